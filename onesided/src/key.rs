//! The chunked remote key both engines hand to peers: a magic, the chunk count, then per chunk
//! its address and length (and, for engines that need one, the engine's own key of that chunk).
//!
//! A registration larger than an engine's chunk size is registered as several chunks; its key
//! lists every chunk, and decoding checks every length against the bytes present before
//! allocating, every chunk non-empty and not wrapping the address space, and the chunks
//! contiguous, so that a peer's key describes one range or is refused.

use crate::wire::{Malformed, Reader};

/// One registered chunk as a peer sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyChunk<'a> {
    /// Address of the chunk in the owner's address space.
    pub addr: u64,
    /// Its length.
    pub len: u64,
    /// The engine's own key of the chunk (UCX's packed rkey); empty where the format carries
    /// none.
    pub blob: &'a [u8],
}

/// One engine's key layout.
#[derive(Debug, Clone, Copy)]
pub struct KeyFormat {
    /// The first four bytes of every key.
    pub magic: &'static [u8; 4],
    /// The most chunks one key may list.
    pub max_chunks: u32,
    /// The longest blob a chunk may carry; 0: chunks carry no blob (nor its length).
    pub max_blob: u32,
}

impl KeyFormat {
    /// Encodes `chunks` (their blobs are left out when the format carries none).
    pub fn encode<'a>(&self, chunks: impl ExactSizeIterator<Item = KeyChunk<'a>>) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 + 16 * chunks.len());
        out.extend_from_slice(self.magic);
        out.extend_from_slice(&(chunks.len() as u32).to_le_bytes());
        for c in chunks {
            out.extend_from_slice(&c.addr.to_le_bytes());
            out.extend_from_slice(&c.len.to_le_bytes());
            if self.max_blob > 0 {
                out.extend_from_slice(&(c.blob.len() as u32).to_le_bytes());
                out.extend_from_slice(c.blob);
            }
        }
        out
    }

    /// Decodes a key; see the module docs for what is checked.
    pub fn decode<'a>(&self, bytes: &'a [u8]) -> Result<Vec<KeyChunk<'a>>, Malformed> {
        let mut r = Reader::new(bytes, "key");
        if r.take(4)? != self.magic {
            return Err(r.malformed("bad magic"));
        }
        let count = r.u32()?;
        if count == 0 || count > self.max_chunks {
            return Err(r.malformed("chunk count out of bounds"));
        }
        // Reject a count the input cannot hold before reserving room for it.
        let least = if self.max_blob > 0 { 20 } else { 16 };
        if (count as usize).saturating_mul(least) > r.remaining() {
            return Err(r.malformed("truncated"));
        }
        let mut chunks = Vec::with_capacity(count as usize);
        let mut next: Option<u64> = None;
        for _ in 0..count {
            let addr = r.u64()?;
            let len = r.u64()?;
            let blob_len = if self.max_blob > 0 { r.u32()? } else { 0 };
            if len == 0 {
                return Err(r.malformed("empty chunk"));
            }
            if addr.checked_add(len).is_none() {
                return Err(r.malformed("chunk wraps the address space"));
            }
            if next.is_some_and(|n| n != addr) {
                return Err(r.malformed("chunks are not contiguous"));
            }
            next = Some(addr + len);
            if self.max_blob > 0 && (blob_len == 0 || blob_len > self.max_blob) {
                return Err(r.malformed("rkey length out of bounds"));
            }
            let blob = r.take(blob_len as usize)?;
            chunks.push(KeyChunk { addr, len, blob });
        }
        r.finish()?;
        Ok(chunks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BARE: KeyFormat = KeyFormat {
        magic: b"TST1",
        max_chunks: 4,
        max_blob: 0,
    };
    const BLOBS: KeyFormat = KeyFormat {
        magic: b"TST2",
        max_chunks: 4,
        max_blob: 8,
    };

    fn chunks() -> [KeyChunk<'static>; 2] {
        [
            KeyChunk {
                addr: 4096,
                len: 100,
                blob: b"abc",
            },
            KeyChunk {
                addr: 4196,
                len: 50,
                blob: b"de",
            },
        ]
    }

    #[test]
    fn round_trips_with_and_without_blobs() {
        let key = BLOBS.encode(chunks().into_iter());
        assert_eq!(BLOBS.decode(&key).unwrap(), chunks());
        let key = BARE.encode(chunks().into_iter());
        assert_eq!(key.len(), 8 + 2 * 16);
        let got = BARE.decode(&key).unwrap();
        assert_eq!((got[1].addr, got[1].len, got[1].blob), (4196, 50, &b""[..]));
    }

    #[test]
    fn every_truncation_trailing_byte_and_foreign_magic_is_rejected() {
        for format in [BARE, BLOBS] {
            let key = format.encode(chunks().into_iter());
            for n in 0..key.len() {
                assert!(format.decode(&key[..n]).is_err(), "prefix of {n} bytes");
            }
            let mut long = key.clone();
            long.push(0);
            assert_eq!(format.decode(&long).unwrap_err().detail, "trailing bytes");
        }
        let key = BARE.encode(chunks().into_iter());
        assert_eq!(BLOBS.decode(&key).unwrap_err().detail, "bad magic");
    }

    #[test]
    fn gaps_empty_wrapping_and_huge_counts_are_rejected() {
        let mut gap = chunks();
        gap[1].addr += 1;
        let detail = |c: &[KeyChunk<'_>]| {
            BARE.decode(&BARE.encode(c.iter().copied()))
                .unwrap_err()
                .detail
        };
        assert_eq!(detail(&gap), "chunks are not contiguous");
        let mut empty = chunks();
        empty[0].len = 0;
        assert_eq!(detail(&empty), "empty chunk");
        let mut wraps = chunks();
        wraps[1].addr = u64::MAX - 1;
        wraps[1].len = 2;
        assert_eq!(detail(&wraps[1..]), "chunk wraps the address space");
        let mut huge = BARE.magic.to_vec();
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            BARE.decode(&huge).unwrap_err().detail,
            "chunk count out of bounds"
        );
    }
}
