//! One test per rule of the allocator's contract, including every case where Ray's Python pool
//! breaks.

use tessera_alloc::{AllocError, Allocator, Layout, Report};

fn l(size: u64, align: u64) -> Layout {
    Layout::new(size, align).unwrap()
}

fn ranges(a: &Allocator) -> Vec<(u64, u64)> {
    a.free_ranges().map(|r| (r.start, r.end)).collect()
}

#[test]
fn exact_fit_across_separate_calls() {
    let mut a = Allocator::new(24);
    let x = a.allocate(12, 4).unwrap();
    let y = a.allocate(12, 4).unwrap();
    assert_eq!(
        (x.offset(), x.size(), y.offset(), y.size()),
        (0, 12, 12, 12)
    );
    assert_eq!(a.report().free, 0);
    assert!(matches!(
        a.allocate(1, 1),
        Err(AllocError::OutOfMemory { .. })
    ));
    a.free(x).unwrap();
    a.free(y).unwrap();
    assert_eq!(ranges(&a), vec![(0, 24)]);
}

#[test]
fn exact_fit_as_one_group() {
    let mut a = Allocator::new(24);
    let g = a.allocate_group(&[l(12, 4), l(12, 4)]).unwrap();
    assert_eq!(g.blocks.len(), 1);
    assert_eq!(g.blocks[0].size(), 24);
    assert_eq!(a.report().free, 0);
}

#[test]
fn blocks_are_never_rounded_up() {
    let mut a = Allocator::new(1 << 20);
    for (size, align) in [
        (1, 1),
        (3, 2),
        (13, 4),
        (100, 64),
        (4097, 4096),
        (70_001, 16),
    ] {
        let b = a.allocate(size, align).unwrap();
        assert_eq!(b.size(), size);
        assert_eq!(b.offset() % align, 0);
        let before = a.report().used;
        a.free(b).unwrap();
        assert_eq!(a.report().used, before - size);
    }
}

#[test]
fn complex128_gets_16_byte_alignment() {
    let mut a = Allocator::new(128);
    let byte = a.allocate(1, 1).unwrap();
    let c128 = a.allocate(16, 16).unwrap();
    assert_eq!(c128.offset(), 16);
    // The gap before it stays free and usable.
    let small = a.allocate(15, 1).unwrap();
    assert_eq!(small.offset(), 1);
    // Ray's packer would place int8[3], f64[2], c128[1] at 0, 8, 32.
    let g = a.allocate_group(&[l(3, 1), l(16, 8), l(16, 16)]).unwrap();
    let base = g.blocks[0].offset();
    let offsets: Vec<u64> = g
        .placements
        .iter()
        .map(|p| base + p.unwrap().offset)
        .collect();
    assert_eq!(offsets[2] % 16, 0);
    assert_eq!(offsets[1] % 8, 0);
    for b in [byte, c128, small].into_iter().chain(g.blocks) {
        a.free(b).unwrap();
    }
    assert_eq!(ranges(&a), vec![(0, 128)]);
}

#[test]
fn every_power_of_two_alignment_up_to_2_pow_40() {
    let mut a = Allocator::new(1 << 48);
    let first = a.allocate(1, 1).unwrap();
    for shift in 0..=40 {
        let align = 1u64 << shift;
        let b = a.allocate(3, align).unwrap();
        assert_eq!(b.offset() % align, 0, "align {align}");
        a.free(b).unwrap();
    }
    a.free(first).unwrap();
    assert_eq!(
        a.allocate(8, 12),
        Err(AllocError::InvalidAlignment { align: 12 })
    );
    assert_eq!(
        a.allocate(8, 0),
        Err(AllocError::InvalidAlignment { align: 0 })
    );
}

#[test]
fn capacity_of_2_pow_48_and_beyond() {
    for capacity in [1u64 << 48, u64::MAX] {
        let mut a = Allocator::new(capacity);
        let big = a.allocate(capacity / 2, 4096).unwrap();
        let rest = a.allocate(capacity - capacity / 2, 1).unwrap();
        assert_eq!(a.report().free, 0);
        assert_eq!(rest.end(), capacity);
        a.free(big).unwrap();
        a.free(rest).unwrap();
        assert_eq!(ranges(&a), vec![(0, capacity)]);
    }
}

#[test]
fn slow_path_finds_the_last_fitting_aligned_range() {
    // One free range of 100 bytes at offset 28: a 64-aligned request of 36 bytes fits only at
    // 64..100, which the guaranteed-fit class search (36 + 63 bytes) cannot see.
    let mut a = Allocator::new(128);
    let head = a.allocate(28, 1).unwrap();
    let tail = a.allocate(100, 1).unwrap();
    let pad = {
        a.free(tail).unwrap();
        a.allocate_group(&[]).unwrap()
    };
    assert!(pad.blocks.is_empty());
    assert_eq!(ranges(&a), vec![(28, 128)]);
    let b = a.allocate(64, 64).unwrap();
    assert_eq!(b.offset(), 64);
    a.free(b).unwrap();
    // Grants up to the largest free aligned range, not a rounded-down class size.
    let largest = a.allocate(100, 1).unwrap();
    assert_eq!(largest.range(), 28..128);
    a.free(largest).unwrap();
    a.free(head).unwrap();
}

