//! Memory regions: owned page-aligned mappings (optionally memfd-backed and sealed, so another
//! process can map them) and caller memory registered in place.
//!
//! This module and the backends' mapping code are the only places that create raw views into
//! memory; everything above them deals in (registration, offset, length).

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

use crate::copy::Copier;
use crate::error::RegionError;
use tessera_sync::unchecked::OnceLock;
use tessera_sync::{Arc, StaticMutex, Weak};

/// Seals every memfd region carries once sized: nobody, us included, can grow or shrink it, so a
/// peer that maps it never faults on a truncated page.
pub(crate) const REQUIRED_SEALS: libc::c_int =
    libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// Memory that can be registered with an [`Agent`](crate::Agent).
///
/// Cloning a `Region` is cheap and shares the same memory; the memory is unmapped (or, for
/// foreign memory, its owner is dropped) when the last clone, registration and in-flight
/// transfer that uses it are gone.
///
/// The bytes of a region may be written at any time by a transfer, by a peer process (for a
/// shared region) or by another clone, so this type never hands out `&[u8]` safely: use
/// [`Region::write_at`] / [`Region::read_at`], or the `unsafe` slice accessors when you know no
/// transfer touches the bytes.
#[derive(Clone)]
pub struct Region {
    inner: Arc<Mapping>,
}

struct Mapping {
    id: u64,
    ptr: NonNull<u8>,
    len: u64,
    kind: Kind,
    /// Set by the first registration: the registration cache has nothing for a region that
    /// was never registered, so its first registration skips the lookup. A hint, not part of
    /// any protocol (std's atomic under loom too).
    registered: tessera_sync::unchecked::AtomicBool,
}

enum Kind {
    /// Our own `mmap`; `fd` is set for a memfd-backed shared mapping.
    Mapped { fd: Option<OwnedFd>, map_len: usize },
    /// Caller memory; dropping the owner releases it.
    Foreign {
        _owner: Option<Box<dyn Any + Send + Sync>>,
    },
}

// SAFETY: `Mapping` only holds a pointer to memory that is valid for its whole life (it owns the
// mapping, or the foreign contract promises validity wherever it is accessed). Concurrent access to the bytes goes
// through raw-pointer copies whose callers uphold the data-race rules documented on `Region`.
unsafe impl Send for Mapping {}
// SAFETY: as for `Send`: no method gives out references into the memory without `unsafe`.
unsafe impl Sync for Mapping {}

const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Region>();
};

pub(crate) fn page_size() -> u64 {
    // SAFETY: sysconf has no memory-safety obligations.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u64
    } else {
        4096
    }
}

fn round_to_pages(len: u64) -> Result<usize, RegionError> {
    let page = page_size();
    let rounded = len
        .checked_add(page - 1)
        .map(|v| v & !(page - 1))
        .ok_or(RegionError::TooLarge { len })?;
    usize::try_from(rounded).map_err(|_| RegionError::TooLarge { len })
}

fn os_error(op: &'static str) -> RegionError {
    RegionError::Os {
        op,
        source: std::io::Error::last_os_error(),
    }
}

impl Region {
    /// `len` bytes of zeroed, page-aligned memory backed by a sealed memfd, so that the `shm`
    /// backend can hand it to a peer process. This is the region to use unless you know better.
    ///
    /// Pages are allocated lazily: a large region costs nothing until it is touched.
    pub fn new(len: u64) -> Result<Self, RegionError> {
        Self::memfd("tessera-region", len)
    }

