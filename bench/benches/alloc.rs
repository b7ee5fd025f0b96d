//! Criterion micro-benchmarks of tessera-alloc's hot paths. The side-by-side workloads with
//! their peers live in the harness (`cargo xtask bench alloc`); these track single operations.

use criterion::{black_box, criterion_group, criterion_main, BatchSize, Criterion};
use tessera_alloc::{pack, Allocator, Layout};

fn allocate_free(c: &mut Criterion) {
    let mut g = c.benchmark_group("allocate_free");
    // A warm allocator with 1,000 scattered live blocks, like a pool in use.
    let mut a = Allocator::new(1 << 30);
    let mut keep = Vec::new();
    for i in 0..2_000u64 {
        let b = a.allocate(1024 + (i % 7) * 64, 16).unwrap();
        if i % 2 == 0 {
            keep.push(b);
        } else {
            a.free(b).unwrap();
        }
    }
    for (size, align) in [(64u64, 16u64), (4096, 4096), (1 << 20, 64)] {
        g.bench_function(format!("{size}B_align{align}"), |b| {
            b.iter(|| {
                let block = a.allocate(black_box(size), align).unwrap();
                a.free(block).unwrap();
            })
        });
    }
    let mut oa = offset_allocator::Allocator::<u32>::new(1 << 30);
    g.bench_function("offset_allocator_64B", |b| {
        b.iter(|| {
            let x = oa.allocate(black_box(64)).unwrap();
            oa.free(x);
        })
    });
    g.finish();
    for b in keep {
        a.free(b).unwrap();
    }
}

fn groups(c: &mut Criterion) {
    let items = vec![Layout::new(1024, 4).unwrap(); 10_000];
    c.bench_function("pack_10k", |b| b.iter(|| pack(black_box(&items)).unwrap()));
    c.bench_function("allocate_group_10k_empty_pool", |b| {
        b.iter_batched(
            || Allocator::new(1 << 30),
            |mut a| {
                let g = a.allocate_group(&items).unwrap();
                (a, g)
            },
            BatchSize::LargeInput,
        )
    });
}

criterion_group!(benches, allocate_free, groups);
criterion_main!(benches);
