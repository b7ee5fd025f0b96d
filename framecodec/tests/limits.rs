//! Every limit at its boundary: a value exactly at a limit is accepted, one just over it is
//! refused with the typed error and its numbers. Meta frames are written by hand, so that the
//! body and table hold exactly the sizes under test.

mod common;

use bytes::Bytes;
use common::meta;
use tessera_framecodec::{
    DType, DecodeError, Decoder, FrameTable, Limits, Tensor, TensorError, Value, MAX_FRAME_ALIGN,
};

/// The frames a table of `(len, align)` asks for.
fn frames(specs: &[(u64, u32)]) -> Vec<Bytes> {
    specs
        .iter()
        .map(|&(len, _)| Bytes::from(vec![0u8; len as usize]))
        .collect()
}

fn decoder(set: impl FnOnce(&mut Limits)) -> Decoder {
    let mut limits = Limits::default();
    set(&mut limits);
    Decoder::with_limits(limits)
}

/// The msgpack body node `[0]`: null.
const NULL: [u8; 2] = [0x91, 0];

/// `[7, [null; n]]` for `n` up to 15.
fn list_of_nulls(n: u8) -> Vec<u8> {
    let mut body = vec![0x92, 7, 0x90 | n];
    for _ in 0..n {
        body.extend_from_slice(&NULL);
    }
    body
}

/// `[9, u8, shape, nil, [0, 0, 1]]`: a u8 tensor with a one-byte payload in frame 0.
fn u8_tensor_of_rank(rank: u16) -> Vec<u8> {
    let mut body = vec![0x95, 9, 1, 0xdc];
    body.extend_from_slice(&rank.to_be_bytes());
    body.extend(vec![1u8; rank.into()]);
    body.extend_from_slice(&[0xc0, 0x93, 0, 0, 1]);
    body
}

#[test]
fn max_meta_bytes_accepts_a_meta_frame_of_exactly_that_size() {
    let m = meta(&[], &NULL);
    let len = m.len() as u64;
    assert_eq!(len, 18);
    let at = decoder(|l| l.max_meta_bytes = len);
    assert_eq!(at.decode(&m, &[]), Ok(Value::Null));
    let under = decoder(|l| l.max_meta_bytes = len - 1);
    assert_eq!(
        under.decode(&m, &[]),
        Err(DecodeError::MetaTooLarge {
            bytes: 18,
            limit: 17
        })
    );
    assert_eq!(
        under.frame_table(&m),
        Err(DecodeError::MetaTooLarge {
            bytes: 18,
            limit: 17
        })
    );
}

#[test]
fn max_frames_accepts_exactly_that_many_frames() {
    let specs = [(1, 1), (2, 1), (3, 1)];
    let m = meta(&specs, &NULL);
    let at = decoder(|l| l.max_frames = 3);
    assert_eq!(at.frame_table(&m).unwrap().frames().len(), 3);
    assert_eq!(at.decode(&m, &frames(&specs)), Ok(Value::Null));
    let under = decoder(|l| l.max_frames = 2);
    assert_eq!(
        under.frame_table(&m),
        Err(DecodeError::TooManyFrames { count: 3, limit: 2 })
    );
    assert_eq!(
        under.decode(&m, &frames(&specs)),
        Err(DecodeError::TooManyFrames { count: 3, limit: 2 })
    );
}

#[test]
fn max_total_bytes_bounds_the_sum_of_the_frame_table() {
    let specs = [(5, 1), (3, 1)];
    let m = meta(&specs, &NULL);
    let at = decoder(|l| l.max_total_bytes = 8);
    assert_eq!(at.frame_table(&m).unwrap().total_bytes(), 8);
    assert_eq!(at.decode(&m, &frames(&specs)), Ok(Value::Null));
    let under = decoder(|l| l.max_total_bytes = 7);
    assert_eq!(
        under.frame_table(&m),
        Err(DecodeError::TooLarge { bytes: 8, limit: 7 })
    );
}

#[test]
fn max_total_bytes_bounds_a_broadcast_tensors_logical_size() {
    // [9, f32, [250], [0], [0, 0, 4]]: one f32 stands for 250, 1000 bytes once copied out.
    let specs = [(4, 4)];
    let m = meta(
        &specs,
        &[0x95, 9, 11, 0x91, 0xcc, 250, 0x91, 0, 0x93, 0, 0, 4],
    );
    let at = decoder(|l| l.max_total_bytes = 1000);
    let Ok(Value::Tensor(t)) = at.decode(&m, &frames(&specs)) else {
        panic!("a broadcast tensor of 1000 logical bytes is within a limit of 1000");
    };
    assert_eq!(t.shape(), &[250]);
    assert_eq!(t.strides(), Some(&[0u64][..]));
    assert_eq!(t.data().len(), 4);
    let under = decoder(|l| l.max_total_bytes = 999);
    assert_eq!(
        under.decode(&m, &frames(&specs)),
        Err(DecodeError::TooLarge {
            bytes: 1000,
            limit: 999
        })
    );
}

