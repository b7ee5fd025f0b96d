//! The single-threaded TLSF allocator: segregated free lists by size class, found through a
//! two-level bitmap, with all bookkeeping in a side table of nodes (never in the managed memory).

use std::ops::Range;

use crate::layout::align_up;
use crate::{pack, AllocError, Layout, WrongAllocator};

/// Second-level classes per power of two: 64, so a class spans at most 1/64 of its sizes and the
/// round-up of the fast path wastes at most that much.
const SL_BITS: u32 = 6;
const SL_COUNT: usize = 1 << SL_BITS;
/// Sizes below 64 get one class each (first level 0); each power of two from 2^6 to 2^63 gets
/// one first-level class, 1 to 58.
const FL_COUNT: usize = 64 - SL_BITS as usize + 1;
/// Size classes: one free list each.
const CLASSES: usize = FL_COUNT * SL_COUNT;
/// The end of a free list. Node 0 is a sink that is never a range: list updates write to it
/// instead of branching on a missing neighbour.
const NIL: u32 = 0;
/// The sentinel of the circular physical order (node 1): the node before the first range and
/// after the last. It is never free, so ranges at either end have a non-free neighbour.
const EDGE: u32 = 1;
/// `next_free` of a node that is a live block (free nodes hold a node index or `NIL` there).
const USED: u32 = u32::MAX;

/// One range, free or used, in the side table: 32 bytes, linked to its physical neighbours
/// and, when free, to the other ranges of its size class.
#[derive(Debug, Clone, Copy)]
struct Node {
    offset: u64,
    size: u64,
    prev_phys: u32,
    next_phys: u32,
    prev_free: u32,
    next_free: u32,
}

/// A granted range `[offset, offset + size)`. It is neither `Copy` nor `Clone`: the only way to
/// give it back is [`Allocator::free`], which consumes it, so a double free does not compile.
/// A block that is dropped without being freed stays allocated (use
/// [`SharedAllocator`](crate::SharedAllocator) leases to free on drop).
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a block that is dropped without being freed stays allocated"]
pub struct Block {
    offset: u64,
    size: u64,
    node: u32,
    owner: u32,
}

impl Block {
    /// First byte of the block.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Size in bytes, exactly as requested.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// One past the last byte.
    pub fn end(&self) -> u64 {
        self.offset + self.size
    }

    /// The block's range of offsets.
    pub fn range(&self) -> Range<u64> {
        self.offset..self.end()
    }
}

/// Where one item of a group landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// Index of the block in [`Group::blocks`].
    pub block: usize,
    /// Offset of the item from the start of that block.
    pub offset: u64,
}

/// The result of [`Allocator::allocate_group`].
#[derive(Debug)]
#[must_use = "the group's blocks stay allocated until they are freed"]
pub struct Group<B = Block> {
    /// The blocks, in item order; each holds a contiguous run of items.
    pub blocks: Vec<B>,
    /// One entry per requested item; `None` for zero-size items, which occupy no block.
    pub placements: Vec<Option<Placement>>,
}

/// Occupancy at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    /// Size of the managed range.
    pub capacity: u64,
    /// Bytes held by live blocks.
    pub used: u64,
    /// Bytes in free ranges (`capacity - used`).
    pub free: u64,
    /// Size of the largest free range.
    pub largest_free: u64,
    /// Live non-empty blocks.
    pub live_blocks: u64,
    /// Free ranges (no two of them are adjacent).
    pub free_ranges: u64,
}

/// An allocator of byte ranges inside `[0, capacity)`.
///
/// `allocate` and `free` take bounded time whatever the number of free ranges: the fast path
/// looks up a size class that is guaranteed to fit through two bitmap scans; only when that
/// finds nothing does a slow path scan the classes that may still hold a fitting range, so no
/// request is refused while a fitting aligned range exists. Freed blocks merge with free
/// neighbours at once.
#[derive(Debug)]
pub struct Allocator {
    id: u32,
    capacity: u64,
    nodes: Vec<Node>,
    /// Recycled nodes, chained through `next_free`.
    spare: u32,
    fl_bitmap: u64,
    sl_bitmap: [u64; FL_COUNT],
    heads: Box<[u32]>,
    free_bytes: u64,
    live_blocks: u64,
    free_ranges: u64,
}

