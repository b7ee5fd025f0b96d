//! Runs (`FLAG_RUNS`): lists of same-shaped tensors as one node and equal frames as one table
//! entry. They decode to exactly what the written-out form decodes to, through every entry
//! point, and a meta that lies about them is refused with a typed error before anything is
//! built for it.

mod common;

use bytes::Bytes;
use proptest::prelude::*;
use tessera_framecodec::{
    decode, DType, DecodeError, Decoder, Encoder, FrameTable, Frames, Limits, PathSeg, Tensor,
    Value, FLAG_RUNS, MIN_RUN,
};

fn tensors(n: usize, len: usize) -> Vec<Value> {
    (0..n)
        .map(|i| {
            let data: Vec<u8> = (0..len).map(|b| (i + b) as u8).collect();
            Tensor::new(DType::U8, &[len as u64], Bytes::from(data))
                .unwrap()
                .into()
        })
        .collect()
}

fn flags(meta: &[u8]) -> u16 {
    u16::from_le_bytes([meta[6], meta[7]])
}

/// `frames` decoded through each entry point gives `value`, every payload a slice of the
/// frames or of the contiguous buffer.
fn decodes_everywhere(frames: &Frames, value: &Value) {
    assert_eq!(&decode(&frames.meta, &frames.payloads).unwrap(), value);
    let buf = common::contiguous(frames, 64);
    let d = Decoder::new();
    let direct = d.decode_contiguous(&frames.meta, &buf, 64).unwrap();
    assert_eq!(&direct, value);
    let later = d
        .decode_unbound(&frames.meta, 64)
        .unwrap()
        .bind(&buf)
        .unwrap();
    assert_eq!(&later, value);
    let range = buf.as_ptr() as usize..buf.as_ptr() as usize + buf.len();
    let mut within = true;
    visit(&direct, &mut |t| {
        within &= t.data().is_empty() || range.contains(&(t.data().as_ptr() as usize));
    });
    assert!(within, "a payload was copied out of the buffer");
}

fn visit(v: &Value, f: &mut impl FnMut(&Tensor)) {
    match v {
        Value::Tensor(t) => f(t),
        Value::List(items) => items.iter().for_each(|v| visit(v, f)),
        Value::Map(entries) => entries.iter().for_each(|(_, v)| visit(v, f)),
        _ => {}
    }
}

/// 1,000 tensors of 4 KiB, each a frame of its own: the meta is a few dozen bytes instead of
/// 32 KB, and decodes to the same value as the written-out form.
#[test]
fn a_batch_of_frames_is_one_node_and_one_table_entry() {
    let column = tensors(1000, 4096);
    let frames = Encoder::new().encode_lists(&[&column]).unwrap();
    let plain = Encoder::new().runs(false).encode_lists(&[&column]).unwrap();
    assert_eq!(flags(&frames.meta), FLAG_RUNS);
    assert_eq!(flags(&plain.meta), 0);
    assert!(
        frames.meta.len() < 64,
        "meta of {} bytes",
        frames.meta.len()
    );
    assert!(plain.meta.len() > 30_000);
    assert_eq!(frames.payloads, plain.payloads);
    let value = Value::List(vec![Value::List(column)]);
    decodes_everywhere(&frames, &value);
    decodes_everywhere(&plain, &value);
    let table = FrameTable::parse(&frames.meta, &Limits::default()).unwrap();
    assert_eq!(table.frames().len(), 1000);
    assert_eq!(table.total_bytes(), 1000 * 4096);
    assert_eq!(table.layout(64).unwrap(), frames.layout(64).unwrap());
}

