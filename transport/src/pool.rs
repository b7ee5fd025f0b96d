//! A registered pool: one region registered once, carved into leased blocks by a
//! `tessera_alloc::SharedAllocator`.

use std::fmt;

use tessera_alloc::{Group, Layout, Lease, Report, SharedAllocator};

use crate::agent::{Agent, Registration};
use crate::desc::{KeepAlive, LocalDesc, RemoteDesc};
use crate::error::{DescError, PoolError, RegionError};
use crate::exposure::{Exposure, Ops};
use crate::Region;
use tessera_sync::Arc;

/// A region registered once with an agent, handing out [`PoolBlock`]s. Registering large
/// regions once and carving blocks out of them is what keeps engines fast: no per-block
/// registration ever happens.
#[derive(Clone)]
pub struct RegisteredPool {
    reg: Registration,
    alloc: SharedAllocator,
}

/// A block leased from a [`RegisteredPool`]. It knows its registration and descriptors; its
/// range returns to the pool when the block, every descriptor made from it and every transfer
/// using those descriptors are gone (deferred release).
#[must_use = "dropping a block returns it to the pool"]
pub struct PoolBlock {
    inner: Arc<BlockInner>,
}

struct BlockInner {
    lease: Lease,
    reg: Registration,
}

/// A pool block that nothing in this process can write any more: it was the last handle on its
/// block (no descriptor, transfer or clone of it was alive), and it offers no way to make one.
/// It reads as `&[u8]` safely, so it can own a `bytes::Bytes` (`Bytes::from_owner`), whose
/// slices then keep the block leased; the block returns to its pool when the last one drops.
///
/// Like any registered memory, it stays reachable by a peer that forges a descriptor of the
/// pool's registration; memory handed to untrusted peers belongs in its own registration.
#[must_use = "dropping a frozen block returns it to the pool"]
pub struct FrozenBlock {
    inner: Arc<BlockInner>,
}

const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<RegisteredPool>();
    assert_send_sync::<PoolBlock>();
    assert_send_sync::<FrozenBlock>();
};

impl RegisteredPool {
    /// A pool of `capacity` bytes in a fresh memfd-backed region, registered with `agent`.
    pub fn new(agent: &Agent, capacity: u64) -> Result<Self, PoolError> {
        let region = Region::memfd("tessera-pool", capacity)?;
        Self::with_region(agent, &region)
    }

    /// A pool over an existing region, registered with `agent`.
    pub fn with_region(agent: &Agent, region: &Region) -> Result<Self, PoolError> {
        let reg = agent.register(region)?;
        Ok(Self::over(reg))
    }

    /// Like [`RegisteredPool::new`], registered scoped: peers reach a block only through
    /// its [`PoolBlock::expose`].
    pub fn new_scoped(agent: &Agent, capacity: u64) -> Result<Self, PoolError> {
        let region = Region::memfd("tessera-pool", capacity)?;
        Self::with_region_scoped(agent, &region)
    }

    /// Like [`RegisteredPool::with_region`], registered scoped
    /// ([`Agent::register_scoped`]).
    pub fn with_region_scoped(agent: &Agent, region: &Region) -> Result<Self, PoolError> {
        let reg = agent.register_scoped(region)?;
        Ok(Self::over(reg))
    }

    fn over(reg: Registration) -> Self {
        Self {
            alloc: SharedAllocator::new(reg.len()),
            reg,
        }
    }

    /// Leases `size` bytes aligned to `align` (relative to the region start, which is
    /// page-aligned for owned regions).
    pub fn lease(&self, size: u64, align: u64) -> Result<PoolBlock, PoolError> {
        let lease = self.alloc.lease(size, align)?;
        Ok(self.wrap(lease))
    }

    /// Leases a group of items packed into as few blocks as possible; see
    /// `tessera_alloc::SharedAllocator::lease_group`.
    pub fn lease_group(&self, items: &[Layout]) -> Result<Group<PoolBlock>, PoolError> {
        let Group { blocks, placements } = self.alloc.lease_group(items)?;
        Ok(Group {
            blocks: blocks.into_iter().map(|l| self.wrap(l)).collect(),
            placements,
        })
    }