/// The class `size` falls in. Sizes below 64 map linearly (first level 0, and first level 1
/// continues the same step of one byte), which the saturating shifts give without a branch.
#[inline]
fn class_of(size: u64) -> (usize, usize) {
    let msb = 63 - (size | 1).leading_zeros();
    let fl = msb.saturating_sub(SL_BITS - 1);
    let sl = (size >> msb.saturating_sub(SL_BITS)) as usize & (SL_COUNT - 1);
    (fl as usize, sl)
}

/// The smallest class whose every range is at least `size` bytes.
#[inline]
fn class_at_least(size: u64) -> Option<(usize, usize)> {
    let msb = 63 - (size | 1).leading_zeros();
    let round = (1u64 << msb.saturating_sub(SL_BITS)) - 1;
    size.checked_add(round).map(class_of)
}

impl Allocator {
    /// An allocator over `[0, capacity)`, all free. Any `u64` capacity works.
    pub fn new(capacity: u64) -> Self {
        Self::with_range_hint(capacity, 64)
    }

    /// Like [`Self::new`], with side-table room for `ranges` ranges (free or used) reserved up
    /// front, so that no allocation up to that many pays for growing it.
    pub fn with_range_hint(capacity: u64, ranges: usize) -> Self {
        let mut a = Self {
            id: next_allocator_id(),
            capacity,
            nodes: Vec::with_capacity(ranges.saturating_add(1)),
            spare: NIL,
            fl_bitmap: 0,
            sl_bitmap: [0; FL_COUNT],
            heads: vec![NIL; CLASSES].into_boxed_slice(),
            free_bytes: capacity,
            live_blocks: 0,
            free_ranges: 0,
        };
        let sentinel = Node {
            offset: 0,
            size: 0,
            prev_phys: EDGE,
            next_phys: EDGE,
            prev_free: NIL,
            next_free: USED,
        };
        a.nodes.extend([sentinel, sentinel]);
        if capacity > 0 {
            let n = a.new_node(0, capacity, true);
            a.insert_phys_after(EDGE, n);
            a.insert_free(n);
            a.free_ranges = 1;
        }
        a
    }

    /// Size of the managed range.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes not held by any block.
    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// Live non-empty blocks.
    pub fn live_blocks(&self) -> u64 {
        self.live_blocks
    }

    /// Grants `size` bytes at an offset that is a multiple of `align` (a power of two).
    ///
    /// The block is exactly `size` bytes: nothing is rounded up, so requests whose sizes add up
    /// to the capacity fill it whenever their alignments allow. A zero-size request succeeds and
    /// takes nothing.
    #[inline]
    pub fn allocate(&mut self, size: u64, align: u64) -> Result<Block, AllocError> {
        if !align.is_power_of_two() {
            return Err(AllocError::InvalidAlignment { align });
        }
        if size == 0 {
            return Ok(self.empty_block());
        }
        match self.find_fit(size, align) {
            Some((node, start)) => Ok(self.carve(node, start, size)),
            None => Err(self.out_of_memory(size, align)),
        }
    }

