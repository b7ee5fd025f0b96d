//! Peers whose metadata is loaded: their registrations, validation of every descriptor before
//! posting, and transfers posted as one NIXL request with the notification.

use super::*;

/// One copy of a transfer: `len` bytes at `local_offset` in `local` and at `remote_offset`
/// in the peer's registration `remote` (an id given to [`NixlPeer::add_remote`]).
#[derive(Debug, Clone, Copy)]
pub struct XferOpDesc<'a> {
    /// The local registration.
    pub local: &'a NixlRegion,
    /// Offset in it.
    pub local_offset: u64,
    /// The remote registration's id.
    pub remote: u64,
    /// Offset in it.
    pub remote_offset: u64,
    /// Bytes to move.
    pub len: u64,
}

/// A handle on a peer whose metadata is loaded.
pub struct NixlPeer {
    pub(super) engine: Arc<Inner>,
    pub(super) name: String,
}

impl fmt::Debug for NixlPeer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NixlPeer")
            .field("name", &self.name)
            .finish()
    }
}

impl NixlPeer {
    /// The peer agent's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Loads newer metadata of the same peer (e.g. after it registered more memory).
    pub fn update(&self, metadata: &[u8]) -> Result<(), NixlEngineError> {
        let _st = self.engine.state.lock();
        let name = self
            .engine
            .agent
            .load_remote_md(metadata)
            .map_err(nixl("loadRemoteMD"))?;
        if name != self.name {
            return Err(NixlEngineError::Invalid(format!(
                "metadata of {name:?} given to the handle of {:?}",
                self.name
            )));
        }
        Ok(())
    }

    /// Records the peer's registration `id` from its [`NixlRegion::remote_key`].
    pub fn add_remote(&self, id: u64, key: &[u8]) -> Result<(), NixlEngineError> {
        let reg = decode_key(key)?;
        let mut st = self.engine.state.lock();
        st.peers
            .entry(self.name.clone())
            .or_default()
            .regs
            .insert(id, reg);
        Ok(())
    }

    /// Sends a notification alone (`genNotif`), through the engine's UCX backend.
    pub fn notify(&self, msg: &[u8]) -> Result<(), NixlEngineError> {
        if msg.len() > self.engine.max_notification {
            return Err(NixlEngineError::Invalid(format!(
                "a notification of {} bytes exceeds the limit of {}",
                msg.len(),
                self.engine.max_notification
            )));
        }
        let st = self.engine.state.lock();
        if st.stopped {
            return Err(NixlEngineError::Shutdown(self.engine.name.clone()));
        }
        self.engine
            .agent
            .send_notification(&self.name, msg, Some(&self.engine.backend))
            .map_err(|source| NixlEngineError::TransferFailed {
                peer: self.name.clone(),
                source,
            })
    }

    /// Forgets the peer's registration `id`.
    pub fn remove_remote(&self, id: u64) {
        if let Some(p) = self.engine.state.lock().peers.get_mut(&self.name) {
            p.regs.remove(&id);
        }
    }

