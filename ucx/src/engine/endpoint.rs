//! Endpoints to peers: the peer's remote keys, validation of every descriptor before posting,
//! and transfers posted as puts or gets, one flush, then the notification.

use super::*;

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
    pub(super) engine: Arc<Inner>,
    pub(super) id: u64,
    pub(super) peer: String,
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
        self.engine
            .state
            .lock()
            .eps
            .get(&self.id)
            .and_then(|e| e.failed.clone())
    }

    /// Unpacks a peer's [`MemRegion::remote_key`] under `id`. Replaces a previous key with the
    /// same id; the old one is destroyed once no transfer is pending.
    pub fn add_remote(&self, id: u64, key: &[u8]) -> Result<(), UcxError> {
        let chunks = key::decode_key(key)?;
        let mut st = self.engine.state.lock();
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
            let s = unsafe { sys::ucp_ep_rkey_unpack(ep.ep, c.blob.as_ptr().cast(), &mut rkey) };
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
        let mut st = self.engine.state.lock();
        if let Some(ep) = st.eps.get_mut(&self.id) {
            if let Some(old) = ep.remotes.remove(&id) {
                ep.retired.extend(old.chunks.into_iter().map(|c| c.rkey));
            }
        }
        drop(st);
        self.engine.wake();
    }

    pub(super) fn ep_mut<'s>(
        &self,
        st: &'s mut State,
        stopped: bool,
    ) -> Result<&'s mut EpState, UcxError> {
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

    pub(super) fn post_inner(
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

        let mut st = self.engine.state.lock();
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

    pub(super) fn post_pending(
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
        let mut st = self.engine.state.lock();
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