    /// Gives a block back; its range merges with free neighbours at once.
    ///
    /// A block granted by another allocator is refused and handed back inside the error.
    #[inline]
    pub fn free(&mut self, block: Block) -> Result<(), WrongAllocator> {
        if block.owner != self.id {
            return Err(WrongAllocator::new(block));
        }
        if block.size == 0 {
            return Ok(());
        }
        let node = block.node;
        let Node {
            prev_phys: prev,
            next_phys: next,
            ..
        } = self.nodes[node as usize];
        debug_assert!({
            let n = &self.nodes[node as usize];
            !self.is_free(node) && n.offset == block.offset && n.size == block.size
        });
        self.free_bytes += block.size;
        self.live_blocks -= 1;
        let prev_free = self.is_free(prev);
        let next_free = self.is_free(next);
        match (prev_free, next_free) {
            (false, false) => {
                self.insert_free(node);
                self.free_ranges += 1;
            }
            (true, false) => {
                // The free neighbour grows over the block and keeps its list entry when its
                // class does not change.
                let old = self.nodes[prev as usize].size;
                self.nodes[prev as usize].size += block.size;
                self.unlink_phys(node);
                self.reclass(prev, old);
            }
            (false, true) => {
                let old = self.nodes[next as usize].size;
                let n = &mut self.nodes[next as usize];
                n.offset = block.offset;
                n.size += block.size;
                self.unlink_phys(node);
                self.reclass(next, old);
            }
            (true, true) => {
                let old = self.nodes[prev as usize].size;
                let next_size = self.nodes[next as usize].size;
                self.remove_free(next);
                self.nodes[prev as usize].size += block.size + next_size;
                self.unlink_phys(node);
                self.unlink_phys(next);
                self.reclass(prev, old);
                self.free_ranges -= 1;
            }
        }
        Ok(())
    }

    /// Gives back the bytes of `block` from `size` on and returns the block with its first
    /// `size` bytes (at the same offset): a block leased for the most a request might need is
    /// trimmed to what it used. The tail merges with a free neighbour at once. A `size` of zero
    /// frees the block and returns an empty one; one at or above the block's size changes
    /// nothing.
    ///
    /// A block granted by another allocator is refused and handed back inside the error.
    pub fn shrink(&mut self, mut block: Block, size: u64) -> Result<Block, WrongAllocator> {
        if block.owner != self.id {
            return Err(WrongAllocator::new(block));
        }
        if size >= block.size {
            return Ok(block);
        }
        if size == 0 {
            self.free(block)?;
            return Ok(self.empty_block());
        }
        let node = block.node;
        let tail = block.size - size;
        let at = block.offset + size;
        let next = self.nodes[node as usize].next_phys;
        if self.is_free(next) {
            // The free neighbour grows back over the tail.
            let old = self.nodes[next as usize].size;
            let n = &mut self.nodes[next as usize];
            n.offset = at;
            n.size += tail;
            self.reclass(next, old);
        } else {
            let t = self.new_node(at, tail, true);
            self.insert_phys_after(node, t);
            self.insert_free(t);
            self.free_ranges += 1;
        }
        self.nodes[node as usize].size = size;
        self.free_bytes += tail;
        block.size = size;
        Ok(block)
    }

    /// Allocates a group of items (tensors) as few contiguous blocks as possible.
    ///
    /// The items are laid out with [`pack`]. When a free range holds the whole packed group, one
    /// block is returned, taken from the smallest size class that holds it (best fit to within
    /// 1/64 of the size). Otherwise the group is split into several blocks, each holding a
    /// contiguous run of items; an item is never split. This runs in O(n + k) for n items in k
    /// blocks, plus a class scan in the rare case that the largest range cannot take the next
    /// item. It is all or nothing: on failure nothing is taken.
    pub fn allocate_group(&mut self, items: &[Layout]) -> Result<Group, AllocError> {
        let packing = pack(items)?;
        let mut placements = vec![None; items.len()];
        if packing.size == 0 {
            return Ok(Group {
                blocks: Vec::new(),
                placements,
            });
        }
        if packing.payload > self.free_bytes {
            return Err(self.out_of_memory(packing.size, packing.align));
        }
        if let Some((node, start)) = self.find_fit(packing.size, packing.align) {
            let block = self.carve(node, start, packing.size);
            for (slot, (item, &offset)) in placements
                .iter_mut()
                .zip(items.iter().zip(&packing.offsets))
            {
                if item.size() > 0 {
                    *slot = Some(Placement { block: 0, offset });
                }
            }
            return Ok(Group {
                blocks: vec![block],
                placements,
            });
        }
        let mut blocks: Vec<Block> = Vec::new();
        match self.place_runs(
            items,
            &packing.offsets,
            packing.size,
            packing.align,
            &mut blocks,
            &mut placements,
        ) {
            Ok(()) => Ok(Group { blocks, placements }),
            Err(()) => {
                for block in blocks {
                    let freed = self.free(block);
                    debug_assert!(freed.is_ok());
                }
                Err(self.out_of_memory(packing.size, packing.align))
            }
        }
    }

