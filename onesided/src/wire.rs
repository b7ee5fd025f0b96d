//! Reading the blobs a peer sends (addresses, remote keys): checked little-endian reads that
//! fail with [`Malformed`] instead of panicking or reading past the end, and the bounds check
//! every descriptor passes before an engine sees it.

use tessera_transport::engine::wire;

/// A blob from a peer that does not parse; nothing was handed to the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("malformed {what}: {detail}")]
pub struct Malformed {
    /// What the blob is: `address`, `key`, ...
    pub what: &'static str,
    /// What is wrong with it.
    pub detail: &'static str,
}

/// Reads a blob front to back through the transport's checked reader
/// ([`tessera_transport::engine::wire::Reader`]), its errors as [`Malformed`] of this blob.
#[derive(Debug)]
pub struct Reader<'a> {
    inner: wire::Reader<'a>,
    what: &'static str,
}

impl<'a> Reader<'a> {
    /// A reader of `bytes`, a `what` (named in errors).
    pub fn new(bytes: &'a [u8], what: &'static str) -> Self {
        Self {
            inner: wire::Reader::new(bytes),
            what,
        }
    }

    /// An error about this blob.
    pub fn malformed(&self, detail: &'static str) -> Malformed {
        Malformed {
            what: self.what,
            detail,
        }
    }

    /// The bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.inner.rest().len()
    }

    /// The next `n` bytes; `truncated` if fewer are left.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], Malformed> {
        let what = self.what;
        self.inner
            .take(n, what)
            .map_err(|_| self.malformed("truncated"))
    }

    /// The next four bytes as a little-endian `u32`.
    pub fn u32(&mut self) -> Result<u32, Malformed> {
        let what = self.what;
        self.inner
            .u32(what)
            .map_err(|_| self.malformed("truncated"))
    }

    /// The next eight bytes as a little-endian `u64`.
    pub fn u64(&mut self) -> Result<u64, Malformed> {
        let what = self.what;
        self.inner
            .u64(what)
            .map_err(|_| self.malformed("truncated"))
    }

    /// Ends the blob: `trailing bytes` if any are left.
    pub fn finish(&self) -> Result<(), Malformed> {
        if self.inner.rest().is_empty() {
            Ok(())
        } else {
            Err(self.malformed("trailing bytes"))
        }
    }
}

/// Whether `len` bytes at `offset` are a non-empty range inside a registration of `reg_len`
/// bytes (without overflow).
pub fn in_bounds(offset: u64, len: u64, reg_len: u64) -> bool {
    len > 0 && offset.checked_add(len).is_some_and(|end| end <= reg_len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_are_checked() {
        let bytes = [1, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 9];
        let mut r = Reader::new(&bytes, "key");
        assert_eq!(r.u32(), Ok(1));
        assert_eq!(r.u64(), Ok(2));
        assert_eq!(r.remaining(), 1);
        assert_eq!(r.finish().unwrap_err().detail, "trailing bytes");
        let err = r.u32().unwrap_err();
        assert_eq!(err.to_string(), "malformed key: truncated");
        assert_eq!(r.take(1), Ok(&[9][..]));
        assert_eq!(r.finish(), Ok(()));
    }

    #[test]
    fn bounds() {
        assert!(in_bounds(0, 4, 4));
        assert!(!in_bounds(1, 4, 4));
        assert!(!in_bounds(0, 0, 4));
        assert!(!in_bounds(u64::MAX, 2, u64::MAX));
    }
}
