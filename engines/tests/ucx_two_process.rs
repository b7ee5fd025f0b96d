//! The `ucx` backend between this process and a real second one, over `UCX_TLS=tcp` and over
//! shared memory: `posix,cma,tcp` with peer error handling (notifications over shared memory),
//! and `posix,cma` without it (one-sided cma; no peer-death test in that mode).
#![cfg(feature = "ucx")]

mod engines_common;

use engines_common::{initiator_killed_mid_write, killed_mid_transfer, round_trip};
use tessera_transport::Agent;
use tessera_ucx::{ErrorHandling, Ucx, UcxConfig};

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

/// The target (the child) killed in the middle of 16 transfers, four times over one agent:
/// each time the initiator (this process) sees every transfer resolve and reaches a new child.
#[test]
fn tcp_target_killed_mid_write_repeatedly() {
    let env = [("UCX_TLS", "tcp")];
    let parent = parent("tcp", ErrorHandling::Peer);
    for _ in 0..4 {
        killed_mid_transfer(&parent, "ucx", &env);
    }
}

/// The initiator (the child) killed in the middle of large WRITEs into this process, eight
/// times; this process must stay alive and serve a new peer afterwards.
///
/// Ignored: UCX 1.22 aborts this process, every run so far (`ucp_request.inl:356 Fatal:
/// unexpected error: Endpoint timeout`). Over `tcp`, a PUT is emulated with active messages:
/// for each fragment the target runs `ucp_put_handler`, which writes the data and sends a
/// completion back (`ucp_rma_sw_send_cmpl`). Fragments the initiator sent before it died are
/// still dispatched from the receive socket; sending the completion for one of them is what
/// first hits the reset connection. UCT then runs the error handlers (UCP discards the
/// endpoint's lanes and calls the engine's error callback) and returns
/// `UCS_ERR_ENDPOINT_TIMEOUT` to the send, which `ucp_request_send` treats as fatal. All of it
/// happens inside one `ucp_worker_progress` call, before the engine gets control back;
/// closing the endpoint from the error callback does not help, since the fatal is the return
/// of that very send. Run it by name with `-- --ignored`.
#[test]
#[ignore = "UCX 1.22 aborts the target when the initiator dies mid-PUT over tcp (see the doc)"]
fn tcp_initiator_killed_mid_write() {
    let env = [("UCX_TLS", "tcp")];
    initiator_killed_mid_write(&parent("tcp", ErrorHandling::Peer), "ucx", &env, 8);
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
