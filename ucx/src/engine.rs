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
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tessera_onesided::{in_bounds, lock};

use crate::key::{self, KeyChunk};
use crate::sys;
use crate::{ErrorHandling, NotifyFn, RmaKind, Side, UcxConfig, UcxError};

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

/// What UCX callbacks report, handled by the next progress pass.
enum Event {
    EpFailed { ep: u64, status: sys::ucs_status_t },
    Note { from: String, msg: Vec<u8> },
}

/// Argument of an endpoint's error callback; freed once the endpoint is closed.
struct ErrArg {
    inner: *const Inner,
    ep: u64,
}

struct RemoteChunk {
    /// Offset of the chunk in the remote registration.
    start: u64,
    len: u64,
    addr: u64,
    rkey: sys::ucp_rkey_h,
}

struct Remote {
    len: u64,
    chunks: Vec<RemoteChunk>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum CloseState {
    Open,
    Closing(*mut c_void),
    Closed,
}

struct EpState {
    ep: sys::ucp_ep_h,
    peer: String,
    /// The peer's worker address (as UCX reads it), to find a parked endpoint again.
    address: Vec<u8>,
    err_arg: *mut ErrArg,
    remotes: HashMap<u64, Remote>,
    /// Replaced or removed keys, destroyed once no transfer is pending on the endpoint.
    retired: Vec<sys::ucp_rkey_h>,
    /// Transfers posted and not yet completed.
    pending: usize,
    /// Set by the error callback; every later post fails with it.
    failed: Option<String>,
    /// The user's handle is gone. The endpoint stays open (parked) until the peer fails or
    /// the engine stops: UCX pairs it with the peer's endpoint to us, so closing it would
    /// tear down the peer's endpoint too (see [`UcxEndpoint`]).
    dropped: bool,
    close: CloseState,
    /// Memory of transfers whose completion UCX could not report; released after the close.
    quarantine: Vec<Arc<MemInner>>,
}

enum Stage {
    Flush(*mut c_void),
    Notify(*mut c_void),
}

struct OpState {
    ep: u64,
    stage: Stage,
    error: Option<UcxError>,
    notify: Option<Vec<u8>>,
    keep: Vec<Arc<MemInner>>,
    done: Done,
}

/// Work to do after the state lock is released.
#[derive(Default)]
struct After {
    finished: Vec<Finished>,
    release: Vec<Arc<MemInner>>,
    notes: Vec<(String, Vec<u8>)>,
}

struct State {
    context: sys::ucp_context_h,
    worker: sys::ucp_worker_h,
    eps: HashMap<u64, EpState>,
    ops: Vec<OpState>,
    next_id: u64,
    stopped: bool,
}

// SAFETY: the UCP handles inside are only used with the `Mutex<State>` held (the worker is
// created in UCS_THREAD_MODE_SERIALIZED, which allows any thread one at a time); the raw
// `ErrArg` and request pointers are owned by this state and only touched under the same lock.
unsafe impl Send for State {}

struct Inner {
    name: String,
    state: Mutex<State>,
    events: Mutex<Vec<Event>>,
    notes: Mutex<VecDeque<(String, Vec<u8>)>>,
    notes_cv: Condvar,
    on_notify: Option<NotifyFn>,
    /// eventfd that wakes the progress thread.
    wake: OwnedFd,
    epoll: OwnedFd,
    max_chunk: u64,
    max_notification: usize,
    address: Vec<u8>,
    error_handling: ErrorHandling,
    busy_poll: Duration,
    /// Live `MemInner`s of this engine.
    live_mem: AtomicUsize,
    /// Set when the worker could not be flushed at shutdown: it is then never destroyed.
    leak_worker: AtomicBool,
}

impl Inner {
    fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: `wake` is an open eventfd owned by self; we pass a valid pointer to 8 bytes.
        // A full counter (EAGAIN) still leaves the fd readable, which is all we need.
        unsafe {
            libc::write(
                self.wake.as_raw_fd(),
                (&one as *const u64).cast(),
                size_of::<u64>(),
            )
        };
    }

    fn drain_wake(&self) {
        let mut v: u64 = 0;
        // SAFETY: non-blocking read of 8 bytes from our own eventfd into a valid u64.
        unsafe {
            libc::read(
                self.wake.as_raw_fd(),
                (&mut v as *mut u64).cast(),
                size_of::<u64>(),
            )
        };
    }

