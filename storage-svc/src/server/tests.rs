//! The driver with real sockets: faults injected into requests, sessions and transfers,
//! quarantine and late writes, backpressure, and registered memory growing and shrinking.

use super::fault::{arm, Fault};
use super::*;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

use crate::error::ErrorKind;
use crate::plane::source_descs;
use crate::proto::{self, Request, Response};
use crate::testing::handshake;
use crate::{Client, ClientConfig, ClientError, Tensor, Value};
use tokio::net::TcpStream;

/// An inproc unit whose closed sessions' blocks wait out a short grace (their unused credits
/// among them), so that `settled` sees everything released.
async fn unit() -> Server {
    Server::start(ServerConfig {
        bind: "127.0.0.1:0".into(),
        backend: Backend::Inproc,
        pool_bytes: 32 << 20,
        unit: UnitConfig {
            late_write_grace: Duration::from_millis(200),
            ..UnitConfig::default()
        },
        ..ServerConfig::default()
    })
    .await
    .unwrap()
}

async fn client(server: &Server) -> Client {
    Client::connect(ClientConfig {
        units: vec![server.addr().to_owned()],
        backend: Backend::Inproc,
        recv_pool_bytes: 32 << 20,
        // Only a guard against a hang: every answer below comes at once.
        timeout: Duration::from_secs(60),
        ..ClientConfig::default()
    })
    .await
    .unwrap()
}

/// One field of one value: a tensor of `n` i32 (above `inline_max` for large `n`).
fn column(n: usize, fill: i32) -> Vec<(String, Vec<Value>)> {
    let t = Tensor::from_slice(&[n as u64], &vec![fill; n]).unwrap();
    vec![("x".to_owned(), vec![Value::Tensor(t)])]
}

fn kind(e: &ClientError) -> Option<ErrorKind> {
    e.kind()
}

