//! The UCX engine: one-sided PUT and GET through UCP, on bindings generated at build time.
//!
//! What a `Transport` backend calls:
//!
//! | step | here | UCP |
//! |---|---|---|
//! | start | [`UcxEngine::new`] | `ucp_init`, `ucp_worker_create` (serialized mode), AM handler |
//! | address | [`UcxEngine::address`] | `ucp_worker_get_address` |
//! | register | [`UcxEngine::register`] → [`MemRegion::remote_key`] | `ucp_mem_map` + `ucp_rkey_pack`, per chunk |
//! | connect | [`UcxEngine::connect`] → [`UcxEndpoint`] | `ucp_ep_create`, peer error handling |
//! | peer metadata | [`UcxEndpoint::add_remote`] / [`UcxEndpoint::remove_remote`] | `ucp_ep_rkey_unpack` / `ucp_rkey_destroy` |
//! | transfer | [`UcxEndpoint::post`] (callback) or [`UcxEndpoint::put`] / [`UcxEndpoint::get`] ([`Pending`]) | `ucp_put_nbx` / `ucp_get_nbx` per piece, `ucp_ep_flush_nbx`, then `ucp_am_send_nbx` for the notification |
//! | notifications | [`UcxConfig::on_notify`] or [`UcxEngine::recv_notification`] | AM receive handler |
//! | teardown | drop handles, then the engine | requests, endpoints, memory handles, worker, context |
//!
//! **Threading.** The worker is created in `UCS_THREAD_MODE_SERIALIZED` and every UCP call is
//! made with the engine's state lock held, so the handles are `Send + Sync`. One progress
//! thread per engine drives the worker: it progresses until there is nothing left to do, arms
//! the worker's event fd (`ucp_worker_arm`) and sleeps in `epoll_wait` on that fd and on an
//! eventfd that posting threads write. While idle it never spins.
//!
//! **Completion.** A transfer's pieces are posted back to back, then one endpoint flush; when
//! the flush completes, every byte landed at the target. Then the notification, if any, goes
//! out as an active message, which the target receives after the data. The completion callback
//! runs on the progress thread, outside every lock. A failed transfer never reports success.
//!
//! **Endpoint lifetime.** UCX pairs the endpoints two workers open to each other into one
//! connection, so closing ours would break the peer's: a dropped [`UcxEndpoint`] is parked,
//! open, until the peer fails or the engine stops, and reconnecting to the same worker takes
//! it up again. A transfer whose endpoint failed before its completion was seen fails, even
//! where UCX completed the discarded requests without an error status.
//!
//! **Peer death.** Endpoints use `UCP_ERR_HANDLING_MODE_PEER`; the error callback marks the
//! endpoint failed, the pending transfers fail with [`UcxError::PeerGone`], and later posts are
//! refused with the same error. The endpoint is then closed in force mode.
//!
//! **Registrations** larger than [`UcxConfig::max_chunk`] are mapped in chunks; the remote key
//! lists all of them and transfers are split at chunk boundaries on both sides, transparently.
//!
//! The peer's address and keys are framed and checksummed by us and checked before UCX sees
//! them; they must still come from a peer you trust, as UCX cannot validate their contents.
//!
//! The engine proper: context, worker, progress thread, endpoints, memory handles, transfers.
//!
//! Locking: `Inner::state` guards every UCP handle and is held for every UCP call. Callbacks
//! that UCX invokes from inside `ucp_worker_progress` (endpoint errors, active messages) only
//! push to `Inner::events`, a leaf lock never held across a UCP call. User callbacks
//! (completions, notifications) and the release of memory handles run with no lock held.

