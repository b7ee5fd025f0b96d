//! The agent as its engine sees it: target-side validation, registrations by id, notification
//! delivery, copy counts and inbound links.

use std::collections::HashMap;
use std::fmt;

use crate::error::RejectReason;
use crate::exposure::ExpState;
use crate::notify::Notifications;
use crate::registry::{RegEntry, Registry};
use crate::transfer::Op;
use crate::Region;
use tessera_sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use tessera_sync::{Arc, Counter, Mutex};

/// The part of an agent its engine may hold: registrations and notifications, never the engine.
pub(crate) struct HostShared {
    pub(crate) name: String,
    pub(crate) id: u64,
    pub(crate) registry: Arc<Registry>,
    pub(crate) notifications: Notifications,
    pub(crate) closed: AtomicBool,
    /// Payload bytes this agent's engine copied into WRITE destinations.
    pub(crate) copied_write: Counter,
    /// Payload bytes this agent's engine copied into READ destinations.
    pub(crate) copied_read: Counter,
    /// WRITEs made inside a peer's standing ranges, with no grant asked for.
    pub(crate) standing_writes: Counter,
    /// Bytes a memory engine's copy runs between offers of its core
    /// ([`Agent::set_copy_slice`](crate::Agent::set_copy_slice)).
    pub(crate) copy_slice: AtomicUsize,
    /// Inbound links by peer name: how many of the engine's readers serving that peer are
    /// still running (engines that track them, see `Transport::tracks_links`).
    pub(crate) inbound: Mutex<HashMap<String, usize>>,
}

/// The agent, as its engine sees it when a peer reaches it: target-side validation and
/// notification delivery. Cheap to clone.
#[derive(Clone)]
pub struct Host {
    pub(crate) shared: Arc<HostShared>,
}

impl fmt::Debug for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Host")
            .field("name", &self.shared.name)
            .finish()
    }
}

impl Host {
    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// Target-side validation: checks every `(registration, offset, len)` a peer asks to
    /// touch against this agent's live registrations and pins them in `grant`, so none can be
    /// deregistered until the grant is cleared or dropped. On error `grant` is left empty.
    ///
    /// Without a peer name, spans of scoped registrations are refused
    /// ([`RejectReason::NotExposed`]); engines that know who asks use [`Host::grant_for`].
    pub fn grant_into(
        &self,
        grant: &mut Grant,
        spans: impl IntoIterator<Item = (u64, u64, u64)>,
    ) -> Result<(), RejectReason> {
        self.grant_with(grant, None, spans)
    }

    /// [`Host::grant_into`] for a request of `op` from the authenticated peer `peer`: spans
    /// of scoped registrations are granted only inside an exposure to `peer` for `op`, and a
    /// WRITE's spans inside exposures are recorded as written by [`Grant::mark_written`].
    pub fn grant_for(
        &self,
        grant: &mut Grant,
        peer: &str,
        op: Op,
        spans: impl IntoIterator<Item = (u64, u64, u64)>,
    ) -> Result<(), RejectReason> {
        self.grant_with(grant, Some((peer, op)), spans)
    }

    fn grant_with(
        &self,
        grant: &mut Grant,
        who: Option<(&str, Op)>,
        spans: impl IntoIterator<Item = (u64, u64, u64)>,
    ) -> Result<(), RejectReason> {
        grant.clear();
        if self.shared.closed.load(Ordering::Acquire) {
            return Err(RejectReason::ShuttingDown);
        }
        grant.op = who.map(|w| w.1);
        let result = self.shared.registry.pin_spans(
            &mut grant.pins,
            &mut grant.spans,
            &mut grant.exposed,
            who,
            spans,
        );
        if result.is_err() {
            grant.clear();
        }
        result
    }

    /// A live registration by id: its region, where it starts in the region and its length.
    /// Engines that hand memory to peers (such as `shm` passing a memfd) use it.
    pub fn registration(&self, id: u64) -> Option<(Region, u64, u64)> {
        self.shared.registry.lookup(id)
    }

    /// Queues a notification from peer `from` for the agent's user.
    pub fn notify(&self, from: &str, msg: Vec<u8>) {
        self.shared.notifications.push(from.to_owned(), msg);
    }

    /// Counts `bytes` of payload this engine copied into the destination of an `op`, for the
    /// agent's [`report`](crate::Agent::report). Count each byte once, where it lands (or
    /// where the one copy runs); a relaxed atomic add.
    pub fn count_copied(&self, op: Op, bytes: u64) {
        match op {
            Op::Write => self.shared.copied_write.add(bytes),
            Op::Read => self.shared.copied_read.add(bytes),
        }
    }

    /// Bytes a copy this agent's engine makes runs between offers of its core to other
    /// threads (see [`Agent::set_copy_slice`](crate::Agent::set_copy_slice)).
    pub fn copy_slice(&self) -> usize {
        self.shared.copy_slice.load(Ordering::Relaxed)
    }

    /// Counts a WRITE made inside a peer's standing ranges without asking for a grant, for the
    /// agent's [`report`](crate::Agent::report).
    pub fn count_standing_write(&self) {
        self.shared.standing_writes.add(1);
    }

