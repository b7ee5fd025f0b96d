//! The unit's registered memory as chunks: registered pools added on demand, up to a byte
//! limit, and deregistered when entirely free while the idle registered memory exceeds its
//! own limit. Registration is slow, so a chunk is large (a request that needs more gets a
//! chunk of its own size) and is only ever registered when no chunk has room.

use tessera_sync::atomic::{AtomicU64, Ordering};
use tessera_sync::Arc;
use tessera_transport::{Agent, PoolBlock, RegisteredPool};

use crate::core::PoolStats;
use crate::error::MemoryError;

/// Sizes of the chunked registered memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ChunkLimits {
    /// Registered bytes at most.
    pub(crate) capacity: u64,
    /// Bytes of one chunk (a lease larger than this gets a chunk of its own size).
    pub(crate) chunk: u64,
    /// Idle (registered, not leased) bytes kept at most: entirely free chunks beyond it are
    /// deregistered.
    pub(crate) idle: u64,
    /// Register the whole capacity at start, fault every page of it in, and keep it (`idle`
    /// is then the capacity): no request registers memory or touches a fresh page.
    pub(crate) prefault: bool,
}

/// Where chunks come from: a transport agent in the server, plain allocators in tests.
pub(crate) trait ChunkSource {
    /// One chunk.
    type Pool: Chunk;
    /// Registers a chunk of `bytes`.
    fn register(&self, bytes: u64) -> Result<Self::Pool, MemoryError>;
}

/// A registered chunk: leases blocks and reports its occupancy.
pub(crate) trait Chunk {
    /// A leased block.
    type Block;
    /// Leases `size` bytes aligned to `align`.
    fn lease(&self, size: u64, align: u64) -> Result<Self::Block, MemoryError>;
    /// Registered bytes.
    fn capacity(&self) -> u64;
    /// Faults every page of the chunk in for writing.
    fn populate(&self) -> Result<(), MemoryError>;
    /// Leased bytes, largest free range and live blocks.
    fn usage(&self) -> (u64, u64, u64);
    /// Leased bytes and live blocks: `usage` without the search for the largest free range,
    /// for the trim after every request.
    fn held(&self) -> (u64, u64);
}

impl ChunkSource for Arc<Agent> {
    type Pool = RegisteredPool;

    fn register(&self, bytes: u64) -> Result<RegisteredPool, MemoryError> {
        // Scoped: a client reaches a block only while it is exposed to it (a pushed PUT's
        // frames, see `PoolMemory::expose`), not the whole pool.
        Ok(RegisteredPool::new_scoped(self, bytes)?)
    }
}

impl Chunk for RegisteredPool {
    type Block = PoolBlock;

    fn lease(&self, size: u64, align: u64) -> Result<PoolBlock, MemoryError> {
        Ok(RegisteredPool::lease(self, size, align)?)
    }

    fn capacity(&self) -> u64 {
        RegisteredPool::capacity(self)
    }

    fn populate(&self) -> Result<(), MemoryError> {
        Ok(RegisteredPool::populate(self)?)
    }

    fn usage(&self) -> (u64, u64, u64) {
        let r = self.report();
        (r.used, r.largest_free, r.live_blocks)
    }

    fn held(&self) -> (u64, u64) {
        RegisteredPool::held(self)
    }
}

const PAGE: u64 = 4096;

/// Chunks of registered memory. Leases and trims run under the unit's lock; blocks return
/// to their chunk from any thread (the chunk's allocator is thread-safe), and a chunk is only
/// deregistered when it has no live block, so nothing leased ever loses its registration.
pub(crate) struct ChunkPool<S: ChunkSource> {
    source: S,
    limits: ChunkLimits,
    /// Oldest first: leases try the oldest chunks first, so the newest drain and go first.
    chunks: Vec<S::Pool>,
    registered: u64,
    /// Bumped whenever a chunk is registered or deregistered (peers need new metadata).
    generation: Arc<AtomicU64>,
}

impl<S: ChunkSource> ChunkPool<S> {
    /// A pool with its first chunk registered (so that a failure to register shows at once),
    /// or with every chunk registered and faulted in when `limits.prefault`.
    pub(crate) fn new(source: S, mut limits: ChunkLimits) -> Result<Self, MemoryError> {
        if limits.capacity == 0 || limits.chunk == 0 {
            return Err(MemoryError::ZeroSize);
        }
        if limits.prefault {
            limits.idle = limits.capacity;
        }
        let mut pool = Self {
            source,
            limits,
            chunks: Vec::new(),
            registered: 0,
            generation: Arc::new(AtomicU64::new(0)),
        };
        pool.grow(limits.chunk.min(limits.capacity))?;
        while limits.prefault && pool.registered < limits.capacity {
            pool.grow(limits.chunk.min(limits.capacity - pool.registered))?;
        }
        Ok(pool)
    }