use std::collections::{HashMap, VecDeque};
use std::ffi::{c_void, CStr, CString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tessera_sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use tessera_sync::{Arc, Condvar, Mutex, Weak};

use tessera_onesided::in_bounds;

use crate::key::{self, KeyChunk};
use crate::sys;
use crate::{ErrorHandling, NotifyFn, RmaKind, Side, UcxConfig, UcxError};

mod endpoint;
mod memory;
mod worker;

pub use endpoint::{RmaOp, UcxEndpoint};
use memory::*;
pub use memory::{MemRegion, UcxProbe};
use worker::*;

/// Active-message id of notifications; both sides use the same.
const AM_NOTIFY: u32 = 0x7e55;
/// How long shutdown lets in-flight transfers finish before it cancels them.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// How long a worker must stay quiet at shutdown before it is destroyed.
const QUIET: Duration = Duration::from_millis(100);

type Done = Box<dyn FnOnce(Result<(), UcxError>) + Send>;
/// A completed transfer: its callback, outcome and the memory it held.
type Finished = (Done, Result<(), UcxError>, Vec<Arc<MemInner>>);

fn status_message(status: sys::ucs_status_t) -> String {
    // SAFETY: ucs_status_string accepts any status value and returns a pointer to a static,
    // NUL-terminated string (or NULL, checked).
    let p = unsafe { sys::ucs_status_string(status) };
    if p.is_null() {
        return format!("unknown status {status}");
    }
    // SAFETY: p is non-null and points to a static NUL-terminated string owned by UCX.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn status_error(call: &'static str, status: sys::ucs_status_t) -> UcxError {
    UcxError::Status {
        call,
        status,
        message: status_message(status),
    }
}

fn check(call: &'static str, status: sys::ucs_status_t) -> Result<(), UcxError> {
    if status == sys::UCS_OK {
        Ok(())
    } else {
        Err(status_error(call, status))
    }
}

/// Statuses that mean the connection to the peer is lost.
fn is_peer_failure(status: sys::ucs_status_t) -> bool {
    status == sys::UCS_ERR_CONNECTION_RESET
        || status == sys::UCS_ERR_UNREACHABLE
        || (sys::UCS_ERR_LAST_LINK_FAILURE..=sys::UCS_ERR_FIRST_LINK_FAILURE).contains(&status)
        || (sys::UCS_ERR_LAST_ENDPOINT_FAILURE..=sys::UCS_ERR_FIRST_ENDPOINT_FAILURE)
            .contains(&status)
}

fn os_error(op: &'static str) -> UcxError {
    UcxError::Os {
        op,
        source: std::io::Error::last_os_error(),
    }
}

/// An engine: one UCP context and worker, with their progress thread.
///
/// Dropping it fails or cancels pending transfers (after a short grace period), closes every
/// endpoint and stops the thread; the worker and context are destroyed once the last
/// [`MemRegion`] and [`UcxEndpoint`] of this engine are gone too.
pub struct UcxEngine {
    inner: Arc<Inner>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for UcxEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxEngine")
            .field("name", &self.inner.name)
            .finish()
    }
}

fn cstring(what: &str, s: &str) -> Result<CString, UcxError> {
    CString::new(s).map_err(|_| UcxError::Invalid(format!("{what} contains a NUL byte")))
}

