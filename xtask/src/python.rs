//! The Python package: its environment, wheel and tests (`cargo xtask python`, and a step of
//! `cargo xtask test`).
//!
//! - `.venv/`: a virtual environment of this project, made once with `python3 -m venv`;
//! - `python/requirements-dev.txt` installed into it by `uv` (pinned, installed once under
//!   `.deps/uv`), whose cache `.deps/uv-cache` holds every package unpacked and hard-links it
//!   into `.venv`: torch's 5 GB are on disk once, a second environment costs no download, and a
//!   stamp in `.venv` records what was installed, so a second run installs nothing;
//! - clippy of the extension crate, `ruff` over `python/`, the wheel built by maturin (the dev
//!   profile; release for `cargo xtask bench python`) and installed into `.venv`, then
//!   `pytest python/tests`, then TransferQueue's own e2e tests against the `Tessera` backend
//!   (`tessera.integrations.transfer_queue.pytest_plugin`). The tests' Ray clusters write under
//!   a directory of the run (`RAY_TMPDIR`), removed afterwards.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{anyhow, Context, Result};

use crate::{cargo, step};

/// The pinned development requirements.
const REQUIREMENTS: &str = "python/requirements-dev.txt";
/// In `.venv`: the requirements text last installed.
const STAMP: &str = ".tessera-requirements";
/// The installer of the environment, from PyPI.
const UV: &str = "uv==0.13.9";

/// `uv`, installed under `.deps/uv` on first use (again when [`UV`] changes).
fn uv(root: &Path) -> Result<PathBuf> {
    let dir = root.join(".deps/uv");
    let bin = dir.join("bin/uv");
    let marker = dir.join(".tessera-version");
    if bin.exists() && fs::read_to_string(&marker).is_ok_and(|m| m == UV) {
        return Ok(bin);
    }
    if dir.exists() {
        fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    let mut cmd = Command::new("python3");
    cmd.args(["-m", "pip", "install", "--disable-pip-version-check"])
        .args(["--quiet", "--no-cache-dir", "--target"])
        .arg(&dir)
        .arg(UV);
    step(&format!("pip install {UV} into .deps/uv"), cmd)?;
    fs::write(&marker, UV).with_context(|| format!("writing {}", marker.display()))?;
    Ok(bin)
}

/// `uv pip install` into the environment of `python`: through the project's cache, or
/// (`cached` false, for the wheel each run builds anew) copied from a cache of this command.
fn uv_install(root: &Path, python: &Path, cached: bool) -> Result<Command> {
    let mut cmd = Command::new(uv(root)?);
    cmd.args(["pip", "install", "--quiet", "--python"])
        .arg(python);
    if cached {
        cmd.arg("--cache-dir")
            .arg(root.join(".deps/uv-cache"))
            .args(["--link-mode", "hardlink"]);
    } else {
        cmd.args(["--no-cache", "--link-mode", "copy"]);
    }
    Ok(cmd)
}

/// The environment's interpreter, after making the environment and installing the pins.
pub(crate) fn env(root: &Path) -> Result<PathBuf> {
    let venv = root.join(".venv");
    let python = venv.join("bin/python");
    if !python.exists() {
        let mut cmd = Command::new("python3");
        cmd.args(["-m", "venv"]).arg(&venv);
        step("python3 -m venv .venv", cmd)?;
    }
    let req_path = root.join(REQUIREMENTS);
    let req =
        fs::read_to_string(&req_path).with_context(|| format!("reading {}", req_path.display()))?;
    let stamp = venv.join(STAMP);
    if fs::read_to_string(&stamp).ok().as_deref() == Some(req.as_str()) {
        return Ok(python);
    }
    // The wheel cache of the pip-based layout, superseded by uv's.
    let old = root.join(".deps/pywheels");
    if old.exists() {
        fs::remove_dir_all(&old).with_context(|| format!("removing {}", old.display()))?;
    }
    let mut install = uv_install(root, &python, true)?;
    install.arg("-r").arg(&req_path);
    step(
        &format!("installing {REQUIREMENTS} into .venv (the first time: torch, about 3.3 GB)"),
        install,
    )?;
    fs::write(&stamp, &req).with_context(|| format!("writing {}", stamp.display()))?;
    Ok(python)
}

/// Builds the wheel into `target/wheels` and installs it into the environment: in the dev
/// profile for the tests (it reuses what `cargo test` built), in release for the benchmarks.
pub(crate) fn install_wheel(root: &Path, python: &Path, release: bool) -> Result<PathBuf> {
    let out = root.join("target/wheels");
    // One wheel of ours in the directory: the one this build makes.
    if let Ok(entries) = fs::read_dir(&out) {
        for e in entries.flatten() {
            if is_our_wheel(&e.path()) {
                fs::remove_file(e.path())
                    .with_context(|| format!("removing {}", e.path().display()))?;
            }
        }
    }
    let mut build = Command::new(root.join(".venv/bin/maturin"));
    build.args(["build", "--locked", "--quiet"]);
    if release {
        build.arg("--release");
    }
    build
        .arg("--manifest-path")
        .arg(root.join("python/Cargo.toml"))
        .arg("--out")
        .arg(&out)
        .arg("--interpreter")
        .arg(python);
    step("maturin build (the tessera-transfer wheel)", build)?;
    let wheel = fs::read_dir(&out)
        .with_context(|| format!("reading {}", out.display()))?
        .flatten()
        .map(|e| e.path())
        .find(|p| is_our_wheel(p))
        .with_context(|| {
            format!(
                "maturin left no tessera_transfer wheel in {}",
                out.display()
            )
        })?;
    let mut install = uv_install(root, python, false)?;
    install.args(["--no-deps", "--reinstall"]).arg(&wheel);
    step("installing the wheel into .venv", install)?;
    Ok(wheel)
}

fn is_our_wheel(p: &Path) -> bool {
    p.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("tessera_transfer-") && n.ends_with(".whl"))
}

