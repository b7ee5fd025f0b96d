//! Build script: nixl-sys loads `libnixl_capi.so` lazily; this only gives binaries an rpath to
//! its directory.
//!
//! It looks in `<workspace>/.deps/nixl/.nixl_cu12.mesonpy.libs` (installed by
//! `cargo xtask deps`) unless `TESSERA_NIXL_LIB_DIR` names another directory.
//!
//! The directory goes out through tessera-rpath: this package's binaries get an rpath to it,
//! and dependents read it as `DEP_TESSERA_NIXL_RPATH` to give theirs the same.

use tessera_rpath::{install_dir, missing};

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    nixl();
}

fn nixl() {
    let dir = install_dir("TESSERA_NIXL_LIB_DIR", ".deps/nixl/.nixl_cu12.mesonpy.libs");
    if !dir.join("libnixl_capi.so").exists() {
        missing(
            "NIXL (libnixl_capi.so)",
            &dir.join("libnixl_capi.so"),
            "TESSERA_NIXL_LIB_DIR",
        );
    }
    tessera_rpath::export("rpath", &dir);
}