impl UcxEngine {
    /// Creates the context and worker and starts the progress thread.
    pub fn new(config: UcxConfig) -> Result<Self, UcxError> {
        if config.max_chunk == 0 {
            return Err(UcxError::Invalid("max_chunk must be positive".into()));
        }
        let tls = config
            .tls
            .as_deref()
            .map(|t| cstring("tls", t))
            .transpose()?;
        let name = cstring("name", &config.name)?;

        let mut cfg: *mut sys::ucp_config_t = ptr::null_mut();
        // SAFETY: NULL prefix and file mean the defaults; `cfg` is a valid out pointer.
        check("ucp_config_read", unsafe {
            sys::ucp_config_read(ptr::null(), ptr::null(), &mut cfg)
        })?;
        if let Some(tls) = &tls {
            // SAFETY: `cfg` was just read and not yet released; both strings are C strings.
            let s = unsafe { sys::ucp_config_modify(cfg, c"TLS".as_ptr(), tls.as_ptr()) };
            if s != sys::UCS_OK {
                // SAFETY: releases the config read above, once.
                unsafe { sys::ucp_config_release(cfg) };
                return Err(status_error("ucp_config_modify(TLS)", s));
            }
        }
        let params = sys::ucp_params_t {
            field_mask: u64::from(sys::UCP_PARAM_FIELD_FEATURES | sys::UCP_PARAM_FIELD_NAME),
            features: u64::from(
                sys::UCP_FEATURE_RMA | sys::UCP_FEATURE_AM | sys::UCP_FEATURE_WAKEUP,
            ),
            name: name.as_ptr(),
            ..Default::default()
        };
        let mut context: sys::ucp_context_h = ptr::null_mut();
        // SAFETY: params and cfg are valid for the call; `context` is a valid out pointer.
        let s = unsafe {
            sys::ucp_init_version(
                sys::UCP_API_MAJOR,
                sys::UCP_API_MINOR,
                &params,
                cfg,
                &mut context,
            )
        };
        // SAFETY: the config is no longer needed after ucp_init; released once.
        unsafe { sys::ucp_config_release(cfg) };
        check("ucp_init", s)?;

        let wparams = sys::ucp_worker_params_t {
            field_mask: u64::from(sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE),
            thread_mode: sys::UCS_THREAD_MODE_SERIALIZED,
            ..Default::default()
        };
        let mut worker: sys::ucp_worker_h = ptr::null_mut();
        // SAFETY: live context; valid params and out pointer.
        let s = unsafe { sys::ucp_worker_create(context, &wparams, &mut worker) };
        if s != sys::UCS_OK {
            // SAFETY: the context has no worker; cleaned up once.
            unsafe { sys::ucp_cleanup(context) };
            return Err(status_error("ucp_worker_create", s));
        }
        let destroy = |worker, context| {
            // SAFETY: called only on the error paths below, before `Inner` takes ownership:
            // the worker has no endpoints or memory handles yet.
            unsafe {
                sys::ucp_worker_destroy(worker);
                sys::ucp_cleanup(context);
            }
        };

        let mut efd: RawFd = -1;
        // SAFETY: live worker of a context with UCP_FEATURE_WAKEUP; valid out pointer.
        let s = unsafe { sys::ucp_worker_get_efd(worker, &mut efd) };
        if s != sys::UCS_OK {
            destroy(worker, context);
            return Err(status_error("ucp_worker_get_efd", s));
        }
        let mut addr: *mut sys::ucp_address_t = ptr::null_mut();
        let mut addr_len: usize = 0;
        // SAFETY: live worker; valid out pointers.
        let s = unsafe { sys::ucp_worker_get_address(worker, &mut addr, &mut addr_len) };
        if s != sys::UCS_OK {
            destroy(worker, context);
            return Err(status_error("ucp_worker_get_address", s));
        }
        // SAFETY: UCX returned `addr_len` readable bytes at `addr`, valid until released.
        let raw = unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), addr_len) }.to_vec();
        // SAFETY: releases the address obtained above, once, on the same worker.
        unsafe { sys::ucp_worker_release_address(worker, addr) };
        let address = key::encode_address(&raw);

        let fds = (|| -> Result<(OwnedFd, OwnedFd), UcxError> {
            // SAFETY: plain syscall; the result is checked before use.
            let wake = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
            if wake < 0 {
                return Err(os_error("eventfd"));
            }
            // SAFETY: `wake` is a fresh fd that nothing else owns.
            let wake = unsafe { OwnedFd::from_raw_fd(wake) };
            // SAFETY: plain syscall; checked.
            let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
            if ep < 0 {
                return Err(os_error("epoll_create1"));
            }
            // SAFETY: fresh fd owned by nothing else.
            let epoll = unsafe { OwnedFd::from_raw_fd(ep) };
            for fd in [efd, wake.as_raw_fd()] {
                let mut ev = libc::epoll_event {
                    events: libc::EPOLLIN as u32,
                    u64: fd as u64,
                };
                // SAFETY: both fds are open (the worker's stays open while the worker lives,
                // and the epoll set is dropped with `Inner`); `ev` is valid for the call.
                if unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) } < 0 {
                    return Err(os_error("epoll_ctl"));
                }
            }
            Ok((wake, epoll))
        })();
        let (wake, epoll) = match fds {
            Ok(f) => f,
            Err(e) => {
                destroy(worker, context);
                return Err(e);
            }
        };

        let inner = Arc::new(Inner {
            name: config.name,
            state: Mutex::new(State {
                context,
                worker,
                eps: HashMap::new(),
                ops: Vec::new(),
                next_id: 1,
                stopped: false,
            }),
            events: Mutex::new(Vec::new()),
            notes: Mutex::new(VecDeque::new()),
            notes_cv: Condvar::new(),
            on_notify: config.on_notify,
            wake,
            epoll,
            max_chunk: config.max_chunk.div_ceil(4096).saturating_mul(4096),
            max_notification: config.max_notification,
            address,
            error_handling: config.error_handling,
            busy_poll: config.busy_poll,
            live_mem: AtomicUsize::new(0),
            leak_worker: AtomicBool::new(false),
        });

        let am = sys::ucp_am_handler_param_t {
            field_mask: u64::from(
                sys::UCP_AM_HANDLER_PARAM_FIELD_ID
                    | sys::UCP_AM_HANDLER_PARAM_FIELD_FLAGS
                    | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
                    | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG,
            ),
            id: AM_NOTIFY,
            flags: sys::UCP_AM_FLAG_WHOLE_MSG,
            cb: Some(on_notify_am),
            arg: Arc::as_ptr(&inner) as *mut c_void,
        };
        {
            let st = inner.state.lock();
            // SAFETY: live worker, lock held; `arg` is the Inner that owns the worker and
            // outlives it (the worker is destroyed in Inner::drop before anything else).
            check("ucp_worker_set_am_recv_handler", unsafe {
                sys::ucp_worker_set_am_recv_handler(st.worker, &am)
            })?;
        }

        let thread_inner = inner.clone();
        let thread = std::thread::Builder::new()
            .name(format!("ucx-progress-{}", inner.name))
            .spawn(move || progress_thread(thread_inner))
            .map_err(|source| UcxError::Os {
                op: "spawning the progress thread",
                source,
            })?;
        Ok(Self {
            inner,
            thread: Some(thread),
        })
    }

    /// The engine's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// What a peer passes to [`UcxEngine::connect`] to reach this engine (framed worker address).
    pub fn address(&self) -> &[u8] {
        &self.inner.address
    }

    /// Registers `len` bytes at `ptr` (`ucp_mem_map`), in chunks of at most the configured
    /// chunk size, and packs their remote keys.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be memory of this process that stays mapped, readable and
    /// writable until the returned [`MemRegion`] and every clone of it are dropped (transfers
    /// in flight hold clones). Peers may write it at any time while it is registered and
    /// their key is valid: the caller must not rely on its contents during that time except
    /// through completed transfers.
    pub unsafe fn register(&self, ptr: *mut u8, len: u64) -> Result<MemRegion, UcxError> {
        // SAFETY: forwarded: the caller upholds this function's contract.
        unsafe { self.register_owned(ptr, len, None) }
    }

    /// Like [`UcxEngine::register`], also holding `owner` (what keeps the memory mapped)
    /// until the memory handles are unmapped: a transfer that UCX may still be running after
    /// it was reported keeps both.
    ///
    /// # Safety
    /// As for [`UcxEngine::register`]; holding `owner` must be enough to keep the range
    /// mapped, or the caller must keep it mapped otherwise.
    pub(crate) unsafe fn register_owned(
        &self,
        ptr: *mut u8,
        len: u64,
        owner: Option<Box<dyn Send + Sync>>,
    ) -> Result<MemRegion, UcxError> {
        if ptr.is_null() || len == 0 {
            return Err(UcxError::Invalid("cannot register an empty range".into()));
        }
        if (ptr as u64).checked_add(len).is_none() || usize::try_from(len).is_err() {
            return Err(UcxError::Invalid("range wraps the address space".into()));
        }
        let mut chunks: Vec<LocalChunk> = Vec::new();
        let mut packed: Vec<Vec<u8>> = Vec::new();
        let st = self.inner.state.lock();
        if st.stopped {
            return Err(UcxError::Shutdown(self.inner.name.clone()));
        }
        let mut start = 0u64;
        let result = (|| {
            while start < len {
                let clen = (len - start).min(self.inner.max_chunk);
                let params = sys::ucp_mem_map_params_t {
                    field_mask: u64::from(
                        sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                            | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                            | sys::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
                    ),
                    address: ptr.wrapping_add(start as usize).cast(),
                    length: clen as usize,
                    memory_type: sys::UCS_MEMORY_TYPE_HOST,
                    ..Default::default()
                };
                let mut memh: sys::ucp_mem_h = ptr::null_mut();
                // SAFETY: live context, lock held; the range is valid memory per this
                // function's contract; `memh` is a valid out pointer.
                check("ucp_mem_map", unsafe {
                    sys::ucp_mem_map(st.context, &params, &mut memh)
                })?;
                chunks.push(LocalChunk {
                    memh,
                    start,
                    len: clen,
                });
                let mut buf: *mut c_void = ptr::null_mut();
                let mut blen: usize = 0;
                // SAFETY: live context and the memh just mapped; valid out pointers.
                check("ucp_rkey_pack", unsafe {
                    sys::ucp_rkey_pack(st.context, memh, &mut buf, &mut blen)
                })?;
                // SAFETY: UCX returned `blen` readable bytes at `buf`, valid until released.
                packed.push(unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), blen) }.to_vec());
                // SAFETY: releases the buffer packed above, once.
                unsafe { sys::ucp_rkey_buffer_release(buf) };
                start += clen;
            }
            Ok(())
        })();
        if let Err(e) = result {
            for c in chunks {
                // SAFETY: mapped above on this context and not shared with anyone yet.
                unsafe { sys::ucp_mem_unmap(st.context, c.memh) };
            }
            return Err(e);
        }
        drop(st);
        self.inner.live_mem.fetch_add(1, Ordering::Relaxed);
        let key = key::encode_key(chunks.iter().zip(&packed).map(|(c, k)| KeyChunk {
            addr: ptr as u64 + c.start,
            len: c.len,
            blob: k,
        }));
        Ok(MemRegion {
            inner: Arc::new(MemInner {
                engine: self.inner.clone(),
                base: ptr as usize,
                len,
                chunks,
                key,
                _owner: owner,
            }),
        })
    }

    /// Opens an endpoint to the engine whose [`UcxEngine::address`] is `address`, with peer
    /// error handling. `peer` names it in errors.
    pub fn connect(&self, peer: &str, address: &[u8]) -> Result<UcxEndpoint, UcxError> {
        let raw = key::decode_address(address)?;
        let mut st = self.inner.state.lock();
        if st.stopped {
            return Err(UcxError::Shutdown(self.inner.name.clone()));
        }
        // A parked endpoint to the same worker is taken up again rather than a second one
        // opened: it is still paired with the peer's endpoint to us.
        self.inner.absorb_failures(&mut st);
        let parked = st.eps.iter_mut().find(|(_, e)| {
            e.dropped && e.close == CloseState::Open && e.failed.is_none() && e.address == raw
        });
        if let Some((&id, e)) = parked {
            e.dropped = false;
            e.peer = peer.to_owned();
            drop(st);
            return Ok(UcxEndpoint {
                engine: self.inner.clone(),
                id,
                peer: peer.to_owned(),
            });
        }
        let id = st.next_id;
        st.next_id += 1;
        let err_arg = Box::into_raw(Box::new(ErrArg {
            inner: Arc::as_ptr(&self.inner),
            ep: id,
        }));
        let params = sys::ucp_ep_params_t {
            field_mask: u64::from(
                sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                    | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                    | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER,
            ),
            address: raw.as_ptr().cast(),
            err_mode: match self.inner.error_handling {
                ErrorHandling::Peer => sys::UCP_ERR_HANDLING_MODE_PEER,
                ErrorHandling::None => sys::UCP_ERR_HANDLING_MODE_NONE,
            },
            err_handler: sys::ucp_err_handler_t {
                cb: Some(on_ep_error),
                arg: err_arg.cast(),
            },
            ..Default::default()
        };
        let mut ep: sys::ucp_ep_h = ptr::null_mut();
        // SAFETY: live worker, lock held; the address bytes passed our framing checks and
        // live for the call; `err_arg` stays allocated until the endpoint is closed.
        let s = unsafe { sys::ucp_ep_create(st.worker, &params, &mut ep) };
        if s != sys::UCS_OK {
            // SAFETY: no endpoint was created, so UCX holds no reference to it; freed once.
            drop(unsafe { Box::from_raw(err_arg) });
            return Err(status_error("ucp_ep_create", s));
        }
        st.eps.insert(
            id,
            EpState {
                ep,
                peer: peer.to_owned(),
                address: raw.to_vec(),
                err_arg,
                remotes: HashMap::new(),
                retired: Vec::new(),
                pending: 0,
                failed: None,
                dropped: false,
                close: CloseState::Open,
                quarantine: Vec::new(),
            },
        );
        drop(st);
        self.inner.wake();
        Ok(UcxEndpoint {
            engine: self.inner.clone(),
            id,
            peer: peer.to_owned(),
        })
    }

    /// The next queued notification (when no [`UcxConfig::on_notify`] was set), waiting up to
    /// `timeout` (forever with `None`).
    pub fn recv_notification(&self, timeout: Option<Duration>) -> Option<(String, Vec<u8>)> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut q = self.inner.notes.lock();
        loop {
            if let Some(n) = q.pop_front() {
                return Some(n);
            }
            match deadline {
                None => q = self.inner.notes_cv.wait(q),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return None;
                    }
                    q = self.inner.notes_cv.wait_timeout(q, d - now).0;
                }
            }
        }
    }

    /// A report of what the engine holds, for leak checks.
    pub fn report(&self) -> UcxReport {
        let st = self.inner.state.lock();
        UcxReport {
            endpoints: st
                .eps
                .values()
                .filter(|e| !e.dropped && e.close != CloseState::Closed)
                .count(),
            parked: st
                .eps
                .values()
                .filter(|e| e.dropped && e.close != CloseState::Closed)
                .count(),
            pending_transfers: st.ops.len(),
            quarantined: st.eps.values().map(|e| e.quarantine.len()).sum(),
            memory_handles: self.inner.live_mem.load(Ordering::Relaxed),
        }
    }

    /// A weak probe on the engine's worker and context, which outlive the engine handle
    /// while endpoints or memory handles are alive.
    pub fn probe(&self) -> UcxProbe {
        UcxProbe {
            inner: Arc::downgrade(&self.inner),
        }
    }

    fn shutdown(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        self.inner.state.lock().stopped = true;
        self.inner.wake();
        let _ = thread.join();
        // Progress here now: close every endpoint (flush mode, or force mode if its peer
        // failed, once nothing is pending on it) and let in-flight transfers finish for a
        // grace period, then cancel them.
        let start = Instant::now();
        let mut forced = false;
        loop {
            let mut after = After::default();
            let busy = {
                let mut st = self.inner.state.lock();
                self.inner.pass(&mut st, &mut after);
                if !forced && start.elapsed() >= SHUTDOWN_GRACE {
                    forced = true;
                    force_close_pending(&mut st);
                }
                !st.ops.is_empty()
                    || st
                        .eps
                        .values()
                        .any(|e| matches!(e.close, CloseState::Closing(_) | CloseState::Open))
            };
            self.inner.run_after(after);
            if !busy || start.elapsed() >= 2 * SHUTDOWN_GRACE {
                break;
            }
            self.inner.sleep(10);
        }
        // Then flush the worker itself. Endpoints UCX made on its own for peers that reached
        // us (the replies of software-emulated GETs over tcp go out on those) cannot be
        // closed by us, and UCX 1.22 crashes purging such replies when the worker is
        // destroyed with some still queued. A worker that does not flush in time is leaked
        // rather than destroyed.
        if !self.flush_worker() || !self.drain_worker() {
            self.inner.leak_worker.store(true, Ordering::Relaxed);
        }
        // Whatever is still pending cannot be proven finished: report it failed but keep its
        // memory registered forever rather than risk a use after free.
        let leftovers = std::mem::take(&mut self.inner.state.lock().ops);
        for op in leftovers {
            std::mem::forget(op.keep);
            (op.done)(Err(UcxError::Shutdown(self.inner.name.clone())));
        }
    }
}