    /// The multi-block path of [`Self::allocate_group`]: before each block, one bitmap lookup
    /// asks whether a range holds everything that is left; if not, the largest class's first
    /// range takes the longest run of items that fits it.
    fn place_runs(
        &mut self,
        items: &[Layout],
        offsets: &[u64],
        packed_size: u64,
        packed_align: u64,
        blocks: &mut Vec<Block>,
        placements: &mut [Option<Placement>],
    ) -> Result<(), ()> {
        let n = items.len();
        let mut i = 0;
        loop {
            while i < n && items[i].size() == 0 {
                i += 1;
            }
            if i == n {
                return Ok(());
            }
            // Everything left, at its packed offsets, in one range: start congruent to the
            // first item's offset modulo the group alignment keeps every item aligned.
            let rest = packed_size - offsets[i];
            let fast = rest
                .checked_add(packed_align - 1)
                .and_then(|need| self.find_fast(need));
            if let Some(node) = fast {
                let base = self.nodes[node as usize].offset;
                let phase = offsets[i] & (packed_align - 1);
                let mut start = (base & !(packed_align - 1)) + phase;
                if start < base {
                    start += packed_align;
                }
                let block_index = blocks.len();
                blocks.push(self.carve(node, start, rest));
                for j in i..n {
                    if items[j].size() > 0 {
                        placements[j] = Some(Placement {
                            block: block_index,
                            offset: offsets[j] - offsets[i],
                        });
                    }
                }
                return Ok(());
            }
            let first = items[i];
            let node = match self.largest_class_head() {
                Some(node) if self.fits(node, first.size(), first.align()).is_some() => node,
                _ => match self.find_fit(first.size(), first.align()) {
                    Some((node, _)) => node,
                    None => return Err(()),
                },
            };
            let Node { offset, size, .. } = self.nodes[node as usize];
            let range_end = offset + size;
            let block_index = blocks.len();
            let start = align_up(offset, first.align()).ok_or(())?;
            let mut cursor = start;
            while i < n {
                let item = items[i];
                if item.size() == 0 {
                    i += 1;
                    continue;
                }
                let at = match align_up(cursor, item.align()) {
                    Some(at) if at <= range_end && range_end - at >= item.size() => at,
                    _ => break,
                };
                placements[i] = Some(Placement {
                    block: block_index,
                    offset: at - start,
                });
                cursor = at + item.size();
                i += 1;
            }
            blocks.push(self.carve(node, start, cursor - start));
        }
    }

    /// Occupancy now. Finding the largest free range scans one size class.
    pub fn report(&self) -> Report {
        Report {
            capacity: self.capacity,
            used: self.capacity - self.free_bytes,
            free: self.free_bytes,
            largest_free: self.largest_free(),
            live_blocks: self.live_blocks,
            free_ranges: self.free_ranges,
        }
    }

