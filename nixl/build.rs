//! Build script: nixl-sys loads `libnixl_capi.so` lazily; this only gives binaries an rpath to
//! its directory.
//!
//! It looks in `<workspace>/.deps/nixl/.nixl_cu12.mesonpy.libs` (installed by
//! `cargo xtask deps`) unless `TESSERA_NIXL_LIB_DIR` names another directory.
//!
//! The directory goes out through tessera-rpath: this package's binaries get an rpath to it,
//! and dependents read it as `DEP_TESSERA_NIXL_RPATH` to give theirs the same.

use std::env;
use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=TESSERA_NIXL_LIB_DIR");
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let root = manifest.parent().unwrap_or(&manifest).to_path_buf();
    nixl(&root);
}

fn dir_from_env(var: &str, default: PathBuf) -> PathBuf {
    env::var_os(var).map(PathBuf::from).unwrap_or(default)
}

fn missing(what: &str, path: &Path, var: &str) -> ! {
    panic!(
        "\n\n{what} not found at {}.\nRun `cargo xtask deps` in the workspace root to install it \
         into .deps/, or point {var} at an existing installation.\n\n",
        path.display()
    );
}

fn nixl(root: &Path) {
    let dir = dir_from_env(
        "TESSERA_NIXL_LIB_DIR",
        root.join(".deps/nixl/.nixl_cu12.mesonpy.libs"),
    );
    if !dir.join("libnixl_capi.so").exists() {
        missing(
            "NIXL (libnixl_capi.so)",
            &dir.join("libnixl_capi.so"),
            "TESSERA_NIXL_LIB_DIR",
        );
    }
    tessera_rpath::export("rpath", &dir);
}
