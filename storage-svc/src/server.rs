//! The tokio driver of a unit: accepts control connections, moves bytes between sockets and
//! the protocol core, and runs each peer's transfers (GET WRITEs, pulled-PUT READs) on that
//! peer's own executor.

use std::collections::HashMap;
use std::future::Future;
use std::os::fd::AsRawFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tessera_transport::{Agent, LinkState, LocalDesc, Peer, RemoteDesc};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tracing::Instrument;

use crate::busy_poll::BusyPoll;
use crate::chunks::{ChunkLimits, ChunkPool};
use crate::core::{Output, SessionId, Stats, TornDown, Unit, UnitConfig};
use crate::error::ErrorKind;
use crate::plane::{source_descs, Backend, PoolMemory};
use crate::proto::{self, Request, Response};
use crate::sync::{AtomicU64, Ordering};

/// Configuration of a unit's server.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// Control-plane address: `HOST:PORT` (TCP) or `unix:PATH`. 127.0.0.1 by default.
    pub bind: String,
    /// Payload backend.
    pub backend: Backend,
    /// `tcp` backend: the address of this host the payload engine listens on and advertises
    /// to clients (port 0 picks one). Unset: 127.0.0.1, reachable from this host only.
    /// `ucx` and `nixl` refuse it (UCX takes its interfaces from `UCX_NET_DEVICES`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload_addr: Option<std::net::SocketAddr>,
    /// Bytes of registered memory at most (the receive pool). It is registered in chunks of
    /// `pool_chunk_bytes` as PUTs need it, never per request.
    pub pool_bytes: u64,
    /// Bytes of one chunk of registered memory (a PUT that needs more gets a chunk of its
    /// own size). The first chunk is registered at start.
    pub pool_chunk_bytes: u64,
    /// Idle registered memory (registered, not leased) kept at most: chunks that are entirely
    /// free are deregistered, newest first, while the idle bytes exceed it.
    pub idle_pool_bytes: u64,
    /// Largest control message accepted, in bytes (checked before allocating).
    pub max_message_bytes: u64,
    /// A WRITE that has not completed after this long fails its session.
    #[serde(with = "secs")]
    pub transfer_timeout: Duration,
    /// Answers queued for one session's connection, at most. A session reads its next
    /// request only when that request's answers (and those of the GETs queued on its
    /// executor) fit, so a client that does not read its answers stops being read instead of
    /// growing the unit's memory. Must exceed `transfer_queue` by 3 or more.
    pub reply_queue: usize,
    /// Transfers (GET WRITEs, pulled-PUT READs) queued on one client's executor, at most. A
    /// session reads its next request only when one more fits; a transfer that still finds
    /// the queue full is answered with `ErrorKind::Busy`.
    pub transfer_queue: usize,
    /// The protocol core's settings.
    pub unit: UnitConfig,
    /// Polls the sessions' sockets before a worker of the server's runtime parks, when that
    /// runtime was built with [`BusyPoll::on_park`] (off by default; the binary's
    /// `busy_poll_us`).
    #[serde(skip)]
    pub busy_poll: Option<BusyPoll>,
}

mod secs {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;
    pub(super) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }
    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let v = f64::deserialize(d)?;
        if !(v.is_finite() && v >= 0.0) {
            return Err(serde::de::Error::custom(
                "seconds must be a finite, non-negative number",
            ));
        }
        Ok(Duration::from_secs_f64(v))
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            bind: "127.0.0.1:7470".into(),
            backend: Backend::Shm,
            payload_addr: None,
            pool_bytes: 2 << 30,
            pool_chunk_bytes: 256 << 20,
            idle_pool_bytes: 512 << 20,
            max_message_bytes: 256 << 20,
            transfer_timeout: Duration::from_secs(60),
            reply_queue: 1024,
            transfer_queue: 64,
            unit: UnitConfig::default(),
            busy_poll: None,
        }
    }
}

/// Errors starting a server.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// Binding the control socket failed.
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address.
        addr: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The transport agent or its pool could not be created.
    #[error("transport: {0}")]
    Transport(String),
    /// The configuration is inconsistent.
    #[error("configuration: {0}")]
    Config(String),
}

/// A transfer on a session's executor.
enum Job {
    /// A GET's WRITE into the client's block: request id, GET id, frames, descriptors.
    Write(u64, u64, Vec<Bytes>, Vec<RemoteDesc>),
    /// A pulled PUT's READ of the client's frames into the unit's block.
    Read {
        put: u64,
        dests: Vec<LocalDesc>,
        srcs: Vec<RemoteDesc>,
        agent: Vec<u8>,
    },
}

