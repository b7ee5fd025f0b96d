//! Arbitrary bytes and mutations of valid encodings: decoding returns `Ok` or a typed error and
//! never panics. The same inputs as the `decode` fuzz target, so CI always runs them.

mod common;

use bytes::Bytes;
use proptest::prelude::*;
use tessera_framecodec::{DecodeError, Decoder, Encoder, FrameTable, Limits, PathSeg, Value};

/// Runs every decoding entry point on one input.
fn decode_all(meta: &[u8], frames: &[Bytes], buf: &Bytes) {
    let mut small = Limits::default();
    small.max_depth = 8;
    small.max_elements = 200;
    small.max_total_bytes = 1 << 20;
    for (i, d) in [Decoder::new(), Decoder::with_limits(small)]
        .iter()
        .enumerate()
    {
        if let Ok(v) = d.decode(meta, frames) {
            if i == 1 {
                poke(&v);
            }
        }
        for align in [64, 1] {
            // Decoded before the payload landed and bound later: the same outcome.
            let direct = d.decode_contiguous(meta, buf, align);
            let later = d.decode_unbound(meta, align).and_then(|u| u.bind(buf));
            match (&direct, &later) {
                (Ok(a), Ok(b)) => assert_eq!(a, b),
                // A short buffer is found first by one and last by the other.
                (Err(DecodeError::BufferTooShort { .. }), Err(_)) => {}
                (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
                _ => panic!("contiguous {direct:?} but unbound then bound {later:?}"),
            }
        }
        let _ = d.select(meta, frames, &[PathSeg::Index(0), PathSeg::Key("a")]);
        let _ = d.select(meta, frames, &[PathSeg::Key("a"), PathSeg::Index(1)]);
        if let Ok(t) = d.frame_table(meta) {
            let _ = t.layout(64);
            let _ = t.split(buf, 64);
        }
    }
}

/// Calls every tensor method on an accepted value (its sizes are bounded by the small limits).
fn poke(v: &Value) {
    match v {
        Value::Tensor(t) => {
            let _ = t.contiguous();
            let _ = t.as_bits::<u8>();
            let _ = t.as_slice::<f32>();
            let _ = t.to_vec::<bool>();
            let _ = t.to_vec::<[f64; 2]>();
            let _ = t.is_contiguous();
            if let Ok(rows) = t.unbind() {
                rows.iter().for_each(|r| poke(&Value::Tensor(r.clone())));
            }
        }
        Value::List(items) => items.iter().for_each(poke),
        Value::Map(entries) => entries.iter().for_each(|(_, v)| poke(v)),
        _ => {}
    }
}

fn header(frames: &[(u64, u32)]) -> Vec<u8> {
    common::meta(frames, &[])
}

#[derive(Debug, Clone)]
enum Mutation {
    Set(usize, u8),
    Flip(usize, u8),
    Truncate(usize),
    Insert(usize, Vec<u8>),
    Remove(usize, usize),
    ShortenFrame(usize, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
        (any::<usize>(), 0u8..8).prop_map(|(i, b)| Mutation::Flip(i, b)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..9))
            .prop_map(|(i, v)| Mutation::Insert(i, v)),
        (any::<usize>(), 1usize..9).prop_map(|(i, n)| Mutation::Remove(i, n)),
        (any::<usize>(), 1usize..9).prop_map(|(i, n)| Mutation::ShortenFrame(i, n)),
    ]
}

