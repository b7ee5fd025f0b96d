//! Counts copies: encoding and decoding a value with large payloads allocate nothing of payload
//! size, and every payload of the result is the very memory that went in.

use bytes::Bytes;
use tessera_framecodec::half::bf16;
use tessera_framecodec::{decode, decode_contiguous, encode, DType, Decoder, Tensor, Value};
use tessera_testkit::CountingAlloc;

/// Counts allocations of at least 64 KiB: nothing of payload size may be allocated.
#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc::new(64 * 1024);

fn inside(inner: &Bytes, outer: &Bytes) -> bool {
    let (i, o) = (inner.as_ptr() as usize, outer.as_ptr() as usize);
    i >= o && i + inner.len() <= o + outer.len()
}

/// One test in this binary, so that no other test allocates while the counts are read.
#[test]
fn encode_and_decode_copy_no_payload() {
    const N: usize = 16 << 20;
    let weights = Bytes::from(vec![3u8; N]);
    let blob = Bytes::from(vec![5u8; N / 2]);
    let tensor = Tensor::new(DType::BF16, &[(N / 2) as u64], weights.clone()).unwrap();
    let value = Value::map([
        ("weights", Value::Tensor(tensor)),
        ("blob", Value::Bytes(blob.clone())),
        ("step", Value::U64(1)),
    ]);
    // Stage the receive buffer before arming: that copy is the transport's write.
    let staged = encode(&value).unwrap();
    let layout = staged.layout(64).unwrap();
    let mut raw = vec![0u8; layout.size as usize];
    for (i, p) in staged.payloads.iter().enumerate() {
        raw[layout.range(i)].copy_from_slice(p);
    }
    let buf = Bytes::from(raw);

    let before = GLOBAL.count();
    let frames = encode(&value).unwrap();
    let from_frames = decode(&frames.meta, &frames.payloads).unwrap();
    let from_buf = decode_contiguous(&frames.meta, &buf, 64).unwrap();
    let row = from_buf
        .get("weights")
        .and_then(Value::as_tensor)
        .unwrap()
        .contiguous()
        .unwrap();
    let selected = Decoder::new()
        .select(&frames.meta, &frames.payloads, &["blob".into()])
        .unwrap()
        .unwrap();
    assert_eq!(
        GLOBAL.count() - before,
        0,
        "a payload-sized allocation happened during encode or decode"
    );

    // Encode: the payload frames are the caller's memory.
    assert_eq!(frames.payloads.len(), 2);
    assert_eq!(frames.payloads[0].as_ptr(), weights.as_ptr());
    assert_eq!(frames.payloads[1].as_ptr(), blob.as_ptr());
    // Decode from frames: the tensors are the frames' memory.
    let w = from_frames
        .get("weights")
        .and_then(Value::as_tensor)
        .unwrap();
    assert_eq!(w.data().as_ptr(), weights.as_ptr());
    let Some(Value::Bytes(b)) = from_frames.get("blob") else {
        panic!("blob missing")
    };
    assert_eq!(b.as_ptr(), blob.as_ptr());
    // Decode from one buffer: the tensors lie inside it.
    let w = from_buf.get("weights").and_then(Value::as_tensor).unwrap();
    assert!(inside(w.data(), &buf));
    assert!(inside(row.data(), &buf));
    let Some(Value::Bytes(b)) = from_buf.get("blob") else {
        panic!("blob missing")
    };
    assert!(inside(b, &buf));
    let Value::Bytes(s) = selected else {
        panic!("selected blob missing")
    };
    assert_eq!(s.as_ptr(), blob.as_ptr());
    assert_eq!(w.as_slice::<bf16>().unwrap().len(), N / 2);

    // The counter does see copies: an explicit copy is counted.
    let before = GLOBAL.count();
    let copy = w.to_vec::<bf16>().unwrap();
    let counted = GLOBAL.count() - before;
    assert_eq!(copy.len(), N / 2);
    assert_eq!(counted, 1);
}