struct SessionHandle {
    replies: mpsc::Sender<Vec<u8>>,
    jobs: Option<mpsc::Sender<Job>>,
    close: watch::Sender<bool>,
    /// The registration generation of the unit's metadata this session last got.
    seen: u64,
    /// GET WRITEs queued on the executor (not counting the one in flight).
    queue_depth: Arc<AtomicU64>,
    /// The client's agent name, the metrics label of its queue (empty before Hello).
    peer: String,
}

struct Shared {
    unit: Mutex<Unit<PoolMemory>>,
    agent: Arc<Agent>,
    /// Bumped when the unit registers or deregisters a chunk of memory.
    generation: Arc<AtomicU64>,
    cfg: ServerConfig,
    sessions: Mutex<HashMap<SessionId, SessionHandle>>,
    /// Closed sessions whose exposed blocks wait for their client's link to be torn down, with
    /// the client's agent name.
    lingering: Mutex<HashMap<SessionId, String>>,
    next_session: AtomicU64,
    tasks: Mutex<JoinSet<()>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A running unit. Dropping it does not stop it; call [`Server::shutdown`].
pub struct Server {
    shared: Arc<Shared>,
    addr: String,
    stop: watch::Sender<bool>,
    accept: tokio::task::JoinHandle<()>,
    timer: tokio::task::JoinHandle<()>,
}

enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

impl Server {
    /// Creates the agent and its registered pool, binds the control socket and starts serving.
    pub async fn start(cfg: ServerConfig) -> Result<Server, ServerError> {
        if cfg.transfer_queue == 0 || cfg.reply_queue < cfg.transfer_queue.saturating_add(3) {
            return Err(ServerError::Config(format!(
                "transfer_queue ({}) must be at least 1 and reply_queue ({}) at least \
                 transfer_queue + 3",
                cfg.transfer_queue, cfg.reply_queue
            )));
        }
        let backend = cfg.backend;
        let payload_addr = cfg.payload_addr;
        let limits = ChunkLimits {
            capacity: cfg.pool_bytes,
            chunk: cfg.pool_chunk_bytes,
            idle: cfg.idle_pool_bytes,
        };
        let (agent, pool) = tokio::task::spawn_blocking(move || {
            let agent = Arc::new(
                backend
                    .agent_at("unit", payload_addr)
                    .map_err(|e| e.to_string())?,
            );
            let pool = ChunkPool::new(agent.clone(), limits)?;
            Ok::<_, String>((agent, pool))
        })
        .await
        .map_err(|e| ServerError::Transport(e.to_string()))?
        .map_err(ServerError::Transport)?;
        let (listener, addr) = if let Some(path) = cfg.bind.strip_prefix("unix:") {
            let _ = std::fs::remove_file(path);
            let l = UnixListener::bind(path).map_err(|source| ServerError::Bind {
                addr: cfg.bind.clone(),
                source,
            })?;
            (Listener::Unix(l, path.into()), cfg.bind.clone())
        } else {
            let l = TcpListener::bind(&cfg.bind)
                .await
                .map_err(|source| ServerError::Bind {
                    addr: cfg.bind.clone(),
                    source,
                })?;
            let a = l.local_addr().map_err(|source| ServerError::Bind {
                addr: cfg.bind.clone(),
                source,
            })?;
            (Listener::Tcp(l), a.to_string())
        };
        let generation = pool.generation();
        let mut unit = Unit::new(cfg.unit.clone(), PoolMemory { pool });
        unit.set_pull_puts(backend.pulls_puts());
        let shared = Arc::new(Shared {
            unit: Mutex::new(unit),
            agent,
            generation,
            cfg,
            sessions: Mutex::new(HashMap::new()),
            lingering: Mutex::new(HashMap::new()),
            next_session: AtomicU64::new(1),
            tasks: Mutex::new(JoinSet::new()),
        });
        let (stop, stop_rx) = watch::channel(false);
        let accept = tokio::spawn(accept_loop(shared.clone(), listener, stop_rx.clone()));
        let timer = tokio::spawn(timer_loop(shared.clone(), stop_rx));
        tracing::info!(%addr, backend = shared.agent.kind(), "unit serving");
        Ok(Server {
            shared,
            addr,
            stop,
            accept,
            timer,
        })
    }

