//! Replicas: every value on `r` units, GETs that fall over to the next copy when a unit is
//! gone, PUTs that fail naming the units that did not store, and indexes whose every copy is
//! gone reported lost, never missing and never wrong.

use tessera_storage::{
    Backend, Client, ClientConfig, ClientError, Modulo, Placement, Rendezvous, Server,
    ServerConfig, Tensor, Value,
};

async fn units(n: usize) -> Vec<Server> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(
            Server::start(ServerConfig {
                bind: "127.0.0.1:0".into(),
                backend: Backend::Inproc,
                pool_bytes: 16 << 20,
                ..ServerConfig::default()
            })
            .await
            .unwrap(),
        );
    }
    out
}

async fn client(servers: &[Server], replicas: usize, placement: Box<dyn Placement>) -> Client {
    Client::connect_with(
        ClientConfig {
            units: servers.iter().map(|s| s.addr().to_owned()).collect(),
            backend: Backend::Inproc,
            recv_pool_bytes: 16 << 20,
            timeout: std::time::Duration::from_secs(10),
            replicas,
            ..ClientConfig::default()
        },
        placement,
    )
    .await
    .unwrap()
}

/// Index `i`'s value: 64 bytes that say which index they belong to.
fn value(i: u64) -> Value {
    let data: Vec<u8> = (0..64).map(|k| (i as u8).wrapping_mul(31) ^ k).collect();
    Value::Tensor(Tensor::from_slice(&[64], &data).unwrap())
}

fn bytes(v: &Value) -> Vec<u8> {
    match v {
        Value::Tensor(t) => t.data().to_vec(),
        other => panic!("not a tensor: {other:?}"),
    }
}

async fn put_all(c: &Client, indexes: &[u64]) -> Result<(), ClientError> {
    let cols = vec![("x".to_string(), indexes.iter().map(|&i| value(i)).collect())];
    c.put("p", indexes, &cols).await
}

/// The units (by position) that hold `index` under `placement` with `r` copies.
fn holders(servers: &[Server], placement: &dyn Placement, index: u64, r: usize) -> Vec<usize> {
    let ids: Vec<String> = servers.iter().map(|s| s.addr().to_owned()).collect();
    let mut out = Vec::new();
    placement.replicas("p", index, &ids, r, &mut out);
    out
}