#[test]
fn frame_alignment_up_to_the_largest_is_accepted() {
    let at = meta(&[(8, 8), (8, MAX_FRAME_ALIGN as u32)], &NULL);
    let table = FrameTable::parse(&at, &Limits::default()).unwrap();
    assert_eq!(table.frames()[1].align, 4096);
    let over = meta(&[(8, 8), (8, 2 * MAX_FRAME_ALIGN as u32)], &NULL);
    assert_eq!(
        FrameTable::parse(&over, &Limits::default()),
        Err(DecodeError::FrameAlign {
            frame: 1,
            align: 8192
        })
    );
}

#[test]
fn a_reserved_field_is_reported_at_its_own_entry() {
    let good = meta(&[(1, 1), (1, 1), (1, 1)], &NULL);
    for (entry, offset) in [(0usize, 28u64), (1, 44), (2, 60)] {
        let mut bad = good.clone();
        bad[16 + 16 * entry + 13] = 1;
        assert_eq!(
            FrameTable::parse(&bad, &Limits::default()),
            Err(DecodeError::Reserved { offset }),
            "reserved field of entry {entry}"
        );
    }
}

#[test]
fn max_elements_counts_the_root() {
    let m = meta(&[], &NULL);
    assert_eq!(
        decoder(|l| l.max_elements = 1).decode(&m, &[]),
        Ok(Value::Null)
    );
    assert_eq!(
        decoder(|l| l.max_elements = 0).decode(&m, &[]),
        Err(DecodeError::TooManyElements { limit: 0 })
    );
}

#[test]
fn max_elements_accepts_a_list_whose_declared_length_fills_it() {
    // The root and 3 items: 4 values.
    let m = meta(&[], &list_of_nulls(3));
    assert_eq!(
        decoder(|l| l.max_elements = 4).decode(&m, &[]),
        Ok(Value::List(vec![Value::Null; 3]))
    );
    assert_eq!(
        decoder(|l| l.max_elements = 3).decode(&m, &[]),
        Err(DecodeError::TooManyElements { limit: 3 })
    );
    // The declared length is refused before any item is read: a body cut after the list
    // header fails on the limit, not on the missing items.
    let cut = meta(&[], &list_of_nulls(3)[..3]);
    assert_eq!(
        decoder(|l| l.max_elements = 3).decode(&cut, &[]),
        Err(DecodeError::TooManyElements { limit: 3 })
    );
    assert!(matches!(
        decoder(|l| l.max_elements = 4).decode(&cut, &[]),
        Err(DecodeError::Malformed { offset: 19, .. })
    ));
}

#[test]
fn max_elements_accepts_a_map_whose_declared_length_fills_it() {
    // [8, {"a": null, "b": null}]: 3 values.
    let m = meta(
        &[],
        &[0x92, 8, 0x82, 0xa1, b'a', 0x91, 0, 0xa1, b'b', 0x91, 0],
    );
    let want = Value::map([("a", Value::Null), ("b", Value::Null)]);
    assert_eq!(decoder(|l| l.max_elements = 3).decode(&m, &[]), Ok(want));
    assert_eq!(
        decoder(|l| l.max_elements = 2).decode(&m, &[]),
        Err(DecodeError::TooManyElements { limit: 2 })
    );
}

#[test]
fn max_elements_counts_nested_values_as_they_are_read() {
    // [[null, null], [null, null]]: 7 values, of which no single declared length tells all.
    let mut body = vec![0x92, 7, 0x92];
    body.extend(list_of_nulls(2));
    body.extend(list_of_nulls(2));
    let m = meta(&[], &body);
    let inner = Value::List(vec![Value::Null; 2]);
    assert_eq!(
        decoder(|l| l.max_elements = 7).decode(&m, &[]),
        Ok(Value::List(vec![inner.clone(), inner]))
    );
    assert_eq!(
        decoder(|l| l.max_elements = 6).decode(&m, &[]),
        Err(DecodeError::TooManyElements { limit: 6 })
    );
}

#[test]
fn max_rank_accepts_a_tensor_of_exactly_that_rank() {
    let specs = [(1, 1)];
    let at = meta(&specs, &u8_tensor_of_rank(4));
    let Ok(Value::Tensor(t)) = decoder(|l| l.max_rank = 4).decode(&at, &frames(&specs)) else {
        panic!("a rank-4 tensor is within a rank limit of 4");
    };
    assert_eq!(t.shape(), &[1, 1, 1, 1]);
    let over = meta(&specs, &u8_tensor_of_rank(5));
    assert_eq!(
        decoder(|l| l.max_rank = 4).decode(&over, &frames(&specs)),
        Err(DecodeError::RankTooHigh { node: 0, limit: 4 })
    );
    // Strides are bounded the same way.
    let mut strided = vec![0x95, 9, 1, 0x94, 1, 1, 1, 1, 0x95, 0, 0, 0, 0, 0];
    strided.extend_from_slice(&[0x93, 0, 0, 1]);
    assert_eq!(
        decoder(|l| l.max_rank = 4).decode(&meta(&specs, &strided), &frames(&specs)),
        Err(DecodeError::RankTooHigh { node: 0, limit: 4 })
    );
}