    /// The control address clients connect to (`HOST:PORT` or `unix:PATH`).
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Current statistics.
    pub fn stats(&self) -> Stats {
        lock(&self.shared.unit).stats()
    }

    /// The unit's transport agent (its [`report`](Agent::report) counts the payload bytes
    /// its engine copied).
    pub fn agent(&self) -> &Agent {
        &self.shared.agent
    }

    /// Serves one more session over `stream` (tests drive a session through an in-memory
    /// pipe whose buffer they choose).
    #[cfg(test)]
    fn attach(&self, stream: tokio::io::DuplexStream) {
        let (r, w) = tokio::io::split(stream);
        let sid = self.shared.next_session.fetch_add(1, Ordering::Relaxed);
        let s = self.shared.clone();
        lock(&self.shared.tasks).spawn(guarded_session(s, sid, Box::new(r), Box::new(w)));
    }

    /// Registered memory the unit holds now, in bytes.
    pub fn registered_bytes(&self) -> u64 {
        self.stats().pool.capacity
    }

    /// Ordered teardown: stop accepting, cancel queued work, let transfers in flight finish
    /// and release their handles, drop peers and stored values, then the agent, then the pool.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.accept.await;
        let _ = self.timer.await;
        let handles: Vec<SessionHandle> = lock(&self.shared.sessions)
            .drain()
            .map(|(_, h)| h)
            .collect();
        for mut h in handles {
            h.jobs = None; // cancels queued WRITEs once the executor sees the channel close
            let _ = h.close.send(true);
        }
        let mut tasks = std::mem::take(&mut *lock(&self.shared.tasks));
        while tasks.join_next().await.is_some() {}
        lock(&self.shared.unit).teardown();
        // The agent goes first (the unit's memory holds it too, ahead of its chunks), then
        // the chunks of registered memory.
        let Server { shared, .. } = self;
        match Arc::try_unwrap(shared) {
            Ok(shared) => {
                drop(shared.agent);
                drop(shared.unit);
            }
            Err(_) => tracing::warn!("unit state still referenced at shutdown"),
        }
    }
}

