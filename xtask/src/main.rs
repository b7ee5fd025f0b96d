//! `cargo xtask`: the project's automation. CI runs `cargo xtask test` and nothing else, so what
//! passes here passes there. `cargo xtask demo` is the first command of the README.

mod deps;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "Tessera project automation")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what the tests need (idempotent), then run fmt, clippy, the tests and loom,
    /// then the `ucx` and `nixl` backend tests.
    Test,
    /// Install what the `ucx` and `nixl` backends need (idempotent) and print the shell env.
    Deps,
    /// Run benchmark suites, print their tables and write target/tessera-bench/<suite>.json.
    Bench {
        /// Suites to run (default: all).
        suites: Vec<String>,
    },
    /// Run the end-to-end demo in release: a storage unit, a producer and a consumer as
    /// separate processes, RL rollouts then a weight sync, every byte checked.
    Demo {
        /// Payload engine: shm (default, one host, no system library), tcp, ucx or nixl.
        #[arg(long, default_value = "shm")]
        backend: String,
        /// A few steps and a small weight set: a few seconds.
        #[arg(long)]
        short: bool,
    },
}

/// Crates with loom tests (`--cfg tessera_loom`), run in release in their own target dir.
const LOOM_CRATES: &[&str] = &["tessera-alloc", "tessera-transport", "tessera-rdt-pool"];

fn main() -> Result<()> {
    let cli = Cli::parse();
    let root = workspace_root();
    std::env::set_current_dir(&root)?;
    match cli.command {
        Cmd::Test => test(&root),
        Cmd::Deps => {
            let layout = deps::install(&root)?;
            deps::print_env(&layout);
            Ok(())
        }
        Cmd::Bench { suites } => bench(&suites),
        Cmd::Demo { backend, short } => demo(&backend, short),
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

/// The feature-gated engines, each tested in its own cargo invocation so that our UCX and
/// NIXL's bundled UCX never load into one process.
const BACKEND_FEATURES: &[&str] = &["ucx", "nixl"];

fn test(root: &Path) -> Result<()> {
    deps::install(root).context("installing the backends' dependencies (cargo xtask deps)")?;
    step("cargo fmt", cargo(&["fmt", "--all", "--check"]))?;
    step(
        "cargo clippy",
        cargo(&[
            "clippy",
            "--workspace",
            "--all-targets",
            "--locked",
            "--",
            "-D",
            "warnings",
        ]),
    )?;
    step("cargo test", cargo(&["test", "--workspace", "--locked"]))?;
    let loom_dir = root.join("target-loom");
    for krate in LOOM_CRATES {
        let mut cmd = cargo(&[
            "test",
            "--release",
            "--locked",
            "-p",
            krate,
            "--lib",
            "loom",
        ]);
        cmd.env("RUSTFLAGS", "--cfg tessera_loom")
            .env("LOOM_MAX_PREEMPTIONS", "2")
            .env("CARGO_TARGET_DIR", &loom_dir);
        step(&format!("loom tests of {krate}"), cmd)?;
    }
    for feature in BACKEND_FEATURES {
        let clippy = cargo(&[
            "clippy",
            "--locked",
            "-p",
            "tessera-transport",
            "--all-targets",
            "--features",
            feature,
            "--",
            "-D",
            "warnings",
        ]);
        step(&format!("cargo clippy --features {feature}"), clippy)?;
        let mut cmd = cargo(&[
            "test",
            "--locked",
            "-p",
            "tessera-transport",
            "--features",
            feature,
        ]);
        cmd.envs(deps::TEST_ENV.iter().copied());
        step(&format!("{feature} backend tests"), cmd)?;
    }
    println!("xtask test: all steps passed");
    Ok(())
}

/// The harness binary knows the suites and rejects unknown names.
fn bench(suites: &[String]) -> Result<()> {
    let mut cmd = cargo(&[
        "run",
        "--release",
        "--locked",
        "-p",
        "tessera-bench",
        "--bin",
        "tessera-bench",
        "--",
    ]);
    cmd.args(suites);
    step("benchmarks", cmd)
}

/// Replaces this process with `cargo run --release -p tessera-demo -- run ...`, so that a
/// Ctrl-C reaches the demo alone and its exit status is ours. The demo itself refuses a
/// backend the storage crate does not offer, before starting anything.
fn demo(backend: &str, short: bool) -> Result<()> {
    use std::os::unix::process::CommandExt;
    let mut cmd = cargo(&[
        "run",
        "--release",
        "--locked",
        "-p",
        "tessera-demo",
        "--",
        "run",
        "--backend",
        backend,
    ]);
    if short {
        cmd.arg("--short");
    }
    println!(
        "==> tessera-demo run --backend {backend}{}",
        if short { " --short" } else { "" }
    );
    let err = cmd.exec();
    Err(err).context("starting cargo run -p tessera-demo")
}

fn cargo(args: &[&str]) -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.args(args);
    cmd
}

fn step(name: &str, mut cmd: Command) -> Result<()> {
    println!("==> {name}");
    let status = cmd.status().with_context(|| format!("starting {name}"))?;
    if !status.success() {
        bail!("{name} failed ({status})");
    }
    Ok(())
}
