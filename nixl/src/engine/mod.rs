//! The NIXL engine: one NIXL agent with its UCX backend, driven through `nixl-sys`.
//!
//! What a `Transport` backend calls:
//!
//! | step | here | NIXL |
//! |---|---|---|
//! | start | [`NixlEngine::new`] | agent (progress thread on, with a sleep between polls), UCX backend |
//! | address | [`NixlEngine::metadata`] | `getLocalMD` |
//! | register | [`NixlEngine::register`] → [`NixlRegion::remote_key`] | `registerMem` (DRAM), per chunk |
//! | connect / update | [`NixlEngine::load_remote`] → [`NixlPeer`], [`NixlPeer::update`] | `loadRemoteMD` |
//! | peer's registrations | [`NixlPeer::add_remote`] / [`NixlPeer::remove_remote`] | (checked by us before NIXL sees them) |
//! | transfer | [`NixlPeer::post`] or [`NixlPeer::write`] / [`NixlPeer::read`] ([`Pending`]) | `createXferReq` with a notification, `postXferReq`, `getXferStatus` |
//! | notifications | [`NixlConfig::on_notify`] or [`NixlEngine::recv_notification`] | `getNotifs` |
//! | close | drop the [`NixlPeer`] | `invalidateRemoteMD` once its transfers are done |
//!
//! **Completion** runs on one waiter thread per engine. While transfers are pending it asks
//! NIXL for their status, sleeping between rounds with a backoff from
//! [`NixlConfig::poll_min`] to [`NixlConfig::poll_max`]; when nothing is pending it blocks on
//! a condition variable (or, with [`NixlConfig::on_notify`] set, wakes every
//! [`NixlConfig::notify_poll`] to fetch notifications). It never spins a core. NIXL's own
//! progress thread is started with [`NixlConfig::progress_delay_us`]: with NIXL's default of 0
//! it spins a core while idle.
//!
//! **Release.** A transfer handle is released only once NIXL reports it finished. A transfer
//! that exceeds [`NixlConfig::timeout`] fails with [`NixlEngineError::Timeout`], but its
//! request and memory stay quarantined until NIXL reports it finished or, at the latest, until
//! teardown; one that never finishes is leaked rather than released while in flight. Every
//! NIXL call is serialized by the engine's lock. Teardown order: transfer handles, remote
//! metadata, registrations, then the agent (which outlives every handle holding it).
//!
//! **Statuses.** `nixl-sys` reports every NIXL failure status as `BackendError`; a failed
//! transfer is therefore [`NixlEngineError::TransferFailed`] carrying that error, whether the
//! peer died or the backend failed. A failed transfer never reports success.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tessera_sync::{Arc, Condvar, Mutex, Weak};

use tessera_onesided::{in_bounds, KeyChunk, KeyFormat};

use nixl_sys::{
    Agent, AgentConfig, Backend, MemType, MemoryRegion, NixlDescriptor, NixlError, NotificationMap,
    OptArgs, RegistrationHandle, XferDescList, XferOp, XferRequest, XferStatus,
};

mod memory;
mod peer;
mod waiter;

pub use memory::NixlRegion;
use memory::*;
pub use peer::{NixlPeer, XferOpDesc};
use waiter::*;

const KEY_MAGIC: &[u8; 4] = b"TNK1";
/// The remote key: per chunk its address and length (NIXL's own keys travel in the metadata).
const KEY: KeyFormat = KeyFormat {
    magic: KEY_MAGIC,
    max_chunks: 1 << 20,
    max_blob: 0,
};
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// Direction of a transfer, seen from the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum XferKind {
    /// Local memory to remote memory.
    Write,
    /// Remote memory to local memory.
    Read,
}

/// Which side of a transfer a descriptor is on: the crate's one [`Side`](tessera_transport::Side).
pub use tessera_transport::Side;

/// Receives notifications: `(sender agent name, message)`, on the waiter thread.
pub type NotifyFn = Arc<dyn Fn(&str, Vec<u8>) + Send + Sync>;

