//! Gives the `tessera-storage` binary (and this package's tests) the rpath that
//! tessera-transport's build script sets for its own when its `ucx` or `nixl` feature is on,
//! so they find the libraries that `cargo xtask deps` installed without `LD_LIBRARY_PATH`.
//! Does nothing otherwise.

fn main() {
    for var in [
        "DEP_TESSERA_TRANSPORT_UCX_RPATH",
        "DEP_TESSERA_TRANSPORT_NIXL_RPATH",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
        if let Ok(dir) = std::env::var(var) {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        }
    }
}
