//! The copy the memory engines (`shm`, `inproc`) run between mapped ranges, and
//! [`Region::write_at`](crate::Region::write_at) and [`Region::read_at`](crate::Region::read_at)
//! between a region and a caller's buffer.
//!
//! Two things set it apart from a plain `memcpy`, both for large segments (from
//! [`STREAM_MIN`] bytes on) alone; smaller ones are copied as before:
//!
//! - **Non-temporal stores** (on x86-64). A cached store first reads the destination's line
//!   into the cache; a streamed one writes the line whole, so a copy larger than the cache
//!   moves two passes over memory instead of three. glibc streams only from a threshold it
//!   derives from the cache size (240 MiB on the benchmark machine): there its 64 MiB copy
//!   runs at about 13.7 GB/s and the streamed one at 20.3. A segment this large leaves the
//!   cache to its reader either way.
//! - **The core is offered to other threads every slice of the copy** (`sched_yield`), 4 MiB
//!   unless the agent says otherwise ([`Agent::set_copy_slice`](crate::Agent::set_copy_slice)).
//!   A 64 MiB copy holds a core for several milliseconds; a thread woken on that core (a
//!   unit's worker with a 4-byte PUT to answer) waited for the copy's whole time slice. The
//!   yield moves the copy's deadline, not its share of the core, and returns at once when
//!   nothing else waits.
//!
//! Measured by `cargo xtask bench storage` (BENCHMARKS.md): the 256 MiB PUT and GET over shm
//! and the 16 MiB PUTs about 1.5 times as fast; under 32 sessions of mixed PUT/GET
//! (`load32`) the median PUT half as long and the small PUTs' p99 about two thirds, the
//! large ones' p99 unchanged. Offering the core every 1 MiB halved the median again but
//! made the large PUTs' p99 a third longer; the small requests and batches, whose segments
//! are smaller, did not move. That was the client's copies: a storage unit's agent, whose
//! other workers serve other sessions, offers its core every 1 MiB (see the storage crate's
//! `ServerConfig::copy_slice_bytes`).

use std::ptr;

/// Segments from this length on are copied with non-temporal stores.
const STREAM_MIN: usize = 4 << 20;

/// Bytes copied between offers of the core to other threads, unless the agent sets its own.
pub(crate) const SLICE: usize = 4 << 20;

/// The shortest slice an agent may set: shorter ones would spend more on `sched_yield` than
/// they gain.
pub(crate) const MIN_SLICE: usize = 64 << 10;

/// One transfer's copy, segment by segment. Dropping it orders its streamed stores before
/// whatever the thread stores next (the record or message saying the data landed).
pub(crate) struct Copier {
    /// Whether a non-temporal store was issued (then a fence is due).
    streamed: bool,
    /// Bytes copied between offers of the core.
    slice: usize,
}

impl Default for Copier {
    fn default() -> Self {
        Self::with_slice(SLICE)
    }
}

impl Copier {
    /// A copier that offers its core every `slice` bytes (at least [`MIN_SLICE`]).
    pub(crate) fn with_slice(slice: usize) -> Self {
        Self {
            streamed: false,
            slice: slice.max(MIN_SLICE),
        }
    }

    /// Copies `len` bytes from `src` to `dst`; ranges that overlap are copied as `memmove`
    /// would.
    ///
    /// # Safety
    ///
    /// `src` must be valid for reads and `dst` for writes of `len` bytes, for the whole call.
    pub(crate) unsafe fn copy(&mut self, src: *const u8, dst: *mut u8, len: usize) {
        if len < STREAM_MIN || overlap(src, dst, len) {
            // SAFETY: the caller's ranges; `ptr::copy` allows overlap.
            unsafe { ptr::copy(src, dst, len) };
            return;
        }
        self.streamed = true;
        let mut at = 0;
        while at < len {
            if at > 0 {
                std::thread::yield_now();
            }
            let n = (len - at).min(self.slice);
            // SAFETY: `at + n <= len`, so both subranges lie in what the caller vouched for,
            // and the ranges do not overlap.
            unsafe { stream_copy(src.add(at), dst.add(at), n) };
            at += n;
        }
    }
}

impl Drop for Copier {
    fn drop(&mut self) {
        if self.streamed {
            store_fence();
        }
    }
}

/// Whether `[src, src + len)` and `[dst, dst + len)` share a byte.
fn overlap(src: *const u8, dst: *mut u8, len: usize) -> bool {
    let (s, d) = (src as usize, dst as usize);
    s < d.saturating_add(len) && d < s.saturating_add(len)
}

