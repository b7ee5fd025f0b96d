//! The `ucx` backend between this process and a real second one, over `UCX_TLS=tcp` and over
//! shared memory: `posix,cma,tcp` with peer error handling (notifications over shared memory),
//! and `posix,cma` without it (one-sided cma; no peer-death test in that mode).
#![cfg(feature = "ucx")]

mod engines_common;

use engines_common::{killed_mid_transfer, round_trip};
use tessera_transport::ucx::{ErrorHandling, Ucx, UcxConfig};
use tessera_transport::Agent;

fn parent(tls: &str, errors: ErrorHandling) -> Agent {
    let mut config = UcxConfig::new("parent");
    config.tls = Some(tls.into());
    config.error_handling = errors;
    Agent::new("parent", Ucx::new(config)).unwrap()
}

#[test]
fn tcp_round_trip() {
    round_trip(
        &parent("tcp", ErrorHandling::Peer),
        "ucx",
        &[("UCX_TLS", "tcp")],
    );
}

#[test]
fn tcp_peer_killed_mid_transfer() {
    let env = [("UCX_TLS", "tcp")];
    killed_mid_transfer(&parent("tcp", ErrorHandling::Peer), "ucx", &env);
}

#[test]
fn shm_round_trip() {
    let tls = "posix,cma,tcp";
    round_trip(
        &parent(tls, ErrorHandling::Peer),
        "ucx",
        &[("UCX_TLS", tls)],
    );
}

#[test]
fn shm_peer_killed_mid_transfer() {
    let tls = "posix,cma,tcp";
    killed_mid_transfer(
        &parent(tls, ErrorHandling::Peer),
        "ucx",
        &[("UCX_TLS", tls)],
    );
}

#[test]
fn cma_round_trip() {
    let env = [("UCX_TLS", "posix,cma"), ("TESSERA_UCX_ERR_MODE", "none")];
    round_trip(&parent("posix,cma", ErrorHandling::None), "ucx", &env);
}

// The conformance cases that make sense with the target in the second process.
two_process_suite!(
    suite_tcp,
    parent("tcp", ErrorHandling::Peer),
    "ucx",
    &[("UCX_TLS", "tcp")]
);
two_process_suite!(
    suite_shm,
    parent("posix,cma,tcp", ErrorHandling::Peer),
    "ucx",
    &[("UCX_TLS", "posix,cma,tcp")]
);
two_process_suite!(
    suite_cma,
    parent("posix,cma", ErrorHandling::None),
    "ucx",
    &[("UCX_TLS", "posix,cma"), ("TESSERA_UCX_ERR_MODE", "none")]
);