    /// Whether the agent is shutting down.
    pub fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::Acquire)
    }

    /// An inbound link from peer `peer` is open: the peer counts as able to write into this
    /// agent's memory until the returned guard drops. Engines take it when a link is set up
    /// and drop it only after the link's reader returned (no grant of it is live any more).
    pub fn link_open(&self, peer: &str) -> LinkGuard {
        *self
            .shared
            .inbound
            .lock()
            .entry(peer.to_owned())
            .or_insert(0) += 1;
        LinkGuard {
            host: self.clone(),
            peer: peer.to_owned(),
        }
    }
}

/// An open inbound link, counted until dropped (see [`Host::link_open`]).
#[must_use = "the link counts as closed as soon as the guard drops"]
pub struct LinkGuard {
    host: Host,
    peer: String,
}

impl LinkGuard {
    /// Files the link under another peer name (engines that learn the name after accepting).
    pub fn rename(&mut self, peer: &str) {
        if peer == self.peer {
            return;
        }
        let mut map = self.host.shared.inbound.lock();
        forget(&mut map, &self.peer);
        *map.entry(peer.to_owned()).or_insert(0) += 1;
        self.peer = peer.to_owned();
    }
}

fn forget(map: &mut HashMap<String, usize>, peer: &str) {
    if let Some(n) = map.get_mut(peer) {
        *n -= 1;
        if *n == 0 {
            map.remove(peer);
        }
    }
}

impl Drop for LinkGuard {
    fn drop(&mut self) {
        forget(&mut self.host.shared.inbound.lock(), &self.peer);
    }
}

impl fmt::Debug for LinkGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LinkGuard")
            .field("peer", &self.peer)
            .finish()
    }
}

/// Registrations pinned for a peer's request, with the address of each span. Reusable:
/// [`Grant::clear`] keeps the allocation, so a steady stream of requests allocates nothing.
#[derive(Default)]
pub struct Grant {
    pub(crate) pins: Vec<Arc<RegEntry>>,
    pub(crate) spans: Vec<(usize, u64)>,
    /// Spans that lie in an exposure: the exposure, offset in the registration, length.
    pub(crate) exposed: Vec<(Arc<ExpState>, u64, u64)>,
    pub(crate) op: Option<Op>,
}

impl Grant {
    /// An empty grant.
    pub fn new() -> Self {
        Self::default()
    }

    /// Releases the pins, keeping capacity.
    pub fn clear(&mut self) {
        self.pins.clear();
        self.spans.clear();
        self.exposed.clear();
        self.op = None;
    }

    /// Records, for a granted WRITE, that every span landed: the exposures its spans lie in
    /// count those bytes as written. Call once the payload is in place (and only then); a
    /// READ's grant records nothing.
    pub fn mark_written(&self) {
        if self.op != Some(Op::Write) {
            return;
        }
        // Touching spans of one exposure (a batch's frames) are recorded as one range.
        let mut run: Option<(&Arc<ExpState>, u64, u64)> = None;
        for (e, offset, len) in &self.exposed {
            match &mut run {
                Some((r, _, end)) if Arc::ptr_eq(r, e) && *end == *offset => *end += *len,
                _ => {
                    if let Some((r, lo, hi)) = run.take() {
                        r.record(lo, hi - lo);
                    }
                    run = Some((e, *offset, *offset + *len));
                }
            }
        }
        if let Some((r, lo, hi)) = run {
            r.record(lo, hi - lo);
        }
    }

    /// Number of spans granted.
    pub fn len(&self) -> usize {
        self.spans.len()
    }

    /// Whether nothing is granted.
    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// Address and length of span `i`. The memory stays registered while the grant holds it.
    pub fn span(&self, i: usize) -> (*mut u8, u64) {
        let (addr, len) = self.spans[i];
        (addr as *mut u8, len)
    }

    /// Total bytes granted.
    pub fn bytes(&self) -> u64 {
        self.spans.iter().map(|s| s.1).sum()
    }
}

impl fmt::Debug for Grant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Grant")
            .field("spans", &self.spans.len())
            .field("bytes", &self.bytes())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exposure::{Ops, Scope};

    /// A WRITE's grant records each span in the exposure it lies in: touching spans of one
    /// exposure as one range, a span that does not follow the one before it, or lies in
    /// another exposure, on its own. A READ's grant records nothing.
    #[test]
    fn a_granted_write_records_each_span_in_its_own_exposure() {
        let scope = Arc::new(Scope::new(true));
        let a = scope.expose("p", 100, 40, Ops::READ_WRITE, None);
        let b = scope.expose("p", 140, 20, Ops::WRITE, None);
        let state = |offset, len| scope.check("p", Op::Write, offset, len).unwrap().unwrap();
        let (ea, eb) = (state(100, 40), state(140, 20));
        // Out of order, touching, and across the two exposures' common edge.
        let exposed = vec![
            (ea.clone(), 130, 10),
            (ea.clone(), 100, 10),
            (ea.clone(), 110, 10),
            (eb, 140, 10),
        ];
        let read = Grant {
            exposed: exposed.clone(),
            op: Some(Op::Read),
            ..Grant::default()
        };
        read.mark_written();
        assert_eq!((a.written(), b.written()), (0, 0), "a READ writes nothing");
        let write = Grant {
            exposed,
            op: Some(Op::Write),
            ..Grant::default()
        };
        write.mark_written();
        assert_eq!((a.written(), b.written()), (30, 10));
        // The bytes between the spans stay unwritten: writing them completes the exposure.
        let gap = Grant {
            exposed: vec![(ea, 120, 10)],
            op: Some(Op::Write),
            ..Grant::default()
        };
        gap.mark_written();
        assert!(a.is_fully_written());
    }
}