async fn losing_units_keeps_every_value_or_says_lost(placement: fn() -> Box<dyn Placement>) {
    let mut servers = units(3).await;
    let c = client(&servers, 2, placement()).await;
    let indexes: Vec<u64> = (0..300).collect();
    put_all(&c, &indexes).await.unwrap();
    // Two copies of each of the 300 values, spread over the three units.
    let keys: Vec<u64> = servers.iter().map(|s| s.stats().keys).collect();
    assert_eq!(keys.iter().sum::<u64>(), 600, "{keys:?}");
    assert!(keys.iter().all(|&k| k > 100), "{keys:?}");

    // Unit 1 goes away: every value still reads back, byte for byte.
    let holders_of: Vec<Vec<usize>> = indexes
        .iter()
        .map(|&i| holders(&servers, &*placement(), i, 2))
        .collect();
    servers.remove(1).shutdown().await;
    let got = c.get("p", &indexes, &["x"]).await.unwrap();
    for (&i, v) in indexes.iter().zip(&got[0]) {
        assert_eq!(bytes(v), bytes(&value(i)), "index {i}");
    }
    // A PUT that needs the lost unit fails, naming it; one that does not still succeeds.
    let on_1: Vec<u64> = indexes
        .iter()
        .copied()
        .filter(|&i| holders_of[i as usize].contains(&1))
        .collect();
    let off_1: Vec<u64> = indexes
        .iter()
        .copied()
        .filter(|&i| !holders_of[i as usize].contains(&1))
        .collect();
    match put_all(&c, &on_1[..5]).await {
        Err(ClientError::Replicas { failed }) => {
            assert!(!failed.is_empty() && failed.iter().all(|e| e.unit() == Some(1)));
        }
        other => panic!("expected a replicas error, got {other:?}"),
    }
    put_all(&c, &off_1[..5]).await.unwrap();

    // An index never stored is missing, not lost, while a copy's unit answers.
    match c.get("p", &[10_000], &["x"]).await {
        Err(e) => assert!(e.is_missing(), "{e}"),
        Ok(v) => panic!("a value for an index never stored: {v:?}"),
    }

    // Unit 2 goes too (the servers left are units 0 and 2): what lived only on units 1 and
    // 2 is lost; what has a copy on unit 0 still reads back.
    servers.remove(1).shutdown().await;
    let gone: Vec<u64> = indexes
        .iter()
        .copied()
        .filter(|&i| !holders_of[i as usize].contains(&0))
        .collect();
    let kept: Vec<u64> = indexes
        .iter()
        .copied()
        .filter(|&i| holders_of[i as usize].contains(&0))
        .collect();
    assert!(!gone.is_empty() && !kept.is_empty());
    match c.get("p", &indexes, &["x"]).await {
        Err(ClientError::Lost { indexes, causes }) => {
            assert_eq!(indexes, gone);
            assert!(causes.iter().all(|e| matches!(e.unit(), Some(1 | 2))));
        }
        other => panic!("expected lost indexes, got {other:?}"),
    }
    let got = c.get("p", &kept, &["x"]).await.unwrap();
    for (&i, v) in kept.iter().zip(&got[0]) {
        assert_eq!(bytes(v), bytes(&value(i)), "index {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn modulo_replicas_survive_a_lost_unit() {
    losing_units_keeps_every_value_or_says_lost(|| Box::new(Modulo)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rendezvous_replicas_survive_a_lost_unit() {
    losing_units_keeps_every_value_or_says_lost(|| Box::new(Rendezvous)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clear_reaches_every_copy_and_replicas_are_bounded() {
    let servers = units(3).await;
    let c = client(&servers, 3, Box::new(Rendezvous)).await;
    put_all(&c, &[1, 2, 3]).await.unwrap();
    assert!(servers.iter().all(|s| s.stats().keys == 3));
    c.clear("p", &[1, 2]).await.unwrap();
    assert!(servers.iter().all(|s| s.stats().keys == 1));
    for bad in [0, 4] {
        let cfg = ClientConfig {
            units: servers.iter().map(|s| s.addr().to_owned()).collect(),
            backend: Backend::Inproc,
            replicas: bad,
            ..ClientConfig::default()
        };
        match Client::connect(cfg).await {
            Err(ClientError::ApiMisuse(m)) => assert!(m.contains("replicas"), "{m}"),
            other => panic!("replicas = {bad} accepted: {:?}", other.err()),
        }
    }
}

/// A placement that names one unit twice would keep one copy where the client promised two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placement_that_repeats_a_unit_is_refused() {
    struct Twice;
    impl Placement for Twice {
        fn unit_of(&self, _: u64, _: usize) -> usize {
            0
        }
        fn replicas(&self, _: &str, _: u64, _: &[String], r: usize, out: &mut Vec<usize>) {
            out.clear();
            out.extend(std::iter::repeat_n(0, r));
        }
    }
    let servers = units(2).await;
    let c = client(&servers, 2, Box::new(Twice)).await;
    match put_all(&c, &[1]).await {
        Err(ClientError::ApiMisuse(m)) => assert!(m.contains("distinct"), "{m}"),
        other => panic!("a repeated unit accepted: {other:?}"),
    }
    assert!(servers.iter().all(|s| s.stats().keys == 0));
}

/// A unit restarted empty at its address: a repair copies back exactly the keys it held,
/// from their other replica, and a second repair has nothing to do. A repair that cannot
/// reach a replica's unit fails, saying which.
#[tokio::test]
async fn repair_restores_a_restarted_units_copies() {
    let mut servers = units(3).await;
    let c = client(&servers, 2, Box::new(Rendezvous)).await;
    let indexes: Vec<u64> = (0..300).collect();
    put_all(&c, &indexes).await.unwrap();
    let addr = servers[1].addr().to_owned();
    let held = servers[1].stats().keys;
    servers.remove(1).shutdown().await;
    let restarted = Server::start(ServerConfig {
        bind: addr.clone(),
        backend: Backend::Inproc,
        pool_bytes: 16 << 20,
        ..ServerConfig::default()
    })
    .await
    .unwrap();
    assert_eq!(restarted.addr(), addr);
    servers.insert(1, restarted);
    let report = c.repair("p", &indexes, &["x"]).await.unwrap();
    assert_eq!(report.checked, 300);
    assert_eq!((report.under_replicated, report.copies), (held, held));
    assert!(report.lost.is_empty());
    assert_eq!(servers[1].stats().keys, held);
    let again = c.repair("p", &indexes, &["x"]).await.unwrap();
    assert_eq!((again.under_replicated, again.copies), (0, 0));
    let got = c.get("p", &indexes, &["x"]).await.unwrap();
    for (&i, v) in indexes.iter().zip(&got[0]) {
        assert_eq!(bytes(v), bytes(&value(i)), "index {i}");
    }
    servers.remove(2).shutdown().await;
    let e = c.repair("p", &indexes, &["x"]).await.unwrap_err();
    assert_eq!(e.unit(), Some(2), "{e}");
}