async fn accept_loop(shared: Arc<Shared>, listener: Listener, mut stop: watch::Receiver<bool>) {
    loop {
        let conn = tokio::select! {
            _ = stop.changed() => break,
            c = async {
                match &listener {
                    Listener::Tcp(l) => l.accept().await.map(|(s, a)| {
                        let _ = s.set_nodelay(true);
                        let fd = s.as_raw_fd();
                        let (r, w) = s.into_split();
                        let r = BusyPoll::watched(shared.cfg.busy_poll.as_ref(), fd, r, true);
                        (Box::new(r) as Box<dyn AsyncRead + Send + Unpin>,
                         Box::new(w) as Box<dyn AsyncWrite + Send + Unpin>, a.to_string())
                    }),
                    Listener::Unix(l, _) => l.accept().await.map(|(s, _)| {
                        let fd = s.as_raw_fd();
                        let (r, w) = s.into_split();
                        let r = BusyPoll::watched(shared.cfg.busy_poll.as_ref(), fd, r, true);
                        (Box::new(r) as Box<dyn AsyncRead + Send + Unpin>,
                         Box::new(w) as Box<dyn AsyncWrite + Send + Unpin>, "unix".to_string())
                    }),
                }
            } => c,
        };
        match conn {
            Ok((r, w, from)) => {
                let sid = shared.next_session.fetch_add(1, Ordering::Relaxed);
                let s = shared.clone();
                let span = tracing::info_span!("session", id = sid, %from);
                lock(&shared.tasks).spawn(guarded_session(s, sid, r, w).instrument(span));
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    if let Listener::Unix(_, path) = &listener {
        let _ = std::fs::remove_file(path);
    }
}

async fn timer_loop(shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    loop {
        let next = lock(&shared.unit).poll_timeout();
        let wait = next
            .map(|t| t.saturating_duration_since(Instant::now()))
            .unwrap_or(Duration::from_millis(200))
            .clamp(Duration::from_millis(5), Duration::from_millis(200));
        tokio::select! {
            _ = stop.changed() => break,
            _ = tokio::time::sleep(wait) => {}
        }
        release_torn_down(&shared);
        let out = {
            let mut unit = lock(&shared.unit);
            let out = unit.handle_timeout(Instant::now());
            // Blocks also come back when the executor drops a GET's frames: trim here too.
            unit.trim_memory();
            out
        };
        dispatch(&shared, out);
        crate::metrics::record_stats(&lock(&shared.unit).stats());
    }
}

/// Closes session `sid` in the core. What its client was shown stays quarantined until the
/// client can no longer write into it: engines that can tell when a peer's link is torn down
/// (`tcp`, `shm`) are asked on each tick of the timer; for the others the core's
/// `late_write_grace` runs out.
fn close_in_core(shared: &Shared, sid: SessionId, handle: Option<&SessionHandle>) {
    let peer = handle.map(|h| h.peer.clone()).unwrap_or_default();
    let how = if peer.is_empty() || shared.agent.peer_link(&peer) == LinkState::Unknown {
        TornDown::Grace
    } else {
        TornDown::Signalled
    };
    let mut unit = lock(&shared.unit);
    unit.close_session(sid, Instant::now(), how);
    if how == TornDown::Signalled && unit.closed_sessions().contains(&sid) {
        lock(&shared.lingering).insert(sid, peer);
    }
}

/// Releases the quarantine of closed sessions whose client's link is torn down.
fn release_torn_down(shared: &Shared) {
    let gone: Vec<SessionId> = lock(&shared.lingering)
        .iter()
        .filter(|(_, peer)| shared.agent.peer_link(peer) != LinkState::Open)
        .map(|(sid, _)| *sid)
        .collect();
    if gone.is_empty() {
        return;
    }
    let mut unit = lock(&shared.unit);
    for sid in gone {
        lock(&shared.lingering).remove(&sid);
        let bytes = unit.release_closed(sid);
        tracing::debug!(
            session = sid,
            bytes,
            "client's link torn down; quarantine released"
        );
    }
    unit.trim_memory();
}

/// A panic's message, for the log and the error answered.
fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".to_owned())
}

/// A future whose panics, in any poll, become `Err(message)` (what a tokio `JoinHandle`
/// reports for a task, without a task of its own, so the caller keeps what the future
/// borrowed from it). The future is not polled again after a panic.
struct CatchUnwind<F>(Pin<Box<F>>);

impl<F: Future> Future for CatchUnwind<F> {
    type Output = Result<F::Output, String>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match catch_unwind(AssertUnwindSafe(|| self.0.as_mut().poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(v)) => Poll::Ready(Ok(v)),
            Err(p) => Poll::Ready(Err(panic_message(&*p))),
        }
    }
}

/// Runs a session; if it panics anywhere outside a request's handling (which answers the
/// request itself), its connection is closed and what it held in the core released, as an
/// ordinary teardown would. Other sessions never notice.
async fn guarded_session(
    shared: Arc<Shared>,
    sid: SessionId,
    r: Box<dyn AsyncRead + Send + Unpin>,
    w: Box<dyn AsyncWrite + Send + Unpin>,
) {
    let run = CatchUnwind(Box::pin(session(shared.clone(), sid, r, w))).await;
    if let Err(what) = run {
        tracing::error!(panic = %what, "session task panicked; closing it and releasing what it held");
        crate::metrics::error(ErrorKind::Internal);
        // Close it in the core first (what it exposed stays quarantined until its client's
        // link is torn down); then dropping the handle ends the reply writer, which closes
        // the connection, and the executor sees its queue close.
        let handle = lock(&shared.sessions).remove(&sid);
        close_in_core(&shared, sid, handle.as_ref());
        drop(handle);
    }
}

async fn session(
    shared: Arc<Shared>,
    sid: SessionId,
    mut r: Box<dyn AsyncRead + Send + Unpin>,
    mut w: Box<dyn AsyncWrite + Send + Unpin>,
) {
    let (reply_tx, mut reply_rx) = mpsc::channel::<Vec<u8>>(shared.cfg.reply_queue);
    let (close_tx, mut close_rx) = watch::channel(false);
    let depth = Arc::new(AtomicU64::new(0));
    // The loop's own handle on the reply queue, to wait for room; dropped before the writer
    // is awaited.
    let gate = reply_tx.clone();
    lock(&shared.sessions).insert(
        sid,
        SessionHandle {
            replies: reply_tx,
            jobs: None,
            close: close_tx,
            seen: 0,
            queue_depth: depth.clone(),
            peer: String::new(),
        },
    );
    lock(&shared.unit).open_session(sid);
    let writer = tokio::spawn(async move {
        while let Some(buf) = reply_rx.recv().await {
            if w.write_all(&buf).await.is_err() {
                break;
            }
        }
        let _ = w.shutdown().await;
    });
    let max = shared.cfg.max_message_bytes;
    loop {
        // Backpressure: read the next request only once its answers fit in the reply queue
        // beside those the executor still owes (each queued GET and the one in flight), and
        // one more GET fits in the transfer queue. This loop is the transfer queue's only
        // producer, so the room it waited for is still there when the request is handled.
        let owed = depth.load(Ordering::Relaxed) as usize + 1;
        let room = (owed + 2).min(shared.cfg.reply_queue);
        let jobs = lock(&shared.sessions)
            .get(&sid)
            .and_then(|h| h.jobs.clone());
        let waited = tokio::select! {
            _ = close_rx.changed() => false,
            ok = async {
                if let Some(jobs) = &jobs {
                    if jobs.reserve().await.is_err() {
                        return false;
                    }
                }
                gate.reserve_many(room).await.is_ok()
            } => ok,
        };
        drop(jobs);
        if !waited {
            break;
        }
        let mut prefix = [0u8; proto::LEN_PREFIX];
        let read = tokio::select! {
            _ = close_rx.changed() => break,
            r = r.read_exact(&mut prefix) => r,
        };
        if read.is_err() {
            break;
        }
        let len = match proto::frame_len(prefix, max) {
            Ok(len) => len,
            Err(e) => {
                // The stream cannot be resynchronised without reading the announced bytes.
                crate::metrics::error(ErrorKind::TooLarge);
                send(
                    &shared,
                    sid,
                    0,
                    &Response::error(ErrorKind::TooLarge, e.to_string()),
                );
                break;
            }
        };
        let mut buf = vec![0u8; len];
        if r.read_exact(&mut buf).await.is_err() {
            break;
        }
        match proto::decode_body::<Request>(&buf) {
            Ok((id, req)) => {
                let op = op_name(&req);
                let span = tracing::debug_span!("request", id, op);
                let _g = span.enter();
                let started = Instant::now();
                let handled = {
                    let mut unit = lock(&shared.unit);
                    // Caught inside the lock's scope: the lock is not poisoned, and the
                    // session is closed below, which releases what it held in the core.
                    catch_unwind(AssertUnwindSafe(|| {
                        #[cfg(test)]
                        fault::before_handle(sid, id, &req);
                        let out = unit.handle(started, sid, id, req);
                        unit.trim_memory();
                        out
                    }))
                };
                let out = match handled {
                    Ok(out) => out,
                    Err(p) => {
                        let what = panic_message(&*p);
                        tracing::error!(id, op, panic = %what, "request handling panicked; closing the session");
                        crate::metrics::error(ErrorKind::Internal);
                        send(
                            &shared,
                            sid,
                            id,
                            &Response::error(
                                ErrorKind::Internal,
                                format!(
                                    "the unit failed handling this {op} request ({what}); \
                                     the session is closed, reconnect"
                                ),
                            ),
                        );
                        break;
                    }
                };
                #[cfg(test)]
                fault::after_handle(op);
                crate::metrics::request(op, started.elapsed(), &out);
                dispatch(&shared, out);
            }
            Err((id, e)) => {
                tracing::debug!(id, error = %e, "bad message");
                crate::metrics::error(ErrorKind::Protocol);
                send(
                    &shared,
                    sid,
                    id,
                    &Response::error(ErrorKind::Protocol, e.to_string()),
                );
            }
        }
    }
    // Teardown of the session: no more replies, cancel queued WRITEs, release what the
    // session held in the core (what it exposed stays quarantined until its client's link
    // is torn down), then let the writer flush and close the connection (so a client that
    // sees the connection close finds the session closed).
    let handle = lock(&shared.sessions).remove(&sid);
    close_in_core(&shared, sid, handle.as_ref());
    drop((handle, gate));
    let _ = writer.await;
    tracing::debug!("session closed");
}

fn op_name(req: &Request) -> &'static str {
    match req {
        Request::Hello { .. } => "hello",
        Request::Put {
            inline: Some(_), ..
        } => "put_inline",
        Request::Put { pull: Some(_), .. } => "put_pull",
        Request::Put { .. } => "put_prepare",
        Request::Commit { .. } => "put_commit",
        Request::Cancel { .. } => "cancel",
        Request::Get { .. } => "get",
        Request::GetInto { .. } => "get_into",
        Request::Clear { .. } => "clear",
        Request::DropPartition { .. } => "drop_partition",
        Request::Stats => "stats",
    }
}