    /// The free ranges in address order. It walks every range, free or used: for diagnostics
    /// and tests, not for hot paths.
    pub fn free_ranges(&self) -> impl Iterator<Item = Range<u64>> + '_ {
        let mut cur = self.nodes[EDGE as usize].next_phys;
        std::iter::from_fn(move || {
            while cur != EDGE {
                let node = cur;
                let n = &self.nodes[node as usize];
                cur = n.next_phys;
                if self.is_free(node) {
                    return Some(n.offset..n.offset + n.size);
                }
            }
            None
        })
    }

    /// Size of the largest free range.
    pub fn largest_free(&self) -> u64 {
        let mut best = 0;
        if let Some((fl, sl)) = self.largest_class() {
            let mut cur = self.heads[fl * SL_COUNT + sl];
            // Bounded like `find_slow`'s walk: a list holds each node at most once.
            for _ in 0..self.nodes.len() {
                if cur == NIL {
                    break;
                }
                let n = &self.nodes[cur as usize];
                best = best.max(n.size);
                cur = n.next_free;
            }
        }
        best
    }

    fn out_of_memory(&self, requested: u64, align: u64) -> AllocError {
        AllocError::OutOfMemory {
            requested,
            align,
            free: self.free_bytes,
            largest_free: self.largest_free(),
        }
    }

    fn empty_block(&self) -> Block {
        Block {
            offset: 0,
            size: 0,
            node: NIL,
            owner: self.id,
        }
    }

    /// Where a request of `size` bytes aligned to `align` starts inside free node `node`, if it
    /// fits there.
    #[inline]
    fn fits(&self, node: u32, size: u64, align: u64) -> Option<u64> {
        let n = &self.nodes[node as usize];
        let start = align_up(n.offset, align)?;
        let end = n.offset + n.size;
        (start <= end && end - start >= size).then_some(start)
    }

    /// A free node that holds the request and the start inside it: the fast path, then the
    /// slow path over the classes the fast path skips.
    #[inline]
    fn find_fit(&self, size: u64, align: u64) -> Option<(u32, u64)> {
        if let Some(node) = size
            .checked_add(align - 1)
            .and_then(|need| self.find_fast(need))
        {
            let start = align_up(self.nodes[node as usize].offset, align)?;
            return Some((node, start));
        }
        self.find_slow(size, align)
    }

    /// The head of the smallest class whose every range is at least `need` bytes.
    #[inline]
    fn find_fast(&self, need: u64) -> Option<u32> {
        let (fl, sl) = class_at_least(need)?;
        let (fl, sl) = self.first_class_from(fl, sl)?;
        Some(self.heads[fl * SL_COUNT + sl])
    }

    /// Scans, smallest first, the non-empty classes from the one `size` falls in: they may hold
    /// a range that fits once aligned although not every range of theirs does.
    #[cold]
    fn find_slow(&self, size: u64, align: u64) -> Option<(u32, u64)> {
        let (mut fl, mut sl) = class_of(size);
        // Both loops are bounded, and the scan checked to move up: a corrupted free list or
        // class map ends in a wrong answer (or a panic in debug builds), never in a spin.
        for _ in 0..CLASSES {
            let Some((f, s)) = self.first_class_from(fl, sl) else {
                break;
            };
            debug_assert!(
                f * SL_COUNT + s >= fl * SL_COUNT + sl,
                "the scan moved down"
            );
            let mut cur = self.heads[f * SL_COUNT + s];
            for _ in 0..self.nodes.len() {
                if cur == NIL {
                    break;
                }
                if let Some(start) = self.fits(cur, size, align) {
                    return Some((cur, start));
                }
                cur = self.nodes[cur as usize].next_free;
            }
            (fl, sl) = if s + 1 < SL_COUNT {
                (f, s + 1)
            } else {
                (f + 1, 0)
            };
            debug_assert!(
                fl * SL_COUNT + sl > f * SL_COUNT + s,
                "the scan did not move"
            );
            if fl >= FL_COUNT {
                break;
            }
        }
        None
    }

    /// The first non-empty class at or above `(fl, sl)`.
    #[inline]
    fn first_class_from(&self, fl: usize, sl: usize) -> Option<(usize, usize)> {
        let sl_map = self.sl_bitmap[fl] & (u64::MAX << sl);
        if sl_map != 0 {
            return Some((fl, sl_map.trailing_zeros() as usize));
        }
        let fl_map = self.fl_bitmap & u64::MAX.checked_shl(fl as u32 + 1).unwrap_or(0);
        if fl_map == 0 {
            return None;
        }
        let fl = fl_map.trailing_zeros() as usize;
        Some((fl, self.sl_bitmap[fl].trailing_zeros() as usize))
    }

    fn largest_class(&self) -> Option<(usize, usize)> {
        if self.fl_bitmap == 0 {
            return None;
        }
        let fl = 63 - self.fl_bitmap.leading_zeros() as usize;
        let sl = 63 - self.sl_bitmap[fl].leading_zeros() as usize;
        Some((fl, sl))
    }

    fn largest_class_head(&self) -> Option<u32> {
        self.largest_class()
            .map(|(fl, sl)| self.heads[fl * SL_COUNT + sl])
    }

    /// Turns `[start, start + size)` of free node `node` into a block. The larger leftover
    /// keeps `node`, and with it its free-list entry when its size class does not change (the
    /// common case of carving from a large range); the other leftover, if any, gets a new node.
    #[inline]
    fn carve(&mut self, node: u32, start: u64, size: u64) -> Block {
        let Node {
            offset,
            size: node_size,
            ..
        } = self.nodes[node as usize];
        let end = start + size;
        let node_end = offset + node_size;
        debug_assert!(offset <= start && end <= node_end && size > 0);
        let lead = start - offset;
        let tail = node_end - end;
        self.free_bytes -= size;
        self.live_blocks += 1;
        let owner = self.id;
        let block = |node| Block {
            offset: start,
            size,
            node,
            owner,
        };
        if lead == 0 && tail == 0 {
            self.remove_free(node);
            self.nodes[node as usize].next_free = USED;
            self.free_ranges -= 1;
            return block(node);
        }
        let used = self.new_node(start, size, false);
        if tail >= lead {
            // [lead?][used][node = tail]
            self.insert_phys_before(node, used);
            if lead > 0 {
                let l = self.new_node(offset, lead, true);
                self.insert_phys_before(used, l);
                self.insert_free(l);
                self.free_ranges += 1;
            }
            let n = &mut self.nodes[node as usize];
            n.offset = end;
            n.size = tail;
        } else {
            // [node = lead][used][tail?]
            self.insert_phys_after(node, used);
            if tail > 0 {
                let t = self.new_node(end, tail, true);
                self.insert_phys_after(used, t);
                self.insert_free(t);
                self.free_ranges += 1;
            }
            self.nodes[node as usize].size = lead;
        }
        self.reclass(node, node_size);
        block(used)
    }

    /// Moves free node `node`, whose size was `old_size`, to its new class if it changed.
    #[inline(always)]
    fn reclass(&mut self, node: u32, old_size: u64) {
        let new_size = self.nodes[node as usize].size;
        if class_of(new_size) != class_of(old_size) {
            self.nodes[node as usize].size = old_size;
            self.remove_free(node);
            self.nodes[node as usize].size = new_size;
            self.insert_free(node);
        }
    }

    fn insert_phys_before(&mut self, at: u32, node: u32) {
        let prev = self.nodes[at as usize].prev_phys;
        self.insert_phys_after(prev, node);
    }

    fn insert_phys_after(&mut self, at: u32, node: u32) {
        let next = self.nodes[at as usize].next_phys;
        self.nodes[node as usize].prev_phys = at;
        self.nodes[node as usize].next_phys = next;
        self.nodes[at as usize].next_phys = node;
        self.nodes[next as usize].prev_phys = node;
    }

    /// Takes `node` out of the physical order and recycles it.
    fn unlink_phys(&mut self, node: u32) {
        let Node {
            prev_phys,
            next_phys,
            ..
        } = self.nodes[node as usize];
        self.nodes[prev_phys as usize].next_phys = next_phys;
        self.nodes[next_phys as usize].prev_phys = prev_phys;
        self.nodes[node as usize].next_free = self.spare;
        self.spare = node;
    }

    fn new_node(&mut self, offset: u64, size: u64, free: bool) -> u32 {
        let node = Node {
            offset,
            size,
            prev_phys: NIL,
            next_phys: NIL,
            prev_free: NIL,
            next_free: if free { NIL } else { USED },
        };
        if self.spare != NIL {
            let i = self.spare;
            self.spare = self.nodes[i as usize].next_free;
            self.nodes[i as usize] = node;
            i
        } else {
            let i = self.nodes.len() as u32;
            debug_assert!(i < USED, "more than 2^32 - 2 ranges");
            debug_assert!(i > EDGE);
            self.nodes.push(node);
            i
        }
    }

    #[inline]
    fn is_free(&self, node: u32) -> bool {
        self.nodes[node as usize].next_free != USED
    }

    #[inline]
    fn insert_free(&mut self, node: u32) {
        let (fl, sl) = class_of(self.nodes[node as usize].size);
        let slot = fl * SL_COUNT + sl;
        let head = self.heads[slot];
        {
            let n = &mut self.nodes[node as usize];
            n.prev_free = NIL;
            n.next_free = head;
        }
        self.nodes[head as usize].prev_free = node;
        self.heads[slot] = node;
        self.fl_bitmap |= 1 << fl;
        self.sl_bitmap[fl] |= 1 << sl;
    }

    #[inline]
    fn remove_free(&mut self, node: u32) {
        let Node {
            size,
            prev_free,
            next_free,
            ..
        } = self.nodes[node as usize];
        // Without branches, which random neighbours would mispredict: the sink takes the
        // writes for a missing neighbour, and the head and bitmaps are updated by selects.
        self.nodes[next_free as usize].prev_free = prev_free;
        self.nodes[prev_free as usize].next_free = next_free;
        let (fl, sl) = class_of(size);
        let slot = fl * SL_COUNT + sl;
        let head = self.heads[slot];
        let head = if head == node { next_free } else { head };
        self.heads[slot] = head;
        self.sl_bitmap[fl] &= !(u64::from(head == NIL) << sl);
        self.fl_bitmap &= !(u64::from(self.sl_bitmap[fl] == 0) << fl);
    }
}

