//! Registered memory: the chunks registered with NIXL, and the remote key that lists their
//! addresses and lengths for peers.

use super::*;

pub(super) struct RegInner {
    pub(super) engine: Arc<Inner>,
    pub(super) handles: Vec<RegistrationHandle>,
    pub(super) base: usize,
    pub(super) len: u64,
    /// (start offset, length) of each chunk.
    pub(super) chunks: Vec<(u64, u64)>,
    /// Keeps the memory mapped; dropped after the handles are deregistered.
    pub(super) _owner: Option<Box<dyn Send + Sync>>,
}

impl Drop for RegInner {
    fn drop(&mut self) {
        let st = lock(&self.engine.state);
        self.handles.clear(); // deregisters, serialized with every other NIXL call
        drop(st);
        self.engine
            .registrations
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A registered range (one or more NIXL registrations). Cheap to clone; deregistered when
/// the last clone, including those held by transfers, is dropped.
#[derive(Clone)]
pub struct NixlRegion {
    pub(super) inner: Arc<RegInner>,
}

impl fmt::Debug for NixlRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NixlRegion")
            .field("base", &(self.inner.base as *const u8))
            .field("len", &self.inner.len)
            .field("chunks", &self.inner.chunks.len())
            .finish()
    }
}

impl NixlRegion {
    /// What a peer passes to [`NixlPeer::add_remote`]: the chunks' addresses and lengths.
    /// (NIXL's own keys travel in [`NixlEngine::metadata`].)
    pub fn remote_key(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 + 16 * self.inner.chunks.len());
        out.extend_from_slice(KEY_MAGIC);
        out.extend_from_slice(&(self.inner.chunks.len() as u32).to_le_bytes());
        for &(start, len) in &self.inner.chunks {
            out.extend_from_slice(&(self.inner.base as u64 + start).to_le_bytes());
            out.extend_from_slice(&len.to_le_bytes());
        }
        out
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.inner.len
    }

    /// Never true: empty registrations are refused.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// First byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.inner.base as *mut u8
    }

    /// Number of NIXL registrations.
    pub fn chunks(&self) -> usize {
        self.inner.chunks.len()
    }
}

pub(super) fn decode_key(bytes: &[u8]) -> Result<RemoteReg, NixlEngineError> {
    let bad = NixlEngineError::Malformed;
    if bytes.len() < 8 || &bytes[..4] != KEY_MAGIC {
        return Err(bad("bad magic or truncated"));
    }
    let mut r = Reader::new(&bytes[4..], "key");
    let count = r.u32()?;
    if count == 0 || count > MAX_CHUNKS {
        return Err(bad("chunk count out of bounds"));
    }
    if r.remaining() != count as usize * 16 {
        return Err(bad("length does not match the chunk count"));
    }
    let mut reg = RemoteReg {
        len: 0,
        chunks: Vec::with_capacity(count as usize),
    };
    let mut next: Option<u64> = None;
    for _ in 0..count {
        let addr = r.u64()?;
        let len = r.u64()?;
        if len == 0 || addr.checked_add(len).is_none() {
            return Err(bad("empty or wrapping chunk"));
        }
        if next.is_some_and(|n| n != addr) {
            return Err(bad("chunks are not contiguous"));
        }
        next = Some(addr + len);
        reg.chunks.push((reg.len, addr, len));
        reg.len += len;
    }
    r.finish()?;
    Ok(reg)
}
