//! Registered memory: the chunks mapped with `ucp_mem_map` and their packed remote keys.

use super::*;

pub(super) struct LocalChunk {
    pub(super) memh: sys::ucp_mem_h,
    /// Offset of the chunk in the registration.
    pub(super) start: u64,
    pub(super) len: u64,
}

pub(super) struct MemInner {
    pub(super) engine: Arc<Inner>,
    pub(super) base: usize,
    pub(super) len: u64,
    pub(super) chunks: Vec<LocalChunk>,
    pub(super) key: Vec<u8>,
    /// Keeps the memory mapped; dropped after the chunks are unmapped.
    pub(super) _owner: Option<Box<dyn Send + Sync>>,
}

// SAFETY: the memory handles are only passed to UCP with the engine's state lock held; `base`
// is an address, never dereferenced by this type.
unsafe impl Send for MemInner {}
// SAFETY: as above; shared access only reads immutable fields.
unsafe impl Sync for MemInner {}

impl Drop for MemInner {
    fn drop(&mut self) {
        let st = self.engine.state.lock();
        for c in &self.chunks {
            // SAFETY: mapped on this context, which is alive (we hold an Arc to it); no
            // transfer uses it any more (transfers hold clones of this Arc); lock held.
            unsafe { sys::ucp_mem_unmap(st.context, c.memh) };
        }
        drop(st);
        self.engine.live_mem.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Tells whether an engine's worker and context still exist (see [`UcxEngine::probe`]).
#[derive(Clone)]
pub struct UcxProbe {
    pub(super) inner: Weak<Inner>,
}

impl std::fmt::Debug for UcxProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxProbe")
            .field("alive", &self.is_alive())
            .finish()
    }
}

impl UcxProbe {
    /// Whether the worker and context are still alive.
    pub fn is_alive(&self) -> bool {
        self.inner.strong_count() > 0
    }
}

/// A registered range (one or more `ucp_mem_map` chunks). Cheap to clone; unmapped when the
/// last clone, including those held by transfers in flight, is dropped.
#[derive(Clone)]
pub struct MemRegion {
    pub(super) inner: Arc<MemInner>,
}

impl std::fmt::Debug for MemRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemRegion")
            .field("base", &(self.inner.base as *const u8))
            .field("len", &self.inner.len)
            .field("chunks", &self.inner.chunks.len())
            .finish()
    }
}

impl MemRegion {
    /// What a peer passes to [`UcxEndpoint::add_remote`]: chunk addresses and packed keys.
    pub fn remote_key(&self) -> &[u8] {
        &self.inner.key
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

    /// Number of `ucp_mem_map` chunks.
    pub fn chunks(&self) -> usize {
        self.inner.chunks.len()
    }
}
