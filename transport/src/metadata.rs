//! The agent metadata wire format: little-endian, versioned, every length checked against the
//! bytes present and a fixed maximum before anything is allocated.

use crate::engine::wire::{Reader, WireError};
use crate::engine::{PeerInfo, RemoteReg};
use crate::error::MetadataError;

const MAGIC: &[u8; 4] = b"TSRA";
const VERSION: u16 = 1;
/// Longest agent name.
pub(crate) const MAX_NAME: usize = 255;
const MAX_KIND: usize = 32;
const MAX_ADDRESS: usize = 1 << 20;
const MAX_KEY: usize = 1 << 16;
const MAX_REGS: usize = 1 << 20;
/// Smallest encoding of one registration: id, len, key length.
const MIN_REG: usize = 8 + 8 + 4;

pub(crate) fn encode(info: &PeerInfo) -> Vec<u8> {
    let keys: usize = info.regs.iter().map(|r| MIN_REG + r.key.len()).sum();
    let mut out =
        Vec::with_capacity(16 + info.name.len() + info.kind.len() + info.address.len() + keys);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.push(info.name.len() as u8);
    out.extend_from_slice(info.name.as_bytes());
    out.push(info.kind.len() as u8);
    out.extend_from_slice(info.kind.as_bytes());
    out.extend_from_slice(&(info.address.len() as u32).to_le_bytes());
    out.extend_from_slice(&info.address);
    out.extend_from_slice(&(info.regs.len() as u32).to_le_bytes());
    for r in &info.regs {
        out.extend_from_slice(&r.id.to_le_bytes());
        out.extend_from_slice(&r.len.to_le_bytes());
        out.extend_from_slice(&(r.key.len() as u32).to_le_bytes());
        out.extend_from_slice(&r.key);
    }
    out
}

impl From<WireError> for MetadataError {
    fn from(e: WireError) -> Self {
        match e {
            WireError::Truncated { what, needed } => MetadataError::Truncated { what, needed },
            WireError::TooLarge { what, len, max } => MetadataError::TooLarge { what, len, max },
        }
    }
}

/// A UTF-8 string of `len` bytes, at most `max`.
fn string(
    r: &mut Reader<'_>,
    len: usize,
    max: usize,
    what: &'static str,
) -> Result<String, MetadataError> {
    let b = r.limited(len, max, what)?;
    std::str::from_utf8(b)
        .map(str::to_owned)
        .map_err(|_| MetadataError::Invalid { what })
}

pub(crate) fn decode(bytes: &[u8]) -> Result<PeerInfo, MetadataError> {
    let mut r = Reader::new(bytes);
    if r.take(4, "magic")? != MAGIC {
        return Err(MetadataError::BadMagic);
    }
    let version = r.u16("version")?;
    if version != VERSION {
        return Err(MetadataError::Version {
            found: version,
            expected: VERSION,
        });
    }
    let name_len = r.u8("name length")? as usize;
    let name = string(&mut r, name_len, MAX_NAME, "name")?;
    if name.is_empty() {
        return Err(MetadataError::Invalid { what: "name" });
    }
    let kind_len = r.u8("kind length")? as usize;
    let kind = string(&mut r, kind_len, MAX_KIND, "kind")?;
    let addr_len = r.u32("address length")? as usize;
    let address = r.limited(addr_len, MAX_ADDRESS, "address")?.to_vec();
    let count = r.u32("registration count")? as usize;
    if count > MAX_REGS {
        return Err(MetadataError::TooLarge {
            what: "registration count",
            len: count as u64,
            max: MAX_REGS as u64,
        });
    }
    if count.saturating_mul(MIN_REG) > r.rest().len() {
        return Err(MetadataError::Truncated {
            what: "registrations",
            needed: count * MIN_REG - r.rest().len(),
        });
    }
    let mut regs = Vec::with_capacity(count);
    for _ in 0..count {
        let id = r.u64("registration id")?;
        let len = r.u64("registration length")?;
        if len == 0 {
            return Err(MetadataError::Invalid {
                what: "registration length",
            });
        }
        let key_len = r.u32("key length")? as usize;
        let key = r.limited(key_len, MAX_KEY, "key")?.to_vec();
        regs.push(RemoteReg { id, len, key });
    }
    if !r.rest().is_empty() {
        return Err(MetadataError::Trailing {
            extra: r.rest().len(),
        });
    }
    Ok(PeerInfo {
        name,
        kind,
        address,
        regs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> PeerInfo {
        PeerInfo {
            name: "trainer-0".into(),
            kind: "tcp".into(),
            address: b"127.0.0.1:9000".to_vec(),
            regs: vec![
                RemoteReg {
                    id: 7,
                    len: 5 << 30,
                    key: vec![],
                },
                RemoteReg {
                    id: 9,
                    len: 4096,
                    key: vec![1, 2, 3],
                },
            ],
        }
    }

    #[test]
    fn round_trip() {
        let info = sample();
        assert_eq!(decode(&encode(&info)).unwrap(), info);
    }

    #[test]
    fn every_truncation_is_an_error() {
        let bytes = encode(&sample());
        for cut in 0..bytes.len() {
            assert!(decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut extra = bytes.clone();
        extra.push(0);
        assert_eq!(decode(&extra), Err(MetadataError::Trailing { extra: 1 }));
    }

    #[test]
    fn huge_counts_are_refused_before_allocating() {
        let mut bytes = encode(&PeerInfo {
            regs: vec![],
            ..sample()
        });
        let n = bytes.len();
        bytes[n - 4..].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            decode(&bytes),
            Err(MetadataError::TooLarge { .. })
        ));
        bytes[n - 4..].copy_from_slice(&1000u32.to_le_bytes());
        assert!(matches!(
            decode(&bytes),
            Err(MetadataError::Truncated { .. })
        ));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode(&bytes);
            let mut good = encode(&sample());
            let n = good.len();
            for (i, b) in bytes.iter().enumerate() {
                good[i % n] ^= b;
            }
            let _ = decode(&good);
        }
    }
}