/// Small tensors packed one after the other in the shared frame: one node with a stride.
#[test]
fn packed_tensors_are_one_node_with_a_stride() {
    // 6-byte u16 tensors at 2-byte alignment: a stride of 6, after a 1-byte string that
    // moves the run off offset 0.
    let column: Vec<Value> = (0..500u16)
        .map(|i| Tensor::from_slice(&[3], &[i, i + 1, i + 2]).unwrap().into())
        .collect();
    let value = Value::map([
        ("first", Value::Bytes(Bytes::from_static(b"x"))),
        ("ids", Value::List(column)),
    ]);
    let frames = Encoder::new().encode(&value).unwrap();
    assert_eq!(flags(&frames.meta), FLAG_RUNS);
    assert_eq!(frames.payloads.len(), 1);
    assert!(
        frames.meta.len() < 80,
        "meta of {} bytes",
        frames.meta.len()
    );
    decodes_everywhere(&frames, &value);
}

/// Strided tensors of one shape and strides make a run too; lists that are not uniform, or
/// shorter than `MIN_RUN`, are written out as before, byte for byte.
#[test]
fn only_uniform_lists_of_min_run_become_runs() {
    let strided: Vec<Value> = (0..8u8)
        .map(|i| {
            Tensor::with_strides(DType::U8, &[2, 2], &[1, 2], Bytes::from(vec![i; 4096]))
                .unwrap()
                .into()
        })
        .collect();
    let v = Value::List(strided);
    let frames = Encoder::new().encode(&v).unwrap();
    assert_eq!(flags(&frames.meta), FLAG_RUNS);
    decodes_everywhere(&frames, &v);

    let mut mixed = tensors(10, 4096);
    mixed[5] = Tensor::new(DType::U8, &[2, 2048], Bytes::from(vec![1u8; 4096]))
        .unwrap()
        .into();
    mixed.push(Value::Null);
    let short = tensors(MIN_RUN - 1, 16);
    for v in [Value::List(mixed), Value::List(short)] {
        let on = Encoder::new().pack_below(4096).encode(&v).unwrap();
        let off = Encoder::new().runs(false).encode(&v).unwrap();
        decodes_everywhere(&on, &v);
        // The mixed list's equal frames still make table runs; the body is written out.
        if flags(&on.meta) == 0 {
            assert_eq!(on.meta, off.meta);
        }
    }
}

/// Strided tensors of one shape and strides may hold payloads of different lengths: such a
/// list is written out, even where its payloads would look like a run of whole frames (the
/// last one packed, at the start of the shared frame that also holds what follows).
#[test]
fn strided_tensors_of_other_lengths_are_no_run() {
    let t = |len: usize, fill: u8| -> Value {
        Tensor::with_strides(DType::U8, &[2, 2], &[1, 2], Bytes::from(vec![fill; len]))
            .unwrap()
            .into()
    };
    let v = Value::map([
        (
            "l",
            Value::List(vec![t(4097, 1), t(4097, 2), t(4096, 3), t(4095, 4)]),
        ),
        ("z", t(8, 5)),
    ]);
    let frames = Encoder::new().encode(&v).unwrap();
    decodes_everywhere(&frames, &v);
}

/// Selecting into a run builds the one tensor on the path, and its rows.
#[test]
fn selecting_into_a_run_builds_one_tensor() {
    let column = tensors(100, 4096);
    let v = Value::map([("x", Value::List(column.clone()))]);
    let frames = Encoder::new().encode(&v).unwrap();
    let d = Decoder::new();
    let got = d
        .select(
            &frames.meta,
            &frames.payloads,
            &[PathSeg::Key("x"), PathSeg::Index(42)],
        )
        .unwrap();
    assert_eq!(got.as_ref(), Some(&column[42]));
    assert_eq!(
        got.unwrap().as_tensor().unwrap().data().as_ptr(),
        frames.payloads[42].as_ptr()
    );
    let row = d
        .select(
            &frames.meta,
            &frames.payloads,
            &[PathSeg::Key("x"), PathSeg::Index(7), PathSeg::Index(3)],
        )
        .unwrap()
        .unwrap();
    assert_eq!(row.as_tensor().unwrap().to_vec::<u8>().unwrap(), [10]);
    let past = d.select(
        &frames.meta,
        &frames.payloads,
        &[PathSeg::Key("x"), PathSeg::Index(100)],
    );
    assert_eq!(past.unwrap(), None);
}

