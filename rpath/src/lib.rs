//! The rpath hand-off between the engine crates that link a system library and the packages
//! whose binaries use them, for build scripts only.
//!
//! An rpath that a build script sets reaches its own package's binaries only. So an engine
//! crate's build script calls [`export`] with the directory of its library: its own binaries
//! get the rpath, and the directory goes out as `links` metadata. Every package depending on
//! an engine crate, directly and with the feature that pulls it in, calls [`forward`] from its
//! build script, so that its binaries and tests find the libraries that `cargo xtask deps`
//! installed without `LD_LIBRARY_PATH`. This crate never links, loads or looks for a library
//! itself, and does nothing at run time.
//!
//! The whole build script of such a dependent (`build.rs`, with tessera-rpath as its
//! build-dependency) is one call:
//!
//! ```no_run
//! tessera_rpath::forward();
//! ```

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