/// Everything `cargo xtask test` runs for the Python package.
pub(crate) fn test(root: &Path) -> Result<()> {
    let python = env(root)?;
    let mut clippy = cargo(&[
        "clippy",
        "--locked",
        "--all-targets",
        "-p",
        "tessera-python",
        "--",
        "-D",
        "warnings",
    ]);
    clippy
        .env("PYO3_PYTHON", &python)
        .env("PYO3_BUILD_EXTENSION_MODULE", "1");
    step("cargo clippy of the Python extension", clippy)?;
    let ruff = root.join(".venv/bin/ruff");
    let mut check = Command::new(&ruff);
    check.args(["check", "--quiet"]).arg(root.join("python"));
    step("ruff check python/", check)?;
    let mut format = Command::new(&ruff);
    format
        .args(["format", "--check", "--quiet"])
        .arg(root.join("python"));
    step("ruff format --check python/", format)?;
    install_wheel(root, &python, false)?;
    let mut pytest = Command::new(&python);
    pytest
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(root.join("python/tests"))
        .env("TESSERA_REQUIRE_TORCH", "1")
        .current_dir(root);
    let ray_dir = ray_tmpdir()?;
    pytest.env("RAY_TMPDIR", &ray_dir);
    let status = pytest.status().context("running pytest")?;
    let e2e = if status.success() {
        transfer_queue_e2e(&python, &ray_dir)
    } else {
        Err(anyhow!("pytest python/tests failed ({status})"))
    };
    // What the Ray clusters of the tests left (their logs and sockets), on failure too.
    let _ = fs::remove_dir_all(&ray_dir);
    e2e
}

/// Where the tests' Ray clusters write (`RAY_TMPDIR`) instead of the machine's `/tmp/ray`:
/// a directory of this run, removed afterwards. Under `/tmp`, not the checkout: Ray's Unix
/// sockets live below it, and their paths must stay under 108 bytes.
fn ray_tmpdir() -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("tessera-ray-{}", std::process::id()));
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// TransferQueue's own end-to-end tests, as its wheel installs them (a top-level `tests`
/// package), against the `Tessera` backend: the plugin adds it to their `BACKEND_CONFIGS`.
fn transfer_queue_e2e(python: &Path, ray_dir: &Path) -> Result<()> {
    let out = Command::new(python)
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ])
        .output()
        .context("asking .venv for its site-packages")?;
    let site = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let e2e = site.join("tests/e2e");
    let mut cmd = Command::new(python);
    cmd.args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .args(["-p", "tessera.integrations.transfer_queue.pytest_plugin"])
        .arg(e2e.join("test_e2e_lifecycle_consistency.py"))
        .arg(e2e.join("test_kv_interface_e2e.py"))
        .env("TQ_TEST_BACKEND", "Tessera")
        .env("RAY_TMPDIR", ray_dir)
        .current_dir(&e2e);
    step(
        "TransferQueue's e2e tests with TQ_TEST_BACKEND=Tessera",
        cmd,
    )
}

/// The benchmark suites that run in the package's environment, each a script
/// `python/bench/bench_SUITE.py` writing `target/tessera-bench/SUITE.{json,md}`: `python` (the
/// package beside the Rust client) and `integrations` (TransferQueue's and Ray's backends side
/// by side).
pub(crate) const SUITES: [&str; 2] = ["python", "integrations"];

/// `cargo xtask bench SUITE` for one of [`SUITES`], with the release wheel.
pub(crate) fn bench(root: &Path, suite: &str) -> Result<()> {
    let python = env(root)?;
    if suite == "integrations" {
        // MooncakeStore's master, one of the peers measured, links libibverbs (it runs
        // without an RDMA device).
        crate::deps::ensure_apt("libibverbs1", "MooncakeStore's master links it")?;
    }
    install_wheel(root, &python, true)?;
    let ray_dir = ray_tmpdir()?;
    let mut cmd = Command::new(&python);
    cmd.arg(root.join(format!("python/bench/bench_{suite}.py")))
        .arg(root.join("target/tessera-bench"))
        .env("RAY_TMPDIR", &ray_dir)
        .current_dir(root);
    let out = step(&format!("the {suite} suite"), cmd);
    let _ = fs::remove_dir_all(&ray_dir);
    out
}
