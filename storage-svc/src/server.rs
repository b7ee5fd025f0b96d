//! The tokio driver of a unit: accepts control connections, moves bytes between sockets and
//! the protocol core, and runs each peer's WRITEs on that peer's own executor.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tessera_transport::{Agent, Peer, RegisteredPool, RemoteDesc};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tracing::Instrument;

use crate::core::{Output, SessionId, Stats, Unit, UnitConfig};
use crate::error::ErrorKind;
use crate::plane::{source_descs, Backend, PoolMemory};
use crate::proto::{self, Request, Response};

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
    /// Bytes of registered memory (the receive pool, registered once; idle memory is the
    /// part of it not leased, so this is also the idle limit).
    pub pool_bytes: u64,
    /// Largest control message accepted, in bytes (checked before allocating).
    pub max_message_bytes: u64,
    /// A WRITE that has not completed after this long fails its session.
    #[serde(with = "secs")]
    pub transfer_timeout: Duration,
    /// The protocol core's settings.
    pub unit: UnitConfig,
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
            max_message_bytes: 256 << 20,
            transfer_timeout: Duration::from_secs(60),
            unit: UnitConfig::default(),
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
}

type Job = (u64, u64, Vec<Bytes>, Vec<RemoteDesc>);

struct SessionHandle {
    replies: mpsc::UnboundedSender<Vec<u8>>,
    jobs: Option<mpsc::UnboundedSender<Job>>,
    close: watch::Sender<bool>,
    queue_depth: Arc<AtomicU64>,
}

struct Shared {
    unit: Mutex<Unit<PoolMemory>>,
    agent: Arc<Agent>,
    cfg: ServerConfig,
    sessions: Mutex<HashMap<SessionId, SessionHandle>>,
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
    pool: RegisteredPool,
}

enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

impl Server {
    /// Creates the agent and its registered pool, binds the control socket and starts serving.
    pub async fn start(cfg: ServerConfig) -> Result<Server, ServerError> {
        let backend = cfg.backend;
        let payload_addr = cfg.payload_addr;
        let pool_bytes = cfg.pool_bytes;
        let (agent, pool) = tokio::task::spawn_blocking(move || {
            let agent = backend
                .agent_at("unit", payload_addr)
                .map_err(|e| e.to_string())?;
            let pool = RegisteredPool::new(&agent, pool_bytes).map_err(|e| e.to_string())?;
            Ok::<_, String>((Arc::new(agent), pool))
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
        let unit = Unit::new(cfg.unit.clone(), PoolMemory { pool: pool.clone() });
        let shared = Arc::new(Shared {
            unit: Mutex::new(unit),
            agent,
            cfg,
            sessions: Mutex::new(HashMap::new()),
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
            pool,
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

    /// Registered memory the unit holds, in bytes.
    pub fn registered_bytes(&self) -> u64 {
        self.pool.capacity()
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
        let Server { shared, pool, .. } = self;
        match Arc::try_unwrap(shared) {
            Ok(shared) => drop(shared.agent),
            Err(_) => tracing::warn!("unit state still referenced at shutdown"),
        }
        drop(pool);
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
                        let (r, w) = s.into_split();
                        (Box::new(r) as Box<dyn AsyncRead + Send + Unpin>,
                         Box::new(w) as Box<dyn AsyncWrite + Send + Unpin>, a.to_string())
                    }),
                    Listener::Unix(l, _) => l.accept().await.map(|(s, _)| {
                        let (r, w) = s.into_split();
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
                lock(&shared.tasks).spawn(session(s, sid, r, w).instrument(span));
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
        let out = lock(&shared.unit).handle_timeout(Instant::now());
        dispatch(&shared, out);
        crate::metrics::record_stats(&lock(&shared.unit).stats());
    }
}

async fn session(
    shared: Arc<Shared>,
    sid: SessionId,
    mut r: Box<dyn AsyncRead + Send + Unpin>,
    mut w: Box<dyn AsyncWrite + Send + Unpin>,
) {
    let (reply_tx, mut reply_rx) = mpsc::unbounded_channel::<Vec<u8>>();
    let (close_tx, mut close_rx) = watch::channel(false);
    lock(&shared.sessions).insert(
        sid,
        SessionHandle {
            replies: reply_tx,
            jobs: None,
            close: close_tx,
            queue_depth: Arc::new(AtomicU64::new(0)),
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
                let out = lock(&shared.unit).handle(started, sid, id, req);
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
    // Teardown of the session: no more replies, cancel queued WRITEs, wait for the one in
    // flight, then release what the session held in the core.
    let handle = lock(&shared.sessions).remove(&sid);
    drop(handle);
    let _ = writer.await;
    lock(&shared.unit).close_session(sid);
    tracing::debug!("session closed");
}

fn op_name(req: &Request) -> &'static str {
    match req {
        Request::Hello { .. } => "hello",
        Request::Put {
            inline: Some(_), ..
        } => "put_inline",
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
                let _ = h.replies.send(buf);
            }
            Err(e) => tracing::error!(error = %e, "cannot encode a response"),
        }
    }
}

fn dispatch(shared: &Arc<Shared>, out: Vec<Output>) {
    for o in out {
        match o {
            Output::Reply {
                session,
                id,
                response,
            } => {
                if let Response::Error(e) = &response {
                    crate::metrics::error(e.kind);
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
                let sent = sessions.get(&session).and_then(|h| {
                    let jobs = h.jobs.as_ref()?;
                    h.queue_depth.fetch_add(1, Ordering::Relaxed);
                    jobs.send((id, get, frames, descs)).ok()
                });
                drop(sessions);
                if sent.is_none() {
                    let out = lock(&shared.unit).transfer_done(
                        session,
                        get,
                        id,
                        Err("session has no executor".into()),
                    );
                    dispatch(shared, out);
                }
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
    let (tx, rx) = mpsc::unbounded_channel();
    let depth = {
        let mut sessions = lock(&shared.sessions);
        let Some(h) = sessions.get_mut(&sid) else {
            return;
        };
        h.jobs = Some(tx);
        h.queue_depth.clone()
    };
    lock(&shared.unit).session_ready(sid);
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
    mut rx: mpsc::UnboundedReceiver<Job>,
    depth: Arc<AtomicU64>,
) {
    let label = peer.name().to_owned();
    while let Some((id, get, frames, descs)) = rx.recv().await {
        crate::metrics::queue_depth(&label, depth.fetch_sub(1, Ordering::Relaxed) - 1);
        let result = write(&shared, &peer, &frames, &descs).await;
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