/// A meta frame with `FLAG_RUNS`: table entries `(len, align, repeat)`, then `body`.
fn runs_meta(frames: u32, entries: &[(u64, u32, u32)], body: &[u8]) -> Vec<u8> {
    let mut m = b"TSFC".to_vec();
    m.extend_from_slice(&1u16.to_le_bytes());
    m.extend_from_slice(&FLAG_RUNS.to_le_bytes());
    m.extend_from_slice(&frames.to_le_bytes());
    m.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    for (len, align, repeat) in entries {
        m.extend_from_slice(&len.to_le_bytes());
        m.extend_from_slice(&align.to_le_bytes());
        m.extend_from_slice(&repeat.to_le_bytes());
    }
    m.extend_from_slice(body);
    m
}

/// A tensor list node of u8 tensors of shape `[len]`: `[10, 1, [len], nil, run]`.
fn list_node(len: u8, run: &[u8]) -> Vec<u8> {
    let mut b = vec![0x95, 10, 1, 0x91, len, 0xc0];
    b.extend_from_slice(run);
    b
}

#[test]
fn lying_runs_are_refused_with_typed_errors() {
    let d = Decoder::new();
    let check = |meta: &[u8], frames: &[Bytes]| -> DecodeError {
        let e = d.decode(meta, frames).unwrap_err();
        // The same meta before its payload: refused as well, nothing bound.
        assert!(d.decode_unbound(meta, 64).is_err(), "{e}");
        e
    };
    let four = vec![Bytes::from(vec![1u8; 16]); 4];
    // A run of zero repeats, runs past the header's count, runs short of it, more entries
    // than frames.
    for (count, entries) in [
        (4, vec![(16, 1, 0), (16, 1, 4)]),
        (4, vec![(16, 1, 5)]),
        (4, vec![(16, 1, 3)]),
        (1, vec![(16, 1, 1), (16, 1, 1)]),
    ] {
        let meta = runs_meta(count, &entries, &list_node(16, &[0x92, 0, 4]));
        assert!(
            matches!(
                check(&meta, &four[..count as usize]),
                DecodeError::FrameRuns { .. }
            ),
            "{entries:?}"
        );
    }
    let table = [(16, 1, 4)];
    // Frames past the table; an empty run; a packed run past its frame, with a stride
    // shorter than its items, or of empty items.
    for run in [
        vec![0x92, 1, 4],
        vec![0x92, 0, 0],
        vec![0x95, 0, 0, 4, 4, 5],
        vec![0x95, 0, 0, 4, 2, 4],
        vec![0x95, 0, 0, 0, 0, 4],
        vec![0x93, 0, 0, 4],
    ] {
        let meta = runs_meta(4, &table, &list_node(16, &run));
        assert!(
            matches!(check(&meta, &four), DecodeError::Malformed { .. }),
            "{run:?}"
        );
    }
    // Items whose length is not the shape's: the first, or a later one of the frames.
    let meta = runs_meta(4, &table, &list_node(8, &[0x92, 0, 4]));
    assert!(matches!(check(&meta, &four), DecodeError::Tensor { .. }));
    let mut uneven = four.clone();
    uneven[2] = Bytes::from(vec![1u8; 17]);
    let meta = runs_meta(
        4,
        &[(16, 1, 2), (17, 1, 1), (16, 1, 1)],
        &list_node(16, &[0x92, 0, 4]),
    );
    assert!(matches!(check(&meta, &uneven), DecodeError::Tensor { .. }));
    // u16 items packed at an odd stride: the second is misaligned.
    let mut body = vec![0x95, 10, 3, 0x91, 1, 0xc0];
    body.extend_from_slice(&[0x95, 0, 0, 2, 3, 4]);
    let meta = runs_meta(1, &[(16, 2, 1)], &body);
    assert!(matches!(
        check(&meta, &four[..1]),
        DecodeError::Misaligned { offset: 3, .. }
    ));
    // Tag 10 without the flag is an unknown tag, as it is to a decoder that predates runs.
    let mut plain = common::meta(&[(16, 1); 4], &[]);
    plain.extend(list_node(16, &[0x92, 0, 4]));
    assert!(matches!(
        check(&plain, &four),
        DecodeError::UnknownTag { tag: 10, .. }
    ));
    // A well-formed run decodes.
    let meta = runs_meta(4, &table, &list_node(16, &[0x92, 0, 4]));
    assert_eq!(
        d.decode(&meta, &four).unwrap(),
        Value::List(vec![
            Tensor::new(DType::U8, &[16], four[0].clone())
                .unwrap()
                .into();
            4
        ])
    );
}

