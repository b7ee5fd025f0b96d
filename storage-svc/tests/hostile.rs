//! Hostile clients and peers: what each may take from the unit is bounded, the token never
//! travels, and a failure of one session stays with it. Every wait below is a hang guard, not
//! a timing assertion.

use std::time::{Duration, Instant};

use serde_bytes::ByteBuf;
use tessera_framecodec::{encode, Tensor, Value};
use tessera_storage::core::{Output, Unit, UnitConfig};
use tessera_storage::proto::{self, Request, Response};
use tessera_storage::testing::handshake::{self, Hello};
use tessera_storage::testing::VecMem;
use tessera_storage::{
    Backend, BackendExt, Client, ClientConfig, ClientError, ErrorKind, Server, ServerConfig, Token,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

const GUARD: Duration = Duration::from_secs(60);

async fn server(cfg: ServerConfig) -> Server {
    Server::start(ServerConfig {
        bind: "127.0.0.1:0".into(),
        backend: Backend::Inproc,
        pool_bytes: 32 << 20,
        ..cfg
    })
    .await
    .unwrap()
}

fn client_cfg(server: &Server) -> ClientConfig {
    ClientConfig {
        units: vec![server.addr().to_owned()],
        backend: Backend::Inproc,
        recv_pool_bytes: 16 << 20,
        timeout: GUARD,
        ..ClientConfig::default()
    }
}

async fn read_response(s: &mut (impl AsyncRead + Unpin)) -> Option<(u64, Response)> {
    let mut prefix = [0u8; proto::LEN_PREFIX];
    s.read_exact(&mut prefix).await.ok()?;
    let mut buf = vec![0u8; proto::frame_len(prefix, 1 << 30).ok()?];
    s.read_exact(&mut buf).await.ok()?;
    proto::decode_body::<Response>(&buf).ok()
}

/// The next answer, within the hang guard.
async fn answer(s: &mut TcpStream) -> Option<(u64, Response)> {
    tokio::time::timeout(GUARD, read_response(s))
        .await
        .expect("the unit neither answered nor closed the connection")
}

async fn call(s: &mut TcpStream, id: u64, req: &Request) -> Response {
    s.write_all(&proto::encode_frame(id, req).unwrap())
        .await
        .unwrap();
    answer(s).await.expect("an answer").1
}

/// Whether the unit closed the connection (reads end), within the hang guard.
async fn closed(s: &mut TcpStream) -> bool {
    let mut rest = Vec::new();
    tokio::time::timeout(GUARD, s.read_to_end(&mut rest))
        .await
        .expect("the unit did not close the connection")
        .is_ok()
}

fn error_kind(r: &Response) -> Option<ErrorKind> {
    match r {
        Response::Error(e) => Some(e.kind),
        _ => None,
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// Relays one TCP connection to `to`, recording every byte either way.
async fn recording_proxy(to: String) -> (String, tokio::task::JoinHandle<Vec<u8>>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        let (mut a, _) = l.accept().await.unwrap();
        let mut b = TcpStream::connect(&to).await.unwrap();
        let mut seen = Vec::new();
        let (mut buf_a, mut buf_b) = (vec![0u8; 1 << 16], vec![0u8; 1 << 16]);
        loop {
            tokio::select! {
                n = a.read(&mut buf_a) => match n {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        seen.extend_from_slice(&buf_a[..n]);
                        if b.write_all(&buf_a[..n]).await.is_err() { break; }
                    }
                },
                n = b.read(&mut buf_b) => match n {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        seen.extend_from_slice(&buf_b[..n]);
                        if a.write_all(&buf_b[..n]).await.is_err() { break; }
                    }
                },
            }
        }
        seen
    });
    (addr, task)
}

/// Finding: the token travelled in plaintext in HELLO. Now a client and a unit that share it
/// open a session with nothing on the wire but nonces and proofs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_never_crosses_the_wire() {
    let secret = "correct-horse-battery-staple";
    let server = server(ServerConfig {
        unit: UnitConfig {
            token: Some(Token::new(secret).unwrap()),
            ..UnitConfig::default()
        },
        ..ServerConfig::default()
    })
    .await;
    let (via, seen) = recording_proxy(server.addr().to_owned()).await;
    let cfg = ClientConfig {
        units: vec![via],
        token: Some(Token::new(secret).unwrap()),
        ..client_cfg(&server)
    };
    assert!(
        !format!("{cfg:?}").contains(secret),
        "Debug shows the token"
    );
    let c = Client::connect(cfg).await.unwrap();
    c.put("p", &[1], &[("x".into(), vec![Value::U64(1)])])
        .await
        .unwrap();
    drop(c);
    let seen = tokio::time::timeout(GUARD, seen).await.unwrap().unwrap();
    assert!(!seen.is_empty());
    assert!(
        !contains(&seen, secret.as_bytes()),
        "the token crossed the wire"
    );
    server.shutdown().await;
}