fn send(shared: &Shared, sid: SessionId, id: u64, resp: &Response) {
    if let Some(h) = lock(&shared.sessions).get(&sid) {
        match proto::encode_frame(id, resp) {
            Ok(buf) => {
                if let Err(mpsc::error::TrySendError::Full(_)) = h.replies.try_send(buf) {
                    // Only answers the session did not wait room for (a prepared PUT that
                    // expired) can find the queue full: the client is not reading. An answer
                    // cannot be dropped silently, so the session ends.
                    tracing::error!(
                        session = sid,
                        id,
                        "reply queue full (the client does not read its answers); closing the session"
                    );
                    crate::metrics::error(ErrorKind::Busy);
                    let _ = h.close.send(true);
                }
            }
            Err(e) => tracing::error!(error = %e, "cannot encode a response"),
        }
    }
}

fn dispatch(shared: &Arc<Shared>, out: Vec<Output<LocalDesc>>) {
    for o in out {
        match o {
            Output::Reply {
                session,
                id,
                mut response,
            } => {
                if let Response::Error(e) = &response {
                    crate::metrics::error(e.kind);
                }
                if let Response::PutReady { agent, .. } = &mut response {
                    // Descriptors may name a chunk registered after this session last got
                    // the unit's metadata: send it along.
                    let now = shared.generation.load(Ordering::Acquire);
                    let stale = lock(&shared.sessions)
                        .get_mut(&session)
                        .is_some_and(|h| std::mem::replace(&mut h.seen, now) != now);
                    if stale {
                        *agent = Some(serde_bytes::ByteBuf::from(shared.agent.metadata()));
                    }
                }
                send(shared, session, id, &response)
            }
            Output::Accept { session, id, agent } => {
                let s = shared.clone();
                lock(&shared.tasks).spawn(accept_peer(s, session, id, agent));
            }
            Output::Write {
                session,
                id,
                get,
                frames,
                descs,
            } => {
                let sessions = lock(&shared.sessions);
                let sent = sessions.get(&session).map(|h| {
                    let Some(jobs) = h.jobs.as_ref() else {
                        return Err(false);
                    };
                    match jobs.try_send(Job::Write(id, get, frames, descs)) {
                        Ok(()) => {
                            let depth = h.queue_depth.fetch_add(1, Ordering::Relaxed) + 1;
                            crate::metrics::queue_depth(&h.peer, depth);
                            Ok(())
                        }
                        Err(mpsc::error::TrySendError::Full(_)) => Err(true),
                        Err(mpsc::error::TrySendError::Closed(_)) => Err(false),
                    }
                });
                drop(sessions);
                let out = match sent {
                    Some(Ok(())) => continue,
                    Some(Err(true)) => lock(&shared.unit).transfer_refused(
                        session,
                        get,
                        id,
                        "the transfer queue for this client is full; retry",
                    ),
                    _ => lock(&shared.unit).transfer_done(
                        session,
                        get,
                        id,
                        Err("session has no executor".into()),
                    ),
                };
                dispatch(shared, out);
            }
            Output::Read {
                session,
                put,
                dests,
                srcs,
                agent,
            } => {
                let job = Job::Read {
                    put,
                    dests,
                    srcs,
                    agent,
                };
                let sent = match lock(&shared.sessions).get(&session) {
                    Some(h) => match h.jobs.as_ref().map(|jobs| jobs.try_send(job)) {
                        Some(Ok(())) => {
                            let depth = h.queue_depth.fetch_add(1, Ordering::Relaxed) + 1;
                            crate::metrics::queue_depth(&h.peer, depth);
                            Ok(())
                        }
                        Some(Err(mpsc::error::TrySendError::Full(_))) => Err(true),
                        _ => Err(false),
                    },
                    None => Err(false),
                };
                let out = match sent {
                    Ok(()) => continue,
                    Err(true) => lock(&shared.unit).read_refused(
                        session,
                        put,
                        ErrorKind::Busy,
                        "the transfer queue for this client is full; retry",
                    ),
                    Err(false) => lock(&shared.unit).read_refused(
                        session,
                        put,
                        ErrorKind::PeerFailed,
                        "session has no executor",
                    ),
                };
                dispatch(shared, out);
            }
            Output::Close { session } => {
                if let Some(h) = lock(&shared.sessions).get(&session) {
                    let _ = h.close.send(true);
                }
            }
        }
    }
}

