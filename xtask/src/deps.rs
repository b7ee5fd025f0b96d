//! `cargo xtask deps`: installs what the `ucx` and `nixl` backends need, idempotently.
//!
//! - `libclang-dev` through apt-get, only when dpkg says it is missing (bindgen needs it, and
//!   so does nixl-sys's build script);
//! - the PyPI wheels `libucx-cu12` and `nixl-cu12` (exact versions, no dependencies) into
//!   `.deps/whl`, only when not downloaded yet;
//! - each wheel extracted into `.deps/ucx` and `.deps/nixl`, only when the marker file naming
//!   that wheel is missing.
//!
//! The default build needs none of this; only tessera-ucx and tessera-nixl do (built with `-p`,
//! `--workspace`, or the `ucx` / `nixl` features of the crates that pull them in).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

/// A wheel: its PyPI name, exact version, file-name prefix and extraction directory.
struct Wheel {
    package: &'static str,
    version: &'static str,
    file_prefix: &'static str,
    dir: &'static str,
}

const WHEELS: &[Wheel] = &[
    Wheel {
        package: "libucx-cu12",
        version: "1.22.0",
        file_prefix: "libucx_cu12-1.22.0-",
        dir: "ucx",
    },
    Wheel {
        package: "nixl-cu12",
        version: "1.5.1",
        file_prefix: "nixl_cu12-1.5.1-",
        dir: "nixl",
    },
];

/// Records which wheel a directory was extracted from.
const MARKER: &str = ".tessera-extracted";

/// Where things land under `<root>/.deps`.
pub(crate) struct Layout {
    deps: PathBuf,
}

impl Layout {
    pub(crate) fn new(root: &Path) -> Self {
        Self {
            deps: root.join(".deps"),
        }
    }

    /// Holds UCX's `include/`, `lib/` and `bin/` (what `TESSERA_UCX_DIR` names).
    pub(crate) fn ucx_dir(&self) -> PathBuf {
        self.deps.join("ucx/libucx")
    }

    /// Holds `libnixl_capi.so` (what `TESSERA_NIXL_LIB_DIR` names).
    pub(crate) fn nixl_lib_dir(&self) -> PathBuf {
        self.deps.join("nixl/.nixl_cu12.mesonpy.libs")
    }

    /// Helper libraries the UCX tools need besides UCX's own (libgomp).
    pub(crate) fn ucx_extra_libs(&self) -> PathBuf {
        self.deps.join("ucx/libucx_cu12.libs")
    }
}

/// Settings the backends' tests run with (see `shared/reference/dependencies.md`):
/// without `UCX_MODULES=^ib` a module of the wheel's UCX can crash at process exit, and
/// `UCX_NET_DEVICES=lo` keeps tcp traffic on loopback.
pub(crate) const TEST_ENV: &[(&str, &str)] = &[("UCX_MODULES", "^ib"), ("UCX_NET_DEVICES", "lo")];

/// Installs whatever is missing; prints what it does, and does nothing when all is there.
pub(crate) fn install(root: &Path) -> Result<Layout> {
    let layout = Layout::new(root);
    ensure_libclang()?;
    let whl = layout.deps.join("whl");
    fs::create_dir_all(&whl).with_context(|| format!("creating {}", whl.display()))?;
    for wheel in WHEELS {
        let file = ensure_wheel(&whl, wheel)?;
        ensure_extracted(&layout.deps.join(wheel.dir), &file)?;
    }
    make_executable(&layout.ucx_dir().join("bin"))?;
    for (what, path) in [
        ("UCX header", layout.ucx_dir().join("include/ucp/api/ucp.h")),
        ("NIXL C API", layout.nixl_lib_dir().join("libnixl_capi.so")),
    ] {
        if !path.exists() {
            bail!("{what} missing after installation: {}", path.display());
        }
    }
    Ok(layout)
}

/// Prints the environment a shell needs to use the installed tools by hand.
pub(crate) fn print_env(layout: &Layout) {
    let ucx = layout.ucx_dir();
    println!(
        "# Tessera backends: installed under {}",
        layout.deps.display()
    );
    println!("# cargo builds find these by default; a shell running the UCX tools needs:");
    println!("export TESSERA_UCX_DIR={}", ucx.display());
    println!(
        "export TESSERA_NIXL_LIB_DIR={}",
        layout.nixl_lib_dir().display()
    );
    println!("export PATH={}:$PATH", ucx.join("bin").display());
    println!(
        "export LD_LIBRARY_PATH={}:{}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}",
        ucx.join("lib").display(),
        layout.ucx_extra_libs().display()
    );
    for (k, v) in TEST_ENV {
        println!("export {k}='{v}'");
    }
}