    /// Sleeps until the worker's event fd or the wake fd is readable, or `timeout_ms` passes.
    fn sleep(&self, timeout_ms: i32) {
        let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 2];
        // SAFETY: `epoll` is our open epoll fd; `evs` is a valid buffer of 2 events.
        unsafe { libc::epoll_wait(self.epoll.as_raw_fd(), evs.as_mut_ptr(), 2, timeout_ms) };
        self.drain_wake();
    }

    /// Progresses the worker until idle and advances every transfer and endpoint. Returns
    /// whether anything happened.
    fn pass(&self, st: &mut State, after: &mut After) -> bool {
        let mut worked = false;
        loop {
            // SAFETY: the worker is alive (destroyed only in Inner::drop) and the state lock
            // is held, serializing this call with every other UCP call.
            while unsafe { sys::ucp_worker_progress(st.worker) } != 0 {
                worked = true;
            }
            let events = std::mem::take(&mut *lock(&self.events));
            let had_events = !events.is_empty();
            for e in events {
                match e {
                    Event::EpFailed { ep, status } => {
                        if let Some(e) = st.eps.get_mut(&ep) {
                            if e.failed.is_none() {
                                e.failed = Some(status_message(status));
                            }
                        }
                    }
                    Event::Note { from, msg } => after.notes.push((from, msg)),
                }
            }
            let moved = self.step_ops(st, after);
            step_eps(st, after);
            if !moved && !had_events {
                return worked;
            }
            worked = true;
        }
    }

    /// Marks the endpoints whose error callback fired since the last pass as failed, leaving
    /// notifications queued for the next pass. Error callbacks only run inside UCP calls,
    /// which are made with the state lock held, so with `st` held none is missed.
    fn absorb_failures(&self, st: &mut State) {
        lock(&self.events).retain(|e| match *e {
            Event::EpFailed { ep, status } => {
                if let Some(e) = st.eps.get_mut(&ep) {
                    if e.failed.is_none() {
                        e.failed = Some(status_message(status));
                    }
                }
                false
            }
            Event::Note { .. } => true,
        });
    }

    /// Runs completions and notification delivery; no lock may be held.
    fn run_after(&self, after: After) {
        drop(after.release);
        for (done, result, keep) in after.finished {
            drop(keep);
            done(result);
        }
        for (from, msg) in after.notes {
            match &self.on_notify {
                Some(f) => {
                    let f = f.clone();
                    let from2 = from.clone();
                    // A panicking user callback must not take the progress thread down.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                        f(&from2, msg)
                    }));
                }
                None => {
                    lock(&self.notes).push_back((from, msg));
                    self.notes_cv.notify_all();
                }
            }
        }
    }
}

fn ep_error(ep: &EpState, call: &'static str, status: sys::ucs_status_t) -> UcxError {
    match &ep.failed {
        Some(message) => UcxError::PeerGone {
            peer: ep.peer.clone(),
            message: message.clone(),
        },
        None if is_peer_failure(status) => UcxError::PeerGone {
            peer: ep.peer.clone(),
            message: status_message(status),
        },
        None => status_error(call, status),
    }
}