    /// Bumped on every registration change.
    pub(crate) fn generation(&self) -> Arc<AtomicU64> {
        self.generation.clone()
    }

    fn grow(&mut self, bytes: u64) -> Result<&S::Pool, MemoryError> {
        let chunk = self.source.register(bytes)?;
        if self.limits.prefault {
            chunk.populate()?;
        }
        self.registered += chunk.capacity();
        let at = self.chunks.len();
        self.chunks.push(chunk);
        self.generation.fetch_add(1, Ordering::Release);
        tracing::debug!(
            bytes,
            registered = self.registered,
            "registered a chunk of memory"
        );
        Ok(&self.chunks[at])
    }

    /// Leases from the first chunk with room, registering a new chunk when none has it and the
    /// limit allows.
    pub(crate) fn lease(
        &mut self,
        size: u64,
        align: u64,
    ) -> Result<<S::Pool as Chunk>::Block, MemoryError> {
        let mut last = None;
        for c in &self.chunks {
            match c.lease(size, align) {
                Ok(b) => return Ok(b),
                Err(e) => last = Some(Box::new(e)),
            }
        }
        // A chunk that surely fits the block: its start is page-aligned, so `align` up to a
        // page costs nothing; a larger alignment may cost up to `align` bytes.
        let need = size
            .checked_add(if align > PAGE { align } else { 0 })
            .and_then(|n| n.checked_next_multiple_of(PAGE))
            .ok_or(MemoryError::LeaseTooLarge { size })?;
        let bytes = need.max(self.limits.chunk);
        let mut room = self.limits.capacity.saturating_sub(self.registered);
        if need > room {
            // Entirely free chunks too small for this lease make room for one that fits.
            self.release_free(0);
            room = self.limits.capacity.saturating_sub(self.registered);
        }
        if need > room {
            let largest = self.chunks.iter().map(|c| c.usage().1).max().unwrap_or(0);
            return Err(MemoryError::Exhausted {
                requested: size,
                registered: self.registered,
                limit: self.limits.capacity,
                largest_free: largest,
                chunk: last,
            });
        }
        self.grow(bytes.min(room))?.lease(size, align)
    }

    /// Deregisters entirely free chunks, newest first, while the idle registered bytes exceed
    /// the idle limit. Returns the bytes deregistered.
    pub(crate) fn trim(&mut self) -> u64 {
        self.release_free(self.limits.idle)
    }

    /// Deregisters entirely free chunks, newest first, while the idle bytes exceed `keep`.
    fn release_free(&mut self, keep: u64) -> u64 {
        let used: u64 = self.chunks.iter().map(|c| c.held().0).sum();
        let mut idle = self.registered - used;
        let mut freed = 0;
        let mut i = self.chunks.len();
        while idle > keep && i > 0 {
            i -= 1;
            let (used, live) = self.chunks[i].held();
            if used == 0 && live == 0 {
                let chunk = self.chunks.remove(i);
                let bytes = chunk.capacity();
                drop(chunk); // its last registration guard: deregistered here
                self.registered -= bytes;
                idle -= bytes.min(idle);
                freed += bytes;
            }
        }
        if freed > 0 {
            self.generation.fetch_add(1, Ordering::Release);
            tracing::debug!(
                freed,
                registered = self.registered,
                "deregistered idle chunks"
            );
        }
        freed
    }

