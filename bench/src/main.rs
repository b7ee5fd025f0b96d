//! `tessera-bench [SUITE...]`: runs the suites, prints their tables, writes
//! `target/tessera-bench/<suite>.json` and the plots, and rebuilds `report.md` from every suite
//! measured so far. `cargo xtask bench` is the usual way in.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use tessera_bench::{plot, Report, SUITES};

/// mimalloc: glibc's allocator gives back the top of its heap as soon as more than 128 KiB
/// of it is free, so a request that allocates and frees more (the descriptors and values of a
/// batch of a thousand tensors) faulted its pages in again each time.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
        for png in plot::draw_all(name, report.all_series(), &out_dir)? {
            println!("wrote {} (and .svg)", png.display());
        }
    }
    let summary = write_summary(&out_dir)?;
    println!("wrote {}", summary.display());
    Ok(())
}

/// `report.md`: the machine, then each suite's latest table and plots, in suite order.
fn write_summary(dir: &Path) -> Result<PathBuf> {
    let mut out = String::from("# Tessera benchmark report\n\n");
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    writeln!(
        out,
        "Machine: {cpu}, {cores} cores. Every ratio is taken against a reference measured in \
         the same run; absolute numbers on a shared machine are noisy.\n"
    )?;
    for (name, _) in SUITES {
        let table = dir.join(format!("{name}.md"));
        let Ok(text) = std::fs::read_to_string(&table) else {
            writeln!(
                out,
                "### {name}\n\nNot measured yet: `cargo xtask bench {name}`.\n"
            )?;
            continue;
        };
        out.push_str(&text);
        out.push('\n');
        let mut pngs: Vec<_> = std::fs::read_dir(dir)?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|f| f.starts_with(&format!("{name}-")) && f.ends_with(".png"))
            .collect();
        pngs.sort();
        for png in pngs {
            writeln!(out, "![{png}]({png})\n")?;
        }
    }
    let path = dir.join("report.md");
    std::fs::write(&path, out).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}
