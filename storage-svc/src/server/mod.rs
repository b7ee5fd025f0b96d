//! The tokio driver of a unit: accepts control connections, moves bytes between sockets and
//! the protocol core, and runs each peer's transfers (GET WRITEs, pulled-PUT READs) on that
//! peer's own executor.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;
use tessera_sync::{Arc, Mutex};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tessera_transport::{Agent, AgentError, LocalDesc, RemoteDesc};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;

use crate::busy_poll::BusyPoll;
use crate::chunks::{ChunkLimits, ChunkPool};
use crate::core::{SessionId, Stats, Unit, UnitConfig};
use crate::error::MemoryError;
use crate::plane::BackendExt;
use crate::plane::{Backend, PoolMemory};
use tessera_sync::atomic::{AtomicU64, Ordering};

mod bulk;
mod connection;
#[cfg(test)]
pub(crate) mod fault;
mod partitions;
#[cfg(test)]
mod tests;
mod timer;
mod transfers;

use self::connection::accept_loop;
#[cfg(test)]
use self::connection::guarded_session;
use self::timer::timer_loop;

/// The address in a unit's start line. The `tessera-storage` binary prints
/// `listening ADDR (engine ..., pool ..., ...)` on stdout once it serves; scripts and tests
/// read ADDR with this.
pub fn announced_addr(line: &str) -> Option<&str> {
    line.trim()
        .strip_prefix("listening ")?
        .split_whitespace()
        .next()
}

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
    #[serde(with = "crate::units::size")]
    pub pool_bytes: u64,
    /// Bytes of one chunk of registered memory (a PUT that needs more gets a chunk of its
    /// own size). The first chunk is registered at start.
    #[serde(with = "crate::units::size")]
    pub pool_chunk_bytes: u64,
    /// Idle registered memory (registered, not leased) kept at most: chunks that are entirely
    /// free are deregistered, newest first, while the idle bytes exceed it.
    #[serde(with = "crate::units::size")]
    pub idle_pool_bytes: u64,
    /// Register all of `pool_bytes` at start and fault every page of it in (as an RDMA
    /// registration pins them), and keep it registered: no request then waits for a chunk's
    /// registration or for a first touch of fresh memory (on a VM, several microseconds a
    /// page), at the price of the whole pool resident from the start. `idle_pool_bytes` is
    /// then ignored.
    pub prefault_pool: bool,
    /// Largest control message accepted from an authenticated session, in bytes (checked
    /// before allocating).
    #[serde(with = "crate::units::size")]
    pub max_message_bytes: u64,
    /// Largest control message accepted before the session is authenticated (its Hello and
    /// Auth), in bytes. A Hello carries the client's agent metadata, which for `nixl` (NIXL's
    /// keys of every registration) and `ucx` (the worker address and rkeys) runs to kilobytes:
    /// 64 KiB by default, so 4096 unauthenticated connections hold at most 256 MiB, each for at
    /// most `handshake_timeout`.
    #[serde(with = "crate::units::size")]
    pub preauth_message_bytes: u64,
    /// A connection that has not completed its handshake (Hello, Challenge, Auth) this long
    /// after it was accepted is closed.
    #[serde(with = "crate::units::duration")]
    pub handshake_timeout: Duration,
    /// Once the first byte of a request arrived, the whole request must arrive within this
    /// time, or the connection is closed (a client that trickles bytes holds nothing long).
    #[serde(with = "crate::units::duration")]
    pub frame_timeout: Duration,
    /// Control connections served at once, at most. Beyond it a new connection is answered
    /// with a `Busy` error frame and closed (counted in `Stats::refused_connections`). At start
    /// the soft `RLIMIT_NOFILE` is raised to the hard limit, and the cap is kept 64 below it.
    pub max_connections: usize,
    /// Connections to clients' agents (`add_remote`, a blocking connect for some engines) in
    /// progress at once, at most.
    pub max_peer_adds: usize,
    /// A client's agent that cannot be added within this time fails its session (with a
    /// `Transfer` error; other sessions are not affected).
    #[serde(with = "crate::units::duration")]
    pub peer_add_timeout: Duration,
    /// A WRITE that has not completed after this long fails its session.
    #[serde(with = "crate::units::duration")]
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
    /// Bytes a large copy of the unit's agent (over `shm`, a GET's WRITE into a client's
    /// block) runs between offers of its core to other threads
    /// ([`Agent::set_copy_slice`](tessera_transport::Agent::set_copy_slice)). 1 MiB
    /// ([`ServerConfig::COPY_SLICE_DEFAULT`]), a quarter of the transport's default: a worker
    /// woken on the copy's core with another session's small request is let in four times as
    /// often, for about 2 % of a lone 256 MiB GET's speed (BENCHMARKS.md).
    #[serde(with = "crate::units::size")]
    pub copy_slice_bytes: u64,
    /// The protocol core's settings.
    pub unit: UnitConfig,
    /// Polls the sessions' sockets before a worker of the server's runtime parks, when that
    /// runtime was built with [`BusyPoll::on_park`] (off by default; the binary's
    /// `busy_poll_us`). Built with [`BusyPoll::expecting`], it also polls past its window for
    /// a session's next request while the session's latest pauses say it comes soon (the
    /// binary's `busy_poll_expect_us`).
    #[serde(skip)]
    pub busy_poll: Option<BusyPoll>,
}