/// A wrong token: the client's proof is refused with `Unauthorized` and the connection
/// closed; before it, the unit showed nothing of its own (no agent metadata, no backend).
/// A client with the wrong token refuses the unit first (it cannot prove the token).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_is_unauthorized_and_learns_nothing() {
    let server = server(ServerConfig {
        unit: UnitConfig {
            token: Some(Token::new("s3cret").unwrap()),
            ..UnitConfig::default()
        },
        ..ServerConfig::default()
    })
    .await;
    let agent = Backend::Inproc.role_agent("raw").unwrap();
    let mut s = TcpStream::connect(server.addr()).await.unwrap();
    let hello = Hello::new(agent.metadata());
    let challenge = call(&mut s, 1, &hello.request()).await;
    let Response::Challenge { nonce, proof } = &challenge else {
        panic!("{challenge:?}")
    };
    assert_eq!((nonce.len(), proof.len()), (32, 32));
    let wrong = Token::new("guess").unwrap();
    assert!(!hello.unit_proves(&challenge, Some(&wrong)));
    assert!(hello.unit_proves(&challenge, Some(&Token::new("s3cret").unwrap())));
    let r = call(&mut s, 2, &hello.auth(&challenge, Some(&wrong))).await;
    assert_eq!(error_kind(&r), Some(ErrorKind::Unauthorized), "{r:?}");
    assert!(closed(&mut s).await);
    // The same through the client, with no token and a wrong one.
    for token in [None, Some(wrong)] {
        let had = token.is_some();
        let e = Client::connect(ClientConfig {
            token,
            ..client_cfg(&server)
        })
        .await
        .err()
        .expect("connected without the token");
        assert!(
            matches!(e, ClientError::Unauthenticated { unit: 0, had_token } if had_token == had),
            "{e}"
        );
        let said = e.to_string();
        assert!(
            said.contains(if had {
                "the tokens differ"
            } else {
                "requires a token"
            }),
            "{said}"
        );
        assert_eq!(e.kind(), Some(ErrorKind::Unauthorized));
    }
    // A replayed proof of another session is refused: the unit's nonce is new each time.
    let mut t = TcpStream::connect(server.addr()).await.unwrap();
    let good = Token::new("s3cret").unwrap();
    let again = call(&mut t, 1, &hello.request()).await;
    let r = call(&mut t, 2, &hello.auth(&challenge, Some(&good))).await;
    assert_ne!(again, challenge);
    assert_eq!(error_kind(&r), Some(ErrorKind::Unauthorized), "{r:?}");
    server.shutdown().await;
}

/// Finding: an unauthenticated connection could announce a frame of `max_message` (256 MiB)
/// and hold it. Before the handshake completed, a frame over `preauth_message_bytes` (64 KiB)
/// is refused and the connection closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unauthenticated_connection_cannot_send_a_large_frame() {
    let server = server(ServerConfig::default()).await;
    let mut s = TcpStream::connect(server.addr()).await.unwrap();
    s.write_all(&(1u32 << 20).to_le_bytes()).await.unwrap();
    let (_, r) = answer(&mut s).await.expect("an error answer");
    assert_eq!(error_kind(&r), Some(ErrorKind::TooLarge), "{r:?}");
    assert!(closed(&mut s).await);
    server.shutdown().await;
}

/// Finding: connections without a read deadline. One that never completes its handshake is
/// closed after `handshake_timeout`; one that trickles a request is closed after
/// `frame_timeout`; the unit keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_and_trickling_connections_are_closed() {
    let server = server(ServerConfig {
        handshake_timeout: Duration::from_millis(300),
        frame_timeout: Duration::from_millis(300),
        ..ServerConfig::default()
    })
    .await;
    // Connected, says nothing.
    let mut silent = TcpStream::connect(server.addr()).await.unwrap();
    let (_, r) = answer(&mut silent).await.expect("an error answer");
    assert_eq!(error_kind(&r), Some(ErrorKind::Unauthorized), "{r:?}");
    assert!(closed(&mut silent).await);
    // Says Hello, then trickles one byte of a request and stops.
    let agent = Backend::Inproc.role_agent("raw").unwrap();
    let mut slow = TcpStream::connect(server.addr()).await.unwrap();
    let hello = Hello::new(agent.metadata());
    let challenge = call(&mut slow, 1, &hello.request()).await;
    let welcome = call(&mut slow, 2, &hello.auth(&challenge, None)).await;
    assert!(matches!(welcome, Response::Welcome { .. }), "{welcome:?}");
    let frame = proto::encode_frame(3, &Request::Stats).unwrap();
    slow.write_all(&frame[..1]).await.unwrap();
    let (_, r) = answer(&mut slow).await.expect("an error answer");
    assert_eq!(error_kind(&r), Some(ErrorKind::Protocol), "{r:?}");
    assert!(closed(&mut slow).await);
    let c = Client::connect(client_cfg(&server)).await.unwrap();
    c.stats().await.unwrap();
    server.shutdown().await;
}