impl Inner {
    /// Advances transfers whose flush or notification completed. Returns whether any moved.
    fn step_ops(&self, st: &mut State, after: &mut After) -> bool {
        let mut moved = false;
        let mut i = 0;
        while i < st.ops.len() {
            let (req, notify_stage) = match st.ops[i].stage {
                Stage::Flush(r) => (r, false),
                Stage::Notify(r) => (r, true),
            };
            // SAFETY: `req` is a live request returned by UCX and not yet freed (it is freed
            // right below, once, after it completed); the state lock is held.
            let status = unsafe { sys::ucp_request_check_status(req) };
            if status == sys::UCS_INPROGRESS {
                i += 1;
                continue;
            }
            // SAFETY: the request completed; released exactly once, the pointer is dropped.
            unsafe { sys::ucp_request_free(req) };
            moved = true;
            let ep_id = st.ops[i].ep;
            // Endpoints with pending transfers stay in the table, so this is always found.
            let (ep_h, err) = match st.eps.get(&ep_id) {
                Some(ep) => {
                    let call = if notify_stage {
                        "ucp_am_send_nbx"
                    } else {
                        "ucp_ep_flush_nbx"
                    };
                    // UCX completes the requests of an endpoint it discards (the peer reset
                    // the connection) without an error status, bytes undelivered: a failure
                    // seen by the time the completion is observed fails the transfer.
                    let err = (status != sys::UCS_OK || ep.failed.is_some())
                        .then(|| ep_error(ep, call, status));
                    // A closing endpoint (force-closed at shutdown) takes no new sends.
                    let usable = if ep.close == CloseState::Open {
                        ep.ep
                    } else {
                        ptr::null_mut()
                    };
                    (usable, err)
                }
                None => (ptr::null_mut(), Some(UcxError::Shutdown(self.name.clone()))),
            };
            let op = &mut st.ops[i];
            if let Some(fresh) = err {
                // The first error of a transfer wins, but a peer failure always reads as one.
                if op.error.is_none() || fresh.is_peer_gone() {
                    op.error = Some(fresh);
                }
            }
            if !notify_stage && op.error.is_none() && op.notify.is_some() && ep_h.is_null() {
                op.error = Some(UcxError::Shutdown(self.name.clone()));
            }
            if !notify_stage && op.error.is_none() && op.notify.is_some() {
                match self.send_notify(ep_h, op.notify.as_deref().unwrap_or_default()) {
                    Ok(Some(r)) => {
                        op.stage = Stage::Notify(r);
                        i += 1;
                        continue;
                    }
                    Ok(None) => {}
                    Err(status) => {
                        if let Some(ep) = st.eps.get(&ep_id) {
                            st.ops[i].error = Some(ep_error(ep, "ucp_am_send_nbx", status));
                        }
                    }
                }
            }
            let op = st.ops.swap_remove(i);
            if let Some(ep) = st.eps.get_mut(&ep_id) {
                ep.pending -= 1;
            }
            let result = match op.error {
                Some(e) => Err(e),
                None => Ok(()),
            };
            after.finished.push((op.done, result, op.keep));
        }
        moved
    }

    /// Sends a notification as an eager active message with our name as header.
    /// `Ok(Some)` is a request to wait for; `Ok(None)` means it completed at once.
    fn send_notify(
        &self,
        ep: sys::ucp_ep_h,
        msg: &[u8],
    ) -> Result<Option<*mut c_void>, sys::ucs_status_t> {
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: sys::UCP_AM_SEND_FLAG_EAGER,
            ..Default::default()
        };
        // SAFETY: `ep` is an open endpoint (callers check the close state); the header is
        // `self.name`, which lives as long as the worker; `msg` is owned by the transfer,
        // which stays in `State::ops` until this request completes; the lock is held.
        let r = unsafe {
            sys::ucp_am_send_nbx(
                ep,
                AM_NOTIFY,
                self.name.as_ptr().cast(),
                self.name.len(),
                msg.as_ptr().cast(),
                msg.len(),
                &param,
            )
        };
        if sys::ptr_is_ptr(r) {
            Ok(Some(r))
        } else {
            let status = sys::ptr_status(r);
            if status == sys::UCS_OK {
                Ok(None)
            } else {
                Err(status)
            }
        }
    }
}

/// Advances endpoint closes: keys first, once nothing is pending, then the endpoint.
fn step_eps(st: &mut State, after: &mut After) {
    let stopped = st.stopped;
    let mut gone = Vec::new();
    for (&id, ep) in st.eps.iter_mut() {
        if ep.pending == 0 && !ep.retired.is_empty() {
            for rkey in ep.retired.drain(..) {
                // SAFETY: no transfer is pending on this endpoint, so no request uses the key;
                // the endpoint is still open; each key is destroyed once (drained).
                unsafe { sys::ucp_rkey_destroy(rkey) };
            }
        }
        if ep.close == CloseState::Open && ep.pending == 0 && (ep.failed.is_some() || stopped) {
            for (_, remote) in ep.remotes.drain() {
                for c in remote.chunks {
                    // SAFETY: as above: nothing pending, endpoint open, destroyed once.
                    unsafe { sys::ucp_rkey_destroy(c.rkey) };
                }
            }
            let mut param = sys::ucp_request_param_t {
                op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
                ..Default::default()
            };
            // A live peer's endpoint is closed in flush mode, at shutdown too: UCX then sends
            // what it still has queued for the peer (replies of emulated GETs, completions
            // of emulated PUTs) and tells the peer, whose endpoint fails at once. Forcing it
            // instead crashes UCX 1.22 while it purges those queued replies.
            if ep.failed.is_some() {
                param.flags = sys::UCP_EP_CLOSE_FLAG_FORCE;
            }
            // SAFETY: the endpoint is open and closed only here, once (state moves on); the
            // param struct is valid for the call; the state lock is held.
            let r = unsafe { sys::ucp_ep_close_nbx(ep.ep, &param) };
            ep.close = if sys::ptr_is_ptr(r) {
                CloseState::Closing(r)
            } else {
                CloseState::Closed
            };
        }
        if let CloseState::Closing(r) = ep.close {
            // SAFETY: `r` is the live close request, freed once below when complete.
            if unsafe { sys::ucp_request_check_status(r) } != sys::UCS_INPROGRESS {
                // SAFETY: completed request, released exactly once.
                unsafe { sys::ucp_request_free(r) };
                ep.close = CloseState::Closed;
            }
        }
        if ep.close == CloseState::Closed {
            ep.ep = ptr::null_mut();
            after.release.append(&mut ep.quarantine);
            if !ep.err_arg.is_null() {
                // SAFETY: allocated by Box::into_raw in connect; the endpoint is closed, so
                // UCX no longer calls the error callback with it; freed once (nulled).
                drop(unsafe { Box::from_raw(ep.err_arg) });
                ep.err_arg = ptr::null_mut();
            }
            if ep.dropped {
                gone.push(id);
            }
        }
    }
    for id in gone {
        st.eps.remove(&id);
    }
}