impl UcxEngine {
    /// Progresses the worker until it has been quiet (no progress, no event on its fd) for
    /// [`QUIET`], for at most [`SHUTDOWN_GRACE`]: replies UCX still owes peers on endpoints
    /// of its own (software-emulated GETs over tcp) are not covered by a worker flush, and
    /// destroying the worker with some queued crashes UCX 1.22. Whether it became quiet.
    fn drain_worker(&self) -> bool {
        let start = Instant::now();
        loop {
            let armed = {
                let st = self.inner.state.lock();
                // SAFETY: live worker, lock held.
                let busy = unsafe { sys::ucp_worker_progress(st.worker) } != 0;
                // SAFETY: live worker, lock held, right after progress.
                !busy && unsafe { sys::ucp_worker_arm(st.worker) } == sys::UCS_OK
            };
            if armed {
                let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 2];
                // SAFETY: `epoll` is the engine's open epoll fd; `evs` holds 2 events.
                let n = unsafe {
                    libc::epoll_wait(
                        self.inner.epoll.as_raw_fd(),
                        evs.as_mut_ptr(),
                        2,
                        QUIET.as_millis() as i32,
                    )
                };
                self.inner.drain_wake();
                if n == 0 {
                    return true;
                }
            }
            if start.elapsed() >= SHUTDOWN_GRACE {
                return false;
            }
        }
    }

    /// `ucp_worker_flush_nbx`, progressed for at most [`SHUTDOWN_GRACE`]. Whether it
    /// completed (with any status: a failed peer fails it, which is as final).
    fn flush_worker(&self) -> bool {
        let r = {
            let st = self.inner.state.lock();
            let param = sys::ucp_request_param_t::default();
            // SAFETY: live worker, lock held, valid param.
            unsafe { sys::ucp_worker_flush_nbx(st.worker, &param) }
        };
        if !sys::ptr_is_ptr(r) {
            return true;
        }
        let start = Instant::now();
        loop {
            let finished = {
                let st = self.inner.state.lock();
                // SAFETY: live worker, lock held; `r` is the live flush request, freed once
                // below when it completed.
                unsafe {
                    while sys::ucp_worker_progress(st.worker) != 0 {}
                    sys::ucp_request_check_status(r) != sys::UCS_INPROGRESS
                }
            };
            if finished {
                let _st = self.inner.state.lock();
                // SAFETY: completed request, released exactly once; lock held.
                unsafe { sys::ucp_request_free(r) };
                return true;
            }
            if start.elapsed() >= SHUTDOWN_GRACE {
                // The request goes with the leaked worker.
                return false;
            }
            self.inner.sleep(10);
        }
    }
}

