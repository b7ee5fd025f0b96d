//! Hostile load against a running unit, shared by the soak test (`tests/soak.rs`) and the
//! `hostile` suite of tessera-bench (which includes this file by path): attackers that hold
//! or abuse sockets with raw bytes, attackers that abuse a valid session through the public
//! `Client` API, a checksummed probe, and the soak workload (mixed PUT/GET/CLEAR, every
//! value derived from a seed and verified on every GET against what the client stored and
//! cleared).
//!
//! Protocol-specific parts, to update when the wire changes, are all in [`wire`] (raw
//! control-plane and payload-engine bytes), [`serve_token_args`] and [`client_config`] (how
//! a unit is given its token and how a session presents it), and the `Request::Put` the
//! prepare flood sends through `Client::raw`.

#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_bytes::ByteBuf;
use tessera_storage::proto::Request;
use tessera_storage::{Backend, Client, ClientConfig, ClientError, ErrorKind, Value};

/// The bytes that depend on the wire formats, in one place.
pub mod wire {
    /// Control plane: a frame is a little-endian u32 body length, then the body.
    pub fn control_prefix(len: u32) -> [u8; 4] {
        len.to_le_bytes()
    }

    /// The largest length a control-plane prefix can announce.
    pub const CONTROL_HUGE: u32 = u32::MAX;

    /// Bytes a payload-engine connection opens with to announce a `len`-byte body, never
    /// authenticated. shm: an 8-byte header (type, three zero bytes, u32 body length; type 5
    /// is a transfer). tcp: a 24-byte header whose count and length words (bytes 4..16) all
    /// announce `len`.
    pub fn payload_header(tcp: bool, len: u32) -> Vec<u8> {
        let l = len.to_le_bytes();
        if tcp {
            let mut h = vec![0u8; 24];
            h[0] = 1;
            for w in 1..4 {
                h[w * 4..w * 4 + 4].copy_from_slice(&l);
            }
            h
        } else {
            let mut h = vec![5, 0, 0, 0];
            h.extend_from_slice(&l);
            h
        }
    }

    /// The shm engine's abstract socket names of process `pid`, from `/proc/net/unix`
    /// (`@tessera-shm-<pid>-<n>`), without the leading `@`.
    pub fn shm_sockets(pid: u32) -> Vec<String> {
        let prefix = format!("@tessera-shm-{pid}-");
        let Ok(text) = std::fs::read_to_string("/proc/net/unix") else {
            return Vec::new();
        };
        let mut out: Vec<String> = text
            .lines()
            .filter_map(|l| l.split_whitespace().nth(7))
            .filter(|p| p.starts_with(&prefix))
            .map(|p| p[1..].to_owned())
            .collect();
        out.sort();
        out.dedup();
        out
    }
}

/// The `tessera-storage serve` arguments that make a unit require `token`.
pub fn serve_token_args(token: &str) -> [String; 2] {
    ["--token".into(), token.into()]
}

/// A session's configuration for a unit at `addr` requiring `token`.
pub fn client_config(addr: &str, backend: Backend, token: &str, pool: u64) -> ClientConfig {
    ClientConfig {
        units: vec![addr.to_owned()],
        backend,
        token: Some(tessera_storage::Token::new(token).expect("a non-empty token")),
        recv_pool_bytes: pool,
        timeout: Duration::from_secs(20),
        ..ClientConfig::default()
    }
}

/// What an attack is aimed at.
#[derive(Clone, Debug)]
pub struct Target {
    /// The unit's control address (`HOST:PORT`).
    pub control: String,
    /// The unit's process id (its shm sockets are named after it).
    pub pid: u32,
    pub backend: Backend,
    /// tcp backend: the unit's payload engine address.
    pub payload: Option<SocketAddr>,
    /// A valid session's configuration.
    pub session: ClientConfig,
}

impl Target {
    fn control_addr(&self) -> SocketAddr {
        self.control
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .unwrap_or_else(|| panic!("control address {:?}", self.control))
    }
}

/// One kind of attack and its size.
#[derive(Clone, Debug)]
pub enum Kind {
    /// Connections to the control address that never send a byte.
    Idle(usize),
    /// Connections that each send a frame's length prefix, then one byte a second.
    Slowloris(usize),
    /// Connections sending garbage frames and huge length prefixes, one after the other.
    Garbage,
    /// A valid session pipelining GETs of `2^20` keys never stored, in requests of this
    /// many keys.
    MissingGets(usize),
    /// A valid session storing this many keys per PUT (at most 2^20), each a one-element
    /// tensor, over and over (the same keys, replaced), its indexes out of order: not an
    /// abuse, the heaviest PUTs a client may make.
    HugePuts(usize),
    /// Sessions preparing PUTs of this many bytes that are never written or committed.
    PrepareFlood { sessions: usize, bytes: usize },
    /// Unauthenticated connections to the unit's payload engine announcing 64 MiB bodies,
    /// half sending nothing more, half a byte a second.
    PayloadPreauth(usize),
}

