//! `alloc` suite: tessera-alloc against offset-allocator 0.2 and rlsf 0.2, on the same operation
//! sequences in the same run.

use std::alloc::Layout as StdLayout;
use std::mem::MaybeUninit;
use std::ptr::NonNull;

use anyhow::{ensure, Result};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tessera_alloc::{Allocator, Block, Layout};

use crate::report::{Line, Series};
use crate::timing::{best_of, ns, us};
use crate::Report;

const GIB: u64 = 1 << 30;
const ALIGN: u64 = 16;
const A_LIVE: usize = 1_000;
const A_STEPS: usize = 1_000_000;
const B_COUNT: usize = 10_000;
const PROBE_EVERY: usize = 1_000;
const RUNS: usize = 3;

/// The three allocators behind one face, so every workload runs the same code for each.
trait Subject {
    type Handle;
    fn alloc(&mut self, size: u64) -> Option<Self::Handle>;
    fn free(&mut self, handle: Self::Handle);
}

struct Tessera(Allocator);

impl Subject for Tessera {
    type Handle = Block;
    #[inline]
    fn alloc(&mut self, size: u64) -> Option<Block> {
        self.0.allocate(size, ALIGN).ok()
    }
    #[inline]
    fn free(&mut self, handle: Block) {
        self.0.free(handle).expect("own block");
    }
}

struct OffsetAlloc(offset_allocator::Allocator);

impl Subject for OffsetAlloc {
    type Handle = offset_allocator::Allocation;
    #[inline]
    fn alloc(&mut self, size: u64) -> Option<Self::Handle> {
        self.0.allocate(u32::try_from(size).ok()?)
    }
    #[inline]
    fn free(&mut self, handle: Self::Handle) {
        self.0.free(handle);
    }
}

/// rlsf writes its headers into the managed memory, so it needs a real buffer behind the pool.
struct Rlsf<'p>(rlsf::Tlsf<'p, u32, u32, 28, 32>);

impl Subject for Rlsf<'_> {
    type Handle = NonNull<u8>;
    #[inline]
    fn alloc(&mut self, size: u64) -> Option<NonNull<u8>> {
        self.0
            .allocate(StdLayout::from_size_align(size as usize, ALIGN as usize).ok()?)
    }
    #[inline]
    fn free(&mut self, handle: NonNull<u8>) {
        // SAFETY: every handle comes from `alloc` on this very Tlsf with alignment ALIGN, and
        // each is freed exactly once (the workloads move handles out of their slots).
        unsafe { self.0.deallocate(handle, ALIGN as usize) }
    }
}

fn with_rlsf<T>(f: impl FnOnce(&mut Rlsf<'_>) -> T) -> T {
    let mut pool: Vec<MaybeUninit<u8>> = Vec::with_capacity(GIB as usize + 4096);
    pool.resize_with(GIB as usize + 4096, MaybeUninit::uninit);
    let mut tlsf = rlsf::Tlsf::new();
    tlsf.insert_free_block(&mut pool[..]);
    f(&mut Rlsf(tlsf))
}

fn new_tessera() -> Tessera {
    Tessera(Allocator::new(GIB))
}

fn new_offset() -> OffsetAlloc {
    OffsetAlloc(offset_allocator::Allocator::new(GIB as u32))
}

/// Workload A's operations: the initial sizes, then (victim slot, new size) per step. Sizes are
/// log-uniform from 64 B to 1 MiB, rounded up to the alignment so that the peers, which know no
/// alignment, return aligned offsets too.
struct WorkloadA {
    initial: Vec<u64>,
    steps: Vec<(u32, u64)>,
}

fn log_uniform(rng: &mut SmallRng) -> u64 {
    let lo = 64f64.ln();
    let hi = (1u64 << 20) as f64;
    let size = rng.gen_range(lo..hi.ln()).exp() as u64;
    size.div_ceil(ALIGN) * ALIGN
}

fn workload_a() -> WorkloadA {
    let mut rng = SmallRng::seed_from_u64(0x7e55e7a);
    WorkloadA {
        initial: (0..A_LIVE).map(|_| log_uniform(&mut rng)).collect(),
        steps: (0..A_STEPS)
            .map(|_| (rng.gen_range(0..A_LIVE as u32), log_uniform(&mut rng)))
            .collect(),
    }
}

/// Runs workload A; with `probe`, measures the fragmentation ratio every PROBE_EVERY steps.
/// Returns the failed allocations and the probes as (step, ratio).
fn run_a<S: Subject>(s: &mut S, w: &WorkloadA, probe: bool) -> (usize, Vec<(f64, f64)>) {
    let mut live: Vec<Option<(S::Handle, u64)>> = w
        .initial
        .iter()
        .map(|&size| s.alloc(size).map(|h| (h, size)))
        .collect();
    let mut failed = live.iter().filter(|x| x.is_none()).count();
    let mut probes = Vec::new();
    for (i, &(slot, size)) in w.steps.iter().enumerate() {
        if let Some((h, _)) = live[slot as usize].take() {
            s.free(h);
        }
        let h = s.alloc(size);
        failed += usize::from(h.is_none());
        live[slot as usize] = h.map(|h| (h, size));
        if probe && i % PROBE_EVERY == PROBE_EVERY - 1 {
            let used: u64 = live.iter().flatten().map(|(_, size)| size).sum();
            let free = GIB - used;
            let ratio = largest_grantable(s, free) as f64 / free as f64;
            probes.push(((i + 1) as f64, ratio));
        }
    }
    for (h, _) in live.into_iter().flatten() {
        s.free(h);
    }
    (failed, probes)
}

fn worst(probes: &[(f64, f64)]) -> f64 {
    probes.iter().map(|p| p.1).fold(1.0, f64::min)
}

fn mean(probes: &[(f64, f64)]) -> f64 {
    probes.iter().map(|p| p.1).sum::<f64>() / probes.len().max(1) as f64
}

/// The largest size `s` grants right now, by binary search over real allocate/free calls.
fn largest_grantable<S: Subject>(s: &mut S, free: u64) -> u64 {
    let (mut lo, mut hi) = (0u64, free / ALIGN);
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        match s.alloc(mid * ALIGN) {
            Some(h) => {
                s.free(h);
                lo = mid;
            }
            None => hi = mid - 1,
        }
    }
    lo * ALIGN
}

