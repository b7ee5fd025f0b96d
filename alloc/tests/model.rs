//! Model-based property test: random sequences of allocate, free, shrink and allocate_group run against
//! the real allocator and against an oracle that is a sorted list of free ranges.

use proptest::prelude::*;
use tessera_alloc::{pack, AllocError, Allocator, Block, Layout};

#[derive(Debug, Clone)]
enum Op {
    Allocate {
        size: u64,
        align_shift: u32,
    },
    Free {
        pick: usize,
    },
    /// Keeps `keep_per_mille` thousandths of a live block (zero frees it).
    Shrink {
        pick: usize,
        keep_per_mille: u64,
    },
    Group {
        items: Vec<(u64, u32)>,
    },
}

fn size() -> impl Strategy<Value = u64> {
    prop_oneof![3 => 0u64..64, 3 => 1u64..600, 1 => 600u64..5000]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (size(), 0u32..13).prop_map(|(size, align_shift)| Op::Allocate { size, align_shift }),
        4 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        2 => (any::<usize>(), prop_oneof![1 => Just(0u64), 6 => 0u64..1000, 1 => Just(1000u64)])
            .prop_map(|(pick, keep_per_mille)| Op::Shrink { pick, keep_per_mille }),
        2 => prop::collection::vec((size(), 0u32..7), 0..12).prop_map(|items| Op::Group { items }),
    ]
}

/// Free ranges `[start, end)`, sorted, merged.
#[derive(Debug, Clone, PartialEq)]
struct Oracle(Vec<(u64, u64)>);

impl Oracle {
    fn take(&mut self, start: u64, end: u64) {
        let i = self
            .0
            .iter()
            .position(|&(s, e)| s <= start && end <= e)
            .unwrap_or_else(|| panic!("[{start}, {end}) is not free in {:?}", self.0));
        let (s, e) = self.0.remove(i);
        if end < e {
            self.0.insert(i, (end, e));
        }
        if s < start {
            self.0.insert(i, (s, start));
        }
    }

    fn give(&mut self, start: u64, end: u64) {
        let i = self.0.partition_point(|&(s, _)| s < start);
        assert!(
            i == 0 || self.0[i - 1].1 <= start,
            "double free of [{start}, {end})"
        );
        assert!(
            i == self.0.len() || end <= self.0[i].0,
            "double free of [{start}, {end})"
        );
        self.0.insert(i, (start, end));
        if i + 1 < self.0.len() && self.0[i].1 == self.0[i + 1].0 {
            self.0[i].1 = self.0[i + 1].1;
            self.0.remove(i + 1);
        }
        if i > 0 && self.0[i - 1].1 == self.0[i].0 {
            self.0[i - 1].1 = self.0[i].1;
            self.0.remove(i);
        }
    }

    fn fits(&self, size: u64, align: u64) -> bool {
        self.0.iter().any(|&(s, e)| {
            let start = s.div_ceil(align) * align;
            start <= e && e - start >= size
        })
    }

    fn free(&self) -> u64 {
        self.0.iter().map(|&(s, e)| e - s).sum()
    }
}

fn check(a: &Allocator, oracle: &Oracle, live: &[Block]) {
    let real: Vec<(u64, u64)> = a.free_ranges().map(|r| (r.start, r.end)).collect();
    assert_eq!(real, oracle.0, "free ranges differ from the oracle");
    for w in real.windows(2) {
        assert!(w[0].1 < w[1].0, "adjacent or overlapping free ranges {w:?}");
    }
    let report = a.report();
    let used: u64 = live.iter().map(Block::size).sum();
    assert_eq!(report.used + report.free, report.capacity);
    assert_eq!(report.used, used);
    assert_eq!(report.free, oracle.free());
    assert_eq!(a.free_bytes(), oracle.free());
    assert_eq!(report.free_ranges, real.len() as u64);
    assert_eq!(
        report.live_blocks,
        live.iter().filter(|b| b.size() > 0).count() as u64
    );
    assert_eq!(
        report.largest_free,
        real.iter().map(|&(s, e)| e - s).max().unwrap_or(0)
    );
    let mut spans: Vec<(u64, u64)> = live
        .iter()
        .filter(|b| b.size() > 0)
        .map(|b| (b.offset(), b.end()))
        .collect();
    spans.sort_unstable();
    for w in spans.windows(2) {
        assert!(w[0].1 <= w[1].0, "live blocks overlap: {w:?}");
    }
}

