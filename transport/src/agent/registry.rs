//! The registration table and the guards on its entries.

use std::collections::HashMap;
use std::fmt;

use super::HostShared;
use crate::desc::{KeepAlive, LocalDesc, RemoteDesc};
use crate::engine::{Grant, RemoteReg, Transport};
use crate::error::{DescError, RejectReason};
use crate::interval::IntervalIndex;
use crate::sync::{lock, Arc, Mutex, Weak};
use crate::Region;

/// The registration table: by id for target-side validation, by range for the cache.
#[derive(Default)]
pub(crate) struct Registry {
    table: Mutex<Table>,
}

#[derive(Default)]
struct Table {
    /// Ids are our own counter, not peer input: the fast hasher is safe here.
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
    /// A live registration of `region` covering `offset..offset + len`.
    pub(super) fn find(&self, region: &Region, offset: u64, len: u64) -> Option<Arc<RegEntry>> {
        let (lo, hi) = addr_range(region.as_ptr().wrapping_add(offset as usize), len);
        let id = region.id();
        let t = lock(&self.table);
        // The region is checked before upgrading: an entry is never dropped under the lock.
        t.by_addr.find_covering(lo, hi, |reg| {
            let slot = t.by_id.get(&reg).filter(|s| s.region == id)?;
            slot.entry.upgrade()
        })
    }

    pub(crate) fn lookup(&self, id: u64) -> Option<(Region, u64, u64)> {
        let entry = lock(&self.table).live(id)?;
        // The lock is released before `entry` can drop.
        Some((entry.region.clone(), entry.offset, entry.len))
    }

    pub(super) fn insert(&self, entry: &Arc<RegEntry>) {
        let (lo, hi) = addr_range(entry.base(), entry.len);
        let mut t = lock(&self.table);
        t.by_id.insert(
            entry.id,
            Slot {
                entry: Arc::downgrade(entry),
                region: entry.region.id(),
            },
        );
        t.by_addr.insert(lo, hi, entry.id);
        t.bytes += entry.len;
    }

    fn remove(&self, entry: &RegEntry) {
        let (lo, _) = addr_range(entry.base(), entry.len);
        let mut t = lock(&self.table);
        t.by_id.remove(&entry.id);
        if t.by_addr.remove(lo, entry.id) {
            t.bytes -= entry.len;
        }
    }

    /// A live registration covering `addr..addr + len`.
    pub(super) fn find_addr(&self, addr: usize, len: u64) -> Option<Arc<RegEntry>> {
        let (lo, hi) = addr_range(addr as *const u8, len);
        let t = lock(&self.table);
        t.by_addr.find_covering(lo, hi, |id| t.live(id))
    }

    pub(super) fn remote_regs(&self) -> Vec<RemoteReg> {
        let t = lock(&self.table);
        let live: Vec<Arc<RegEntry>> = t.by_id.values().filter_map(|s| s.entry.upgrade()).collect();
        // An entry whose other owners let go meanwhile drops here, after the lock.
        drop(t);
        let mut regs: Vec<RemoteReg> = live
            .iter()
            .map(|e| RemoteReg {
                id: e.id,
                len: e.len,
                key: e.key.clone(),
            })
            .collect();
        drop(live);
        regs.sort_unstable_by_key(|r| r.id);
        regs
    }

    pub(super) fn stats(&self) -> (usize, u64) {
        let t = lock(&self.table);
        (t.by_addr.len(), t.bytes)
    }

    /// Pins every span's registration into `grant`. Never drops an `Arc<RegEntry>` while the
    /// table is locked (that would re-enter the lock from `RegEntry::drop`).
    pub(crate) fn pin_spans(
        &self,
        grant: &mut Grant,
        spans: impl IntoIterator<Item = (u64, u64, u64)>,
    ) -> Result<(), RejectReason> {
        let t = lock(&self.table);
        for (reg, offset, len) in spans {
            let entry = match grant.pins.last() {
                Some(last) if last.id == reg => last,
                _ => {
                    let found = t
                        .by_id
                        .get(&reg)
                        .and_then(|s| s.entry.upgrade())
                        .ok_or(RejectReason::UnknownRegistration)?;
                    grant.pins.push(found);
                    grant.pins.last().ok_or(RejectReason::Malformed)?
                }
            };
            if len == 0 {
                return Err(RejectReason::Malformed);
            }
            match offset.checked_add(len) {
                Some(end) if end <= entry.len => {}
                _ => return Err(RejectReason::OutOfRange),
            }
            grant
                .spans
                .push((entry.base() as usize + offset as usize, len));
        }
        Ok(())
    }
}

