//! Raw peers: clients that speak an engine's wire protocol by hand, for tests that send what
//! the honest initiator never would (oversized headers, spans outside a registration, frames
//! out of order) and read what the target answers.
//!
//! [`RawTcp`] and [`RawShm`] connect to an agent's address (taken from its metadata), run the
//! engine's real handshake as a name of the caller's choosing, with or without a [`Token`],
//! through the same proofs, labels and message types the engine uses, and then offer, through
//! [`RawPeer`]: arbitrary bytes ([`io::Write`]), a frame of a given type and body, a READ or
//! WRITE request naming arbitrary [`Span`]s, and the target's answer. Neither engine's
//! initiator checks are involved: whatever a raw peer asks for is judged by the target alone.
//!
//! They panic on nothing: every failure, a refused handshake included, is an [`io::Error`].

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::time::Duration;

use crate::auth::{self, Token, MAC_LEN, NONCE_LEN};
use crate::engine::wire::u64_at;
use crate::error::RejectReason;
use crate::transfer::Op;
use crate::{handshake, metadata, shm, tcp};

/// How long a raw peer waits for any read before giving up (a hang guard, not a speed goal).
pub const READ_TIMEOUT: Duration = Duration::from_secs(60);

/// Bytes a target reads of a connection's handshake at most, headers included, before it
/// refuses it.
pub const PRE_AUTH_MAX: usize = handshake::PRE_AUTH_MAX;

/// A range a request names on the target: registration id, offset inside it, length. Any
/// values at all: a raw peer checks nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// The registration id.
    pub reg: u64,
    /// First byte, relative to the registration.
    pub offset: u64,
    /// Length.
    pub len: u64,
}

impl Span {
    /// `len` bytes at `offset` of registration `reg`.
    pub fn new(reg: u64, offset: u64, len: u64) -> Self {
        Self { reg, offset, len }
    }
}

/// The target's answer to a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// Granted. On `tcp` a READ's payload follows (here), and a WRITE's payload has landed;
    /// on `shm` the target now pins the spans until the peer sends `DONE` or the link closes.
    Granted(Vec<u8>),
    /// Refused by the target's own check.
    Rejected(RejectReason),
}

/// What both raw peers offer once connected.
pub trait RawPeer: Read + Write {
    /// Connects to the target whose metadata is `meta`, without a handshake.
    fn connect(meta: &[u8]) -> io::Result<Self>
    where
        Self: Sized;

    /// Runs the handshake as [`authenticate`](Self::authenticate) does, but sends in `AUTH`
    /// whatever `forge` makes of the honest proof (a flipped bit, a proof cut short).
    fn authenticate_sending(
        &mut self,
        name: &str,
        token: Option<&Token>,
        forge: &dyn Fn(&[u8]) -> Vec<u8>,
    ) -> io::Result<()>;

    /// Connects and authenticates as `name` (with `token`, or without one as a process of
    /// the target's user), advertising no address of its own.
    fn authenticated(meta: &[u8], name: &str, token: Option<&Token>) -> io::Result<Self>
    where
        Self: Sized,
    {
        let mut s = Self::connect(meta)?;
        s.authenticate(name, token)?;
        Ok(s)
    }

    /// Runs the engine's handshake as `name`: `HELLO`, the target's `CHALLENGE` (its proof
    /// checked), `AUTH`, then `HELLO_ACK`; a `REFUSED` or a proof that does not verify is an
    /// error.
    fn authenticate(&mut self, name: &str, token: Option<&Token>) -> io::Result<()> {
        self.authenticate_sending(name, token, &<[u8]>::to_vec)
    }

    /// Sends one frame of the engine's framing: `ty` and `body` (`shm`: the 8-byte header
    /// with the body's length; `tcp`: the 24-byte header with `ty` in its first byte and
    /// zeros elsewhere, then the body).
    fn send_frame(&mut self, ty: u8, body: &[u8]) -> io::Result<()>;

    /// Sends a READ or WRITE request naming `spans`, whatever they are. On `tcp` a WRITE's
    /// `payload` follows the request (the target expects the spans' total length of it); on
    /// `shm`, where the initiator copies through its own mapping, `payload` is not sent.
    fn request(&mut self, op: Op, spans: &[Span], payload: &[u8]) -> io::Result<()>;

