//! An agent's registration table and its entries: what target-side validation, the
//! registration cache and address lookups ask. The guards users hold are
//! [`Registration`](crate::Registration)s, over these entries.

use std::collections::HashMap;

use crate::error::RejectReason;
use crate::exposure::{ExpState, Scope};
use crate::interval::IntervalIndex;
use crate::transfer::Op;
use crate::Region;
use tessera_sync::{Arc, Mutex, Weak};

/// The registration table: by id for target-side validation, by range for the cache.
#[derive(Default)]
pub(crate) struct Registry {
    table: Mutex<Table>,
}

#[derive(Default)]
struct Table {
    /// Ids are our own random numbers, not peer input: the fast hasher is safe here.
    by_id: HashMap<u64, Slot, rustc_hash::FxBuildHasher>,
    /// Address ranges of the live registrations. The cache's question "a registration of
    /// this region covering this range?" is asked here too, as the range's addresses with
    /// the region's id checked, so one index serves both lookups.
    by_addr: IntervalIndex,
    /// Bytes the live registrations cover.
    bytes: u64,
}

struct Slot {
    entry: Weak<RegEntry>,
    region: u64,
    scoped: bool,
}

/// The address range `base..base + len` as index keys.
fn addr_range(base: *const u8, len: u64) -> (u64, u64) {
    let lo = base as usize as u64;
    (lo, lo.saturating_add(len))
}

impl Table {
    /// Entry `id` if it is live (one whose last owner is dropping it is not).
    fn live(&self, id: u64) -> Option<Arc<RegEntry>> {
        self.by_id.get(&id).and_then(|s| s.entry.upgrade())
    }
}

impl Registry {
    /// A fresh registration id: random (a peer cannot guess another's), non-zero, and unused
    /// in this table.
    pub(crate) fn fresh_id(&self) -> u64 {
        loop {
            let id = crate::auth::random_u64();
            if !self.table.lock().by_id.contains_key(&id) {
                return id;
            }
        }
    }

    /// A live, unscoped registration of `region` covering `offset..offset + len` (a scoped
    /// one is never shared through the cache).
    pub(crate) fn find_unscoped(
        &self,
        region: &Region,
        offset: u64,
        len: u64,
    ) -> Option<Arc<RegEntry>> {
        let (lo, hi) = addr_range(region.as_ptr().wrapping_add(offset as usize), len);
        let id = region.id();
        let t = self.table.lock();
        // The region is checked before upgrading: an entry is never dropped under the lock.
        t.by_addr.find_covering(lo, hi, |reg| {
            let slot = t.by_id.get(&reg).filter(|s| s.region == id && !s.scoped)?;
            slot.entry.upgrade()
        })
    }

    pub(crate) fn lookup(&self, id: u64) -> Option<(Region, u64, u64)> {
        let entry = self.table.lock().live(id)?;
        // The lock is released before `entry` can drop.
        Some((entry.region.clone(), entry.offset, entry.len))
    }

    pub(crate) fn insert(&self, entry: &Arc<RegEntry>) {
        let (lo, hi) = addr_range(entry.base(), entry.len);
        let mut t = self.table.lock();
        t.by_id.insert(
            entry.id,
            Slot {
                entry: Arc::downgrade(entry),
                region: entry.region.id(),
                scoped: entry.scope.enforced,
            },
        );
        t.by_addr.insert(lo, hi, entry.id);
        t.bytes += entry.len;
    }

    fn remove(&self, entry: &RegEntry) {
        let (lo, _) = addr_range(entry.base(), entry.len);
        let mut t = self.table.lock();
        t.by_id.remove(&entry.id);
        if t.by_addr.remove(lo, entry.id) {
            t.bytes -= entry.len;
        }
    }

    /// A live registration covering `addr..addr + len`.
    pub(crate) fn find_addr(&self, addr: usize, len: u64) -> Option<Arc<RegEntry>> {
        let (lo, hi) = addr_range(addr as *const u8, len);
        let t = self.table.lock();
        t.by_addr.find_covering(lo, hi, |id| t.live(id))
    }

    /// Every live registration as (id, length, remote key), by id.
    pub(crate) fn remote_regs(&self) -> Vec<(u64, u64, Vec<u8>)> {
        let t = self.table.lock();
        let live: Vec<Arc<RegEntry>> = t.by_id.values().filter_map(|s| s.entry.upgrade()).collect();
        // An entry whose other owners let go meanwhile drops here, after the lock.
        drop(t);
        let mut regs: Vec<(u64, u64, Vec<u8>)> =
            live.iter().map(|e| (e.id, e.len, e.key.clone())).collect();
        drop(live);
        regs.sort_unstable_by_key(|r| r.0);
        regs
    }

    pub(crate) fn stats(&self) -> (usize, u64) {
        let t = self.table.lock();
        (t.by_addr.len(), t.bytes)
    }

