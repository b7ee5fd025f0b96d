//! Gives the `tessera-storage` binary and this package's tests the rpath of the engines built in
//! (tessera-rpath).

fn main() {
    tessera_rpath::forward();
}