/// Connects to the client's agent (a blocking connect for some engines), then starts the
/// session's executor: WRITEs to one peer run one at a time, peers run concurrently.
async fn accept_peer(shared: Arc<Shared>, sid: SessionId, id: u64, md: Vec<u8>) {
    let agent = shared.agent.clone();
    let peer = tokio::task::spawn_blocking(move || agent.add_remote(&md)).await;
    let peer = match peer {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => {
            send(
                &shared,
                sid,
                id,
                &Response::error(ErrorKind::Transfer, e.to_string()),
            );
            return;
        }
        Err(e) => {
            send(
                &shared,
                sid,
                id,
                &Response::error(ErrorKind::Transfer, e.to_string()),
            );
            return;
        }
    };
    let (tx, rx) = mpsc::channel(shared.cfg.transfer_queue);
    let depth = {
        let mut sessions = lock(&shared.sessions);
        let Some(h) = sessions.get_mut(&sid) else {
            return;
        };
        h.jobs = Some(tx);
        h.peer = peer.name().to_owned();
        h.queue_depth.clone()
    };
    lock(&shared.unit).session_ready(sid);
    let seen = shared.generation.load(Ordering::Acquire);
    if let Some(h) = lock(&shared.sessions).get_mut(&sid) {
        h.seen = seen;
    }
    let welcome = Response::Welcome {
        agent: shared.agent.metadata(),
        backend: shared.agent.kind().to_owned(),
        inline_max: shared.cfg.unit.inline_max,
        align: shared.cfg.unit.align,
    };
    send(&shared, sid, id, &welcome);
    let s = shared.clone();
    lock(&shared.tasks).spawn(executor(s, sid, peer, rx, depth).in_current_span());
}

