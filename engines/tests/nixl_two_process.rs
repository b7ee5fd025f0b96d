//! The `nixl` backend between this process and a real second one: NIXL's UCX backend with
//! its default transports (`tcp,cma` with peer error handling; `cargo xtask test` keeps tcp
//! on loopback). NIXL over `UCX_TLS=tcp` alone runs between network namespaces in
//! `cargo xtask two-node-test`.
#![cfg(feature = "nixl")]

mod engines_common;

use engines_common::{killed_mid_transfer, round_trip};
use tessera_nixl::{Nixl, NixlConfig};
use tessera_transport::Agent;

fn parent() -> Agent {
    Agent::new("parent", Nixl::new(NixlConfig::new("parent"))).unwrap()
}

#[test]
fn default_transports_round_trip() {
    round_trip(&parent(), "nixl", &[]);
}

#[test]
fn default_transports_peer_killed_mid_transfer() {
    killed_mid_transfer(&parent(), "nixl", &[]);
}

// The conformance cases that make sense with the target in the second process.
two_process_suite!(suite, parent(), "nixl", &[]);