/// Error callback of every endpoint: records the failure for the next progress pass.
unsafe extern "C" fn on_ep_error(arg: *mut c_void, _ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    if arg.is_null() {
        return;
    }
    // SAFETY: `arg` is the endpoint's `ErrArg`, freed only after the endpoint is closed, and
    // its `inner` points to the `Inner` that owns the worker, alive while UCX calls back.
    let (inner, ep) = unsafe {
        let a = &*(arg as *const ErrArg);
        (&*a.inner, a.ep)
    };
    lock(&inner.events).push(Event::EpFailed { ep, status });
}

/// Active-message handler of notifications: copies the message for the next progress pass.
unsafe extern "C" fn on_notify_am(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    if arg.is_null() || param.is_null() {
        return sys::UCS_OK;
    }
    // SAFETY: `arg` is the `Inner` that owns the worker (set when the handler was installed,
    // alive until the worker is destroyed); `param` is valid for this call (checked non-null).
    let (inner, attr) = unsafe { (&*(arg as *const Inner), (*param).recv_attr) };
    if attr & u64::from(sys::UCP_AM_RECV_ATTR_FLAG_RNDV) != 0 {
        // Our peers send notifications eagerly; a rendezvous message is not ours. Dropped.
        return sys::UCS_OK;
    }
    let from = if header.is_null() || header_length == 0 {
        String::new()
    } else {
        // SAFETY: UCX passes `header_length` readable bytes at `header` for this call.
        let h = unsafe { std::slice::from_raw_parts(header.cast::<u8>(), header_length) };
        String::from_utf8_lossy(h).into_owned()
    };
    let msg = if data.is_null() || length == 0 {
        Vec::new()
    } else {
        // SAFETY: without the RNDV flag, `data` holds `length` readable bytes for this call
        // (the handler was installed with UCP_AM_FLAG_WHOLE_MSG).
        unsafe { std::slice::from_raw_parts(data.cast::<u8>(), length) }.to_vec()
    };
    lock(&inner.events).push(Event::Note { from, msg });
    sys::UCS_OK
}