#[test]
fn neighbours_merge_on_free_in_any_order() {
    let mut a = Allocator::new(1000);
    let blocks: Vec<_> = (0..10).map(|_| a.allocate(100, 4).unwrap()).collect();
    let mut order: Vec<_> = blocks.into_iter().enumerate().collect();
    order.sort_by_key(|(i, _)| (i * 7) % 10);
    for (_, b) in order {
        a.free(b).unwrap();
        let r = ranges(&a);
        for w in r.windows(2) {
            assert!(w[0].1 < w[1].0, "adjacent free ranges {r:?}");
        }
    }
    assert_eq!(ranges(&a), vec![(0, 1000)]);
    assert_eq!(a.report().free_ranges, 1);
}

#[test]
fn block_from_another_allocator_is_refused_and_returned() {
    let mut a = Allocator::new(100);
    let mut b = Allocator::new(100);
    let from_a = a.allocate(10, 1).unwrap();
    let before = b.report();
    let err = b.free(from_a).unwrap_err();
    assert!(err.to_string().contains("another allocator"), "{err}");
    assert_eq!(b.report(), before);
    let from_a = err.into_block();
    a.free(from_a).unwrap();
    assert_eq!(a.report().used, 0);
    // Zero-size blocks carry their owner too.
    let empty = a.allocate(0, 8).unwrap();
    assert!(b.free(empty).is_err());
}

#[test]
fn zero_size_requests_consume_nothing() {
    let mut a = Allocator::new(16);
    let full = a.allocate(16, 1).unwrap();
    let z = a.allocate(0, 4096).unwrap();
    assert_eq!(z.size(), 0);
    assert_eq!(a.report().live_blocks, 1);
    a.free(z).unwrap();
    a.free(full).unwrap();
    assert_eq!(a.report().free, 16);
}

#[test]
fn zero_size_items_at_the_end_of_a_group_and_on_a_full_pool() {
    let mut a = Allocator::new(24);
    let g = a.allocate_group(&[l(12, 4), l(12, 4), l(0, 16)]).unwrap();
    assert_eq!(g.blocks.len(), 1);
    assert_eq!(g.placements[2], None);
    assert_eq!(a.report().free, 0);
    // The pool is full: all-empty groups and lone zero-size items still succeed.
    let empty = a.allocate_group(&[l(0, 4), l(0, 8)]).unwrap();
    assert!(empty.blocks.is_empty());
    assert_eq!(empty.placements, vec![None, None]);
    let z = a.allocate(0, 16).unwrap();
    a.free(z).unwrap();
    assert!(matches!(
        a.allocate_group(&[l(0, 4), l(1, 1)]),
        Err(AllocError::OutOfMemory { .. })
    ));
}

#[test]
fn out_of_memory_carries_the_numbers() {
    let mut a = Allocator::new(100);
    let x = a.allocate(40, 1).unwrap();
    let y = a.allocate(20, 1).unwrap();
    a.free(x).unwrap();
    // Free: [0, 40) and [60, 100).
    let err = a.allocate(41, 1).unwrap_err();
    assert_eq!(
        err,
        AllocError::OutOfMemory {
            requested: 41,
            align: 1,
            free: 80,
            largest_free: 40
        }
    );
    assert!(err.to_string().contains("largest free range 40"), "{err}");
    a.free(y).unwrap();
}

fn snapshot(a: &Allocator) -> (Report, Vec<(u64, u64)>) {
    (a.report(), ranges(a))
}

#[test]
fn failure_leaves_the_state_untouched() {
    let mut a = Allocator::new(1000);
    let mut keep = Vec::new();
    for i in 0..10 {
        let b = a.allocate(60, 4).unwrap();
        if i % 2 == 0 {
            keep.push(b);
        } else {
            keep.push(a.allocate(1, 1).unwrap());
            a.free(b).unwrap();
        }
    }
    let before = snapshot(&a);
    // More bytes than are free: refused up front.
    assert!(a.allocate_group(&[l(900, 1)]).is_err());
    assert_eq!(snapshot(&a), before);
    // Fits by total bytes but not item by item: some blocks are taken, then all given back.
    let items: Vec<Layout> = (0..6).map(|_| l(59, 1)).chain([l(300, 1)]).collect();
    assert!(a.allocate_group(&items).is_err());
    assert_eq!(snapshot(&a), before);
    assert!(a.allocate(1000, 1).is_err());
    assert_eq!(snapshot(&a), before);
    for b in keep {
        a.free(b).unwrap();
    }
}

