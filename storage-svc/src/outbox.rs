//! A control connection's way out, for the client's requests and the unit's answers alike: a
//! message is written to the socket straight from the thread that makes it when nothing is
//! queued ahead of it, with no hop to the connection's writer task and back (a wake-up of
//! another thread each way, tens of microseconds where that thread's core has halted). What
//! the socket does not take at once (it is non-blocking), and every message behind it, goes
//! to the writer task, in order.

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, RawFd};

/// A second handle on a connection's socket: the same open file, so non-blocking as the
/// runtime set it. Writes go out through it straight from the thread that makes them (here),
/// and the client's callers that wait on the socket read through one (its inbox).
pub(crate) enum Direct {
    Tcp(std::net::TcpStream),
    Unix(std::os::unix::net::UnixStream),
}

impl Direct {
    /// A handle on `s`'s socket.
    pub(crate) fn tcp(s: &tokio::net::TcpStream) -> io::Result<Direct> {
        Ok(Direct::Tcp(s.as_fd().try_clone_to_owned()?.into()))
    }

    /// A handle on `s`'s socket.
    pub(crate) fn unix(s: &tokio::net::UnixStream) -> io::Result<Direct> {
        Ok(Direct::Unix(s.as_fd().try_clone_to_owned()?.into()))
    }

    fn write(&self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Direct::Tcp(s) => (&*s).write(buf),
            Direct::Unix(s) => (&*s).write(buf),
        }
    }

    /// A read that does not wait (`WouldBlock` when nothing came).
    pub(crate) fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Direct::Tcp(s) => (&*s).read(buf),
            Direct::Unix(s) => (&*s).read(buf),
        }
    }
}

impl AsRawFd for Direct {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Direct::Tcp(s) => s.as_raw_fd(),
            Direct::Unix(s) => s.as_raw_fd(),
        }
    }
}

/// What decides between the direct write and the writer task. Held under a lock across a
/// direct write and the hand-over to the writer, so messages leave in the order they were
/// sent.
pub(crate) struct OutState {
    /// `None` where the connection is no socket (tests' in-memory pipes): all goes through
    /// the writer.
    direct: Option<Direct>,
    /// Messages handed to the writer task and not yet wholly written.
    queued: usize,
    /// A write failed, perhaps after part of a message: nothing may follow it.
    broken: bool,
}

impl OutState {
    pub(crate) fn new(direct: Option<Direct>) -> Self {
        Self {
            direct,
            queued: 0,
            broken: false,
        }
    }

    /// Writes as much of `buf` as the socket takes at once, when nothing is queued ahead of
    /// it; returns the bytes written (all of them: nothing is left for the writer). `Err`
    /// once a write failed.
    pub(crate) fn write_now(&mut self, buf: &[u8]) -> Result<usize, ()> {
        if self.broken {
            return Err(());
        }
        let Some(direct) = self.direct.as_ref().filter(|_| self.queued == 0) else {
            return Ok(0);
        };
        let mut from = 0;
        while from < buf.len() {
            match direct.write(&buf[from..]) {
                Ok(n) if n > 0 => from += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                _ => {
                    self.broken = true;
                    return Err(());
                }
            }
        }
        Ok(from)
    }

    /// A message (the rest of it) goes to the writer.
    pub(crate) fn queue(&mut self) {
        self.queued += 1;
    }

    /// The writer wrote one.
    pub(crate) fn dequeue(&mut self) {
        self.queued -= 1;
    }

    /// A message queued after its first `from` bytes went out could not be handed to the
    /// writer: if any did go out, the message is cut and nothing may follow it.
    pub(crate) fn not_handed_over(&mut self, from: usize) {
        self.queued -= 1;
        if from > 0 {
            self.broken = true;
        }
    }

    /// The writer's write failed.
    pub(crate) fn fail(&mut self) {
        self.broken = true;
    }

    /// Whether a write failed: the connection carries nothing more.
    pub(crate) fn broken(&self) -> bool {
        self.broken
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// A message the socket takes only in part leaves the rest for the writer, and nothing
    /// goes out directly behind it until the writer is done; once the peer is gone the
    /// connection is broken for good.
    #[test]
    fn what_the_socket_does_not_take_holds_back_what_follows() {
        let (a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        let mut out = OutState::new(Some(Direct::Unix(a)));
        assert_eq!(out.write_now(b"whole").unwrap(), 5);
        let big = vec![7u8; 16 << 20];
        let took = out.write_now(&big).unwrap();
        assert!(took > 0 && took < big.len(), "{took}");
        out.queue();
        let mut head = vec![0u8; 5 + took];
        b.read_exact(&mut head).unwrap();
        assert_eq!(&head[..5], b"whole");
        // The socket has room again; the writer still owes the rest of `big`.
        assert_eq!(out.write_now(b"next").unwrap(), 0, "jumped the queue");
        out.dequeue();
        assert_eq!(out.write_now(b"next").unwrap(), 4);
        drop(b);
        assert!(out.write_now(b"after").is_err());
        assert!(
            out.write_now(b"").is_err(),
            "a broken connection takes nothing more"
        );
    }

    /// A message whose rest the writer could not take: nothing follows it once part of it went
    /// out; when none did, the connection goes on.
    #[test]
    fn a_message_cut_short_is_the_last() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        let mut out = OutState::new(Some(Direct::Unix(a)));
        out.queue();
        out.not_handed_over(0);
        assert_eq!(out.write_now(b"next").unwrap(), 4);
        out.queue();
        out.not_handed_over(4);
        assert!(
            out.write_now(b"after").is_err(),
            "written behind a cut message"
        );
    }

    /// Without a socket of its own everything goes to the writer.
    #[test]
    fn without_a_direct_handle_nothing_is_written_here() {
        let mut out = OutState::new(None);
        assert_eq!(out.write_now(b"message").unwrap(), 0);
    }
}