/// Waits until the unit has closed every session (clients close theirs when dropped) and
/// released what they left in quarantine (their unused credits).
async fn settled(server: &Server) -> Stats {
    for _ in 0..6000 {
        let s = server.stats();
        if s.sessions == 0 && s.quarantined_bytes == 0 {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("sessions never closed: {:?}", server.stats());
}

/// Another client stores, reads back and clears as if nothing happened.
async fn others_carry_on(server: &Server, partition: &str) {
    let c = client(server).await;
    c.put(partition, &[1], &column(100_000, 5)).await.unwrap();
    let got = c.get(partition, &[1], &["x"]).await.unwrap();
    assert_eq!(
        got[0][0].as_tensor().unwrap().as_slice::<i32>().unwrap()[99_999],
        5
    );
    drop(got);
    c.clear(partition, &[1]).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_panics_is_answered_and_closes_only_its_session() {
    arm("panic-in-handle", Fault::Handle);
    let server = unit().await;
    let a = client(&server).await;
    a.put("kept", &[0], &column(100_000, 1)).await.unwrap();
    let e = a
        .put("panic-in-handle", &[0], &column(10, 1))
        .await
        .unwrap_err();
    assert_eq!(kind(&e), Some(ErrorKind::Internal), "{e}");
    assert!(e.to_string().contains("session is closed"), "{e}");
    // The session is gone; the client's next request opens a new one.
    a.stats().await.unwrap();
    others_carry_on(&server, "other").await;
    drop(a);
    let s = settled(&server).await;
    assert_eq!(s.keys, 1, "what the session stored stays stored");
    assert_eq!((s.leased_bytes, s.quarantined_bytes), (0, 0));
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_task_that_panics_is_closed_and_released() {
    arm("panic-in-session", Fault::Session);
    let server = unit().await;
    let a = client(&server).await;
    let e = a
        .put("panic-in-session", &[0], &column(10, 1))
        .await
        .unwrap_err();
    assert!(!matches!(e, ClientError::Timeout { .. }), "{e}");
    others_carry_on(&server, "other").await;
    drop(a);
    let s = settled(&server).await;
    assert_eq!((s.leased_bytes, s.quarantined_bytes), (0, 0));
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_write_that_panics_fails_that_get_and_its_session() {
    let server = unit().await;
    let a = client(&server).await;
    a.put("panic-in-write", &[0], &column(100_000, 3))
        .await
        .unwrap();
    arm("panic-in-write", Fault::Write);
    let e = a.get("panic-in-write", &[0], &["x"]).await.unwrap_err();
    assert_eq!(kind(&e), Some(ErrorKind::Transfer), "{e}");
    assert!(e.to_string().contains("injected fault"), "{e}");
    // The unit failed that session; the client's next request opens a new one.
    a.stats().await.unwrap();
    others_carry_on(&server, "other").await;
    drop(a);
    let s = settled(&server).await;
    assert_eq!((s.pending_gets, s.leased_bytes), (0, 0));
    server.shutdown().await;
}

async fn call(stream: &mut TcpStream, id: u64, req: &Request) -> Response {
    stream
        .write_all(&proto::encode_frame(id, req).unwrap())
        .await
        .unwrap();
    read_response(stream).await.expect("an answer").1
}

async fn read_response(stream: &mut (impl AsyncRead + Unpin)) -> Option<(u64, Response)> {
    let mut prefix = [0u8; proto::LEN_PREFIX];
    stream.read_exact(&mut prefix).await.ok()?;
    let mut buf = vec![0u8; proto::frame_len(prefix, 1 << 30).unwrap()];
    stream.read_exact(&mut buf).await.unwrap();
    Some(proto::decode_body::<Response>(&buf).unwrap())
}

fn prepare(partition: &str) -> Request {
    let value = Value::List(vec![Value::List(vec![column(100_000, 7)
        .remove(0)
        .1
        .remove(0)])]);
    let frames = tessera_framecodec::encode(&value).unwrap();
    Request::Put {
        partition: partition.into(),
        indexes: vec![0],
        fields: vec!["x".into()],
        meta: serde_bytes::ByteBuf::from(frames.meta.to_vec()),
        inline: None,
        pull: None,
    }
}

/// A unit on `backend` whose closed sessions wait `grace` for late WRITEs.
async fn unit_with_grace(backend: Backend, grace: Duration) -> Server {
    Server::start(ServerConfig {
        bind: "127.0.0.1:0".into(),
        backend,
        pool_bytes: 32 << 20,
        unit: UnitConfig {
            late_write_grace: grace,
            ..UnitConfig::default()
        },
        ..ServerConfig::default()
    })
    .await
    .unwrap()
}

/// A raw control connection that said HELLO (request id 1) as `agent`, and the unit's
/// agent metadata from its welcome.
async fn hello(server: &Server, agent: &Agent) -> (TcpStream, Vec<u8>) {
    let mut s = TcpStream::connect(server.addr()).await.unwrap();
    let hello = handshake::Hello::new(agent.metadata());
    let challenge = call(&mut s, 1, &hello.request()).await;
    let auth = hello.auth(&challenge, None);
    let Response::Welcome { agent: md, .. } = call(&mut s, 1, &auth).await else {
        panic!("no welcome")
    };
    (s, md)
}

/// Polls the unit's STATS until `f` holds (a hang guard, not a timing assertion).
async fn until(server: &Server, what: &str, f: impl Fn(&Stats) -> bool) -> Stats {
    for _ in 0..6000 {
        let s = server.stats();
        if f(&s) {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{what} never happened: {:?}", server.stats());
}

/// A session holding a leased block (a prepared PUT) and a quarantined one (cancelled
/// after exposure) panics: it is answered and closed; both blocks were exposed, so they
/// stay quarantined (the inproc engine cannot tell when its peer stops writing) until the
/// late-write grace is over, then go back to the pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_session_releases_its_leases_and_quarantine() {
    arm("panic-holding-leases", Fault::Handle);
    let server = unit_with_grace(Backend::Inproc, Duration::from_millis(100)).await;
    let agent = Backend::Inproc.role_agent("raw").unwrap();
    let (mut s, _) = hello(&server, &agent).await;
    assert!(matches!(
        call(&mut s, 2, &prepare("p")).await,
        Response::PutReady { .. }
    ));
    let cancel = Request::Cancel {
        of: 2,
        maybe_written: true,
    };
    assert_eq!(call(&mut s, 3, &cancel).await, Response::Done);
    assert!(matches!(
        call(&mut s, 4, &prepare("p")).await,
        Response::PutReady { .. }
    ));
    let before = server.stats();
    assert!(before.leased_bytes > 0 && before.quarantined_bytes > 0);
    assert_eq!(before.pool.live_blocks, 2);
    match call(&mut s, 5, &prepare("panic-holding-leases")).await {
        Response::Error(e) => assert_eq!(e.kind, ErrorKind::Internal),
        other => panic!("{other:?}"),
    }
    assert!(
        read_response(&mut s).await.is_none(),
        "the connection is closed"
    );
    let after = until(&server, "the grace running out", |s| {
        s.quarantined_bytes == 0
    })
    .await;
    assert_eq!((after.sessions, after.leased_bytes), (0, 0));
    assert_eq!((after.pool.used, after.pool.live_blocks), (0, 0));
    others_carry_on(&server, "other").await;
    server.shutdown().await;
}

/// A session that closes after READY, on an engine that cannot tell when its client stops
/// writing: the exposed block stays quarantined (in STATS, per partition) while the grace
/// lasts, and the unit's teardown still frees everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_sessions_exposed_block_waits_for_the_grace() {
    let server = unit_with_grace(Backend::Inproc, Duration::from_secs(3600)).await;
    let agent = Backend::Inproc.role_agent("raw").unwrap();
    let (mut s, _) = hello(&server, &agent).await;
    assert!(matches!(
        call(&mut s, 2, &prepare("p")).await,
        Response::PutReady { .. }
    ));
    let exposed = server.stats().leased_bytes;
    drop(s);
    let after = until(&server, "the session closing", |s| s.sessions == 0).await;
    assert_eq!((after.leased_bytes, after.quarantined_bytes), (0, exposed));
    assert_eq!(after.partitions[0].quarantined_bytes, exposed);
    assert_eq!(after.pool.live_blocks, 1);
    server.shutdown().await;
}

/// Over tcp, a client shows READY, drops its control connection, and WRITEs late into the
/// block it was given: the unit's engine refuses it, the block's exposure being gone.
/// Meanwhile another client's PUT of the same size must not have been given that block: its
/// value reads back intact after the late WRITE. Once the
/// late writer's agent is gone (its link closed), the quarantine is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_write_over_tcp_never_lands_in_a_reused_block() {
    // Over tcp the link decides, never the clock.
    let server = unit_with_grace(Backend::Tcp, Duration::ZERO).await;
    let agent = Backend::Tcp.role_agent("late").unwrap();
    let (mut s, md) = hello(&server, &agent).await;
    let peer = agent.add_remote(&md).unwrap();
    let Response::PutReady { block, agent: md } = call(&mut s, 2, &prepare("p")).await else {
        panic!("no READY")
    };
    if let Some(md) = md {
        agent.add_remote(&md).unwrap();
    }
    let exposed = server.stats().leased_bytes;
    drop(s);
    let after = until(&server, "the session closing", |s| s.sessions == 0).await;
    assert_eq!(
        (after.leased_bytes, after.quarantined_bytes),
        (0, exposed),
        "the exposed block stays quarantined while the client's link is up"
    );
    // Another client stores a value of the same size (the freed block's offset would be
    // the first fit).
    let c = Client::connect(ClientConfig {
        units: vec![server.addr().to_owned()],
        backend: Backend::Tcp,
        recv_pool_bytes: 32 << 20,
        timeout: Duration::from_secs(60),
        ..ClientConfig::default()
    })
    .await
    .unwrap();
    c.put("other", &[1], &column(100_000, 5)).await.unwrap();
    // The late WRITE is refused: the block's exposure went with the session (tcp sees
    // every request; the quarantine is for engines that cannot refuse it).
    let garbage = [Bytes::from(vec![0xAB; block.len as usize])];
    let locals = source_descs(&agent, &garbage).unwrap();
    let late = peer.write(&locals, &[block], None).unwrap().await;
    assert!(
        matches!(
            late,
            Err(tessera_transport::TransferError::Rejected {
                reason: tessera_transport::RejectReason::NotExposed,
                ..
            })
        ),
        "{late:?}"
    );
    let got = c.get("other", &[1], &["x"]).await.unwrap();
    let vals = got[0][0].as_tensor().unwrap().as_slice::<i32>().unwrap();
    assert!(
        vals.iter().all(|&v| v == 5),
        "another PUT's value was overwritten"
    );
    drop(got);
    assert_eq!(server.stats().quarantined_bytes, exposed);
    // The late writer goes away: its link closes and the block comes back.
    drop((locals, peer, agent));
    let s = until(&server, "the quarantine's release", |s| {
        s.quarantined_bytes == 0
    })
    .await;
    // The other client's session holds credits besides.
    assert_eq!(
        s.pool.live_blocks,
        1 + s.credit_bytes / UnitConfig::default().credit_bytes,
        "only the stored value and the credits hold blocks"
    );
    drop(c);
    server.shutdown().await;
}

/// A client that pipelines many requests and reads none of the answers: the unit stops
/// reading from it once its reply queue and the pipe are full, instead of handling every
/// request and queueing every answer; when the client reads, every answer arrives, in
/// order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_does_not_read_is_not_read_either() {
    const QUEUE: usize = 8;
    const PIPE: usize = 4096;
    const N: u64 = 2000;
    let server = Server::start(ServerConfig {
        bind: "127.0.0.1:0".into(),
        backend: Backend::Inproc,
        pool_bytes: 1 << 20,
        reply_queue: QUEUE,
        transfer_queue: 1,
        ..ServerConfig::default()
    })
    .await
    .unwrap();
    let (mut ours, theirs) = tokio::io::duplex(PIPE);
    server.attach(theirs);
    let agent = Backend::Inproc.role_agent("raw").unwrap();
    let hello = handshake::Hello::new(agent.metadata());
    ours.write_all(&proto::encode_frame(0, &hello.request()).unwrap())
        .await
        .unwrap();
    let Some((0, challenge)) = read_response(&mut ours).await else {
        panic!("no challenge")
    };
    ours.write_all(&proto::encode_frame(0, &hello.auth(&challenge, None)).unwrap())
        .await
        .unwrap();
    assert!(matches!(
        read_response(&mut ours).await,
        Some((0, Response::Welcome { .. }))
    ));
    // Inline PUTs of one small value each: one stored key per request handled.
    let value = Value::List(vec![Value::List(vec![Value::U64(1)])]);
    let meta = tessera_framecodec::encode(&value).unwrap().meta.to_vec();
    let (mut rd, mut wr) = tokio::io::split(ours);
    let writer = tokio::spawn(async move {
        for i in 1..=N {
            let put = Request::Put {
                partition: "p".into(),
                indexes: vec![i],
                fields: vec!["x".into()],
                meta: serde_bytes::ByteBuf::from(meta.clone()),
                inline: Some(Vec::new()),
                pull: None,
            };
            wr.write_all(&proto::encode_frame(i, &put).unwrap())
                .await
                .unwrap();
        }
        wr
    });
    // The pipe holds PIPE / (shortest answer) answers, the queue QUEUE, the reply writer
    // one in hand, and one request can be in the session's hand. Without the bound,
    // every request would be handled.
    let shortest = proto::encode_frame(1, &Response::Done).unwrap().len();
    let bound = (PIPE / shortest + QUEUE + 2) as u64;
    let mut handled = 0;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        handled = server.stats().keys;
        assert!(handled <= bound, "{handled} requests handled, unread");
    }
    assert!(handled > 0);
    assert!(
        !writer.is_finished(),
        "the unit stopped reading the requests"
    );
    for i in 1..=N {
        let mut prefix = [0u8; proto::LEN_PREFIX];
        rd.read_exact(&mut prefix).await.unwrap();
        let mut buf = vec![0u8; proto::frame_len(prefix, 1 << 20).unwrap()];
        rd.read_exact(&mut buf).await.unwrap();
        let (id, resp) = proto::decode_body::<Response>(&buf).unwrap();
        assert_eq!((id, resp), (i, Response::Done));
    }
    drop(writer.await.unwrap());
    assert_eq!(server.stats().keys, N);
    server.shutdown().await;
}

#[tokio::test]
async fn queue_bounds_are_checked() {
    let bad = Server::start(ServerConfig {
        bind: "127.0.0.1:0".into(),
        backend: Backend::Inproc,
        pool_bytes: 1 << 20,
        reply_queue: 10,
        transfer_queue: 8,
        ..ServerConfig::default()
    })
    .await;
    assert!(matches!(bad, Err(ServerError::Config(_))));
}

/// PUTs beyond the first chunk register more chunks (the client learns them from the
/// READY answer and writes into them), up to the limit; CLEAR gives the memory back down
/// to the idle limit; the agent's registrations always match what STATS reports.
async fn registered_memory_grows_and_shrinks(backend: Backend) {
    const MIB: u64 = 1 << 20;
    let server = Server::start(ServerConfig {
        bind: "127.0.0.1:0".into(),
        backend,
        pool_bytes: 24 * MIB,
        pool_chunk_bytes: 4 * MIB,
        idle_pool_bytes: 6 * MIB,
        // Every chunk below holds PUTs' values only.
        unit: UnitConfig {
            credit_bytes: 0,
            ..UnitConfig::default()
        },
        ..ServerConfig::default()
    })
    .await
    .unwrap();
    let c = Client::connect(ClientConfig {
        units: vec![server.addr().to_owned()],
        backend,
        recv_pool_bytes: 8 * MIB,
        ..ClientConfig::default()
    })
    .await
    .unwrap();
    let check = |server: &Server| {
        let s = server.stats();
        let r = server.agent().report();
        assert_eq!(r.registered_bytes, s.pool.capacity, "{s:?}");
        assert_eq!(r.registrations as u64, s.pool.chunks, "{s:?}");
        s
    };
    assert_eq!(check(&server).pool.capacity, 4 * MIB);
    // Ten values of 1.5 MiB: two fit a chunk, so five chunks.
    for i in 0..10u64 {
        let cols = column(384 << 10, i as i32);
        c.put("p", &[i], &cols).await.unwrap();
    }
    let s = check(&server);
    assert_eq!((s.pool.capacity, s.pool.chunks), (20 * MIB, 5));
    assert_eq!((s.pool.limit, s.pool.idle_limit), (24 * MIB, 6 * MIB));
    for i in 0..10u64 {
        let got = c.get("p", &[i], &["x"]).await.unwrap();
        let t = got[0][0].as_tensor().unwrap();
        assert_eq!(t.as_slice::<i32>().unwrap()[1000], i as i32);
    }
    // Beyond the limit: refused with a clear error, nothing stored.
    let e = c.put("p", &[99], &column(3 << 20, 1)).await.unwrap_err();
    assert_eq!(e.kind(), Some(ErrorKind::OutOfMemory), "{e}");
    assert!(e.to_string().contains("registered memory exhausted"), "{e}");
    c.clear("p", &(0..10).collect::<Vec<_>>()).await.unwrap();
    let s = check(&server);
    assert_eq!(s.pool.used, 0);
    assert!(s.pool.capacity <= 6 * MIB, "{s:?}");
    assert_eq!(
        s.pool.capacity,
        4 * MIB,
        "one chunk is within the idle limit"
    );
    // And grows again.
    for i in 0..4u64 {
        c.put("q", &[i], &column(384 << 10, 1)).await.unwrap();
    }
    assert_eq!(check(&server).pool.capacity, 8 * MIB);
    // A dropped partition's values are freed with the request (outside the unit's lock).
    c.drop_partition("q").await.unwrap();
    assert_eq!(check(&server).pool.used, 0);
    drop(c);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registered_memory_grows_and_shrinks_inproc() {
    registered_memory_grows_and_shrinks(Backend::Inproc).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registered_memory_grows_and_shrinks_shm() {
    registered_memory_grows_and_shrinks(Backend::Shm).await;
}

/// A GET larger than the client's receive pool fails with the pool's numbers as data (its
/// allocator's `OutOfMemory`, not a message to parse); the unit and the client carry on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_beyond_the_receive_pool_reports_its_numbers() {
    let server = unit().await;
    let small = Client::connect(ClientConfig {
        units: vec![server.addr().to_owned()],
        backend: Backend::Inproc,
        recv_pool_bytes: 1 << 20,
        timeout: Duration::from_secs(60),
        ..ClientConfig::default()
    })
    .await
    .unwrap();
    small.put("p", &[1], &column(1 << 20, 3)).await.unwrap();
    let e = small.get("p", &[1], &["x"]).await.unwrap_err();
    let ClientError::OutOfMemory {
        requested,
        free,
        largest_free,
        ..
    } = e
    else {
        panic!("expected OutOfMemory, got {e:?}");
    };
    assert!(requested >= 4 << 20, "{requested}");
    assert!(
        free <= 1 << 20 && largest_free <= free,
        "{free} {largest_free}"
    );
    assert!(requested > largest_free);
    let got = small.get("p", &[1], &["missing"]).await.unwrap_err();
    assert_eq!(kind(&got), Some(ErrorKind::Missing));
    others_carry_on(&server, "q").await;
}

/// A GET (request 7) of `indexes` of field `x` of `partition`, sent on a raw control
/// connection of its own; the task ends with its answer.
async fn raw_get(
    server: &Server,
    partition: &str,
    indexes: Vec<u64>,
) -> tokio::task::JoinHandle<Option<(u64, Response)>> {
    let agent = Backend::Inproc.role_agent("raw").unwrap();
    let (mut a, _) = hello(server, &agent).await;
    let get = Request::Get {
        partition: partition.into(),
        indexes,
        fields: vec!["x".into()],
    };
    a.write_all(&proto::encode_frame(7, &get).unwrap())
        .await
        .unwrap();
    tokio::spawn(async move { read_response(&mut a).await })
}

/// The error that answers [`raw_get`]'s GET of 2^20 keys never stored.
fn all_missing(answer: Option<(u64, Response)>) -> crate::error::RemoteError {
    let (id, r) = answer.expect("an answer");
    assert_eq!(id, 7);
    let Response::Error(e) = r else {
        panic!("{r:?}")
    };
    assert_eq!(e.kind, ErrorKind::Missing);
    assert!(e.message.starts_with("1048576 key(s)"), "{e:?}");
    e
}

/// A GET of 2^20 keys does not hold the unit's shared state for its whole length: while it
/// is being handled, another session's small requests on another partition are handled too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_get_is_handled_in_slices_and_others_are_served_meanwhile() {
    let server = unit().await;
    let (tx, rx) = std::sync::mpsc::channel();
    fault::watch_get("huge-get", tx);
    let b = client(&server).await;
    let reader = raw_get(&server, "huge-get", (0..1u64 << 20).collect()).await;
    started(rx).await;
    // The huge GET is under way; small requests of another session on another partition.
    let mut small = 0;
    while !reader.is_finished() {
        b.clear("huge-get-other", &[small]).await.unwrap();
        small += 1;
    }
    let e = all_missing(reader.await.unwrap());
    assert_eq!(e.missing.len(), 1000);
    assert!(
        fault::served_during_get("huge-get"),
        "no other request was handled while the huge GET held the unit ({small} waited)"
    );
    drop(b);
    assert_eq!(
        server.shared.partitions.len(),
        0,
        "a partition's lock was left"
    );
    server.shutdown().await;
}

/// Waits (in a blocking thread) until `rx` hears that a watched request started.
async fn started(rx: std::sync::mpsc::Receiver<()>) {
    tokio::task::spawn_blocking(move || {
        rx.recv_timeout(Duration::from_secs(120))
            .expect("the request was never handled")
    })
    .await
    .unwrap();
}

/// `n` keys of field `x`, each an I64 of `base` plus its index.
fn numbered(n: u64, base: i64) -> (Vec<u64>, Vec<(String, Vec<Value>)>) {
    let values = (0..n).map(|i| Value::I64(base + i as i64)).collect();
    ((0..n).collect(), vec![("x".to_owned(), values)])
}

fn ints(got: &[Vec<Value>]) -> Vec<i64> {
    got[0]
        .iter()
        .map(|v| match v {
            Value::I64(i) => *i,
            other => panic!("{other:?}"),
        })
        .collect()
}

/// Keys of the PUTs stored in slices below: 32 times `slice_keys`.
const SLICED_PUT_KEYS: u64 = 32 * 4096;

/// A PUT of more keys than `slice_keys` is stored in slices: on a unit with one worker,
/// another session's requests are served while it is stored, and every key is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_huge_put_is_stored_in_slices_and_others_are_served_meanwhile() {
    let server = unit().await;
    let (tx, rx) = std::sync::mpsc::channel();
    fault::watch_get("huge-put", tx);
    let a = Arc::new(client(&server).await);
    let b = client(&server).await;
    let (indexes, columns) = numbered(SLICED_PUT_KEYS, 0);
    let writer = {
        let a = a.clone();
        tokio::spawn(async move { a.put("huge-put", &indexes, &columns).await })
    };
    started(rx).await;
    let mut small = 0;
    while !writer.is_finished() {
        b.put("huge-put-other", &[small], &numbered(1, 7).1)
            .await
            .unwrap();
        small += 1;
    }
    writer.await.unwrap().unwrap();
    assert!(
        fault::served_during_get("huge-put"),
        "no other request was handled while the huge PUT was stored ({small} waited)"
    );
    let got = b
        .get("huge-put", &[0, SLICED_PUT_KEYS - 1], &["x"])
        .await
        .unwrap();
    assert_eq!(ints(&got), [0, SLICED_PUT_KEYS as i64 - 1]);
    assert_eq!(server.stats().keys, SLICED_PUT_KEYS + small);
    drop((a, b));
    assert_eq!(
        server.shared.partitions.len(),
        0,
        "a partition's lock was left"
    );
    server.shutdown().await;
}

/// Two clients of `server`, the first having stored [`SLICED_PUT_KEYS`] keys of `partition`
/// ([`numbered`] from 0), and the partition watched from then on.
async fn stored_and_watched(
    server: &Server,
    partition: &str,
) -> (Arc<Client>, Client, std::sync::mpsc::Receiver<()>) {
    let a = Arc::new(client(server).await);
    let b = client(server).await;
    let (indexes, old) = numbered(SLICED_PUT_KEYS, 0);
    a.put(partition, &indexes, &old).await.unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    fault::watch_get(partition, tx);
    (a, b, rx)
}

/// A PUT stored in slices is seen whole or not at all: a GET of its first and last keys
/// that arrives while it is stored waits for it, and reads both new values.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_stored_in_slices_is_seen_whole() {
    let server = unit().await;
    let (a, b, rx) = stored_and_watched(&server, "whole-put").await;
    let (indexes, new) = numbered(SLICED_PUT_KEYS, 1 << 40);
    let writer = {
        let a = a.clone();
        tokio::spawn(async move { a.put("whole-put", &indexes, &new).await })
    };
    started(rx).await;
    let last = SLICED_PUT_KEYS - 1;
    let got = b.get("whole-put", &[0, last], &["x"]).await.unwrap();
    assert_eq!(
        ints(&got),
        [1 << 40, (1 << 40) + last as i64],
        "a mix of the two PUTs"
    );
    assert!(
        fault::waited_during("whole-put"),
        "the GET did not wait for the PUT"
    );
    writer.await.unwrap().unwrap();
    drop((a, b));
    server.shutdown().await;
}