#[test]
fn group_uses_one_best_fit_block_when_a_range_holds_it() {
    // Holes of 200, 100 and 150 bytes (in address order), then the large tail.
    let mut a = Allocator::new(10_000);
    let sizes = [200u64, 1, 100, 1, 150, 1];
    let mut blocks: Vec<_> = sizes.iter().map(|&s| a.allocate(s, 1).unwrap()).collect();
    let mut holes = Vec::new();
    for i in [4, 2, 0] {
        holes.push(blocks.remove(i));
    }
    for h in holes {
        a.free(h).unwrap();
    }
    let g = a.allocate_group(&[l(40, 4), l(40, 8), l(40, 8)]).unwrap();
    assert_eq!(g.blocks.len(), 1);
    // The 150-byte hole [302, 452) is the best fit; the block starts 8-aligned inside it.
    assert_eq!(g.blocks[0].range(), 304..424);
    for b in blocks.into_iter().chain(g.blocks) {
        a.free(b).unwrap();
    }
}

#[test]
fn group_splits_into_runs_and_never_splits_an_item() {
    // Three holes of 100 bytes; five 40-byte items need three blocks.
    let mut a = Allocator::new(1000);
    let mut fences = Vec::new();
    let mut holes = Vec::new();
    for _ in 0..3 {
        holes.push(a.allocate(100, 1).unwrap());
        fences.push(a.allocate(1, 1).unwrap());
    }
    fences.push(a.allocate(a.report().free, 1).unwrap());
    for h in holes {
        a.free(h).unwrap();
    }
    let items: Vec<Layout> = (0..5).map(|_| l(40, 4)).collect();
    let g = a.allocate_group(&items).unwrap();
    assert_eq!(g.blocks.len(), 3);
    let mut seen_blocks = Vec::new();
    for (i, p) in g.placements.iter().enumerate() {
        let p = p.unwrap();
        let block = &g.blocks[p.block];
        let start = block.offset() + p.offset;
        assert_eq!(start % 4, 0);
        assert!(
            start + items[i].size() <= block.end(),
            "item {i} spills out of its block"
        );
        seen_blocks.push(p.block);
    }
    // Contiguous runs in item order.
    assert!(
        seen_blocks.windows(2).all(|w| w[0] <= w[1]),
        "{seen_blocks:?}"
    );
    for b in fences.into_iter().chain(g.blocks) {
        a.free(b).unwrap();
    }
    assert_eq!(a.report().free_ranges, 1);
}

#[test]
fn scattered_groups_fill_n_holes_with_n_items() {
    let n = 2_000;
    let mut a = Allocator::new(n * 2 * 1024);
    let mut fences = Vec::new();
    let mut holes = Vec::new();
    for _ in 0..n {
        holes.push(a.allocate(1024, 4).unwrap());
        fences.push(a.allocate(1024, 4).unwrap());
    }
    for h in holes {
        a.free(h).unwrap();
    }
    let items: Vec<Layout> = (0..n).map(|_| l(1024, 4)).collect();
    let g = a.allocate_group(&items).unwrap();
    assert_eq!(g.blocks.len(), n as usize);
    assert_eq!(a.report().free, 0);
    for b in fences.into_iter().chain(g.blocks) {
        a.free(b).unwrap();
    }
    assert_eq!(a.report().free_ranges, 1);
}

/// A shrunk block keeps its first bytes where they were; its tail is free at once, merged with
/// a free neighbour or a range of its own, and a later allocation can take it. Another
/// allocator's block is handed back untouched.
#[test]
fn shrink_frees_the_tail_at_once() {
    let mut a = Allocator::new(1000);
    let x = a.allocate(400, 8).unwrap();
    let y = a.allocate(100, 8).unwrap();
    // Followed by a used block: the tail becomes a range of its own.
    let x = a.shrink(x, 150).unwrap();
    assert_eq!((x.offset(), x.size()), (0, 150));
    assert_eq!(ranges(&a), vec![(150, 400), (500, 1000)]);
    // Followed by a free range: the tail joins it.
    let y = a.shrink(y, 60).unwrap();
    assert_eq!((y.offset(), y.size()), (400, 60));
    assert_eq!(ranges(&a), vec![(150, 400), (460, 1000)]);
    assert_eq!(a.report().used, 210);
    let z = a.allocate(250, 1).unwrap();
    assert_eq!(z.offset(), 150, "the freed tail is allocatable");
    // At or above its size, nothing changes; zero frees it.
    let y = a.shrink(y, 60).unwrap();
    assert_eq!(y.size(), 60);
    let y = a.shrink(y, 0).unwrap();
    assert_eq!(y.size(), 0);
    assert_eq!(ranges(&a), vec![(400, 1000)]);
    let mut other = Allocator::new(64);
    let w = other.allocate(32, 1).unwrap();
    let w = a.shrink(w, 16).unwrap_err().into_block();
    assert_eq!(w.size(), 32);
    other.free(w).unwrap();
    for b in [x, y, z] {
        a.free(b).unwrap();
    }
    assert_eq!(ranges(&a), vec![(0, 1000)]);
}
