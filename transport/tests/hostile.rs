//! Engines survive hostile peers: garbage on their sockets closes that connection only, and
//! memory that cannot be shared is refused with an error, not a hang.

use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Once;
use std::time::Duration;

use tessera_transport::testing::raw::{self, Answer, RawPeer, RawShm, RawTcp, Span};
use tessera_transport::testing::{hang_guard, pattern};
use tessera_transport::{shm::Shm, tcp::Tcp, Agent, Region, TransferError};

/// The engine address inside an agent's metadata (magic, version, name, kind, address).
fn address(meta: &[u8]) -> Vec<u8> {
    let name = meta[6] as usize;
    let kind = meta[7 + name] as usize;
    let at = 8 + name + kind;
    let len = u32::from_le_bytes(meta[at..at + 4].try_into().unwrap()) as usize;
    meta[at + 4..at + 4 + len].to_vec()
}

fn still_serves(target: &Agent, make: impl Fn(&str) -> Agent) {
    let a = make("honest");
    let ra = Region::new(4096).unwrap();
    let rb = Region::new(4096).unwrap();
    let ga = a.register(&ra).unwrap();
    let gb = target.register(&rb).unwrap();
    ra.write_at(0, &pattern(3, 4096)).unwrap();
    let peer = a.add_remote(&target.metadata()).unwrap();
    let t = peer
        .write(
            &[ga.desc(0, 4096).unwrap()],
            &[gb.remote(0, 4096).unwrap()],
            None,
        )
        .unwrap();
    t.wait_timeout(hang_guard()).unwrap();
    let mut got = vec![0u8; 4096];
    rb.read_at(0, &mut got).unwrap();
    assert_eq!(got, pattern(3, 4096));
}

#[test]
fn tcp_target_survives_garbage() {
    let target = Agent::new("target", Tcp::new()).unwrap();
    let addr = String::from_utf8(address(&target.metadata())).unwrap();
    for junk in [
        vec![0xFFu8; 24],                             // bad kind
        [1u8, 1, 0, 0, 255, 255, 255, 255].repeat(3), // descriptor count over the limit
        pattern(9, 10_000),                           // noise
        vec![1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0],     // truncated header
    ] {
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        let _ = s.write_all(&junk);
        drop(s);
    }
    still_serves(&target, |n| Agent::new(n, Tcp::new()).unwrap());
}

#[test]
fn shm_target_survives_garbage() {
    let target = Agent::new("target", Shm::new()).unwrap();
    let name = address(&target.metadata());
    for junk in [
        vec![5u8, 0, 0, 0, 255, 255, 255, 255],
        pattern(4, 5000),
        vec![2, 0, 0, 0, 1, 0, 0, 0, 7],
    ] {
        let addr = SocketAddr::from_abstract_name(&name).unwrap();
        let mut s = UnixStream::connect_addr(&addr).unwrap();
        let _ = s.write_all(&junk);
        drop(s);
    }
    still_serves(&target, |n| Agent::new(n, Shm::new()).unwrap());
}

/// Panics on the engines' own threads (named `shm-...` and `tcp-...`) since the first call,
/// counted by a panic hook that reports them as before.
fn engine_panics() -> usize {
    static COUNT: AtomicUsize = AtomicUsize::new(0);
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let report = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let name = std::thread::current().name().unwrap_or_default().to_owned();
            if name.starts_with("shm-") || name.starts_with("tcp-") {
                COUNT.fetch_add(1, Ordering::SeqCst);
            }
            report(info);
        }));
    });
    COUNT.load(Ordering::SeqCst)
}

/// The shm target reads at most `PRE_AUTH_MAX` bytes of a handshake, headers included: a
/// HELLO that fills the budget exactly is answered; one byte more, or an AUTH past what the
/// HELLO left, closes the connection at once, long before the (6 s) deadline, without
/// waiting for a body. An AUTH that fits what is left is read and its proof refused.
/// Malformed HELLOs, and a first frame of another type, close it without a CHALLENGE. No
/// thread of the engine panics on any of it.
#[test]
fn shm_handshake_reads_within_its_budget_and_refuses_malformed_hellos() {
    const H: usize = RawShm::HEADER;
    const MAX: usize = raw::PRE_AUTH_MAX;
    let panics = engine_panics();
    // Short, so that a target that waits for more than it may read fails this test soon.
    let deadline = Duration::from_secs(6);
    let target = Agent::new("target", Shm::new().with_handshake_deadline(deadline)).unwrap();
    let name = address(&target.metadata());
    let connect = || {
        let addr = SocketAddr::from_abstract_name(&name).unwrap();
        let s = UnixStream::connect_addr(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        s
    };
    // A well-formed HELLO body of `len` bytes: nonce, name, and an address padded out.
    let hello = |len: usize| {
        let mut b = auth::nonce().to_vec();
        b.push(6);
        b.extend_from_slice(b"client");
        assert!(len >= b.len());
        b.resize(len, 7);
        b
    };
    let header = |ty: u8, len: usize| {
        let mut h = vec![ty, 0, 0, 0];
        h.extend_from_slice(&(len as u32).to_le_bytes());
        h
    };
    let first_type = |s: &mut UnixStream| {
        let mut head = [0u8; H];
        s.read_exact(&mut head).unwrap();
        let len = u32::from_le_bytes(head[4..8].try_into().unwrap()) as usize;
        let mut body = vec![0u8; len];
        s.read_exact(&mut body).unwrap();
        head[0]
    };
    // Closed at once: well within the deadline, whatever it sent before.
    let closed_at_once = |s: UnixStream, what: &str| {
        let t = Instant::now();
        let got = drain_until_closed(s);
        assert!(
            t.elapsed() < deadline / 3,
            "{what}: closed only after {:?}",
            t.elapsed()
        );
        got
    };

    // A HELLO that fills the budget exactly is answered.
    let mut s = connect();
    s.write_all(&shm_frame(RawShm::HELLO, &hello(MAX - H)))
        .unwrap();
    assert_eq!(
        first_type(&mut s),
        RawShm::CHALLENGE,
        "a HELLO of the whole budget"
    );
    drop(s);
    // One byte more is refused before its body arrives.
    let mut s = connect();
    s.write_all(&header(RawShm::HELLO, MAX - H + 1)).unwrap();
    let got = closed_at_once(s, "a HELLO one byte over");
    assert!(got.is_empty(), "{got:?}");
    // An AUTH past what the HELLO left: refused before its body arrives.
    let mut s = connect();
    s.write_all(&shm_frame(RawShm::HELLO, &hello(100))).unwrap();
    assert_eq!(first_type(&mut s), RawShm::CHALLENGE);
    let left = MAX - H - 100;
    s.write_all(&header(RawShm::AUTH, left - H + 1)).unwrap();
    let got = closed_at_once(s, "an AUTH over what is left");
    assert!(got.is_empty(), "{got:?}");
    // Fewer bytes left than a header: refused without reading one.
    let mut s = connect();
    s.write_all(&shm_frame(RawShm::HELLO, &hello(MAX - H - 3)))
        .unwrap();
    assert_eq!(first_type(&mut s), RawShm::CHALLENGE);
    // The target may close before this arrives: it need not read it.
    let _ = s.write_all(&header(RawShm::AUTH, 0));
    let got = closed_at_once(s, "an AUTH with 3 bytes left");
    assert!(got.is_empty(), "{got:?}");
    // Exactly a header left: the empty AUTH is read, and its proof refused.
    let mut s = connect();
    s.write_all(&shm_frame(RawShm::HELLO, &hello(MAX - 2 * H)))
        .unwrap();
    assert_eq!(first_type(&mut s), RawShm::CHALLENGE);
    s.write_all(&header(RawShm::AUTH, 0)).unwrap();
    let got = closed_at_once(s, "an empty AUTH that fits");
    assert_eq!(shm_types(&got), [RawShm::REFUSED], "{got:?}");
    // Malformed HELLOs and another first frame: closed, never challenged.
    let good = hello(40);
    let mut no_name = good.clone();
    no_name[32] = 0;
    let mut long_name = good.clone();
    long_name[32] = 200;
    for (what, frame) in [
        (
            "a HELLO shorter than its nonce",
            shm_frame(RawShm::HELLO, &good[..32]),
        ),
        ("a HELLO without a name", shm_frame(RawShm::HELLO, &no_name)),
        (
            "a HELLO whose name overruns it",
            shm_frame(RawShm::HELLO, &long_name),
        ),
        ("another first frame", shm_frame(RawShm::MAP_REQ, &good)),
    ] {
        let mut s = connect();
        s.write_all(&frame).unwrap();
        let got = closed_at_once(s, what);
        assert!(
            !shm_types(&got).contains(&RawShm::CHALLENGE),
            "{what}: {got:?}"
        );
    }
    assert_eq!(engine_panics(), panics, "a thread of the engine panicked");
    still_serves(&target, |n| Agent::new(n, Shm::new()).unwrap());
}

/// A header announcing a body over the engine's limit (64 MiB) closes the connection at once,
/// before a byte of the body arrives and without making room for it.
#[test]
fn shm_refuses_an_oversized_body_before_it_arrives() {
    let target = Agent::new("target", Shm::new()).unwrap();
    let name = address(&target.metadata());
    let addr = SocketAddr::from_abstract_name(&name).unwrap();
    let mut s = UnixStream::connect_addr(&addr).unwrap();
    let mut header = vec![5u8, 0, 0, 0]; // XFER
    header.extend_from_slice(&((64u32 << 20) + 1).to_le_bytes());
    s.write_all(&header).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut buf = [0u8; 64];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(_) => continue,
            Err(e) => panic!("the target kept the connection open, waiting for the body: {e}"),
        }
    }
    still_serves(&target, |n| Agent::new(n, Shm::new()).unwrap());
}