/// Settings of one engine.
#[derive(Clone)]
pub struct NixlConfig {
    /// The agent's name; peers see it in notifications and must not share it.
    pub name: String,
    /// Registrations larger than this are registered in chunks of this size.
    pub max_chunk: u64,
    /// Extra UCX backend parameters, e.g. `("ucx_error_handling_mode", "none")`.
    pub backend_params: Vec<(String, String)>,
    /// Sleep of NIXL's progress thread between polls, in µs (NIXL's default 0 spins).
    pub progress_delay_us: u64,
    /// Shortest sleep of the waiter between status rounds.
    pub poll_min: Duration,
    /// Longest sleep of the waiter between status rounds.
    pub poll_max: Duration,
    /// Transfers still pending after this fail with a timeout (their memory is quarantined).
    pub timeout: Option<Duration>,
    /// The largest notification accepted for sending.
    pub max_notification: usize,
    /// Where notifications go; `None` keeps them for the raw engine's `recv_notification`
    /// (an agent's engine always sends them to the agent).
    pub on_notify: Option<NotifyFn>,
    /// With `on_notify`, how often an idle waiter fetches notifications.
    pub notify_poll: Duration,
}

impl NixlConfig {
    /// Defaults: 64 GiB chunks, 10 ms progress delay, 20 µs to 1 ms status backoff, no
    /// timeout, 64 KiB notifications kept for `recv_notification`.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            max_chunk: 64 << 30,
            backend_params: Vec::new(),
            progress_delay_us: 10_000,
            poll_min: Duration::from_micros(20),
            poll_max: Duration::from_millis(1),
            timeout: None,
            max_notification: 64 << 10,
            on_notify: None,
            notify_poll: Duration::from_millis(5),
        }
    }
}

impl fmt::Debug for NixlConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NixlConfig")
            .field("name", &self.name)
            .field("max_chunk", &self.max_chunk)
            .field("backend_params", &self.backend_params)
            .field("progress_delay_us", &self.progress_delay_us)
            .field("timeout", &self.timeout)
            .field("on_notify", &self.on_notify.is_some())
            .finish()
    }
}

/// What went wrong in the NIXL engine.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NixlEngineError {
    /// A NIXL call failed; carries `nixl-sys`'s error.
    #[error("{call} failed: {source}")]
    Nixl {
        /// The NIXL operation.
        call: &'static str,
        /// The error `nixl-sys` reported.
        source: NixlError,
    },
    /// `libnixl_capi.so` could not be loaded (run `cargo xtask deps`).
    #[error("the NIXL library is not available: {0}")]
    Unavailable(String),
    /// NIXL reported the transfer failed (peer gone or backend failure).
    #[error("transfer with {peer:?} failed: {source}")]
    TransferFailed {
        /// The peer agent.
        peer: String,
        /// The status `nixl-sys` reported.
        source: NixlError,
    },
    /// The transfer did not finish in time; its request and memory are quarantined.
    #[error("transfer with {peer:?} still pending after {after:?}")]
    Timeout {
        /// The peer agent.
        peer: String,
        /// The configured timeout.
        after: Duration,
    },
    /// A descriptor falls outside its registration (caller misuse); nothing was posted.
    #[error("descriptor {index}: {len} bytes at offset {offset} fall outside the {side} registration of {reg_len} bytes")]
    OutOfRange {
        /// Which side.
        side: Side,
        /// The descriptor's position.
        index: usize,
        /// Its offset.
        offset: u64,
        /// Its length.
        len: u64,
        /// The registration's length.
        reg_len: u64,
    },
    /// A descriptor names a remote registration unknown to this peer handle.
    #[error("descriptor {index}: remote registration {id} is unknown for peer {peer:?}")]
    UnknownRemote {
        /// The peer.
        peer: String,
        /// The descriptor's position.
        index: usize,
        /// The registration id.
        id: u64,
    },
    /// A local registration of another engine was used (caller misuse).
    #[error("descriptor {index}: the local registration belongs to another engine")]
    ForeignRegistration {
        /// The descriptor's position.
        index: usize,
    },
    /// Caller misuse: empty registration, empty transfer, oversized notification.
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// A remote key from a peer is malformed.
    #[error("malformed remote key: {0}")]
    Malformed(&'static str),
    /// The engine is shutting down.
    #[error("the NIXL engine {0:?} is shut down")]
    Shutdown(String),
}

impl From<tessera_onesided::Malformed> for NixlEngineError {
    fn from(m: tessera_onesided::Malformed) -> Self {
        NixlEngineError::Malformed(m.detail)
    }
}

