//! Plans, prepared transfers, transfer handles and typed completion.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::agent::{PeerCore, RegEntry, MAX_NOTIFICATION};
use crate::desc::{coalesce_in_place, KeepAlive, Loc, LocalDesc, Pair, RemoteDesc};
use crate::engine::{Op, Xfer};
use crate::error::{RejectReason, Side, TransferError};
use crate::sync::{lock, Arc, AtomicUsize, Condvar, Mutex, Ordering};

/// One contiguous copy of a plan: `len` bytes between a local address and a remote
/// (registration, offset).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Local registration id.
    pub local_reg: u64,
    /// Offset in the local registration.
    pub local_offset: u64,
    local_addr: usize,
    /// Remote registration id.
    pub remote_reg: u64,
    /// Offset in the remote registration.
    pub remote_offset: u64,
    /// Length in bytes.
    pub len: u64,
}

impl Segment {
    /// Address of the local bytes. Valid while the plan lives: the plan pins the registration.
    pub fn local_ptr(&self) -> *mut u8 {
        self.local_addr as *mut u8
    }
}

/// A validated, coalesced transfer: what an engine executes. It owns every resource the
/// transfer touches (local registrations, pool blocks, the peer handle), so they stay alive
/// until the engine drops the plan.
pub struct Plan {
    op: Op,
    peer: Arc<PeerCore>,
    segments: Vec<Segment>,
    _pins: Vec<Arc<RegEntry>>,
    _keep: Vec<KeepAlive>,
    bytes: u64,
}

impl Plan {
    /// Direction.
    pub fn op(&self) -> Op {
        self.op
    }

    /// The copies, coalesced.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Total bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The peer's name.
    pub fn peer_name(&self) -> &str {
        &self.peer.name
    }
}

impl fmt::Debug for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Plan")
            .field("op", &self.op)
            .field("peer", &self.peer_name())
            .field("segments", &self.segments.len())
            .field("bytes", &self.bytes)
            .finish()
    }
}

/// A descriptor pair list validated and coalesced once, to post many times cheaply (NIXL's
/// prepared transfers). Posting costs an `Arc` clone and the engine's own work.
#[derive(Clone)]
pub struct Prepared {
    plan: Arc<Plan>,
}

impl Prepared {
    pub(crate) fn new(
        peer: Arc<PeerCore>,
        op: Op,
        local: &[LocalDesc],
        remote: &[RemoteDesc],
        merge: bool,
    ) -> Result<Self, TransferError> {
        let name = |p: &PeerCore| p.name.to_string();
        if local.len() != remote.len() {
            return Err(TransferError::Mismatch {
                peer: name(&peer),
                detail: format!(
                    "{} local descriptors for {} remote ones",
                    local.len(),
                    remote.len()
                ),
            });
        }
        let table = lock(&peer.regs).clone();
        let agent_id = peer.agent.host.id;
        let mut pairs: Vec<Pair> = Vec::with_capacity(local.len());
        let mut pins: Vec<Arc<RegEntry>> = Vec::new();
        let mut keep = Vec::new();
        let mut bytes = 0u64;
        let mut last_remote: Option<(u64, u64)> = None;
        for (index, (l, r)) in local.iter().zip(remote).enumerate() {
            if l.len != r.len {
                return Err(TransferError::Mismatch {
                    peer: name(&peer),
                    detail: format!(
                        "pair {index}: local {} bytes, remote {} bytes",
                        l.len, r.len
                    ),
                });
            }
            if l.reg.agent_id != agent_id {
                return Err(TransferError::Mismatch {
                    peer: name(&peer),
                    detail: format!("local descriptor {index} is registered with another agent"),
                });
            }
            let reg_len = match last_remote {
                Some((id, len)) if id == r.reg => len,
                _ => {
                    let len =
                        table
                            .len_of(r.reg)
                            .ok_or_else(|| TransferError::UnknownRegistration {
                                peer: name(&peer),
                                side: Side::Remote,
                                index,
                                reg: r.reg,
                            })?;
                    last_remote = Some((r.reg, len));
                    len
                }
            };
            match r.end() {
                Some(end) if end <= reg_len && r.len > 0 => {}
                _ => {
                    return Err(TransferError::OutOfRange {
                        peer: name(&peer),
                        side: Side::Remote,
                        index,
                        reg: r.reg,
                        offset: r.offset,
                        len: r.len,
                        reg_len,
                    })
                }
            }
            if pins.last().is_none_or(|p| p.id != l.reg.id) {
                pins.push(l.reg.clone());
            }
            if let Some(k) = &l.keep {
                keep.push(k.clone());
            }
            bytes += l.len;
            let pair = Pair {
                local: Loc {
                    reg: l.reg.id,
                    offset: l.offset,
                },
                remote: Loc {
                    reg: r.reg,
                    offset: r.offset,
                },
                len: l.len,
            };
            // Merging a pair into the one just before it is always right; `coalesce_in_place`
            // below then handles whatever is out of order.
            match pairs.last_mut() {
                Some(last) if merge && last.continued_by(&pair) => last.len += pair.len,
                _ => pairs.push(pair),
            }
        }
        if merge {
            coalesce_in_place(&mut pairs);
        }
        pins.sort_unstable_by_key(|p| p.id);
        pins.dedup_by_key(|p| p.id);
        let segments = pairs
            .iter()
            .map(|p| {
                let base = pins
                    .binary_search_by_key(&p.local.reg, |e| e.id)
                    .map(|i| pins[i].base() as usize)
                    .unwrap_or(0);
                Segment {
                    local_reg: p.local.reg,
                    local_offset: p.local.offset,
                    local_addr: base + p.local.offset as usize,
                    remote_reg: p.remote.reg,
                    remote_offset: p.remote.offset,
                    len: p.len,
                }
            })
            .collect();
        Ok(Self {
            plan: Arc::new(Plan {
                op,
                peer,
                segments,
                _pins: pins,
                _keep: keep,
                bytes,
            }),
        })
    }