/// Finding: no connection cap. Beyond `max_connections` a connection gets a clear `Busy`
/// frame and is closed, counted in STATS; the connections served are not disturbed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_are_refused_clearly() {
    let server = server(ServerConfig {
        max_connections: 2,
        ..ServerConfig::default()
    })
    .await;
    let c = Client::connect(client_cfg(&server)).await.unwrap();
    let _idle = TcpStream::connect(server.addr()).await.unwrap();
    let mut refused = Vec::new();
    for _ in 0..3 {
        let mut s = TcpStream::connect(server.addr()).await.unwrap();
        let (_, r) = answer(&mut s).await.expect("a refusal");
        assert_eq!(error_kind(&r), Some(ErrorKind::Busy), "{r:?}");
        assert!(closed(&mut s).await);
        refused.push(s);
    }
    let st = &c.stats().await.unwrap()[0];
    assert_eq!((st.connections, st.refused_connections), (2, 3), "{st:?}");
    server.shutdown().await;
}

/// A unit over vector memory with open sessions `1` and `2`, of agents `client-1` and
/// `client-2`.
fn core_unit(cfg: UnitConfig) -> (Unit<VecMem>, Instant) {
    let mut unit = Unit::new(cfg, VecMem::new(1 << 26));
    let now = Instant::now();
    for s in [1, 2] {
        unit.open_session(s);
        let out = handshake::open(&mut unit, now, s, 0, vec![], None);
        assert!(matches!(out[..], [Output::Accept { .. }]), "{out:?}");
        unit.session_ready(s, &format!("client-{s}"));
    }
    (unit, now)
}

fn reply(out: &[Output]) -> &Response {
    match out {
        [Output::Reply { response, .. }, ..] => response,
        other => panic!("{other:?}"),
    }
}

fn empty_put(first: u64, n: u64) -> Request {
    let value = Value::List(vec![Value::List(
        (0..n).map(|_| Value::Bytes(Vec::new().into())).collect(),
    )]);
    let frames = encode(&value).unwrap();
    Request::Put {
        partition: "p".into(),
        indexes: (first..first + n).collect(),
        fields: vec!["x".into()],
        meta: ByteBuf::from(frames.meta.to_vec()),
        inline: Some(Vec::new()),
        pull: None,
    }
}

/// Finding: PUTs of empty values counted 0 bytes, so keys grew without bound. Each stored key
/// now costs `key_overhead_bytes` plus its length, and `max_stored_keys` bounds them.
#[test]
fn empty_values_are_not_free() {
    let (mut unit, now) = core_unit(UnitConfig {
        capacity_bytes: 100_000,
        ..UnitConfig::default()
    });
    let mut stored = 0;
    let refused = loop {
        let out = unit.handle(now, 1, stored + 10, empty_put(stored * 1000, 1000));
        match reply(&out) {
            Response::Done => stored += 1,
            other => break other.clone(),
        }
        assert!(stored < 1000, "empty values are never refused");
    };
    assert_eq!(
        error_kind(&refused),
        Some(ErrorKind::Capacity),
        "{refused:?}"
    );
    let st = unit.stats();
    assert!(
        st.charged_bytes <= 100_000 && st.charged_bytes >= st.keys * 64,
        "{st:?}"
    );
    // The key count is bounded on its own too.
    let (mut unit, now) = core_unit(UnitConfig {
        max_stored_keys: 1500,
        ..UnitConfig::default()
    });
    assert_eq!(
        reply(&unit.handle(now, 1, 1, empty_put(0, 1000))),
        &Response::Done
    );
    let r = reply(&unit.handle(now, 1, 2, empty_put(1000, 1000))).clone();
    assert_eq!(error_kind(&r), Some(ErrorKind::Capacity), "{r:?}");
    // Replacing stored keys adds none.
    assert_eq!(
        reply(&unit.handle(now, 1, 3, empty_put(0, 1000))),
        &Response::Done
    );
}

fn big_put(index: u64) -> Request {
    let big = Value::Tensor(Tensor::from_slice(&[100_000], &vec![7u8; 100_000]).unwrap());
    let frames = encode(&Value::List(vec![Value::List(vec![big])])).unwrap();
    Request::Put {
        partition: "q".into(),
        indexes: vec![index],
        fields: vec!["x".into()],
        meta: ByteBuf::from(frames.meta.to_vec()),
        inline: None,
        pull: None,
    }
}