    /// Posts a transfer: every op is validated first (nothing is posted if one is invalid),
    /// split at chunk boundaries on both sides into one NIXL descriptor list per side, and
    /// posted as one request with the notification. `done` runs exactly once: on the waiter
    /// thread, or before this returns when NIXL completed or failed it in place. On `Err`,
    /// nothing was posted and `done` is dropped without running.
    pub fn post(
        &self,
        kind: XferKind,
        ops: &[XferOpDesc<'_>],
        notify: Option<Vec<u8>>,
        done: impl FnOnce(Result<(), NixlEngineError>) + Send + 'static,
    ) -> Result<(), NixlEngineError> {
        if ops.is_empty() {
            return Err(NixlEngineError::Invalid(
                "a transfer needs at least one op".into(),
            ));
        }
        if let Some(n) = &notify {
            if n.len() > self.engine.max_notification {
                return Err(NixlEngineError::Invalid(format!(
                    "a notification of {} bytes exceeds the limit of {}",
                    n.len(),
                    self.engine.max_notification
                )));
            }
        }
        let mut keep: Vec<Arc<RegInner>> = Vec::new();
        for (index, op) in ops.iter().enumerate() {
            let local = &op.local.inner;
            if !Arc::ptr_eq(&local.engine, &self.engine) {
                return Err(NixlEngineError::ForeignRegistration { index });
            }
            if !in_bounds(op.local_offset, op.len, local.len) {
                return Err(NixlEngineError::OutOfRange {
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
        if st.stopped {
            return Err(NixlEngineError::Shutdown(self.engine.name.clone()));
        }
        let peer = st.peers.get(&self.name);
        let mut ldesc = XferDescList::new(MemType::Dram).map_err(nixl("createXferDlist"))?;
        let mut rdesc = XferDescList::new(MemType::Dram).map_err(nixl("createXferDlist"))?;
        for (index, op) in ops.iter().enumerate() {
            let remote = peer.and_then(|p| p.regs.get(&op.remote)).ok_or_else(|| {
                NixlEngineError::UnknownRemote {
                    peer: self.name.clone(),
                    index,
                    id: op.remote,
                }
            })?;
            if !in_bounds(op.remote_offset, op.len, remote.len) {
                return Err(NixlEngineError::OutOfRange {
                    side: Side::Remote,
                    index,
                    offset: op.remote_offset,
                    len: op.len,
                    reg_len: remote.len,
                });
            }
            let local = &op.local.inner;
            let (mut loff, mut roff, mut left) = (op.local_offset, op.remote_offset, op.len);
            while left > 0 {
                let li = local.chunks.partition_point(|c| c.0 + c.1 <= loff);
                let ri = remote.chunks.partition_point(|c| c.0 + c.2 <= roff);
                let (lc, rc) = (local.chunks[li], remote.chunks[ri]);
                let piece = left.min(lc.0 + lc.1 - loff).min(rc.0 + rc.2 - roff);
                ldesc.add_desc(local.base + loff as usize, piece as usize, 0);
                rdesc.add_desc((rc.1 + (roff - rc.0)) as usize, piece as usize, 0);
                loff += piece;
                roff += piece;
                left -= piece;
            }
        }
        let mut args = OptArgs::new().map_err(nixl("createOptArgs"))?;
        args.add_backend(&self.engine.backend)
            .map_err(nixl("optArgs backend"))?;
        if let Some(n) = &notify {
            args.set_notification_message(n)
                .map_err(nixl("optArgs notification"))?;
            // NIXL sends the message only with this flag set.
            args.set_has_notification(true)
                .map_err(nixl("optArgs notification"))?;
        }
        let op = match kind {
            XferKind::Write => XferOp::Write,
            XferKind::Read => XferOp::Read,
        };
        let req = self
            .engine
            .agent
            .create_xfer_req(op, &ldesc, &rdesc, &self.name, Some(&args))
            .map_err(nixl("createXferReq"))?;
        let done: Done = Box::new(done);
        let posted = self.engine.agent.post_xfer_req(&req, Some(&args));
        let peer_name = self.name.clone();
        let finished_now = match posted {
            Ok(true) => None,
            Ok(false) => Some(Ok(())),
            Err(source) => {
                // Something may have been posted before the failure: release the request
                // only if NIXL no longer reports it in progress.
                let err = NixlEngineError::TransferFailed {
                    peer: peer_name.clone(),
                    source,
                };
                match self.engine.agent.get_xfer_status(&req) {
                    Ok(XferStatus::InProgress) => {
                        let p = st.peers.entry(peer_name.clone()).or_default();
                        p.pending += 1;
                        st.inflight.push(InFlight {
                            req,
                            peer: peer_name,
                            keep,
                            done: None,
                            deadline: None,
                        });
                        drop(st);
                        self.engine.cv.notify_all();
                        done(Err(err));
                        return Ok(());
                    }
                    _ => Some(Err(err)),
                }
            }
        };
        match finished_now {
            None => {
                st.peers.entry(peer_name.clone()).or_default().pending += 1;
                st.inflight.push(InFlight {
                    req,
                    peer: peer_name,
                    keep,
                    done: Some(done),
                    deadline: self.engine.timeout.map(|t| Instant::now() + t),
                });
                drop(st);
                self.engine.cv.notify_all();
            }
            Some(result) => {
                drop(req); // finished: released before its memory
                drop(st);
                drop(keep);
                done(result);
            }
        }
        Ok(())
    }

    /// [`NixlPeer::post`] of a WRITE, returning a handle to wait on.
    pub fn write(
        &self,
        ops: &[XferOpDesc<'_>],
        notify: Option<Vec<u8>>,
    ) -> Result<Pending, NixlEngineError> {
        self.post_pending(XferKind::Write, ops, notify)
    }

    /// [`NixlPeer::post`] of a READ, returning a handle to wait on.
    pub fn read(
        &self,
        ops: &[XferOpDesc<'_>],
        notify: Option<Vec<u8>>,
    ) -> Result<Pending, NixlEngineError> {
        self.post_pending(XferKind::Read, ops, notify)
    }

    pub(super) fn post_pending(
        &self,
        kind: XferKind,
        ops: &[XferOpDesc<'_>],
        notify: Option<Vec<u8>>,
    ) -> Result<Pending, NixlEngineError> {
        let (pending, settle) = Pending::new();
        self.post(kind, ops, notify, settle)?;
        Ok(pending)
    }
}

impl Drop for NixlPeer {
    fn drop(&mut self) {
        let mut st = self.engine.state.lock();
        if let Some(p) = st.peers.get_mut(&self.name) {
            p.handles = p.handles.saturating_sub(1);
        }
        if !st.stopped {
            self.engine.invalidate_idle_peers(&mut st);
        }
    }
}
