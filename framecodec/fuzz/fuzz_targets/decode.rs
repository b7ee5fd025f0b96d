//! Feeds arbitrary bytes to every decoding entry point of tessera-framecodec. The input is split
//! into a meta frame and up to three payload frames; the same inputs run as a stable property
//! test in `tests/hostile.rs`. Run with
//! `RUSTC_BOOTSTRAP=1 cargo fuzz run decode` from `framecodec/`.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use tessera_framecodec::{DecodeError, Decoder, Limits, PathSeg};

fuzz_target!(|data: &[u8]| {
    // First byte: how many payload frames; next bytes: their lengths; the rest: meta, frames.
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let n = usize::from(n % 4);
    if rest.len() < n {
        return;
    }
    let (lens, mut rest) = rest.split_at(n);
    let mut frames = Vec::with_capacity(n);
    for &len in lens {
        let len = usize::from(len).min(rest.len());
        let (frame, tail) = rest.split_at(len);
        frames.push(Bytes::copy_from_slice(frame));
        rest = tail;
    }
    let meta = rest;
    let buf = Bytes::copy_from_slice(data);
    let mut small = Limits::default();
    small.max_depth = 8;
    small.max_elements = 1000;
    for d in [Decoder::new(), Decoder::with_limits(small)] {
        let _ = d.decode(meta, &frames);
        for align in [64, 1] {
            let direct = d.decode_contiguous(meta, &buf, align);
            let later = d.decode_unbound(meta, align).and_then(|u| u.bind(&buf));
            match (&direct, &later) {
                (Ok(a), Ok(b)) => assert_eq!(a, b),
                // A short buffer is found first by one and last by the other.
                (Err(DecodeError::BufferTooShort { .. }), Err(_)) => {}
                (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
                _ => panic!("contiguous {direct:?} but unbound then bound {later:?}"),
            }
        }
        let _ = d.select(meta, &frames, &[PathSeg::Index(0), PathSeg::Key("a")]);
        if let Ok(t) = d.frame_table(meta) {
            let _ = t.layout(64);
        }
    }
});
