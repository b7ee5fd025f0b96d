//! Handles on remote agents.

use std::collections::HashMap;
use std::fmt;

use super::AgentCore;
use super::Prepared;
use crate::desc::{KeepAlive, LocalDesc, RemoteDesc};
use crate::engine::RemoteReg;
use crate::engine::{Connection, Op};
use crate::error::TransferError;
use crate::transfer::Transfer;
use tessera_sync::{Arc, Mutex};

/// A handle on a remote agent. Cloning is cheap; the connection closes when the last handle
/// and the last transfer with the peer are gone.
#[derive(Clone)]
pub struct Peer {
    pub(crate) core: Arc<PeerCore>,
}

pub(crate) struct PeerCore {
    pub(crate) name: Arc<str>,
    pub(crate) agent: Arc<AgentCore>,
    pub(crate) conn: Mutex<Arc<dyn Connection>>,
    pub(super) address: Mutex<Vec<u8>>,
    pub(crate) regs: Mutex<Arc<RegTable>>,
}

impl Drop for PeerCore {
    fn drop(&mut self) {
        self.conn.lock().close();
        let mut peers = self.agent.peers.lock();
        if peers
            .get(&*self.name)
            .is_some_and(|w| w.strong_count() == 0)
        {
            peers.remove(&*self.name);
        }
    }
}

impl Peer {
    /// The peer agent's name.
    pub fn name(&self) -> &str {
        &self.core.name
    }

    /// Whether the peer's latest metadata announced registration `id`, and its length.
    pub fn registration_len(&self, id: u64) -> Option<u64> {
        self.core.regs.lock().len_of(id)
    }

    /// Validates and coalesces a descriptor pair list once, to post it many times.
    pub fn prepare(
        &self,
        op: Op,
        local: &[LocalDesc],
        remote: &[RemoteDesc],
    ) -> Result<Prepared, TransferError> {
        Prepared::new(self.core.clone(), op, local, remote, true)
    }

    /// Like [`Peer::prepare`] without coalescing: the engine sees one segment per pair, in the
    /// given order. Useful to measure what coalescing saves, or to keep a strict order of
    /// overlapping destinations.
    pub fn prepare_uncoalesced(
        &self,
        op: Op,
        local: &[LocalDesc],
        remote: &[RemoteDesc],
    ) -> Result<Prepared, TransferError> {
        Prepared::new(self.core.clone(), op, local, remote, false)
    }

    /// Copies each `local[i]` to `remote[i]` (pairwise equal lengths), then delivers `notify`
    /// to the peer. Every remote descriptor is checked against the peer's metadata before a
    /// byte moves.
    pub fn write(
        &self,
        local: &[LocalDesc],
        remote: &[RemoteDesc],
        notify: Option<&[u8]>,
    ) -> Result<Transfer, TransferError> {
        self.prepare(Op::Write, local, remote)?.post(notify)
    }

    /// Copies each `sources[i]`, an `(address, length)` range of memory that is not
    /// registered, to `remote[i]` (pairwise equal lengths), then delivers `notify` to the
    /// peer: a WRITE without registering its sources, for engines that reach local memory by
    /// address (where [`Agent::local_side_needs_registration`](crate::Agent::local_side_needs_registration)
    /// is false; the others refuse it). Every remote descriptor is checked as for
    /// [`Peer::write`]. The transfer holds `keep` until the engine is done with the sources,
    /// even when the [`Transfer`] is dropped before it completes.
    ///
    /// # Safety
    ///
    /// Every source range must be valid for reads, and not written by anyone, until the
    /// engine drops `keep`: `keep` owns that memory or keeps its owner alive (the `Bytes` of
    /// the frames, say).
    pub unsafe fn write_unregistered(
        &self,
        sources: &[(*const u8, u64)],
        remote: &[RemoteDesc],
        keep: KeepAlive,
        notify: Option<&[u8]>,
    ) -> Result<Transfer, TransferError> {
        // SAFETY: the caller upholds `Prepared::unregistered`'s contract, which is this
        // function's.
        unsafe { Prepared::unregistered(self.core.clone(), sources, remote, keep) }?.post(notify)
    }

    /// Copies each `remote[i]` into `local[i]` (pairwise equal lengths), then delivers
    /// `notify` to the peer.
    pub fn read(
        &self,
        local: &[LocalDesc],
        remote: &[RemoteDesc],
        notify: Option<&[u8]>,
    ) -> Result<Transfer, TransferError> {
        self.prepare(Op::Read, local, remote)?.post(notify)
    }

    /// Sends a notification alone.
    pub fn notify(&self, msg: &[u8]) -> Result<Transfer, TransferError> {
        self.prepare(Op::Write, &[], &[])?.post(Some(msg))
    }
}

impl fmt::Debug for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Peer").field("name", &self.name()).finish()
    }
}

/// A peer's registrations as its latest metadata announced them: id -> length.
pub(crate) struct RegTable {
    lens: HashMap<u64, u64>,
}

impl RegTable {
    pub(crate) fn new(regs: &[RemoteReg]) -> Self {
        Self {
            lens: regs.iter().map(|r| (r.id, r.len)).collect(),
        }
    }

    pub(crate) fn len_of(&self, id: u64) -> Option<u64> {
        self.lens.get(&id).copied()
    }
}