    /// Like [`Region::new`], with `name` shown in `/proc/PID/maps` and `/proc/PID/fd`.
    pub fn memfd(name: &str, len: u64) -> Result<Self, RegionError> {
        if len == 0 {
            return Err(RegionError::Empty);
        }
        let map_len = round_to_pages(len)?;
        let cname = std::ffi::CString::new(name.replace('\0', "_"))
            .unwrap_or_else(|_| c"tessera-region".to_owned());
        // SAFETY: `cname` is a valid NUL-terminated string that outlives the call.
        let raw = unsafe {
            libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(os_error("memfd_create"));
        }
        // SAFETY: `raw` is a freshly created descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let size = libc::off_t::try_from(map_len).map_err(|_| RegionError::TooLarge { len })?;
        // SAFETY: `fd` is a valid memfd; ftruncate only sets its size.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
            return Err(os_error("ftruncate"));
        }
        // SAFETY: `fd` is a valid memfd created with MFD_ALLOW_SEALING.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, REQUIRED_SEALS) } != 0 {
            return Err(os_error("F_ADD_SEALS"));
        }
        let ptr = map_shared(fd.as_fd(), map_len)?;
        Ok(Self::from_mapping(
            ptr,
            len,
            Kind::Mapped {
                fd: Some(fd),
                map_len,
            },
        ))
    }

    /// `len` bytes of zeroed, page-aligned private memory (`MAP_ANONYMOUS | MAP_PRIVATE`). It
    /// cannot be shared with another process, so the `shm` backend refuses to register it.
    pub fn anonymous(len: u64) -> Result<Self, RegionError> {
        if len == 0 {
            return Err(RegionError::Empty);
        }
        let map_len = round_to_pages(len)?;
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing aliases
        // nothing; the result is checked against MAP_FAILED.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(os_error("mmap"));
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| os_error("mmap"))?;
        Ok(Self::from_mapping(
            ptr,
            len,
            Kind::Mapped { fd: None, map_len },
        ))
    }

    /// Maps a memfd that another process shared with us (the `shm` backend's peer side).
    ///
    /// The memfd must carry the grow, shrink and seal seals and be at least `len` bytes long,
    /// so that it can never be truncated under the mapping. The whole file is mapped, and the
    /// region is as long as the file.
    ///
    /// A file this process has mapped already (the same memfd, reached through any descriptor
    /// and any connection) is not mapped again: the region shares the live mapping. Pages are
    /// mapped into a process once per mapping, each on its first touch, so every session of a
    /// process to one peer would otherwise fault the same pages of the peer's pool in again
    /// (32 sessions writing into a unit's pool paid 32 times for each page).
    pub(crate) fn map_sealed(fd: OwnedFd, len: u64) -> Result<Self, RegionError> {
        if len == 0 {
            return Err(RegionError::Empty);
        }
        // SAFETY: `fd` is a valid descriptor; F_GET_SEALS only reads its seals.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & REQUIRED_SEALS != REQUIRED_SEALS {
            return Err(RegionError::NotSealed);
        }
        // SAFETY: an all-zero `stat` is a valid value for fstat to overwrite.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `fd` is valid and `st` is a writable stat buffer.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(os_error("fstat"));
        }
        let size = st.st_size as u64;
        if size < len {
            return Err(RegionError::TooSmall { len, actual: size });
        }
        let map_len = usize::try_from(size).map_err(|_| RegionError::TooLarge { len: size })?;
        // The file's identity, not anything the peer says: a live mapping holds the file, so
        // its inode cannot be reused while the entry can be upgraded.
        let file = (st.st_dev as u64, st.st_ino as u64);
        let mut mapped = peer_mappings().lock();
        if let Some(inner) = mapped.get(&file).and_then(Weak::upgrade) {
            return Ok(Self { inner });
        }
        let ptr = map_shared(fd.as_fd(), map_len)?;
        let region = Self::from_mapping(
            ptr,
            size,
            Kind::Mapped {
                fd: Some(fd),
                map_len,
            },
        );
        mapped.retain(|_, m| m.strong_count() > 0);
        mapped.insert(file, Arc::downgrade(&region.inner));
        Ok(region)
    }

    /// Registers caller memory in place: `len` bytes at `ptr`. `owner`, if any, is dropped when
    /// the region (and every registration and transfer using it) is gone.
    ///
    /// Such a region has no file descriptor, so only in-process backends (and engines that
    /// register arbitrary virtual memory) can use it.
    ///
    /// The region itself never touches the memory: bytes are accessed only where something
    /// asks for them. A transfer touches exactly its segments; [`Region::read_at`],
    /// [`Region::write_at`], [`Region::fill`] and the slice accessors the bytes they name; an
    /// engine that maps or pins memory to register it (`ucx`, `nixl`) the whole registered
    /// range; a peer the ranges of its requests, within the registrations it can name.
    ///
    /// # Safety
    /// - every byte of `ptr..ptr + len` that is ever accessed through the region must be valid
    ///   for that access (for reads where it is read, for writes where it is written), from
    ///   now until `owner` is dropped (or forever, if `owner` is `None`), and the memory must
    ///   not be unmapped or reused meanwhile. Bytes that nothing accesses need not be valid;
    ///   the caller then keeps the region from whatever could access them (its accessors, an
    ///   engine registration that maps the whole range, a registration peers can name);
    /// - while a transfer reads or writes this memory, nothing else may access the bytes it
    ///   touches through references (only raw-pointer accesses that tolerate concurrent
    ///   modification, as for any memory shared with a device or another process).
    pub unsafe fn from_raw_parts(
        ptr: NonNull<u8>,
        len: u64,
        owner: Option<Box<dyn Any + Send + Sync>>,
    ) -> Result<Self, RegionError> {
        if len == 0 {
            return Err(RegionError::Empty);
        }
        if usize::try_from(len).is_err()
            || (ptr.as_ptr() as usize).checked_add(len as usize).is_none()
        {
            return Err(RegionError::TooLarge { len });
        }
        Ok(Self::from_mapping(
            ptr,
            len,
            Kind::Foreign { _owner: owner },
        ))
    }

    /// Registers a caller's boxed buffer in place; the region owns it from now on.
    pub fn from_vec(buf: Vec<u8>) -> Result<Self, RegionError> {
        let mut buf = buf.into_boxed_slice();
        let len = buf.len() as u64;
        let ptr = NonNull::new(buf.as_mut_ptr()).ok_or(RegionError::Empty)?;
        // SAFETY: the boxed slice's heap buffer is valid for `len` bytes and never moves; the
        // region owns the box, so it lives as long as the region; no reference to it escapes.
        unsafe { Self::from_raw_parts(ptr, len, Some(Box::new(buf))) }
    }

    fn from_mapping(ptr: NonNull<u8>, len: u64, kind: Kind) -> Self {
        Self {
            inner: Arc::new(Mapping {
                id: next_id(),
                ptr,
                len,
                kind,
                registered: tessera_sync::unchecked::AtomicBool::new(false),
            }),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.inner.len
    }

    /// Always false: a region is never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Whether this memory (any clone) was registered before; marks it registered.
    pub(crate) fn mark_registered(&self) -> bool {
        use tessera_sync::unchecked::Ordering::Relaxed;
        // A load and a store, not a swap: a locked instruction per registration shows in
        // bulk registration, and two first registrations racing only both skip the lookup.
        let before = self.inner.registered.load(Relaxed);
        if !before {
            self.inner.registered.store(true, Relaxed);
        }
        before
    }

    /// A process-unique id of the underlying memory, shared by clones.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// First byte of the region.
    pub fn as_ptr(&self) -> *mut u8 {
        self.inner.ptr.as_ptr()
    }

    /// The memfd behind the region, if it has one.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        match &self.inner.kind {
            Kind::Mapped { fd: Some(fd), .. } => Some(fd.as_fd()),
            _ => None,
        }
    }

    /// Whether another process can map this region (it is memfd-backed).
    pub fn is_shareable(&self) -> bool {
        self.fd().is_some()
    }

    fn check(&self, offset: u64, len: usize) -> Result<(), RegionError> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.inner.len => Ok(()),
            _ => Err(RegionError::OutOfRange {
                offset,
                len: len as u64,
                region_len: self.inner.len,
            }),
        }
    }

    /// Copies `data` into the region at `offset` (as the memory engines copy: see the crate
    /// README).
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), RegionError> {
        self.check(offset, data.len())?;
        // SAFETY: the range was checked to lie inside the region; our own mappings are valid
        // for writes throughout, and foreign memory wherever it is written (the contract of
        // `from_raw_parts`). `data` is a separate Rust slice.
        unsafe {
            Copier::default().copy(
                data.as_ptr(),
                self.as_ptr().add(offset as usize),
                data.len(),
            )
        };
        Ok(())
    }

    /// Copies bytes at `offset` out of the region into `out` (as the memory engines copy).
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<(), RegionError> {
        self.check(offset, out.len())?;
        // SAFETY: the range was checked to lie inside the region; our own mappings are valid
        // for reads throughout, and foreign memory wherever it is read (the contract of
        // `from_raw_parts`). `out` is an exclusive Rust slice.
        unsafe {
            Copier::default().copy(
                self.as_ptr().add(offset as usize),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        Ok(())
    }

    /// Fills `len` bytes at `offset` with `byte`.
    pub fn fill(&self, offset: u64, len: u64, byte: u8) -> Result<(), RegionError> {
        let ulen = usize::try_from(len).map_err(|_| RegionError::TooLarge { len })?;
        self.check(offset, ulen)?;
        // SAFETY: the range was checked to lie inside the region, valid for writes wherever it
        // is written (our own mappings throughout; foreign memory by `from_raw_parts`).
        unsafe { std::ptr::write_bytes(self.as_ptr().add(offset as usize), byte, ulen) };
        Ok(())
    }

    /// Faults every page in for writing, so the first transfer into the region does not pay
    /// for page faults (`MADV_POPULATE_WRITE`, or a write per page where the kernel lacks it).
    /// Contents are unchanged. Only for memory this region mapped itself. A kernel that cannot
    /// give the memory fails it with an error (`ENOMEM`) rather than the process.
    pub fn populate(&self) -> Result<(), RegionError> {
        let Kind::Mapped { map_len, .. } = self.inner.kind else {
            return Ok(());
        };
        // SAFETY: the range is exactly this region's own mapping; MADV_POPULATE_WRITE only
        // faults pages in and never changes their contents.
        let rc = unsafe { libc::madvise(self.as_ptr().cast(), map_len, libc::MADV_POPULATE_WRITE) };
        if rc == 0 {
            return Ok(());
        }
        // Only a kernel without MADV_POPULATE_WRITE (before 5.14: EINVAL) gets the writes.
        if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL) {
            return Err(os_error("madvise(MADV_POPULATE_WRITE)"));
        }
        let page = page_size() as usize;
        let base = self.as_ptr();
        for at in (0..self.inner.len as usize).step_by(page) {
            // SAFETY: `at` lies inside the mapping; an atomic read-modify-write of zero
            // changes nothing even if a transfer or peer writes the byte concurrently.
            unsafe {
                let byte = &*(base.add(at) as *const tessera_sync::unchecked::AtomicU8);
                byte.fetch_add(0, tessera_sync::unchecked::Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// The whole region as a slice.
    ///
    /// # Safety
    /// No transfer, peer process or other thread may write the region while the slice lives.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is valid for `len` bytes for as long as `self` lives (foreign
        // memory wherever it is read, by `from_raw_parts`); the caller promises nobody writes
        // it meanwhile.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.inner.len as usize) }
    }

    /// The whole region as a mutable slice.
    ///
    /// # Safety
    /// No transfer, peer process or other thread may read or write the region while the slice
    /// lives, and no other slice of it may exist.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> &mut [u8] {
        // SAFETY: the mapping is valid for `len` bytes for as long as `self` lives (foreign
        // memory wherever it is accessed, by `from_raw_parts`); the caller promises exclusive
        // access meanwhile.
        unsafe { std::slice::from_raw_parts_mut(self.as_ptr(), self.inner.len as usize) }
    }
}

/// The peers' memfds this process has mapped, by device and inode (see [`Region::map_sealed`]).
type PeerMappings = StaticMutex<HashMap<(u64, u64), Weak<Mapping>>>;

fn peer_mappings() -> &'static PeerMappings {
    static MAPPED: OnceLock<PeerMappings> = OnceLock::new();
    MAPPED.get_or_init(Default::default)
}

fn map_shared(fd: BorrowedFd<'_>, map_len: usize) -> Result<NonNull<u8>, RegionError> {
    // SAFETY: mapping a valid memfd shared at a kernel-chosen address aliases no Rust object;
    // the file is sealed against shrinking, so every mapped page stays backed.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(os_error("mmap"));
    }
    NonNull::new(ptr.cast::<u8>()).ok_or_else(|| os_error("mmap"))
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if let Kind::Mapped { map_len, .. } = self.kind {
            // SAFETY: `ptr..ptr + map_len` is the mapping this value created and owns; every
            // user of it (clones, registrations, transfers) holds this `Mapping` alive, so the
            // last one is gone.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), map_len) };
        }
    }
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("id", &self.inner.id)
            .field("len", &self.inner.len)
            .field("shareable", &self.is_shareable())
            .finish()
    }
}

