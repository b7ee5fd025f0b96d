//! Gives the peer binary and the tests the rpath of the engines built in (see tessera-rpath).

fn main() {
    tessera_rpath::forward();
}