/// A GET handled in slices sees no PUT land between them: a PUT of its first and last keys
/// that arrives meanwhile waits for it, so the GET reads both old values.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_in_slices_sees_no_put_land_between_them() {
    let server = unit().await;
    let (a, b, rx) = stored_and_watched(&server, "whole-get").await;
    let indexes: Vec<u64> = (0..SLICED_PUT_KEYS).collect();
    let reader = {
        let a = a.clone();
        tokio::spawn(async move { a.get("whole-get", &indexes, &["x"]).await })
    };
    started(rx).await;
    let last = SLICED_PUT_KEYS - 1;
    let new = vec![("x".to_owned(), vec![Value::I64(-1), Value::I64(-2)])];
    b.put("whole-get", &[0, last], &new).await.unwrap();
    let got = reader.await.unwrap().unwrap();
    let got = ints(&got);
    assert_eq!(
        (got[0], got[last as usize]),
        (0, last as i64),
        "the PUT landed midway"
    );
    assert!(
        fault::waited_during("whole-get"),
        "the PUT did not wait for the GET"
    );
    let got = b.get("whole-get", &[0, last], &["x"]).await.unwrap();
    assert_eq!(ints(&got), [-1, -2]);
    drop((a, b));
    server.shutdown().await;
}

/// The keys of a GET of 2^20 indexes out of order are checked on a bulk thread: on a unit
/// with one worker, another session's requests are served while the check runs (its set of
/// a million indexes takes hundreds of milliseconds in a debug build).
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_huge_get_out_of_order_is_checked_off_the_worker() {
    let server = unit().await;
    let (checking, sliced) = watch_check_then_handling("shuffled-get");
    let b = client(&server).await;
    // Every index once, out of order: the duplicate check needs its set.
    let reader = raw_get(&server, "shuffled-get", shuffled(1 << 20)).await;
    started(checking).await;
    // Small requests of another session on the GET's partition until the GET is answered.
    // Those answered before the GET took the unit's lock for its first slice (right after
    // its check, with no wait between) were served while its keys were checked.
    let (small, during_check) = small_clears_until(&b, "shuffled-get", &reader, &sliced).await;
    all_missing(reader.await.unwrap());
    assert!(
        during_check > 0,
        "no other request was served while the GET's keys were checked ({small} in all)"
    );
    drop(b);
    server.shutdown().await;
}