#[test]
fn shm_refuses_private_memory_as_a_target() {
    let a = Agent::new("a", Shm::new()).unwrap();
    let b = Agent::new("b", Shm::new()).unwrap();
    let private = Region::anonymous(4096).unwrap();
    let gb = b.register(&private).unwrap();
    let ra = Region::anonymous(4096).unwrap(); // private is fine on the local side
    let ga = a.register(&ra).unwrap();
    let peer = a.add_remote(&b.metadata()).unwrap();
    let t = peer
        .write(
            &[ga.desc(0, 64).unwrap()],
            &[gb.remote(0, 64).unwrap()],
            None,
        )
        .unwrap();
    match t.wait_timeout(hang_guard()) {
        Err(TransferError::Backend { peer, source }) => {
            assert_eq!(peer, "b");
            assert_eq!(source.backend, "shm");
        }
        other => panic!("expected a backend error, got {other:?}"),
    }
}

// ----- trust: authentication, bounds, names, exposures --------------------------------------

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Instant;

use tessera_testkit::CountingAlloc;
use tessera_transport::auth::{self, Token};
use tessera_transport::{Inproc, Ops, RegisteredPool, RejectReason};

/// Counts allocations of 16 MiB or more: nothing in these tests makes one, except an engine
/// that makes room for a body a header merely announced, and the tests that send the largest
/// bodies on purpose. Those and the tests that watch the count take turns
/// ([`large_allocations`]), since the count is the whole process's.
#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc::new(16 << 20);

/// Held by a test that watches [`GLOBAL`] or makes allocations it would count.
fn large_allocations() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

/// Selects, in a re-executed copy of this binary, the attack `attacker` runs.
const ATTACK_VAR: &str = "TESSERA_HOSTILE_ATTACK";

fn token() -> Token {
    Token::new("the shared secret").unwrap()
}

/// `meta` with its engine address replaced by `addr` (and its registrations kept).
fn with_address(meta: &[u8], addr: &[u8]) -> Vec<u8> {
    let name = meta[6] as usize;
    let kind = meta[7 + name] as usize;
    let at = 8 + name + kind;
    let len = u32::from_le_bytes(meta[at..at + 4].try_into().unwrap()) as usize;
    let mut out = meta[..at].to_vec();
    out.extend_from_slice(&(addr.len() as u32).to_le_bytes());
    out.extend_from_slice(addr);
    out.extend_from_slice(&meta[at + 4 + len..]);
    out
}

fn shm_frame(ty: u8, body: &[u8]) -> Vec<u8> {
    let mut m = vec![ty, 0, 0, 0];
    m.extend_from_slice(&(body.len() as u32).to_le_bytes());
    m.extend_from_slice(body);
    m
}

/// Every byte the other end sends until it closes; panics if it stays open (a hang guard).
fn drain_until_closed(mut s: impl Read) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return got,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return got,
            Err(e) => panic!("the target kept the connection open: {e}"),
        }
    }
}

/// The message types in a stream of shm frames.
fn shm_types(mut bytes: &[u8]) -> Vec<u8> {
    let mut types = Vec::new();
    while bytes.len() >= 8 {
        let len = u32::from_le_bytes(bytes[4..8].try_into().unwrap()) as usize;
        types.push(bytes[0]);
        bytes = &bytes[(8 + len).min(bytes.len())..];
    }
    types
}