fn nixl(call: &'static str) -> impl FnOnce(NixlError) -> NixlEngineError {
    move |source| NixlEngineError::Nixl { call, source }
}

/// A NIXL agent with its UCX backend and its waiter thread.
///
/// Dropping it lets pending transfers finish for a grace period, then invalidates the peers
/// (which fails what is left in NIXL), and leaks what NIXL still reports in flight rather
/// than release it. The agent itself is destroyed once the last [`NixlRegion`] and
/// [`NixlPeer`] are gone too.
pub struct NixlEngine {
    inner: Arc<Inner>,
    thread: Option<JoinHandle<()>>,
}

impl fmt::Debug for NixlEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NixlEngine")
            .field("name", &self.inner.name)
            .finish()
    }
}

impl NixlEngine {
    /// Creates the agent and its UCX backend and starts the waiter thread.
    pub fn new(config: NixlConfig) -> Result<Self, NixlEngineError> {
        if config.max_chunk == 0 || config.poll_min.is_zero() || config.poll_max < config.poll_min {
            return Err(NixlEngineError::Invalid(
                "max_chunk and poll_min must be positive, poll_max at least poll_min".into(),
            ));
        }
        if nixl_sys::is_stub() {
            return Err(NixlEngineError::Unavailable(
                "libnixl_capi.so was not found; run `cargo xtask deps`".into(),
            ));
        }
        let cfg = AgentConfig {
            enable_prog_thread: true,
            pthr_delay_us: config.progress_delay_us,
            ..AgentConfig::default()
        };
        let agent = Agent::new_configured(&config.name, &cfg).map_err(nixl("createAgent"))?;
        let (_mems, mut params) = agent
            .get_plugin_params("UCX")
            .map_err(nixl("getPluginParams(UCX)"))?;
        for (k, v) in &config.backend_params {
            params.set(k, v).map_err(nixl("backend parameter"))?;
        }
        let backend = agent
            .create_backend("UCX", &params)
            .map_err(nixl("createBackend(UCX)"))?;
        let inner = Arc::new(Inner {
            name: config.name,
            agent,
            backend,
            state: Mutex::new(State {
                inflight: Vec::new(),
                peers: HashMap::new(),
                notes: VecDeque::new(),
                stopped: false,
            }),
            cv: Condvar::new(),
            poll_min: config.poll_min,
            poll_max: config.poll_max,
            notify_poll: config.notify_poll,
            timeout: config.timeout,
            max_chunk: config.max_chunk,
            max_notification: config.max_notification,
            on_notify: config.on_notify,
            registrations: tessera_sync::atomic::AtomicUsize::new(0),
        });
        let t = inner.clone();
        let thread = std::thread::Builder::new()
            .name(format!("nixl-waiter-{}", inner.name))
            .spawn(move || waiter(t))
            .map_err(|e| NixlEngineError::Invalid(format!("spawning the waiter thread: {e}")))?;
        Ok(Self {
            inner,
            thread: Some(thread),
        })
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// This agent's metadata (`getLocalMD`): what a peer passes to
    /// [`NixlEngine::load_remote`]. Fetch it again after registering memory.
    pub fn metadata(&self) -> Result<Vec<u8>, NixlEngineError> {
        let _st = self.inner.state.lock();
        self.inner.agent.get_local_md().map_err(nixl("getLocalMD"))
    }

    /// Registers `len` bytes at `ptr` as DRAM, in chunks of at most the configured size.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be memory of this process that stays mapped, readable and
    /// writable until the returned [`NixlRegion`] and every clone of it are dropped
    /// (transfers in flight, including quarantined ones, hold clones). Peers may write it at
    /// any time while it is registered and they hold its key.
    pub unsafe fn register(&self, ptr: *mut u8, len: u64) -> Result<NixlRegion, NixlEngineError> {
        // SAFETY: forwarded: the caller upholds this function's contract.
        unsafe { self.register_owned(ptr, len, None) }
    }

    /// Like [`NixlEngine::register`], also holding `owner` (what keeps the memory mapped)
    /// until the registrations are released, including from quarantine.
    ///
    /// # Safety
    /// As for [`NixlEngine::register`]; holding `owner` must be enough to keep the range
    /// mapped, or the caller must keep it mapped otherwise.
    pub(crate) unsafe fn register_owned(
        &self,
        ptr: *mut u8,
        len: u64,
        owner: Option<Box<dyn Send + Sync>>,
    ) -> Result<NixlRegion, NixlEngineError> {
        if ptr.is_null() || len == 0 {
            return Err(NixlEngineError::Invalid(
                "cannot register an empty range".into(),
            ));
        }
        if (ptr as u64).checked_add(len).is_none() || usize::try_from(len).is_err() {
            return Err(NixlEngineError::Invalid(
                "range wraps the address space".into(),
            ));
        }
        let st = self.inner.state.lock();
        if st.stopped {
            return Err(NixlEngineError::Shutdown(self.inner.name.clone()));
        }
        let mut handles = Vec::new();
        let mut chunks = Vec::new();
        let mut start = 0u64;
        while start < len {
            let clen = (len - start).min(self.inner.max_chunk);
            let range = RawRange {
                addr: ptr as usize + start as usize,
                len: clen as usize,
            };
            match self.inner.agent.register_memory(&range, None) {
                Ok(h) => handles.push(h),
                Err(e) => {
                    drop(handles); // deregisters what was registered, lock still held
                    return Err(NixlEngineError::Nixl {
                        call: "registerMem",
                        source: e,
                    });
                }
            }
            chunks.push((start, clen));
            start += clen;
        }
        drop(st);
        self.inner
            .registrations
            .fetch_add(1, tessera_sync::atomic::Ordering::Relaxed);
        Ok(NixlRegion {
            inner: Arc::new(RegInner {
                engine: self.inner.clone(),
                handles,
                base: ptr as usize,
                len,
                chunks,
                _owner: owner,
            }),
        })
    }

    /// Loads a peer's metadata (`loadRemoteMD`) and returns a handle on it. The peer's
    /// metadata is invalidated when its last handle is dropped and its transfers are done.
    pub fn load_remote(&self, metadata: &[u8]) -> Result<NixlPeer, NixlEngineError> {
        self.load_remote_named(metadata, None)
    }

    /// Like [`NixlEngine::load_remote`] for metadata that must be of peer `expected`; if
    /// NIXL refuses it because a previous instance of that peer is still loaded (the peer
    /// restarted), that instance is invalidated and the metadata loaded again.
    pub fn load_remote_named(
        &self,
        metadata: &[u8],
        expected: Option<&str>,
    ) -> Result<NixlPeer, NixlEngineError> {
        let mut st = self.inner.state.lock();
        if st.stopped {
            return Err(NixlEngineError::Shutdown(self.inner.name.clone()));
        }
        let name = match self.inner.agent.load_remote_md(metadata) {
            Ok(name) => name,
            Err(first) => match expected {
                // A peer that restarted under the same name: NIXL still holds the dead
                // one's connection. Forget it, then load the new metadata.
                Some(peer) if st.peers.contains_key(peer) => {
                    let _ = self.inner.agent.invalidate_remote_md(peer);
                    if let Some(p) = st.peers.get_mut(peer) {
                        p.regs.clear();
                    }
                    self.inner
                        .agent
                        .load_remote_md(metadata)
                        .map_err(nixl("loadRemoteMD"))?
                }
                _ => {
                    return Err(NixlEngineError::Nixl {
                        call: "loadRemoteMD",
                        source: first,
                    })
                }
            },
        };
        if expected.is_some_and(|e| e != name) {
            return Err(NixlEngineError::Invalid(format!(
                "metadata of {name:?} given for peer {:?}",
                expected.unwrap_or_default()
            )));
        }
        st.peers.entry(name.clone()).or_default().handles += 1;
        Ok(NixlPeer {
            engine: self.inner.clone(),
            name,
        })
    }

    /// The next notification (when no [`NixlConfig::on_notify`] was set), waiting up to
    /// `timeout` (forever with `None`), polling NIXL with the engine's backoff.
    pub fn recv_notification(&self, timeout: Option<Duration>) -> Option<(String, Vec<u8>)> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut backoff = self.inner.poll_min;
        loop {
            {
                let mut st = self.inner.state.lock();
                if st.notes.is_empty() && self.inner.on_notify.is_none() {
                    let mut fresh = Vec::new();
                    self.inner.fetch_notes(&mut fresh);
                    st.notes.extend(fresh);
                }
                if let Some(n) = st.notes.pop_front() {
                    return Some(n);
                }
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return None;
            }
            let nap = deadline.map_or(backoff, |d| backoff.min(d - now));
            std::thread::sleep(nap);
            backoff = (backoff * 2).min(self.inner.poll_max);
        }
    }

