//! End to end: the unit runs as its own process (the `tessera-storage` binary), clients here.

mod common;

use std::time::Duration;

use common::scenarios::{self, rl_round_trip};
use common::UnitProcess;
use tessera_storage::{Backend, ClientConfig, ErrorKind, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rl_round_trip_shm() {
    rl_round_trip(Backend::Shm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rl_round_trip_tcp() {
    rl_round_trip(Backend::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_dtypes_nested_values_and_errors() {
    for backend in [Backend::Shm, Backend::Tcp] {
        scenarios::mixed_dtypes_nested_values_and_errors(backend).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_and_backend_mismatch_are_refused() {
    let unit = UnitProcess::start(Backend::Shm, &["--token", "s3cret"]);
    let err = tessera_storage::Client::connect(unit.config())
        .await
        .err()
        .expect("no token");
    assert_eq!(err.kind(), Some(ErrorKind::Unauthorized));
    let ok = tessera_storage::Client::connect(ClientConfig {
        token: Some("s3cret".parse().unwrap()),
        ..unit.config()
    })
    .await;
    assert!(ok.is_ok());
    let err = tessera_storage::Client::connect(ClientConfig {
        token: Some("s3cret".parse().unwrap()),
        backend: Backend::Tcp,
        ..unit.config()
    })
    .await
    .err()
    .expect("backend mismatch");
    assert!(err.to_string().contains("backend"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_units_route_by_modulo() {
    let a = UnitProcess::start(Backend::Shm, &[]);
    let b = UnitProcess::start(Backend::Shm, &[]);
    let client = tessera_storage::Client::connect(ClientConfig {
        units: vec![a.addr.clone(), b.addr.clone()],
        ..a.config()
    })
    .await
    .unwrap();
    let idx: Vec<u64> = (0..10).collect();
    let vals: Vec<Value> = idx
        .iter()
        .map(|i| Value::Bytes(vec![*i as u8; 100_000].into()))
        .collect();
    client
        .put("p", &idx, &[("x".into(), vals.clone())])
        .await
        .unwrap();
    let s = client.stats().await.unwrap();
    assert_eq!((s[0].keys, s[1].keys), (5, 5));
    let got = client.get("p", &[9, 0, 5], &["x"]).await.unwrap();
    assert_eq!(
        got[0],
        vec![vals[9].clone(), vals[0].clone(), vals[5].clone()]
    );
    tokio::time::timeout(Duration::from_secs(60), client.clear("p", &idx))
        .await
        .unwrap()
        .unwrap();
}