/// Watches the request of many keys on `partition`: the first receiver hears when the check
/// of its keys begins, the second when it is handled (its first slice, or its store).
fn watch_check_then_handling(
    partition: &str,
) -> (std::sync::mpsc::Receiver<()>, std::sync::mpsc::Receiver<()>) {
    let (tx, handled) = std::sync::mpsc::channel();
    fault::watch_get(partition, tx);
    let (tx, checking) = std::sync::mpsc::channel();
    fault::watch_check(partition, tx);
    (checking, handled)
}

/// CLEARs of `partition` by `b`, a key each, until `big` is finished: how many in all, and
/// how many were answered before `handled` heard that the big request was handled.
async fn small_clears_until<T>(
    b: &Client,
    partition: &str,
    big: &tokio::task::JoinHandle<T>,
    handled: &std::sync::mpsc::Receiver<()>,
) -> (u64, u64) {
    let (mut small, mut before, mut seen) = (0, 0, false);
    while !big.is_finished() {
        b.clear(partition, &[small]).await.unwrap();
        seen = seen || handled.try_recv().is_ok();
        if !seen {
            before += 1;
        }
        small += 1;
    }
    (small, before)
}

/// The keys of a PUT of 2^20 indexes out of order are checked on a bulk thread: on a unit
/// with one worker, another session's requests are served while the check runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_huge_put_out_of_order_is_checked_off_the_worker() {
    let server = unit().await;
    let (checking, stored) = watch_check_then_handling("shuffled-put");
    let a = Arc::new(client(&server).await);
    let b = client(&server).await;
    // Each index's value is the index.
    let indexes = shuffled(1 << 20);
    let values = indexes.iter().map(|i| Value::I64(*i as i64)).collect();
    let columns = vec![("x".to_owned(), values)];
    let writer = {
        let a = a.clone();
        tokio::spawn(async move { a.put("shuffled-put", &indexes, &columns).await })
    };
    started(checking).await;
    // Small requests of another session until the PUT is answered. Those answered before it
    // was handled were served while its keys were checked.
    let (small, during_check) =
        small_clears_until(&b, "shuffled-put-other", &writer, &stored).await;
    writer.await.unwrap().unwrap();
    assert!(
        during_check > 0,
        "no other request was served while the PUT's keys were checked ({small} in all)"
    );
    let got = b.get("shuffled-put", &[5, 1 << 19], &["x"]).await.unwrap();
    assert_eq!(ints(&got), [5, 1 << 19]);
    drop((a, b));
    server.shutdown().await;
}

