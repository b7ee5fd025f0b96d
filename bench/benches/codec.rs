//! Criterion micro-benchmarks of tessera-framecodec on a storage batch's shape: one column of
//! 1,000 tensors of 4 KiB, encoded as the storage client encodes a PUT and decoded as the unit
//! decodes it (the meta before the payload lands, then bound to the block) and as a GET's
//! receiver decodes a contiguous buffer.

use bytes::{Bytes, BytesMut};
use criterion::{black_box, criterion_group, criterion_main, Criterion};
use tessera_framecodec::{Decoder, Encoder, Tensor, Value};

const ALIGN: u64 = 64;

fn batch() -> Vec<Value> {
    (0..1000u32)
        .map(|i| Value::Tensor(Tensor::from_slice(&[4096], &vec![i as u8; 4096]).unwrap()))
        .collect()
}

fn codec(c: &mut Criterion) {
    let mut g = c.benchmark_group("batch_1000x4k");
    let column = batch();
    let enc = Encoder::new();
    g.bench_function("encode_lists", |b| {
        b.iter(|| enc.encode_lists(black_box(&[&column[..]])).unwrap())
    });
    let frames = enc.encode_lists(&[&column[..]]).unwrap();
    let dec = Decoder::new();
    let table = dec.frame_table(&frames.meta).unwrap();
    let layout = table.layout(ALIGN).unwrap();
    let mut buf = BytesMut::zeroed(layout.size as usize);
    for (i, f) in frames.payloads.iter().enumerate() {
        let at = layout.offsets[i] as usize;
        buf[at..at + f.len()].copy_from_slice(f);
    }
    let buf: Bytes = buf.freeze();
    g.bench_function("frame_table_layout", |b| {
        b.iter(|| {
            dec.frame_table(black_box(&frames.meta))
                .unwrap()
                .layout(ALIGN)
                .unwrap()
        })
    });
    g.bench_function("decode_unbound", |b| {
        b.iter(|| dec.decode_unbound(black_box(&frames.meta), ALIGN).unwrap())
    });
    g.bench_function("decode_unbound_bind", |b| {
        b.iter(|| {
            dec.decode_unbound(black_box(&frames.meta), ALIGN)
                .unwrap()
                .bind(&buf)
                .unwrap()
        })
    });
    g.bench_function("decode_contiguous", |b| {
        b.iter(|| {
            dec.decode_contiguous(black_box(&frames.meta), &buf, ALIGN)
                .unwrap()
        })
    });
    g.finish();
}

criterion_group!(benches, codec);
criterion_main!(benches);