    /// The plan: segments after coalescing.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Posts the transfer; `notify` reaches the peer after the data landed.
    pub fn post(&self, notify: Option<&[u8]>) -> Result<Transfer, TransferError> {
        let peer = &self.plan.peer;
        if let Some(msg) = notify {
            if msg.len() > MAX_NOTIFICATION {
                return Err(TransferError::NotificationTooLarge {
                    peer: peer.name.to_string(),
                    len: msg.len(),
                    max: MAX_NOTIFICATION,
                });
            }
        }
        if peer.agent.host.closed.load(Ordering::Acquire) {
            return Err(TransferError::PeerGone {
                peer: peer.name.to_string(),
                detail: "this agent is shut down".into(),
            });
        }
        let state = Arc::new(XferState::default());
        let in_flight = peer.agent.in_flight.clone();
        in_flight.fetch_add(1, Ordering::AcqRel);
        let done = Completion {
            state: state.clone(),
            plan: Some(self.plan.clone()),
            in_flight: Some(in_flight),
            peer: peer.name.clone(),
        };
        let conn = lock(&peer.conn).clone();
        conn.post(Xfer {
            notify: notify.map(<[u8]>::to_vec),
            done,
        });
        Ok(Transfer {
            state,
            peer: peer.name.clone(),
        })
    }
}

impl fmt::Debug for Prepared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.plan.fmt(f)
    }
}

const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Transfer>();
    assert_send_sync::<Prepared>();
    assert_send_sync::<Completion>();
    assert_send_sync::<Plan>();
};

#[derive(Default)]
struct XferState {
    slot: Mutex<Slot>,
    done: Condvar,
}

#[derive(Default)]
struct Slot {
    result: Option<Result<(), TransferError>>,
    waker: Option<Waker>,
}

/// Where an engine reports a transfer's outcome. Completing consumes it, so an outcome is
/// reported once; dropping it unreported fails the transfer with
/// [`TransferError::StatusLost`]. Either way the transfer's resources are released first, so
/// whoever awaits the transfer sees them released.
pub struct Completion {
    state: Arc<XferState>,
    plan: Option<Arc<Plan>>,
    in_flight: Option<Arc<AtomicUsize>>,
    peer: Arc<str>,
}

