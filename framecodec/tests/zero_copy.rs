//! Counts copies: encoding and decoding a value with large payloads allocate nothing of payload
//! size, and every payload of the result is the very memory that went in.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use bytes::Bytes;
use tessera_framecodec::half::bf16;
use tessera_framecodec::{decode, decode_contiguous, encode, DType, Decoder, Tensor, Value};

/// Wraps the system allocator and counts allocations of at least `BIG` bytes while armed.
struct Counting;

const BIG: usize = 64 * 1024;
static ARMED: AtomicBool = AtomicBool::new(false);
static BIG_ALLOCS: AtomicUsize = AtomicUsize::new(0);

impl Counting {
    fn note(size: usize) {
        if size >= BIG && ARMED.load(Ordering::SeqCst) {
            BIG_ALLOCS.fetch_add(1, Ordering::SeqCst);
        }
    }
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so it
// upholds `GlobalAlloc`'s contract exactly as `System` does; counting touches only atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        Self::note(layout.size());
        // SAFETY: same layout, forwarded to the system allocator.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        Self::note(layout.size());
        // SAFETY: same layout, forwarded to the system allocator.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` (through us) with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        Self::note(new_size);
        // SAFETY: `ptr` was allocated by `System` (through us) with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn inside(inner: &Bytes, outer: &Bytes) -> bool {
    let (i, o) = (inner.as_ptr() as usize, outer.as_ptr() as usize);
    i >= o && i + inner.len() <= o + outer.len()
}

/// One test in this binary, so that no other test allocates while the counter is armed.
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

    BIG_ALLOCS.store(0, Ordering::SeqCst);
    ARMED.store(true, Ordering::SeqCst);
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
    ARMED.store(false, Ordering::SeqCst);
    assert_eq!(
        BIG_ALLOCS.load(Ordering::SeqCst),
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
    ARMED.store(true, Ordering::SeqCst);
    let copy = w.to_vec::<bf16>().unwrap();
    ARMED.store(false, Ordering::SeqCst);
    assert_eq!(copy.len(), N / 2);
    assert_eq!(BIG_ALLOCS.load(Ordering::SeqCst), 1);
}
