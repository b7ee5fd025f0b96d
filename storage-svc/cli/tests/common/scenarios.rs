//! Scenarios run over several backends: by `e2e` and `faults` over shm and tcp, and by
//! `engines` over ucx and nixl (behind their features).

use std::process::{Command, Stdio};
use std::time::Duration;

use tessera_storage::{Backend, Client, ErrorKind, Stats, Tensor, Value};

use super::{checksum, columns, rollout, UnitProcess};

/// 256 RL rollouts over `backend` in one PUT (frame-native), GET with checksums, a GET in
/// reverse order, CLEAR twice, and nothing left in either pool.
pub async fn rl_round_trip(backend: Backend) {
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
    // Only this session's credits hold memory.
    assert_eq!(
        (
            s.keys,
            s.bytes,
            s.pool.used - s.credit_bytes,
            s.leased_bytes
        ),
        (0, 0, 0, 0),
        "{s:?}"
    );
    assert!(
        s.bytes_in > 0 && s.bytes_out > 0,
        "payload plane used: {s:?}"
    );
    assert_eq!(client.recv_pool_used(), 0);
}

pub fn mixed(i: u64) -> Value {
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

/// Mixed dtypes and nested values over `backend`: PUT, GET, an atomic replace, missing keys
/// named, a capacity refusal that stores nothing, and DROP PARTITION back to an empty pool.
pub async fn mixed_dtypes_nested_values_and_errors(backend: Backend) {
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
    let s = &client.stats().await.unwrap()[0];
    assert_eq!(s.pool.used - s.credit_bytes, 0, "{s:?}");
}

pub const BIG: usize = 96 << 20;

pub async fn stats(c: &Client) -> Stats {
    c.stats().await.unwrap().remove(0)
}

/// Polls until `f` holds (at most ~60 s, then fails): a wait for the unit to notice a dead
/// peer, never a speed assertion.
pub async fn eventually(c: &Client, what: &str, f: impl Fn(&Stats) -> bool) -> Stats {
    for _ in 0..600 {
        let s = stats(c).await;
        if f(&s) {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{what}: {:?}", stats(c).await);
}

pub struct Kill(pub std::process::Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn client_process(unit: &UnitProcess, args: &[&str]) -> Kill {
    Kill(
        Command::new(env!("CARGO_BIN_EXE_tessera-storage"))
            .args(args)
            .args(["--unit", &unit.addr, "--backend", unit.backend.name()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// Real client processes (the binary) killed mid-PUT and mid-GET over `backend`: the unit
/// releases everything they held, and other clients carry on.
pub async fn client_killed_mid_put_and_mid_get_leaks_nothing(backend: Backend) {
    // A killed PUT's exposed block stays quarantined until the client's link is torn down;
    // on the engines that cannot tell (ucx, nixl), for the late-write grace, short here.
    let unit = UnitProcess::start(backend, &["--late-write-grace", "300ms"]);
    let other = unit.client().await;
    let base = stats(&other).await.pool.used;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("big.bin");
    std::fs::write(&file, vec![0x5au8; BIG]).unwrap();

    // Mid-PUT: kill the client once its PUT holds a receive block (or once it is done).
    let mut child = client_process(
        &unit,
        &[
            "put",
            "--partition",
            "p",
            "--index",
            "1",
            "--field",
            "x",
            "--file",
            file.to_str().unwrap(),
        ],
    );
    for _ in 0..600 {
        let s = stats(&other).await;
        if s.pending_puts > 0 || s.keys > 0 || child.0.try_wait().unwrap().is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(child);
    other.clear("p", &[1]).await.unwrap();
    eventually(&other, "after the killed PUT", |s| {
        s.pending_puts == 0
            && s.leased_bytes == 0
            && s.quarantined_bytes == 0
            && s.pool.used - s.credit_bytes == base
            && s.sessions == 1
    })
    .await;

    // Mid-GET: store a big value, kill a client while the unit writes it.
    other
        .put(
            "p",
            &[2],
            &[("x".into(), vec![Value::Bytes(vec![7u8; BIG].into())])],
        )
        .await
        .unwrap();
    let child = client_process(
        &unit,
        &[
            "get",
            "--partition",
            "p",
            "--index",
            "2",
            "--field",
            "x",
            "--out",
            "/dev/null",
        ],
    );
    for _ in 0..600 {
        if stats(&other).await.pending_gets > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    drop(child);
    other.clear("p", &[2]).await.unwrap();
    // The other client's PUT brought its session credits, which it holds.
    eventually(&other, "after the killed GET", |s| {
        s.pending_gets == 0 && s.pool.used - s.credit_bytes == base && s.sessions == 1
    })
    .await;
    // Other clients carry on.
    other
        .put(
            "p",
            &[3],
            &[("x".into(), vec![Value::Bytes(vec![1u8; 1 << 20].into())])],
        )
        .await
        .unwrap();
    let got = other.get("p", &[3], &["x"]).await.unwrap();
    assert_eq!(got[0][0], Value::Bytes(vec![1u8; 1 << 20].into()));
    drop(dir);
}