    /// What the engine holds, for leak checks.
    pub fn report(&self) -> NixlReport {
        let st = self.inner.state.lock();
        NixlReport {
            pending_transfers: st.inflight.iter().filter(|x| x.done.is_some()).count(),
            quarantined: st.inflight.iter().filter(|x| x.done.is_none()).count(),
            peers: st.peers.len(),
            registrations: self
                .inner
                .registrations
                .load(tessera_sync::atomic::Ordering::Relaxed),
        }
    }

    /// A weak probe on the agent, which outlives the engine handle while registrations or
    /// peer handles exist.
    pub fn probe(&self) -> NixlProbe {
        NixlProbe {
            inner: Arc::downgrade(&self.inner),
        }
    }

    fn shutdown(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        self.inner.state.lock().stopped = true;
        self.inner.cv.notify_all();
        let _ = thread.join();
        let start = Instant::now();
        let mut invalidated = false;
        loop {
            let mut after = After::default();
            let busy = {
                let mut st = self.inner.state.lock();
                self.inner.round(&mut st, &mut after, Instant::now());
                if !invalidated && start.elapsed() >= SHUTDOWN_GRACE {
                    // Disconnecting the peers makes NIXL fail what is still in flight.
                    invalidated = true;
                    let names: Vec<String> = st.peers.keys().cloned().collect();
                    for n in names {
                        let _ = self.inner.agent.invalidate_remote_md(&n);
                    }
                }
                !st.inflight.is_empty()
            };
            self.inner.run_after(after);
            if !busy || start.elapsed() >= 2 * SHUTDOWN_GRACE {
                break;
            }
            std::thread::sleep(self.inner.poll_max);
        }
        let mut st = self.inner.state.lock();
        for x in std::mem::take(&mut st.inflight) {
            // NIXL still reports it in flight: never release it or its memory.
            std::mem::forget(x.req);
            std::mem::forget(x.keep);
            if let Some(done) = x.done {
                done(Err(NixlEngineError::Shutdown(self.inner.name.clone())));
            }
        }
    }
}

