#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// The system allocator, counting allocations of at least `threshold` bytes (see the crate's
/// contract). Install it with `#[global_allocator]`.
#[derive(Debug)]
pub struct CountingAlloc {
    threshold: usize,
    count: AtomicU64,
    bytes: AtomicU64,
}

impl CountingAlloc {
    /// Counts allocations and reallocations of at least `threshold` bytes (0: every one).
    pub const fn new(threshold: usize) -> Self {
        Self {
            threshold,
            count: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
        }
    }

    /// Counted allocations so far, in the whole process.
    pub fn count(&self) -> u64 {
        self.count.load(Relaxed)
    }

    /// Bytes of the counted allocations so far (a reallocation counts its new size).
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Relaxed)
    }

    fn note(&self, size: usize) {
        if size >= self.threshold {
            self.count.fetch_add(1, Relaxed);
            self.bytes.fetch_add(size as u64, Relaxed);
        }
    }
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so it upholds
// `GlobalAlloc`'s contract exactly as `System` does; counting touches only atomics and never
// allocates.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        self.note(layout.size());
        // SAFETY: the caller's layout, forwarded to the system allocator.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        self.note(layout.size());
        // SAFETY: the caller's layout, forwarded to the system allocator.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` (through us) with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        self.note(new_size);
        // SAFETY: `ptr` was allocated by `System` (through us) with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// How many pages of `[addr, addr + len)` are resident in memory (`mincore(2)`), and how many
/// pages the range spans, for tests that check what a path faulted in (a prefaulted pool)
/// or left alone. `addr` must be page-aligned. Panics when the range is not all mapped.
pub fn resident_pages(addr: *const u8, len: usize) -> (usize, usize) {
    // SAFETY: sysconf has no memory-safety obligations.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    let mut vec = vec![0u8; len.div_ceil(page)];
    // SAFETY: mincore reads no byte of the range (the kernel checks that it is mapped, and
    // fails otherwise); it writes one byte per page of it into `vec`, which holds that many.
    let rc = unsafe { libc::mincore(addr as *mut libc::c_void, len, vec.as_mut_ptr()) };
    assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
    (vec.iter().filter(|b| *b & 1 == 1).count(), vec.len())
}
