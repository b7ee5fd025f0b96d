//! The thread-safe allocator and its RAII leases.

use std::fmt;

// The allocator's `Arc` is loom's under the model: its reference count is part of what the
// loom tests check (a lease outliving every other handle).
use crate::{AllocError, Allocator, Block, Group, Layout, Placement, Report};
use tessera_sync::{CheckedArc as Arc, Mutex, MutexGuard};

/// An [`Allocator`] shared between threads. Cloning it is cheap and shares the same ranges.
///
/// It hands out [`Lease`]s: owned guards that free their range when dropped, on any thread.
#[derive(Clone)]
pub struct SharedAllocator {
    inner: Arc<Mutex<Allocator>>,
}

/// A range leased from a [`SharedAllocator`]. Dropping it gives the range back.
///
/// Like tokio's `OwnedSemaphorePermit`, it owns a handle on its allocator, so it can be moved to
/// and dropped on any thread and outlive every other handle.
#[must_use = "dropping a lease frees its range at once"]
pub struct Lease {
    block: Option<Block>,
    offset: u64,
    size: u64,
    pool: Arc<Mutex<Allocator>>,
}

const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<SharedAllocator>();
    assert_send_sync::<Lease>();
    assert_send_sync::<Group<Lease>>();
};

impl SharedAllocator {
    /// A shared allocator over `[0, capacity)`.
    pub fn new(capacity: u64) -> Self {
        Self::from(Allocator::new(capacity))
    }

    fn lock(&self) -> MutexGuard<'_, Allocator> {
        // The allocator never panics while locked; should a caller's thread die while holding
        // the guard anyway, the bookkeeping is still consistent (the lock ignores poisoning).
        self.inner.lock()
    }

    fn wrap(&self, block: Block) -> Lease {
        Lease {
            offset: block.offset(),
            size: block.size(),
            block: Some(block),
            pool: self.inner.clone(),
        }
    }

    /// Leases `size` bytes aligned to `align`; see [`Allocator::allocate`].
    pub fn lease(&self, size: u64, align: u64) -> Result<Lease, AllocError> {
        let block = self.lock().allocate(size, align)?;
        Ok(self.wrap(block))
    }

    /// Leases a group of items as few blocks as possible; see [`Allocator::allocate_group`].
    pub fn lease_group(&self, items: &[Layout]) -> Result<Group<Lease>, AllocError> {
        let Group { blocks, placements } = self.lock().allocate_group(items)?;
        Ok(Group {
            blocks: blocks.into_iter().map(|b| self.wrap(b)).collect(),
            placements,
        })
    }

    /// Occupancy now.
    pub fn report(&self) -> Report {
        self.lock().report()
    }

    /// Bytes held by live blocks, and how many blocks: [`SharedAllocator::report`]'s `used`
    /// and `live_blocks` without its scan for the largest free range, for a caller that
    /// asks often.
    pub fn held(&self) -> (u64, u64) {
        let a = self.lock();
        (a.capacity() - a.free_bytes(), a.live_blocks())
    }

    /// Size of the managed range.
    pub fn capacity(&self) -> u64 {
        self.lock().capacity()
    }

    /// Whether `lease` came from this allocator (or one of its clones).
    pub fn owns(&self, lease: &Lease) -> bool {
        Arc::ptr_eq(&self.inner, &lease.pool)
    }
}

impl From<Allocator> for SharedAllocator {
    fn from(allocator: Allocator) -> Self {
        Self {
            inner: Arc::new(Mutex::new(allocator)),
        }
    }
}

impl fmt::Debug for SharedAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedAllocator")
            .field("report", &self.report())
            .finish()
    }
}

impl Lease {
    /// First byte of the leased range.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// One past the last byte.
    pub fn end(&self) -> u64 {
        self.offset + self.size
    }

    /// The leased range of offsets.
    pub fn range(&self) -> std::ops::Range<u64> {
        self.offset..self.end()
    }

    /// Keeps the first `size` bytes and gives the rest back at once ([`Allocator::shrink`]);
    /// a size at or above the lease's changes nothing.
    pub fn shrink(&mut self, size: u64) {
        if size >= self.size {
            return;
        }
        if let Some(block) = self.block.take() {
            let mut pool = self.pool.lock();
            match pool.shrink(block, size) {
                Ok(b) => {
                    self.size = b.size();
                    self.block = Some(b);
                }
                // The block came from this very allocator, so `shrink` cannot refuse it.
                Err(e) => self.block = Some(e.into_block()),
            }
        }
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("offset", &self.offset)
            .field("size", &self.size)
            .finish()
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(block) = self.block.take() {
            let mut pool = self.pool.lock();
            // The block came from this very allocator, so `free` cannot refuse it.
            let freed = pool.free(block);
            debug_assert!(freed.is_ok());
        }
    }
}

