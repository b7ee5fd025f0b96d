//! End to end: the unit runs as its own process (the `tessera-storage` binary), clients here.

mod common;

use std::time::Duration;

use common::{checksum, columns, rollout, UnitProcess};
use tessera_storage::{Backend, ClientConfig, ErrorKind, Tensor, Value};

async fn rl_round_trip(backend: Backend) {
    let unit = UnitProcess::start(backend, &[]);
    let client = unit.client().await;
    let indexes: Vec<u64> = (0..256).collect();
    let rows: Vec<_> = indexes
        .iter()
        .map(|i| rollout(*i, 100 + (*i as usize % 700)))
        .collect();
    let sums: Vec<Vec<u64>> = rows
        .iter()
        .map(|r| r.iter().map(|(_, v)| checksum(v)).collect())
        .collect();
    client
        .put("step-0", &indexes, &columns(rows))
        .await
        .unwrap();
    let fields = ["tokens", "logp", "reward", "image"];
    let got = client.get("step-0", &indexes, &fields).await.unwrap();
    for (f, col) in got.iter().enumerate() {
        for (p, v) in col.iter().enumerate() {
            assert_eq!(checksum(v), sums[p][f], "field {f} index {p}");
        }
    }
    // Requested order is kept.
    let rev: Vec<u64> = indexes.iter().rev().copied().collect();
    let back = client.get("step-0", &rev, &["reward"]).await.unwrap();
    assert_eq!(checksum(&back[0][0]), sums[255][2]);
    drop(got);
    drop(back);
    client.clear("step-0", &indexes).await.unwrap();
    client.clear("step-0", &indexes).await.unwrap();
    let s = &client.stats().await.unwrap()[0];
    assert_eq!(
        (s.keys, s.bytes, s.pool.used, s.leased_bytes),
        (0, 0, 0, 0),
        "{s:?}"
    );
    assert!(
        s.bytes_in > 0 && s.bytes_out > 0,
        "payload plane used: {s:?}"
    );
    assert_eq!(client.recv_pool_used(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rl_round_trip_shm() {
    rl_round_trip(Backend::Shm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rl_round_trip_tcp() {
    rl_round_trip(Backend::Tcp).await;
}

fn mixed(i: u64) -> Value {
    let f16: Vec<tessera_framecodec::half::f16> = (0..3000)
        .map(|k| tessera_framecodec::half::f16::from_f32(k as f32 + i as f32))
        .collect();
    Value::map([
        (
            "f64",
            Value::Tensor(Tensor::from_slice(&[4, 1000], &vec![i as f64; 4000]).unwrap()),
        ),
        (
            "f16",
            Value::Tensor(Tensor::from_slice(&[3000], &f16).unwrap()),
        ),
        (
            "i64",
            Value::Tensor(Tensor::from_slice(&[2], &[i as i64, -1]).unwrap()),
        ),
        (
            "bool",
            Value::Tensor(Tensor::from_slice(&[3], &[true, false, true]).unwrap()),
        ),
        ("bytes", Value::Bytes(vec![i as u8; 10_000].into())),
        (
            "nested",
            Value::List(vec![
                Value::Null,
                Value::Str(format!("sample {i}")),
                Value::map([("deep", Value::List(vec![Value::U64(i), Value::F64(0.25)]))]),
            ]),
        ),
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_dtypes_nested_values_and_errors() {
    for backend in [Backend::Shm, Backend::Tcp] {
        let unit = UnitProcess::start(backend, &["--capacity", "2000000"]);
        let client = unit.client().await;
        let idx = [7u64, 3, 11];
        let vals: Vec<Value> = idx.iter().map(|i| mixed(*i)).collect();
        client
            .put("p", &idx, &[("m".into(), vals.clone())])
            .await
            .unwrap();
        let got = client.get("p", &idx, &["m"]).await.unwrap();
        for (a, b) in got[0].iter().zip(&vals) {
            assert_eq!(checksum(a), checksum(b));
        }
        // Replace atomically, then read the new value.
        client
            .put("p", &[7], &[("m".into(), vec![mixed(70)])])
            .await
            .unwrap();
        let got = client.get("p", &[7], &["m"]).await.unwrap();
        assert_eq!(checksum(&got[0][0]), checksum(&mixed(70)));
        // Missing keys name themselves.
        let err = client.get("p", &[7, 8], &["m"]).await.unwrap_err();
        let tessera_storage::ClientError::Remote { source, .. } = err else {
            panic!("{err}")
        };
        assert_eq!(source.missing, vec![("m".to_string(), 8)]);
        // Capacity in bytes: refused whole, nothing stored.
        let huge: Vec<Value> = (0..4)
            .map(|_| Value::Bytes(vec![1u8; 600_000].into()))
            .collect();
        let err = client
            .put("p", &[20, 21, 22, 23], &[("h".into(), huge)])
            .await
            .unwrap_err();
        assert_eq!(err.kind(), Some(ErrorKind::Capacity));
        let s = &client.stats().await.unwrap()[0];
        assert_eq!((s.keys, s.leased_bytes), (3, 0));
        client.drop_partition("p").await.unwrap();
        client.drop_partition("p").await.unwrap();
        drop(got);
        assert_eq!(client.stats().await.unwrap()[0].pool.used, 0);
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
        token: Some("s3cret".into()),
        ..unit.config()
    })
    .await;
    assert!(ok.is_ok());
    let err = tessera_storage::Client::connect(ClientConfig {
        token: Some("s3cret".into()),
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