/// An unauthenticated client speaking the shm protocol: a HELLO (old and new form), then
/// MAP_REQ for ids 1..=64 and for `real`. Returns the message types it got before the close.
fn shm_attack(name: &[u8], real: u64) -> Vec<u8> {
    let addr = SocketAddr::from_abstract_name(name).unwrap();
    let mut s = UnixStream::connect_addr(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut out = shm_frame(1, b"client");
    let mut hello = auth::nonce().to_vec();
    hello.push(6);
    hello.extend_from_slice(b"client");
    out.extend(shm_frame(1, &hello));
    out.extend(shm_frame(11, &[0u8; 32])); // a made-up proof
    for id in (1..=64u64).chain([real]) {
        out.extend(shm_frame(2, &id.to_le_bytes()));
    }
    let _ = s.write_all(&out);
    shm_types(&drain_until_closed(&s))
}

/// An unauthenticated client speaking the tcp protocol: HELLO, then a READ of `len` bytes of
/// `real` and a WRITE of 4 KiB of 0xAB into it. Returns every byte it got before the close.
fn tcp_attack(addr: &str, real: u64, len: u64) -> Vec<u8> {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut out = vec![0u8; 24];
    out[0] = 3; // HELLO
    out[8..12].copy_from_slice(&6u32.to_le_bytes());
    out.extend_from_slice(&[0u8; 32]);
    out.extend_from_slice(b"client");
    let desc = |len: u64| {
        let mut d = real.to_le_bytes().to_vec();
        d.extend_from_slice(&0u64.to_le_bytes());
        d.extend_from_slice(&len.to_le_bytes());
        d
    };
    for (op, n) in [(1u8, len), (0u8, 4096)] {
        let mut head = vec![1u8, op, 0, 0];
        head.extend_from_slice(&1u32.to_le_bytes());
        head.resize(24, 0);
        out.extend(head);
        out.extend(desc(n));
        if op == 0 {
            out.extend(vec![0xABu8; 4096]);
        }
    }
    let _ = s.write_all(&out);
    drain_until_closed(&s)
}

/// Not a test of its own: the attacker side of the cross-user tests, run as another user in
/// a copy of this binary (it does nothing when the variable is unset).
#[test]
fn attacker() {
    let Ok(attack) = std::env::var(ATTACK_VAR) else {
        return;
    };
    let parts: Vec<&str> = attack.split(' ').collect();
    let real: u64 = parts[2].parse().unwrap();
    match parts[0] {
        "shm" => println!("GOT {:?}", shm_attack(parts[1].as_bytes(), real)),
        "tcp" => println!("GOT {:?}", tcp_attack(parts[1], real, 4096)),
        "tcp-dial" => {
            let a = Agent::new("nobody", Tcp::new()).unwrap();
            match a.add_remote(&unhex(parts[1])) {
                Ok(_) => println!("GOT added"),
                Err(e) => println!("GOT {e}"),
            }
        }
        _ => unreachable!(),
    }
}

/// Runs `attacker` as uid 65534 and returns what it printed.
fn attack_as_nobody(attack: &str) -> String {
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .arg(exe)
        .args(["--exact", "attacker", "--nocapture", "--test-threads", "1"])
        .env(ATTACK_VAR, attack)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "the attacker failed: {text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines()
        .find_map(|l| l.split_once("GOT ").map(|(_, g)| g.to_owned()))
        .unwrap_or_else(|| panic!("no result from the attacker: {text}"))
}

fn euid() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1).map(|u| u.parse().unwrap()))
        .unwrap()
}

fn secret_region() -> (Region, Vec<u8>) {
    let r = Region::new(1 << 16).unwrap();
    let secret = pattern(77, 1 << 16);
    r.write_at(0, &secret).unwrap();
    (r, secret)
}

fn unchanged(r: &Region, secret: &[u8]) {
    let mut got = vec![0u8; secret.len()];
    r.read_at(0, &mut got).unwrap();
    assert!(got == secret, "the attacker changed registered memory");
}

/// Finding 1, shm: a client that does not authenticate gets no memfd of any registration,
/// whether it guesses small ids or knows the real one: from another user against a
/// tokenless target (as root), and from this user against a target with a token.
#[test]
fn shm_unauthenticated_clients_get_no_memory() {
    let (r, _) = secret_region();
    let with_token = Agent::new("target", Shm::new().with_token(token())).unwrap();
    let g = with_token.register(&r).unwrap();
    let types = shm_attack(&address(&with_token.metadata()), g.id());
    assert!(
        !types.contains(&3),
        "a MAP_OK reached the attacker: {types:?}"
    );
    if euid() == 0 {
        let open = Agent::new("target2", Shm::new()).unwrap();
        let g = open.register(&r).unwrap();
        let name = String::from_utf8(address(&open.metadata())).unwrap();
        let got = attack_as_nobody(&format!("shm {name} {}", g.id()));
        let types: Vec<&str> = got
            .trim_matches(|c| c == '[' || c == ']')
            .split(", ")
            .collect();
        assert!(!types.contains(&"3"), "a MAP_OK reached uid 65534: {got}");
        still_serves(&open, |n| Agent::new(n, Shm::new()).unwrap());
    }
    still_serves(&with_token, |n| {
        Agent::new(n, Shm::new().with_token(token())).unwrap()
    });
}

/// Finding 1, tcp: a client that does not authenticate reads no byte and writes none.
#[test]
fn tcp_unauthenticated_clients_read_and_write_nothing() {
    let (r, secret) = secret_region();
    let with_token = Agent::new("target", Tcp::new().with_token(token())).unwrap();
    let g = with_token.register(&r).unwrap();
    let addr = String::from_utf8(address(&with_token.metadata())).unwrap();
    let got = tcp_attack(&addr, g.id(), 4096);
    assert!(
        got.len() <= 24 + 64 && !got.windows(64).any(|w| w == &secret[..64]),
        "the attacker got {} bytes",
        got.len()
    );
    unchanged(&r, &secret);
    if euid() == 0 {
        let open = Agent::new("target2", Tcp::new()).unwrap();
        let g2 = open.register(&r).unwrap();
        let addr = String::from_utf8(address(&open.metadata())).unwrap();
        let got = attack_as_nobody(&format!("tcp {addr} {}", g2.id()));
        // The attacker prints its bytes as a list: only a REFUSED header (24 bytes) at most.
        assert!(got.matches(',').count() < 24, "uid 65534 got bytes: {got}");
        unchanged(&r, &secret);
        still_serves(&open, |n| Agent::new(n, Tcp::new()).unwrap());
    }
    still_serves(&with_token, |n| {
        Agent::new(n, Tcp::new().with_token(token())).unwrap()
    });
}

/// tcp without a token: an agent of another user (as root) is refused before the challenge,
/// and its `add_remote` says why.
#[test]
fn tcp_another_users_agent_is_refused_and_told_why() {
    if euid() != 0 {
        return;
    }
    let open = Agent::new("target", Tcp::new()).unwrap();
    let got = attack_as_nobody(&format!("tcp-dial {} 0", hex(&open.metadata())));
    assert!(
        got.contains("target refused us: we run as another user and no token is configured"),
        "{got}"
    );
    assert_eq!(
        open.peer_link("nobody"),
        tessera_transport::LinkState::Closed
    );
}

/// A wrong or missing token fails `add_remote` with an error saying the tokens differ.
#[test]
fn mismatched_tokens_fail_add_remote_clearly() {
    type Make = fn(Option<Token>) -> Agent;
    let shm: Make = |t| match t {
        Some(t) => Agent::new("t", Shm::new().with_token(t)).unwrap(),
        None => Agent::new("t", Shm::new()).unwrap(),
    };
    let tcp: Make = |t| match t {
        Some(t) => Agent::new("t", Tcp::new().with_token(t)).unwrap(),
        None => Agent::new("t", Tcp::new()).unwrap(),
    };
    let shm_d: Make = |t| match t {
        Some(t) => Agent::new("d", Shm::new().with_token(t)).unwrap(),
        None => Agent::new("d", Shm::new()).unwrap(),
    };
    let tcp_d: Make = |t| match t {
        Some(t) => Agent::new("d", Tcp::new().with_token(t)).unwrap(),
        None => Agent::new("d", Tcp::new()).unwrap(),
    };
    let wrong = || Some(Token::new("another secret").unwrap());
    for (target, dialer) in [(shm, shm_d), (tcp, tcp_d)] {
        for (t, d) in [
            (Some(token()), wrong()),
            (Some(token()), None),
            (None, Some(token())),
        ] {
            let target = target(t);
            let dialer = dialer(d);
            let err = dialer
                .add_remote(&target.metadata())
                .unwrap_err()
                .to_string();
            assert!(err.contains("tokens differ"), "{err}");
        }
        let ok = dialer(Some(token())).add_remote(&target(Some(token())).metadata());
        assert!(ok.is_ok(), "{ok:?}");
    }
}

