//! Build script: generates UCP bindings with bindgen from the UCX headers and links `libucp`
//! and `libucs`.
//!
//! It looks in `<workspace>/.deps/ucx/libucx` (installed by `cargo xtask deps`) unless
//! `TESSERA_UCX_DIR` names the directory holding `include/` and `lib/`.
//!
//! The library directory goes out through tessera-rpath: this package's binaries get an rpath
//! to it, and dependents read it as `DEP_TESSERA_UCX_RPATH` to give theirs the same.

use std::env;
use std::path::PathBuf;

use tessera_rpath::{install_dir, missing};

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    ucx();
}

fn ucx() {
    let dir = install_dir("TESSERA_UCX_DIR", ".deps/ucx/libucx");
    let include = dir.join("include");
    let lib = dir.join("lib");
    let header = include.join("ucp/api/ucp.h");
    if !header.is_file() {
        missing("UCX (ucp/api/ucp.h)", &header, "TESSERA_UCX_DIR");
    }
    if !lib.join("libucp.so").exists() {
        missing("UCX (libucp.so)", &lib.join("libucp.so"), "TESSERA_UCX_DIR");
    }
    println!("cargo:rerun-if-changed={}", header.display());
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=ucp");
    println!("cargo:rustc-link-lib=dylib=ucs");
    tessera_rpath::export("rpath", &lib);

    let bindings = bindgen::Builder::default()
        .header_contents("tessera_ucx.h", "#include <ucp/api/ucp.h>\n")
        .clang_arg(format!("-I{}", include.display()))
        .allowlist_function("ucp_.*")
        .allowlist_function("ucs_status_string")
        .allowlist_type("ucp_.*")
        .allowlist_type("ucs_status_t")
        .allowlist_var("UCP_.*")
        .allowlist_var("UCS_.*")
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .layout_tests(false)
        .derive_default(true)
        .generate_comments(false)
        .generate()
        .unwrap_or_else(|e| panic!("bindgen failed on {}: {e}", header.display()));
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("set by cargo")).join("ucp_sys.rs");
    bindings
        .write_to_file(&out)
        .unwrap_or_else(|e| panic!("writing {}: {e}", out.display()));
}