    /// The target's answer to the oldest request not answered yet.
    fn answer(&mut self) -> io::Result<Answer>;

    /// Every byte the target sends until it closes the connection (or resets it); an error
    /// if it stays open past [`READ_TIMEOUT`].
    fn drain_until_closed(&mut self) -> io::Result<Vec<u8>> {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match self.read(&mut buf) {
                Ok(0) => return Ok(got),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return Ok(got),
                Err(e) => return Err(e),
            }
        }
    }
}

/// The target's name and engine address in its metadata.
fn target_of(meta: &[u8]) -> io::Result<(String, Vec<u8>)> {
    let info = metadata::decode(meta).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    Ok((info.name, info.address))
}

fn refused(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, why)
}

fn unexpected(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_owned())
}

// ----- tcp ---------------------------------------------------------------------------------

/// A raw client of a `tcp` agent.
#[derive(Debug)]
pub struct RawTcp {
    stream: TcpStream,
    target: String,
    /// Requests sent and not answered: (op, total length).
    asked: VecDeque<(Op, u64)>,
}

impl RawTcp {
    /// The header length of every `tcp` message.
    pub const HEADER: usize = tcp::HEADER;
    /// A request's message kind.
    pub const XFER: u8 = tcp::KIND_XFER;
    /// The kind of a dialer's first message.
    pub const HELLO: u8 = tcp::KIND_HELLO;
    /// A notification's message kind.
    pub const NOTIFY: u8 = tcp::KIND_NOTIFY;
    /// Descriptors in one request, at most.
    pub const MAX_DESCS: usize = tcp::MAX_DESCS;

    /// Sends a 24-byte header as given, then `body`.
    pub fn send_header(&mut self, head: [u8; tcp::HEADER], body: &[u8]) -> io::Result<()> {
        self.stream.write_all(&head)?;
        self.stream.write_all(body)
    }

    /// The socket.
    pub fn stream(&self) -> &TcpStream {
        &self.stream
    }
}

impl Read for RawTcp {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream.read(buf)
    }
}

impl Write for RawTcp {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}

impl RawPeer for RawTcp {
    fn connect(meta: &[u8]) -> io::Result<Self> {
        let (target, address) = target_of(meta)?;
        let addr = std::str::from_utf8(&address).map_err(|_| unexpected("address not UTF-8"))?;
        let stream = TcpStream::connect(addr)?;
        stream.set_read_timeout(Some(READ_TIMEOUT))?;
        stream.set_nodelay(true)?;
        Ok(Self {
            stream,
            target,
            asked: VecDeque::new(),
        })
    }

    fn authenticate_sending(
        &mut self,
        name: &str,
        token: Option<&Token>,
        forge: &dyn Fn(&[u8]) -> Vec<u8>,
    ) -> io::Result<()> {
        let nonce = auth::nonce();
        let mut hello = vec![0u8; tcp::HEADER];
        hello[0] = tcp::KIND_HELLO;
        hello[8..12].copy_from_slice(&(name.len() as u32).to_le_bytes());
        hello.extend_from_slice(&nonce);
        hello.extend_from_slice(name.as_bytes());
        self.stream.write_all(&hello)?;
        let mut head = [0u8; tcp::HEADER];
        self.stream.read_exact(&mut head)?;
        if head[0] == tcp::KIND_REFUSED {
            return Err(refused(handshake::refused(&self.target, name, head[1])));
        }
        if head[0] != tcp::KIND_CHALLENGE {
            return Err(unexpected("expected CHALLENGE"));
        }
        let mut challenge = [0u8; NONCE_LEN + MAC_LEN];
        self.stream.read_exact(&mut challenge)?;
        let mut theirs = [0u8; NONCE_LEN];
        theirs.copy_from_slice(&challenge[..NONCE_LEN]);
        if !handshake::check_target(
            token,
            tcp::KIND,
            &nonce,
            &theirs,
            &self.target,
            &challenge[NONCE_LEN..],
        ) {
            return Err(refused(handshake::bad_target_proof(&self.target, token)));
        }
        let proof = forge(&handshake::dialer_proof(
            token,
            tcp::KIND,
            &nonce,
            &theirs,
            name,
            b"",
        ));
        self.send_frame(tcp::KIND_AUTH, &proof)?;
        self.stream.read_exact(&mut head)?;
        match head[0] {
            tcp::KIND_HELLO_ACK => Ok(()),
            tcp::KIND_REFUSED => Err(refused(handshake::refused(&self.target, name, head[1]))),
            _ => Err(unexpected("expected HELLO_ACK")),
        }
    }

