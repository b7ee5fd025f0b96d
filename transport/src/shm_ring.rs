//! The `shm` engine's rings: single-producer, single-consumer byte rings in memfds that the
//! target of a link creates and maps into the initiator. One carries the initiator's WRITE
//! records to the target (below); the other the target's announcements of standing ranges to
//! the initiator, which takes it before every transfer it posts (see `shm`).
//!
//! A WRITE into a standing range is a copy the initiator runs itself; the target learns that
//! it landed from a record. Sent over the link's socket (`WROTE`), that record costs a system
//! call on the initiator and a wake-up of the target's serving thread, and whoever waits for
//! the WRITE is woken by that thread in turn: tens of microseconds on a virtual machine. In
//! the ring the record is a few stores: a target thread that spins for it
//! ([`Ring::watch`]) takes it itself within a cache-line transfer. The socket still carries a
//! doorbell (`RECORDS`) when no target thread watches, so that the serving thread takes the
//! records instead.
//!
//! **No lost doorbell.** The producer stores its tail, fences, then reads the watcher count;
//! a watcher that stops decrements the count, fences, then takes what the ring holds. With
//! both fences sequentially consistent, either the producer sees the watcher (and the watcher's
//! last take sees the record) or it sees none and rings (the loom tests below check it).
//!
//! **Trust.** The producer is the peer. Everything read from the ring is bounded before use:
//! a tail more than the capacity ahead, a record running past the tail or the data area's end,
//! ends the link ([`Malformed`]). The consumer copies each record out of the shared memory
//! before it parses it, and the target checks every span it names against its exposures as it
//! would a `WROTE`'s. A target can corrupt its own ring only: the producer bounds every store
//! by the capacity and treats a head it cannot believe as a full ring. In the ring of
//! announcements the roles swap: the target produces, and the initiator parses each record as
//! the `STANDING` or `REVOKE` it would read on the socket.

use std::os::fd::OwnedFd;
use std::ptr::NonNull;
use tessera_sync::atomic::{fence, AtomicU64, Ordering};

use crate::Region;

/// Where the data area starts in the ring's memory: the header has its own page.
pub(crate) const DATA_AT: usize = 4096;
/// The ring's memory: its header's page and 256 KiB of records.
pub(crate) const RING_BYTES: u64 = (DATA_AT + (256 << 10)) as u64;
/// A record's length prefix; this value instead says the rest of the data area is skipped.
const WRAP: u32 = u32::MAX;
/// Records are stored at multiples of this.
const ALIGN: u64 = 8;

/// The ring's header, at the start of its memory. Each side writes its own line.
#[repr(C)]
pub(crate) struct Header {
    /// Bytes ever pushed, wrap gaps included (written by the producer).
    tail: AtomicU64,
    _tail_line: [u64; 7],
    /// Bytes ever taken (written by the consumer).
    head: AtomicU64,
    _head_line: [u64; 7],
    /// Consumer threads spinning on the ring now: the producer rings no doorbell while any is.
    watchers: AtomicU64,
}

impl Header {
    #[cfg(test)]
    fn new() -> Self {
        Self {
            tail: AtomicU64::new(0),
            _tail_line: [0; 7],
            head: AtomicU64::new(0),
            _head_line: [0; 7],
            watchers: AtomicU64::new(0),
        }
    }
}

/// The ring's data is not what its producer may have written: the link must end.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Malformed;

/// Where a pushed record stands.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Pushed {
    /// A consumer thread watches the ring: it takes the record.
    Watched,
    /// Nobody watches: the producer must ring the doorbell.
    Unwatched,
    /// No room (or a record too large for the ring): send it another way.
    NoRoom,
}

/// A ring and the memfd it lies in, mapped for as long as it lives: the target's (which
/// creates it) or the initiator's (which maps what the target sent).
pub(crate) struct MappedRing {
    ring: Ring,
    memory: Region,
}

impl MappedRing {
    /// A new ring in a fresh memfd of [`RING_BYTES`] named `name`, for the target of a link.
    pub(crate) fn create(name: &str) -> Option<Self> {
        Self::over(Region::memfd(name, RING_BYTES).ok()?)
    }

    /// The ring the target sent: its memfd, of `len` bytes. `None` when it cannot be used.
    pub(crate) fn map(fd: OwnedFd, len: u64) -> Option<Self> {
        if len != RING_BYTES {
            return None;
        }
        Self::over(Region::map_sealed(fd, len).ok()?)
    }

