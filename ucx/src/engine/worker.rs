//! The worker's state and its progress thread: endpoints' and transfers' state machines, the
//! events UCX callbacks report, and the thread that progresses the worker and sleeps on its
//! event fd.

use super::*;

/// What UCX callbacks report, handled by the next progress pass.
pub(super) enum Event {
    EpFailed { ep: u64, status: sys::ucs_status_t },
    Note { from: String, msg: Vec<u8> },
}

/// Argument of an endpoint's error callback; freed once the endpoint is closed.
pub(super) struct ErrArg {
    pub(super) inner: *const Inner,
    pub(super) ep: u64,
}

pub(super) struct RemoteChunk {
    /// Offset of the chunk in the remote registration.
    pub(super) start: u64,
    pub(super) len: u64,
    pub(super) addr: u64,
    pub(super) rkey: sys::ucp_rkey_h,
}

pub(super) struct Remote {
    pub(super) len: u64,
    pub(super) chunks: Vec<RemoteChunk>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum CloseState {
    Open,
    Closing(*mut c_void),
    Closed,
}

pub(super) struct EpState {
    pub(super) ep: sys::ucp_ep_h,
    pub(super) peer: String,
    /// The peer's worker address (as UCX reads it), to find a parked endpoint again.
    pub(super) address: Vec<u8>,
    pub(super) err_arg: *mut ErrArg,
    pub(super) remotes: HashMap<u64, Remote>,
    /// Replaced or removed keys, destroyed once no transfer is pending on the endpoint.
    pub(super) retired: Vec<sys::ucp_rkey_h>,
    /// Transfers posted and not yet completed.
    pub(super) pending: usize,
    /// Set by the error callback; every later post fails with it.
    pub(super) failed: Option<String>,
    /// The user's handle is gone. The endpoint stays open (parked) until the peer fails or
    /// the engine stops: UCX pairs it with the peer's endpoint to us, so closing it would
    /// tear down the peer's endpoint too (see [`UcxEndpoint`]).
    pub(super) dropped: bool,
    pub(super) close: CloseState,
    /// Memory of transfers whose completion UCX could not report; released after the close.
    pub(super) quarantine: Vec<Arc<MemInner>>,
}

pub(super) enum Stage {
    Flush(*mut c_void),
    Notify(*mut c_void),
}

pub(super) struct OpState {
    pub(super) ep: u64,
    pub(super) stage: Stage,
    pub(super) error: Option<UcxError>,
    pub(super) notify: Option<Vec<u8>>,
    pub(super) keep: Vec<Arc<MemInner>>,
    pub(super) done: Done,
}

/// Work to do after the state lock is released.
#[derive(Default)]
pub(super) struct After {
    pub(super) finished: Vec<Finished>,
    pub(super) release: Vec<Arc<MemInner>>,
    pub(super) notes: Vec<(String, Vec<u8>)>,
}

pub(super) struct State {
    pub(super) context: sys::ucp_context_h,
    pub(super) worker: sys::ucp_worker_h,
    pub(super) eps: HashMap<u64, EpState>,
    pub(super) ops: Vec<OpState>,
    pub(super) next_id: u64,
    pub(super) stopped: bool,
}

// SAFETY: the UCP handles inside are only used with the `Mutex<State>` held (the worker is
// created in UCS_THREAD_MODE_SERIALIZED, which allows any thread one at a time); the raw
// `ErrArg` and request pointers are owned by this state and only touched under the same lock.
unsafe impl Send for State {}

pub(super) struct Inner {
    pub(super) name: String,
    pub(super) state: Mutex<State>,
    pub(super) events: Mutex<Vec<Event>>,
    pub(super) notes: Mutex<VecDeque<(String, Vec<u8>)>>,
    pub(super) notes_cv: Condvar,
    pub(super) on_notify: Option<NotifyFn>,
    /// eventfd that wakes the progress thread.
    pub(super) wake: OwnedFd,
    pub(super) epoll: OwnedFd,
    pub(super) max_chunk: u64,
    pub(super) max_notification: usize,
    pub(super) address: Vec<u8>,
    pub(super) error_handling: ErrorHandling,
    pub(super) busy_poll: Duration,
    /// Live `MemInner`s of this engine.
    pub(super) live_mem: AtomicUsize,
    /// Set when the worker could not be flushed at shutdown: it is then never destroyed.
    pub(super) leak_worker: AtomicBool,
}

impl Inner {
    pub(super) fn wake(&self) {
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

    pub(super) fn drain_wake(&self) {
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
    pub(super) fn sleep(&self, timeout_ms: i32) {
        let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 2];
        // SAFETY: `epoll` is our open epoll fd; `evs` is a valid buffer of 2 events.
        unsafe { libc::epoll_wait(self.epoll.as_raw_fd(), evs.as_mut_ptr(), 2, timeout_ms) };
        self.drain_wake();
    }

    /// Progresses the worker until idle and advances every transfer and endpoint. Returns
    /// whether anything happened.
    pub(super) fn pass(&self, st: &mut State, after: &mut After) -> bool {
        let mut worked = false;
        loop {
            // SAFETY: the worker is alive (destroyed only in Inner::drop) and the state lock
            // is held, serializing this call with every other UCP call.
            while unsafe { sys::ucp_worker_progress(st.worker) } != 0 {
                worked = true;
            }
            let events = std::mem::take(&mut *self.events.lock());
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
    pub(super) fn absorb_failures(&self, st: &mut State) {
        self.events.lock().retain(|e| match *e {
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
    pub(super) fn run_after(&self, after: After) {
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
                    self.notes.lock().push_back((from, msg));
                    self.notes_cv.notify_all();
                }
            }
        }
    }
}

pub(super) fn ep_error(ep: &EpState, call: &'static str, status: sys::ucs_status_t) -> UcxError {
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
    pub(super) fn step_ops(&self, st: &mut State, after: &mut After) -> bool {
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
    pub(super) fn send_notify(
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
pub(super) fn step_eps(st: &mut State, after: &mut After) {
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
pub(super) unsafe extern "C" fn on_ep_error(
    arg: *mut c_void,
    _ep: sys::ucp_ep_h,
    status: sys::ucs_status_t,
) {
    if arg.is_null() {
        return;
    }
    // SAFETY: `arg` is the endpoint's `ErrArg`, freed only after the endpoint is closed, and
    // its `inner` points to the `Inner` that owns the worker, alive while UCX calls back.
    let (inner, ep) = unsafe {
        let a = &*(arg as *const ErrArg);
        (&*a.inner, a.ep)
    };
    inner.events.lock().push(Event::EpFailed { ep, status });
}

/// Active-message handler of notifications: copies the message for the next progress pass.
pub(super) unsafe extern "C" fn on_notify_am(
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
    inner.events.lock().push(Event::Note { from, msg });
    sys::UCS_OK
}

pub(super) fn progress_thread(inner: Arc<Inner>) {
    let mut last_work: Option<Instant> = None;
    loop {
        let mut after = After::default();
        let (stop, armed) = {
            let mut st = inner.state.lock();
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