/// One live registration, shared by every guard, descriptor and in-flight transfer on it.
pub(crate) struct RegEntry {
    pub(crate) id: u64,
    pub(crate) agent_id: u64,
    pub(super) region: Region,
    pub(super) offset: u64,
    pub(crate) len: u64,
    pub(super) key: Vec<u8>,
    /// Where the registration is listed: `None` for a local-only registration
    /// ([`Agent::register_local`](super::Agent::register_local)), which its engine never saw and its agent's registry never
    /// held, so dropping it releases nothing but its memory.
    pub(super) listed: Option<Listed>,
}

/// The engine that registered an entry and the agent whose registry lists it.
pub(super) struct Listed {
    pub(super) transport: Arc<dyn Transport>,
    pub(super) host: Weak<HostShared>,
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
        if let Some(host) = listed.host.upgrade() {
            host.registry.remove(self);
        }
        listed.transport.deregister(self.id);
    }
}

/// A registration guard: a window onto a registered range. Cloning is cheap; the range is
/// deregistered when the last guard, descriptor and transfer on it are gone.
#[derive(Clone)]
#[must_use = "dropping the last guard deregisters the memory"]
pub struct Registration {
    pub(crate) entry: Arc<RegEntry>,
    /// Window start, relative to the registration.
    pub(super) start: u64,
    pub(super) len: u64,
}

impl Registration {
    /// The registration's id, as peers name it.
    pub fn id(&self) -> u64 {
        self.entry.id
    }

    /// Length of this window.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where this window starts inside the registration that peers see (non-zero when the
    /// cache answered with a larger registration).
    pub fn offset_in_registration(&self) -> u64 {
        self.start
    }

    /// The region this registration covers.
    pub fn region(&self) -> &Region {
        &self.entry.region
    }

    /// Address of the window's first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.entry.base().wrapping_add(self.start as usize)
    }

    fn window(&self, offset: u64, len: u64) -> Result<u64, DescError> {
        if len == 0 {
            return Err(DescError::Empty);
        }
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.start + offset),
            _ => Err(DescError::OutOfRange {
                reg: self.entry.id,
                offset,
                len,
                reg_len: self.len,
            }),
        }
    }

    /// A local descriptor of `len` bytes at `offset` in this window.
    pub fn desc(&self, offset: u64, len: u64) -> Result<LocalDesc, DescError> {
        Ok(LocalDesc {
            offset: self.window(offset, len)?,
            reg: self.entry.clone(),
            len,
            keep: None,
        })
    }

    /// Like [`Registration::desc`], also keeping `keep` alive as long as the descriptor and
    /// any transfer using it.
    pub fn desc_keeping(
        &self,
        offset: u64,
        len: u64,
        keep: KeepAlive,
    ) -> Result<LocalDesc, DescError> {
        let mut d = self.desc(offset, len)?;
        d.keep = Some(keep);
        Ok(d)
    }

    /// The same range as a peer names it, to send to the peer.
    pub fn remote(&self, offset: u64, len: u64) -> Result<RemoteDesc, DescError> {
        Ok(RemoteDesc::new(
            self.entry.id,
            self.window(offset, len)?,
            len,
        ))
    }
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registration")
            .field("id", &self.entry.id)
            .field("start", &self.start)
            .field("len", &self.len)
            .finish()
    }
}

/// A peer's registrations as its latest metadata announced them: id -> length.
pub(crate) struct RegTable {
    lens: HashMap<u64, u64>,
}

impl RegTable {
    pub(super) fn new(regs: &[RemoteReg]) -> Self {
        Self {
            lens: regs.iter().map(|r| (r.id, r.len)).collect(),
        }
    }

    pub(crate) fn len_of(&self, id: u64) -> Option<u64> {
        self.lens.get(&id).copied()
    }
}
