//! A link's tasks: the writer, the reader and the target side that serves requests, and the listener that greets new peers.

use std::io;
use std::os::fd::AsRawFd;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

use crate::auth::{Token, MAC_LEN, NONCE_LEN};
use crate::engine::{Grant, Host, Op};
use crate::error::{RejectReason, TransferError};
use crate::handshake::{self, PRE_AUTH_MAX};
use crate::notify::MAX_NOTIFICATION;
use tessera_sync::Arc;

use super::*;

pub(super) async fn write_loop(
    mut w: OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<Job>,
    link: Arc<Link>,
    host: Host,
    mut stop: watch::Receiver<bool>,
) {
    let mut head = Vec::with_capacity(4096);
    let mut spans: Vec<(usize, u64)> = Vec::new();
    loop {
        let job = tokio::select! {
            j = rx.recv() => match j {
                Some(j) => j,
                None => break,
            },
            _ = stop.changed() => break,
        };
        let sent = match job {
            Job::Close => break,
            Job::HelloAck => {
                head.clear();
                head.resize(HEADER, 0);
                head[0] = KIND_HELLO_ACK;
                send_bytes(&w, &head).await
            }
            Job::Respond {
                status,
                reason,
                grant,
                note,
            } => {
                head.clear();
                head.resize(HEADER, 0);
                head[0] = KIND_RESP;
                head[1] = status;
                head[2] = reason;
                let mut sent = send_bytes(&w, &head).await;
                if let Some(mut grant) = grant {
                    spans.clear();
                    spans.extend((0..grant.len()).map(|i| {
                        let (p, l) = grant.span(i);
                        (p as usize, l)
                    }));
                    if sent.is_ok() {
                        // SAFETY: every span was validated against, and is pinned in, a live
                        // registration of this agent by `grant`, held until the write returns.
                        sent = unsafe { write_spans(&w, &spans) }.await;
                    }
                    grant.clear();
                    link.spare.lock().push(grant);
                }
                if sent.is_ok() {
                    if let Some(note) = note {
                        host.notify(&link.peer, note);
                    }
                }
                sent
            }
            Job::Request(xfer) => {
                if let Some(why) = link.dead() {
                    xfer.done.complete(Err(link.gone(&why)));
                    continue;
                }
                let plan = xfer.plan();
                let segs = plan.segments();
                let notify = xfer.notify.as_deref();
                head.clear();
                head.push(if segs.is_empty() {
                    KIND_NOTIFY
                } else {
                    KIND_XFER
                });
                head.push(plan.op().code());
                head.push(u8::from(notify.is_some()));
                head.push(0);
                head.extend_from_slice(&(segs.len() as u32).to_le_bytes());
                head.extend_from_slice(&(notify.map_or(0, <[u8]>::len) as u32).to_le_bytes());
                head.resize(HEADER, 0);
                for s in segs {
                    head.extend_from_slice(&s.remote_reg.to_le_bytes());
                    head.extend_from_slice(&s.remote_offset.to_le_bytes());
                    head.extend_from_slice(&s.len.to_le_bytes());
                }
                head.extend_from_slice(notify.unwrap_or_default());
                spans.clear();
                let is_write = plan.op() == Op::Write;
                if is_write {
                    spans.extend(segs.iter().map(|s| (s.local_ptr() as usize, s.len)));
                }
                // Hold the plan while its payload is written: if the link fails meanwhile, the
                // reader completes the transfer, and the memory must stay pinned until the
                // write call has returned.
                let keep = is_write.then(|| xfer.done.plan_handle());
                // Queue before writing: the response may come back before the write returns.
                link.pending.lock().push_back(xfer);
                // If the reader already failed, nobody will answer: fail what is queued.
                // (`die` marks the link dead before draining, so either it drained this
                // transfer or this check sees the mark.)
                if let Some(why) = link.dead() {
                    link.die(&why);
                    break;
                }
                let mut sent = send_bytes(&w, &head).await;
                if sent.is_ok() && is_write {
                    // SAFETY: the spans lie in local registrations pinned by the plan that
                    // `keep` holds until the write has returned, or in memory that plan's
                    // keep-alive owns (`Peer::write_unregistered`'s contract).
                    sent = unsafe { write_spans(&w, &spans) }.await;
                }
                drop(keep);
                sent
            }
        };
        if let Err(e) = sent {
            link.die(&format!("writing: {e}"));
            break;
        }
    }
    rx.close();
    let why = link.dead().unwrap_or_else(|| "link closed".into());
    link.die(&why);
    while let Ok(job) = rx.try_recv() {
        if let Job::Request(x) = job {
            x.done.complete(Err(link.gone(&why)));
        }
    }
    let _ = w.shutdown().await;
}

