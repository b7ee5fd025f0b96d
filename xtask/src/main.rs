//! `cargo xtask`: the project's automation. CI runs `cargo xtask test` and nothing else, so what
//! passes here passes there. `cargo xtask demo` is the first command of the README.
#![forbid(unsafe_code)]

mod cluster_net;
mod deps;
mod msrv;
mod mutants;
mod python;
mod two_node;

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
    /// Run fmt, clippy and the docs (warnings are errors), install what the tests need
    /// (idempotent), then run the tests and loom, then the `ucx` and `nixl` backend tests.
    Test,
    /// Install what the `ucx` and `nixl` backends need (idempotent) and print the shell env.
    Deps,
    /// The Python package alone: make `.venv` and install the pins (idempotent), clippy of the
    /// extension, ruff, build and install the wheel, run `pytest python/tests`.
    Python,
    /// As root: two agents in two network namespaces joined by a veth pair move 1 GiB each
    /// way over `tcp`, `ucx` and `nixl`, survive a killed target, and clean up.
    TwoNodeTest,
    /// As root: storage units found through etcd across six network namespaces on a bridge,
    /// over `tcp` and `ucx`: a killed unit, a repair, a unit that joins, etcd down for 10 s and
    /// a unit cut off and back; everything removed afterwards.
    ClusterTest,
    /// Run benchmark suites, print their tables and write target/tessera-bench/SUITE.json.
    Bench {
        /// Suites to run (default: all): alloc, codec, transport, pool, storage, hostile (the
        /// harness's), python (the Python package) and integrations (TransferQueue's and Ray's
        /// backends side by side), both in `.venv`, and cluster (units in network namespaces
        /// on shaped links; root).
        suites: Vec<String>,
    },
    /// Mutation testing (cargo-mutants, installed under .deps) of what mutants.toml lists;
    /// writes target/tessera-mutants/summary.json. Not part of `test`: a full run takes about
    /// 70 minutes on two cores.
    Mutants {
        /// Groups of mutants.toml to run (default: all).
        groups: Vec<String>,
        /// Only check the list and count its mutants.
        #[arg(long)]
        list: bool,
        /// Groups run side by side, each lane with a build dir of its own.
        #[arg(long, default_value_t = 2)]
        lanes: usize,
        /// Test only the mutants each group's previous run did not catch (after new tests).
        #[arg(long)]
        iterate: bool,
        /// Run nothing: tally the groups' last results (after an interrupted run).
        #[arg(long)]
        report: bool,
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
        /// Further flags of `tessera-demo run`, passed on as they are: the workload's
        /// (`--steps 1`, `--weight-bytes 268435456`, ...; `tessera-demo run --help` lists them).
        #[arg(
            trailing_var_arg = true,
            allow_hyphen_values = true,
            value_name = "DEMO FLAGS"
        )]
        args: Vec<String>,
    },
}

/// Crates of fuzz targets, outside the workspace (`cargo fuzz run <target>` from their parent).
const FUZZ_CRATES: [&str; 2] = ["framecodec/fuzz", "storage-svc/fuzz"];

/// Crates with loom tests (`--cfg tessera_loom`), run in release in their own target dir.
const LOOM_CRATES: &[&str] = &[
    "tessera-sync",
    "tessera-alloc",
    "tessera-transport",
    "tessera-rdt-pool",
    "tessera-storage",
];