impl ServerConfig {
    /// The default of [`ServerConfig::copy_slice_bytes`].
    pub const COPY_SLICE_DEFAULT: u64 = 1 << 20;
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
            prefault_pool: false,
            max_message_bytes: 256 << 20,
            preauth_message_bytes: 64 << 10,
            handshake_timeout: Duration::from_secs(5),
            frame_timeout: Duration::from_secs(30),
            max_connections: 4096,
            max_peer_adds: 16,
            peer_add_timeout: Duration::from_secs(10),
            transfer_timeout: Duration::from_secs(60),
            reply_queue: 1024,
            transfer_queue: 64,
            copy_slice_bytes: Self::COPY_SLICE_DEFAULT,
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
    /// The transport agent could not be created.
    #[error("transport: {0}")]
    Agent(#[from] AgentError),
    /// The registered pool could not be created.
    #[error("transport: {0}")]
    Memory(#[from] MemoryError),
    /// The blocking setup task panicked or was cancelled.
    #[error("transport: {0}")]
    Background(#[from] tokio::task::JoinError),
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
    replies: Arc<connection::Replies>,
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
    tasks: Mutex<JoinSet<()>>,
    /// Control connections being served.
    connections: AtomicU64,
    /// `max_connections`, kept below the open-file limit.
    connection_cap: u64,
    /// Connections refused at the cap.
    refused: AtomicU64,
    /// Failed accepts (`EMFILE`, `ENFILE`, ...).
    accept_errors: AtomicU64,
    /// Bounds the `add_remote` calls in progress.
    peer_adds: Arc<tokio::sync::Semaphore>,
    /// The order of requests that conflict over a partition held by one handled in slices.
    partitions: partitions::PartitionLocks,
}

impl Shared {
    /// The core's statistics with the driver's counters.
    fn stats(&self) -> Stats {
        let mut s = self.unit.lock().stats();
        self.add_counters(&mut s);
        s
    }

    fn add_counters(&self, s: &mut Stats) {
        s.connections = self.connections.load(Ordering::Relaxed);
        s.refused_connections = self.refused.load(Ordering::Relaxed);
        s.accept_errors = self.accept_errors.load(Ordering::Relaxed);
    }
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit; returns the soft limit then in force.
fn raise_nofile() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the local `rlimit` it is given and nothing else.
    #[allow(unsafe_code)]
    let got = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0;
    if !got {
        return u64::MAX;
    }
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit reads the local `rlimit` it is given.
        #[allow(unsafe_code)]
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim.rlim_cur = lim.rlim_max;
        }
    }
    lim.rlim_cur
}

/// A running unit. Dropping it does not stop it; call [`Server::shutdown`].
pub struct Server {
    shared: Arc<Shared>,
    addr: String,
    stop: watch::Sender<bool>,
    accept: tokio::task::JoinHandle<()>,
    timer: tokio::task::JoinHandle<()>,
}

/// Removes the file at `path` only if it is a stale socket (a socket no one accepts on):
/// never a regular file, a directory or a live socket.
fn remove_stale_socket(path: &str) -> std::io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if !meta.file_type().is_socket() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            format!("{path} exists and is not a socket; not removing it"),
        ));
    }
    match std::os::unix::net::UnixStream::connect(path) {
        Ok(_) => Err(std::io::Error::new(
            std::io::ErrorKind::AddrInUse,
            format!("{path} is a live socket (another process accepts on it)"),
        )),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => std::fs::remove_file(path),
        Err(e) => Err(std::io::Error::new(
            e.kind(),
            format!("{path}: cannot tell whether the socket is stale: {e}"),
        )),
    }
}

enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

/// A session id unique in the process, not only in its unit: the logs of several units in
/// one process (and the test harness's fault hooks, keyed by session) never mix sessions up.
pub(super) fn next_session() -> SessionId {
    use tessera_sync::unchecked::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
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
        if cfg.max_connections == 0 || cfg.max_peer_adds == 0 || cfg.preauth_message_bytes < 256 {
            return Err(ServerError::Config(format!(
                "max_connections ({}) and max_peer_adds ({}) must be at least 1, \
                 preauth_message_bytes ({}) at least 256",
                cfg.max_connections, cfg.max_peer_adds, cfg.preauth_message_bytes
            )));
        }
        let backend = cfg.backend;
        let payload_addr = cfg.payload_addr;
        let limits = ChunkLimits {
            capacity: cfg.pool_bytes,
            chunk: cfg.pool_chunk_bytes,
            idle: cfg.idle_pool_bytes,
            prefault: cfg.prefault_pool,
        };
        let token = cfg.unit.token.clone();
        let copy_slice = cfg.copy_slice_bytes;
        let (agent, pool) = tokio::task::spawn_blocking(move || {
            let agent = Arc::new(backend.role_agent_at("unit", payload_addr, token.as_ref())?);
            agent.set_copy_slice(usize::try_from(copy_slice).unwrap_or(usize::MAX));
            let pool = ChunkPool::new(agent.clone(), limits)?;
            Ok::<_, ServerError>((agent, pool))
        })
        .await??;
        let (listener, addr) = if let Some(path) = cfg.bind.strip_prefix("unix:") {
            remove_stale_socket(path).map_err(|source| ServerError::Bind {
                addr: cfg.bind.clone(),
                source,
            })?;
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
        let nofile = raise_nofile();
        let connection_cap = (cfg.max_connections as u64).min(nofile.saturating_sub(64).max(1));
        if connection_cap < cfg.max_connections as u64 {
            tracing::warn!(
                max_connections = cfg.max_connections,
                nofile,
                cap = connection_cap,
                "max_connections lowered below the open-file limit"
            );
        }
        let peer_adds = Arc::new(tokio::sync::Semaphore::new(cfg.max_peer_adds.max(1)));
        let generation = pool.generation();
        // Credits never hold more than an eighth of the registered memory, however small the
        // pool: the rest stays for the PUTs themselves.
        let mut unit_cfg = cfg.unit.clone();
        unit_cfg.credit_limit = unit_cfg.credit_limit.min(cfg.pool_bytes / 8);
        let mut unit = Unit::new(unit_cfg, PoolMemory { pool });
        unit.set_pull_puts(backend.pulls_puts());
        let shared = Arc::new(Shared {
            unit: Mutex::new(unit),
            agent,
            generation,
            cfg,
            sessions: Mutex::new(HashMap::new()),
            lingering: Mutex::new(HashMap::new()),
            tasks: Mutex::new(JoinSet::new()),
            connections: AtomicU64::new(0),
            connection_cap,
            refused: AtomicU64::new(0),
            accept_errors: AtomicU64::new(0),
            peer_adds,
            partitions: Default::default(),
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
        self.shared.stats()
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
        let sid = next_session();
        let s = self.shared.clone();
        self.shared
            .tasks
            .lock()
            .spawn(guarded_session(s, sid, Box::new(r), Box::new(w), None));
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
        let handles: Vec<SessionHandle> = self
            .shared
            .sessions
            .lock()
            .drain()
            .map(|(_, h)| h)
            .collect();
        for mut h in handles {
            h.jobs = None; // cancels queued WRITEs once the executor sees the channel close
            let _ = h.close.send(true);
        }
        let mut tasks = std::mem::take(&mut *self.shared.tasks.lock());
        while tasks.join_next().await.is_some() {}
        self.shared.unit.lock().teardown();
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
