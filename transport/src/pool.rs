//! A registered pool: one region registered once, carved into leased blocks by a
//! `tessera_alloc::SharedAllocator`.

use std::fmt;

use tessera_alloc::{Group, Layout, Lease, Report, SharedAllocator};

use crate::agent::{Agent, Registration};
use crate::desc::{KeepAlive, LocalDesc, RemoteDesc};
use crate::error::{DescError, PoolError, RegionError};
use crate::sync::Arc;
use crate::Region;

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

const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<RegisteredPool>();
    assert_send_sync::<PoolBlock>();
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
        Ok(Self {
            alloc: SharedAllocator::new(reg.len()),
            reg,
        })
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

    /// Capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.reg.len()
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

impl fmt::Debug for PoolBlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolBlock")
            .field("reg", &self.inner.reg.id())
            .field("offset", &self.offset())
            .field("len", &self.len())
            .finish()
    }
}
