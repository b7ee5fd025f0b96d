//! Faults, load and hostile control messages. The unit runs as its own process; killed
//! clients are real processes (the `tessera-storage` binary as a client).

mod common;

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Duration;

use common::scenarios::{self, eventually, stats, BIG};
use common::{checksum, UnitProcess};
use proptest::prelude::*;
use tessera_storage::proto::{encode_frame, Request, Response};
use tessera_storage::{Backend, Client, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_killed_mid_put_and_mid_get_leaks_nothing() {
    for backend in [Backend::Shm, Backend::Tcp] {
        scenarios::client_killed_mid_put_and_mid_get_leaks_nothing(backend).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_killed_mid_get_fails_the_get_and_frees_the_client_block() {
    let mut unit = UnitProcess::start(Backend::Shm, &[]);
    let client = Arc::new(unit.client().await);
    client
        .put(
            "p",
            &[1],
            &[("x".into(), vec![Value::Bytes(vec![9u8; BIG].into())])],
        )
        .await
        .unwrap();
    let c = client.clone();
    let get = tokio::spawn(async move { c.get("p", &[1], &["x"]).await });
    tokio::time::sleep(Duration::from_millis(1)).await;
    unit.kill();
    // Bounded by the connection closing, not by a timer: a hang fails via the outer guard.
    let r = tokio::time::timeout(Duration::from_secs(120), get)
        .await
        .expect("GET hung")
        .unwrap();
    match r {
        Ok(v) => assert_eq!(v[0][0], Value::Bytes(vec![9u8; BIG].into())),
        // The connection's end as the reader saw it ("closed"), or as a write met it (reset),
        // or the unit's WRITE cut short.
        Err(e) => assert!(
            e.to_string().contains("closed")
                || e.to_string().contains("transport")
                || matches!(e, tessera_storage::ClientError::Io { .. }),
            "{e}"
        ),
    }
    assert_eq!(client.recv_pool_used(), 0);
    assert!(client.stats().await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_32_clients_mixed_ops_with_checksums() {
    let unit = UnitProcess::start(Backend::Shm, &[]);
    let cfg = tessera_storage::ClientConfig {
        recv_pool_bytes: 32 << 20,
        ..unit.config()
    };
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..32u64 {
        let cfg = cfg.clone();
        tasks.spawn(async move {
            let client = Client::connect(cfg).await.unwrap();
            let mut checked = 0u64;
            for round in 0..6u64 {
                let idx: Vec<u64> = (0..8).map(|k| c * 1000 + round * 10 + k).collect();
                let vals: Vec<Value> = idx
                    .iter()
                    .map(|i| {
                        let n = if i % 3 == 0 { 200_000 } else { 300 };
                        Value::Bytes(
                            (0..n)
                                .map(|k| (k as u64 ^ i) as u8)
                                .collect::<Vec<u8>>()
                                .into(),
                        )
                    })
                    .collect();
                let sums: Vec<u64> = vals.iter().map(checksum).collect();
                client
                    .put("load", &idx, &[("v".into(), vals)])
                    .await
                    .unwrap();
                let got = client.get("load", &idx, &["v"]).await.unwrap();
                for (v, s) in got[0].iter().zip(&sums) {
                    assert_eq!(checksum(v), *s);
                    checked += 1;
                }
                if round % 2 == 1 {
                    client.clear("load", &idx).await.unwrap();
                }
            }
            checked
        });
    }
    let mut total = 0;
    while let Some(r) = tasks.join_next().await {
        total += r.unwrap();
    }
    assert_eq!(total, 32 * 6 * 8);
    let c = unit.client().await;
    assert_eq!(stats(&c).await.keys, 32 * 3 * 8);
    c.drop_partition("load").await.unwrap();
    // The loaders' unused credits are released once their links are torn down.
    let s = eventually(&c, "the loaders' credits released", |s| {
        s.pool.used == s.credit_bytes && s.quarantined_bytes == 0
    })
    .await;
    assert_eq!(s.keys, 0);
}

fn raw_roundtrip(sock: &mut std::net::TcpStream, bytes: &[u8]) -> Option<Response> {
    sock.write_all(bytes).ok()?;
    let mut prefix = [0u8; 4];
    sock.read_exact(&mut prefix).ok()?;
    let mut body = vec![0u8; u32::from_le_bytes(prefix) as usize];
    sock.read_exact(&mut body).ok()?;
    Some(
        tessera_storage::proto::decode_body::<Response>(&body)
            .ok()?
            .1,
    )
}

fn framed(body: &[u8]) -> Vec<u8> {
    let mut v = (body.len() as u32).to_le_bytes().to_vec();
    v.extend_from_slice(body);
    v
}

/// Hostile bytes on one raw connection: each garbage frame is answered with an error and a
/// valid request on the same connection still works; an oversized length closes only that
/// connection.
#[test]
fn hostile_control_messages() {
    let unit = UnitProcess::start(Backend::Shm, &["--max-message", "65536"]);
    let mut sock = std::net::TcpStream::connect(&unit.addr).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let valid = encode_frame(5, &Request::Stats).unwrap();
    let check = |sock: &mut std::net::TcpStream, body: &[u8]| {
        let r = raw_roundtrip(sock, &framed(body)).expect("the unit answers");
        assert!(matches!(r, Response::Error(_)), "{r:?}");
    };
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(200));
    let strat = prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..300),
        (0usize..valid.len() - 4, any::<u8>()).prop_map(move |(at, b)| {
            let mut v = encode_frame(5, &Request::Stats).unwrap()[4..].to_vec();
            v[at] ^= b | 1;
            v
        }),
    ];
    let shared = std::sync::Mutex::new(sock.try_clone().unwrap());
    runner
        .run(&strat, |body| {
            let r = raw_roundtrip(&mut shared.lock().unwrap(), &framed(&body))
                .expect("the unit answers");
            // A mutation may still be a valid Stats request (refused: no Hello yet).
            prop_assert!(matches!(r, Response::Error(_)), "{:?}", r);
            Ok(())
        })
        .unwrap();
    check(&mut sock, &[0x93, 0x01]);
    // An oversized length prefix: answered with an error and that connection closed.
    let mut bad = std::net::TcpStream::connect(&unit.addr).unwrap();
    bad.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let r = raw_roundtrip(&mut bad, &u32::MAX.to_le_bytes()).expect("error response");
    assert!(matches!(r, Response::Error(_)));
    // The unit keeps serving everyone else.
    let r = raw_roundtrip(&mut sock, &valid).unwrap();
    assert!(matches!(r, Response::Error(e) if e.kind == tessera_storage::ErrorKind::NoSession));
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = unit.client().await;
        c.put("p", &[1], &[("x".into(), vec![Value::U64(1)])])
            .await
            .unwrap();
    });
}
