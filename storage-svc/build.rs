//! Gives this package's tests (the library's own, which start ucx and nixl agents under those
//! features) the rpath of the engines built in (tessera-rpath). The binary's crate, `cli/`, has
//! its own.

fn main() {
    tessera_rpath::forward();
}