fn run(capacity: u64, ops: Vec<Op>) {
    let mut a = Allocator::new(capacity);
    let mut oracle = Oracle(if capacity > 0 {
        vec![(0, capacity)]
    } else {
        vec![]
    });
    let mut live: Vec<Block> = Vec::new();
    for op in ops {
        match op {
            Op::Allocate { size, align_shift } => {
                let align = 1u64 << align_shift;
                match a.allocate(size, align) {
                    Ok(b) => {
                        assert_eq!(b.size(), size);
                        assert_eq!(b.offset() % align, 0);
                        if size > 0 {
                            oracle.take(b.offset(), b.end());
                        }
                        live.push(b);
                    }
                    Err(AllocError::OutOfMemory { .. }) => {
                        assert!(
                            !oracle.fits(size, align),
                            "false out-of-memory for {size} aligned {align}"
                        );
                    }
                    Err(e) => panic!("unexpected {e}"),
                }
            }
            Op::Free { pick } => {
                if !live.is_empty() {
                    let b = live.swap_remove(pick % live.len());
                    if b.size() > 0 {
                        oracle.give(b.offset(), b.end());
                    }
                    a.free(b).unwrap();
                }
            }
            Op::Shrink {
                pick,
                keep_per_mille,
            } => {
                if !live.is_empty() {
                    let b = live.swap_remove(pick % live.len());
                    let (offset, old) = (b.offset(), b.size());
                    let keep = old * keep_per_mille / 1000;
                    let b = a.shrink(b, keep).unwrap();
                    assert_eq!(b.size(), keep.min(old));
                    if keep > 0 {
                        assert_eq!(b.offset(), offset, "a shrunk block keeps its offset");
                    }
                    if keep < old {
                        oracle.give(offset + keep, offset + old);
                    }
                    live.push(b);
                }
            }
            Op::Group { items } => {
                let layouts: Vec<Layout> = items
                    .iter()
                    .map(|&(s, sh)| Layout::new(s, 1 << sh).unwrap())
                    .collect();
                let packing = pack(&layouts).unwrap();
                let one_range_fits = oracle.fits(packing.size, packing.align);
                let before = (oracle.clone(), a.report());
                match a.allocate_group(&layouts) {
                    Ok(g) => {
                        if packing.size > 0 && one_range_fits {
                            assert_eq!(g.blocks.len(), 1, "a free range holds the packed group");
                        }
                        assert_eq!(g.placements.len(), layouts.len());
                        let mut last_block = 0;
                        let mut cursor = 0;
                        for (item, p) in layouts.iter().zip(&g.placements) {
                            match p {
                                None => assert_eq!(item.size(), 0),
                                Some(p) => {
                                    assert!(item.size() > 0);
                                    let block = &g.blocks[p.block];
                                    let at = block.offset() + p.offset;
                                    assert_eq!(at % item.align(), 0, "misaligned item");
                                    assert!(at + item.size() <= block.end(), "item spills out");
                                    // Items keep their order: runs are contiguous, never interleaved.
                                    assert!(
                                        p.block > last_block
                                            || (p.block == last_block && at >= cursor)
                                    );
                                    last_block = p.block;
                                    cursor = at + item.size();
                                }
                            }
                        }
                        for b in &g.blocks {
                            assert!(b.size() > 0, "empty block in a group");
                            oracle.take(b.offset(), b.end());
                        }
                        live.extend(g.blocks);
                    }
                    Err(AllocError::OutOfMemory { .. }) => {
                        assert!(!one_range_fits || packing.size == 0);
                        assert_eq!(
                            (oracle.clone(), a.report()),
                            before,
                            "a failed group changed the state"
                        );
                    }
                    Err(e) => panic!("unexpected {e}"),
                }
            }
        }
        check(&a, &oracle, &live);
    }
    for b in live.drain(..) {
        if b.size() > 0 {
            oracle.give(b.offset(), b.end());
        }
        a.free(b).unwrap();
    }
    check(&a, &oracle, &live);
    assert_eq!(a.report().free_ranges, u64::from(capacity > 0));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn matches_the_free_range_oracle(
        capacity in prop_oneof![Just(0u64), Just(24), 1u64..256, Just(4096), Just(20_000)],
        ops in prop::collection::vec(op(), 1..120),
    ) {
        run(capacity, ops);
    }
}
