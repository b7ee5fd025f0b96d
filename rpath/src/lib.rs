#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

use std::path::Path;

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