/// Finding: quarantined blocks of open sessions piled up until every PUT of every client
/// failed `out_of_memory`. A session whose quarantine is full fails its own PUTs; another
/// session's PUTs go on. And a session failed by an expired PUT is closed, so its
/// quarantine is released once its client's link is torn down.
#[test]
fn a_full_quarantine_fails_only_its_own_session() {
    let (mut unit, now) = core_unit(UnitConfig {
        session_quarantine_limit: 150_000,
        quarantine_limit: 1 << 30,
        prepare_ttl: Duration::from_secs(5),
        ..UnitConfig::default()
    });
    for id in [1, 2] {
        let out = unit.handle(now, 1, id, big_put(id));
        assert!(matches!(reply(&out), Response::PutReady { .. }), "{out:?}");
        let cancel = Request::Cancel {
            of: id,
            maybe_written: true,
        };
        assert_eq!(
            reply(&unit.handle(now, 1, 10 + id, cancel)),
            &Response::Done
        );
    }
    let r = reply(&unit.handle(now, 1, 3, big_put(3))).clone();
    assert_eq!(error_kind(&r), Some(ErrorKind::OutOfMemory), "{r:?}");
    let Response::Error(e) = &r else { panic!() };
    assert!(e.message.contains("this client's quarantine"), "{e:?}");
    // The same client in a new session keeps what it left quarantined.
    unit.open_session(3);
    let out = handshake::open(&mut unit, now, 3, 0, vec![], None);
    assert!(matches!(out[..], [Output::Accept { .. }]), "{out:?}");
    unit.session_ready(3, "client-1");
    let r = reply(&unit.handle(now, 3, 3, big_put(5))).clone();
    assert_eq!(error_kind(&r), Some(ErrorKind::OutOfMemory), "{r:?}");
    let out = unit.handle(now, 2, 1, big_put(4));
    assert!(matches!(reply(&out), Response::PutReady { .. }), "{out:?}");
    // Session 2's prepared PUT expires: it fails, and it is closed.
    let out = unit.handle_timeout(now + Duration::from_secs(6));
    assert_eq!(error_kind(reply(&out)), Some(ErrorKind::PeerFailed));
    assert!(
        out.iter()
            .any(|o| matches!(o, Output::Close { session: 2 })),
        "{out:?}"
    );
}

/// Finding: the client never opened a new session after its connection was lost (or the
/// unit failed it). The request that met the failure fails; the next one opens a new
/// session transparently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_opens_a_new_session_after_its_session_ended() {
    let dir = tempfile::tempdir().unwrap();
    let bind = format!("unix:{}", dir.path().join("unit.sock").display());
    let cfg = || ServerConfig {
        bind: bind.clone(),
        backend: Backend::Shm,
        pool_bytes: 16 << 20,
        ..ServerConfig::default()
    };
    let first = Server::start(cfg()).await.unwrap();
    let c = Client::connect(ClientConfig {
        units: vec![bind.clone()],
        backend: Backend::Shm,
        recv_pool_bytes: 16 << 20,
        timeout: GUARD,
        ..ClientConfig::default()
    })
    .await
    .unwrap();
    c.put("p", &[1], &[("x".into(), vec![Value::U64(1)])])
        .await
        .unwrap();
    first.shutdown().await;
    let second = Server::start(cfg()).await.unwrap();
    // Whether or not the client noticed the close before this request, a new session serves
    // the next one at the latest.
    let _ = c.stats().await;
    let st = c.stats().await.expect("no new session was opened");
    assert_eq!(st[0].keys, 0, "a new unit answers");
    c.put("p", &[2], &[("x".into(), vec![Value::U64(2)])])
        .await
        .unwrap();
    second.shutdown().await;
}

/// Rewrites the address in agent metadata (the transport's format: magic, version, name,
/// kind, address, registrations).
fn with_address(md: &[u8], address: &[u8]) -> Vec<u8> {
    let mut at = 4 + 2;
    at += 1 + md[at] as usize; // name
    at += 1 + md[at] as usize; // kind
    let len = u32::from_le_bytes(md[at..at + 4].try_into().unwrap()) as usize;
    let mut out = md[..at].to_vec();
    out.extend_from_slice(&(address.len() as u32).to_le_bytes());
    out.extend_from_slice(address);
    out.extend_from_slice(&md[at + 4 + len..]);
    out
}

/// An abstract unix listener whose backlog is full: a connect to it blocks.
struct FullBacklog {
    fd: libc::c_int,
    _filler: std::os::unix::net::UnixStream,
}

impl FullBacklog {
    fn new(name: &str) -> Self {
        use std::os::linux::net::SocketAddrExt;
        use std::os::unix::net::{SocketAddr, UnixStream};
        let mut sa: libc::sockaddr_un =
            // SAFETY: sockaddr_un is plain data; all zeroes is a valid value.
            unsafe { std::mem::zeroed() };
        sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
        for (i, b) in name.bytes().enumerate() {
            sa.sun_path[i + 1] = b as libc::c_char;
        }
        let len = (size_of::<libc::sa_family_t>() + 1 + name.len()) as libc::socklen_t;
        // SAFETY: plain socket calls on a descriptor this function owns, with a sockaddr_un
        // that outlives them.
        let fd = unsafe {
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
            assert!(fd >= 0);
            assert_eq!(
                libc::bind(fd, &sa as *const _ as *const libc::sockaddr, len),
                0
            );
            assert_eq!(libc::listen(fd, 0), 0);
            fd
        };
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let filler = UnixStream::connect_addr(&addr).unwrap();
        Self {
            fd,
            _filler: filler,
        }
    }
}

impl Drop for FullBacklog {
    fn drop(&mut self) {
        // SAFETY: closes the descriptor this value owns, once; blocked connects then fail.
        unsafe { libc::close(self.fd) };
    }
}