// ----- the reader ------------------------------------------------------------------------

/// Reads whatever the peer sends: its requests (this agent as target) and the responses to
/// this agent's requests. Never writes.
pub(super) async fn read_loop(
    mut r: OwnedReadHalf,
    link: Arc<Link>,
    host: Host,
    mut stop: watch::Receiver<bool>,
    open: crate::engine::LinkGuard,
) {
    let why = match serve(&mut r, &link, &host, &mut stop).await {
        Ok(()) => "the agent shut down".to_owned(),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => "connection closed".to_owned(),
        Err(e) => format!("reading: {e}"),
    };
    link.die(&why);
    // Nothing more is read from this connection, and `serve` released its grants.
    drop(r);
    drop(open);
}

pub(super) fn malformed(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_owned())
}

pub(super) async fn serve(
    r: &mut OwnedReadHalf,
    link: &Link,
    host: &Host,
    stop: &mut watch::Receiver<bool>,
) -> io::Result<()> {
    let mut head = [0u8; HEADER];
    let mut descs: Vec<u8> = Vec::new();
    let mut note: Vec<u8> = Vec::new();
    let mut spans: Vec<(usize, u64)> = Vec::new();
    let mut scratch: Vec<u8> = Vec::new();
    loop {
        tokio::select! {
            g = r.read_exact(&mut head) => { g?; }
            _ = stop.changed() => return Ok(()),
        }
        let kind = head[0];
        if kind == KIND_RESP {
            receive_response(r, link, host, head[1], head[2], &mut spans).await?;
            continue;
        }
        let (has_note, n, note_len) = (
            head[2] != 0,
            u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as usize,
            u32::from_le_bytes([head[8], head[9], head[10], head[11]]) as usize,
        );
        if !(kind == KIND_XFER || kind == KIND_NOTIFY)
            || n > MAX_DESCS
            || note_len > MAX_NOTIFICATION
        {
            return Err(malformed("bad request header"));
        }
        let op = Op::from_code(head[1]).ok_or_else(|| malformed("bad op"))?;
        read_growing(r, &mut descs, n * 24).await?;
        read_growing(r, &mut note, note_len).await?;
        let desc = |i: usize| {
            let at = i * 24;
            let u = |o: usize| {
                let mut a = [0u8; 8];
                a.copy_from_slice(&descs[at + o..at + o + 8]);
                u64::from_le_bytes(a)
            };
            (u(0), u(8), u(16))
        };
        let mut total = 0u64;
        for i in 0..n {
            total = total
                .checked_add(desc(i).2)
                .ok_or_else(|| malformed("payload length overflows"))?;
        }
        let mut grant = link.spare.lock().pop().unwrap_or_default();
        match host.grant_for(&mut grant, &link.peer, op, (0..n).map(desc)) {
            Ok(()) => {
                let note = has_note.then(|| note.clone());
                if op == Op::Write {
                    spans.clear();
                    spans.extend((0..grant.len()).map(|i| {
                        let (p, l) = grant.span(i);
                        (p as usize, l)
                    }));
                    // SAFETY: every span was validated against, and is pinned in, a live
                    // registration of this agent by `grant`, which outlives the read. By the
                    // registration contract, registered memory may be written by transfers
                    // at any time and its owner reaches it only through raw-pointer copies.
                    unsafe { read_spans(r, &spans) }.await?;
                    grant.mark_written();
                    host.count_copied(Op::Write, grant.bytes());
                    grant.clear();
                    link.spare.lock().push(grant);
                    if let Some(note) = note {
                        host.notify(&link.peer, note);
                    }
                    respond(link, 0, 0, None, None)?;
                } else {
                    respond(link, 0, 0, Some(grant), note)?;
                }
            }
            Err(reason) => {
                link.spare.lock().push(grant);
                if op == Op::Write {
                    let mut left = total;
                    scratch.resize(64 * 1024, 0);
                    while left > 0 {
                        let chunk = left.min(scratch.len() as u64) as usize;
                        r.read_exact(&mut scratch[..chunk]).await?;
                        left -= chunk as u64;
                    }
                }
                respond(link, 1, reason.code(), None, None)?;
            }
        }
    }
}

