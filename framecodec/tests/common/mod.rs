//! Strategies and helpers shared by the integration tests.
#![allow(dead_code)]

use bytes::Bytes;
use proptest::prelude::*;
use tessera_framecodec::{DType, Frames, PathSeg, Tensor, Value};

/// Copies `frames` into one buffer at the offsets of their receive layout, as a sender's
/// scatter WRITE would.
pub(crate) fn contiguous(frames: &Frames, align: u64) -> Bytes {
    let layout = frames.layout(align).unwrap();
    let mut buf = vec![0u8; layout.size as usize];
    for (i, p) in frames.payloads.iter().enumerate() {
        buf[layout.range(i)].copy_from_slice(p);
    }
    Bytes::from(buf)
}

fn dtype() -> impl Strategy<Value = DType> {
    (0..DType::ALL.len()).prop_map(|i| DType::ALL[i])
}

fn payload(len: usize, dtype: DType) -> impl Strategy<Value = Bytes> {
    proptest::collection::vec(any::<u8>(), len).prop_map(move |mut v| {
        if dtype == DType::Bool {
            v.iter_mut().for_each(|b| *b &= 1);
        }
        Bytes::from(v)
    })
}

/// A tensor of any dtype, rank 0 to 3, contiguous or with arbitrary (possibly zero) strides.
pub(crate) fn tensor() -> impl Strategy<Value = Tensor> {
    (
        dtype(),
        proptest::collection::vec(0u64..4, 0..4),
        proptest::option::of(proptest::collection::vec(0u64..5, 4)),
        0usize..3,
    )
        .prop_flat_map(|(dtype, shape, strides, extra)| {
            let strides = strides.map(|s| s[..shape.len()].to_vec());
            let elems = match &strides {
                None => shape.iter().product::<u64>() as usize,
                Some(s) if shape.contains(&0) => extra * (s.len().min(1)),
                Some(s) => {
                    let last: u64 = shape.iter().zip(s).map(|(d, s)| (d - 1) * s).sum();
                    last as usize + 1 + extra
                }
            };
            payload(elems * dtype.size(), dtype).prop_map(move |data| match &strides {
                None => Tensor::new(dtype, &shape, data).unwrap(),
                Some(s) => Tensor::with_strides(dtype, &shape, s, data).unwrap(),
            })
        })
}

/// A large tensor (above the default packing threshold) now and then.
fn big_tensor() -> impl Strategy<Value = Tensor> {
    (1u64..3, 4096u64..6000).prop_map(|(rows, cols)| {
        let data: Vec<u8> = (0..rows * cols).map(|i| (i % 251) as u8).collect();
        Tensor::new(DType::U8, &[rows, cols], Bytes::from(data)).unwrap()
    })
}

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        1 => Just(Value::Null),
        1 => any::<bool>().prop_map(Value::Bool),
        1 => any::<i64>().prop_map(Value::I64),
        1 => any::<u64>().prop_map(Value::U64),
        1 => any::<f64>()
            .prop_filter("NaN is not equal to itself", |f| !f.is_nan())
            .prop_map(Value::F64),
        1 => "[a-zé]{0,6}".prop_map(Value::Str),
        1 => proptest::collection::vec(any::<u8>(), 0..40).prop_map(|v| Value::Bytes(v.into())),
        3 => tensor().prop_map(Value::Tensor),
        1 => big_tensor().prop_map(Value::Tensor),
    ]
}

/// A nested value up to four levels deep.
pub(crate) fn value() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::List),
            proptest::collection::vec(("[a-c]{1,2}", inner), 0..6).prop_map(Value::Map),
        ]
    })
}

/// A path of keys and indexes, some of which lead nowhere.
pub(crate) fn path() -> impl Strategy<Value = Vec<(Option<String>, u64)>> {
    proptest::collection::vec((proptest::option::of("[a-c]{1,2}"), 0u64..4), 0..4)
}

/// `path()` as path segments.
pub(crate) fn segs(path: &[(Option<String>, u64)]) -> Vec<PathSeg<'_>> {
    path.iter()
        .map(|(k, i)| match k {
            Some(k) => PathSeg::Key(k),
            None => PathSeg::Index(*i),
        })
        .collect()
}

/// A meta frame: header, one table entry per `(len, align)`, then `body`.
pub(crate) fn meta(frames: &[(u64, u32)], body: &[u8]) -> Vec<u8> {
    let mut m = b"TSFC".to_vec();
    m.extend_from_slice(&1u16.to_le_bytes());
    m.extend_from_slice(&0u16.to_le_bytes());
    m.extend_from_slice(&(frames.len() as u32).to_le_bytes());
    m.extend_from_slice(&[0; 4]);
    for (len, align) in frames {
        m.extend_from_slice(&len.to_le_bytes());
        m.extend_from_slice(&align.to_le_bytes());
        m.extend_from_slice(&[0; 4]);
    }
    m.extend_from_slice(body);
    m
}

/// A u8 tensor of shape `[n]` filled with `fill`.
pub(crate) fn sized(n: usize, fill: u8) -> Tensor {
    Tensor::new(DType::U8, &[n as u64], Bytes::from(vec![fill; n])).unwrap()
}
