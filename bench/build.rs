//! Gives this package's binaries and tests the rpath of the engines built in (tessera-rpath).

fn main() {
    tessera_rpath::forward();
}