/// Closes, in force mode, endpoints that still have transfers pending: UCX then completes
/// their requests with an error.
fn force_close_pending(st: &mut State) {
    for ep in st.eps.values_mut() {
        if ep.close == CloseState::Open && ep.pending > 0 {
            let param = sys::ucp_request_param_t {
                op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
                flags: sys::UCP_EP_CLOSE_FLAG_FORCE,
                ..Default::default()
            };
            // SAFETY: open endpoint, closed once (state moves on), lock held by the caller.
            // Its keys are destroyed after the close (UCX keeps them valid until then); this
            // path only runs at shutdown after the grace period.
            let r = unsafe { sys::ucp_ep_close_nbx(ep.ep, &param) };
            ep.close = if sys::ptr_is_ptr(r) {
                CloseState::Closing(r)
            } else {
                CloseState::Closed
            };
        }
    }
}

impl Drop for UcxEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let st = self.state.get_mut();
        for (_, ep) in st.eps.drain() {
            for rkey in ep.retired {
                // SAFETY: nothing is pending (every handle and the thread are gone); each key
                // is destroyed once.
                unsafe { sys::ucp_rkey_destroy(rkey) };
            }
            for (_, r) in ep.remotes {
                for c in r.chunks {
                    // SAFETY: as above.
                    unsafe { sys::ucp_rkey_destroy(c.rkey) };
                }
            }
            if !ep.err_arg.is_null() && ep.close == CloseState::Closed {
                // SAFETY: the endpoint is closed, UCX no longer uses the argument; freed once.
                drop(unsafe { Box::from_raw(ep.err_arg) });
            }
            // An endpoint that never finished closing keeps its argument (leaked on purpose):
            // the worker destroy below may still call its error callback.
        }
        if self.leak_worker.load(Ordering::Relaxed) {
            // The worker could not be flushed: destroying it could crash inside UCX.
            return;
        }
        // SAFETY: last reference: no endpoint handle, memory handle or progress thread is
        // left, so this is the last use of the worker and then of the context, in the order
        // UCX requires.
        unsafe {
            sys::ucp_worker_destroy(st.worker);
            sys::ucp_cleanup(st.context);
        }
    }
}

/// What an engine holds ([`Ucx::report`](crate::Ucx::report)), for leak checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UcxReport {
    /// Endpoints with a live handle, not yet closed.
    pub endpoints: usize,
    /// Endpoints whose handle is gone, kept open while the peer lives (UCX pairs them with the
    /// peer's endpoints to us: closing ours would break the peer's).
    pub parked: usize,
    /// Transfers posted and not completed.
    pub pending_transfers: usize,
    /// Memory handles held in quarantine by failed endpoints.
    pub quarantined: usize,
    /// Live memory handles (registrations, counting clones held by transfers).
    pub memory_handles: usize,
}

/// A posted transfer's outcome, to wait on (the raw API's `put`, `get` and `flush`).
pub type Pending = tessera_onesided::Pending<Result<(), UcxError>>;

#[allow(dead_code)]
fn assert_send_sync() {
    fn is<T: Send + Sync>() {}
    is::<UcxEngine>();
    is::<UcxEndpoint>();
    is::<MemRegion>();
    is::<Pending>();
}