/// A dialer whose `AUTH` proof does not verify (one bit flipped), with the target's token or
/// without one, is refused with `REFUSED` (proof): no link is filed under its name, a WRITE
/// it sends next is never answered and lands nowhere, and the same name proving itself
/// honestly is admitted afterwards.
#[test]
fn a_target_refuses_a_dialer_whose_proof_does_not_verify() {
    fn flipped(proof: &[u8]) -> Vec<u8> {
        let mut p = proof.to_vec();
        p[0] ^= 1;
        p
    }
    fn check<P: RawPeer + std::fmt::Debug>(
        target: &Agent,
        token: Option<&Token>,
        real: u64,
        connect: fn(&[u8]) -> std::io::Result<P>,
        authenticate: fn(&mut P, Option<&Token>, bool) -> std::io::Result<()>,
    ) {
        let meta = target.metadata();
        let mut s = connect(&meta).unwrap();
        let err = authenticate(&mut s, token, true).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::PermissionDenied, "{err}");
        assert!(err.to_string().contains("refused our proof"), "{err}");
        assert_eq!(
            target.peer_link("raw"),
            tessera_transport::LinkState::Closed
        );
        let _ = s.request(
            tessera_transport::Op::Write,
            &[Span::new(real, 0, 4096)],
            &[0xAB; 4096],
        );
        assert_eq!(s.drain_until_closed().unwrap(), Vec::<u8>::new());
        let mut honest = connect(&meta).unwrap();
        authenticate(&mut honest, token, false).unwrap();
    }
    let t = token();
    for token in [Some(&t), None] {
        let (r, secret) = secret_region();
        let shm = match token {
            Some(t) => Agent::new("target", Shm::new().with_token(t.clone())).unwrap(),
            None => Agent::new("target", Shm::new()).unwrap(),
        };
        let g = shm.register(&r).unwrap();
        check(&shm, token, g.id(), RawShm::connect, |s, t, forge| {
            s.authenticate_sending("raw", t, if forge { &flipped } else { &<[u8]>::to_vec })
        });
        let tcp = match token {
            Some(t) => Agent::new("target", Tcp::new().with_token(t.clone())).unwrap(),
            None => Agent::new("target", Tcp::new()).unwrap(),
        };
        let g2 = tcp.register(&r).unwrap();
        check(&tcp, token, g2.id(), RawTcp::connect, |s, t, forge| {
            s.authenticate_sending("raw", t, if forge { &flipped } else { &<[u8]>::to_vec })
        });
        unchanged(&r, &secret);
    }
}

/// Selects, in a re-executed copy of this binary, an shm agent named `client` adding the
/// metadata (hex) in the variable.
const IMPOSTOR_VAR: &str = "TESSERA_HOSTILE_IMPOSTOR";

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(h: &str) -> Vec<u8> {
    (0..h.len() / 2)
        .map(|i| u8::from_str_radix(&h[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

/// Runs this binary's test `name` with `var` set to `value`; returns the text after
/// `marker` on its output.
fn rerun(name: &str, var: &str, value: &str, marker: &str) -> String {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads", "1"])
        .env(var, value)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.lines()
        .find_map(|l| l.split_once(marker).map(|(_, m)| m.to_owned()))
        .unwrap_or_else(|| panic!("no {marker} from the child: {text}"))
}

#[test]
fn impostor_child() {
    let Ok(meta) = std::env::var(IMPOSTOR_VAR) else {
        return;
    };
    let a = Agent::new("client", Shm::new()).unwrap();
    match a.add_remote(&unhex(&meta)) {
        Ok(_) => println!("IMPOSTOR added"),
        Err(e) => println!("IMPOSTOR {e}"),
    }
}

/// Finding 2: an agent that authenticates under the name of a peer with a live link is
/// refused (`name in use`), and the peer's link keeps working. On tcp the impostor is an
/// agent of this process; on shm, where a name belongs to a process, one of another.
#[test]
fn a_hello_under_a_live_peers_name_leaves_its_link_working() {
    for (make, shm) in [
        (
            (|n: &str| Agent::new(n, Tcp::new()).unwrap()) as fn(&str) -> Agent,
            false,
        ),
        (|n: &str| Agent::new(n, Shm::new()).unwrap(), true),
    ] {
        let unit = make("unit");
        let client = make("client");
        let rc = Region::new(4096).unwrap();
        let gc = client.register(&rc).unwrap();
        let ru = Region::new(4096).unwrap();
        let gu = unit.register(&ru).unwrap();
        let peer = client.add_remote(&unit.metadata()).unwrap();
        let write = |seed| {
            rc.write_at(0, &pattern(seed, 4096)).unwrap();
            peer.write(
                &[gc.desc(0, 4096).unwrap()],
                &[gu.remote(0, 4096).unwrap()],
                None,
            )
            .unwrap()
            .wait_timeout(hang_guard())
        };
        write(1).unwrap();
        let err = if shm {
            rerun(
                "impostor_child",
                IMPOSTOR_VAR,
                &hex(&unit.metadata()),
                "IMPOSTOR ",
            )
        } else {
            let impostor = make("client");
            impostor
                .add_remote(&unit.metadata())
                .unwrap_err()
                .to_string()
        };
        assert!(err.contains("name in use"), "{err}");
        write(2).unwrap();
        let mut got = vec![0u8; 4096];
        ru.read_at(0, &mut got).unwrap();
        assert_eq!(got, pattern(2, 4096));
        // The process that holds the name may connect again under it (a dropped handle).
        if shm {
            drop(peer);
            let again = client.add_remote(&unit.metadata());
            assert!(again.is_ok(), "{again:?}");
        }
    }
}

/// Two tcp agents adding each other at once share the links they end up with: each
/// `add_remote` succeeds (one of them through the other's link when refused `name in use`).
#[test]
fn tcp_agents_adding_each_other_at_once_both_succeed() {
    for _ in 0..20 {
        let a = Agent::new("a", Tcp::new()).unwrap();
        let b = Agent::new("b", Tcp::new()).unwrap();
        let (ma, mb) = (a.metadata(), b.metadata());
        std::thread::scope(|s| {
            let ta = s.spawn(|| a.add_remote(&mb).map(drop));
            let tb = s.spawn(|| b.add_remote(&ma).map(drop));
            ta.join().unwrap().unwrap();
            tb.join().unwrap().unwrap();
        });
    }
}

/// `add_remote` of an shm target whose listen backlog is full fails at its connect timeout
/// instead of blocking forever.
#[test]
fn shm_connect_to_a_full_backlog_fails_at_its_deadline() {
    let name = format!("tessera-hostile-backlog-{}", std::process::id());
    // SAFETY: plain socket creation; the result is checked and owned below.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    assert!(fd >= 0);
    // SAFETY: `fd` is a new socket nobody else owns.
    let listener = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: an all-zero sockaddr_un is valid.
    let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, &b) in sa.sun_path[1..].iter_mut().zip(name.as_bytes()) {
        *d = b as libc::c_char;
    }
    let len = (std::mem::offset_of!(libc::sockaddr_un, sun_path) + 1 + name.len()) as u32;
    // SAFETY: `sa` is initialized and `len` covers the family and the abstract name.
    let rc = unsafe {
        libc::bind(
            listener.as_raw_fd(),
            (&sa as *const libc::sockaddr_un).cast(),
            len,
        )
    };
    assert_eq!(rc, 0);
    // SAFETY: a bound socket; a backlog of 0 holds one pending connection.
    assert_eq!(unsafe { libc::listen(listener.as_raw_fd(), 0) }, 0);
    // Fill the backlog with connections nobody accepts.
    let mut fillers = Vec::new();
    loop {
        // SAFETY: as above.
        let c = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_NONBLOCK, 0) };
        // SAFETY: a new socket nobody else owns.
        let c = unsafe { OwnedFd::from_raw_fd(c) };
        // SAFETY: `sa` and `len` as for bind.
        let rc =
            unsafe { libc::connect(c.as_raw_fd(), (&sa as *const libc::sockaddr_un).cast(), len) };
        if rc != 0 {
            break;
        }
        fillers.push(c);
        assert!(fillers.len() < 1000, "the backlog never filled");
    }
    let timeout = Duration::from_secs(1);
    let dialer = Agent::new("dialer", Shm::new().with_connect_timeout(timeout)).unwrap();
    let honest = Agent::new("full", Shm::new()).unwrap();
    let meta = with_address(&honest.metadata(), name.as_bytes());
    let t = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(
            dialer
                .add_remote(&meta)
                .map(drop)
                .map_err(|e| e.to_string()),
        );
    });
    let result = rx
        .recv_timeout(hang_guard())
        .expect("add_remote blocked on a full backlog");
    let err = result.unwrap_err();
    assert!(err.contains("backlog"), "{err}");
    assert!(t.elapsed() >= timeout, "gave up after {:?}", t.elapsed());
    drop(fillers);
}