fn main() -> Result<()> {
    let cli = Cli::parse();
    let root = workspace_root();
    std::env::set_current_dir(&root)?;
    match cli.command {
        Cmd::Test => test(&root),
        Cmd::Python => python::test(&root),
        Cmd::Deps => {
            let layout = deps::install(&root)?;
            deps::print_env(&layout);
            Ok(())
        }
        Cmd::TwoNodeTest => two_node::run(&root),
        Cmd::ClusterTest => cluster_net::run(&root),
        Cmd::Bench { suites } => bench(&root, &suites),
        Cmd::Demo {
            backend,
            short,
            args,
        } => demo(&root, &backend, short, &args),
        Cmd::Mutants {
            groups,
            list,
            lanes,
            iterate,
            report,
        } => mutants::run(&root, &groups, list, lanes, iterate, report),
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

/// One row of [`BACKEND_TESTS`]: a package's tests of one feature-gated engine.
struct BackendTests {
    /// The engine; each engine's rows run in their own cargo invocations.
    engine: &'static str,
    /// The package tested.
    package: &'static str,
    /// The package's features that build the engine in.
    features: &'static [&'static str],
    /// Whether the library's unit tests run too (the engine's own crate: its docs and
    /// doctests are checked as well).
    lib: bool,
    /// The integration test targets.
    targets: &'static [&'static str],
    /// A test name filter (empty: all).
    filter: &'static str,
}

/// The feature-gated engines and their test targets, each engine run in its own cargo
/// invocations so that our UCX and NIXL's bundled UCX never load into one process. The
/// default targets already ran in `cargo test` (the default members: all but tessera-ucx and
/// tessera-nixl). Each engine runs the conformance suite in one process and, through the peer
/// binary, across two.
const BACKEND_TESTS: &[BackendTests] = &[
    BackendTests {
        engine: "ucx",
        package: "tessera-ucx",
        features: &["testing"],
        lib: true,
        targets: &["engine", "conformance"],
        filter: "",
    },
    BackendTests {
        engine: "ucx",
        package: "tessera-engines",
        features: &["ucx"],
        lib: false,
        targets: &["ucx_two_process"],
        filter: "",
    },
    BackendTests {
        engine: "ucx",
        package: "tessera-storage-cli",
        features: &["ucx"],
        lib: false,
        targets: &["engines"],
        filter: "",
    },
    BackendTests {
        engine: "ucx",
        package: "tessera-demo",
        features: &["ucx"],
        lib: false,
        targets: &["demo"],
        filter: "over_ucx",
    },
    BackendTests {
        engine: "nixl",
        package: "tessera-nixl",
        features: &["testing"],
        lib: true,
        targets: &["engine", "conformance"],
        filter: "",
    },
    BackendTests {
        engine: "nixl",
        package: "tessera-engines",
        features: &["nixl"],
        lib: false,
        targets: &["nixl_two_process"],
        filter: "",
    },
    BackendTests {
        engine: "nixl",
        package: "tessera-storage-cli",
        features: &["nixl"],
        lib: false,
        targets: &["engines"],
        filter: "",
    },
    BackendTests {
        engine: "nixl",
        package: "tessera-demo",
        features: &["nixl"],
        lib: false,
        targets: &["demo"],
        filter: "over_nixl",
    },
];

/// The `--features` argument naming `features` of each of `rows`' packages.
fn qualified_features(rows: &[&BackendTests]) -> String {
    rows.iter()
        .flat_map(|r| r.features.iter().map(|f| format!("{}/{f}", r.package)))
        .collect::<Vec<_>>()
        .join(",")
}