impl Group<Lease> {
    /// Where item `index` landed: its lease and its offset inside that lease, or `None` for a
    /// zero-size item (or an index out of range).
    pub fn item(&self, index: usize) -> Option<(&Lease, u64)> {
        let Placement { block, offset } = (*self.placements.get(index)?)?;
        Some((&self.blocks[block], offset))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_sync::{model, thread};

    #[test]
    fn lease_frees_on_drop_from_another_thread() {
        let shared = SharedAllocator::new(1 << 20);
        let lease = shared.lease(1000, 64).unwrap();
        assert_eq!(lease.offset() % 64, 0);
        assert!(shared.owns(&lease));
        assert!(!SharedAllocator::new(64).owns(&lease));
        std::thread::spawn(move || drop(lease)).join().unwrap();
        assert_eq!(shared.report().used, 0);
        assert_eq!(shared.report().free_ranges, 1);
    }

    #[test]
    fn held_is_the_reports_used_bytes_and_live_blocks() {
        let shared = SharedAllocator::new(1 << 20);
        let held = |s: &SharedAllocator| {
            let r = s.report();
            assert_eq!(s.held(), (r.used, r.live_blocks));
            r.used
        };
        assert_eq!(held(&shared), 0);
        let a = shared.lease(1000, 64).unwrap();
        let mut b = shared.lease(5000, 4096).unwrap();
        let _empty = shared.lease(0, 8).unwrap();
        assert_eq!(held(&shared), 6000);
        b.shrink(100);
        assert_eq!(held(&shared), 1100);
        drop(a);
        assert_eq!(shared.held(), (100, 1));
    }

    #[test]
    fn group_leases_outlive_the_allocator_handle() {
        let shared = SharedAllocator::new(4096);
        let items = [Layout::new(100, 4).unwrap(), Layout::new(0, 8).unwrap()];
        let group = shared.lease_group(&items).unwrap();
        let probe = shared.clone();
        drop(shared);
        let (lease, offset) = group.item(0).unwrap();
        assert_eq!((lease.size(), offset), (100, 0));
        assert!(group.item(1).is_none());
        drop(group);
        assert_eq!(probe.report().used, 0);
    }

    #[test]
    fn a_lease_names_its_range() {
        let shared = SharedAllocator::new(4096);
        let _first = shared.lease(100, 1).unwrap();
        let lease = shared.lease(50, 64).unwrap();
        let at = lease.offset();
        assert!(at >= 100 && at % 64 == 0, "{at}");
        assert_eq!(lease.size(), 50);
        assert_eq!(lease.end(), at + 50);
        assert_eq!(lease.range(), at..at + 50);
    }

    #[test]
    fn a_shrunk_lease_gives_its_tail_back() {
        let shared = SharedAllocator::new(4096);
        let mut lease = shared.lease(1000, 64).unwrap();
        let at = lease.offset();
        lease.shrink(100);
        assert_eq!((lease.offset(), lease.size()), (at, 100));
        assert_eq!(shared.report().used, 100);
        lease.shrink(200);
        assert_eq!(lease.size(), 100, "growing is not shrinking");
        lease.shrink(0);
        assert_eq!((lease.size(), shared.report().used), (0, 0));
        drop(lease);
        assert_eq!(shared.report().free_ranges, 1);
    }

    /// Leases taken and dropped on several threads are never handed out twice, never freed
    /// twice, and never lost.
    #[test]
    fn loom_leases_across_threads() {
        model(|| {
            let shared = SharedAllocator::new(64);
            let threads: Vec<_> = (0..2)
                .map(|t| {
                    let shared = shared.clone();
                    thread::spawn(move || {
                        let a = shared.lease(16 + t, 8).unwrap();
                        let b = shared.lease(8, 4).unwrap();
                        assert!(a.end() <= b.offset() || b.end() <= a.offset());
                        drop(a);
                        let c = shared.lease(8, 8).unwrap();
                        (b, c)
                    })
                })
                .collect();
            let mut held: Vec<Lease> = Vec::new();
            for t in threads {
                let (b, c) = t.join().unwrap();
                held.push(b);
                held.push(c);
            }
            held.sort_by_key(Lease::offset);
            for pair in held.windows(2) {
                assert!(pair[0].end() <= pair[1].offset(), "{held:?} overlap");
            }
            let report = shared.report();
            assert_eq!(report.used, held.iter().map(Lease::size).sum::<u64>());
            drop(held);
            let report = shared.report();
            assert_eq!(
                (report.used, report.free_ranges, report.live_blocks),
                (0, 1, 0)
            );
        });
    }

    /// Three threads racing on a pool that fits only two leases: every grant is disjoint and
    /// every refusal leaves the pool intact.
    #[test]
    fn loom_contended_pool_never_double_grants() {
        model(|| {
            let shared = SharedAllocator::new(32);
            let threads: Vec<_> = (0..3)
                .map(|_| {
                    let shared = shared.clone();
                    thread::spawn(move || shared.lease(16, 16).ok())
                })
                .collect();
            let granted: Vec<Lease> = threads
                .into_iter()
                .filter_map(|t| t.join().unwrap())
                .collect();
            assert!(!granted.is_empty() && granted.len() <= 2);
            if let [a, b] = &granted[..] {
                assert_ne!(a.offset(), b.offset());
            }
            drop(granted);
            assert_eq!(shared.report().free, 32);
        });
    }
}