    fn over(memory: Region) -> Option<Self> {
        // Every page is faulted in up front, on both sides: each record of the ring's first
        // lap would otherwise stop its writer on a fresh page (a batch PUT's record is a few
        // KiB, so its first few dozen WRITEs each paid one), and its reader on the same page.
        // A ring that cannot be populated (no memory for it now) still works, faulting as
        // it goes.
        let _ = memory.populate();
        let base = NonNull::new(memory.as_ptr())?;
        // SAFETY: a shared mapping of `RING_BYTES` of a memfd, page-aligned, that `memory`
        // keeps mapped for as long as the ring lives: a fresh one (zeroed), or one the target
        // sealed against shrinking, so it is never truncated under the mapping. What the other
        // side stores there bounds nothing here (see `Ring`).
        let ring = unsafe { Ring::over(base, RING_BYTES) }?;
        Some(Self { ring, memory })
    }

    /// The memfd, to send to the initiator.
    pub(crate) fn memory(&self) -> &Region {
        &self.memory
    }
}

impl std::ops::Deref for MappedRing {
    type Target = Ring;

    fn deref(&self) -> &Ring {
        &self.ring
    }
}

/// One side's view of a ring (see the module docs). The memory it lies in is kept alive by
/// its owner for as long as the view is used.
pub(crate) struct Ring {
    header: NonNull<Header>,
    data: NonNull<u8>,
    cap: u64,
}

// SAFETY: the view only holds pointers into memory its owner keeps mapped; every access to
// the shared header goes through atomics, and the data area is written only by the producer
// before it publishes the tail and read by the consumer after it acquired it (each side is
// used from one thread at a time: its owner locks it).
unsafe impl Send for Ring {}
// SAFETY: as for `Send`.
unsafe impl Sync for Ring {}

impl Ring {
    /// A view of the ring laid over `len` bytes at `base`, the start of a shared mapping.
    ///
    /// # Safety
    ///
    /// `base` must be page-aligned and valid for reads and writes of `len` bytes for as long
    /// as the view is used, and the header's bytes must be zero or a header's (a fresh memfd,
    /// or one the other side laid out).
    unsafe fn over(base: NonNull<u8>, len: u64) -> Option<Self> {
        let cap = len.checked_sub(DATA_AT as u64)? / ALIGN * ALIGN;
        if cap < 64 {
            return None;
        }
        Some(Self {
            header: base.cast(),
            // SAFETY: `DATA_AT < len`, so the data area starts inside the mapping.
            data: unsafe { base.add(DATA_AT) },
            cap,
        })
    }

    /// A view of a header and data area that live elsewhere (the tests' heap).
    ///
    /// # Safety
    ///
    /// Both must outlive the view; `data` must be valid for `cap` bytes, `cap` a multiple of
    /// 8.
    #[cfg(test)]
    unsafe fn from_parts(header: &Header, data: NonNull<u8>, cap: u64) -> Self {
        Self {
            header: NonNull::from(header),
            data,
            cap,
        }
    }

    fn header(&self) -> &Header {
        // SAFETY: the header lies at the start of memory the owner keeps mapped (`over`), and
        // is only ever accessed through its atomics.
        unsafe { self.header.as_ref() }
    }

    /// The largest record [`Ring::push`] takes: half the data area, its length included.
    pub(crate) fn max_record(&self) -> usize {
        (self.cap / 2) as usize - 4
    }

    /// Producer: appends `record` after the bytes pushed so far (`tail`, the producer's own
    /// count, advanced here) and tells whether a consumer thread watches.
    pub(crate) fn push(&self, tail: &mut u64, record: &[u8]) -> Pushed {
        if record.is_empty() || record.len() > self.max_record() {
            return Pushed::NoRoom;
        }
        let h = self.header();
        let head = h.head.load(Ordering::Acquire);
        // A head the consumer cannot have written leaves no room: nothing more goes this way.
        let Some(free) = self.cap.checked_sub(tail.wrapping_sub(head)) else {
            return Pushed::NoRoom;
        };
        let need = (4 + record.len() as u64).next_multiple_of(ALIGN);
        let at = *tail % self.cap;
        let skip = if need > self.cap - at {
            self.cap - at
        } else {
            0
        };
        if skip + need > free {
            return Pushed::NoRoom;
        }
        if skip != 0 {
            self.put(at, &WRAP.to_le_bytes());
        }
        let at = (*tail + skip) % self.cap;
        self.put(at, &(record.len() as u32).to_le_bytes());
        self.put(at + 4, record);
        *tail += skip + need;
        h.tail.store(*tail, Ordering::Release);
        fence(Ordering::SeqCst);
        match h.watchers.load(Ordering::Relaxed) {
            0 => Pushed::Unwatched,
            _ => Pushed::Watched,
        }
    }