    fn send_frame(&mut self, ty: u8, body: &[u8]) -> io::Result<()> {
        let mut head = [0u8; tcp::HEADER];
        head[0] = ty;
        self.send_header(head, body)
    }

    fn request(&mut self, op: Op, spans: &[Span], payload: &[u8]) -> io::Result<()> {
        let mut head = [0u8; tcp::HEADER];
        head[0] = tcp::KIND_XFER;
        head[1] = op.code();
        head[4..8].copy_from_slice(&(spans.len() as u32).to_le_bytes());
        let mut body = Vec::with_capacity(spans.len() * 24 + payload.len());
        for s in spans {
            body.extend_from_slice(&s.reg.to_le_bytes());
            body.extend_from_slice(&s.offset.to_le_bytes());
            body.extend_from_slice(&s.len.to_le_bytes());
        }
        if op == Op::Write {
            body.extend_from_slice(payload);
        }
        let total = spans.iter().fold(0u64, |t, s| t.wrapping_add(s.len));
        self.asked.push_back((op, total));
        self.send_header(head, &body)
    }

    fn answer(&mut self) -> io::Result<Answer> {
        let (op, total) = self
            .asked
            .pop_front()
            .ok_or_else(|| unexpected("no request to answer"))?;
        let mut head = [0u8; tcp::HEADER];
        self.stream.read_exact(&mut head)?;
        if head[0] != tcp::KIND_RESP {
            return Err(unexpected("expected a response"));
        }
        if head[1] != 0 {
            return Ok(Answer::Rejected(RejectReason::from_code(head[2])));
        }
        let mut payload = Vec::new();
        if op == Op::Read {
            // Read as it arrives: a total the target never sends allocates nothing.
            (&mut self.stream).take(total).read_to_end(&mut payload)?;
            if (payload.len() as u64) < total {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        }
        Ok(Answer::Granted(payload))
    }
}

// ----- shm ---------------------------------------------------------------------------------

/// A raw client of an `shm` agent. It never maps the target's memory: it asks, and reads the
/// answers.
#[derive(Debug)]
pub struct RawShm {
    stream: UnixStream,
    target: String,
    next_id: u64,
    /// Ids of requests sent and not answered.
    asked: VecDeque<u64>,
}

impl RawShm {
    /// The header length of every `shm` message.
    pub const HEADER: usize = shm::HEADER;
    /// A dialer's first message.
    pub const HELLO: u8 = shm::HELLO;
    /// A request for a registration's memfd.
    pub const MAP_REQ: u8 = shm::MAP_REQ;
    /// A transfer request.
    pub const XFER: u8 = shm::XFER;
    /// The initiator's report that a granted transfer is over.
    pub const DONE: u8 = shm::DONE;
    /// A notification for the target's agent: the body is the message.
    pub const NOTIFY: u8 = shm::NOTIFY;
    /// The largest body of a message after the handshake.
    pub const MAX_BODY: usize = shm::MAX_BODY;
    /// The target's answer to a `HELLO`: its nonce and proof.
    pub const CHALLENGE: u8 = shm::CHALLENGE;
    /// The dialer's proof.
    pub const AUTH: u8 = shm::AUTH;
    /// The target's refusal of a handshake (reason in the body).
    pub const REFUSED: u8 = shm::REFUSED;
    /// The target's first message after the handshake: the memfd of the link's ring of WRITE
    /// records (its length in the body).
    pub const RING: u8 = shm::RING;
    /// The initiator's doorbell: records wait in the ring.
    pub const RECORDS: u8 = shm::RECORDS;

    /// The next frame the target sends: its type and body (a body over the engine's limit
    /// is an error, before anything is allocated for it). File descriptors passed with it
    /// (`MAP_OK`) are not received, so the kernel closes them.
    pub fn read_frame(&mut self) -> io::Result<(u8, Vec<u8>)> {
        let mut head = [0u8; shm::HEADER];
        self.stream.read_exact(&mut head)?;
        let len = u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as usize;
        if len > shm::MAX_BODY {
            return Err(unexpected("body over the engine's limit"));
        }
        let mut body = vec![0u8; len];
        self.stream.read_exact(&mut body)?;
        Ok((head[0], body))
    }