/// Finding: HELLOs naming shm peers with a full listen backlog pinned the unit's blocking
/// threads in `connect()` and locked out new clients. Each such session now fails with a
/// clear `Transfer` error within `peer_add_timeout` and is closed; other clients connect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_that_cannot_be_reached_fail_only_their_session() {
    let name = format!("tessera-hostile-{}", std::process::id());
    let trap = FullBacklog::new(&name);
    let server = Server::start(ServerConfig {
        bind: "127.0.0.1:0".into(),
        backend: Backend::Shm,
        pool_bytes: 16 << 20,
        peer_add_timeout: Duration::from_millis(500),
        ..ServerConfig::default()
    })
    .await
    .unwrap();
    let agent = Backend::Shm.role_agent("hostile").unwrap();
    let md = with_address(&agent.metadata(), name.as_bytes());
    let mut hostile = Vec::new();
    for _ in 0..8 {
        let mut s = TcpStream::connect(server.addr()).await.unwrap();
        let hello = Hello::new(md.clone());
        let challenge = call(&mut s, 1, &hello.request()).await;
        s.write_all(&proto::encode_frame(2, &hello.auth(&challenge, None)).unwrap())
            .await
            .unwrap();
        hostile.push(s);
    }
    for s in &mut hostile {
        let (id, r) = answer(s).await.expect("an answer to Auth");
        assert_eq!(id, 2);
        assert_eq!(error_kind(&r), Some(ErrorKind::Transfer), "{r:?}");
        let Response::Error(e) = &r else { panic!() };
        assert!(e.message.contains("within"), "{e:?}");
        assert!(closed(s).await);
    }
    let c = Client::connect(ClientConfig {
        units: vec![server.addr().to_owned()],
        backend: Backend::Shm,
        recv_pool_bytes: 16 << 20,
        timeout: GUARD,
        ..ClientConfig::default()
    })
    .await
    .expect("a well-behaved client is locked out");
    c.stats().await.unwrap();
    drop(trap);
    drop(c);
    server.shutdown().await;
}

/// Finding: a client resumed after SIGSTOP reported a Timeout for an answer it had already
/// received (its timer and its socket became ready together). When a deadline fires, an
/// answer that is there (or that the reader is handing over) is taken first. Here a unit
/// answers just after the client's deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_that_came_is_not_a_timeout() {
    let timeout = Duration::from_millis(300);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let unit_agent = Backend::Inproc.role_agent("fake-unit").unwrap();
    let md = unit_agent.metadata();
    let unit = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        fake_welcome(&mut s, md).await;
        // STATS is answered just after the client's deadline.
        let (id, _) = read_request(&mut s).await;
        tokio::time::sleep(timeout + Duration::from_millis(20)).await;
        send(&mut s, id, &Response::Stats(Default::default())).await;
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest).await;
    });
    let c = Client::connect(ClientConfig {
        units: vec![addr],
        backend: Backend::Inproc,
        recv_pool_bytes: 1 << 20,
        timeout,
        ..ClientConfig::default()
    })
    .await
    .unwrap();
    let st = c.stats().await.expect("the answer came, yet a timeout");
    assert_eq!(st.len(), 1);
    drop(c);
    drop(unit_agent);
    unit.await.unwrap();
}

/// A fake unit's side of the handshake (Hello, Challenge, Auth, Welcome), with no token and
/// `md` as the unit's agent.
async fn fake_welcome(s: &mut (impl AsyncRead + AsyncWrite + Unpin), md: Vec<u8>) {
    use tessera_transport::auth;
    let (id, req) = read_request(s).await;
    let Request::Hello { nonce, agent } = req else {
        panic!("{req:?}")
    };
    let ours = auth::nonce();
    let parts = proto::handshake_parts(&nonce, &ours, &agent);
    let proof = auth::prove(None, proto::UNIT_PROOF, &parts);
    let challenge = Response::Challenge {
        nonce: ByteBuf::from(ours.to_vec()),
        proof: ByteBuf::from(proof.to_vec()),
    };
    send(s, id, &challenge).await;
    let (id, _) = read_request(s).await;
    let welcome = Response::Welcome {
        agent: md,
        backend: "inproc".into(),
        inline_max: 1024,
        align: 64,
    };
    send(s, id, &welcome).await;
}