/// Reads `len` bytes into `buf` (replacing its contents), growing it only as they arrive:
/// at most doubling what is already there (64 KiB at first), so an announced length that
/// never comes costs nothing. A buffer that grew keeps its capacity for the next message.
pub(super) async fn read_growing(
    r: &mut OwnedReadHalf,
    buf: &mut Vec<u8>,
    len: usize,
) -> io::Result<()> {
    const STEP: usize = 64 << 10;
    buf.clear();
    while buf.len() < len {
        let at = buf.len();
        let chunk = (len - at).min(at.max(STEP).max(buf.capacity() - at));
        buf.resize(at + chunk, 0);
        r.read_exact(&mut buf[at..]).await?;
    }
    Ok(())
}

pub(super) fn respond(
    link: &Link,
    status: u8,
    reason: u8,
    grant: Option<Grant>,
    note: Option<Vec<u8>>,
) -> io::Result<()> {
    link.jobs
        .send(Job::Respond {
            status,
            reason,
            grant,
            note,
        })
        .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "the writer stopped"))
}

/// A response to this agent's oldest pending request.
pub(super) async fn receive_response(
    r: &mut OwnedReadHalf,
    link: &Link,
    host: &Host,
    status: u8,
    reason: u8,
    spans: &mut Vec<(usize, u64)>,
) -> io::Result<()> {
    let xfer = link
        .pending
        .lock()
        .pop_front()
        .ok_or_else(|| malformed("a response without a request"))?;
    if status != 0 {
        xfer.done.complete(Err(TransferError::Rejected {
            peer: link.peer.clone(),
            reason: RejectReason::from_code(reason),
        }));
        return Ok(());
    }
    if xfer.plan().op() == Op::Read {
        spans.clear();
        spans.extend(
            xfer.plan()
                .segments()
                .iter()
                .map(|s| (s.local_ptr() as usize, s.len)),
        );
        // SAFETY: the spans lie in local registrations pinned by this transfer's plan, which
        // `xfer` owns until it is completed below.
        if let Err(e) = unsafe { read_spans(r, spans) }.await {
            xfer.done
                .complete(Err(link.gone(&format!("receiving a payload: {e}"))));
            return Err(e);
        }
        host.count_copied(Op::Read, spans.iter().map(|s| s.1).sum());
    }
    xfer.done.complete(Ok(()));
    Ok(())
}

// ----- accepting ---------------------------------------------------------------------------

pub(super) async fn accept_loop(
    listener: TcpListener,
    host: Host,
    token: Option<Token>,
    deadline: Duration,
    links: Arc<Links>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.changed() => return,
        };
        let Ok((stream, _)) = accepted else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        harden(stream.as_raw_fd());
        tokio::spawn(greet(
            stream,
            host.clone(),
            token.clone(),
            deadline,
            links.clone(),
            stop.clone(),
        ));
    }
}

/// What an authenticated dialer said about itself.
struct Hello {
    name: String,
    addr: Vec<u8>,
}

