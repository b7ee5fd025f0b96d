//! The storage unit over the one-sided engines, `ucx` and `nixl` (behind the features of the
//! same name): the unit runs as its own process (the `tessera-storage` binary), clients here,
//! with the same scenarios as `e2e` and `faults` run over shm and tcp. Inline small payloads,
//! frame-native PUTs (the unit READs the client's frames, registered in place, into its
//! block), deferred GETs (the unit WRITEs into the client's pool), and killed clients.
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

/// A client killed in the middle of its PUT (while the unit READs its frames) and of its GET
/// (while the unit WRITEs into its pool): the unit survives, releases everything, and serves
/// others. Over UCX's tcp transport a client that died while it WRITEs into the unit used to
/// abort the unit inside UCX 1.22 (`tessera-transport`'s `ucx_two_process` test
/// `tcp_initiator_killed_mid_write` still shows it); since the unit pulls PUT payloads over
/// the one-sided engines, it is the initiator of every transfer and only sees its own
/// requests fail.
#[cfg(feature = "ucx")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_client_killed_mid_put_and_mid_get_leaks_nothing() {
    scenarios::client_killed_mid_put_and_mid_get_leaks_nothing(Backend::Ucx).await;
}

#[cfg(feature = "nixl")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_client_killed_mid_put_and_mid_get_leaks_nothing() {
    scenarios::client_killed_mid_put_and_mid_get_leaks_nothing(Backend::Nixl).await;
}