    fn wrap(&self, lease: Lease) -> PoolBlock {
        PoolBlock {
            inner: Arc::new(BlockInner {
                lease,
                reg: self.reg.clone(),
            }),
        }
    }

    /// The pool's registration.
    pub fn registration(&self) -> &Registration {
        &self.reg
    }

    /// Occupancy of the pool's allocator.
    pub fn report(&self) -> Report {
        self.alloc.report()
    }

    /// Bytes held by live blocks and how many blocks ([`SharedAllocator::held`]).
    pub fn held(&self) -> (u64, u64) {
        self.alloc.held()
    }

    /// Capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.reg.len()
    }

    /// Faults every page of the pool's memory in for writing, as an RDMA registration pins
    /// them, so that no transfer into the pool pays for a first touch (on a VM, where the
    /// host backs fresh memory on demand, several microseconds per page). The pool's memory is
    /// then resident in full. Contents are unchanged; memory the pool did not map itself
    /// ([`RegisteredPool::with_region`] over foreign memory) is left as it is.
    pub fn populate(&self) -> Result<(), PoolError> {
        Ok(self.reg.region().populate()?)
    }
}

impl fmt::Debug for RegisteredPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegisteredPool")
            .field("reg", &self.reg)
            .field("report", &self.report())
            .finish()
    }
}

impl PoolBlock {
    /// Offset of the block in the pool's registration window.
    pub fn offset(&self) -> u64 {
        self.inner.lease.offset()
    }

    /// Size in bytes (may be zero for an empty lease).
    pub fn len(&self) -> u64 {
        self.inner.lease.size()
    }

    /// Whether the block is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Address of the first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.inner.reg.as_ptr().wrapping_add(self.offset() as usize)
    }

    /// The registration the block lives in.
    pub fn registration(&self) -> &Registration {
        &self.inner.reg
    }

    /// A descriptor of the whole block; it keeps the block leased.
    pub fn desc(&self) -> Result<LocalDesc, DescError> {
        self.desc_range(0, self.len())
    }

    /// A descriptor of `len` bytes at `offset` in the block; it keeps the block leased.
    pub fn desc_range(&self, offset: u64, len: u64) -> Result<LocalDesc, DescError> {
        self.check(offset, len)?;
        let keep: KeepAlive = self.inner.clone();
        self.inner
            .reg
            .desc_keeping(self.offset() + offset, len, keep)
    }

    /// Lets peer `peer` touch the whole block with `ops` until the returned [`Exposure`]
    /// drops (the block stays leased meanwhile); see [`Registration::expose`]. An empty
    /// block's exposure allows nothing.
    pub fn expose(&self, peer: &str, ops: Ops) -> Exposure {
        let keep: KeepAlive = self.inner.clone();
        match self
            .inner
            .reg
            .expose_keeping(peer, self.offset(), self.len(), ops, keep.clone())
        {
            Ok(e) => e,
            // Only an empty block's range is refused: expose nothing, at its offset.
            Err(_) => self.inner.reg.entry.scope.expose(
                peer,
                self.inner.reg.start + self.offset(),
                0,
                ops,
                Some(keep),
            ),
        }
    }

    /// The whole block as a peer names it.
    pub fn remote(&self) -> Result<RemoteDesc, DescError> {
        self.remote_range(0, self.len())
    }

    /// `len` bytes at `offset` in the block as a peer names them.
    pub fn remote_range(&self, offset: u64, len: u64) -> Result<RemoteDesc, DescError> {
        self.check(offset, len)?;
        self.inner.reg.remote(self.offset() + offset, len)
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), DescError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() && len > 0 => Ok(()),
            _ if len == 0 => Err(DescError::Empty),
            _ => Err(DescError::OutOfRange {
                reg: self.inner.reg.id(),
                offset,
                len,
                reg_len: self.len(),
            }),
        }
    }

    fn region_offset(&self, offset: u64, len: usize) -> Result<u64, RegionError> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.len() => Ok(self.inner.reg.as_ptr() as u64
                - self.inner.reg.region().as_ptr() as u64
                + self.offset()
                + offset),
            _ => Err(RegionError::OutOfRange {
                offset,
                len: len as u64,
                region_len: self.len(),
            }),
        }
    }

    /// Copies `data` into the block at `offset`.
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), RegionError> {
        let at = self.region_offset(offset, data.len())?;
        self.inner.reg.region().write_at(at, data)
    }

    /// Copies bytes at `offset` of the block into `out`.
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<(), RegionError> {
        let at = self.region_offset(offset, out.len())?;
        self.inner.reg.region().read_at(at, out)
    }

    /// The block as a slice.
    ///
    /// # Safety
    /// No transfer, peer or other thread may write the block while the slice lives.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the block lies inside the registered region, which stays mapped while
        // `self` holds the registration; the caller promises nobody writes it meanwhile.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len() as usize) }
    }
}

