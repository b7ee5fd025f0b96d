//! The storage unit over the one-sided engines, `ucx` and `nixl` (behind the features of the
//! same name): the unit runs as its own process (the `tessera-storage` binary), clients here,
//! with the same scenarios as `e2e` and `faults` run over shm and tcp. Inline small payloads,
//! frame-native PUTs (the client WRITEs into the unit's block, from frames registered in
//! place), deferred GETs (the unit WRITEs into the client's pool), and killed clients (for
//! ucx only by name, see below).
//!
//! Run with `cargo xtask deps` done and `UCX_MODULES=^ib UCX_NET_DEVICES=lo`, one feature per
//! cargo invocation, as `cargo xtask test` does.
#![cfg(any(feature = "ucx", feature = "nixl"))]

mod common;

use common::scenarios;
use common::UnitProcess;
use tessera_storage::{Backend, Value};

/// A small value travels inline in the control message; a large one through the engine,
/// from a frame registered in place (private memory, not the client's pool).
async fn inline_and_in_place(backend: Backend) {
    let unit = UnitProcess::start(backend, &[]);
    let client = unit.client().await;
    let small = Value::Bytes(vec![5u8; 100].into());
    let registered = client.agent().report().registrations;
    client
        .put("p", &[1], &[("x".into(), vec![small.clone()])])
        .await
        .unwrap();
    let big: Vec<u8> = (0..(3 << 20)).map(|k: u32| (k * 7) as u8).collect();
    client
        .put(
            "p",
            &[2],
            &[("x".into(), vec![Value::Bytes(big.clone().into())])],
        )
        .await
        .unwrap();
    let got = client.get("p", &[2, 1], &["x"]).await.unwrap();
    assert_eq!(got[0][0], Value::Bytes(big.into()));
    assert_eq!(got[0][1], small);
    let s = &client.stats().await.unwrap()[0];
    assert!(s.bytes_in >= 3 << 20 && s.bytes_out >= 3 << 20, "{s:?}");
    drop(got);
    client.clear("p", &[1, 2]).await.unwrap();
    assert_eq!(client.recv_pool_used(), 0);
    // The in-place registration of the PUT's frame went with the frame.
    assert_eq!(client.agent().report().registrations, registered);
}

macro_rules! engine_tests {
    ($feature:literal, $module:ident, $backend:expr) => {
        #[cfg(feature = $feature)]
        mod $module {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn rl_round_trip() {
                scenarios::rl_round_trip($backend).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn mixed_dtypes_nested_values_and_errors() {
                scenarios::mixed_dtypes_nested_values_and_errors($backend).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn inline_and_registered_in_place() {
                inline_and_in_place($backend).await;
            }
        }
    };
}

engine_tests!("ucx", ucx, Backend::Ucx);
engine_tests!("nixl", nixl, Backend::Nixl);

/// Left out of `cargo xtask test`: over the UCX engine the unit process itself intermittently
/// aborts when a client is killed in the middle of its PUT WRITE (UCX prints
/// `ucp_request.inl:356 Fatal: unexpected error: Endpoint timeout`; 3 runs of 12 here, with
/// `UCX_TLS` unset). The abort is inside UCX 1.22: the unit is the target of a PUT that UCX
/// emulates over tcp with active messages, and the completion it sends back for a fragment
/// the dead client sent (`ucp_put_handler` -> `ucp_rma_sw_send_cmpl`) fails with
/// `UCS_ERR_ENDPOINT_TIMEOUT`, which `ucp_request_send` treats as fatal, inside one
/// `ucp_worker_progress` call. `tessera-transport`'s `ucx_two_process` test
/// `tcp_initiator_killed_mid_write` reproduces it without the unit. The test stays as it is,
/// a test that can fail; run it by name with `-- --ignored`.
#[cfg(feature = "ucx")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "UCX 1.22 can abort the unit when a client dies mid-WRITE over tcp (see the doc)"]
async fn ucx_client_killed_mid_put_and_mid_get_leaks_nothing() {
    scenarios::client_killed_mid_put_and_mid_get_leaks_nothing(Backend::Ucx).await;
}

#[cfg(feature = "nixl")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_client_killed_mid_put_and_mid_get_leaks_nothing() {
    scenarios::client_killed_mid_put_and_mid_get_leaks_nothing(Backend::Nixl).await;
}
