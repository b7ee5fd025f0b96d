//! placeholder
pub fn run(_r: &mut crate::Report) -> anyhow::Result<()> {
    Ok(())
}