fn test(root: &Path) -> Result<()> {
    // The offline checks first: a formatting slip fails in seconds, before anything installs.
    // Clippy, docs and tests of the default members (all but tessera-ucx and tessera-nixl,
    // which need the installed libraries and are checked with their engine below).
    step("cargo fmt", cargo(&["fmt", "--all", "--check"]))?;
    println!("==> rust-version of every package (against its dependencies')");
    msrv::check(root)?;
    step(
        "cargo clippy",
        cargo(&[
            "clippy",
            "--all-targets",
            "--locked",
            "--",
            "-D",
            "warnings",
        ]),
    )?;
    let mut doc = cargo(&["doc", "--no-deps", "--locked"]);
    doc.env("RUSTDOCFLAGS", "-D warnings");
    step("cargo doc", doc)?;
    // The fuzz targets are crates of their own (cargo fuzz builds them on nightly features):
    // checked here on stable so that they keep up with the APIs they drive.
    for dir in FUZZ_CRATES {
        let manifest = root.join(dir).join("Cargo.toml");
        let mut check = cargo(&["check", "--locked", "--manifest-path"]);
        check
            .arg(&manifest)
            .env("CARGO_TARGET_DIR", root.join("target").join("fuzz-check"));
        step(&format!("cargo check of the fuzz targets in {dir}"), check)?;
    }
    deps::install(root).context("installing the backends' dependencies (cargo xtask deps)")?;
    step("cargo test", cargo(&["test", "--locked"]))?;
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
    let mut engines: Vec<&str> = BACKEND_TESTS.iter().map(|t| t.engine).collect();
    engines.dedup();
    for engine in engines {
        let rows: Vec<&BackendTests> = BACKEND_TESTS
            .iter()
            .filter(|t| t.engine == engine)
            .collect();
        // One clippy per engine over every package that has it.
        let mut clippy = cargo(&["clippy", "--locked", "--all-targets"]);
        for row in &rows {
            clippy.args(["-p", row.package]);
        }
        // The storage library's own targets too: its engines tests run in its cli crate.
        clippy.args(["-p", "tessera-storage"]);
        let features = qualified_features(&rows) + &format!(",tessera-storage/{engine}");
        clippy.args(["--features", &features]);
        clippy.args(["--", "-D", "warnings"]);
        clippy.envs(deps::TEST_ENV.iter().copied());
        step(&format!("cargo clippy of the {engine} engine"), clippy)?;
        for row in rows.iter().filter(|r| r.lib) {
            // The engine's own crate: its docs and its README's examples too.
            let features = qualified_features(&[row]);
            let mut doc = cargo(&["doc", "--no-deps", "--locked", "-p", row.package]);
            let mut doctest = cargo(&["test", "--locked", "--doc", "-p", row.package]);
            for cmd in [&mut doc, &mut doctest] {
                if !features.is_empty() {
                    cmd.args(["--features", &features]);
                }
                cmd.envs(deps::TEST_ENV.iter().copied());
            }
            doc.env("RUSTDOCFLAGS", "-D warnings");
            step(&format!("cargo doc of {}", row.package), doc)?;
            step(&format!("doctests of {}", row.package), doctest)?;
        }
        for row in rows {
            let mut cmd = cargo(&["test", "--locked", "-p", row.package]);
            let features = qualified_features(&[row]);
            if !features.is_empty() {
                cmd.args(["--features", &features]);
            }
            if row.lib {
                cmd.arg("--lib");
            }
            for target in row.targets {
                cmd.args(["--test", target]);
            }
            if !row.filter.is_empty() {
                cmd.args(["--", row.filter]);
            }
            cmd.envs(deps::TEST_ENV.iter().copied());
            step(&format!("{engine} engine tests of {}", row.package), cmd)?;
        }
    }
    cluster_tests().context("the cluster tests (tessera-cluster and the etcd feature)")?;
    python::test(root).context("the Python package (cargo xtask python)")?;
    if is_root() {
        println!("==> two-node test (root: network namespaces)");
        two_node::run(root).context("cargo xtask two-node-test")?;
        println!("==> cluster test (root: network namespaces)");
        cluster_net::run(root).context("cargo xtask cluster-test")?;
    } else {
        println!(
            "==> two-node and cluster tests NOT run: they need root to create network \
             namespaces (CI runs as root; run `sudo cargo xtask two-node-test` and \
             `sudo cargo xtask cluster-test`)"
        );
    }
    println!("xtask test: all steps passed");
    Ok(())
}