fn apply(meta: &mut Vec<u8>, frames: &mut [Bytes], m: &Mutation) {
    let at = |i: usize, len: usize| if len == 0 { 0 } else { i % len };
    match m {
        Mutation::Set(i, b) if !meta.is_empty() => {
            let i = at(*i, meta.len());
            meta[i] = *b;
        }
        Mutation::Flip(i, bit) if !meta.is_empty() => {
            let i = at(*i, meta.len());
            meta[i] ^= 1 << bit;
        }
        Mutation::Truncate(i) => meta.truncate(at(*i, meta.len() + 1)),
        Mutation::Insert(i, v) => {
            let i = at(*i, meta.len() + 1);
            meta.splice(i..i, v.iter().copied());
        }
        Mutation::Remove(i, n) if !meta.is_empty() => {
            let i = at(*i, meta.len());
            let end = (i + n).min(meta.len());
            meta.drain(i..end);
        }
        Mutation::ShortenFrame(i, n) if !frames.is_empty() => {
            let f = at(*i, frames.len());
            let len = frames[f].len().saturating_sub(*n);
            frames[f] = frames[f].slice(..len);
        }
        _ => {}
    }
}

/// Msgpack fragments from the node schema's vocabulary, so random bodies get past the first byte.
fn token() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        (0x90u8..0x96).prop_map(|b| vec![b]),
        (0u8..12).prop_map(|b| vec![b]),
        Just(vec![0xc0]),
        Just(vec![0x81, 0xa1, b'a']),
        Just(vec![0x93, 0, 0, 4]),
        Just(vec![0xdd, 0xff, 0xff, 0xff, 0xff]),
        Just(vec![0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]),
        Just(vec![0xcb, 0x3f, 0xe0, 0, 0, 0, 0, 0, 0]),
        any::<u8>().prop_map(|b| vec![b]),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn schema_shaped_bodies_never_panic(
        tokens in proptest::collection::vec(token(), 0..40),
        frame_len in 0u64..64,
    ) {
        let mut meta = header(&[(frame_len, 16)]);
        meta.extend(tokens.concat());
        let frames = [Bytes::from(vec![1u8; frame_len as usize])];
        let buf = Bytes::from(vec![0u8; 128]);
        decode_all(&meta, &frames, &buf);
    }

    #[test]
    fn arbitrary_bytes_never_panic(
        meta in proptest::collection::vec(any::<u8>(), 0..200),
        frames in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 0..3),
    ) {
        let frames: Vec<Bytes> = frames.into_iter().map(Bytes::from).collect();
        let buf = Bytes::from(vec![0u8; 256]);
        decode_all(&meta, &frames, &buf);
    }

    #[test]
    fn arbitrary_bodies_behind_a_valid_header_never_panic(
        specs in proptest::collection::vec((0u64..64, 0u32..5), 0..3),
        body in proptest::collection::vec(any::<u8>(), 0..200),
    ) {
        let specs: Vec<(u64, u32)> = specs.into_iter().map(|(l, a)| (l, 1 << a)).collect();
        let mut meta = header(&specs);
        meta.extend_from_slice(&body);
        let frames: Vec<Bytes> = specs.iter().map(|(l, _)| Bytes::from(vec![1u8; *l as usize])).collect();
        let buf = Bytes::from(vec![0u8; 1024]);
        prop_assert!(FrameTable::parse(&meta, &Limits::default()).is_ok());
        decode_all(&meta, &frames, &buf);
    }

    #[test]
    fn mutated_encodings_never_panic(
        v in common::value(),
        pack_below in prop_oneof![Just(0usize), Just(4096)],
        mutations in proptest::collection::vec(mutation(), 1..4),
    ) {
        // With lists of same-shaped tensors beside it, framed and packed: runs to mutate.
        let framed = Value::List(vec![Value::Tensor(common::sized(16, 1)); 5]);
        let packed = Value::List(vec![Value::Tensor(common::sized(3, 2)); 6]);
        let v = Value::List(vec![framed, v, packed]);
        let frames = Encoder::new().pack_below(pack_below).encode(&v).unwrap();
        let buf = common::contiguous(&frames, 64);
        let mut meta = frames.meta.to_vec();
        let mut payloads: Vec<Bytes> = frames.payloads.to_vec();
        for m in &mutations {
            apply(&mut meta, &mut payloads, m);
        }
        decode_all(&meta, &payloads, &buf);
        decode_all(&meta, &payloads, &buf.slice(..buf.len() / 2));
    }
}