/// Every index of `0..n` once, out of order.
fn shuffled(n: u64) -> Vec<u64> {
    let mut indexes: Vec<u64> = (0..n).collect();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for i in (1..indexes.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        indexes.swap(i, (x % (i as u64 + 1)) as usize);
    }
    indexes
}

/// A GET past the bulk threshold is answered as any other: found values encoded on the bulk
/// thread, a repeated index refused by its check there.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_get_past_the_bulk_threshold_is_answered_alike() {
    let server = unit().await;
    let c = client(&server).await;
    let n = (connection::BULK_KEYS + 10) as u64;
    let indexes: Vec<u64> = (0..n).collect();
    let values: Vec<Value> = indexes.iter().map(|&i| Value::I64(i as i64 * 3)).collect();
    c.put("bulk-get", &indexes, &[("x".to_string(), values)])
        .await
        .unwrap();
    let got = c.get("bulk-get", &indexes, &["x"]).await.unwrap();
    assert_eq!(got[0].len(), n as usize);
    assert!(got[0]
        .iter()
        .enumerate()
        .all(|(i, v)| *v == Value::I64(i as i64 * 3)));
    let mut repeated = indexes.clone();
    repeated[5] = n - 1;
    repeated.swap(0, 1);
    let e = c.get("bulk-get", &repeated, &["x"]).await.unwrap_err();
    assert_eq!(kind(&e), Some(ErrorKind::BadRequest), "{e}");
    assert!(e.to_string().contains("duplicate index"), "{e}");
    server.shutdown().await;
}