impl PoolBlock {
    /// Keeps the block's first `len` bytes and gives the rest back to the pool at once, if
    /// this is its last handle (as [`PoolBlock::freeze`] asks); a block leased for the most a
    /// request might need is trimmed to what it used. Returns `false`, changing nothing,
    /// while a descriptor, exposure or transfer of the block is alive.
    pub fn shrink(&mut self, len: u64) -> bool {
        match Arc::get_mut(&mut self.inner) {
            Some(inner) => {
                inner.lease.shrink(len);
                true
            }
            None => false,
        }
    }

    /// Turns the block into read-only bytes, if this is its last handle: no descriptor made
    /// from it and no transfer using it is still alive (a finished transfer has released its
    /// hold). Otherwise the block comes back unchanged.
    pub fn freeze(mut self) -> Result<FrozenBlock, PoolBlock> {
        if Arc::get_mut(&mut self.inner).is_some() {
            Ok(FrozenBlock { inner: self.inner })
        } else {
            Err(self)
        }
    }
}

impl FrozenBlock {
    /// Offset of the block in the pool's registration window.
    pub fn offset(&self) -> u64 {
        self.inner.lease.offset()
    }

    /// Size in bytes.
    pub fn len(&self) -> u64 {
        self.inner.lease.size()
    }

    /// Whether the block is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The registration the block lives in.
    pub fn registration(&self) -> &Registration {
        &self.inner.reg
    }
}

impl AsRef<[u8]> for FrozenBlock {
    fn as_ref(&self) -> &[u8] {
        let ptr = self.inner.reg.as_ptr().wrapping_add(self.offset() as usize);
        // SAFETY: the block lies inside the registered region, which stays mapped while
        // `self` holds the registration, and is leased to `self` alone until it drops.
        // `freeze` proved no descriptor, transfer or other handle on the block existed, and a
        // frozen block can make none, so nothing in this process writes these bytes while the
        // slice lives; peers reach pool memory only through descriptors they were given.
        unsafe { std::slice::from_raw_parts(ptr, self.len() as usize) }
    }
}

impl fmt::Debug for FrozenBlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FrozenBlock")
            .field("reg", &self.inner.reg.id())
            .field("offset", &self.offset())
            .field("len", &self.len())
            .finish()
    }
}