fn progress_thread(inner: Arc<Inner>) {
    let mut last_work: Option<Instant> = None;
    loop {
        let mut after = After::default();
        let (stop, armed) = {
            let mut st = lock(&inner.state);
            let now = Instant::now();
            if inner.pass(&mut st, &mut after) {
                last_work = Some(now);
            }
            let hot = last_work.is_some_and(|t| now.duration_since(t) < inner.busy_poll);
            if st.stopped {
                (true, None)
            } else if hot {
                // Traffic just flowed: poll on for a moment instead of paying a wake-up per
                // socket buffer. Idle for `busy_poll`, the thread arms and sleeps.
                (false, None)
            } else {
                // SAFETY: live worker, lock held, called right after progress returned 0.
                (false, Some(unsafe { sys::ucp_worker_arm(st.worker) }))
            }
        };
        inner.run_after(after);
        if stop {
            break;
        }
        match armed {
            None => std::hint::spin_loop(),
            Some(s) if s == sys::UCS_OK => inner.sleep(-1),
            Some(s) if s == sys::UCS_ERR_BUSY => {}
            // Arming is not supported by some transport: poll gently instead of spinning.
            Some(_) => inner.sleep(1),
        }
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
            let st = lock(&inner.state);
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
        let st = lock(&self.inner.state);
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
            rkey: k,
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
        let mut st = lock(&self.inner.state);
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
        let mut q = lock(&self.inner.notes);
        loop {
            if let Some(n) = q.pop_front() {
                return Some(n);
            }
            match deadline {
                None => {
                    q = self
                        .inner
                        .notes_cv
                        .wait(q)
                        .unwrap_or_else(|e| e.into_inner())
                }
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return None;
                    }
                    q = self
                        .inner
                        .notes_cv
                        .wait_timeout(q, d - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
        }
    }

    /// A report of what the engine holds, for leak checks.
    pub fn report(&self) -> UcxReport {
        let st = lock(&self.inner.state);
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
        lock(&self.inner.state).stopped = true;
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
                let mut st = lock(&self.inner.state);
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
        let leftovers = std::mem::take(&mut lock(&self.inner.state).ops);
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
                let st = lock(&self.inner.state);
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
            let st = lock(&self.inner.state);
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
                let st = lock(&self.inner.state);
                // SAFETY: live worker, lock held; `r` is the live flush request, freed once
                // below when it completed.
                unsafe {
                    while sys::ucp_worker_progress(st.worker) != 0 {}
                    sys::ucp_request_check_status(r) != sys::UCS_INPROGRESS
                }
            };
            if finished {
                let _st = lock(&self.inner.state);
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
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
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

struct LocalChunk {
    memh: sys::ucp_mem_h,
    /// Offset of the chunk in the registration.
    start: u64,
    len: u64,
}

struct MemInner {
    engine: Arc<Inner>,
    base: usize,
    len: u64,
    chunks: Vec<LocalChunk>,
    key: Vec<u8>,
    /// Keeps the memory mapped; dropped after the chunks are unmapped.
    _owner: Option<Box<dyn Send + Sync>>,
}

// SAFETY: the memory handles are only passed to UCP with the engine's state lock held; `base`
// is an address, never dereferenced by this type.
unsafe impl Send for MemInner {}
// SAFETY: as above; shared access only reads immutable fields.
unsafe impl Sync for MemInner {}

impl Drop for MemInner {
    fn drop(&mut self) {
        let st = lock(&self.engine.state);
        for c in &self.chunks {
            // SAFETY: mapped on this context, which is alive (we hold an Arc to it); no
            // transfer uses it any more (transfers hold clones of this Arc); lock held.
            unsafe { sys::ucp_mem_unmap(st.context, c.memh) };
        }
        drop(st);
        self.engine.live_mem.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Tells whether an engine's worker and context still exist (see [`UcxEngine::probe`]).
#[derive(Clone)]
pub struct UcxProbe {
    inner: Weak<Inner>,
}

impl std::fmt::Debug for UcxProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxProbe")
            .field("alive", &self.is_alive())
            .finish()
    }
}

impl UcxProbe {
    /// Whether the worker and context are still alive.
    pub fn is_alive(&self) -> bool {
        self.inner.strong_count() > 0
    }
}

/// A registered range (one or more `ucp_mem_map` chunks). Cheap to clone; unmapped when the
/// last clone, including those held by transfers in flight, is dropped.
#[derive(Clone)]
pub struct MemRegion {
    inner: Arc<MemInner>,
}

impl std::fmt::Debug for MemRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemRegion")
            .field("base", &(self.inner.base as *const u8))
            .field("len", &self.inner.len)
            .field("chunks", &self.inner.chunks.len())
            .finish()
    }
}

impl MemRegion {
    /// What a peer passes to [`UcxEndpoint::add_remote`]: chunk addresses and packed keys.
    pub fn remote_key(&self) -> &[u8] {
        &self.inner.key
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.inner.len
    }

    /// Never true: empty registrations are refused.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// First byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.inner.base as *mut u8
    }

    /// Number of `ucp_mem_map` chunks.
    pub fn chunks(&self) -> usize {
        self.inner.chunks.len()
    }
}

/// One copy of a transfer: `len` bytes at `local_offset` in `local` and at `remote_offset`
/// in the peer's registration `remote` (an id given to [`UcxEndpoint::add_remote`]).
#[derive(Debug, Clone, Copy)]
pub struct RmaOp<'a> {
    /// The local registration.
    pub local: &'a MemRegion,
    /// Offset in it.
    pub local_offset: u64,
    /// The remote registration's id.
    pub remote: u64,
    /// Offset in it.
    pub remote_offset: u64,
    /// Bytes to move.
    pub len: u64,
}