/// Pipelined requests whose messages the socket cannot take at once: each caller writes what
/// the socket takes, the connection's writer task the rest and every request behind it, and
/// no two requests' bytes interleave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_beyond_the_socket_buffer_stay_whole_and_in_order() {
    let server = unit().await;
    let c = Arc::new(client(&server).await);
    // Inline PUTs of 64,000 bytes each (under inline_max): 12.8 MB of control messages in
    // flight together, far beyond a loopback socket's buffer.
    let puts: Vec<_> = (0..200u64)
        .map(|i| {
            let c = c.clone();
            tokio::spawn(async move { c.put("pipe", &[i], &column(16_000, i as i32)).await })
        })
        .collect();
    for p in puts {
        p.await.unwrap().unwrap();
    }
    let gets: Vec<_> = (0..200u64)
        .map(|i| {
            let c = c.clone();
            tokio::spawn(async move { (i, c.get("pipe", &[i], &["x"]).await) })
        })
        .collect();
    for g in gets {
        let (i, got) = g.await.unwrap();
        let got = got.unwrap();
        let v = got[0][0].as_tensor().unwrap().as_slice::<i32>().unwrap();
        assert!(
            v.len() == 16_000 && v.iter().all(|&x| x == i as i32),
            "value {i}"
        );
    }
    assert_eq!(server.stats().keys, 200);
}