impl fmt::Debug for PoolBlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolBlock")
            .field("reg", &self.inner.reg.id())
            .field("offset", &self.offset())
            .field("len", &self.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Inproc;

    #[test]
    fn freeze_needs_the_last_handle_and_returns_the_block_on_drop() {
        let agent = Agent::new("a", Inproc::new()).unwrap();
        let pool = RegisteredPool::new(&agent, 4096).unwrap();
        let block = pool.lease(16, 8).unwrap();
        block.write_at(0, b"0123456789abcdef").unwrap();
        let desc = block.desc().unwrap();
        let block = block
            .freeze()
            .expect_err("a descriptor still holds the block");
        drop(desc);
        let frozen = block.freeze().expect("last handle");
        assert_eq!(frozen.as_ref(), b"0123456789abcdef");
        assert_eq!(pool.report().used, 16);
        drop(frozen);
        assert_eq!(pool.report().used, 0);
    }

    /// A block shrinks only as its last handle; it keeps its first bytes, and the pool can
    /// lease the tail again at once.
    #[test]
    fn shrink_needs_the_last_handle_and_frees_the_tail() {
        let agent = Agent::new("a", Inproc::new()).unwrap();
        let pool = RegisteredPool::new(&agent, 4096).unwrap();
        let mut block = pool.lease(4096, 8).unwrap();
        block.write_at(0, b"keep").unwrap();
        let desc = block.desc().unwrap();
        assert!(!block.shrink(64), "a descriptor still holds the block");
        assert_eq!(block.len(), 4096);
        drop(desc);
        assert!(block.shrink(64));
        assert_eq!((block.offset(), block.len()), (0, 64));
        assert_eq!(pool.report().used, 64);
        let tail = pool.lease(4032, 1).expect("the tail is free");
        assert_eq!(tail.offset(), 64);
        let frozen = block.freeze().expect("last handle");
        assert_eq!(&frozen.as_ref()[..4], b"keep");
    }

    /// Pages of the pool's mapping that are resident.
    fn resident_pages(pool: &RegisteredPool) -> usize {
        let len = pool.capacity() as usize;
        tessera_testkit::resident_pages(pool.registration().as_ptr(), len).0
    }

    /// A fresh pool has no page resident; once populated, every page is, and what was
    /// written stays.
    #[test]
    fn populate_faults_the_whole_pool_in() {
        let agent = Agent::new("a", Inproc::new()).unwrap();
        let pool = RegisteredPool::new(&agent, 64 << 12).unwrap();
        let block = pool.lease(4, 1).unwrap();
        block.write_at(0, b"kept").unwrap();
        assert_eq!(resident_pages(&pool), 1);
        pool.populate().unwrap();
        assert_eq!(resident_pages(&pool), 64);
        let mut out = [0u8; 4];
        block.read_at(0, &mut out).unwrap();
        assert_eq!(&out, b"kept");
    }

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8).collect()
    }

    /// A range of a block that is not the pool's first starts at the block's offset plus the
    /// range's, as a local and as a remote descriptor, and a transfer from it moves exactly
    /// those bytes.
    #[test]
    fn a_block_range_starts_at_the_block_plus_its_offset() {
        let a = Agent::new("a", Inproc::new()).unwrap();
        let b = Agent::new("b", Inproc::new()).unwrap();
        let pool = RegisteredPool::new(&a, 1 << 16).unwrap();
        let first = pool.lease(4096, 4096).unwrap();
        let block = pool.lease(4096, 4096).unwrap();
        assert!(block.offset() > 0);
        first.write_at(0, &[0xEE; 4096]).unwrap();
        block.write_at(0, &pattern(4096)).unwrap();
        let whole = block.desc().unwrap();
        let local = block.desc_range(100, 50).unwrap();
        let remote = block.remote_range(100, 50).unwrap();
        assert_eq!(
            (local.reg(), local.offset(), local.len()),
            (whole.reg(), whole.offset() + 100, 50)
        );
        assert_eq!(local.to_remote(), remote);
        let inbox = Region::new(4096).unwrap();
        let g = b.register(&inbox).unwrap();
        let peer = a.add_remote(&b.metadata()).unwrap();
        peer.write(&[local], &[g.remote(0, 50).unwrap()], None)
            .unwrap()
            .wait_timeout(crate::TEST_WAIT)
            .unwrap();
        let mut got = [0u8; 50];
        inbox.read_at(0, &mut got).unwrap();
        assert_eq!(got[..], pattern(4096)[100..150]);
    }

    /// A range must lie inside its block: one that runs past the block's end (into the next
    /// block of the same registration) is out of range, an empty one is refused, for local
    /// and remote descriptors alike.
    #[test]
    fn a_block_range_must_lie_inside_the_block() {
        let a = Agent::new("a", Inproc::new()).unwrap();
        let pool = RegisteredPool::new(&a, 1 << 16).unwrap();
        let block = pool.lease(4096, 4096).unwrap();
        let _next = pool.lease(4096, 4096).unwrap();
        let (reg, n) = (block.registration().id(), block.len());
        for (offset, len) in [(n - 96, 200), (n, 1), (0, n + 1), (u64::MAX, 2)] {
            let out_of_range = |e: DescError| {
                matches!(e, DescError::OutOfRange { reg: r, offset: o, len: l, reg_len }
                    if (r, o, l, reg_len) == (reg, offset, len, n))
            };
            assert!(out_of_range(block.desc_range(offset, len).unwrap_err()));
            assert!(out_of_range(block.remote_range(offset, len).unwrap_err()));
        }
        assert!(matches!(block.desc_range(8, 0), Err(DescError::Empty)));
        assert!(matches!(block.remote_range(n, 0), Err(DescError::Empty)));
        assert_eq!(block.desc_range(n - 1, 1).unwrap().len(), 1);
        assert_eq!(block.remote_range(0, n).unwrap().len, n);
    }

    /// `write_at` and `read_at` address the block, not the pool: bytes written at an offset
    /// of a block that is not the pool's first read back there and leave transfers from that
    /// range, the blocks around it keep theirs, and an access past the block's end is out of
    /// range even where the pool goes on.
    #[test]
    fn block_reads_and_writes_stay_inside_the_block() {
        let a = Agent::new("a", Inproc::new()).unwrap();
        let b = Agent::new("b", Inproc::new()).unwrap();
        let pool = RegisteredPool::new(&a, 1 << 16).unwrap();
        let first = pool.lease(4096, 4096).unwrap();
        let block = pool.lease(4096, 4096).unwrap();
        let next = pool.lease(4096, 4096).unwrap();
        let n = block.len();
        first.write_at(0, &[0xEE; 4096]).unwrap();
        next.write_at(0, &[0xDD; 4096]).unwrap();
        block.write_at(100, b"tensor").unwrap();
        let mut got = [0u8; 6];
        block.read_at(100, &mut got).unwrap();
        assert_eq!(&got, b"tensor");
        let inbox = Region::new(4096).unwrap();
        let g = b.register(&inbox).unwrap();
        let peer = a.add_remote(&b.metadata()).unwrap();
        peer.write(
            &[block.desc_range(100, 6).unwrap()],
            &[g.remote(0, 6).unwrap()],
            None,
        )
        .unwrap()
        .wait_timeout(crate::TEST_WAIT)
        .unwrap();
        inbox.read_at(0, &mut got).unwrap();
        assert_eq!(&got, b"tensor");
        for (offset, len) in [(n - 2, 4u64), (n, 1), (u64::MAX, 2)] {
            let out_of_range = |e: RegionError| {
                matches!(e, RegionError::OutOfRange { offset: o, len: l, region_len }
                    if (o, l, region_len) == (offset, len, n))
            };
            let data = vec![0xAB; len as usize];
            assert!(out_of_range(block.write_at(offset, &data).unwrap_err()));
            let mut out = vec![0u8; len as usize];
            assert!(out_of_range(block.read_at(offset, &mut out).unwrap_err()));
        }
        block.write_at(n - 4, b"last").unwrap();
        let mut around = vec![0u8; 4096];
        first.read_at(0, &mut around).unwrap();
        assert!(around.iter().all(|&x| x == 0xEE));
        next.read_at(0, &mut around).unwrap();
        assert!(around.iter().all(|&x| x == 0xDD));
    }
}