/// Every workload leaves its allocator empty again, so one instance serves all runs: the first,
/// untimed, warms its side table (or, for rlsf, its pool) like any long-lived pool.
/// Nanoseconds one call of `f` takes.
fn time_once<T>(f: impl FnOnce() -> T) -> f64 {
    let start = std::time::Instant::now();
    std::hint::black_box(f());
    ns(start.elapsed())
}

fn run_b<S: Subject>(s: &mut S, order: &[usize]) {
    let mut handles: Vec<Option<S::Handle>> = (0..B_COUNT).map(|_| s.alloc(1024)).collect();
    for &i in order {
        if let Some(h) = handles[i].take() {
            s.free(h);
        }
    }
}

/// A pool whose free space is exactly `n` holes of 1 KiB, each between two used fences.
fn scattered(n: u64) -> (Allocator, Vec<Block>) {
    let mut a = Allocator::new(2 * n * 1024);
    let mut fences = Vec::new();
    let mut holes = Vec::new();
    for _ in 0..n {
        holes.push(a.allocate(1024, 4).expect("fits"));
        fences.push(a.allocate(1024, 4).expect("fits"));
    }
    for h in holes {
        a.free(h).expect("own block");
    }
    (a, fences)
}

fn scatter_us(n: u64) -> Result<f64> {
    let items = vec![Layout::new(1024, 4)?; n as usize];
    let mut blocks = 0;
    let d = best_of(
        RUNS * 3,
        || scattered(n),
        |(mut a, fences)| {
            let g = a.allocate_group(&items).expect("n items fit n holes");
            blocks = g.blocks.len();
            (a, fences, g)
        },
    );
    ensure!(blocks == n as usize, "scatter of {n} used {blocks} blocks");
    Ok(us(d))
}