impl Completion {
    /// Reports the outcome. A target's refusal because it is shutting down is reported as
    /// [`TransferError::PeerGone`], whichever engine saw it.
    pub fn complete(mut self, result: Result<(), TransferError>) {
        let result = match result {
            Err(TransferError::Rejected {
                peer,
                reason: RejectReason::ShuttingDown,
            }) => Err(TransferError::PeerGone {
                peer,
                detail: "the peer is shutting down".into(),
            }),
            other => other,
        };
        self.finish(result);
    }

    /// The transfer's plan. It holds every resource the transfer touches, and lives until the
    /// outcome is reported.
    pub fn plan(&self) -> &Plan {
        // Only `finish` takes the plan, and it consumes or drops the completion.
        self.plan
            .as_deref()
            .unwrap_or_else(|| unreachable!("plan taken before completion"))
    }

    /// Another handle on the plan, for an engine that may still touch the plan's memory after
    /// the outcome is reported (say, a payload write racing the failure of its connection).
    /// The transfer's resources are released when the last handle is dropped.
    pub fn plan_handle(&self) -> Arc<Plan> {
        match &self.plan {
            Some(p) => p.clone(),
            None => unreachable!("plan taken before completion"),
        }
    }

    /// The peer's name, for building errors.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    fn finish(&mut self, result: Result<(), TransferError>) {
        let Some(in_flight) = self.in_flight.take() else {
            return;
        };
        drop(self.plan.take());
        in_flight.fetch_sub(1, Ordering::AcqRel);
        let waker = {
            let mut slot = lock(&self.state.slot);
            slot.result = Some(result);
            slot.waker.take()
        };
        self.state.done.notify_all();
        if let Some(w) = waker {
            w.wake();
        }
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        if self.in_flight.is_some() {
            let peer = self.peer.to_string();
            self.finish(Err(TransferError::StatusLost { peer }));
        }
    }
}

impl fmt::Debug for Completion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Completion")
            .field("peer", &self.peer)
            .finish()
    }
}

/// Where a transfer stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Status {
    /// Still moving.
    Pending,
    /// Every byte landed and the notification, if any, was handed over.
    Done,
    /// Failed; terminal.
    Failed(TransferError),
}

/// A posted transfer: a `Future` of its outcome, and pollable with [`Transfer::status`].
///
/// Dropping it does not cancel the transfer: the engine keeps every resource the transfer
/// touches until it completes or the agent is torn down.
#[must_use = "a transfer's outcome should be checked"]
pub struct Transfer {
    state: Arc<XferState>,
    peer: Arc<str>,
}

impl Transfer {
    /// The status now, without waiting.
    pub fn status(&self) -> Status {
        match &lock(&self.state.slot).result {
            None => Status::Pending,
            Some(Ok(())) => Status::Done,
            Some(Err(e)) => Status::Failed(e.clone()),
        }
    }

    /// The peer's name.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Blocks the thread until the transfer completes.
    pub fn wait(self) -> Result<(), TransferError> {
        let mut slot = lock(&self.state.slot);
        loop {
            if let Some(r) = &slot.result {
                return r.clone();
            }
            slot = self
                .state
                .done
                .wait(slot)
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Blocks up to `timeout`. On timeout the transfer goes on (its resources stay held) and
    /// [`TransferError::Timeout`] is returned; check again with [`Transfer::status`].
    pub fn wait_timeout(&self, timeout: Duration) -> Result<(), TransferError> {
        let deadline = Instant::now() + timeout;
        let mut slot = lock(&self.state.slot);
        loop {
            if let Some(r) = &slot.result {
                return r.clone();
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return Err(TransferError::Timeout {
                    peer: self.peer.to_string(),
                    after: timeout,
                });
            };
            slot = self
                .state
                .done
                .wait_timeout(slot, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Future for Transfer {
    type Output = Result<(), TransferError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut slot = lock(&self.state.slot);
        match &slot.result {
            Some(r) => Poll::Ready(r.clone()),
            None => {
                slot.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

impl fmt::Debug for Transfer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Transfer")
            .field("peer", &self.peer)
            .field("status", &self.status())
            .finish()
    }
}
