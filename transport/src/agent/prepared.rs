//! Prepared transfers: descriptor pairs validated against both sides and coalesced once, to post
//! many times.

use std::fmt;

use super::peer::RegTable;
use super::PeerCore;
use crate::desc::{coalesce_in_place, KeepAlive, Loc, LocalDesc, Pair, RemoteDesc};
use crate::engine::Xfer;
use crate::error::{Side, TransferError};
use crate::notify::MAX_NOTIFICATION;
use crate::registry::RegEntry;
use crate::transfer::{Completion, Op, Plan, Segment, Transfer, UNREGISTERED};
use tessera_sync::atomic::Ordering;
use tessera_sync::Arc;

/// A descriptor pair list validated and coalesced once, to post many times cheaply (NIXL's
/// prepared transfers). Posting costs an `Arc` clone and the engine's own work.
#[derive(Clone)]
pub struct Prepared {
    plan: Arc<Plan>,
    peer: Arc<PeerCore>,
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
        let mut remote_side = RemoteSide::of(&peer);
        let agent_id = peer.agent.host.id;
        let mut pairs: Vec<Pair> = Vec::with_capacity(local.len());
        let mut pins: Vec<Arc<RegEntry>> = Vec::new();
        let mut keep = Vec::new();
        let mut bytes = 0u64;
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
            remote_side.check(index, r)?;
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
                Segment::new(
                    (p.local.reg, p.local.offset, base + p.local.offset as usize),
                    (p.remote.reg, p.remote.offset),
                    p.len,
                )
            })
            .collect();
        keep.reserve(pins.len() + 1);
        keep.extend(pins.into_iter().map(|p| p as KeepAlive));
        keep.push(peer.clone());
        Ok(Self {
            plan: Arc::new(Plan::new(op, peer.name.clone(), segments, keep, bytes)),
            peer,
        })
    }

    /// A WRITE of `sources`, `(address, length)` ranges of memory that is not registered,
    /// to `remote`, pairwise, coalesced; the plan keeps `keep` alive. Only for engines that
    /// reach local memory by address ([`Agent::local_side_needs_registration`] false).
    ///
    /// # Safety
    ///
    /// As [`Peer::write_unregistered`] asks.
    ///
    /// [`Agent::local_side_needs_registration`]: crate::Agent::local_side_needs_registration
    /// [`Peer::write_unregistered`]: crate::Peer::write_unregistered
    pub(crate) unsafe fn unregistered(
        peer: Arc<PeerCore>,
        sources: &[(*const u8, u64)],
        remote: &[RemoteDesc],
        keep: KeepAlive,
    ) -> Result<Self, TransferError> {
        let name = |p: &PeerCore| p.name.to_string();
        if peer.agent.transport.local_side_needs_registration() {
            return Err(TransferError::Mismatch {
                peer: name(&peer),
                detail: format!(
                    "the {} engine reads only registered memory: register the sources",
                    peer.agent.transport.kind()
                ),
            });
        }
        if sources.len() != remote.len() {
            return Err(TransferError::Mismatch {
                peer: name(&peer),
                detail: format!(
                    "{} sources for {} remote descriptors",
                    sources.len(),
                    remote.len()
                ),
            });
        }
        let mut remote_side = RemoteSide::of(&peer);
        let mut pairs: Vec<Pair> = Vec::with_capacity(sources.len());
        let mut bytes = 0u64;
        for (index, (&(addr, len), r)) in sources.iter().zip(remote).enumerate() {
            if len != r.len {
                return Err(TransferError::Mismatch {
                    peer: name(&peer),
                    detail: format!("pair {index}: source {len} bytes, remote {} bytes", r.len),
                });
            }
            remote_side.check(index, r)?;
            bytes += len;
            let pair = Pair {
                local: Loc {
                    reg: UNREGISTERED,
                    offset: addr as u64,
                },
                remote: Loc {
                    reg: r.reg,
                    offset: r.offset,
                },
                len,
            };
            match pairs.last_mut() {
                Some(last) if last.continued_by(&pair) => last.len += pair.len,
                _ => pairs.push(pair),
            }
        }
        coalesce_in_place(&mut pairs);
        let segments = pairs
            .iter()
            .map(|p| {
                Segment::new(
                    (UNREGISTERED, p.local.offset, p.local.offset as usize),
                    (p.remote.reg, p.remote.offset),
                    p.len,
                )
            })
            .collect();
        let keep = vec![keep, peer.clone() as KeepAlive];
        Ok(Self {
            plan: Arc::new(Plan::new(
                Op::Write,
                peer.name.clone(),
                segments,
                keep,
                bytes,
            )),
            peer,
        })
    }

    /// The plan: segments after coalescing.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Posts the transfer; `notify` reaches the peer after the data landed.
    pub fn post(&self, notify: Option<&[u8]>) -> Result<Transfer, TransferError> {
        let peer = &self.peer;
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
        let (done, transfer) = Completion::start(self.plan.clone(), peer.agent.in_flight.clone());
        let conn = peer.conn.lock().clone();
        conn.post(Xfer {
            notify: notify.map(<[u8]>::to_vec),
            done,
        });
        Ok(transfer)
    }
}

/// The peer's registrations as its metadata announced them, to check remote descriptors
/// against, remembering the last one looked up (descriptors into one block come in a row).
struct RemoteSide<'a> {
    peer: &'a PeerCore,
    table: Arc<RegTable>,
    last: Option<(u64, u64)>,
}

impl<'a> RemoteSide<'a> {
    fn of(peer: &'a PeerCore) -> Self {
        Self {
            peer,
            table: peer.regs.lock().clone(),
            last: None,
        }
    }

    /// Whether remote descriptor `index`, `r`, is a non-empty range of a registration the
    /// peer announced.
    fn check(&mut self, index: usize, r: &RemoteDesc) -> Result<(), TransferError> {
        let peer = || self.peer.name.to_string();
        let reg_len = match self.last {
            Some((id, len)) if id == r.reg => len,
            _ => {
                let len =
                    self.table
                        .len_of(r.reg)
                        .ok_or_else(|| TransferError::UnknownRegistration {
                            peer: peer(),
                            side: Side::Remote,
                            index,
                            reg: r.reg,
                        })?;
                self.last = Some((r.reg, len));
                len
            }
        };
        match r.end() {
            Some(end) if end <= reg_len && r.len > 0 => Ok(()),
            _ => Err(TransferError::OutOfRange {
                peer: peer(),
                side: Side::Remote,
                index,
                reg: r.reg,
                offset: r.offset,
                len: r.len,
                reg_len,
            }),
        }
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