async fn executor(
    shared: Arc<Shared>,
    sid: SessionId,
    peer: Peer,
    mut rx: mpsc::Receiver<Job>,
    depth: Arc<AtomicU64>,
) {
    let label = peer.name().to_owned();
    while let Some(job) = rx.recv().await {
        crate::metrics::queue_depth(&label, depth.fetch_sub(1, Ordering::Relaxed) - 1);
        let (id, get, frames, descs) = match job {
            Job::Write(id, get, frames, descs) => (id, get, frames, descs),
            Job::Read {
                put,
                dests,
                srcs,
                agent,
            } => {
                let result = CatchUnwind(Box::pin(read(&shared, &agent, &dests, &srcs)))
                    .await
                    .unwrap_or_else(|what| {
                        tracing::error!(session = sid, put, panic = %what, "PUT READ panicked");
                        crate::metrics::error(ErrorKind::Internal);
                        Err(format!("the unit failed reading this PUT ({what})"))
                    });
                // The destinations keep the block leased until the READ is gone.
                drop(dests);
                if let Err(e) = &result {
                    tracing::warn!(session = sid, put, error = %e, "PUT READ failed");
                }
                let out = lock(&shared.unit).read_done(sid, put, result);
                dispatch(&shared, out);
                continue;
            }
        };
        let result = CatchUnwind(Box::pin(async {
            #[cfg(test)]
            fault::before_write(sid, get);
            write(&shared, &peer, &frames, &descs).await
        }))
        .await
        .unwrap_or_else(|what| {
            tracing::error!(session = sid, get, panic = %what, "GET WRITE panicked");
            crate::metrics::error(ErrorKind::Internal);
            Err(format!("the unit failed writing this GET ({what})"))
        });
        if let Err(e) = &result {
            tracing::warn!(session = sid, get, error = %e, "GET WRITE failed");
        }
        let out = lock(&shared.unit).transfer_done(sid, get, id, result);
        dispatch(&shared, out);
    }
    crate::metrics::queue_depth(&label, 0);
}

async fn write(
    shared: &Shared,
    peer: &Peer,
    frames: &[Bytes],
    descs: &[RemoteDesc],
) -> Result<(), String> {
    let locals = source_descs(&shared.agent, frames)?;
    let t = peer
        .write(&locals, descs, None)
        .map_err(|e| e.to_string())?;
    drop(locals);
    match tokio::time::timeout(shared.cfg.transfer_timeout, t).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err("transfer timed out".into()),
    }
}

/// READs a pulled PUT's frames from the client into the unit's block. The client's metadata
/// names the registrations its frames live in (registered for this PUT): the peer learns them
/// first.
async fn read(
    shared: &Shared,
    metadata: &[u8],
    dests: &[LocalDesc],
    srcs: &[RemoteDesc],
) -> Result<(), String> {
    let peer = shared
        .agent
        .add_remote(metadata)
        .map_err(|e| e.to_string())?;
    let t = peer.read(dests, srcs, None).map_err(|e| e.to_string())?;
    match tokio::time::timeout(shared.cfg.transfer_timeout, t).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err("transfer timed out".into()),
    }
}