/// Finding: a client whose write to the unit failed (the unit had closed) sent its next
/// request on the same session and failed again: the session counted as ended only once the
/// connection's reader had heard the close, a race on a busy machine. Here the unit shuts
/// only its reading side, so the reader hears nothing ever: the failed write alone must end
/// the session, and the next request opens a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_write_ends_the_session() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("unit.sock");
    let listener = tokio::net::UnixListener::bind(&path).unwrap();
    let unit_agent = Backend::Inproc.role_agent("fake-unit").unwrap();
    let md = unit_agent.metadata();
    let (shut_tx, shut) = tokio::sync::oneshot::channel();
    let unit = tokio::spawn(async move {
        let (mut first, _) = listener.accept().await.unwrap();
        fake_welcome(&mut first, md.clone()).await;
        let first = first.into_std().unwrap();
        first.shutdown(std::net::Shutdown::Read).unwrap();
        shut_tx.send(()).unwrap();
        let (mut second, _) = listener.accept().await.unwrap();
        fake_welcome(&mut second, md).await;
        let (id, req) = read_request(&mut second).await;
        assert!(matches!(req, Request::Stats), "{req:?}");
        send(&mut second, id, &Response::Stats(Default::default())).await;
        let mut rest = Vec::new();
        let _ = second.read_to_end(&mut rest).await;
        drop(first);
    });
    let c = Client::connect(ClientConfig {
        units: vec![format!("unix:{}", path.display())],
        backend: Backend::Inproc,
        recv_pool_bytes: 1 << 20,
        timeout: GUARD,
        ..ClientConfig::default()
    })
    .await
    .unwrap();
    shut.await.unwrap();
    let err = c.stats().await.expect_err("the unit reads nothing");
    assert!(matches!(err, ClientError::Io { .. }), "{err:?}");
    let st = c.stats().await.expect("no new session was opened");
    assert_eq!(st.len(), 1);
    drop(c);
    drop(unit_agent);
    unit.await.unwrap();
}

async fn read_request(s: &mut (impl AsyncRead + Unpin)) -> (u64, Request) {
    let mut prefix = [0u8; proto::LEN_PREFIX];
    s.read_exact(&mut prefix).await.unwrap();
    let mut buf = vec![0u8; proto::frame_len(prefix, 1 << 20).unwrap()];
    s.read_exact(&mut buf).await.unwrap();
    proto::decode_body::<Request>(&buf).unwrap()
}

async fn send(s: &mut (impl AsyncWrite + Unpin), id: u64, r: &Response) {
    s.write_all(&proto::encode_frame(id, r).unwrap())
        .await
        .unwrap();
}

/// A session opened by hand for `agent` (Hello, Auth, Welcome: request ids 1 and 2); the
/// stream and the unit's agent metadata.
async fn raw_session(
    server: &Server,
    agent: &tessera_transport::Agent,
    token: Option<&Token>,
) -> (TcpStream, Vec<u8>) {
    let mut s = TcpStream::connect(server.addr()).await.unwrap();
    let hello = Hello::new(agent.metadata());
    let challenge = call(&mut s, 1, &hello.request()).await;
    let welcome = call(&mut s, 2, &hello.auth(&challenge, token)).await;
    let Response::Welcome { agent: md, .. } = welcome else {
        panic!("no welcome: {welcome:?}")
    };
    (s, md)
}

/// Finding 7: PREPARE a PUT, COMMIT without WRITE, GET it: the block's previous contents (a
/// value another client had cleared) came back. Now such a COMMIT is refused and nothing is
/// published; once the WRITE landed, the same PUT commits and reads back as written. On
/// every engine where the unit is the target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_without_its_write_publishes_nothing() {
    const LEN: usize = 100_000; // `big_put`'s one frame
    for backend in [Backend::Shm, Backend::Tcp, Backend::Inproc] {
        let server = Server::start(ServerConfig {
            bind: "127.0.0.1:0".into(),
            backend,
            pool_bytes: 4 << 20,
            ..ServerConfig::default()
        })
        .await
        .unwrap();
        let victim = Client::connect(ClientConfig {
            backend,
            ..client_cfg(&server)
        })
        .await
        .unwrap();
        let secret = Value::Tensor(Tensor::from_slice(&[LEN as u64], &vec![0x5Au8; LEN]).unwrap());
        victim
            .put("q", &[1], &[("x".into(), vec![secret])])
            .await
            .unwrap();
        victim.clear("q", &[1]).await.unwrap();

        let agent = backend.role_agent("raw").unwrap();
        let (mut s, md) = raw_session(&server, &agent, None).await;
        let peer = agent.add_remote(&md).unwrap();
        let ready = call(&mut s, 3, &big_put(2)).await;
        let Response::PutReady { block, .. } = ready else {
            panic!("{backend}: no READY: {ready:?}")
        };
        let refused = call(&mut s, 4, &Request::Commit { put: 3 }).await;
        assert_eq!(
            error_kind(&refused),
            Some(ErrorKind::BadRequest),
            "{backend}: a COMMIT without its WRITE: {refused:?}"
        );
        let got = victim.get("q", &[2], &["x"]).await;
        assert!(
            matches!(&got, Err(e) if e.kind() == Some(ErrorKind::Missing)),
            "{backend}: an unwritten PUT was published: {got:?}"
        );

        let src = tessera_transport::Region::new(LEN as u64).unwrap();
        src.write_at(0, &vec![0xC3u8; LEN]).unwrap();
        let reg = agent.register(&src).unwrap();
        let dst = tessera_transport::RemoteDesc::new(block.reg, block.offset, LEN as u64);
        peer.write(&[reg.desc(0, LEN as u64).unwrap()], &[dst], None)
            .unwrap()
            .await
            .unwrap();
        let done = call(&mut s, 5, &Request::Commit { put: 3 }).await;
        assert!(
            matches!(done, Response::Done | Response::Stored { .. }),
            "{backend}: {done:?}"
        );
        let got = victim.get("q", &[2], &["x"]).await.unwrap();
        let bytes = got[0][0].as_tensor().unwrap().as_slice::<u8>().unwrap();
        assert!(
            bytes.iter().all(|&b| b == 0xC3),
            "{backend}: not what was written"
        );
        drop((got, peer, reg, agent, s, victim));
        server.shutdown().await;
    }
}