/// The packages and features of clusters through etcd, outside the default build (the etcd
/// client's build needs `protoc`): clippy, docs and tests, against a private etcd that each
/// test starts and stops (Debian's `etcd-server`).
fn cluster_tests() -> Result<()> {
    deps::ensure_apt("protobuf-compiler", "the etcd client's build needs protoc")?;
    deps::ensure_apt("etcd-server", "the cluster tests run a private etcd")?;
    let packages = ["tessera-cluster", "tessera-storage", "tessera-storage-cli"];
    let features = "tessera-storage/etcd,tessera-storage-cli/etcd";
    let mut clippy = cargo(&[
        "clippy",
        "--locked",
        "--all-targets",
        "--features",
        features,
    ]);
    for p in packages {
        clippy.args(["-p", p]);
    }
    clippy.args(["--", "-D", "warnings"]);
    step("cargo clippy of the etcd feature", clippy)?;
    let mut doc = cargo(&["doc", "--no-deps", "--locked", "-p", "tessera-cluster"]);
    doc.env("RUSTDOCFLAGS", "-D warnings");
    step("cargo doc of tessera-cluster", doc)?;
    step(
        "tessera-cluster tests",
        cargo(&["test", "--locked", "-p", "tessera-cluster"]),
    )?;
    for package in ["tessera-storage", "tessera-storage-cli"] {
        step(
            &format!("cluster tests of {package}"),
            cargo(&[
                "test",
                "--locked",
                "-p",
                package,
                "--features",
                "etcd",
                "--test",
                "cluster",
            ]),
        )?;
    }
    Ok(())
}

/// The harness binary knows the suites and rejects unknown names. The `transport` suite
/// also measures the UCX and NIXL backends: their deps are installed and their bandwidth
/// examples built first, in release, one feature at a time (never both in one process). The
/// `storage` suite measures the unit over `ucx` too, so the harness is built with its `ucx`
/// feature whenever that suite runs.
fn bench(root: &Path, suites: &[String]) -> Result<()> {
    let all = suites.is_empty();
    let wants = |name: &str| all || suites.iter().any(|s| s == name);
    let rest: Vec<String> = suites
        .iter()
        .filter(|s| !python::SUITES.contains(&s.as_str()) && s.as_str() != "cluster")
        .cloned()
        .collect();
    if all || !rest.is_empty() {
        harness(root, &rest)?;
    }
    // Namespaces and shaped links: as root only; a run of every suite skips it otherwise.
    if wants("cluster") {
        if is_root() {
            cluster_net::bench(root).context("cargo xtask bench cluster")?;
        } else if all {
            println!("==> the cluster suite NOT run: it needs root to create network namespaces");
        } else {
            bail!("the cluster suite creates network namespaces and must run as root");
        }
    }
    // The Python suites run in the package's environment (`cargo xtask python`'s), after the
    // harness's suites.
    for suite in python::SUITES {
        if wants(suite) {
            python::bench(root, suite)?;
        }
    }
    Ok(())
}

