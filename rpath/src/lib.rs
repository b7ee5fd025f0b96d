#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

use std::path::{Path, PathBuf};

/// The `links` metadata each engine crate exports, as its dependents' build scripts see it.
pub const EXPORTED: &[&str] = &["DEP_TESSERA_UCX_RPATH", "DEP_TESSERA_NIXL_RPATH"];

/// In an engine crate's build script: gives its own binaries an rpath to `dir` and exports
/// `dir` as the `links` metadata `key` (read by dependents as `DEP_<LINKS>_<KEY>`).
pub fn export(key: &str, dir: &Path) {
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
    println!("cargo:{key}={}", dir.display());
}

/// In a dependent's build script: gives this package's binaries the rpath of every engine
/// crate it depends on with its library; does nothing for the others.
pub fn forward() {
    for var in EXPORTED {
        println!("cargo:rerun-if-env-changed={var}");
        if let Ok(dir) = std::env::var(var) {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        }
    }
}

/// In an engine crate's build script: where `cargo xtask deps` installed its library,
/// `<workspace>/under`, unless the environment variable `var` names another directory (the
/// build script reruns when `var` changes).
pub fn install_dir(var: &str, under: &str) -> PathBuf {
    println!("cargo:rerun-if-env-changed={var}");
    if let Some(dir) = std::env::var_os(var) {
        return PathBuf::from(dir);
    }
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    manifest.parent().unwrap_or(&manifest).join(under)
}

/// In an engine crate's build script: stops the build, saying that `what` is not at `path` and
/// how to install it (or where `var` would point).
pub fn missing(what: &str, path: &Path, var: &str) -> ! {
    panic!(
        "\n\n{what} not found at {}.\nRun `cargo xtask deps` in the workspace root to install it \
         into .deps/, or point {var} at an existing installation.\n\n",
        path.display()
    );
}