/// Credits, by hand: a `PutCredited` whose credit was not written publishes nothing (the
/// block may hold a value another client cleared), a credit is used once and only by its
/// session, a PUT larger than its credit is refused, and a credit that was written stores
/// exactly what was written, in one round trip. On every engine where the unit is the
/// target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_credit_publishes_only_what_was_written_into_it() {
    const LEN: usize = 100_000; // `big_put`'s one frame
    for backend in [Backend::Shm, Backend::Tcp, Backend::Inproc] {
        let server = Server::start(ServerConfig {
            bind: "127.0.0.1:0".into(),
            backend,
            // Credits may take an eighth of it: three for each of the two sessions.
            pool_bytes: 64 << 20,
            unit: UnitConfig {
                credit_bytes: 1 << 20,
                session_credits: 3,
                ..UnitConfig::default()
            },
            // How long the unit waits for a credit's frames to be recorded as written.
            transfer_timeout: Duration::from_millis(300),
            ..ServerConfig::default()
        })
        .await
        .unwrap();
        // A value cleared before: its bytes are what an unwritten credit would publish.
        let victim = Client::connect(ClientConfig {
            backend,
            ..client_cfg(&server)
        })
        .await
        .unwrap();
        for i in 0..4 {
            let secret =
                Value::Tensor(Tensor::from_slice(&[LEN as u64], &vec![0x5Au8; LEN]).unwrap());
            victim
                .put("v", &[i], &[("x".into(), vec![secret])])
                .await
                .unwrap();
        }
        victim.clear("v", &[0, 1, 2, 3]).await.unwrap();

        let agent = backend.role_agent("raw").unwrap();
        let (mut s, md) = raw_session(&server, &agent, None).await;
        let peer = agent.add_remote(&md).unwrap();
        let src = tessera_transport::Region::new(LEN as u64).unwrap();
        src.write_at(0, &vec![0xC3u8; LEN]).unwrap();
        let reg = agent.register(&src).unwrap();
        let write = |block: tessera_transport::RemoteDesc| {
            let dst = tessera_transport::RemoteDesc::new(block.reg, block.offset, LEN as u64);
            peer.write(&[reg.desc(0, LEN as u64).unwrap()], &[dst], None)
                .unwrap()
        };
        // The first pushed PUT's answer brings the credits.
        let Response::PutReady { block, agent: md } = call(&mut s, 3, &big_put(1)).await else {
            panic!("{backend}: no READY")
        };
        if let Some(md) = md {
            agent.add_remote(&md).unwrap();
        }
        write(block).await.unwrap();
        let stored = call(&mut s, 4, &Request::Commit { put: 3 }).await;
        let Response::Stored { credits, agent: md } = stored else {
            panic!("{backend}: {stored:?}")
        };
        if let Some(md) = md {
            agent.add_remote(&md).unwrap();
        }
        assert_eq!(credits.len(), 3, "{backend}: the session's credits");
        let credited = |index: u64, credit: u64| {
            let Request::Put {
                partition,
                indexes,
                fields,
                meta,
                ..
            } = big_put(index)
            else {
                unreachable!()
            };
            Request::PutCredited {
                partition,
                indexes,
                fields,
                meta,
                credit,
                bytes: LEN as u64,
            }
        };
        // Named without its WRITE: refused once the unit waited its transfer timeout for the
        // frames, nothing published, the credit used up.
        let refused = call(&mut s, 5, &credited(2, credits[0].id)).await;
        assert_eq!(
            error_kind(&refused),
            Some(ErrorKind::BadRequest),
            "{backend}: {refused:?}"
        );
        let got = victim.get("q", &[2], &["x"]).await;
        assert!(
            matches!(&got, Err(e) if e.kind() == Some(ErrorKind::Missing)),
            "{backend}: an unwritten credit was published: {got:?}"
        );
        let again = call(&mut s, 6, &credited(2, credits[0].id)).await;
        assert_eq!(
            error_kind(&again),
            Some(ErrorKind::UnknownTransfer),
            "{backend}: {again:?}"
        );
        // Another session cannot name this one's credit.
        let (mut other, _) = raw_session(&server, &agent, None).await;
        let stolen = call(&mut other, 3, &credited(2, credits[1].id)).await;
        assert_eq!(
            error_kind(&stolen),
            Some(ErrorKind::UnknownTransfer),
            "{backend}: {stolen:?}"
        );
        // A PUT larger than its credit is refused.
        let huge = Value::Tensor(Tensor::from_slice(&[2 << 20], &vec![1u8; 2 << 20]).unwrap());
        let frames = encode(&Value::List(vec![Value::List(vec![huge])])).unwrap();
        let too_big = Request::PutCredited {
            partition: "q".into(),
            indexes: vec![3],
            fields: vec!["x".into()],
            meta: ByteBuf::from(frames.meta.to_vec()),
            credit: credits[2].id,
            bytes: 2 << 20,
        };
        let r = call(&mut s, 7, &too_big).await;
        assert_eq!(
            error_kind(&r),
            Some(ErrorKind::TooLarge),
            "{backend}: {r:?}"
        );
        // Written: stored in one round trip, exactly what was written, with a new credit.
        write(credits[1].block).await.unwrap();
        let r = call(&mut s, 8, &credited(2, credits[1].id)).await;
        let Response::Stored { credits: more, .. } = r else {
            panic!("{backend}: {r:?}")
        };
        assert!(!more.is_empty(), "{backend}: the session is topped up");
        let got = victim.get("q", &[2], &["x"]).await.unwrap();
        let bytes = got[0][0].as_tensor().unwrap().as_slice::<u8>().unwrap();
        assert!(
            bytes.iter().all(|&b| b == 0xC3),
            "{backend}: not what was written"
        );
        // The value keeps its frames' part of the credit only; the refused PUTs' credits,
        // whose WRITE might still have been on its way, wait in quarantine.
        let st = server.stats();
        assert_eq!(st.quarantined_bytes, 2 << 20, "{backend}: {st:?}");
        assert!(
            st.pool.used - st.credit_bytes - st.quarantined_bytes < 2 * (LEN as u64) + 4096,
            "{backend}: {st:?}"
        );
        drop((got, peer, reg, agent, s, other, victim));
        server.shutdown().await;
    }
}