/// A few bytes of meta cannot make a decoder build more values than its limits allow: a run's
/// tensors count against `max_elements` and its frames against `max_frames`, before anything
/// is reserved for them.
#[test]
fn runs_count_against_the_limits_before_anything_is_built() {
    let mut limits = Limits::default();
    limits.max_elements = 1000;
    limits.max_frames = 1000;
    let d = Decoder::with_limits(limits);
    // A million 1-byte tensors packed in a 1 MiB frame, from 40 bytes of meta.
    let run = [0x95, 0, 0, 1, 1, 0xce, 0x00, 0x10, 0x00, 0x00];
    let meta = runs_meta(1, &[(1 << 20, 1, 1)], &list_node(1, &run));
    assert!(matches!(
        d.decode_unbound(&meta, 64),
        Err(DecodeError::TooManyElements { limit: 1000 })
    ));
    // A table of a million frames in one entry.
    let meta = runs_meta(1 << 20, &[(1, 1, 1 << 20)], &list_node(1, &[0x92, 0, 4]));
    assert!(matches!(
        d.frame_table(&meta),
        Err(DecodeError::TooManyFrames { .. })
    ));
}

/// `t` with its bytes changed by `i` (a bool stays 0 or 1).
fn varied(t: &Tensor, i: usize) -> Tensor {
    let mask = if t.dtype() == DType::Bool { 1 } else { 0xff };
    let data: Vec<u8> = t.data().iter().map(|b| (b ^ i as u8) & mask).collect();
    let data = Bytes::from(data);
    match t.strides() {
        Some(s) => Tensor::with_strides(t.dtype(), t.shape(), s, data).unwrap(),
        None => Tensor::new(t.dtype(), t.shape(), data).unwrap(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Lists of same-shaped tensors of any dtype and count, framed or packed, beside other
    /// values: the run form decodes to the value, as the written-out form does.
    #[test]
    fn runs_round_trip(
        t in common::tensor(),
        count in 0usize..40,
        pack_below in prop_oneof![Just(0usize), Just(16), Just(4096)],
        other in common::value(),
    ) {
        // Same dtype, shape and strides, each with bytes of its own.
        let column: Vec<Value> = (0..count).map(|i| Value::Tensor(varied(&t, i))).collect();
        let v = Value::map([("col", Value::List(column)), ("other", other)]);
        let on = Encoder::new().pack_below(pack_below).encode(&v).unwrap();
        let off = Encoder::new().pack_below(pack_below).runs(false).encode(&v).unwrap();
        prop_assert_eq!(&on.payloads, &off.payloads);
        prop_assert!(on.meta.len() <= off.meta.len());
        decodes_everywhere(&on, &v);
        let buf = common::contiguous(&on, 64);
        let plain = Decoder::new().decode_contiguous(&off.meta, &common::contiguous(&off, 64), 64);
        prop_assert_eq!(Decoder::new().decode_contiguous(&on.meta, &buf, 64).unwrap(), plain.unwrap());
    }
}