    /// Occupancy over all chunks.
    pub(crate) fn usage(&self) -> PoolStats {
        let mut s = PoolStats {
            capacity: self.registered,
            limit: self.limits.capacity,
            idle_limit: self.limits.idle,
            chunks: self.chunks.len() as u64,
            ..PoolStats::default()
        };
        for c in &self.chunks {
            let (used, largest, live) = c.usage();
            s.used += used;
            s.largest_free = s.largest_free.max(largest);
            s.live_blocks += live;
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_sync::{model, thread};
    use tessera_transport::Inproc;

    const MIB: u64 = 1 << 20;

    fn pool(capacity: u64, chunk: u64, idle: u64) -> (Arc<Agent>, ChunkPool<Arc<Agent>>) {
        let agent = Arc::new(Agent::new("chunks", Inproc::new()).unwrap());
        let limits = ChunkLimits {
            capacity,
            chunk,
            idle,
            prefault: false,
        };
        let pool = ChunkPool::new(agent.clone(), limits).unwrap();
        (agent, pool)
    }

    /// What the agent has registered matches what the pool reports: nothing leaks.
    fn registered(agent: &Agent, pool: &ChunkPool<Arc<Agent>>) -> u64 {
        let u = pool.usage();
        let r = agent.report();
        assert_eq!(
            (r.registered_bytes, r.registrations as u64),
            (u.capacity, u.chunks)
        );
        u.capacity
    }

    #[test]
    fn grows_on_demand_up_to_the_limit_and_shrinks_to_the_idle_limit() {
        let (agent, mut pool) = pool(20 * MIB, 4 * MIB, 4 * MIB);
        assert_eq!(registered(&agent, &pool), 4 * MIB, "one chunk at start");
        let g0 = pool.generation().load(Ordering::Acquire);
        // Twelve 1 MiB blocks: three chunks, registered only when the others are full.
        let mut blocks: Vec<_> = (0..12).map(|_| pool.lease(MIB, 64).unwrap()).collect();
        assert_eq!(registered(&agent, &pool), 12 * MIB);
        assert_eq!(pool.usage().used, 12 * MIB);
        assert_eq!(pool.generation().load(Ordering::Acquire), g0 + 2);
        // A lease larger than a chunk gets a chunk of its own size, within the limit.
        let big = pool.lease(4 * MIB + 1, 64).unwrap();
        assert_eq!(registered(&agent, &pool), 12 * MIB + 4 * MIB + 4096);
        // The limit: nothing more can be registered.
        let e = pool.lease(8 * MIB, 64).unwrap_err();
        assert!(e.to_string().contains("registered memory exhausted"), "{e}");
        assert!(
            matches!(
                &e,
                MemoryError::Exhausted { chunk: Some(c), .. }
                    if matches!(**c, MemoryError::Alloc(tessera_alloc::AllocError::OutOfMemory { .. }))
            ),
            "{e:?}"
        );
        drop(big);
        let g = pool.generation().load(Ordering::Acquire);
        assert_eq!(pool.trim(), 4 * MIB + 4096, "the free big chunk goes");
        assert_eq!(
            pool.generation().load(Ordering::Acquire),
            g + 1,
            "peers learn of it"
        );
        assert!(pool.lease(8 * MIB + 1, 64).is_err(), "8 MiB of room left");
        // Nothing is idle: trimming keeps every chunk, and the metadata stays.
        assert_eq!(pool.trim(), 0);
        assert_eq!(pool.generation().load(Ordering::Acquire), g + 1);
        // Free the blocks of the last two chunks: one is kept as idle memory.
        blocks.truncate(4);
        assert_eq!(pool.trim(), 4 * MIB);
        assert_eq!(registered(&agent, &pool), 8 * MIB);
        assert_eq!(pool.usage().capacity - pool.usage().used, 4 * MIB);
        // All free: down to the idle limit, the oldest chunk last.
        drop(blocks);
        assert_eq!(pool.trim(), 4 * MIB);
        assert_eq!(registered(&agent, &pool), 4 * MIB);
        // Grows again when needed.
        let again: Vec<_> = (0..8).map(|_| pool.lease(MIB, 64).unwrap()).collect();
        assert_eq!(registered(&agent, &pool), 8 * MIB);
        drop(again);
        drop(pool);
        assert_eq!(agent.report().registrations, 0);
    }

    /// Resident pages of a chunk and its pages in all.
    fn resident(chunk: &RegisteredPool) -> (usize, usize) {
        tessera_testkit::resident_pages(chunk.registration().as_ptr(), chunk.capacity() as usize)
    }

    /// Prefaulted: the whole capacity is registered at start, every page resident, and kept
    /// whatever the idle limit; without, only the first chunk, and none of its pages.
    #[test]
    fn a_prefaulted_pool_registers_and_touches_everything_at_start() {
        let agent = Arc::new(Agent::new("chunks", Inproc::new()).unwrap());
        let limits = ChunkLimits {
            capacity: 10 * MIB,
            chunk: 4 * MIB,
            idle: 0,
            prefault: true,
        };
        let mut pool = ChunkPool::new(agent.clone(), limits).unwrap();
        assert_eq!(registered(&agent, &pool), 10 * MIB);
        let sizes: Vec<u64> = pool.chunks.iter().map(|c| c.capacity()).collect();
        assert_eq!(sizes, [4 * MIB, 4 * MIB, 2 * MIB]);
        for c in &pool.chunks {
            let (resident, pages) = resident(c);
            assert_eq!(resident, pages);
        }
        let blocks: Vec<_> = (0..10).map(|_| pool.lease(MIB, 64).unwrap()).collect();
        drop(blocks);
        assert_eq!(pool.trim(), 0, "nothing is deregistered");
        assert_eq!(pool.usage().idle_limit, 10 * MIB);
        assert_eq!(registered(&agent, &pool), 10 * MIB);

        let (agent, pool) = self::pool(10 * MIB, 4 * MIB, 0);
        assert_eq!(registered(&agent, &pool), 4 * MIB);
        assert_eq!(resident(&pool.chunks[0]).0, 0);
    }

    #[test]
    fn a_block_in_use_keeps_its_chunk() {
        let (agent, mut pool) = pool(8 * MIB, 4 * MIB, 0);
        let first = pool.lease(4 * MIB, 64).unwrap();
        let second = pool.lease(MIB, 64).unwrap();
        assert_eq!(pool.usage().chunks, 2);
        // A descriptor of the block (as a transfer holds) keeps the block leased.
        let desc = second.desc().unwrap();
        drop(second);
        assert_eq!(pool.trim(), 0, "the second chunk still has a live block");
        drop(desc);
        assert_eq!(pool.trim(), 4 * MIB);
        drop(first);
        assert_eq!(pool.trim(), 4 * MIB);
        assert_eq!(registered(&agent, &pool), 0);
        // Empty, it registers again on demand.
        let b = pool.lease(MIB, 64).unwrap();
        assert_eq!(registered(&agent, &pool), 4 * MIB);
        drop(b);
    }

    /// A lease of exactly the room left gets a chunk of its own, and free chunks stay: they
    /// are released only when the lease would not fit otherwise. A page alignment is free.
    #[test]
    fn a_lease_of_exactly_the_room_left_fits() {
        let (agent, mut pool) = pool(13 * MIB, 4 * MIB, 13 * MIB);
        let a = pool.lease(4 * MIB, 64).unwrap();
        let b = pool.lease(4 * MIB, PAGE).unwrap();
        assert_eq!(
            registered(&agent, &pool),
            8 * MIB,
            "a page alignment costs no page"
        );
        drop(b);
        let c = pool.lease(5 * MIB, 64).unwrap();
        assert_eq!(registered(&agent, &pool), 13 * MIB);
        assert_eq!(pool.usage().chunks, 3, "the free chunk stayed");
        drop((a, c));
    }

    /// A trim goes on deregistering free chunks until the idle bytes are down to the limit.
    #[test]
    fn a_trim_frees_every_chunk_above_the_idle_limit() {
        let (agent, mut pool) = pool(12 * MIB, 4 * MIB, 4 * MIB);
        let blocks: Vec<_> = (0..3).map(|_| pool.lease(4 * MIB, 64).unwrap()).collect();
        assert_eq!(pool.usage().chunks, 3);
        drop(blocks);
        assert_eq!(pool.trim(), 8 * MIB);
        assert_eq!(registered(&agent, &pool), 4 * MIB);
    }

    /// A lease that fits the limit only without the free chunks replaces them.
    #[test]
    fn free_chunks_make_room_for_a_large_lease() {
        let (agent, mut pool) = pool(8 * MIB, 4 * MIB, 8 * MIB);
        let big = pool.lease(6 * MIB, 64).unwrap();
        assert_eq!(registered(&agent, &pool), 6 * MIB);
        assert_eq!(pool.usage().chunks, 1);
        let small = pool.lease(MIB, 64).unwrap();
        assert_eq!(registered(&agent, &pool), 8 * MIB);
        // The chunk with a live block stays: no room, a clear error.
        let e = pool.lease(4 * MIB, 64).unwrap_err();
        assert!(e.to_string().contains("exhausted"), "{e}");
        drop((big, small));
    }

    /// The unit trims while an executor drops the last block of a chunk on another thread:
    /// the chunk is deregistered exactly once, by one of the two trims, never while the block
    /// lives, and the agent ends with exactly the chunks the pool reports.
    #[test]
    fn loom_trim_races_a_block_returning() {
        model(|| {
            let (agent, mut pool) = pool(128 << 10, 64 << 10, 0);
            let first = pool.lease(64 << 10, 64).unwrap();
            let second = pool.lease(4096, 64).unwrap();
            assert_eq!(pool.usage().chunks, 2);
            let executor = thread::spawn(move || drop(second));
            let raced = pool.trim();
            executor.join().unwrap();
            let after = pool.trim();
            assert_eq!(raced + after, 64 << 10, "the free chunk goes exactly once");
            assert_eq!(registered(&agent, &pool), 64 << 10);
            drop(first);
            assert_eq!(pool.trim(), 64 << 10);
            assert_eq!(registered(&agent, &pool), 0);
        });
    }

    /// A lease that grows the pool races a block of the first chunk returning: the lease
    /// lands in the first chunk or in a new one, and nothing is leaked either way.
    #[test]
    fn loom_grow_races_a_block_returning() {
        model(|| {
            let (agent, mut pool) = pool(128 << 10, 64 << 10, 0);
            let full = pool.lease(64 << 10, 64).unwrap();
            let executor = thread::spawn(move || drop(full));
            let block = pool.lease(4096, 64).unwrap();
            executor.join().unwrap();
            let chunks = pool.usage().chunks;
            assert!(chunks == 1 || chunks == 2);
            assert_eq!(pool.usage().used, 4096);
            drop(block);
            pool.trim();
            assert_eq!(registered(&agent, &pool), 0);
        });
    }
}