/// A process-unique id (regions, agents, engines' sockets). Ids only need to be unique within
/// the process; they are not part of any model-checked protocol.
pub(crate) fn next_id() -> u64 {
    static NEXT: tessera_sync::Counter = tessera_sync::Counter::new(1);
    NEXT.next()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memfd_region_is_sealed_and_zeroed() {
        let r = Region::new(10_000).unwrap();
        assert!(r.is_shareable());
        let mut buf = [1u8; 16];
        r.read_at(9_984, &mut buf).unwrap();
        assert_eq!(buf, [0; 16]);
        r.write_at(5, b"hello").unwrap();
        let mut out = [0u8; 5];
        r.clone().read_at(5, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        // SAFETY: the fd is valid; F_GET_SEALS only reads.
        let seals = unsafe { libc::fcntl(r.fd().unwrap().as_raw_fd(), libc::F_GET_SEALS) };
        assert_eq!(seals & REQUIRED_SEALS, REQUIRED_SEALS);
        // SAFETY: ftruncate on a valid fd; it must be refused because of the seals.
        let grow = unsafe { libc::ftruncate(r.fd().unwrap().as_raw_fd(), 1 << 30) };
        assert_ne!(grow, 0);
    }

    #[test]
    fn large_writes_and_reads_at_any_offset_move_every_byte() {
        let r = Region::new(16 << 20).unwrap();
        let data: Vec<u8> = (0..(9 << 20) + 77)
            .map(|i: usize| (i % 251) as u8)
            .collect();
        r.write_at(3, &data).unwrap();
        let mut out = vec![0u8; data.len() + 8];
        r.read_at(0, &mut out[5..]).unwrap();
        assert!(out[8..] == data[..], "every byte, in place");
        assert_eq!(out[5..8], [0, 0, 0], "nothing before");
        let mut after = [1u8; 4];
        r.read_at(3 + data.len() as u64, &mut after).unwrap();
        assert_eq!(after, [0; 4], "nothing after");
    }

    #[test]
    fn bad_ranges_are_errors() {
        let r = Region::anonymous(100).unwrap();
        assert!(!r.is_shareable());
        assert!(r.write_at(99, b"ab").is_err());
        assert!(r.read_at(u64::MAX, &mut [0u8; 1]).is_err());
        assert!(r.fill(50, 51, 0).is_err());
        assert!(matches!(Region::new(0), Err(RegionError::Empty)));
        assert!(matches!(
            Region::new(u64::MAX),
            Err(RegionError::TooLarge { .. })
        ));
    }

    #[test]
    fn remap_refuses_unsealed_memfd() {
        let raw =
            // SAFETY: a valid NUL-terminated name; the result is checked.
            unsafe { libc::memfd_create(c"unsealed".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: `raw` is a fresh descriptor owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate on a valid fd.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), 4096) }, 0);
        assert!(matches!(
            Region::map_sealed(fd, 4096),
            Err(RegionError::NotSealed)
        ));
    }

    /// How many mappings of `r`'s file this process holds, by `/proc/self/maps`.
    fn mappings_of(r: &Region) -> usize {
        // SAFETY: an all-zero `stat` is a valid value for fstat to overwrite.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        let fd = r.fd().unwrap().as_raw_fd();
        // SAFETY: the descriptor is valid and `st` a writable stat buffer.
        let rc = unsafe { libc::fstat(fd, &mut st) };
        assert_eq!(rc, 0);
        let ino = st.st_ino.to_string();
        std::fs::read_to_string("/proc/self/maps")
            .unwrap()
            .lines()
            .filter(|line| line.split_whitespace().nth(4) == Some(ino.as_str()))
            .count()
    }

    /// A peer's file is mapped once however many descriptors of it arrive, and unmapped with
    /// the last region that uses it; another file, or the same one after that, is mapped anew.
    #[test]
    fn a_peers_file_is_mapped_once_while_any_region_of_it_lives() {
        let owner = Region::new(3 * 4096).unwrap();
        let other = Region::new(4096).unwrap();
        let map = |r: &Region, len| {
            Region::map_sealed(r.fd().unwrap().try_clone_to_owned().unwrap(), len).unwrap()
        };
        let first = map(&owner, 4096);
        let second = map(&owner, 3 * 4096);
        assert_eq!(first.as_ptr(), second.as_ptr(), "one mapping for both");
        assert_eq!(first.id(), second.id());
        assert_eq!(
            first.len(),
            3 * 4096,
            "the whole file, whatever length was asked"
        );
        assert_ne!(
            first.as_ptr(),
            owner.as_ptr(),
            "the owner's own mapping is its own"
        );
        second.write_at(4096, b"seen").unwrap();
        let mut out = [0u8; 4];
        owner.read_at(4096, &mut out).unwrap();
        assert_eq!(&out, b"seen");
        let elsewhere = map(&other, 4096);
        assert_ne!(
            elsewhere.as_ptr(),
            first.as_ptr(),
            "another file, another mapping"
        );
        assert!(matches!(
            Region::map_sealed(other.fd().unwrap().try_clone_to_owned().unwrap(), 8192),
            Err(RegionError::TooSmall { .. })
        ));

        assert_eq!(mappings_of(&owner), 2, "the owner's and one more");
        drop(first);
        assert_eq!(mappings_of(&owner), 2, "still used by the second region");
        drop(second);
        assert_eq!(mappings_of(&owner), 1, "unmapped with the last region");
        let again = map(&owner, 4096);
        let mut out = [0u8; 4];
        again.read_at(4096, &mut out).unwrap();
        assert_eq!(&out, b"seen", "mapped anew, the same file");
    }

    #[test]
    fn populate_keeps_contents() {
        for r in [
            Region::new(3 * 4096 + 5).unwrap(),
            Region::anonymous(9000).unwrap(),
        ] {
            r.write_at(4096, b"kept").unwrap();
            r.populate().unwrap();
            let mut out = [0u8; 4];
            r.read_at(4096, &mut out).unwrap();
            assert_eq!(&out, b"kept");
        }
    }

    #[test]
    fn sparse_region_above_4gib() {
        let r = Region::new(5 << 30).unwrap();
        r.write_at((4 << 30) + 17, b"far").unwrap();
        let mut out = [0u8; 3];
        r.read_at((4 << 30) + 17, &mut out).unwrap();
        assert_eq!(&out, b"far");
    }
}