impl Drop for NixlEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// What an engine holds, for leak checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NixlReport {
    /// Transfers posted and not yet reported.
    pub pending_transfers: usize,
    /// Transfers reported as timed out whose requests NIXL still runs.
    pub quarantined: usize,
    /// Peers whose metadata is loaded.
    pub peers: usize,
    /// Live registrations (counting clones held by transfers as one).
    pub registrations: usize,
}

/// Tells whether an engine's agent still exists (see [`NixlEngine::probe`]).
#[derive(Clone)]
pub struct NixlProbe {
    inner: Weak<Inner>,
}

impl fmt::Debug for NixlProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NixlProbe")
            .field("alive", &self.is_alive())
            .finish()
    }
}

impl NixlProbe {
    /// Whether the agent is still alive.
    pub fn is_alive(&self) -> bool {
        self.inner.strong_count() > 0
    }
}

/// A posted transfer's outcome, to wait on (the raw API's `write` and `read`).
pub type Pending = tessera_onesided::Pending<Result<(), NixlEngineError>>;

#[allow(dead_code)]
fn assert_send_sync() {
    fn is<T: Send + Sync>() {}
    is::<NixlEngine>();
    is::<NixlPeer>();
    is::<NixlRegion>();
    is::<Pending>();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_decode_and_reject_bad_input() {
        let mut key = KEY_MAGIC.to_vec();
        key.extend_from_slice(&2u32.to_le_bytes());
        for (a, l) in [(4096u64, 100u64), (4196, 50)] {
            key.extend_from_slice(&a.to_le_bytes());
            key.extend_from_slice(&l.to_le_bytes());
        }
        let reg = decode_key(&key).unwrap();
        assert_eq!(reg.len, 150);
        assert_eq!(reg.chunks[1], (100, 4196, 50));
        for n in 0..key.len() {
            assert!(decode_key(&key[..n]).is_err(), "prefix {n}");
        }
        let mut gap = key.clone();
        gap[24] ^= 1; // second chunk's address no longer follows the first
        assert!(decode_key(&gap).is_err());
    }
}
