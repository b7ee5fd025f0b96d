//! What one transfer is made of, below the agent: its direction, its plan of segments, the
//! completion an engine reports through, and the handle its caller waits on.

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::error::{RejectReason, TransferError};
use tessera_sync::atomic::{AtomicUsize, Ordering};
use tessera_sync::{Arc, OneShot};

/// Direction of a transfer, seen from the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum Op {
    /// Local memory to remote memory.
    Write,
    /// Remote memory to local memory.
    Read,
}
impl Op {
    pub(crate) fn code(self) -> u8 {
        match self {
            Op::Write => 1,
            Op::Read => 2,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(Op::Write),
            2 => Some(Op::Read),
            _ => None,
        }
    }
}

/// Something that must stay alive while a transfer may touch a descriptor's bytes (a pool
/// block's lease, the owner of foreign memory, a pinned registration, the peer handle).
pub type KeepAlive = Arc<dyn Any + Send + Sync>;

/// [`Segment::local_reg`] of a segment whose local side is not registered (a WRITE from
/// [`Peer::write_unregistered`](crate::Peer::write_unregistered)): its local offset is the
/// address.
pub(crate) const UNREGISTERED: u64 = 0;

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
    pub(crate) fn new(
        (local_reg, local_offset, local_addr): (u64, u64, usize),
        (remote_reg, remote_offset): (u64, u64),
        len: u64,
    ) -> Self {
        Self {
            local_reg,
            local_offset,
            local_addr,
            remote_reg,
            remote_offset,
            len,
        }
    }

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
    peer: Arc<str>,
    segments: Vec<Segment>,
    /// The peer handle, the local registrations and pool blocks the segments touch.
    _keep: Vec<KeepAlive>,
    bytes: u64,
}

impl Plan {
    /// A plan of `segments` with `peer`, keeping `keep` alive until the engine drops it.
    pub(crate) fn new(
        op: Op,
        peer: Arc<str>,
        segments: Vec<Segment>,
        keep: Vec<KeepAlive>,
        bytes: u64,
    ) -> Self {
        Self {
            op,
            peer,
            segments,
            _keep: keep,
            bytes,
        }
    }

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
        &self.peer
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

/// A transfer's outcome, set once by its [`Completion`] and read by its [`Transfer`].
type XferState = OneShot<Result<(), TransferError>>;

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
    /// A new transfer of `plan`, counted in `in_flight` until its outcome is reported: the
    /// completion for the engine and the handle for the caller.
    pub(crate) fn start(plan: Arc<Plan>, in_flight: Arc<AtomicUsize>) -> (Self, Transfer) {
        let state = Arc::new(XferState::default());
        let peer = plan.peer.clone();
        in_flight.fetch_add(1, Ordering::AcqRel);
        let done = Completion {
            state: state.clone(),
            plan: Some(plan),
            in_flight: Some(in_flight),
            peer: peer.clone(),
        };
        (done, Transfer { state, peer })
    }

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
        self.state.set(result);
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
        match self.state.get() {
            None => Status::Pending,
            Some(Ok(())) => Status::Done,
            Some(Err(e)) => Status::Failed(e),
        }
    }

    /// The peer's name.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Blocks the thread until the transfer completes.
    pub fn wait(self) -> Result<(), TransferError> {
        self.state.wait()
    }

    /// Blocks up to `timeout`. On timeout the transfer goes on (its resources stay held) and
    /// [`TransferError::Timeout`] is returned; check again with [`Transfer::status`].
    pub fn wait_timeout(&self, timeout: Duration) -> Result<(), TransferError> {
        self.state.wait_timeout(timeout).unwrap_or_else(|| {
            Err(TransferError::Timeout {
                peer: self.peer.to_string(),
                after: timeout,
            })
        })
    }
}

impl Future for Transfer {
    type Output = Result<(), TransferError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.state.poll(cx)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Each op's wire code reads back as that op; any other code is no op.
    #[test]
    fn op_codes_read_back_and_others_are_refused() {
        for op in [Op::Write, Op::Read] {
            assert_eq!(Op::from_code(op.code()), Some(op));
        }
        for code in [0u8, 3, 255] {
            assert_eq!(Op::from_code(code), None);
        }
    }

    /// A transfer of an empty plan with `peer`, whose plan keeps `keep` alive.
    fn started(keep: &Arc<()>) -> (Completion, Transfer, Arc<AtomicUsize>) {
        let plan = Plan::new(Op::Write, "p".into(), Vec::new(), vec![keep.clone()], 0);
        let in_flight = Arc::new(AtomicUsize::new(0));
        let (done, t) = Completion::start(Arc::new(plan), in_flight.clone());
        assert_eq!(in_flight.load(Ordering::Acquire), 1);
        assert!(matches!(t.status(), Status::Pending));
        (done, t, in_flight)
    }

    /// Completing reports the outcome to the handle, releases the plan and leaves the
    /// in-flight count.
    #[test]
    fn completing_reports_releases_and_uncounts() {
        let keep = Arc::new(());
        let (done, t, in_flight) = started(&keep);
        done.complete(Ok(()));
        assert!(matches!(t.status(), Status::Done));
        assert_eq!(in_flight.load(Ordering::Acquire), 0);
        assert_eq!(Arc::strong_count(&keep), 1, "the plan was released");
    }

    /// A completion dropped unreported fails its transfer with `StatusLost`, never success,
    /// and releases the plan and the in-flight count all the same.
    #[test]
    fn a_dropped_completion_fails_its_transfer_as_status_lost() {
        let keep = Arc::new(());
        let (done, t, in_flight) = started(&keep);
        drop(done);
        assert!(
            matches!(t.status(), Status::Failed(TransferError::StatusLost { ref peer }) if peer == "p"),
            "{:?}",
            t.status()
        );
        assert_eq!(in_flight.load(Ordering::Acquire), 0);
        assert_eq!(Arc::strong_count(&keep), 1, "the plan was released");
    }
}
