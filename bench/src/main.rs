//! `tessera-bench [SUITE...]`: runs the suites, prints their tables and writes
//! `target/tessera-bench/<suite>.json`. `cargo xtask bench` is the usual way in.

use std::path::PathBuf;

use anyhow::{bail, Result};
use tessera_bench::{Report, SUITES};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    for name in &args {
        if !SUITES.iter().any(|(n, _)| n == name) {
            let known: Vec<&str> = SUITES.iter().map(|(n, _)| *n).collect();
            bail!("unknown suite {name:?}; known: {}", known.join(", "));
        }
    }
    let out_dir = std::env::var_os("TESSERA_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/tessera-bench")
        });
    for (name, run) in SUITES {
        if !args.is_empty() && !args.iter().any(|a| a == name) {
            continue;
        }
        eprintln!("running suite {name}...");
        let mut report = Report::new(name);
        run(&mut report)?;
        println!("{}", report.table());
        let path = report.write_json(&out_dir)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