/// Faults that this crate's own tests inject: compiled only under `cfg(test)`, never part of
/// a build's API.
#[cfg(test)]
pub(crate) mod fault {
    use std::sync::Mutex;

    use crate::core::SessionId;
    use crate::proto::Request;

    /// Where a request on an armed partition panics.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(crate) enum Fault {
        /// Inside the core's handling of the request, with the unit locked.
        Handle,
        /// In the session task after the request was handled (outside the per-request guard).
        Session,
        /// In the executor, writing the GET's payload.
        Write,
    }

    static ARMED: Mutex<Vec<(String, Fault)>> = Mutex::new(Vec::new());
    static WRITES: Mutex<Vec<(SessionId, u64)>> = Mutex::new(Vec::new());
    thread_local! {
        static SESSION: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// Every request on `partition` panics at `fault` (partitions keep tests apart).
    pub(crate) fn arm(partition: &str, fault: Fault) {
        ARMED.lock().unwrap().push((partition.to_owned(), fault));
    }

    fn armed(req: &Request) -> Option<Fault> {
        let partition = match req {
            Request::Put { partition, .. }
            | Request::Get { partition, .. }
            | Request::Clear { partition, .. } => partition,
            _ => return None,
        };
        let armed = ARMED.lock().unwrap();
        armed.iter().find(|(p, _)| p == partition).map(|&(_, f)| f)
    }

    pub(crate) fn before_handle(sid: SessionId, id: u64, req: &Request) {
        match armed(req) {
            Some(Fault::Handle) => panic!("injected fault while handling request {id}"),
            Some(Fault::Session) => SESSION.with(|s| s.set(true)),
            Some(Fault::Write) => WRITES.lock().unwrap().push((sid, id)),
            None => {}
        }
    }

    pub(crate) fn after_handle(op: &str) {
        if SESSION.with(|s| s.replace(false)) {
            panic!("injected fault in the session task after a {op} request");
        }
    }

    pub(crate) fn before_write(sid: SessionId, get: u64) {
        if WRITES.lock().unwrap().contains(&(sid, get)) {
            panic!("injected fault writing GET {get}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fault::{arm, Fault};
    use super::*;
    use crate::{Client, ClientConfig, ClientError, Tensor, Value};
    use tokio::net::TcpStream;

    async fn unit() -> Server {
        Server::start(ServerConfig {
            bind: "127.0.0.1:0".into(),
            backend: Backend::Inproc,
            pool_bytes: 32 << 20,
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

    /// Waits until the unit has closed every session (clients close theirs when dropped).
    async fn settled(server: &Server) -> Stats {
        for _ in 0..6000 {
            let s = server.stats();
            if s.sessions == 0 {
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
        // The session is gone: its next request fails at once, without a timeout.
        let e = a.stats().await.unwrap_err();
        assert!(!matches!(e, ClientError::Timeout { .. }), "{e}");
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
        let e = a.stats().await.unwrap_err();
        assert_eq!(kind(&e), Some(ErrorKind::PeerFailed), "{e}");
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
        let hello = Request::Hello {
            token: None,
            agent: agent.metadata(),
        };
        let Response::Welcome { agent: md, .. } = call(&mut s, 1, &hello).await else {
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
        let agent = Backend::Inproc.agent("raw").unwrap();
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
        let agent = Backend::Inproc.agent("raw").unwrap();
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
    /// block it was given. Meanwhile another client's PUT of the same size must not have been
    /// given that block: its value reads back intact after the late WRITE landed. Once the
    /// late writer's agent is gone (its link closed), the quarantine is released.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_late_write_over_tcp_never_lands_in_a_reused_block() {
        // Over tcp the link decides, never the clock.
        let server = unit_with_grace(Backend::Tcp, Duration::ZERO).await;
        let agent = Backend::Tcp.agent("late").unwrap();
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
        // The late WRITE lands.
        let garbage = [Bytes::from(vec![0xAB; block.len as usize])];
        let locals = source_descs(&agent, &garbage).unwrap();
        peer.write(&locals, &[block], None).unwrap().await.unwrap();
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
        assert_eq!(s.pool.live_blocks, 1, "only the stored value holds a block");
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
        let agent = Backend::Inproc.agent("raw").unwrap();
        let hello = Request::Hello {
            token: None,
            agent: agent.metadata(),
        };
        ours.write_all(&proto::encode_frame(0, &hello).unwrap())
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
}