impl Kind {
    pub fn name(&self) -> &'static str {
        match self {
            Kind::Idle(_) => "idle",
            Kind::Slowloris(_) => "slowloris",
            Kind::Garbage => "garbage",
            Kind::MissingGets(_) => "missing_gets",
            Kind::HugePuts(_) => "huge_puts",
            Kind::PrepareFlood { .. } => "prepare_flood",
            Kind::PayloadPreauth(_) => "payload_preauth",
        }
    }
}

/// Counters of a running attack.
#[derive(Debug, Default)]
pub struct Counters {
    /// Connections opened, or requests sent.
    pub ops: AtomicU64,
    /// Connections the unit refused or closed, or requests it failed.
    pub refused: AtomicU64,
    /// The first answer of the unit that refused a session attack's request.
    pub first_refusal: Mutex<Option<String>>,
}

impl Counters {
    fn refuse(&self, why: impl FnOnce() -> String) {
        self.refused.fetch_add(1, Ordering::Relaxed);
        let mut first = self.first_refusal.lock().unwrap();
        if first.is_none() {
            *first = Some(why());
        }
    }
}

/// A running attack: its threads stop and close everything they opened when it is stopped
/// or dropped.
pub struct Attack {
    pub name: &'static str,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    pub counters: Arc<Counters>,
    /// Connections to open before the attack is at full strength.
    warm: u64,
}

/// An attack thread's work: until the flag is set, counting into the counters.
type Body = Box<dyn FnOnce(&AtomicBool, &Counters) + Send>;

/// Runs first on every attack thread (the bench pins them to a core).
pub type ThreadInit = Option<fn()>;

impl Attack {
    /// Starts `kind` against `t` on its own threads.
    pub fn start(kind: &Kind, t: &Target, init: ThreadInit) -> Attack {
        let stop = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(Counters::default());
        let mut threads = Vec::new();
        let mut spawn = |f: Body| {
            let (stop, counters) = (stop.clone(), counters.clone());
            threads.push(
                std::thread::Builder::new()
                    .name(format!("attack-{}", kind.name()))
                    .spawn(move || {
                        if let Some(init) = init {
                            init();
                        }
                        f(&stop, &counters)
                    })
                    .expect("attack thread"),
            );
        };
        let t = t.clone();
        match kind.clone() {
            Kind::Idle(n) => {
                let addr = t.control_addr();
                spawn(Box::new(move |s, c| idle(addr, n, s, c)));
            }
            Kind::Slowloris(n) => {
                let addr = t.control_addr();
                spawn(Box::new(move |s, c| slowloris(addr, n, s, c)));
            }
            Kind::Garbage => {
                let addr = t.control_addr();
                spawn(Box::new(move |s, c| garbage(addr, s, c)));
            }
            Kind::MissingGets(chunk) => {
                let cfg = t.session.clone();
                spawn(Box::new(move |s, c| {
                    block_on(missing_gets(cfg, chunk, s, c))
                }));
            }
            Kind::HugePuts(keys) => {
                let cfg = t.session.clone();
                spawn(Box::new(move |s, c| block_on(huge_puts(cfg, keys, s, c))));
            }
            Kind::PrepareFlood { sessions, bytes } => {
                for i in 0..sessions {
                    let cfg = t.session.clone();
                    spawn(Box::new(move |s, c| {
                        block_on(prepare_flood(cfg, i, bytes, s, c))
                    }));
                }
            }
            Kind::PayloadPreauth(n) => {
                let t = t.clone();
                spawn(Box::new(move |s, c| payload_preauth(&t, n, s, c)));
            }
        }
        let warm = match kind {
            Kind::Idle(n) | Kind::Slowloris(n) | Kind::PayloadPreauth(n) => *n as u64,
            _ => 0,
        };
        Attack {
            name: kind.name(),
            stop,
            threads,
            counters,
            warm,
        }
    }

