//! Round trips of random nested values, through frame lists and contiguous buffers.

mod common;

use proptest::prelude::*;
use tessera_framecodec::{decode, decode_contiguous, Decoder, Encoder, Value};

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn encode_then_decode_gives_the_value_back(
        v in common::value(),
        pack_below in prop_oneof![Just(0usize), Just(16), Just(4096), Just(usize::MAX)],
        align in prop_oneof![Just(1u64), Just(64), Just(4096)],
    ) {
        let frames = Encoder::new().pack_below(pack_below).encode(&v).unwrap();
        // At most one packed frame: every other frame is a payload of its own.
        prop_assert_eq!(decode(&frames.meta, &frames.payloads).unwrap(), v.clone());
        let buf = common::contiguous(&frames, align);
        let back = decode_contiguous(&frames.meta, &buf, align).unwrap();
        prop_assert_eq!(&back, &v);
        // Every tensor of the result lies inside the buffer.
        let start = buf.as_ptr() as usize;
        let mut stack = vec![&back];
        while let Some(x) = stack.pop() {
            match x {
                Value::Tensor(t) if !t.data().is_empty() => {
                    let p = t.data().as_ptr() as usize;
                    prop_assert!(p >= start && p + t.data().len() <= start + buf.len());
                }
                Value::List(items) => stack.extend(items),
                Value::Map(entries) => stack.extend(entries.iter().map(|(_, v)| v)),
                _ => {}
            }
        }
    }

    #[test]
    fn select_agrees_with_pointer(v in common::value(), path in common::path()) {
        let frames = Encoder::new().encode(&v).unwrap();
        let segs = common::segs(&path);
        let got = Decoder::new().select(&frames.meta, &frames.payloads, &segs).unwrap();
        prop_assert_eq!(got, v.pointer(&segs));
    }

    #[test]
    fn rows_of_decoded_tensors_are_views(t in common::tensor()) {
        let frames = Encoder::new().pack_below(0).encode(&Value::Tensor(t.clone())).unwrap();
        let back = decode(&frames.meta, &frames.payloads).unwrap();
        let back = back.as_tensor().unwrap();
        if let Ok(rows) = back.unbind() {
            for (i, row) in rows.iter().enumerate() {
                prop_assert_eq!(row, &t.row(i as u64).unwrap());
                let a = row.contiguous().unwrap();
                let b = t.row(i as u64).unwrap().contiguous().unwrap();
                prop_assert_eq!(a.data(), b.data());
            }
        }
    }
}

#[test]
fn a_thousand_tiny_tensors_travel_as_two_frames() {
    let items: Vec<Value> = (0..1000u32)
        .map(|i| {
            tessera_framecodec::Tensor::from_slice(&[4], &[i, i + 1, i + 2, i + 3])
                .unwrap()
                .into()
        })
        .collect();
    let v = Value::List(items);
    let frames = Encoder::new().encode(&v).unwrap();
    assert_eq!(frames.frame_count(), 2);
    assert_eq!(frames.payloads[0].len(), 16_000);
    assert_eq!(decode(&frames.meta, &frames.payloads).unwrap(), v);
}