/// Copies with non-temporal stores: the destination's head up to a 64-byte boundary and its
/// tail with plain ones, the lines between whole.
///
/// # Safety
///
/// As [`Copier::copy`], and the ranges do not overlap.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_copy(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    let head = dst.align_offset(64).min(len);
    // SAFETY: every access below stays within `len` bytes of `src` and `dst` (the caller's
    // ranges, which do not overlap); the streamed stores go to 64-byte aligned lines of `dst`
    // (SSE2, part of x86-64), the loads may be unaligned.
    unsafe {
        ptr::copy_nonoverlapping(src, dst, head);
        let mut i = head;
        while i + 64 <= len {
            let s = src.add(i).cast::<__m128i>();
            let d = dst.add(i).cast::<__m128i>();
            let (a, b, c, e) = (
                _mm_loadu_si128(s),
                _mm_loadu_si128(s.add(1)),
                _mm_loadu_si128(s.add(2)),
                _mm_loadu_si128(s.add(3)),
            );
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
            i += 64;
        }
        ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i);
    }
}

/// Elsewhere a plain copy.
///
/// # Safety
///
/// As [`Copier::copy`], and the ranges do not overlap.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn stream_copy(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: the caller's ranges, which do not overlap.
    unsafe { ptr::copy_nonoverlapping(src, dst, len) };
}

/// Orders the non-temporal stores before later stores.
fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sfence` has no preconditions (SSE, part of x86-64).
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
    #[cfg(not(target_arch = "x86_64"))]
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}

#[cfg(test)]
mod tests {
    use super::{Copier, MIN_SLICE, SLICE, STREAM_MIN};

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 + i / 251) as u8).collect()
    }

    #[test]
    fn copies_every_byte_at_any_alignment_and_length() {
        let src = pattern(STREAM_MIN + 3 * 64 + 7);
        for len in [
            0,
            1,
            63,
            64,
            65,
            SLICE - 1,
            SLICE + 1,
            STREAM_MIN,
            STREAM_MIN + 129,
        ] {
            for (s_off, d_off) in [(0, 0), (1, 0), (0, 5), (13, 61), (64, 3)] {
                if s_off + len > src.len() {
                    continue;
                }
                // The default slice, and the shortest, which cuts the large copies into
                // dozens of slices.
                for slice in [SLICE, MIN_SLICE] {
                    let mut dst = vec![0xAAu8; len + d_off + 9];
                    {
                        let mut c = Copier::with_slice(slice);
                        // SAFETY: both ranges lie inside their vectors.
                        unsafe {
                            c.copy(src.as_ptr().add(s_off), dst.as_mut_ptr().add(d_off), len)
                        };
                    }
                    assert_eq!(
                        &dst[d_off..d_off + len],
                        &src[s_off..s_off + len],
                        "{len} {s_off} {d_off} {slice}"
                    );
                    assert!(dst[..d_off].iter().all(|&b| b == 0xAA), "before, {len}");
                    assert!(
                        dst[d_off + len..].iter().all(|&b| b == 0xAA),
                        "after, {len}"
                    );
                }
            }
        }
    }

    #[test]
    fn only_large_ranges_apart_are_streamed() {
        let mut buf = vec![0u8; 3 * STREAM_MIN];
        let base = buf.as_mut_ptr();
        let streamed = |src: usize, dst: usize, len: usize| {
            let mut c = Copier::default();
            // SAFETY: every range below lies inside `buf`.
            unsafe { c.copy(base.add(src), base.add(dst), len) };
            c.streamed
        };
        assert!(streamed(0, STREAM_MIN, STREAM_MIN), "adjacent ranges");
        assert!(streamed(STREAM_MIN, 0, STREAM_MIN), "adjacent, backward");
        assert!(streamed(2 * STREAM_MIN, 0, STREAM_MIN), "backward, apart");
        assert!(!streamed(0, STREAM_MIN, STREAM_MIN - 1), "small");
        assert!(
            !streamed(0, STREAM_MIN - 1, STREAM_MIN),
            "overlapping by one byte"
        );
        assert!(
            !streamed(STREAM_MIN - 1, 0, STREAM_MIN),
            "overlapping backward"
        );
    }

    #[test]
    fn overlapping_ranges_copy_as_memmove() {
        let len = STREAM_MIN + 100;
        for shift in [1usize, 4096] {
            let mut buf = pattern(len + shift);
            let expected = buf[..len].to_vec();
            let mut c = Copier::default();
            // SAFETY: both ranges lie inside `buf`; they overlap, which `copy` allows.
            unsafe { c.copy(buf.as_ptr(), buf.as_mut_ptr().add(shift), len) };
            drop(c);
            assert_eq!(&buf[shift..], &expected[..], "forward by {shift}");
            let mut buf = pattern(len + shift);
            let expected = buf[shift..].to_vec();
            let mut c = Copier::default();
            // SAFETY: as above.
            unsafe { c.copy(buf.as_ptr().add(shift), buf.as_mut_ptr(), len) };
            drop(c);
            assert_eq!(&buf[..len], &expected[..], "backward by {shift}");
        }
    }
}