/// The suites of the `tessera-bench` harness (all of them when `suites` is empty).
fn harness(root: &Path, suites: &[String]) -> Result<()> {
    let mut cmd = cargo(&[
        "run",
        "--release",
        "--locked",
        "-p",
        "tessera-bench",
        "--bin",
        "tessera-bench",
    ]);
    if suites.is_empty() || suites.iter().any(|s| s == "storage") {
        // The storage suite measures the unit over ucx too: the harness is built with the
        // feature (UCX only; NIXL never loads into this process) and runs with the test
        // settings of the backends.
        deps::install(root).context("installing the backends' dependencies (cargo xtask deps)")?;
        cmd.args(["--features", "ucx"]);
        for (k, v) in deps::TEST_ENV {
            if std::env::var_os(k).is_none() {
                cmd.env(k, v);
            }
        }
    }
    if suites.is_empty() || suites.iter().any(|s| s == "hostile") {
        // The hostile suite runs the unit as the `tessera-storage` binary, found next to the
        // harness.
        step(
            "building the tessera-storage binary",
            cargo(&[
                "build",
                "--release",
                "--locked",
                "-p",
                "tessera-storage-cli",
                "--bin",
                "tessera-storage",
            ]),
        )?;
    }
    cmd.arg("--");
    cmd.args(suites);
    if suites.is_empty() || suites.iter().any(|s| s == "transport") {
        let layout = deps::install(root)
            .context("installing the backends' dependencies (cargo xtask deps)")?;
        for (package, example) in [
            ("tessera-ucx", "ucx_agent_bw"),
            ("tessera-nixl", "nixl_agent_bw"),
        ] {
            step(
                &format!("building the {example} example"),
                cargo(&[
                    "build",
                    "--release",
                    "--locked",
                    "-p",
                    package,
                    "--example",
                    example,
                ]),
            )?;
        }
        let examples = root.join("target/release/examples");
        let ucx = layout.ucx_dir();
        cmd.env("TESSERA_BENCH_UCX_BW", examples.join("ucx_agent_bw"))
            .env("TESSERA_BENCH_NIXL_BW", examples.join("nixl_agent_bw"))
            .env("TESSERA_BENCH_PERFTEST", ucx.join("bin/ucx_perftest"))
            .env(
                "TESSERA_BENCH_UCX_LIBS",
                format!(
                    "{}:{}",
                    ucx.join("lib").display(),
                    layout.ucx_extra_libs().display()
                ),
            );
    }
    step("benchmarks", cmd)
}

/// Replaces this process with `cargo run --release -p tessera-demo -- run ...`, so that a
/// Ctrl-C reaches the demo alone and its exit status is ours. `ucx` and `nixl` first install
/// their libraries (`cargo xtask deps`), then build the demo with the feature of the same
/// name and run it with the backends' test settings (`UCX_MODULES=^ib`, `UCX_NET_DEVICES=lo`:
/// the demo's processes share this host), each unless already set. The default build needs
/// neither a system library nor a feature; the demo itself refuses any other name.
fn demo(root: &Path, backend: &str, short: bool, args: &[String]) -> Result<()> {
    use std::os::unix::process::CommandExt;
    let feature = matches!(backend, "ucx" | "nixl").then_some(backend);
    if feature.is_some() {
        deps::install(root).context("installing the backends' dependencies (cargo xtask deps)")?;
    }
    let mut cmd = cargo(&["run", "--release", "--locked", "-p", "tessera-demo"]);
    if let Some(feature) = feature {
        cmd.args(["--features", feature]);
        for (k, v) in deps::TEST_ENV {
            if std::env::var_os(k).is_none() {
                cmd.env(k, v);
            }
        }
    }
    cmd.args(["--", "run", "--backend", backend]);
    if short {
        cmd.arg("--short");
    }
    cmd.args(args);
    println!(
        "==> tessera-demo run --backend {backend}{}{}",
        if short { " --short" } else { "" },
        args.iter().map(|a| format!(" {a}")).collect::<String>()
    );
    let err = cmd.exec();
    Err(err).context("starting cargo run -p tessera-demo")
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `cargo xtask demo` passes the flags it does not know to `tessera-demo run`, after its own.
    #[test]
    fn demo_passes_workload_flags_on() {
        let cli = Cli::try_parse_from([
            "xtask",
            "demo",
            "--backend",
            "tcp",
            "--steps",
            "1",
            "--weight-bytes",
            "1048576",
        ])
        .unwrap();
        let Cmd::Demo {
            backend,
            short,
            args,
        } = cli.command
        else {
            panic!("not the demo");
        };
        assert_eq!((backend.as_str(), short), ("tcp", false));
        assert_eq!(args, ["--steps", "1", "--weight-bytes", "1048576"]);
        let cli = Cli::try_parse_from(["xtask", "demo", "--short"]).unwrap();
        assert!(matches!(cli.command, Cmd::Demo { short: true, ref args, .. } if args.is_empty()));
    }
}
