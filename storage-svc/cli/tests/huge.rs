//! Values above 4 GiB on `shm`: one 5 GiB value, and one 8 GiB PUT of three frames
//! (3 + 3 + 2 GiB). The sources are untouched zeroed memory (read as the zero page) with a
//! marker every 64 MiB, so only the unit's pool and the client's receive block hold real pages.
//! Ignored by default (they need about 11 GiB of RAM); run them by name with `--ignored`.

mod common;

use bytes::Bytes;
use common::UnitProcess;
use tessera_storage::{Backend, Client, ClientConfig, Value};

const GIB: usize = 1 << 30;
const STRIDE: usize = 64 << 20;

fn sparse(len: usize, seed: u8) -> Bytes {
    let mut v = vec![0u8; len];
    for (k, at) in (0..len).step_by(STRIDE).enumerate() {
        v[at] = seed.wrapping_add(k as u8) | 1;
    }
    v[len - 1] = seed;
    Bytes::from(v)
}

fn check(b: &Bytes, len: usize, seed: u8) {
    assert_eq!(b.len(), len);
    for (k, at) in (0..len).step_by(STRIDE).enumerate() {
        assert_eq!(b[at], seed.wrapping_add(k as u8) | 1, "marker at {at}");
        assert!(
            b[at + 1..at + 4096].iter().all(|x| *x == 0),
            "zeros after {at}"
        );
    }
    assert_eq!(b[len - 1], seed);
}

async fn client(unit: &UnitProcess, recv: u64) -> Client {
    Client::connect(ClientConfig {
        recv_pool_bytes: recv,
        ..unit.config()
    })
    .await
    .unwrap()
}

fn bytes_of(v: &Value) -> &Bytes {
    match v {
        Value::Bytes(b) => b,
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "moves 5 GiB; needs about 11 GiB of RAM"]
async fn single_5gib_value_on_shm() {
    let len = 5 * GIB;
    let unit = UnitProcess::start(
        Backend::Shm,
        &["--pool", "5637144576", "--capacity", "8589934592"],
    );
    let c = client(&unit, (len + GIB / 4) as u64).await;
    c.put(
        "huge",
        &[0],
        &[("x".into(), vec![Value::Bytes(sparse(len, 3))])],
    )
    .await
    .unwrap();
    let s = &c.stats().await.unwrap()[0];
    assert_eq!((s.keys, s.bytes), (1, len as u64));
    let got = c.get("huge", &[0], &["x"]).await.unwrap();
    check(bytes_of(&got[0][0]), len, 3);
    drop(got);
    c.clear("huge", &[0]).await.unwrap();
    assert_eq!(c.stats().await.unwrap()[0].pool.used, 0);
    assert_eq!(c.recv_pool_used(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "moves 8 GiB; needs about 12 GiB of RAM"]
async fn multi_frame_8gib_put_on_shm() {
    let unit = UnitProcess::start(
        Backend::Shm,
        &["--pool", "8858370048", "--capacity", "17179869184"],
    );
    let c = client(&unit, (3 * GIB + GIB / 4) as u64).await;
    let sizes = [3 * GIB, 3 * GIB, 2 * GIB];
    let cols: Vec<(String, Vec<Value>)> = sizes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            (
                format!("f{i}"),
                vec![Value::Bytes(sparse(*n, i as u8 * 40))],
            )
        })
        .collect();
    c.put("huge", &[0], &cols).await.unwrap();
    drop(cols);
    let s = &c.stats().await.unwrap()[0];
    assert_eq!((s.keys, s.bytes), (3, 8 * GIB as u64));
    for (i, n) in sizes.iter().enumerate() {
        let got = c.get("huge", &[0], &[&format!("f{i}")]).await.unwrap();
        check(bytes_of(&got[0][0]), *n, i as u8 * 40);
    }
    c.drop_partition("huge").await.unwrap();
    assert_eq!(c.stats().await.unwrap()[0].pool.used, 0);
}