/// Fills `report` with the alloc suite's metrics.
pub fn run(report: &mut Report) -> Result<()> {
    let w = workload_a();
    // One instance of each serves every round (each run leaves it empty again); rounds are
    // interleaved so that load from other work on the machine hits all three alike.
    let (mut t, mut o) = (new_tessera(), new_offset());
    let [a_tessera, a_offset, a_rlsf] = with_rlsf(|r| {
        let mut best = [f64::MAX; 3];
        for round in 0..=RUNS {
            let d = [
                time_once(|| run_a(&mut t, &w, false)),
                time_once(|| run_a(&mut o, &w, false)),
                time_once(|| run_a(r, &w, false)),
            ];
            if round > 0 {
                for (b, d) in best.iter_mut().zip(d) {
                    *b = b.min(d / (2 * A_STEPS) as f64);
                }
            }
        }
        best
    });
    let how_a = "1M free+allocate pairs over 1 GiB, ~1,000 live, 64 B-1 MiB log-uniform, align 16; one warm-up round, then best of 3 rounds interleaved with the peers, wall time / 2M ops";
    report.put("a_ns_per_op", a_tessera, how_a);
    report.put(
        "a_offset_allocator_ns_per_op",
        a_offset,
        "same sequence, offset-allocator 0.2",
    );
    report.put(
        "a_rlsf_ns_per_op",
        a_rlsf,
        "same sequence, rlsf 0.2 (32 classes)",
    );
    report.put(
        "a_ratio_offset_allocator",
        a_tessera / a_offset,
        "tessera / offset-allocator",
    );
    report.put("a_ratio_rlsf", a_tessera / a_rlsf, "tessera / rlsf");

    let mut rng = SmallRng::seed_from_u64(0xb0b);
    let mut order: Vec<usize> = (0..B_COUNT).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.gen_range(0..=i));
    }
    let [b_tessera, b_offset, b_rlsf] = with_rlsf(|r| {
        let mut best = [f64::MAX; 3];
        for round in 0..=RUNS * 3 {
            let d = [
                time_once(|| run_b(&mut t, &order)),
                time_once(|| run_b(&mut o, &order)),
                time_once(|| run_b(r, &order)),
            ];
            if round > 0 {
                for (b, d) in best.iter_mut().zip(d) {
                    *b = b.min(d / (2 * B_COUNT) as f64);
                }
            }
        }
        best
    });
    report.put("b_ns_per_op", b_tessera, "10,000 x 1 KiB allocate, then free in random order; warm-up round, then best of 9 rounds interleaved with the peers, wall time / 20k ops");
    report.put("b_rlsf_ns_per_op", b_rlsf, "same sequence, rlsf 0.2");
    report.put(
        "b_offset_allocator_ns_per_op",
        b_offset,
        "same sequence, offset-allocator 0.2",
    );
    report.put("b_ratio_rlsf", b_tessera / b_rlsf, "tessera / rlsf");
    report.put(
        "b_ratio_offset_allocator",
        b_tessera / b_offset,
        "tessera / offset-allocator",
    );

    let (fail_t, probes_t) = run_a(&mut new_tessera(), &w, true);
    let (fail_o, probes_o) = run_a(&mut new_offset(), &w, true);
    let (fail_r, probes_r) = with_rlsf(|r| run_a(r, &w, true));
    let (frag_t, frag_o, frag_r) = (worst(&probes_t), worst(&probes_o), worst(&probes_r));
    let how_frag = "workload A, every 1,000 steps: largest grantable size (binary search of real allocations, align 16) / free bytes; worst value";
    report.put("frag_worst", frag_t, how_frag);
    report.put(
        "frag_worst_offset_allocator",
        frag_o,
        "same probe, offset-allocator 0.2",
    );
    report.put("frag_worst_rlsf", frag_r, "same probe, rlsf 0.2");
    report.put("frag_mean", mean(&probes_t), "mean of the same probes");
    report.put(
        "frag_mean_offset_allocator",
        mean(&probes_o),
        "mean, offset-allocator 0.2",
    );
    report.put("frag_mean_rlsf", mean(&probes_r), "mean, rlsf 0.2");
    report.series(Series {
        name: "fragmentation".into(),
        title: "Largest grantable / free bytes during workload A".into(),
        x_label: "step".into(),
        y_label: "largest grantable / free".into(),
        log_x: false,
        lines: vec![
            Line {
                label: "tessera-alloc".into(),
                points: probes_t,
            },
            Line {
                label: "offset-allocator 0.2".into(),
                points: probes_o,
            },
            Line {
                label: "rlsf 0.2".into(),
                points: probes_r,
            },
        ],
    });
    report.put(
        "a_failed_allocations",
        fail_t as f64,
        "workload A allocations refused (tessera)",
    );
    report.put(
        "a_failed_allocations_peers",
        (fail_o + fail_r) as f64,
        "workload A allocations refused (offset-allocator + rlsf)",
    );

    let items = vec![Layout::new(1024, 4)?; 10_000];
    let group = best_of(RUNS * 3, new_tessera, |mut a| {
        let g = a.0.allocate_group(&items).expect("fits");
        assert_eq!(g.blocks.len(), 1);
        (a, g)
    });
    report.put(
        "group_10k_us",
        us(group),
        "allocate_group of 10,000 float32[256] into an empty 1 GiB pool (one block); best of 9",
    );
    let s1 = scatter_us(1_000)?;
    let s16 = scatter_us(16_000)?;
    report.put(
        "scatter_1k_us",
        s1,
        "1,000 x 1 KiB items into 1,000 separate 1 KiB holes; best of 9",
    );
    report.put(
        "scatter_16k_us",
        s16,
        "16,000 items into 16,000 holes; best of 9",
    );
    report.put("scatter_16k_over_1k", s16 / s1, "linear scaling is 16");
    Ok(())
}