/// An endpoint to one peer.
///
/// UCX pairs the endpoints two workers open to each other (its endpoint matching): the
/// peer's endpoint to us and ours to it are one connection, and closing either side tears
/// down both, so the peer's transfers fail with "Connection reset by remote peer" (or, before
/// the error completion below, were reported done with their bytes dropped). Dropping this
/// handle therefore keeps the UCP endpoint open, *parked*, with its keys destroyed once
/// nothing is pending; [`UcxEngine::connect`] to the same worker takes it up again. A parked
/// endpoint is closed when the peer fails or the engine shuts down.
pub struct UcxEndpoint {
    engine: Arc<Inner>,
    id: u64,
    peer: String,
}

impl std::fmt::Debug for UcxEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxEndpoint")
            .field("peer", &self.peer)
            .finish()
    }
}

impl UcxEndpoint {
    /// The peer's name.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// The endpoint's error, if the peer failed.
    pub fn failure(&self) -> Option<String> {
        lock(&self.engine.state)
            .eps
            .get(&self.id)
            .and_then(|e| e.failed.clone())
    }

    /// Unpacks a peer's [`MemRegion::remote_key`] under `id`. Replaces a previous key with the
    /// same id; the old one is destroyed once no transfer is pending.
    pub fn add_remote(&self, id: u64, key: &[u8]) -> Result<(), UcxError> {
        let chunks = key::decode_key(key)?;
        let mut st = lock(&self.engine.state);
        let stopped = st.stopped;
        let ep = self.ep_mut(&mut st, stopped)?;
        let mut remote = Remote {
            len: 0,
            chunks: Vec::with_capacity(chunks.len()),
        };
        for c in &chunks {
            let mut rkey: sys::ucp_rkey_h = ptr::null_mut();
            // SAFETY: open endpoint, lock held; the packed key bytes passed our framing checks
            // and live for the call; `rkey` is a valid out pointer.
            let s = unsafe { sys::ucp_ep_rkey_unpack(ep.ep, c.rkey.as_ptr().cast(), &mut rkey) };
            if s != sys::UCS_OK {
                for done in remote.chunks {
                    // SAFETY: unpacked just above, never used by a transfer; destroyed once.
                    unsafe { sys::ucp_rkey_destroy(done.rkey) };
                }
                return Err(status_error("ucp_ep_rkey_unpack", s));
            }
            remote.chunks.push(RemoteChunk {
                start: remote.len,
                len: c.len,
                addr: c.addr,
                rkey,
            });
            remote.len += c.len;
        }
        if let Some(old) = ep.remotes.insert(id, remote) {
            ep.retired.extend(old.chunks.into_iter().map(|c| c.rkey));
        }
        Ok(())
    }

    /// Forgets remote registration `id` (its key is destroyed once nothing is pending).
    pub fn remove_remote(&self, id: u64) {
        let mut st = lock(&self.engine.state);
        if let Some(ep) = st.eps.get_mut(&self.id) {
            if let Some(old) = ep.remotes.remove(&id) {
                ep.retired.extend(old.chunks.into_iter().map(|c| c.rkey));
            }
        }
        drop(st);
        self.engine.wake();
    }

