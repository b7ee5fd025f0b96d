//! The byte formats this engine hands to peers: worker addresses and remote keys.
//!
//! Both are framed by us, so that a truncated or corrupted blob is rejected here, with an
//! error, before UCX parses a byte of it. Pure code, no UCX calls.

pub(crate) use tessera_onesided::KeyChunk;
use tessera_onesided::{KeyFormat, Reader};

use crate::UcxError;

const ADDRESS_MAGIC: &[u8; 4] = b"TUA1";
const KEY_MAGIC: &[u8; 4] = b"TUK1";
/// The most chunks one remote key may carry (a 64 GiB chunk size makes this 64 PiB).
pub(crate) const MAX_CHUNKS: u32 = 1 << 20;
/// The largest packed UCX rkey we accept for one chunk.
pub(crate) const MAX_RKEY: u32 = 64 << 10;
/// The largest worker address we accept.
pub(crate) const MAX_ADDRESS: u32 = 1 << 20;

/// FNV-1a, to catch corruption (not an authenticator).
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Frames a UCX worker address: magic, length, checksum, bytes.
pub(crate) fn encode_address(raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(raw.len() + 16);
    out.extend_from_slice(ADDRESS_MAGIC);
    out.extend_from_slice(&(raw.len() as u32).to_le_bytes());
    out.extend_from_slice(&fnv1a(raw).to_le_bytes());
    out.extend_from_slice(raw);
    out
}

/// The UCX worker address inside a framed address.
pub(crate) fn decode_address(bytes: &[u8]) -> Result<&[u8], UcxError> {
    let mut r = Reader::new(bytes, "address");
    if r.take(4)? != ADDRESS_MAGIC {
        return Err(UcxError::Malformed {
            what: "address",
            detail: "bad magic",
        });
    }
    let len = r.u32()?;
    if len == 0 || len > MAX_ADDRESS {
        return Err(UcxError::Malformed {
            what: "address",
            detail: "length out of bounds",
        });
    }
    let sum = r.u64()?;
    let raw = r.take(len as usize)?;
    if fnv1a(raw) != sum {
        return Err(UcxError::Malformed {
            what: "address",
            detail: "checksum mismatch",
        });
    }
    r.finish()?;
    Ok(raw)
}

/// The remote key: per chunk its address, length and packed rkey.
const KEY: KeyFormat = KeyFormat {
    magic: KEY_MAGIC,
    max_chunks: MAX_CHUNKS,
    max_blob: MAX_RKEY,
};

/// Encodes a remote key: magic, chunk count, then per chunk address, length and packed rkey.
pub(crate) fn encode_key<'a>(chunks: impl ExactSizeIterator<Item = KeyChunk<'a>>) -> Vec<u8> {
    KEY.encode(chunks)
}

/// Decodes a remote key. Chunks must be non-empty and contiguous; every length is checked
/// against the bytes present before anything is allocated.
pub(crate) fn decode_key(bytes: &[u8]) -> Result<Vec<KeyChunk<'_>>, UcxError> {
    Ok(KEY.decode(bytes)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        encode_key(
            [
                KeyChunk {
                    addr: 4096,
                    len: 100,
                    blob: b"abc",
                },
                KeyChunk {
                    addr: 4196,
                    len: 7,
                    blob: b"de",
                },
            ]
            .into_iter(),
        )
    }

    #[test]
    fn key_round_trip() {
        let bytes = sample();
        let chunks = decode_key(&bytes).unwrap();
        assert_eq!(chunks.len(), 2);
        assert_eq!(chunks[1].addr, 4196);
        assert_eq!(chunks[1].blob, b"de");
    }

    #[test]
    fn every_truncation_and_trailing_byte_is_rejected() {
        let bytes = sample();
        for n in 0..bytes.len() {
            assert!(decode_key(&bytes[..n]).is_err(), "prefix of {n} bytes");
        }
        let mut long = bytes.clone();
        long.push(0);
        assert!(decode_key(&long).is_err());
    }

    #[test]
    fn gaps_and_huge_counts_are_rejected() {
        let gap = encode_key(
            [
                KeyChunk {
                    addr: 0,
                    len: 10,
                    blob: b"a",
                },
                KeyChunk {
                    addr: 11,
                    len: 10,
                    blob: b"b",
                },
            ]
            .into_iter(),
        );
        assert!(decode_key(&gap).is_err());
        let mut huge = KEY_MAGIC.to_vec();
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_key(&huge).is_err());
    }

    #[test]
    fn address_round_trip_and_corruption() {
        let framed = encode_address(b"worker-address");
        assert_eq!(decode_address(&framed).unwrap(), b"worker-address");
        for i in 0..framed.len() {
            let mut bad = framed.clone();
            bad[i] ^= 0x40;
            assert!(decode_address(&bad).is_err(), "flipped byte {i}");
        }
        assert!(decode_address(&[]).is_err());
    }
}