/// Finding 4: before authentication a header announcing a large body closes the
/// connection without making room for it; a handshake left half done closes at the deadline.
#[test]
fn pre_auth_bounds_close_without_allocating() {
    let _turn = large_allocations();
    // A short handshake deadline keeps the test quick; the default is 5 s.
    let deadline = Duration::from_secs(1);
    let target = Agent::new("target", Shm::new().with_handshake_deadline(deadline)).unwrap();
    let name = address(&target.metadata());
    let before = GLOBAL.bytes();
    let addr = SocketAddr::from_abstract_name(&name).unwrap();
    let mut s = UnixStream::connect_addr(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut header = vec![1u8, 0, 0, 0]; // HELLO
    header.extend_from_slice(&(60u32 << 20).to_le_bytes());
    s.write_all(&header).unwrap();
    s.write_all(&[0u8; 4096]).unwrap();
    drain_until_closed(&s);
    assert_eq!(GLOBAL.bytes(), before, "the announced body was allocated");
    // Silent after connecting (shm), and after a HELLO (tcp): closed, never acknowledged.
    let started = Instant::now();
    let s = UnixStream::connect_addr(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    assert!(drain_until_closed(&s).is_empty());
    let tcp = Agent::new("target", Tcp::new().with_handshake_deadline(deadline)).unwrap();
    let mut s =
        std::net::TcpStream::connect(String::from_utf8(address(&tcp.metadata())).unwrap()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut hello = vec![0u8; 24];
    hello[0] = 3;
    hello[8..12].copy_from_slice(&6u32.to_le_bytes());
    hello.extend_from_slice(&auth::nonce());
    hello.extend_from_slice(b"client");
    s.write_all(&hello).unwrap();
    let got = drain_until_closed(&s);
    assert!(got.first() != Some(&5), "a half handshake was acknowledged");
    assert!(started.elapsed() < hang_guard());
    assert!(started.elapsed() >= deadline, "closed before the deadline");
    still_serves(&target, |n| Agent::new(n, Shm::new()).unwrap());
    still_serves(&tcp, |n| Agent::new(n, Tcp::new()).unwrap());
}

/// After authentication, a request announcing four million descriptors (96 MiB) that never
/// come makes no room for them.
#[test]
fn tcp_descriptor_buffers_grow_only_as_bytes_arrive() {
    let _turn = large_allocations();
    let t = token();
    let target = Agent::new("target", Tcp::new().with_token(t.clone())).unwrap();
    let meta = target.metadata();
    let before = GLOBAL.bytes();
    let mut s = RawTcp::authenticated(&meta, "raw", Some(&t)).unwrap();
    let mut head = [0u8; RawTcp::HEADER];
    head[0] = RawTcp::XFER;
    head[4..8].copy_from_slice(&(1u32 << 22).to_le_bytes());
    s.send_header(head, &[0u8; 1000]).unwrap();
    drop(s);
    let deadline = Instant::now() + hang_guard();
    while target.peer_link("raw") != tessera_transport::LinkState::Closed {
        assert!(Instant::now() < deadline, "the link never closed");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        GLOBAL.bytes(),
        before,
        "the announced descriptors were allocated"
    );
}

/// A tcp request header is checked before anything it announces is read: a notification of
/// exactly the largest size is delivered and a request of exactly the most descriptors is
/// read and answered, while one byte or one descriptor more, or a kind that is no request,
/// closes the link at once, without an answer.
#[test]
fn tcp_request_headers_are_bounded_before_their_body() {
    let _turn = large_allocations();
    use tessera_transport::MAX_NOTIFICATION;
    let t = token();
    let target = Agent::new("target", Tcp::new().with_token(t.clone())).unwrap();
    let meta = target.metadata();
    // kind, op WRITE, has_note, descriptors, note length.
    let head = |kind: u8, n: usize, note: usize| {
        let mut h = [0u8; RawTcp::HEADER];
        h[0] = kind;
        h[1] = 1;
        h[2] = u8::from(note > 0);
        h[4..8].copy_from_slice(&(n as u32).to_le_bytes());
        h[8..12].copy_from_slice(&(note as u32).to_le_bytes());
        h
    };
    // Each raw link has a name of its own: the target may not have seen the last one close
    // when the next one says Hello, and it refuses a second live link of one name.
    // The largest notification arrives.
    let mut s = RawTcp::authenticated(&meta, "raw-note", Some(&t)).unwrap();
    let note = pattern(9, MAX_NOTIFICATION);
    s.send_header(head(RawTcp::XFER, 0, MAX_NOTIFICATION), &note)
        .unwrap();
    let got = target
        .wait_notification(hang_guard())
        .expect("the notification");
    assert_eq!(got.msg, note);
    drop(s);
    // The most descriptors are read, and refused by the grant (registration 0 is no one's):
    // answered, not closed.
    let mut s = RawTcp::authenticated(&meta, "raw-descs", Some(&t)).unwrap();
    s.send_header(
        head(RawTcp::XFER, RawTcp::MAX_DESCS, 0),
        &vec![0u8; RawTcp::MAX_DESCS * 24],
    )
    .unwrap();
    let mut resp = [0u8; RawTcp::HEADER];
    s.read_exact(&mut resp)
        .expect("an answer to the largest request");
    assert_eq!(resp[1], 1, "the request is refused: {resp:?}");
    drop(s);
    // One more, or no request at all: closed at once, unanswered (a target that waited for
    // the body would run into the read timeout).
    for (k, (what, h)) in [
        (
            "one byte of notification more",
            head(RawTcp::XFER, 0, MAX_NOTIFICATION + 1),
        ),
        (
            "one descriptor more",
            head(RawTcp::XFER, RawTcp::MAX_DESCS + 1, 0),
        ),
        ("a kind that is no request", head(9, 0, 0)),
    ]
    .into_iter()
    .enumerate()
    {
        let mut s = RawTcp::authenticated(&meta, &format!("raw-{k}"), Some(&t)).unwrap();
        s.stream()
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        s.send_header(h, &[]).unwrap();
        let got = s
            .drain_until_closed()
            .unwrap_or_else(|e| panic!("{what}: the link stayed open: {e}"));
        assert!(got.is_empty(), "{what}: answered {got:?}");
    }
    still_serves(&target, |n| {
        Agent::new(n, Tcp::new().with_token(t.clone())).unwrap()
    });
}

/// One request whose first span lies in an exposure of one scoped registration and whose
/// second names another scoped registration, exposed to nobody, at the same offsets: the
/// first span's exposure does not carry over, the request is refused `NotExposed`, and
/// neither registration is written.
#[test]
fn an_exposure_does_not_cover_another_registrations_span() {
    let unit = Agent::new("unit", Tcp::new()).unwrap();
    let (ra, secret_a) = secret_region();
    let (rb, secret_b) = secret_region();
    let a = unit.register_scoped(&ra).unwrap();
    let b = unit.register_scoped(&rb).unwrap();
    let _open = a.expose("raw", 0, 4096, Ops::WRITE).unwrap();
    let mut raw = RawTcp::authenticated(&unit.metadata(), "raw", None).unwrap();
    raw.request(
        tessera_transport::Op::Write,
        &[Span::new(a.id(), 0, 16), Span::new(b.id(), 0, 16)],
        &[0xAB; 32],
    )
    .unwrap();
    assert_eq!(
        raw.answer().unwrap(),
        Answer::Rejected(RejectReason::NotExposed)
    );
    // The other registration's span alone is refused too.
    raw.request(
        tessera_transport::Op::Write,
        &[Span::new(b.id(), 0, 16)],
        &[0xAB; 16],
    )
    .unwrap();
    assert_eq!(
        raw.answer().unwrap(),
        Answer::Rejected(RejectReason::NotExposed)
    );
    unchanged(&ra, &secret_a);
    unchanged(&rb, &secret_b);
}

/// Two spans of one request inside one exposure (the second reusing the first's lookup)
/// each land at their own offsets.
#[test]
fn spans_in_one_exposure_land_at_their_own_offsets() {
    let unit = Agent::new("unit", Tcp::new()).unwrap();
    let r = Region::new(8192).unwrap();
    let a = unit.register_scoped(&r).unwrap();
    let _open = a.expose("raw", 0, 8192, Ops::WRITE).unwrap();
    let mut raw = RawTcp::authenticated(&unit.metadata(), "raw", None).unwrap();
    let payload = pattern(11, 32);
    raw.request(
        tessera_transport::Op::Write,
        &[Span::new(a.id(), 100, 16), Span::new(a.id(), 4000, 16)],
        &payload,
    )
    .unwrap();
    assert_eq!(raw.answer().unwrap(), Answer::Granted(Vec::new()));
    let mut got = vec![0u8; 8192];
    r.read_at(0, &mut got).unwrap();
    let mut want = vec![0u8; 8192];
    want[100..116].copy_from_slice(&payload[..16]);
    want[4000..4016].copy_from_slice(&payload[16..]);
    assert!(got == want, "the spans landed elsewhere");
}

fn scoped_pair(make: fn(&str) -> Agent) {
    let unit = make("unit");
    let client = make("client");
    let pool = RegisteredPool::new_scoped(&unit, 1 << 20).unwrap();
    let block = pool.lease(8192, 4096).unwrap();
    let other = pool.lease(8192, 4096).unwrap();
    let rc = Region::new(1 << 16).unwrap();
    rc.write_at(0, &pattern(5, 1 << 16)).unwrap();
    let gc = client.register(&rc).unwrap();
    let plain = RegisteredPool::new(&unit, 1 << 16).unwrap();
    let peer = client.add_remote(&unit.metadata()).unwrap();
    let write = |remote: tessera_transport::RemoteDesc, len: u64| {
        peer.write(&[gc.desc(0, len).unwrap()], &[remote], None)
            .unwrap()
            .wait_timeout(hang_guard())
    };
    let read = |remote: tessera_transport::RemoteDesc, len: u64| {
        peer.read(&[gc.desc(32768, len).unwrap()], &[remote], None)
            .unwrap()
            .wait_timeout(hang_guard())
    };
    let not_exposed = |r: Result<(), TransferError>| {
        assert!(
            matches!(
                r,
                Err(TransferError::Rejected {
                    reason: RejectReason::NotExposed,
                    ..
                })
            ),
            "{r:?}"
        )
    };
    // Nothing is exposed yet.
    not_exposed(write(block.remote().unwrap(), 8192));
    not_exposed(read(block.remote().unwrap(), 8192));
    let e = block.expose("client", Ops::WRITE);
    // Another peer's name, another block, another op, a range past the exposure: refused.
    not_exposed(write(other.remote().unwrap(), 8192));
    not_exposed(read(block.remote().unwrap(), 8192));
    not_exposed(write(
        pool.registration()
            .remote(block.offset(), 8192 + 4096)
            .unwrap(),
        12288,
    ));
    assert_eq!(e.written(), 0);
    // shm counts at the target's DONE, which may trail the initiator's completion.
    write(block.remote_range(0, 1000).unwrap(), 1000).unwrap();
    assert_eq!(e.wait_written(1000, hang_guard()), 1000);
    write(block.remote_range(500, 1000).unwrap(), 1000).unwrap();
    assert_eq!(
        e.wait_written(1500, hang_guard()),
        1500,
        "overlapping writes count once"
    );
    assert_eq!(e.written(), 1500);
    assert!(!e.is_fully_written());
    write(block.remote_range(1500, 8192 - 1500).unwrap(), 8192 - 1500).unwrap();
    assert!(e.wait_fully_written(hang_guard()));
    assert!(e.is_fully_written());
    let mut got = vec![0u8; 1500];
    block.read_at(1500, &mut got).unwrap();
    assert_eq!(got, pattern(5, 6692)[..1500]);
    // A READ exposure to the same peer allows reading.
    let r = block.expose("client", Ops::READ);
    read(block.remote().unwrap(), 8192).unwrap();
    assert_eq!(r.written(), 0);
    drop(e);
    drop(r);
    not_exposed(write(block.remote().unwrap(), 8192));
    // An exposure to someone else does not let this peer in.
    let _someone = block.expose("someone", Ops::READ_WRITE);
    not_exposed(write(block.remote().unwrap(), 8192));
    // One request of several spans: each span is checked, also one that follows an exposed
    // span of the same registration (before the exposure or past its end).
    assert!(block.offset() < other.offset());
    let e2 = other.expose("client", Ops::WRITE);
    let write2 = |remotes: [tessera_transport::RemoteDesc; 2]| {
        let locals = [gc.desc(0, 100).unwrap(), gc.desc(100, 100).unwrap()];
        peer.write(&locals, &remotes, None)
            .unwrap()
            .wait_timeout(hang_guard())
    };
    let before = {
        let mut b = vec![0u8; 8192];
        block.read_at(0, &mut b).unwrap();
        b
    };
    not_exposed(write2([
        other.remote_range(0, 100).unwrap(),
        block.remote_range(0, 100).unwrap(),
    ]));
    not_exposed(write2([
        other.remote_range(0, 100).unwrap(),
        pool.registration()
            .remote(other.offset() + 8192, 100)
            .unwrap(),
    ]));
    let mut after = vec![0u8; 8192];
    block.read_at(0, &mut after).unwrap();
    assert_eq!(before, after, "a refused request writes nothing");
    write2([
        other.remote_range(0, 100).unwrap(),
        other.remote_range(1000, 100).unwrap(),
    ])
    .unwrap();
    assert_eq!(e2.wait_written(200, hang_guard()), 200);
    // Spans apart count as two ranges: the gap between them is still unwritten.
    write(other.remote_range(100, 100).unwrap(), 100).unwrap();
    assert_eq!(e2.wait_written(300, hang_guard()), 300);
    // Touching spans count once each.
    write2([
        other.remote_range(2000, 100).unwrap(),
        other.remote_range(2100, 100).unwrap(),
    ])
    .unwrap();
    assert_eq!(e2.wait_written(500, hang_guard()), 500);
    // Touching spans of two exposures count in each.
    assert_eq!(block.offset() + 8192, other.offset());
    let e1 = block.expose("client", Ops::WRITE);
    write2([
        block.remote_range(8192 - 100, 100).unwrap(),
        other.remote_range(4000, 100).unwrap(),
    ])
    .unwrap();
    assert_eq!(e2.wait_written(600, hang_guard()), 600);
    assert_eq!(e1.wait_written(100, hang_guard()), 100);
    assert_eq!(e2.written(), 600);
    // Unscoped registrations behave as before.
    let pb = plain.lease(4096, 4096).unwrap();
    write(pb.remote().unwrap(), 4096).unwrap();
    // An exposure there records what it covers and shuts nobody out.
    let counted = pb.expose("client", Ops::WRITE);
    let _elsewhere = pb.expose("someone", Ops::READ);
    write(pb.remote_range(0, 100).unwrap(), 100).unwrap();
    assert_eq!(counted.wait_written(100, hang_guard()), 100);
    read(pb.remote().unwrap(), 4096).unwrap();
}

/// Finding 7: scoped registrations grant only inside exposures, and exposures count what
/// completed WRITEs covered.
#[test]
fn scoped_registrations_grant_only_exposures_tcp() {
    scoped_pair(|n| Agent::new(n, Tcp::new()).unwrap());
}

#[test]
fn scoped_registrations_grant_only_exposures_shm() {
    scoped_pair(|n| Agent::new(n, Shm::new()).unwrap());
}

#[test]
fn scoped_registrations_grant_only_exposures_inproc() {
    scoped_pair(|n| Agent::new(n, Inproc::new()).unwrap());
}

/// Registration ids are random: neither small nor consecutive.
#[test]
fn registration_ids_are_not_guessable() {
    let a = Agent::new("a", Inproc::new()).unwrap();
    let r = Region::new(4096).unwrap();
    let ids: Vec<u64> = (0..8)
        .map(|_| {
            let g = a.register_range(&r, 0, 4096).unwrap();
            let id = g.id();
            drop(g);
            id
        })
        .collect();
    let mut sorted = ids.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), ids.len(), "ids repeat: {ids:?}");
    assert!(ids.iter().all(|&id| id > 1 << 32), "small ids: {ids:?}");
    assert!(
        ids.windows(2).all(|w| w[0].abs_diff(w[1]) > 1 << 16),
        "sequential ids: {ids:?}"
    );
}

/// Selects, in a re-executed copy of this binary, printing an inproc agent's metadata.
const INPROC_VAR: &str = "TESSERA_HOSTILE_INPROC";

#[test]
fn inproc_child() {
    if std::env::var_os(INPROC_VAR).is_none() {
        return;
    }
    let a = Agent::new("unit", Inproc::new()).unwrap();
    println!("META {}", hex(&a.metadata()));
}

/// Finding 8: inproc metadata from another process fails `add_remote`, naming both processes,
/// even when an agent of this process has the same address.
#[test]
fn inproc_peers_of_another_process_are_refused() {
    let meta = unhex(&rerun("inproc_child", INPROC_VAR, "1", "META "));
    // Agents of this process, so the child's agent number is likely taken here too.
    let _here: Vec<Agent> = (0..8)
        .map(|i| Agent::new(&format!("x{i}"), Inproc::new()).unwrap())
        .collect();
    let client = Agent::new("client", Inproc::new()).unwrap();
    let err = client.add_remote(&meta).unwrap_err().to_string();
    assert!(
        err.contains("inproc peers must live in one process"),
        "{err}"
    );
    assert!(err.contains(&std::process::id().to_string()), "{err}");
}

/// After authentication, an shm message announcing 60 MiB that never comes makes no room
/// for it: the reader's buffer grows only as bytes arrive.
#[test]
fn shm_reader_grows_only_as_bytes_arrive() {
    let _turn = large_allocations();
    let t = token();
    let target = Agent::new("target", Shm::new().with_token(t.clone())).unwrap();
    let meta = target.metadata();
    let before = GLOBAL.bytes();
    let mut s = RawShm::authenticated(&meta, "raw", Some(&t)).unwrap();
    let mut header = vec![RawShm::XFER, 0, 0, 0];
    header.extend_from_slice(&(60u32 << 20).to_le_bytes());
    s.write_all(&header).unwrap();
    s.write_all(&[0u8; 1000]).unwrap();
    drop(s);
    let deadline = Instant::now() + hang_guard();
    while target.peer_link("raw") != tessera_transport::LinkState::Closed {
        assert!(Instant::now() < deadline, "the link never closed");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(GLOBAL.bytes(), before, "the announced body was allocated");
}

/// After the handshake, a message of exactly the engine's largest body is read whole, and a
/// header announcing one byte more closes the connection at once, before any of its body.
#[test]
fn shm_reader_reads_the_largest_body_and_refuses_one_byte_more() {
    let _turn = large_allocations();
    let t = token();
    let target = Agent::new("target", Shm::new().with_token(t.clone())).unwrap();
    let meta = target.metadata();
    let header = |len: usize| {
        let mut h = vec![RawShm::XFER, 0, 0, 0];
        h.extend_from_slice(&(len as u32).to_le_bytes());
        h
    };
    // The whole of the largest body is taken in, well within the hang guard (the reader's
    // buffer grows by doubling, not by a few bytes at a time).
    let mut s = RawShm::authenticated(&meta, "raw", Some(&t)).unwrap();
    s.write_all(&header(RawShm::MAX_BODY)).unwrap();
    let started = Instant::now();
    for chunk in vec![0u8; RawShm::MAX_BODY].chunks(1 << 20) {
        s.write_all(chunk)
            .expect("the target stopped reading a body within its limit");
        assert!(
            started.elapsed() < hang_guard(),
            "the body was still being read"
        );
    }
    drop(s);
    // One byte more: closed on the header.
    let mut s = RawShm::authenticated(&meta, "raw2", Some(&t)).unwrap();
    s.write_all(&header(RawShm::MAX_BODY + 1)).unwrap();
    let started = Instant::now();
    s.drain_until_closed()
        .expect("the target waited for a body over its limit");
    assert!(started.elapsed() < hang_guard());
    still_serves(&target, |n| {
        Agent::new(n, Shm::new().with_token(t.clone())).unwrap()
    });
}

/// Messages that arrive back to back, more of them than the reader's buffer holds and split
/// anywhere, are each read whole and in order: the reader moves a partial message to the front
/// of its buffer and goes on.
#[test]
fn shm_reader_reads_messages_that_straddle_its_buffer() {
    let t = token();
    let target = Agent::new("target", Shm::new().with_token(t.clone())).unwrap();
    let mut s = RawShm::authenticated(&target.metadata(), "raw", Some(&t)).unwrap();
    // 300 notifications of 1,000 to 1,298 bytes: about 350 KiB in one write.
    let bodies: Vec<Vec<u8>> = (0..300u64).map(|i| pattern(i, 1000 + i as usize)).collect();
    let burst: Vec<u8> = bodies
        .iter()
        .flat_map(|b| shm_frame(RawShm::NOTIFY, b))
        .collect();
    s.write_all(&burst).unwrap();
    for (i, want) in bodies.iter().enumerate() {
        let got = target
            .wait_notification(hang_guard())
            .unwrap_or_else(|| panic!("notification {i} never came"));
        assert_eq!(
            (got.from.as_str(), &got.msg),
            ("raw", want),
            "notification {i}"
        );
    }
    drop(s);
}

/// tcp without a token listens only on loopback.
#[test]
fn tcp_without_a_token_refuses_to_listen_off_loopback() {
    let err = Agent::new("x", Tcp::bind("0.0.0.0:0".parse().unwrap())).unwrap_err();
    assert!(err.to_string().contains("without a token"), "{err}");
    let ok = Agent::new(
        "y",
        Tcp::bind("0.0.0.0:0".parse().unwrap()).with_token(token()),
    );
    assert!(ok.is_ok(), "{ok:?}");
}

/// Spans the honest initiator would refuse to send, straight from an authenticated raw peer:
/// one past the end of a registration and one whose end overflows are refused by the
/// target's own check, in both directions, and its memory stays as it was. The link stays
/// usable and the target serves others.
/// Returns what the granted READ brought back (`tcp`: the bytes; `shm`: nothing, since its
/// initiator copies through its own mapping).
fn target_refuses_bad_spans(raw: &mut dyn RawPeer, r: &Region, id: u64) -> Vec<u8> {
    let secret = pattern(77, 1 << 16);
    let past_end = Span::new(id, (1 << 16) - 4096, 8192);
    let overflowing = Span::new(id, u64::MAX - 100, 4096);
    for op in [tessera_transport::Op::Write, tessera_transport::Op::Read] {
        for span in [past_end, overflowing] {
            raw.request(op, &[span], &vec![0xAB; span.len as usize])
                .unwrap();
            assert_eq!(
                raw.answer().unwrap(),
                Answer::Rejected(RejectReason::OutOfRange),
                "{op:?} {span:?}"
            );
            unchanged(r, &secret);
        }
    }
    // Two spans, one fine and one past the end: all or nothing.
    raw.request(
        tessera_transport::Op::Write,
        &[Span::new(id, 0, 4096), past_end],
        &[0xAB; 4096 + 8192],
    )
    .unwrap();
    assert_eq!(
        raw.answer().unwrap(),
        Answer::Rejected(RejectReason::OutOfRange)
    );
    unchanged(r, &secret);
    // A span inside is granted on the same link.
    raw.request(tessera_transport::Op::Read, &[Span::new(id, 0, 4096)], &[])
        .unwrap();
    match raw.answer().unwrap() {
        Answer::Granted(got) => got,
        other => panic!("a span inside was refused: {other:?}"),
    }
}

#[test]
fn tcp_target_refuses_spans_out_of_range_from_a_raw_peer() {
    let (r, _) = secret_region();
    let target = Agent::new("target", Tcp::new()).unwrap();
    let g = target.register(&r).unwrap();
    let mut raw = RawTcp::authenticated(&target.metadata(), "raw", None).unwrap();
    let got = target_refuses_bad_spans(&mut raw, &r, g.id());
    assert_eq!(got, pattern(77, 4096));
    still_serves(&target, |n| Agent::new(n, Tcp::new()).unwrap());
}

#[test]
fn shm_target_refuses_spans_out_of_range_from_a_raw_peer() {
    let (r, _) = secret_region();
    let t = token();
    let target = Agent::new("target", Shm::new().with_token(t.clone())).unwrap();
    let g = target.register(&r).unwrap();
    let mut raw = RawShm::authenticated(&target.metadata(), "raw", Some(&t)).unwrap();
    assert!(target_refuses_bad_spans(&mut raw, &r, g.id()).is_empty());
    still_serves(&target, |n| {
        Agent::new(n, Shm::new().with_token(token())).unwrap()
    });
}

/// A raw peer with the wrong token, or none against a target that has one, is refused with
/// the engine's own words.
#[test]
fn raw_peers_with_the_wrong_token_are_refused() {
    let wrong = Token::new("another secret").unwrap();
    let tcp = Agent::new("target", Tcp::new().with_token(token())).unwrap();
    let shm = Agent::new("target", Shm::new().with_token(token())).unwrap();
    for tok in [Some(&wrong), None] {
        let e = RawTcp::authenticated(&tcp.metadata(), "raw", tok).unwrap_err();
        assert!(e.to_string().contains("tokens differ"), "{e}");
        let e = RawShm::authenticated(&shm.metadata(), "raw", tok).unwrap_err();
        assert!(e.to_string().contains("tokens differ"), "{e}");
    }
}
