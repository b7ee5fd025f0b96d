//! Test support, not part of the crate's contract: heap memory for driving the protocol core
//! ([`Unit`](crate::core::Unit)) without a transport or a registered pool. The crate's own
//! unit and loom tests and its integration tests share it.

use bytes::Bytes;
use tessera_transport::RemoteDesc;

use crate::core::{Memory, PoolStats};
use crate::error::MemoryError;
use crate::sync::{Arc, AtomicU64, Ordering};

/// Heap memory that counts the bytes of its live blocks and refuses a lease past its
/// capacity. Every block is named to peers as registration 1 at the block's offsets. Clones
/// share the count.
#[derive(Clone)]
pub struct VecMem {
    live: Arc<AtomicU64>,
    cap: u64,
}

impl VecMem {
    /// Memory that leases at most `cap` bytes at once.
    pub fn new(cap: u64) -> Self {
        Self {
            live: Arc::new(AtomicU64::new(0)),
            cap,
        }
    }

    /// Bytes in blocks not yet dropped.
    pub fn live(&self) -> u64 {
        self.live.load(Ordering::SeqCst)
    }
}

/// A block of [`VecMem`]; dropping it gives its bytes back to the count.
pub struct VecBlock {
    buf: Vec<u8>,
    live: Arc<AtomicU64>,
}

impl Drop for VecBlock {
    fn drop(&mut self) {
        self.live.fetch_sub(self.buf.len() as u64, Ordering::SeqCst);
    }
}

impl AsRef<[u8]> for VecBlock {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Memory for VecMem {
    type Block = VecBlock;
    fn lease(&mut self, size: u64, align: u64) -> Result<VecBlock, MemoryError> {
        if self.live().saturating_add(size) > self.cap {
            let free = self.cap.saturating_sub(self.live());
            return Err(tessera_alloc::AllocError::OutOfMemory {
                requested: size,
                align,
                free,
                largest_free: free,
            }
            .into());
        }
        self.live.fetch_add(size, Ordering::SeqCst);
        Ok(VecBlock {
            buf: vec![0; size as usize],
            live: self.live.clone(),
        })
    }
    type Dest = RemoteDesc;
    fn dest(&self, block: &VecBlock, offset: u64, len: u64) -> Result<RemoteDesc, MemoryError> {
        self.remote(block, offset, len)
    }
    fn remote(&self, _block: &VecBlock, offset: u64, len: u64) -> Result<RemoteDesc, MemoryError> {
        Ok(RemoteDesc::new(1, offset, len))
    }
    fn freeze(&self, block: VecBlock, len: u64) -> Bytes {
        Bytes::from_owner(block).slice(..len as usize)
    }
    fn block_len(block: &VecBlock) -> u64 {
        block.buf.len() as u64
    }
    fn copy_in(&mut self, data: &[u8], align: u64) -> Result<Bytes, MemoryError> {
        let mut block = self.lease(data.len() as u64, align)?;
        block.buf.copy_from_slice(data);
        Ok(Bytes::from_owner(block))
    }
    fn usage(&self) -> PoolStats {
        PoolStats {
            capacity: self.cap,
            used: self.live(),
            ..PoolStats::default()
        }
    }
}