    /// The socket.
    pub fn stream(&self) -> &UnixStream {
        &self.stream
    }
}

impl Read for RawShm {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream.read(buf)
    }
}

impl Write for RawShm {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}

impl RawPeer for RawShm {
    fn connect(meta: &[u8]) -> io::Result<Self> {
        let (target, address) = target_of(meta)?;
        let addr = SocketAddr::from_abstract_name(&address)?;
        let stream = UnixStream::connect_addr(&addr)?;
        stream.set_read_timeout(Some(READ_TIMEOUT))?;
        Ok(Self {
            stream,
            target,
            next_id: 1,
            asked: VecDeque::new(),
        })
    }

    fn authenticate_sending(
        &mut self,
        name: &str,
        token: Option<&Token>,
        forge: &dyn Fn(&[u8]) -> Vec<u8>,
    ) -> io::Result<()> {
        let nonce = auth::nonce();
        let mut hello = nonce.to_vec();
        hello.push(name.len() as u8);
        hello.extend_from_slice(name.as_bytes());
        self.send_frame(shm::HELLO, &hello)?;
        let (ty, body) = self.read_frame()?;
        if ty == shm::REFUSED {
            let code = body.first().copied().unwrap_or(0);
            return Err(refused(handshake::refused(&self.target, name, code)));
        }
        if ty != shm::CHALLENGE || body.len() != NONCE_LEN + MAC_LEN {
            return Err(unexpected("expected CHALLENGE"));
        }
        let mut theirs = [0u8; NONCE_LEN];
        theirs.copy_from_slice(&body[..NONCE_LEN]);
        if !handshake::check_target(
            token,
            shm::KIND,
            &nonce,
            &theirs,
            &self.target,
            &body[NONCE_LEN..],
        ) {
            return Err(refused(handshake::bad_target_proof(&self.target, token)));
        }
        let proof = forge(&handshake::dialer_proof(
            token,
            shm::KIND,
            &nonce,
            &theirs,
            name,
            b"",
        ));
        self.send_frame(shm::AUTH, &proof)?;
        match self.read_frame()? {
            (shm::HELLO_ACK, _) => Ok(()),
            (shm::REFUSED, body) => {
                let code = body.first().copied().unwrap_or(0);
                Err(refused(handshake::refused(&self.target, name, code)))
            }
            _ => Err(unexpected("expected HELLO_ACK")),
        }
    }

    fn send_frame(&mut self, ty: u8, body: &[u8]) -> io::Result<()> {
        let mut out = Vec::with_capacity(shm::HEADER + body.len());
        shm::frame(&mut out, ty, |b| b.extend_from_slice(body));
        self.stream.write_all(&out)
    }

    fn request(&mut self, op: Op, spans: &[Span], _payload: &[u8]) -> io::Result<()> {
        let id = self.next_id;
        self.next_id += 1;
        let mut body = Vec::with_capacity(13 + spans.len() * 24);
        body.extend_from_slice(&id.to_le_bytes());
        body.push(op.code());
        body.extend_from_slice(&(spans.len() as u32).to_le_bytes());
        for s in spans {
            body.extend_from_slice(&s.reg.to_le_bytes());
            body.extend_from_slice(&s.offset.to_le_bytes());
            body.extend_from_slice(&s.len.to_le_bytes());
        }
        self.asked.push_back(id);
        self.send_frame(shm::XFER, &body)
    }

    fn answer(&mut self) -> io::Result<Answer> {
        let id = self
            .asked
            .pop_front()
            .ok_or_else(|| unexpected("no request to answer"))?;
        loop {
            let (ty, body) = self.read_frame()?;
            if !(ty == shm::GRANT || ty == shm::REJECT) {
                continue; // MAP_OK, MAP_ERR: answers to what the caller sent by hand
            }
            if u64_at(&body, 0) != Some(id) {
                return Err(unexpected("an answer to another request"));
            }
            return Ok(if ty == shm::GRANT {
                Answer::Granted(Vec::new())
            } else {
                Answer::Rejected(RejectReason::from_code(body.get(8).copied().unwrap_or(0)))
            });
        }
    }
}
