//! A declared list or map length reserves no more than the bytes left in the meta body could
//! hold (every item takes at least two bytes), however long the length claims to be.

use tessera_framecodec::{DecodeError, Decoder, Limits, Value};
use tessera_testkit::CountingAlloc;

/// Counts allocations of at least 64 KiB.
const THRESHOLD: usize = 64 * 1024;

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc::new(THRESHOLD);

/// A meta frame with no payload frames and `body`.
fn meta(body: &[u8]) -> Vec<u8> {
    let mut m = b"TSFC".to_vec();
    m.extend_from_slice(&1u16.to_le_bytes());
    m.extend_from_slice(&[0; 10]);
    m.extend_from_slice(body);
    m
}

/// `[8, {key: [7, <list of 2^32 - 1 items>]}]` with a key of `key` bytes and `left` bytes
/// after the list header, each a reserved msgpack marker, so the first item fails at once.
fn lying_list(key: usize, left: usize) -> Vec<u8> {
    let mut body = vec![0x92, 8, 0x81, 0xdb];
    body.extend_from_slice(&(key as u32).to_be_bytes());
    body.extend(vec![b'k'; key]);
    body.extend_from_slice(&[0x92, 7, 0xdd, 0xff, 0xff, 0xff, 0xff]);
    body.extend(vec![0xc1; left]);
    meta(&body)
}

/// One test in this binary, so that no other test allocates while the counts are read.
#[test]
fn a_declared_length_reserves_at_most_what_the_bytes_left_can_hold() {
    let value = size_of::<Value>();
    // Room for `left / 2` values is half the threshold: a reservation within the bound is not
    // counted, one of twice the bound is. The key puts the list header far into the body.
    let left = THRESHOLD / value;
    let key = 16 * 1024;
    let m = lying_list(key, left);
    let decoder = Decoder::with_limits(Limits::unlimited());

    let before = GLOBAL.count();
    let got = decoder.decode(&m, &[]);
    let counted = GLOBAL.count() - before;
    assert!(matches!(got, Err(DecodeError::Malformed { .. })), "{got:?}");
    assert_eq!(
        counted,
        0,
        "a list declaring 2^32 - 1 items with {left} bytes left reserved more than {} values",
        left / 2
    );

    // The counter does see a reservation the bytes allow: a list of `2 * left` nulls.
    let n = 2 * left;
    let mut body = vec![0x92, 7, 0xdd];
    body.extend_from_slice(&(n as u32).to_be_bytes());
    for _ in 0..n {
        body.extend_from_slice(&[0x91, 0]);
    }
    let before = GLOBAL.count();
    let got = decoder.decode(&meta(&body), &[]);
    let counted = GLOBAL.count() - before;
    assert_eq!(got, Ok(Value::List(vec![Value::Null; n])));
    assert!(counted >= 1);
}