/// Allocator ids only need to be unique; they are not part of any model-checked protocol.
/// After 2^32 allocators the ids wrap; a block would then be misattributed only if it outlived
/// 2^32 allocator creations and was handed to exactly the one that reused its owner's id.
fn next_allocator_id() -> u32 {
    static NEXT: tessera_sync::Counter = tessera_sync::Counter::new(1);
    NEXT.next() as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The smallest size of class `(fl, sl)`.
    fn floor((fl, sl): (usize, usize)) -> u128 {
        if fl == 0 {
            sl as u128
        } else {
            ((SL_COUNT + sl) as u128) << (fl - 1)
        }
    }

    #[test]
    fn classes_are_monotonic_and_bounded() {
        let mut sizes: Vec<u64> = (0..4096).collect();
        sizes.extend((12..64).flat_map(|s| {
            [
                (1u64 << s) - 1,
                1 << s,
                (1 << s) + 1,
                (1 << s) + (1 << (s - 1)),
            ]
        }));
        sizes.push(u64::MAX);
        let mut last = (0, 0);
        for &size in &sizes {
            let c = class_of(size);
            assert!(c >= last, "class of {size} went down");
            assert!(c.0 < FL_COUNT && c.1 < SL_COUNT);
            assert!(floor(c) <= u128::from(size), "{size} below its class {c:?}");
            last = c;
            if let Some(up) = class_at_least(size) {
                assert!(
                    floor(up) >= u128::from(size),
                    "{size}: class {up:?} holds smaller"
                );
                assert!(floor(up) <= u128::from(size) + (u128::from(size) >> SL_BITS));
            }
        }
        assert_eq!(class_of(0), (0, 0));
        assert_eq!(class_of(63), (0, 63));
        assert_eq!(class_of(64), (1, 0));
        assert_eq!(class_of(127), (1, 63));
        assert_eq!(class_of(128), (2, 0));
        assert_eq!(class_of(129), (2, 0));
        assert_eq!(class_at_least(129), Some((2, 1)));
        assert_eq!(class_at_least(u64::MAX), None);
    }
}