    /// Consumer: hands every record pushed since `head` (the consumer's own count, advanced
    /// here) to `each`, copied out of the shared memory into `scratch` first, and frees their
    /// room. On [`Malformed`], `head` stays after the last good record.
    pub(crate) fn take(
        &self,
        head: &mut u64,
        scratch: &mut Vec<u8>,
        mut each: impl FnMut(&[u8]),
    ) -> Result<(), Malformed> {
        let h = self.header();
        let tail = h.tail.load(Ordering::Acquire);
        // Nothing new: the head's line stays as it is, in the producer's cache too.
        if tail == *head {
            return Ok(());
        }
        if tail.wrapping_sub(*head) > self.cap {
            return Err(Malformed);
        }
        let mut at_head = *head;
        while at_head != tail {
            let left = tail.wrapping_sub(at_head);
            // A multiple of 8 before the data's end: a length prefix fits there.
            let at = at_head % self.cap;
            let mut len = [0u8; 4];
            self.get(at, &mut len);
            let len = u32::from_le_bytes(len);
            if len == WRAP {
                let skip = self.cap - at;
                if skip > left {
                    return Err(Malformed);
                }
                at_head = at_head.wrapping_add(skip);
                continue;
            }
            let need = (4 + u64::from(len)).next_multiple_of(ALIGN);
            if len == 0 || need > left || need > self.cap - at {
                return Err(Malformed);
            }
            scratch.clear();
            scratch.resize(len as usize, 0);
            self.get(at + 4, scratch);
            at_head = at_head.wrapping_add(need);
            *head = at_head;
            each(scratch);
        }
        *head = at_head;
        h.head.store(*head, Ordering::Release);
        Ok(())
    }

    /// Producer: the bytes pushed (up to `tail`) that the consumer has not taken yet; the
    /// whole capacity when its head cannot be believed.
    pub(crate) fn backlog(&self, tail: u64) -> u64 {
        let head = self.header().head.load(Ordering::Acquire);
        tail.wrapping_sub(head).min(self.cap)
    }

    /// The data area's size.
    pub(crate) fn capacity(&self) -> u64 {
        self.cap
    }