/// Answers the client's socket cannot take at once (it pipelines GETs and reads nothing
/// until the last is sent): the unit writes what the socket takes from the session's own
/// thread and leaves the rest, and every answer behind it, to the session's writer; every
/// answer arrives whole and in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_beyond_the_socket_buffer_stay_whole_and_in_order() {
    const N: u64 = 150;
    let server = unit().await;
    let agent = Backend::Inproc.role_agent("raw").unwrap();
    let (mut s, _) = hello(&server, &agent).await;
    // 64,000 bytes inline per answer: 9.6 MB of answers, far beyond the socket's buffers.
    let frames = |i: u64| {
        tessera_framecodec::encode(&Value::List(vec![Value::List(vec![column(
            16_000, i as i32,
        )
        .remove(0)
        .1
        .remove(0)])]))
        .unwrap()
    };
    for i in 0..N {
        let f = frames(i);
        let put = Request::Put {
            partition: "p".into(),
            indexes: vec![i],
            fields: vec!["x".into()],
            meta: serde_bytes::ByteBuf::from(f.meta.to_vec()),
            inline: Some(
                f.payloads
                    .iter()
                    .map(|p| serde_bytes::ByteBuf::from(p.to_vec()))
                    .collect(),
            ),
            pull: None,
        };
        assert_eq!(call(&mut s, 2 + i, &put).await, Response::Done, "PUT {i}");
    }
    let (mut rd, mut wr) = s.into_split();
    let sender = tokio::spawn(async move {
        for i in 0..N {
            let get = Request::Get {
                partition: "p".into(),
                indexes: vec![i],
                fields: vec!["x".into()],
            };
            wr.write_all(&proto::encode_frame(1000 + i, &get).unwrap())
                .await
                .unwrap();
        }
        wr
    });
    let wr = sender.await.unwrap();
    for i in 0..N {
        let Some((id, Response::Values { frames, .. })) = read_response(&mut rd).await else {
            panic!("no values for GET {i}")
        };
        assert_eq!(id, 1000 + i, "answers out of order");
        let want = frames_of(i);
        assert_eq!(frames.len(), want.len());
        for (got, want) in frames.iter().zip(&want) {
            assert!(got.as_slice() == want.as_slice(), "answer {i} is not whole");
        }
    }
    drop((rd, wr));
    server.shutdown().await;

    fn frames_of(i: u64) -> Vec<Vec<u8>> {
        let v = vec![i as i32; 16_000];
        vec![v.iter().flat_map(|x| x.to_le_bytes()).collect()]
    }
}

