//! `inproc`: agents in one process; a transfer is the initiator's own `memmove` between
//! registered ranges, after the target agent validated and pinned its side.

use std::collections::HashMap;
use tessera_sync::unchecked::OnceLock;

use crate::copy::Copier;
use crate::engine::wire::{u32_at, u64_at};
use crate::engine::{Connection, Grant, Host, Op, PeerInfo, RegInfo, Transport, Xfer};
use crate::error::{BackendError, RegisterError, RejectReason, TransferError};
use crate::region::next_id;
use tessera_sync::{Arc, StaticMutex, Weak};

const KIND: &str = "inproc";

/// Agents in this process, by address.
fn directory() -> &'static StaticMutex<HashMap<u64, Weak<Node>>> {
    static DIR: OnceLock<StaticMutex<HashMap<u64, Weak<Node>>>> = OnceLock::new();
    DIR.get_or_init(Default::default)
}

struct Node {
    host: Host,
}

/// The in-process backend: the default, needing no system library.
#[derive(Debug)]
pub struct Inproc {
    address: u64,
    node: OnceLock<Arc<Node>>,
}

impl Inproc {
    /// A new engine with a process-unique address.
    pub fn new() -> Self {
        Self {
            address: next_id(),
            node: OnceLock::new(),
        }
    }
}

impl Default for Inproc {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.host.fmt(f)
    }
}

impl Transport for Inproc {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn start(&self, host: Host) -> Result<(), BackendError> {
        let node = Arc::new(Node { host });
        self.node
            .set(node.clone())
            .map_err(|_| BackendError::new(KIND, "started twice"))?;
        directory()
            .lock()
            .insert(self.address, Arc::downgrade(&node));
        Ok(())
    }

    fn register(&self, _: &RegInfo<'_>) -> Result<Vec<u8>, RegisterError> {
        Ok(Vec::new())
    }

    fn deregister(&self, _: u64) {}

    fn local_side_needs_registration(&self) -> bool {
        // Transfers reach local memory through the segment's address.
        false
    }

    /// The agent's number in this process, then the process id: an address only means
    /// something inside its own process.
    fn address(&self) -> Vec<u8> {
        let mut a = self.address.to_le_bytes().to_vec();
        a.extend_from_slice(&std::process::id().to_le_bytes());
        a
    }

    fn connect(&self, peer: &PeerInfo) -> Result<Arc<dyn Connection>, BackendError> {
        let (Some(address), Some(pid)) = (u64_at(&peer.address, 0), u32_at(&peer.address, 8))
        else {
            return Err(BackendError::new(KIND, "malformed address"));
        };
        if peer.address.len() != 12 {
            return Err(BackendError::new(KIND, "malformed address"));
        }
        let me = std::process::id();
        if pid != me {
            return Err(BackendError::new(
                KIND,
                format!(
                    "inproc peers must live in one process: the peer is in process {pid}, \
                     this is {me}"
                ),
            ));
        }
        let target = directory()
            .lock()
            .get(&address)
            .cloned()
            .ok_or_else(|| BackendError::new(KIND, "no such agent in this process"))?;
        let local = self
            .node
            .get()
            .map(|n| n.host.clone())
            .ok_or_else(|| BackendError::new(KIND, "not started"))?;
        Ok(Arc::new(InprocConnection {
            target,
            from: local.name().to_owned(),
            local,
            peer: peer.name.clone(),
        }))
    }

    fn shutdown(&self) {
        directory().lock().remove(&self.address);
    }
}

struct InprocConnection {
    target: Weak<Node>,
    /// The initiating agent, which counts the copies.
    local: Host,
    from: String,
    peer: String,
}

impl InprocConnection {
    fn run(&self, xfer: &Xfer) -> Result<(), TransferError> {
        let gone = || TransferError::PeerGone {
            peer: self.peer.clone(),
            detail: "the agent was dropped".into(),
        };
        let target = self.target.upgrade().ok_or_else(gone)?;
        if target.host.is_closed() {
            return Err(gone());
        }
        let segments = xfer.plan().segments();
        let mut grant = Grant::new();
        target
            .host
            .grant_for(
                &mut grant,
                &self.from,
                xfer.plan().op(),
                segments
                    .iter()
                    .map(|s| (s.remote_reg, s.remote_offset, s.len)),
            )
            .map_err(|reason| match reason {
                RejectReason::ShuttingDown => gone(),
                reason => TransferError::Rejected {
                    peer: self.peer.clone(),
                    reason,
                },
            })?;
        let mut copier = Copier::with_slice(self.local.copy_slice());
        for (i, seg) in segments.iter().enumerate() {
            let (remote, len) = grant.span(i);
            let (src, dst) = match xfer.plan().op() {
                Op::Write => (seg.local_ptr(), remote),
                Op::Read => (remote, seg.local_ptr()),
            };
            // SAFETY: `src` and `dst` each lie inside a registration pinned for this copy (the
            // plan pins the local one, the grant the remote one), `len` bytes long, so both
            // stay mapped (a WRITE from unregistered sources reads memory the plan's
            // keep-alive owns and nobody writes: `Peer::write_unregistered`'s contract); `copy` tolerates overlap (two registrations may map the same pages).
            unsafe { copier.copy(src, dst, len as usize) };
        }
        // Its stores are ordered before the record below.
        drop(copier);
        grant.mark_written();
        self.local.count_copied(xfer.plan().op(), grant.bytes());
        drop(grant);
        if let Some(msg) = &xfer.notify {
            target.host.notify(&self.from, msg.clone());
        }
        Ok(())
    }
}

impl Connection for InprocConnection {
    fn post(&self, xfer: Xfer) {
        let result = self.run(&xfer);
        xfer.done.complete(result);
    }
}