    /// Consumer: one more thread spins on the ring; the producer rings no doorbell meanwhile.
    pub(crate) fn watch(&self) {
        self.header().watchers.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// Consumer: a thread stops spinning. It must take the ring once more afterwards: a
    /// record pushed while it still counted came without a doorbell.
    pub(crate) fn unwatch(&self) {
        self.header().watchers.fetch_sub(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// Consumer threads watching now.
    #[cfg(test)]
    pub(crate) fn watchers(&self) -> u64 {
        self.header().watchers.load(Ordering::SeqCst)
    }

    /// Pushes `record` after what the producer pushed, as the producer could.
    #[cfg(test)]
    pub(crate) fn push_as_producer(&self, record: &[u8]) -> Pushed {
        let mut tail = self.header().tail.load(Ordering::Acquire);
        self.push(&mut tail, record)
    }

    /// Stores a tail as a dishonest producer could.
    #[cfg(test)]
    pub(crate) fn set_tail(&self, tail: u64) {
        self.header().tail.store(tail, Ordering::Release);
    }

    /// Copies `bytes` into the data area at `at` (they fit before its end).
    fn put(&self, at: u64, bytes: &[u8]) {
        debug_assert!(at + bytes.len() as u64 <= self.cap);
        // SAFETY: `at + len <= cap` (the callers' checks), so the range lies in the data area;
        // the consumer reads it only after the tail that covers it is published.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.data.as_ptr().add(at as usize),
                bytes.len(),
            )
        };
    }

    /// Copies `out.len()` bytes of the data area from `at` into `out` (they lie before its
    /// end).
    fn get(&self, at: u64, out: &mut [u8]) {
        debug_assert!(at + out.len() as u64 <= self.cap);
        // SAFETY: `at + len <= cap` (the callers' checks), so the range lies in the data area.
        // An honest producer does not write it until the consumer's head passed it; a
        // dishonest one can only change the bytes copied, which are parsed and checked after.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.data.as_ptr().add(at as usize),
                out.as_mut_ptr(),
                out.len(),
            )
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::UnsafeCell;
    use tessera_sync::{model, thread, CheckedArc};

    /// A ring on the heap, as both sides see it.
    struct Heap {
        header: Header,
        data: Box<[UnsafeCell<u64>]>,
    }

    // SAFETY: the data area is written and read only through `Ring`, whose protocol orders
    // the accesses of its two sides (what the tests check).
    unsafe impl Sync for Heap {}

    impl Heap {
        fn new(cap: u64) -> CheckedArc<Self> {
            CheckedArc::new(Self {
                header: Header::new(),
                data: (0..cap / 8).map(|_| UnsafeCell::new(0)).collect(),
            })
        }

        fn ring(&self) -> Ring {
            let data = NonNull::new(self.data.as_ptr() as *mut u8).unwrap();
            // SAFETY: the view is used only while `self` lives (the tests keep the Arc), and
            // the data area is `UnsafeCell`s, written through shared references.
            unsafe { Ring::from_parts(&self.header, data, self.data.len() as u64 * 8) }
        }
    }

    fn record(i: u8, len: usize) -> Vec<u8> {
        (0..len).map(|j| i.wrapping_add(j as u8)).collect()
    }

    fn take_all(ring: &Ring, head: &mut u64) -> Result<Vec<Vec<u8>>, Malformed> {
        let mut got = Vec::new();
        ring.take(head, &mut Vec::new(), |r| got.push(r.to_vec()))?;
        Ok(got)
    }

    #[test]
    fn records_come_out_in_order_across_the_wrap() {
        let heap = Heap::new(256);
        let ring = heap.ring();
        let (mut tail, mut head) = (0, 0);
        for i in 0..100u8 {
            let r = record(i, 1 + (i as usize * 7) % ring.max_record());
            assert_eq!(ring.push(&mut tail, &r), Pushed::Unwatched);
            assert_eq!(take_all(&ring, &mut head).unwrap(), vec![r]);
        }
        assert_eq!(head, tail);
        assert!(tail > 4 * 256, "wrapped several times");
    }

    #[test]
    fn a_full_ring_takes_nothing_until_the_consumer_frees_room() {
        let heap = Heap::new(256);
        let ring = heap.ring();
        let (mut tail, mut head) = (0, 0);
        let r = record(1, 60);
        let mut pushed = 0;
        while ring.push(&mut tail, &r) != Pushed::NoRoom {
            pushed += 1;
        }
        assert_eq!(pushed, 4);
        let before = tail;
        assert_eq!(ring.push(&mut tail, &r), Pushed::NoRoom);
        assert_eq!(tail, before, "a refused push moves nothing");
        assert_eq!(take_all(&ring, &mut head).unwrap().len(), pushed);
        assert_ne!(ring.push(&mut tail, &r), Pushed::NoRoom);
        // Empty and oversized records never go in.
        assert_eq!(ring.push(&mut tail, &[]), Pushed::NoRoom);
        let big = record(2, ring.max_record() + 1);
        assert_eq!(ring.push(&mut tail, &big), Pushed::NoRoom);
    }

    #[test]
    fn watchers_silence_the_doorbell() {
        let heap = Heap::new(256);
        let ring = heap.ring();
        let mut tail = 0;
        ring.watch();
        ring.watch();
        assert_eq!(ring.push(&mut tail, b"abc"), Pushed::Watched);
        ring.unwatch();
        assert_eq!(ring.push(&mut tail, b"abc"), Pushed::Watched);
        ring.unwatch();
        assert_eq!(ring.push(&mut tail, b"abc"), Pushed::Unwatched);
    }

    /// What a dishonest producer can store is refused, and the consumer's head stays after
    /// the last good record.
    #[test]
    fn malformed_rings_are_refused() {
        type Corrupt = fn(&Header, &Ring);
        let cases: [(&str, Corrupt); 7] = [
            ("tail past the capacity", |h, _| {
                h.tail.store(1 << 20, Ordering::Release)
            }),
            ("tail behind the head", |h, _| {
                h.tail.store(u64::MAX, Ordering::Release)
            }),
            ("record past the tail", |h, r| {
                r.put(0, &100u32.to_le_bytes());
                h.tail.store(16, Ordering::Release)
            }),
            ("empty record", |h, r| {
                r.put(0, &0u32.to_le_bytes());
                h.tail.store(8, Ordering::Release)
            }),
            ("tail inside a length", |h, r| {
                r.put(0, &1u32.to_le_bytes());
                h.tail.store(2, Ordering::Release)
            }),
            ("tail inside a wrap gap, stale records beyond it", |h, r| {
                r.put(0, &3u32.to_le_bytes());
                r.put(240, &WRAP.to_le_bytes());
                h.head.store(240, Ordering::Release);
                h.tail.store(248, Ordering::Release);
            }),
            ("record past the data's end", |h, r| {
                r.put(240, &30u32.to_le_bytes());
                h.head.store(240, Ordering::Release);
                h.tail.store(240 + 40, Ordering::Release);
            }),
        ];
        for (what, corrupt) in cases {
            let heap = Heap::new(256);
            let ring = heap.ring();
            corrupt(&heap.header, &ring);
            let mut head = heap.header.head.load(Ordering::Acquire);
            let before = head;
            let mut got = Vec::new();
            let take = || ring.take(&mut head, &mut Vec::new(), |r| got.push(r.to_vec()));
            // A take that believed what it read could run on for 2^61 records.
            #[cfg(feature = "testing")]
            let taken = crate::testing::finish_or_exit(what, take, || {});
            #[cfg(not(feature = "testing"))]
            let taken = take();
            assert_eq!(taken, Err(Malformed), "{what}");
            assert_eq!((head, got), (before, Vec::<Vec<u8>>::new()), "{what}");
        }
        // A good record, then garbage: the head stays after the good one.
        let heap = Heap::new(256);
        let ring = heap.ring();
        let mut tail = 0;
        ring.push(&mut tail, b"good");
        ring.put(8, &0u32.to_le_bytes());
        heap.header.tail.store(16, Ordering::Release);
        let (mut head, mut got) = (0, Vec::new());
        let taken = ring.take(&mut head, &mut Vec::new(), |r| got.push(r.to_vec()));
        assert_eq!(
            (taken, got, head),
            (Err(Malformed), vec![b"good".to_vec()], 8)
        );
        // A head the consumer cannot have written: the producer sends nothing this way.
        let heap = Heap::new(256);
        let ring = heap.ring();
        heap.header.head.store(1 << 20, Ordering::Release);
        assert_eq!(ring.push(&mut 0, b"abc"), Pushed::NoRoom);
    }

    /// The doorbell is never lost: a record pushed while the consumer watches and then stops
    /// is taken by the consumer's last take, or its producer was told to ring.
    #[test]
    fn loom_no_lost_doorbell() {
        model(|| {
            let heap = Heap::new(64);
            let producer = {
                let heap = heap.clone();
                thread::spawn(move || heap.ring().push(&mut 0, b"record") == Pushed::Unwatched)
            };
            let ring = heap.ring();
            let mut head = 0;
            ring.watch();
            let mut got = take_all(&ring, &mut head).unwrap();
            ring.unwatch();
            got.extend(take_all(&ring, &mut head).unwrap());
            let rang = producer.join().unwrap();
            assert!(rang || got == [b"record".to_vec()], "record lost");
            // Rung or not, the record is taken once.
            got.extend(take_all(&ring, &mut head).unwrap());
            assert_eq!(got, [b"record".to_vec()]);
        });
    }

    /// Records pushed while the consumer takes concurrently, across the wrap of a small ring,
    /// come out once each, in order, whole.
    #[test]
    fn loom_concurrent_push_and_take() {
        model(|| {
            // Records of 16 bytes with their length: the third wraps.
            let heap = Heap::new(40);
            let producer = {
                let heap = heap.clone();
                thread::spawn(move || {
                    let ring = heap.ring();
                    let mut tail = 0;
                    let mut sent = Vec::new();
                    for i in 0..3u8 {
                        let r = record(i, 9);
                        while ring.push(&mut tail, &r) == Pushed::NoRoom {
                            thread::yield_now();
                        }
                        sent.push(r);
                    }
                    sent
                })
            };
            let ring = heap.ring();
            let mut head = 0;
            let mut got = Vec::new();
            while got.len() < 3 {
                got.extend(take_all(&ring, &mut head).unwrap());
                thread::yield_now();
            }
            assert_eq!(got, producer.join().unwrap());
        });
    }
}