/// A GET of a shape laid out before offers a block for it; when the values under it became
/// small and come back inline, the next GET of that shape offers none (an offer leases a
/// receive block and announces it to the unit, for nothing when the answer is inline), until
/// one of its shape is laid out again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_answered_inline_offers_no_block_next_time() {
    let server = unit().await;
    let c = client(&server).await;
    let get = |fill: i32, n: usize| {
        let c = &c;
        async move {
            let got = c.get("shrinks", &[1], &["x"]).await.unwrap();
            let v = got[0][0].as_tensor().unwrap().as_slice::<i32>().unwrap();
            assert!(v.len() == n && v.iter().all(|&x| x == fill));
        }
    };
    // 400,000 bytes: through the payload plane; the second GET offers its block.
    c.put("shrinks", &[1], &column(100_000, 1)).await.unwrap();
    get(1, 100_000).await;
    get(1, 100_000).await;
    assert_eq!(fault::offers("shrinks"), 1);
    // 16 bytes: inline. The first GET still offers (the shape was laid out), the next not.
    c.put("shrinks", &[1], &column(4, 2)).await.unwrap();
    get(2, 4).await;
    assert_eq!(fault::offers("shrinks"), 2);
    get(2, 4).await;
    get(2, 4).await;
    assert_eq!(
        fault::offers("shrinks"),
        2,
        "an inline shape kept offering blocks"
    );
    // Large again: laid out by the next GET, offered by the one after.
    c.put("shrinks", &[1], &column(100_000, 3)).await.unwrap();
    get(3, 100_000).await;
    get(3, 100_000).await;
    assert_eq!(fault::offers("shrinks"), 3);
    drop(c);
    server.shutdown().await;
}

/// A unit over shm (a 64 MiB pool) and a client of it (a 32 MiB receive pool).
async fn shm_pair() -> (Server, Client) {
    let server = Server::start(ServerConfig {
        bind: "127.0.0.1:0".into(),
        backend: Backend::Shm,
        pool_bytes: 64 << 20,
        ..ServerConfig::default()
    })
    .await
    .unwrap();
    let c = Client::connect(ClientConfig {
        units: vec![server.addr().to_owned()],
        backend: Backend::Shm,
        recv_pool_bytes: 32 << 20,
        timeout: Duration::from_secs(60),
        ..ClientConfig::default()
    })
    .await
    .unwrap();
    (server, c)
}

/// Over shm, the second PUT of a session lands in a credit and the second GET of a shape in
/// the block it offered, each in one round trip: both engines copy into ranges the other
/// announced as standing, without a grant, and the values read back whole. The offered
/// block keeps only what the values occupy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credits_and_offered_blocks_take_one_round_trip_over_shm() {
    let (server, c) = shm_pair().await;
    for round in 0..16 {
        c.put("p", &[1], &column(100_000, round)).await.unwrap();
        let got = c.get("p", &[1], &["x"]).await.unwrap();
        let vals = got[0][0].as_tensor().unwrap().as_slice::<i32>().unwrap();
        assert!(vals.iter().all(|&v| v == round), "round {round}");
        // The result keeps its frames' bytes of the receive pool, not the offered block's.
        assert!(
            c.recv_pool_used() < 400_000 + 4096,
            "{}",
            c.recv_pool_used()
        );
    }
    let s = server.stats();
    assert_eq!((s.pending_puts, s.pending_gets), (0, 0));
    // The client's PUTs after the first WRITE into its credits, the unit's GET WRITEs after
    // the first into blocks the client offered: standing, so without a grant, once the
    // writer's engine has read the announcement (it travels beside the answer that hands the
    // block over, so a WRITE that comes first asks for its grant as before; under load that
    // may be most of them, never all).
    assert!(
        c.agent().report().standing_writes >= 1,
        "{:?}",
        c.agent().report()
    );
    assert!(
        server.agent().report().standing_writes >= 1,
        "{:?}",
        server.agent().report()
    );
    drop(c);
    server.shutdown().await;
}

/// Over shm, a GET of 1,000 values written into the block it offered: the unit sends their
/// meta ahead of the WRITE (`Writing`), the client decodes it while the values land and
/// binds them to the block after `GetDone`; every value reads back as stored, round after
/// round, and nothing stays pending on either side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_get_decodes_its_meta_while_the_values_land() {
    let (server, c) = shm_pair().await;
    let n = 1000u64;
    let indexes: Vec<u64> = (0..n).collect();
    for round in 0..4u8 {
        let vals: Vec<Value> = indexes
            .iter()
            .map(|&i| {
                let fill = (i as u8) ^ round;
                Value::Tensor(Tensor::from_slice(&[4096], &vec![fill; 4096]).unwrap())
            })
            .collect();
        c.put("b", &indexes, &[("x".to_string(), vals.clone())])
            .await
            .unwrap();
        let got = c.get("b", &indexes, &["x"]).await.unwrap();
        assert_eq!(got[0], vals, "round {round}");
    }
    let s = server.stats();
    assert_eq!((s.pending_puts, s.pending_gets), (0, 0));
    drop(c);
    server.shutdown().await;
}

/// The unit's agent copies in the slices its configuration says: 1 MiB by default, and what
/// the configuration sets otherwise (the transport's floor applies).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_units_agent_copies_in_the_configured_slices() {
    let server = unit().await;
    assert_eq!(
        server.agent().copy_slice() as u64,
        ServerConfig::COPY_SLICE_DEFAULT
    );
    server.shutdown().await;
    for (set, used) in [(8 << 20, 8 << 20), (1, 64 << 10)] {
        let server = Server::start(ServerConfig {
            bind: "127.0.0.1:0".into(),
            backend: Backend::Inproc,
            pool_bytes: 32 << 20,
            copy_slice_bytes: set,
            ..ServerConfig::default()
        })
        .await
        .unwrap();
        assert_eq!(server.agent().copy_slice(), used, "{set}");
        server.shutdown().await;
    }
}
