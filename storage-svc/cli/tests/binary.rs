//! The binary: TOML configuration, the Prometheus endpoint, and a raw session that prepares a
//! PUT and vanishes.

mod common;

use std::io::{Read, Write};
use std::process::Command;
use std::time::Duration;

use common::UnitProcess;
use serde_bytes::ByteBuf;
use tessera_framecodec::encode;
use tessera_storage::proto::{decode_body, encode_frame, Request, Response};
use tessera_storage::{Backend, BackendExt, Value};

fn exe() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tessera-storage"))
}

#[test]
fn config_file_round_trips_and_flags_override() {
    let out = exe()
        .args(["serve", "--print-config", "--capacity", "12345"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("capacity_bytes = 12345"), "{text}");
    assert!(text.contains("bind = \"127.0.0.1:7470\""), "{text}");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("unit.toml");
    std::fs::write(
        &path,
        text.replace("capacity_bytes = 12345", "capacity_bytes = 777"),
    )
    .unwrap();
    let out = exe()
        .args([
            "serve",
            "--print-config",
            "--config",
            path.to_str().unwrap(),
            "--backend",
            "tcp",
        ])
        .output()
        .unwrap();
    let again = String::from_utf8(out.stdout).unwrap();
    assert!(
        again.contains("capacity_bytes = 777") && again.contains("backend = \"tcp\""),
        "{again}"
    );
    std::fs::write(&path, "no_such_key = 1\n").unwrap();
    let out = exe()
        .args(["serve", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_endpoint_and_cli_round_trip() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let metrics = format!("127.0.0.1:{port}");
    let unit = UnitProcess::start(Backend::Shm, &["--metrics", &metrics]);
    let put = exe()
        .args([
            "put",
            "--unit",
            &unit.addr,
            "--partition",
            "p",
            "--index",
            "4",
            "--field",
            "x",
            "--value",
            "hello",
        ])
        .status()
        .unwrap();
    assert!(put.success());
    let got = exe()
        .args([
            "get",
            "--unit",
            &unit.addr,
            "--partition",
            "p",
            "--index",
            "4",
            "--field",
            "x",
        ])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8(got.stdout).unwrap().trim(), "bytes[5]");
    let c = unit.client().await;
    let _ = c.get("p", &[99], &["x"]).await.unwrap_err();
    // The stats gauges are refreshed by the unit's timer; poll the endpoint for a while.
    let mut body = String::new();
    for _ in 0..100 {
        body.clear();
        if let Ok(mut s) = std::net::TcpStream::connect(&metrics) {
            let _ = write!(s, "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n");
            let _ = s.read_to_string(&mut body);
        }
        if body.contains("tessera_storage_pool_used_bytes") && body.contains("kind=\"missing\"") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for name in [
        "tessera_storage_request_seconds",
        "tessera_storage_errors_total",
        "tessera_storage_registered_bytes",
        "tessera_storage_idle_bytes",
        "tessera_storage_leased_bytes",
        "tessera_storage_quarantined_bytes",
        "tessera_storage_bytes_in",
    ] {
        assert!(body.contains(name), "{name} missing from {body}");
    }
}

fn roundtrip(s: &mut std::net::TcpStream, id: u64, req: &Request) -> Response {
    s.write_all(&encode_frame(id, req).unwrap()).unwrap();
    let mut prefix = [0u8; 4];
    s.read_exact(&mut prefix).unwrap();
    let mut body = vec![0u8; u32::from_le_bytes(prefix) as usize];
    s.read_exact(&mut body).unwrap();
    decode_body::<Response>(&body).unwrap().1
}

/// A session that prepares a PUT (its block is exposed) and disconnects: the unit releases
/// the block when the session ends, and other clients carry on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_lost_after_prepare_releases_its_block() {
    let unit = UnitProcess::start(Backend::Shm, &[]);
    let agent = Backend::Shm.role_agent("raw").unwrap();
    let other = unit.client().await;
    let mut s = std::net::TcpStream::connect(&unit.addr).unwrap();
    let hello = tessera_storage::testing::handshake::Hello::new(agent.metadata());
    let (mut s, welcome) = tokio::task::spawn_blocking(move || {
        let challenge = roundtrip(&mut s, 0, &hello.request());
        let r = roundtrip(&mut s, 0, &hello.auth(&challenge, None));
        (s, r)
    })
    .await
    .unwrap();
    assert!(matches!(welcome, Response::Welcome { .. }), "{welcome:?}");
    let frames = encode(&Value::List(vec![Value::List(vec![Value::Bytes(
        vec![1u8; 8 << 20].into(),
    )])]))
    .unwrap();
    let req = Request::Put {
        partition: "p".into(),
        indexes: vec![1],
        fields: vec!["x".into()],
        meta: ByteBuf::from(frames.meta.to_vec()),
        inline: None,
        pull: None,
    };
    let r = roundtrip(&mut s, 1, &req);
    assert!(matches!(r, Response::PutReady { .. }), "{r:?}");
    let st = &other.stats().await.unwrap()[0];
    assert!(st.leased_bytes >= 8 << 20 && st.pending_puts == 1, "{st:?}");
    drop(s);
    let mut last = None;
    for _ in 0..300 {
        let st = other.stats().await.unwrap().remove(0);
        if st.leased_bytes == 0 && st.pending_puts == 0 && st.pool.used == 0 {
            last = None;
            break;
        }
        last = Some(st);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(last.is_none(), "{last:?}");
    other
        .put("p", &[2], &[("x".into(), vec![Value::U64(2)])])
        .await
        .unwrap();
}

/// `serve --log-level debug` prints each request's span on stderr, inside its session's span;
/// the default filter prints none.
#[test]
fn debug_log_level_prints_request_spans() {
    // A span closes once its request is handled and answered, so it may be printed after
    // the answer reached the client: the unit is stopped once the line is there (or a while
    // has passed, where none is expected).
    let stats_span =
        |l: &str| l.contains("request{") && l.contains("op=\"stats\"") && l.contains("close");
    let serve = |extra: &[&str], wait: bool| {
        let mut child = exe()
            .args([
                "serve",
                "--announce",
                "--bind",
                "127.0.0.1:0",
                "--backend",
                "tcp",
            ])
            .args(extra)
            .env_remove("RUST_LOG")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let addr = common::announced(&mut child);
        let stats = exe()
            .args(["stats", "--unit", &addr, "--backend", "tcp"])
            .output()
            .unwrap();
        assert!(stats.status.success(), "{stats:?}");
        let (tx, rx) = std::sync::mpsc::channel();
        let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
        let reader = std::thread::spawn(move || {
            let mut err = String::new();
            for line in std::io::BufRead::lines(stderr).map_while(Result::ok) {
                if stats_span(&line) {
                    let _ = tx.send(());
                }
                err.push_str(&line);
                err.push('\n');
            }
            err
        });
        let _ = rx.recv_timeout(if wait {
            Duration::from_secs(30)
        } else {
            Duration::from_millis(200)
        });
        child.kill().unwrap();
        child.wait().unwrap();
        reader.join().unwrap()
    };
    let err = serve(&["--log-level", "debug"], true);
    let request = err
        .lines()
        .find(|l| stats_span(l))
        .unwrap_or_else(|| panic!("no span of the STATS request in:\n{err}"));
    assert!(request.contains("session{"), "{request}");
    assert!(request.contains("DEBUG"), "{request}");
    let quiet = serve(&[], false);
    assert!(!quiet.contains("request{"), "{quiet}");
    assert!(exe()
        .args(["serve", "--log-level", "no=such=filter", "--print-config"])
        .output()
        .is_ok_and(|o| !o.status.success()));
}

/// The unit binary polls its sessions for 50 us by default; it serves the same with polling
/// off and with a long window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_with_busy_polling_off_and_long() {
    for window in ["0", "2000"] {
        let unit = UnitProcess::start(Backend::Shm, &["--busy-poll-us", window]);
        let c = unit.client().await;
        for i in 0..50u64 {
            let v = Value::Bytes(vec![i as u8; 1 + (i as usize) * 997].into());
            c.put("p", &[i], &[("x".into(), vec![v.clone()])])
                .await
                .unwrap();
            let got = c.get("p", &[i], &["x"]).await.unwrap();
            assert_eq!(got[0][0], v, "window {window} us");
        }
    }
}