fn ensure_libclang() -> Result<()> {
    ensure_apt("libclang-dev", "bindgen needs it")
}

/// Installs the Debian package `package` with apt-get, only when dpkg says it is missing.
pub(crate) fn ensure_apt(package: &str, why: &str) -> Result<()> {
    let installed = Command::new("dpkg")
        .args(["-s", package])
        .output()
        .map(|o| {
            o.status.success()
                && String::from_utf8_lossy(&o.stdout).contains("Status: install ok installed")
        })
        .unwrap_or(false);
    if installed {
        return Ok(());
    }
    println!("==> deps: installing {package} ({why})");
    for args in [&["update", "-q"][..], &["install", "-y", "-q", package][..]] {
        let status = Command::new("apt-get")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .with_context(|| format!("running apt-get ({package}: {why})"))?;
        if !status.success() {
            bail!(
                "apt-get {} failed ({status}); install {package} by hand",
                args.join(" ")
            );
        }
    }
    Ok(())
}

fn find_wheel(whl: &Path, wheel: &Wheel) -> Result<Option<PathBuf>> {
    for entry in fs::read_dir(whl).with_context(|| format!("reading {}", whl.display()))? {
        let path = entry?.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if name.starts_with(wheel.file_prefix) && name.ends_with(".whl") {
            return Ok(Some(path));
        }
    }
    Ok(None)
}

fn python() -> &'static str {
    let works = |p: &str| {
        Command::new(p)
            .args(["-m", "pip", "--version"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
    };
    if works("python3") {
        "python3"
    } else {
        "python"
    }
}

fn ensure_wheel(whl: &Path, wheel: &Wheel) -> Result<PathBuf> {
    if let Some(found) = find_wheel(whl, wheel)? {
        return Ok(found);
    }
    println!("==> deps: downloading {}=={}", wheel.package, wheel.version);
    let status = Command::new(python())
        .args([
            "-m",
            "pip",
            "download",
            "-q",
            "--no-cache-dir",
            "--no-deps",
            "--only-binary=:all:",
        ])
        .args([
            "--python-version",
            "3.11",
            "--platform",
            "manylinux_2_28_x86_64",
        ])
        .arg(format!("{}=={}", wheel.package, wheel.version))
        .arg("-d")
        .arg(whl)
        .status()
        .context("running pip download (python3 with pip is needed)")?;
    if !status.success() {
        bail!(
            "pip download of {}=={} failed ({status})",
            wheel.package,
            wheel.version
        );
    }
    find_wheel(whl, wheel)?.with_context(|| {
        format!(
            "pip download of {}=={} left no {}*.whl in {}",
            wheel.package,
            wheel.version,
            wheel.file_prefix,
            whl.display()
        )
    })
}

fn ensure_extracted(dir: &Path, wheel: &Path) -> Result<()> {
    let name = wheel
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default()
        .to_owned();
    let marker = dir.join(MARKER);
    if fs::read_to_string(&marker).is_ok_and(|m| m.trim() == name) {
        return Ok(());
    }
    println!("==> deps: extracting {name} into {}", dir.display());
    if dir.symlink_metadata().is_ok() {
        if dir.is_dir() && !dir.is_symlink() {
            fs::remove_dir_all(dir)
        } else {
            fs::remove_file(dir)
        }
        .with_context(|| format!("removing the stale {}", dir.display()))?;
    }
    // Extract next to the target and rename, so an interrupted run never leaves a directory
    // that looks complete.
    let partial = dir.with_extension("partial");
    if partial.exists() {
        fs::remove_dir_all(&partial)?;
    }
    let status = Command::new(python())
        .args(["-m", "zipfile", "-e"])
        .arg(wheel)
        .arg(&partial)
        .status()
        .context("running python's zipfile")?;
    if !status.success() {
        bail!("extracting {} failed ({status})", wheel.display());
    }
    fs::write(partial.join(MARKER), format!("{name}\n"))?;
    fs::rename(&partial, dir)
        .with_context(|| format!("moving {} to {}", partial.display(), dir.display()))?;
    Ok(())
}

/// Python's zipfile drops the exec bits: restore them on the UCX tools.
fn make_executable(bin: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let Ok(entries) = fs::read_dir(bin) else {
        return Ok(());
    };
    for entry in entries {
        let path = entry?.path();
        if path.is_file() {
            let mut perm = fs::metadata(&path)?.permissions();
            if perm.mode() & 0o111 != 0o111 {
                perm.set_mode(perm.mode() | 0o755);
                fs::set_permissions(&path, perm)
                    .with_context(|| format!("chmod +x {}", path.display()))?;
            }
        }
    }
    Ok(())
}