    fn ep_mut<'s>(&self, st: &'s mut State, stopped: bool) -> Result<&'s mut EpState, UcxError> {
        let name = self.engine.name.clone();
        let ep = st
            .eps
            .get_mut(&self.id)
            .ok_or_else(|| UcxError::Shutdown(name.clone()))?;
        if let Some(message) = &ep.failed {
            return Err(UcxError::PeerGone {
                peer: ep.peer.clone(),
                message: message.clone(),
            });
        }
        if stopped || ep.close != CloseState::Open {
            return Err(UcxError::Shutdown(name));
        }
        Ok(ep)
    }

    /// Posts a transfer: every op is validated first (nothing is posted if one is out of
    /// range), then each is posted as `ucp_put_nbx`/`ucp_get_nbx` pieces split at chunk
    /// boundaries, then one endpoint flush, then the notification. `done` runs exactly once,
    /// after the flush (and the notification) completed or failed: on the progress thread,
    /// or before this returns when UCX completed everything in place. On `Err`, nothing was
    /// posted and `done` is dropped without running.
    pub fn post(
        &self,
        kind: RmaKind,
        ops: &[RmaOp<'_>],
        notify: Option<Vec<u8>>,
        done: impl FnOnce(Result<(), UcxError>) + Send + 'static,
    ) -> Result<(), UcxError> {
        self.post_inner(kind, ops, notify, done, false)
    }

    /// An endpoint flush alone: completes once everything posted before it completed and
    /// the endpoint's connection is established (UCX wires endpoints up lazily).
    pub fn flush(&self) -> Result<Pending, UcxError> {
        let (pending, settle) = Pending::new();
        self.post_inner(RmaKind::Put, &[], None, settle, true)?;
        Ok(pending)
    }

    fn post_inner(
        &self,
        kind: RmaKind,
        ops: &[RmaOp<'_>],
        notify: Option<Vec<u8>>,
        done: impl FnOnce(Result<(), UcxError>) + Send + 'static,
        flush_only: bool,
    ) -> Result<(), UcxError> {
        if ops.is_empty() && notify.is_none() && !flush_only {
            return Err(UcxError::Invalid(
                "a transfer needs at least one op or a notification".into(),
            ));
        }
        if let Some(n) = &notify {
            if n.len() > self.engine.max_notification {
                return Err(UcxError::Invalid(format!(
                    "a notification of {} bytes exceeds the limit of {}",
                    n.len(),
                    self.engine.max_notification
                )));
            }
        }
        let mut keep: Vec<Arc<MemInner>> = Vec::new();
        for (index, op) in ops.iter().enumerate() {
            let local = &op.local.inner;
            if !Arc::ptr_eq(&local.engine, &self.engine) {
                return Err(UcxError::ForeignRegistration { index });
            }
            if !in_bounds(op.local_offset, op.len, local.len) {
                return Err(UcxError::OutOfRange {
                    side: Side::Local,
                    index,
                    offset: op.local_offset,
                    len: op.len,
                    reg_len: local.len,
                });
            }
            if !keep.iter().any(|k| Arc::ptr_eq(k, local)) {
                keep.push(local.clone());
            }
        }

        let mut st = lock(&self.engine.state);
        let stopped = st.stopped;
        let ep = self.ep_mut(&mut st, stopped)?;
        for (index, op) in ops.iter().enumerate() {
            let remote = ep
                .remotes
                .get(&op.remote)
                .ok_or_else(|| UcxError::UnknownRemote {
                    peer: self.peer.clone(),
                    index,
                    id: op.remote,
                })?;
            if !in_bounds(op.remote_offset, op.len, remote.len) {
                return Err(UcxError::OutOfRange {
                    side: Side::Remote,
                    index,
                    offset: op.remote_offset,
                    len: op.len,
                    reg_len: remote.len,
                });
            }
        }

        // Validated: post every piece. A posting error stops posting, but the flush still
        // runs so that what was posted completes before the transfer reports.
        let mut error: Option<UcxError> = None;
        'ops: for op in ops {
            let remote = &ep.remotes[&op.remote];
            let local = &op.local.inner;
            let (mut loff, mut roff, mut left) = (op.local_offset, op.remote_offset, op.len);
            while left > 0 {
                let li = local.chunks.partition_point(|c| c.start + c.len <= loff);
                let ri = remote.chunks.partition_point(|c| c.start + c.len <= roff);
                let (lc, rc) = (&local.chunks[li], &remote.chunks[ri]);
                let piece = left
                    .min(lc.start + lc.len - loff)
                    .min(rc.start + rc.len - roff);
                let param = sys::ucp_request_param_t {
                    op_attr_mask: sys::UCP_OP_ATTR_FIELD_MEMH | sys::UCP_OP_ATTR_FIELD_MEMORY_TYPE,
                    memh: lc.memh,
                    memory_type: sys::UCS_MEMORY_TYPE_HOST,
                    ..Default::default()
                };
                let buf = (local.base + loff as usize) as *mut c_void;
                let raddr = rc.addr + (roff - rc.start);
                // SAFETY: open endpoint, lock held; `buf..buf+piece` lies inside the local
                // chunk `lc` (validated above), which stays mapped while this transfer holds
                // its MemRegion in `keep`; `rc.rkey` was unpacked on this endpoint and is
                // destroyed only when no transfer is pending; the peer's range was validated
                // against its key.
                let r = unsafe {
                    match kind {
                        RmaKind::Put => {
                            sys::ucp_put_nbx(ep.ep, buf, piece as usize, raddr, rc.rkey, &param)
                        }
                        RmaKind::Get => {
                            sys::ucp_get_nbx(ep.ep, buf, piece as usize, raddr, rc.rkey, &param)
                        }
                    }
                };
                if sys::ptr_is_ptr(r) {
                    // The flush below tracks completion; the request itself is released now,
                    // which UCX allows for requests still in progress.
                    // SAFETY: a live request returned just above, released once.
                    unsafe { sys::ucp_request_free(r) };
                } else if sys::ptr_is_err(r) {
                    let call = match kind {
                        RmaKind::Put => "ucp_put_nbx",
                        RmaKind::Get => "ucp_get_nbx",
                    };
                    error = Some(ep_error(ep, call, sys::ptr_status(r)));
                    break 'ops;
                }
                loff += piece;
                roff += piece;
                left -= piece;
            }
        }

        let param = sys::ucp_request_param_t::default();
        // SAFETY: open endpoint, lock held, valid param.
        let r = unsafe { sys::ucp_ep_flush_nbx(ep.ep, &param) };
        let done: Done = Box::new(done);
        let ep_id = self.id;
        if sys::ptr_is_ptr(r) {
            ep.pending += 1;
            st.ops.push(OpState {
                ep: ep_id,
                stage: Stage::Flush(r),
                error,
                notify,
                keep,
                done,
            });
            drop(st);
            self.engine.wake();
            return Ok(());
        }
        let status = sys::ptr_status(r);
        if status != sys::UCS_OK {
            // The flush could not even start: UCX cannot tell us when the posted pieces are
            // done, so their memory stays registered until the endpoint is closed.
            let err = ep_error(ep, "ucp_ep_flush_nbx", status);
            ep.quarantine.extend(keep);
            drop(st);
            self.engine.wake();
            done(Err(err));
            return Ok(());
        }
        // Everything completed in place: notify (if asked) and report, unless the endpoint
        // failed meanwhile (UCX then completes what it discarded without an error).
        let ep_h = ep.ep;
        self.engine.absorb_failures(&mut st);
        let error = error.or_else(|| {
            let ep = st.eps.get(&ep_id)?;
            ep.failed
                .is_some()
                .then(|| ep_error(ep, "ucp_ep_flush_nbx", sys::UCS_OK))
        });
        let result = match (error, &notify) {
            (Some(e), _) => Err(e),
            (None, None) => Ok(()),
            (None, Some(msg)) => match self.engine.send_notify(ep_h, msg) {
                Ok(None) => Ok(()),
                Ok(Some(req)) => {
                    let ep = st.eps.get_mut(&ep_id).map(|e| e.pending += 1);
                    debug_assert!(ep.is_some());
                    st.ops.push(OpState {
                        ep: ep_id,
                        stage: Stage::Notify(req),
                        error: None,
                        notify,
                        keep,
                        done,
                    });
                    drop(st);
                    self.engine.wake();
                    return Ok(());
                }
                Err(s) => Err(st
                    .eps
                    .get(&ep_id)
                    .map(|e| ep_error(e, "ucp_am_send_nbx", s))
                    .unwrap_or_else(|| status_error("ucp_am_send_nbx", s))),
            },
        };
        drop(st);
        drop(keep);
        done(result);
        Ok(())
    }

    /// [`UcxEndpoint::post`] of a PUT, returning a handle to wait on.
    pub fn put(&self, ops: &[RmaOp<'_>], notify: Option<Vec<u8>>) -> Result<Pending, UcxError> {
        self.post_pending(RmaKind::Put, ops, notify)
    }

    /// [`UcxEndpoint::post`] of a GET, returning a handle to wait on.
    pub fn get(&self, ops: &[RmaOp<'_>], notify: Option<Vec<u8>>) -> Result<Pending, UcxError> {
        self.post_pending(RmaKind::Get, ops, notify)
    }

    fn post_pending(
        &self,
        kind: RmaKind,
        ops: &[RmaOp<'_>],
        notify: Option<Vec<u8>>,
    ) -> Result<Pending, UcxError> {
        let (pending, settle) = Pending::new();
        self.post(kind, ops, notify, settle)?;
        Ok(pending)
    }
}

impl Drop for UcxEndpoint {
    fn drop(&mut self) {
        let mut st = lock(&self.engine.state);
        let stopped = st.stopped;
        if let Some(ep) = st.eps.get_mut(&self.id) {
            // Parked: its keys go (destroyed once nothing is pending), the endpoint stays.
            ep.dropped = true;
            for (_, old) in ep.remotes.drain() {
                ep.retired.extend(old.chunks.into_iter().map(|c| c.rkey));
            }
            if stopped && ep.close == CloseState::Closed {
                st.eps.remove(&self.id);
            }
        }
        drop(st);
        self.engine.wake();
    }
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