/// The target's side of the handshake: reads at most `PRE_AUTH_MAX` bytes, all of them
/// before the handshake deadline (the caller's timeout). `Ok(None)`: refused, and told so.
async fn admit(
    stream: &mut TcpStream,
    host: &Host,
    token: Option<&Token>,
) -> io::Result<Option<Hello>> {
    let mut head = [0u8; HEADER];
    stream.read_exact(&mut head).await?;
    let len = u32::from_le_bytes([head[8], head[9], head[10], head[11]]) as usize;
    let addr_len = u32::from_le_bytes([head[12], head[13], head[14], head[15]]) as usize;
    if head[0] != KIND_HELLO || len == 0 || len > 255 || addr_len > 255 {
        return Err(malformed("expected HELLO"));
    }
    // Well under PRE_AUTH_MAX with the AUTH that follows.
    const _: () = assert!(2 * HEADER + NONCE_LEN + 255 + 255 + MAC_LEN <= PRE_AUTH_MAX);
    let mut theirs = [0u8; NONCE_LEN];
    stream.read_exact(&mut theirs).await?;
    let mut name = vec![0u8; len];
    stream.read_exact(&mut name).await?;
    let mut addr = vec![0u8; addr_len];
    stream.read_exact(&mut addr).await?;
    let name = String::from_utf8(name).map_err(|_| malformed("name is not UTF-8"))?;
    let refuse = |code: u8| {
        let mut r = [0u8; HEADER];
        r[0] = KIND_REFUSED;
        r[1] = code;
        r
    };
    if token.is_none() {
        let (local, remote) = (stream.local_addr()?, stream.peer_addr()?);
        if handshake::tcp_socket_uid(remote, local) != Some(handshake::euid()) {
            stream.write_all(&refuse(handshake::REFUSED_UID)).await?;
            return Ok(None);
        }
    }
    let ours = crate::auth::nonce();
    let proof = handshake::target_proof(token, KIND, &theirs, &ours, host.name());
    let mut challenge = [0u8; HEADER + NONCE_LEN + MAC_LEN];
    challenge[0] = KIND_CHALLENGE;
    challenge[HEADER..HEADER + NONCE_LEN].copy_from_slice(&ours);
    challenge[HEADER + NONCE_LEN..].copy_from_slice(&proof);
    stream.write_all(&challenge).await?;
    stream.read_exact(&mut head).await?;
    if head[0] != KIND_AUTH {
        return Err(malformed("expected AUTH"));
    }
    let mut proof = [0u8; MAC_LEN];
    stream.read_exact(&mut proof).await?;
    if !handshake::check_dialer(token, KIND, &theirs, &ours, &name, &addr, &proof) {
        stream.write_all(&refuse(handshake::REFUSED_PROOF)).await?;
        return Ok(None);
    }
    Ok(Some(Hello { name, addr }))
}

/// Authenticates the dialer, files the link under its name (unless a live link is filed
/// there: then it is refused, `name in use`), acknowledges, and runs it. A dialer that does
/// not authenticate within the deadline, or sends anything else first, is dropped.
pub(super) async fn greet(
    mut stream: TcpStream,
    host: Host,
    token: Option<Token>,
    deadline: Duration,
    links: Arc<Links>,
    stop: watch::Receiver<bool>,
) {
    let hello = tokio::time::timeout(deadline, admit(&mut stream, &host, token.as_ref())).await;
    let Ok(Ok(Some(Hello { name, addr }))) = hello else {
        return;
    };
    let mut stream = Some(stream);
    let link = links.claim(&name, || {
        spawn_link(
            &tokio::runtime::Handle::current(),
            stream.take().expect("claim builds the link once"),
            name.clone(),
            addr,
            host,
            stop,
        )
    });
    match link {
        Some(link) => {
            let _ = link.jobs.send(Job::HelloAck);
        }
        None => {
            if let Some(mut s) = stream {
                let mut r = [0u8; HEADER];
                r[0] = KIND_REFUSED;
                r[1] = handshake::REFUSED_NAME_IN_USE;
                let _ = tokio::time::timeout(deadline, s.write_all(&r)).await;
            }
        }
    }
}