#[test]
fn the_decoders_rank_never_exceeds_the_tensors() {
    assert_eq!(Tensor::MAX_RANK, 64);
    let specs = [(1, 1)];
    let at = meta(&specs, &u8_tensor_of_rank(64));
    let over = meta(&specs, &u8_tensor_of_rank(65));
    for limit in [64, 100, u32::MAX] {
        let d = decoder(|l| l.max_rank = limit);
        let Ok(Value::Tensor(t)) = d.decode(&at, &frames(&specs)) else {
            panic!("a rank-64 tensor is within Tensor::MAX_RANK");
        };
        assert_eq!(t.shape().len(), 64);
        assert_eq!(
            d.decode(&over, &frames(&specs)),
            Err(DecodeError::RankTooHigh { node: 0, limit: 64 })
        );
    }
    assert_eq!(Limits::unlimited().max_rank, 64);
}

#[test]
fn tensor_max_rank_accepts_exactly_that_rank() {
    let one = Bytes::from_static(&[7]);
    let t = Tensor::new(DType::U8, &[1; Tensor::MAX_RANK], one.clone()).unwrap();
    assert_eq!(t.shape().len(), 64);
    assert_eq!(
        Tensor::new(DType::U8, &[1; Tensor::MAX_RANK + 1], one.clone()),
        Err(TensorError::RankTooHigh {
            rank: 65,
            limit: 64
        })
    );
    assert_eq!(
        Tensor::with_strides(DType::U8, &[1; 65], &[0; 65], one),
        Err(TensorError::RankTooHigh {
            rank: 65,
            limit: 64
        })
    );
}

#[test]
fn a_string_that_is_not_utf8_is_reported_at_its_first_bad_byte() {
    // [5, "ab\xff"]: the body starts at byte 16, the string's bytes at 16 + 3, the bad one at 21.
    let m = meta(&[], &[0x92, 5, 0xa3, b'a', b'b', 0xff]);
    assert_eq!(
        Decoder::new().decode(&m, &[]),
        Err(DecodeError::Malformed {
            offset: 21,
            reason: "string is not UTF-8".into()
        })
    );
    // Behind a frame table of two entries the body starts at byte 48; a map key this time.
    let specs = [(1, 1), (1, 1)];
    let m = meta(
        &specs,
        &[0x92, 8, 0x81, 0xa4, b'k', b'e', b'y', 0xc3, 0x91, 0],
    );
    assert_eq!(
        Decoder::new().decode(&m, &frames(&specs)),
        Err(DecodeError::Malformed {
            offset: 55,
            reason: "string is not UTF-8".into()
        })
    );
}

#[test]
fn an_empty_payload_may_sit_at_any_offset() {
    // An 8-byte frame aligned to 4, and f32 tensors referring to it.
    let specs = [(8, 4)];
    let tensor = |dim: u8, offset: u8, len: u8| {
        meta(
            &specs,
            &[0x95, 9, 11, 0x91, dim, 0xc0, 0x93, 0, offset, len],
        )
    };
    for offset in [1, 2, 3, 8] {
        let Ok(Value::Tensor(t)) = Decoder::new().decode(&tensor(0, offset, 0), &frames(&specs))
        else {
            panic!("an empty f32 payload at offset {offset} is accepted");
        };
        assert_eq!(t.shape(), &[0]);
        assert!(t.data().is_empty());
    }
    assert_eq!(
        Decoder::new().decode(&tensor(1, 2, 4), &frames(&specs)),
        Err(DecodeError::Misaligned {
            node: 0,
            frame: 0,
            offset: 2,
            frame_align: 4,
            align: 4
        })
    );
    // A frame aligned to less than the dtype: refused when the payload has bytes, not when empty.
    let loose = [(8, 1)];
    let tensor = |dim: u8, len: u8| meta(&loose, &[0x95, 9, 11, 0x91, dim, 0xc0, 0x93, 0, 0, len]);
    assert!(matches!(
        Decoder::new().decode(&tensor(0, 0), &frames(&loose)),
        Ok(Value::Tensor(_))
    ));
    assert_eq!(
        Decoder::new().decode(&tensor(1, 4), &frames(&loose)),
        Err(DecodeError::Misaligned {
            node: 0,
            frame: 0,
            offset: 0,
            frame_align: 1,
            align: 4
        })
    );
}

#[test]
fn splitting_with_an_alignment_that_is_not_a_power_of_two_is_refused() {
    let specs = [(8, 8)];
    let m = meta(&specs, &[0x92, 6, 0x93, 0, 0, 8]);
    let table = Decoder::new().frame_table(&m).unwrap();
    let buf = Bytes::from(vec![1u8; 64]);
    assert_eq!(table.split(&buf, 64).unwrap().len(), 1);
    for align in [0, 3, 48] {
        assert_eq!(
            table.split(&buf, align),
            Err(DecodeError::InvalidAlignment { align })
        );
        assert_eq!(
            Decoder::new().decode_contiguous(&m, &buf, align),
            Err(DecodeError::InvalidAlignment { align })
        );
    }
}
