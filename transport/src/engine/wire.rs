//! Checked little-endian reading, for every wire format of the transport and its engines
//! (agent metadata, engine headers, remote keys): each read is checked against the bytes
//! present, and each variable length against a maximum before anything is allocated.

/// A read that the bytes could not satisfy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The bytes end early.
    #[error("{what} truncated: {needed} more bytes needed")]
    Truncated {
        /// The field being read.
        what: &'static str,
        /// Bytes missing.
        needed: usize,
    },
    /// A length exceeds its limit.
    #[error("{what} is {len} long, more than the limit {max}")]
    TooLarge {
        /// The field.
        what: &'static str,
        /// Its announced length.
        len: u64,
        /// The limit.
        max: u64,
    },
}

/// Reads fields off the front of a byte slice.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    /// A reader at the start of `bytes`.
    pub fn new(bytes: &'a [u8]) -> Self {
        Self { bytes }
    }

    /// The bytes not read yet.
    pub fn rest(&self) -> &'a [u8] {
        self.bytes
    }

    /// The next `n` bytes.
    pub fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], WireError> {
        if self.bytes.len() < n {
            return Err(WireError::Truncated {
                what,
                needed: n - self.bytes.len(),
            });
        }
        let (head, tail) = self.bytes.split_at(n);
        self.bytes = tail;
        Ok(head)
    }

    /// The next `N` bytes as an array.
    pub fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], WireError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    /// A byte.
    pub fn u8(&mut self, what: &'static str) -> Result<u8, WireError> {
        Ok(self.take(1, what)?[0])
    }

    /// A little-endian `u16`.
    pub fn u16(&mut self, what: &'static str) -> Result<u16, WireError> {
        self.array(what).map(u16::from_le_bytes)
    }

    /// A little-endian `u32`.
    pub fn u32(&mut self, what: &'static str) -> Result<u32, WireError> {
        self.array(what).map(u32::from_le_bytes)
    }

    /// A little-endian `u64`.
    pub fn u64(&mut self, what: &'static str) -> Result<u64, WireError> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// The next `len` bytes, refused before reading when `len` exceeds `max`.
    pub fn limited(
        &mut self,
        len: usize,
        max: usize,
        what: &'static str,
    ) -> Result<&'a [u8], WireError> {
        if len > max {
            return Err(WireError::TooLarge {
                what,
                len: len as u64,
                max: max as u64,
            });
        }
        self.take(len, what)
    }
}

/// The little-endian `u64` at byte `at` of `b`, if `b` holds it.
pub fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(
        b.get(at..at.checked_add(8)?)?.try_into().ok()?,
    ))
}

/// The little-endian `u32` at byte `at` of `b`, if `b` holds it.
pub fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(
        b.get(at..at.checked_add(4)?)?.try_into().ok()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_read_is_checked() {
        let bytes = [1u8, 2, 0, 3, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0, 9];
        let mut r = Reader::new(&bytes);
        assert_eq!(r.u8("a"), Ok(1));
        assert_eq!(r.u16("b"), Ok(2));
        assert_eq!(r.u32("c"), Ok(3));
        assert_eq!(r.u64("d"), Ok(4));
        assert_eq!(
            r.u16("e"),
            Err(WireError::Truncated {
                what: "e",
                needed: 1
            })
        );
        assert_eq!(r.rest(), [9]);
        assert_eq!(
            r.limited(5, 4, "f"),
            Err(WireError::TooLarge {
                what: "f",
                len: 5,
                max: 4
            })
        );
        assert_eq!(r.limited(1, 4, "g"), Ok(&[9u8][..]));
        // The limit itself is allowed.
        let four = [1u8, 2, 3, 4];
        assert_eq!(Reader::new(&four).limited(4, 4, "h"), Ok(&four[..]));
        assert_eq!(u64_at(&bytes, 7), Some(4));
        assert_eq!(u64_at(&bytes, 9), None);
        assert_eq!(u64_at(&bytes, usize::MAX), None);
        assert_eq!(u32_at(&bytes, 3), Some(3));
        assert_eq!(u32_at(&bytes, 13), None);
    }
}
