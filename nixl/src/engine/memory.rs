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
        let st = self.engine.state.lock();
        self.handles.clear(); // deregisters, serialized with every other NIXL call
        drop(st);
        self.engine
            .registrations
            .fetch_sub(1, tessera_sync::atomic::Ordering::Relaxed);
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
        KEY.encode(self.inner.chunks.iter().map(|&(start, len)| KeyChunk {
            addr: self.inner.base as u64 + start,
            len,
            blob: &[],
        }))
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
    let chunks = KEY.decode(bytes)?;
    let mut reg = RemoteReg {
        len: 0,
        chunks: Vec::with_capacity(chunks.len()),
    };
    for c in chunks {
        reg.chunks.push((reg.len, c.addr, c.len));
        reg.len += c.len;
    }
    Ok(reg)
}