    /// Waits, at most `max`, until the attack has opened all its connections.
    pub fn wait_warm(&self, max: Duration) {
        let end = Instant::now() + max;
        while self.counters.ops.load(Ordering::Relaxed) < self.warm && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the attack and waits for its threads, which close every socket they hold.
    pub fn stop(mut self) {
        self.halt();
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Attack {
    fn drop(&mut self) {
        self.halt();
    }
}

fn nap(stop: &AtomicBool, d: Duration) -> bool {
    let end = Instant::now() + d;
    while Instant::now() < end {
        if stop.load(Ordering::SeqCst) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20).min(end - Instant::now()));
    }
    !stop.load(Ordering::SeqCst)
}

fn connect(addr: SocketAddr, c: &Counters) -> Option<TcpStream> {
    c.ops.fetch_add(1, Ordering::Relaxed);
    match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
        Ok(s) => Some(s),
        Err(_) => {
            c.refused.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

/// Whether the unit closed `s` (read end of stream or an error; would-block is alive).
fn closed(s: &mut TcpStream) -> bool {
    let _ = s.set_nonblocking(true);
    let mut b = [0u8; 256];
    let gone = match s.read(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    };
    let _ = s.set_nonblocking(false);
    gone
}

fn idle(addr: SocketAddr, n: usize, stop: &AtomicBool, c: &Counters) {
    let mut socks: Vec<Option<TcpStream>> = Vec::with_capacity(n);
    while socks.len() < n && !stop.load(Ordering::SeqCst) {
        socks.push(connect(addr, c));
    }
    // Reopen what the unit closes, so the pressure stays.
    while nap(stop, Duration::from_millis(500)) {
        for s in socks.iter_mut() {
            if stop.load(Ordering::SeqCst) {
                break;
            }
            if s.as_mut().is_none_or(closed) {
                c.refused.fetch_add(1, Ordering::Relaxed);
                *s = connect(addr, c);
            }
        }
    }
}

/// Announces frames of this many bytes, sent a byte a second.
const SLOW_FRAME: u32 = 1000;

fn slowloris(addr: SocketAddr, n: usize, stop: &AtomicBool, c: &Counters) {
    let open = |c: &Counters| {
        let mut s = connect(addr, c)?;
        s.set_write_timeout(Some(Duration::from_millis(100))).ok()?;
        s.write_all(&wire::control_prefix(SLOW_FRAME)).ok()?;
        Some(s)
    };
    let mut socks: Vec<Option<TcpStream>> = Vec::with_capacity(n);
    while socks.len() < n && !stop.load(Ordering::SeqCst) {
        socks.push(open(c));
    }
    while nap(stop, Duration::from_secs(1)) {
        for s in socks.iter_mut() {
            if stop.load(Ordering::SeqCst) {
                break;
            }
            let alive = s.as_mut().is_some_and(|s| s.write_all(&[0]).is_ok());
            if !alive {
                c.refused.fetch_add(1, Ordering::Relaxed);
                *s = open(c);
            }
        }
    }
}

/// xorshift64*: cheap, deterministic, good enough for content and choices.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

fn garbage(addr: SocketAddr, stop: &AtomicBool, c: &Counters) {
    let mut rng = Rng::new(0x6a7b);
    let mut round = 0u64;
    while !stop.load(Ordering::SeqCst) {
        round += 1;
        let Some(mut s) = connect(addr, c) else {
            nap(stop, Duration::from_millis(50));
            continue;
        };
        let _ = s.set_write_timeout(Some(Duration::from_millis(200)));
        let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
        let mut msg = Vec::new();
        match round % 3 {
            // A huge announced frame, then a little of it.
            0 => msg.extend_from_slice(&wire::control_prefix(wire::CONTROL_HUGE)),
            // A body just over 4 KiB that is not a request.
            1 => msg.extend_from_slice(&wire::control_prefix(5000)),
            // A small body of random bytes.
            _ => msg.extend_from_slice(&wire::control_prefix(64)),
        }
        let body = if round % 3 == 1 { 5000 } else { 64 };
        msg.extend((0..body).map(|_| rng.next_u64() as u8));
        let _ = s.write_all(&msg);
        // Whatever the unit answers, until it closes or goes quiet.
        let mut sink = [0u8; 4096];
        while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
        drop(s);
        nap(stop, Duration::from_millis(5));
    }
}

fn payload_preauth(t: &Target, n: usize, stop: &AtomicBool, c: &Counters) {
    enum Sock {
        Unix(UnixStream),
        Tcp(TcpStream),
    }
    impl Sock {
        fn write(&mut self, b: &[u8]) -> bool {
            match self {
                Sock::Unix(s) => s.write_all(b).is_ok(),
                Sock::Tcp(s) => s.write_all(b).is_ok(),
            }
        }
    }
    let tcp = t.backend == Backend::Tcp;
    let open = |c: &Counters| -> Option<Sock> {
        c.ops.fetch_add(1, Ordering::Relaxed);
        let mut s = if tcp {
            let s = TcpStream::connect_timeout(&t.payload?, Duration::from_secs(1)).ok()?;
            s.set_write_timeout(Some(Duration::from_millis(100))).ok()?;
            Sock::Tcp(s)
        } else {
            use std::os::linux::net::SocketAddrExt;
            let name = wire::shm_sockets(t.pid).into_iter().next()?;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).ok()?;
            let s = UnixStream::connect_addr(&addr).ok()?;
            s.set_write_timeout(Some(Duration::from_millis(100))).ok()?;
            Sock::Unix(s)
        };
        s.write(&wire::payload_header(tcp, 64 << 20)).then_some(s)
    };
    let mut socks: Vec<Option<Sock>> = Vec::with_capacity(n);
    while socks.len() < n && !stop.load(Ordering::SeqCst) {
        let s = open(c);
        if s.is_none() {
            c.refused.fetch_add(1, Ordering::Relaxed);
        }
        socks.push(s);
    }
    while nap(stop, Duration::from_secs(1)) {
        for (i, s) in socks.iter_mut().enumerate() {
            // Odd ones trickle, even ones only hold the socket.
            let alive = match s.as_mut() {
                Some(s) if i % 2 == 1 => s.write(&[0]),
                Some(_) => true,
                None => false,
            };
            if !alive {
                c.refused.fetch_add(1, Ordering::Relaxed);
                *s = open(c);
            }
        }
    }
}

/// Runs an attack that needs a session on a current-thread runtime of its own thread.
fn block_on(f: impl std::future::Future<Output = ()>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("attack runtime");
    rt.block_on(f);
}

async fn missing_gets(cfg: ClientConfig, chunk: usize, stop: &AtomicBool, c: &Counters) {
    let timeout = cfg.timeout;
    let Some(client) = session(cfg, stop, c).await else {
        return;
    };
    let mut chunk = chunk.clamp(1, 1 << 20);
    let mut base = 1u64 << 40;
    while !stop.load(Ordering::SeqCst) {
        // 2^20 missing keys per round, every chunk in flight at once.
        let keys: Vec<Vec<u64>> = (0..(1usize << 20).div_ceil(chunk))
            .map(|k| {
                let start = base + (k * chunk) as u64;
                (start..start + chunk as u64).collect()
            })
            .collect();
        base += 1 << 20;
        let client = &client;
        let reqs = keys.iter().map(|k| async move {
            tokio::time::timeout(timeout, client.get("missing-flood", k, &["v"])).await
        });
        c.ops.fetch_add(keys.len() as u64, Ordering::Relaxed);
        let Some(answers) = until_stopped(stop, join_all(reqs.collect())).await else {
            return;
        };
        let mut refused = false;
        for r in answers {
            match r {
                Ok(Err(ClientError::Remote { source, .. }))
                    if source.kind == ErrorKind::Missing => {}
                // A unit that takes fewer keys per request (`max_keys`) gets more requests.
                Ok(Err(e @ ClientError::Remote { .. })) => {
                    c.refuse(|| e.to_string());
                    refused = true;
                }
                other => c.refuse(|| format!("{other:?}")),
            }
        }
        if refused && chunk > 1024 {
            chunk /= 2;
        }
    }
}

async fn huge_puts(cfg: ClientConfig, keys: usize, stop: &AtomicBool, c: &Counters) {
    let timeout = cfg.timeout;
    let Some(client) = session(cfg, stop, c).await else {
        return;
    };
    // Shuffled by a fixed odd multiplier modulo a power of two: every index once.
    let n = keys.clamp(1, 1 << 20).next_power_of_two() as u64;
    let indexes: Vec<u64> = (0..n).map(|i| i.wrapping_mul(0x9e37_79b9) % n).collect();
    let values: Vec<Value> = (0..n)
        .map(|i| {
            let t = tessera_storage::Tensor::from_slice(&[1], &[i as f32]).expect("a tensor");
            Value::Tensor(t)
        })
        .collect();
    let columns = vec![("v".to_owned(), values)];
    while !stop.load(Ordering::SeqCst) {
        c.ops.fetch_add(1, Ordering::Relaxed);
        let put = tokio::time::timeout(timeout, client.put("huge-puts", &indexes, &columns));
        match until_stopped(stop, put).await {
            None => return,
            Some(Ok(Ok(()))) => {}
            Some(other) => c.refuse(|| format!("{other:?}")),
        }
    }
}

async fn prepare_flood(cfg: ClientConfig, i: usize, bytes: usize, stop: &AtomicBool, c: &Counters) {
    let timeout = cfg.timeout;
    let Some(client) = session(cfg, stop, c).await else {
        return;
    };
    // Only the meta frame travels: the PUT asks for a receive block and is never written.
    let big = Value::List(vec![Value::List(vec![Value::Bytes(Bytes::from(
        vec![0u8; bytes],
    ))])]);
    let meta = tessera_framecodec::encode(&big).expect("encode").meta;
    let mut k = 0u64;
    while !stop.load(Ordering::SeqCst) {
        k += 1;
        let req = Request::Put {
            partition: format!("prepare-flood-{i}"),
            indexes: vec![k],
            fields: vec!["v".into()],
            meta: ByteBuf::from(meta.to_vec()),
            inline: None,
            pull: None,
        };
        c.ops.fetch_add(1, Ordering::Relaxed);
        let Some(answer) =
            until_stopped(stop, tokio::time::timeout(timeout, client.raw(0, req))).await
        else {
            return;
        };
        if !matches!(
            answer,
            Ok(Ok(tessera_storage::proto::Response::PutReady { .. }))
        ) {
            c.refuse(|| format!("{answer:?}"));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A session of `cfg`, or `None` when it fails or `stop` is set first.
async fn session(cfg: ClientConfig, stop: &AtomicBool, c: &Counters) -> Option<Client> {
    match until_stopped(stop, Client::connect(cfg)).await? {
        Ok(client) => Some(client),
        Err(e) => {
            c.refuse(|| format!("connect: {e}"));
            None
        }
    }
}

/// `f`'s output, or `None` as soon as `stop` is set (`f` is dropped).
async fn until_stopped<F: std::future::Future>(stop: &AtomicBool, f: F) -> Option<F::Output> {
    let watch = async {
        while !stop.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::select! {
        out = f => Some(out),
        () = watch => None,
    }
}

pub use tessera_storage::testing::join_all;

// ----- content ----------------------------------------------------------------------------

/// Bytes of the random pattern values are cut from: the soak's largest value and a page.
const PATTERN: usize = (64 << 20) + PAGE;
/// Every this many bytes a value carries its seed.
const PAGE: usize = 4096;

/// The random pattern, made once per process.
fn pattern() -> &'static [u8] {
    static P: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    P.get_or_init(|| {
        let mut rng = Rng::new(0x7e55_e4a0);
        (0..PATTERN / 8)
            .flat_map(|_| rng.next_u64().to_le_bytes())
            .collect()
    })
}

/// Where the value of `seed` starts in the pattern: a multiple of 8 below a page.
fn offset(seed: u64) -> usize {
    (Rng::new(seed).next_u64() % (PAGE as u64 / 8)) as usize * 8
}

/// `len` bytes derived from `seed`: a stretch of a fixed random pattern from a place `seed`
/// picks, with `seed` over the first 8 bytes of every 4 KiB, so that no page of another
/// value passes for one of this value. Made at memcpy speed: the load generator's own work
/// must not be what a soak measures. Values longer than the pattern come from an RNG.
pub fn content(seed: u64, len: usize) -> Bytes {
    content_in_parts(seed, len, keep_core)
}

/// [`content`], calling `between` after each [`PART`] of it.
fn content_in_parts(seed: u64, len: usize, between: fn()) -> Bytes {
    if len > PATTERN - PAGE {
        let mut rng = Rng::new(seed);
        let mut v = Vec::with_capacity(len + 8);
        while v.len() < len {
            if v.len() % PART == 0 && !v.is_empty() {
                between();
            }
            v.extend_from_slice(&rng.next_u64().to_le_bytes());
        }
        v.truncate(len);
        return Bytes::from(v);
    }
    let at = offset(seed);
    let stamp = seed.to_le_bytes();
    let mut v = Vec::with_capacity(len);
    for (i, part) in pattern()[at..at + len].chunks(PART).enumerate() {
        if i > 0 {
            between();
        }
        let from = v.len();
        v.extend_from_slice(part);
        for page in v[from..].chunks_mut(PAGE) {
            let n = page.len().min(8);
            page[..n].copy_from_slice(&stamp[..n]);
        }
    }
    Bytes::from(v)
}

/// Whether `got` is exactly [`content`]`(seed, len)`, as bytes.
pub fn matches(got: &Value, seed: u64, len: usize) -> bool {
    matches_in_parts(got, seed, len, keep_core)
}

/// [`matches`], calling `between` after each [`PART`] of the value.
fn matches_in_parts(got: &Value, seed: u64, len: usize, between: fn()) -> bool {
    let data: &[u8] = match got {
        Value::Bytes(b) => b,
        _ => return false,
    };
    if data.len() != len {
        return false;
    }
    if len > PATTERN - PAGE {
        return data == &content_in_parts(seed, len, between)[..];
    }
    let at = offset(seed);
    let want = &pattern()[at..at + len];
    let stamp = seed.to_le_bytes();
    let parts = data.chunks(PART).zip(want.chunks(PART));
    parts.enumerate().all(|(i, (got, want))| {
        if i > 0 {
            between();
        }
        got.chunks(PAGE).zip(want.chunks(PAGE)).all(|(got, want)| {
            let n = got.len().min(8);
            got[..n] == stamp[..n] && got[n..] == want[n..]
        })
    })
}

/// Bytes of a value made or checked between two calls of the `between` given, a multiple of
/// [`PAGE`]: about 100 us of work into fresh pages.
const PART: usize = 256 << 10;

/// Offers the core to any other thread that wants it ([`SoakConfig::give_way`]).
fn give_way() {
    std::thread::yield_now();
}

/// Goes on at once.
fn keep_core() {}

// ----- probe ------------------------------------------------------------------------------

/// Bytes of the probe's value.
pub const PROBE_BYTES: usize = 1 << 20;

/// A well-behaved session: PUT then GET of one checksummed 1 MiB value.
pub struct Probe {
    client: Client,
    seed: u64,
    timeout: Duration,
    n: u64,
}

impl Probe {
    pub async fn connect(cfg: ClientConfig, timeout: Duration) -> Result<Probe, ClientError> {
        Ok(Probe {
            client: Client::connect(cfg).await?,
            seed: 0x9e0be,
            timeout,
            n: 0,
        })
    }

    /// One PUT + GET round trip and its time; an error or timeout counts as the timeout.
    pub async fn once(&mut self) -> (Duration, bool) {
        self.n += 1;
        let seed = self.seed ^ self.n;
        let value = content(seed, PROBE_BYTES);
        let key = [self.n % 4];
        let cols = [("v".to_string(), vec![Value::Bytes(value)])];
        let t = Instant::now();
        let put = self.client.put("probe", &key, &cols);
        let ok = match tokio::time::timeout(self.timeout, put).await {
            Ok(Ok(())) => {
                let get = self.client.get("probe", &key, &["v"]);
                match tokio::time::timeout(self.timeout.saturating_sub(t.elapsed()), get).await {
                    Ok(Ok(cols)) => matches(&cols[0][0], seed, PROBE_BYTES),
                    _ => false,
                }
            }
            _ => false,
        };
        let d = t.elapsed();
        if ok {
            (d, true)
        } else {
            (self.timeout.max(d), false)
        }
    }

    /// Round trips for `d`: their times and how many failed.
    pub async fn run_for(&mut self, d: Duration) -> (Vec<Duration>, u64) {
        let end = Instant::now() + d;
        let (mut times, mut errors) = (Vec::new(), 0);
        while Instant::now() < end {
            let (t, ok) = self.once().await;
            times.push(t);
            errors += u64::from(!ok);
        }
        (times, errors)
    }
}

/// The `q` quantile of `times` (0 when empty).
pub fn quantile(times: &[Duration], q: f64) -> Duration {
    if times.is_empty() {
        return Duration::ZERO;
    }
    let mut v = times.to_vec();
    v.sort();
    v[quantile_index(v.len(), q)]
}

/// Where the `q` quantile lies among `len` sorted values (`len` > 0): the nearest rank.
pub fn quantile_index(len: usize, q: f64) -> usize {
    ((len - 1) as f64 * q).round() as usize
}

// ----- soak -------------------------------------------------------------------------------

/// The soak workload's size.
#[derive(Clone, Debug)]
pub struct SoakConfig {
    pub sessions: usize,
    /// How long the timed part runs.
    pub duration: Duration,
    /// Load before the timed part, whose latencies are not kept (its GETs are still
    /// checked). Both start once every session has connected.
    pub warmup: Duration,
    /// Keys each session cycles through.
    pub keys: u64,
    /// Values above this many bytes take a permit of [`SoakConfig::large_in_flight`] and
    /// are cleared once verified, so that few are stored or in flight at once.
    pub large: usize,
    pub large_in_flight: usize,
    pub max_bytes: usize,
    /// Whether a thread making or checking a large value offers its core between parts of
    /// it. A value over [`SMALL_VALUE`] is made at the idle priority, and that is not enough
    /// for the sessions' latencies: their runtime's worker busy-polls, so it is often
    /// preempted rather than woken, and the scheduler then runs an idle thread it picked (a
    /// new one starts with as much claim as any) until the next tick, 4 ms here, with the
    /// worker runnable behind it. Off beside attackers that share the core at the idle
    /// priority too: each offer would hand one of them a tick (the hostile suite's soak made
    /// a tenth of its requests with it).
    pub give_way: bool,
}

impl Default for SoakConfig {
    fn default() -> Self {
        Self {
            sessions: 32,
            duration: Duration::from_secs(10),
            warmup: Duration::ZERO,
            keys: 16,
            large: 1 << 20,
            large_in_flight: 2,
            max_bytes: 64 << 20,
            give_way: false,
        }
    }
}

/// The soak's outcome.
#[derive(Debug, Default)]
pub struct SoakReport {
    pub put: Vec<Duration>,
    /// The value size of each PUT of `put`, in the same order.
    pub put_bytes: Vec<usize>,
    pub get: Vec<Duration>,
    pub clear: Vec<Duration>,
    /// GETs of a stored key that came back missing.
    pub lost: u64,
    /// GETs that returned other bytes than stored, or a value for a cleared key.
    pub corrupt: u64,
    /// Requests that failed (their outcome is unknown, the key is left unchecked).
    pub failed: u64,
    /// The first few failures and findings, for the log.
    pub notes: Vec<String>,
    pub elapsed: Duration,
}

impl SoakReport {
    pub fn ops(&self) -> usize {
        self.put.len() + self.get.len() + self.clear.len()
    }

    fn merge(&mut self, o: SoakReport) {
        self.put.extend(o.put);
        self.put_bytes.extend(o.put_bytes);
        self.get.extend(o.get);
        self.clear.extend(o.clear);
        self.lost += o.lost;
        self.corrupt += o.corrupt;
        self.failed += o.failed;
        for n in o.notes {
            if self.notes.len() < 20 {
                self.notes.push(n);
            }
        }
    }

    /// Drops the latencies taken so far (those of the warm-up).
    fn forget_times(&mut self) {
        for times in [&mut self.put, &mut self.get, &mut self.clear] {
            times.clear();
        }
        self.put_bytes.clear();
    }

    fn note(&mut self, n: String) {
        if self.notes.len() < 20 {
            self.notes.push(n);
        }
    }
}

/// The largest value of the soak's small band.
pub const SMALL_VALUE: usize = 64 << 10;

/// A value size of 1 KiB..`max`, skewed toward small: 80 % up to 64 KiB, 15 % up to 1 MiB,
/// the rest up to `max`, log-uniform within each band.
fn value_len(rng: &mut Rng, max: usize) -> usize {
    let (lo, hi) = match rng.below(100) {
        0..80 => (10, 16),
        80..95 => (16, 20),
        _ => (20, max.max(2).ilog2()),
    };
    let e = lo + rng.below(u64::from(hi - lo + 1)) as u32;
    let len = (1usize << e) - rng.below(1 << (e - 1)) as usize;
    len.clamp(1 << 10, max)
}

/// What a session knows of one key.
#[derive(Clone, Copy, Debug)]
enum Known {
    Stored { seed: u64, len: usize },
    Cleared,
}

/// `f` (making or checking `len` bytes of a value) on a thread of its own at the idle
/// priority when the value is larger than [`SMALL_VALUE`], else here: tens of milliseconds of
/// a 64 MiB value's bytes on the runtime's worker, or beside it at the same priority, would
/// hold up every session's requests, and their latencies would measure the load generator
/// instead of the unit (in the 32-session load of the benchmarks, the small PUTs' p99 was
/// 130-170 times their median with the generator at the workers' priority, 7 without on the
/// machine of that day; on a later one 12-15 at the idle priority alone, 3.2-3.4 once the
/// thread also gave way between parts of the value, [`SoakConfig::give_way`]).
async fn off_worker<T: Send + 'static>(len: usize, f: impl FnOnce() -> T + Send + 'static) -> T {
    if len <= SMALL_VALUE {
        return f();
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        idle_priority();
        let _ = tx.send(f());
    });
    rx.await.expect("the soak's value check does not panic")
}

/// Puts the calling thread in Linux's SCHED_IDLE class (open to every thread; one that may
/// not stays as it is): it gets next to no share of a cpu other threads want, and gives way
/// to any that wakes, so the load generator's bulk work, tens of milliseconds of fresh memory
/// for a large value, seldom delays the requests it times (see [`SoakConfig::give_way`] for
/// when it does).
pub fn idle_priority() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler reads `param` and changes the calling thread (pid 0) only.
    unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
}

/// Runs `cfg.sessions` sessions of mixed PUT/GET/CLEAR against the unit of `session` on the
/// current runtime and checks every GET against what its session stored and cleared.
pub async fn soak(session: ClientConfig, cfg: SoakConfig) -> SoakReport {
    let large = Arc::new(tokio::sync::Semaphore::new(cfg.large_in_flight));
    let start = Instant::now();
    let connected = Arc::new(tokio::sync::Barrier::new(cfg.sessions));
    let mut tasks = Vec::new();
    for s in 0..cfg.sessions {
        let (session, cfg, large) = (session.clone(), cfg.clone(), large.clone());
        let connected = connected.clone();
        tasks.push(tokio::spawn(async move {
            soak_session(s as u64, session, cfg, large, &connected).await
        }));
    }
    let mut total = SoakReport::default();
    for t in tasks {
        match t.await {
            Ok(r) => total.merge(r),
            Err(e) => {
                total.failed += 1;
                total.note(format!("session task: {e}"));
            }
        }
    }
    total.elapsed = start.elapsed();
    total
}

async fn soak_session(
    id: u64,
    session: ClientConfig,
    cfg: SoakConfig,
    large: Arc<tokio::sync::Semaphore>,
    connected: &tokio::sync::Barrier,
) -> SoakReport {
    let mut r = SoakReport::default();
    let timeout = session.timeout;
    let client = Client::connect(session).await;
    // Every session waits here, also one that failed to connect, so that none waits forever.
    connected.wait().await;
    let timed = Instant::now() + cfg.warmup;
    let end = timed + cfg.duration;
    let client = match client {
        Ok(c) => c,
        Err(e) => {
            r.failed += 1;
            r.note(format!("session {id}: connect: {e}"));
            return r;
        }
    };
    let part = format!("soak-{id}");
    let asking = Asking {
        id,
        timeout,
        between: if cfg.give_way { give_way } else { keep_core },
    };
    let between = asking.between;
    let mut rng = Rng::new(0x50a4 ^ (id << 32));
    let mut known: HashMap<u64, Known> = HashMap::new();
    let mut generation = 0u64;
    let mut warm = false;
    while Instant::now() < end {
        if !warm && Instant::now() >= timed {
            warm = true;
            r.forget_times();
        }
        let key = rng.below(cfg.keys);
        let op = rng.below(10);
        if op < 4 {
            let len = value_len(&mut rng, cfg.max_bytes);
            let _permit = if len > cfg.large {
                Some(large.clone().acquire_owned().await.expect("semaphore"))
            } else {
                None
            };
            generation += 1;
            let seed = (id << 48) ^ (key << 32) ^ generation;
            let cols = vec![(
                "v".to_string(),
                vec![Value::Bytes(
                    off_worker(len, move || content_in_parts(seed, len, between)).await,
                )],
            )];
            let t = Instant::now();
            let res = tokio::time::timeout(timeout, client.put(&part, &[key], &cols)).await;
            drop(cols);
            match res {
                Ok(Ok(())) => {
                    r.put.push(t.elapsed());
                    r.put_bytes.push(len);
                    known.insert(key, Known::Stored { seed, len });
                }
                other => {
                    r.failed += 1;
                    r.note(format!("session {id}: PUT {key} ({len} B): {other:?}"));
                    known.remove(&key);
                    continue;
                }
            }
            if len > cfg.large {
                // Verified and cleared while the permit is held.
                check_get(&client, &part, key, &known, asking, &mut r).await;
                clear(&client, &part, key, &mut known, asking, &mut r).await;
            }
        } else if op < 8 {
            check_get(&client, &part, key, &known, asking, &mut r).await;
        } else {
            clear(&client, &part, key, &mut known, asking, &mut r).await;
        }
    }
    r
}

/// What a soak session's requests share.
#[derive(Clone, Copy)]
struct Asking {
    id: u64,
    timeout: Duration,
    /// Called between parts of a large value made or checked.
    between: fn(),
}

async fn check_get(
    client: &Client,
    part: &str,
    key: u64,
    known: &HashMap<u64, Known>,
    asking: Asking,
    r: &mut SoakReport,
) {
    let Asking {
        id,
        timeout,
        between,
    } = asking;
    let t = Instant::now();
    let res = tokio::time::timeout(timeout, client.get(part, &[key], &["v"])).await;
    let took = t.elapsed();
    let expected = known.get(&key).copied();
    match res {
        Ok(Ok(cols)) => {
            r.get.push(took);
            let mismatch = match expected {
                Some(Known::Stored { seed, len }) => {
                    !off_worker(len, move || {
                        matches_in_parts(&cols[0][0], seed, len, between)
                    })
                    .await
                }
                _ => false,
            };
            match expected {
                Some(Known::Stored { len, .. }) if mismatch => {
                    r.corrupt += 1;
                    r.note(format!("session {id}: GET {key}: not the {len} B stored"));
                }
                Some(Known::Cleared) => {
                    r.corrupt += 1;
                    r.note(format!("session {id}: GET {key}: a value after CLEAR"));
                }
                _ => {}
            }
        }
        Ok(Err(ClientError::Remote { source, .. })) if source.kind == ErrorKind::Missing => {
            r.get.push(took);
            if let Some(Known::Stored { len, .. }) = expected {
                r.lost += 1;
                r.note(format!(
                    "session {id}: GET {key}: the {len} B stored are missing"
                ));
            }
        }
        other => {
            r.failed += 1;
            r.note(format!("session {id}: GET {key}: {other:?}"));
        }
    }
}

async fn clear(
    client: &Client,
    part: &str,
    key: u64,
    known: &mut HashMap<u64, Known>,
    asking: Asking,
    r: &mut SoakReport,
) {
    let Asking { id, timeout, .. } = asking;
    let t = Instant::now();
    match tokio::time::timeout(timeout, client.clear(part, &[key])).await {
        Ok(Ok(())) => {
            r.clear.push(t.elapsed());
            known.insert(key, Known::Cleared);
        }
        other => {
            r.failed += 1;
            r.note(format!("session {id}: CLEAR {key}: {other:?}"));
            known.remove(&key);
        }
    }
}

// ----- the unit's memory ------------------------------------------------------------------

/// VmRSS of process `pid`, in bytes.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = s
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// Samples [`rss_bytes`] every 50 ms on a thread until stopped; the maximum seen.
pub struct RssWatch {
    stop: Arc<AtomicBool>,
    max: Arc<Mutex<u64>>,
    thread: Option<JoinHandle<()>>,
}

impl RssWatch {
    pub fn start(pid: u32) -> RssWatch {
        let stop = Arc::new(AtomicBool::new(false));
        let max = Arc::new(Mutex::new(rss_bytes(pid).unwrap_or(0)));
        let (s, m) = (stop.clone(), max.clone());
        let thread = std::thread::spawn(move || {
            while nap(&s, Duration::from_millis(50)) {
                if let Some(v) = rss_bytes(pid) {
                    let mut m = m.lock().unwrap();
                    *m = (*m).max(v);
                }
            }
        });
        RssWatch {
            stop,
            max,
            thread: Some(thread),
        }
    }

    /// Stops sampling; the maximum seen.
    pub fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        *self.max.lock().unwrap()
    }
}

impl Drop for RssWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
