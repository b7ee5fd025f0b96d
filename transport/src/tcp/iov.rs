//! Vectored I/O straight from and into registered ranges, and the reader's wake-up threshold.

use std::io;
use std::os::fd::AsRawFd;

use tokio::io::Interest;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

use super::*;

/// Position in a list of (address, length) spans.
#[derive(Default)]
pub(super) struct Cursor {
    pub(super) span: usize,
    pub(super) offset: u64,
}

impl Cursor {
    pub(super) fn advance(&mut self, spans: &[(usize, u64)], mut n: usize) {
        while n > 0 && self.span < spans.len() {
            let rest = spans[self.span].1 - self.offset;
            if (n as u64) < rest {
                self.offset += n as u64;
                return;
            }
            n -= rest as usize;
            self.span += 1;
            self.offset = 0;
        }
    }

    /// Whether every span is done; steps over empty ones first, so no call is made for them.
    pub(super) fn done(&mut self, spans: &[(usize, u64)]) -> bool {
        while self.span < spans.len() && spans[self.span].1 == self.offset {
            self.span += 1;
            self.offset = 0;
        }
        self.span >= spans.len()
    }
}

/// Largest slice handed to one system call entry (the kernel caps a call near 2 GiB anyway).
pub(super) const MAX_IOV: u64 = 1 << 30;

/// Most bytes one `sendmsg` is handed. The call copies into the socket's buffer with the
/// socket locked, and the ACKs that arrive meanwhile wait until it returns: a payload handed
/// whole stalls the sender between bursts. Loopback across two cores of the bench machine
/// (receiver woken per 256 KiB): 2.1-2.6 GB/s with the whole 256 MiB per call, 3.8-4.3 with
/// 256 KiB-1 MiB per call, 2.7 with 4 MiB.
pub(super) const SEND_MAX: u64 = 1 << 20;

/// Fills `iov` with the spans from `cur` on, `budget` bytes at most; returns how many entries
/// it used.
pub(super) fn fill_iov(
    spans: &[(usize, u64)],
    cur: &Cursor,
    iov: &mut [libc::iovec; IOV_BATCH],
    mut budget: u64,
) -> usize {
    let mut k = 0;
    let (mut j, mut off) = (cur.span, cur.offset);
    while k < IOV_BATCH && j < spans.len() && budget > 0 {
        let (addr, len) = spans[j];
        let chunk = (len - off).min(MAX_IOV).min(budget);
        iov[k] = libc::iovec {
            iov_base: (addr + off as usize) as *mut libc::c_void,
            iov_len: chunk as usize,
        };
        k += 1;
        budget -= chunk;
        if off + chunk < len {
            break;
        }
        j += 1;
        off = 0;
    }
    k
}

pub(super) fn empty_iov() -> [libc::iovec; IOV_BATCH] {
    [libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    }; IOV_BATCH]
}

/// Writes every span, in order, with vectored `sendmsg` calls (`MSG_NOSIGNAL`: a dead peer is
/// an error, not a signal). The bytes go to the kernel straight from the spans; no Rust
/// reference to them is ever made, since other threads or processes may touch the memory.
///
/// # Safety
/// Each span must be readable for its length until this returns (it lies in a pinned
/// registration).
pub(super) async unsafe fn write_spans(
    w: &OwnedWriteHalf,
    spans: &[(usize, u64)],
) -> io::Result<()> {
    let stream: &TcpStream = w.as_ref();
    let fd = stream.as_raw_fd();
    let mut cur = Cursor::default();
    while !cur.done(spans) {
        w.writable().await?;
        let result = stream.try_io(Interest::WRITABLE, || {
            let mut iov = empty_iov();
            let k = fill_iov(spans, &cur, &mut iov, SEND_MAX);
            // SAFETY: an all-zero msghdr is valid; it then points at `iov`, whose first `k`
            // entries describe readable memory (the caller's promise), all alive across the
            // call.
            let n = unsafe {
                let mut msg: libc::msghdr = std::mem::zeroed();
                msg.msg_iov = iov.as_mut_ptr();
                msg.msg_iovlen = k as _;
                libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL)
            };
            if n < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(n as usize)
            }
        });
        match result {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => cur.advance(spans, n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes `bytes` (a header) through the same `MSG_NOSIGNAL` path as payloads.
pub(super) async fn send_bytes(w: &OwnedWriteHalf, bytes: &[u8]) -> io::Result<()> {
    // SAFETY: `bytes` is a live, readable slice borrowed for the whole call.
    unsafe { write_spans(w, &[(bytes.as_ptr() as usize, bytes.len() as u64)]) }.await
}

/// Reads into every span, in order, with `readv`, straight from the kernel into the spans; no
/// Rust reference to them is made (spans may even overlap).
///
/// # Safety
/// Each span must be writable for its length until this returns (it lies in a pinned
/// registration).
pub(super) async unsafe fn read_spans(r: &OwnedReadHalf, spans: &[(usize, u64)]) -> io::Result<()> {
    let stream: &TcpStream = r.as_ref();
    let fd = stream.as_raw_fd();
    let mut cur = Cursor::default();
    let mut left: u64 = spans.iter().map(|s| s.1).sum();
    // Back to 1 however this returns (or is dropped), for the next header.
    let mut lowat = Lowat { fd, bytes: 1 };
    while !cur.done(spans) {
        // Wake this reader only once a good part of what it still expects is queued: one
        // wake-up per `LOWAT_MAX` bytes instead of one per segment burst. Never above what
        // is still to come, so it cannot wait for bytes the peer will not send (a closed or
        // failed connection wakes it regardless).
        lowat.set(left.min(LOWAT_MAX) as libc::c_int);
        r.readable().await?;
        let result = stream.try_io(Interest::READABLE, || {
            let mut iov = empty_iov();
            let k = fill_iov(spans, &cur, &mut iov, u64::MAX);
            // SAFETY: the first `k` entries of `iov` describe writable memory (the caller's
            // promise), alive across the call.
            let n = unsafe { libc::readv(fd, iov.as_ptr(), k as libc::c_int) };
            if n < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(n as usize)
            }
        });
        match result {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                cur.advance(spans, n);
                left -= n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The most a payload reader asks the kernel to queue before waking it.
pub(super) const LOWAT_MAX: u64 = 256 << 10;

/// The socket's `SO_RCVLOWAT` (readiness once this many bytes are queued) while a payload is
/// read; 1 again when dropped.
pub(super) struct Lowat {
    fd: std::os::fd::RawFd,
    bytes: libc::c_int,
}

impl Lowat {
    fn set(&mut self, bytes: libc::c_int) {
        if bytes != self.bytes {
            // SAFETY: `fd` is an open socket owned by the reader; the value is a c_int that
            // lives across the call, with its size passed alongside.
            unsafe {
                libc::setsockopt(
                    self.fd,
                    libc::SOL_SOCKET,
                    libc::SO_RCVLOWAT,
                    (&bytes as *const libc::c_int).cast(),
                    size_of::<libc::c_int>() as libc::socklen_t,
                );
            }
            self.bytes = bytes;
        }
    }
}

impl Drop for Lowat {
    fn drop(&mut self) {
        self.set(1);
    }
}

// ----- the writer ------------------------------------------------------------------------
