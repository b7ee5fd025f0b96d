//! The byte formats this engine hands to peers: worker addresses and remote keys.
//!
//! Both are framed by us, so that a truncated or corrupted blob is rejected here, with an
//! error, before UCX parses a byte of it. Pure code, no UCX calls.

use tessera_onesided::Reader;

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

/// One registered chunk as a peer sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KeyChunk<'a> {
    /// Address of the chunk in the owner's address space.
    pub(crate) addr: u64,
    /// Its length.
    pub(crate) len: u64,
    /// The packed UCX rkey.
    pub(crate) rkey: &'a [u8],
}

/// Encodes a remote key: magic, chunk count, then per chunk address, length and packed rkey.
pub(crate) fn encode_key<'a>(chunks: impl ExactSizeIterator<Item = KeyChunk<'a>>) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(KEY_MAGIC);
    out.extend_from_slice(&(chunks.len() as u32).to_le_bytes());
    for c in chunks {
        out.extend_from_slice(&c.addr.to_le_bytes());
        out.extend_from_slice(&c.len.to_le_bytes());
        out.extend_from_slice(&(c.rkey.len() as u32).to_le_bytes());
        out.extend_from_slice(c.rkey);
    }
    out
}

/// Decodes a remote key. Chunks must be non-empty and contiguous; every length is checked
/// against the bytes present before anything is allocated.
pub(crate) fn decode_key(bytes: &[u8]) -> Result<Vec<KeyChunk<'_>>, UcxError> {
    let bad = |detail| UcxError::Malformed {
        what: "key",
        detail,
    };
    let mut r = Reader::new(bytes, "key");
    if r.take(4)? != KEY_MAGIC {
        return Err(bad("bad magic"));
    }
    let count = r.u32()?;
    if count == 0 || count > MAX_CHUNKS {
        return Err(bad("chunk count out of bounds"));
    }
    // Each chunk takes at least 20 bytes: reject a count the input cannot hold before
    // reserving room for it.
    if (count as usize).saturating_mul(20) > r.remaining() {
        return Err(bad("truncated"));
    }
    let mut chunks = Vec::with_capacity(count as usize);
    let mut next: Option<u64> = None;
    for _ in 0..count {
        let addr = r.u64()?;
        let len = r.u64()?;
        let klen = r.u32()?;
        if len == 0 {
            return Err(bad("empty chunk"));
        }
        if addr.checked_add(len).is_none() {
            return Err(bad("chunk wraps the address space"));
        }
        if next.is_some_and(|n| n != addr) {
            return Err(bad("chunks are not contiguous"));
        }
        next = Some(addr + len);
        if klen == 0 || klen > MAX_RKEY {
            return Err(bad("rkey length out of bounds"));
        }
        let rkey = r.take(klen as usize)?;
        chunks.push(KeyChunk { addr, len, rkey });
    }
    r.finish()?;
    Ok(chunks)
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
                    rkey: b"abc",
                },
                KeyChunk {
                    addr: 4196,
                    len: 7,
                    rkey: b"de",
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
        assert_eq!(chunks[1].rkey, b"de");
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
                    rkey: b"a",
                },
                KeyChunk {
                    addr: 11,
                    len: 10,
                    rkey: b"b",
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