    /// Pins every span's registration into `grant`. Never drops an `Arc<RegEntry>` while the
    /// table is locked (that would re-enter the lock from `RegEntry::drop`).
    ///
    /// A span of a scoped registration is granted only inside an exposure to `peer` for
    /// `op` (none without a peer name); each span that lies in an exposure is listed in
    /// `exposed`, to record what a WRITE covered.
    pub(crate) fn pin_spans(
        &self,
        pins: &mut Vec<Arc<RegEntry>>,
        out: &mut Vec<(usize, u64)>,
        exposed: &mut Vec<(Arc<ExpState>, u64, u64)>,
        who: Option<(&str, Op)>,
        spans: impl IntoIterator<Item = (u64, u64, u64)>,
    ) -> Result<(), RejectReason> {
        let t = self.table.lock();
        let mut last_exposed: Option<u64> = None;
        for (reg, offset, len) in spans {
            let entry = match pins.last() {
                Some(last) if last.id == reg => last,
                _ => {
                    let found = t
                        .by_id
                        .get(&reg)
                        .and_then(|s| s.entry.upgrade())
                        .ok_or(RejectReason::UnknownRegistration)?;
                    pins.push(found);
                    pins.last().ok_or(RejectReason::Malformed)?
                }
            };
            if len == 0 {
                return Err(RejectReason::Malformed);
            }
            match offset.checked_add(len) {
                Some(end) if end <= entry.len => {}
                _ => return Err(RejectReason::OutOfRange),
            }
            // Consecutive spans in one exposure of one registration (a batch's frames,
            // merged into one exposed range) reuse the previous span's lookup.
            let reuse = match (who, exposed.last()) {
                (Some((_, op)), Some((e, _, _))) if last_exposed == Some(reg) => {
                    e.covers(op, offset, len).then(|| e.clone())
                }
                _ => None,
            };
            if let Some(e) = reuse {
                exposed.push((e, offset, len));
                out.push((entry.base() as usize + offset as usize, len));
                continue;
            }
            match who {
                Some((peer, op)) => match entry.scope.check(peer, op, offset, len) {
                    Ok(Some(e)) => {
                        exposed.push((e, offset, len));
                        last_exposed = Some(reg);
                    }
                    Ok(None) => {}
                    Err(()) => return Err(RejectReason::NotExposed),
                },
                None if entry.scope.enforced => return Err(RejectReason::NotExposed),
                None => {}
            }
            out.push((entry.base() as usize + offset as usize, len));
        }
        Ok(())
    }
}

/// One live registration, shared by every guard, descriptor and in-flight transfer on it.
pub(crate) struct RegEntry {
    pub(crate) id: u64,
    pub(crate) agent_id: u64,
    pub(crate) region: Region,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) key: Vec<u8>,
    /// Its exposures, and whether requests outside them are refused.
    pub(crate) scope: Arc<Scope>,
    /// Where the registration is listed: `None` for a local-only registration
    /// ([`Agent::register_local`](crate::Agent::register_local)), which its engine never saw and its agent's registry never
    /// held, so dropping it releases nothing but its memory.
    pub(crate) listed: Option<Listed>,
}

/// The engine that registered an entry and the registry that lists it.
pub(crate) struct Listed {
    pub(crate) engine: Arc<dyn ListedEngine>,
    pub(crate) registry: Weak<Registry>,
}

/// A listed entry's engine, as the entry reaches it: `Transport::deregister` when its last
/// holder drops it, `Transport::standing` when one of its standing exposures comes or goes
/// (each agent builds one, over its engine).
pub(crate) trait ListedEngine: Send + Sync {
    fn deregister(&self, id: u64);
    fn standing(&self, peer: &str, grant: crate::engine::Standing, live: bool);
    fn spin_for_writes(
        &self,
        peer: &str,
        window: std::time::Duration,
        done: &mut dyn FnMut() -> bool,
    ) -> bool;
    fn watch_writes(&self, peer: &str) -> crate::engine::WriteWatch;
}

impl RegEntry {
    pub(crate) fn base(&self) -> *mut u8 {
        self.region.as_ptr().wrapping_add(self.offset as usize)
    }
}

impl Drop for RegEntry {
    fn drop(&mut self) {
        let Some(listed) = &self.listed else {
            return;
        };
        if let Some(registry) = listed.registry.upgrade() {
            registry.remove(self);
        }
        listed.engine.deregister(self.id);
    }
}

#[cfg(test)]
mod tests {
    use crate::{Agent, Inproc, Region};

    /// The cache never hands a scoped registration to an unscoped `register` of the same
    /// memory, nor an unscoped one to `register_scoped`.
    #[test]
    fn the_cache_keeps_scoped_and_unscoped_registrations_apart() {
        let a = Agent::new("a", Inproc::new()).unwrap();
        let r = Region::new(1 << 16).unwrap();
        let scoped = a.register_scoped(&r).unwrap();
        let plain = a.register(&r).unwrap();
        assert_ne!(plain.id(), scoped.id());
        assert_eq!(a.register(&r).unwrap().id(), plain.id());
        assert_ne!(a.register_scoped(&r).unwrap().id(), plain.id());
    }

    /// The registered bytes the agent reports fall by a registration's length when it goes.
    #[test]
    fn registered_bytes_fall_as_registrations_go() {
        let a = Agent::new("a", Inproc::new()).unwrap();
        let r1 = Region::new(1 << 16).unwrap();
        let r2 = Region::new(1 << 12).unwrap();
        let g1 = a.register(&r1).unwrap();
        let g2 = a.register(&r2).unwrap();
        let report = a.report();
        assert_eq!(
            (report.registrations, report.registered_bytes),
            (2, (1 << 16) + (1 << 12))
        );
        drop(g1);
        let report = a.report();
        assert_eq!(
            (report.registrations, report.registered_bytes),
            (1, 1 << 12)
        );
        drop(g2);
        let report = a.report();
        assert_eq!((report.registrations, report.registered_bytes), (0, 0));
    }
}