/// A unit and a client over `backend` sharing `token`, the client holding one stored value.
async fn unit_with_a_value(backend: Backend, token: &Token) -> (Server, Client) {
    let server = Server::start(ServerConfig {
        bind: "127.0.0.1:0".into(),
        backend,
        pool_bytes: 4 << 20,
        unit: UnitConfig {
            token: Some(token.clone()),
            ..UnitConfig::default()
        },
        ..ServerConfig::default()
    })
    .await
    .unwrap();
    let c = Client::connect(ClientConfig {
        backend,
        token: Some(token.clone()),
        ..client_cfg(&server)
    })
    .await
    .unwrap();
    let v = Value::Tensor(Tensor::from_slice(&[4096], &vec![0x11u8; 4096]).unwrap());
    c.put("p", &[1], &[("x".into(), vec![v])]).await.unwrap();
    (server, c)
}

async fn still_intact(c: &Client) {
    let got = c
        .get("p", &[1], &["x"])
        .await
        .expect("the client's session survives");
    let bytes = got[0][0].as_tensor().unwrap().as_slice::<u8>().unwrap();
    assert!(bytes.iter().all(|&b| b == 0x11), "the stored value changed");
}

/// Finding 1: with `--token`, any local process mapped the unit's pool through the shm
/// socket, or read and wrote it through the tcp payload port: the token guarded the control
/// socket only. Now a payload peer without the token (or with another) is refused at its
/// handshake, even holding the unit's full metadata (engine address, registration ids).
/// Runs as the unit's own user: the transport's hostile tests add another uid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payload_peers_without_the_token_reach_nothing() {
    use tessera_transport::{shm::Shm, tcp::Tcp, Agent};
    let token = Token::new("payload-secret").unwrap();
    let wrong = Token::new("guess").unwrap();
    for backend in [Backend::Shm, Backend::Tcp] {
        let (server, c) = unit_with_a_value(backend, &token).await;
        let md = server.agent().metadata();
        for attacker_token in [None, Some(wrong.clone())] {
            let attacker = match (backend, attacker_token) {
                (Backend::Shm, None) => Agent::new("attacker", Shm::new()),
                (Backend::Shm, Some(t)) => Agent::new("attacker", Shm::new().with_token(t)),
                (_, None) => Agent::new("attacker", Tcp::new()),
                (_, Some(t)) => Agent::new("attacker", Tcp::new().with_token(t)),
            }
            .unwrap();
            let added = attacker.add_remote(&md);
            assert!(
                added.is_err(),
                "{backend}: a peer without the token was let in"
            );
        }
        still_intact(&c).await;
        drop(c);
        server.shutdown().await;
    }
}

/// Finding 2: a tcp payload HELLO under a client's agent name retired that client's link,
/// and every later request of the client failed `peer_failed`. Now a name with a live link
/// cannot be claimed by another peer, even one holding the token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_under_a_clients_name_leaves_its_session_alone() {
    use tessera_transport::{tcp::Tcp, Agent};
    let token = Token::new("payload-secret").unwrap();
    let (server, c) = unit_with_a_value(Backend::Tcp, &token).await;
    let impostor = Agent::new(c.agent().name(), Tcp::new().with_token(token.clone())).unwrap();
    let claimed = impostor.add_remote(&server.agent().metadata());
    assert!(claimed.is_err(), "another peer claimed the client's name");
    still_intact(&c).await;
    drop((impostor, c));
    server.shutdown().await;
}
