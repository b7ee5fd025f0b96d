//! Control connections: accepting them, a session's request loop (read a request, step the
//! core, send the answers), and connecting to the client's agent after its Hello. A panic
//! in one session closes that session only.

use std::future::Future;
use std::os::fd::AsRawFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, watch};
use tracing::Instrument;

#[cfg(test)]
use super::fault;
use super::timer::close_in_core;
use super::transfers::{dispatch, executor};
use super::{lock, Listener, SessionHandle, Shared};
use crate::busy_poll::BusyPoll;
use crate::core::SessionId;
use crate::error::ErrorKind;
use crate::proto::{self, Request, Response};
use crate::sync::{AtomicU64, Ordering};

pub(super) async fn accept_loop(
    shared: Arc<Shared>,
    listener: Listener,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let conn = tokio::select! {
            _ = stop.changed() => break,
            c = async {
                match &listener {
                    Listener::Tcp(l) => l.accept().await.map(|(s, a)| {
                        let _ = s.set_nodelay(true);
                        let fd = s.as_raw_fd();
                        let (r, w) = s.into_split();
                        let r = BusyPoll::watched(shared.cfg.busy_poll.as_ref(), fd, r, true);
                        (Box::new(r) as Box<dyn AsyncRead + Send + Unpin>,
                         Box::new(w) as Box<dyn AsyncWrite + Send + Unpin>, a.to_string())
                    }),
                    Listener::Unix(l, _) => l.accept().await.map(|(s, _)| {
                        let fd = s.as_raw_fd();
                        let (r, w) = s.into_split();
                        let r = BusyPoll::watched(shared.cfg.busy_poll.as_ref(), fd, r, true);
                        (Box::new(r) as Box<dyn AsyncRead + Send + Unpin>,
                         Box::new(w) as Box<dyn AsyncWrite + Send + Unpin>, "unix".to_string())
                    }),
                }
            } => c,
        };
        match conn {
            Ok((r, w, from)) => {
                let sid = shared.next_session.fetch_add(1, Ordering::Relaxed);
                let s = shared.clone();
                let span = tracing::info_span!("session", id = sid, %from);
                lock(&shared.tasks).spawn(guarded_session(s, sid, r, w).instrument(span));
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    if let Listener::Unix(_, path) = &listener {
        let _ = std::fs::remove_file(path);
    }
}

/// A panic's message, for the log and the error answered.
pub(super) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".to_owned())
}

/// A panic caught at a future's boundary, with its message.
#[derive(Debug)]
pub(super) struct Panicked(pub(super) String);

impl std::fmt::Display for Panicked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A future whose panics, in any poll, become `Err(Panicked(message))` (what a tokio `JoinHandle`
/// reports for a task, without a task of its own, so the caller keeps what the future
/// borrowed from it). The future is not polled again after a panic.
pub(super) struct CatchUnwind<F>(pub(super) Pin<Box<F>>);

impl<F: Future> Future for CatchUnwind<F> {
    type Output = Result<F::Output, Panicked>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match catch_unwind(AssertUnwindSafe(|| self.0.as_mut().poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(v)) => Poll::Ready(Ok(v)),
            Err(p) => Poll::Ready(Err(Panicked(panic_message(&*p)))),
        }
    }
}

/// Runs a session; if it panics anywhere outside a request's handling (which answers the
/// request itself), its connection is closed and what it held in the core released, as an
/// ordinary teardown would. Other sessions never notice.
pub(super) async fn guarded_session(
    shared: Arc<Shared>,
    sid: SessionId,
    r: Box<dyn AsyncRead + Send + Unpin>,
    w: Box<dyn AsyncWrite + Send + Unpin>,
) {
    let run = CatchUnwind(Box::pin(session(shared.clone(), sid, r, w))).await;
    if let Err(what) = run {
        tracing::error!(panic = %what, "session task panicked; closing it and releasing what it held");
        crate::metrics::error(ErrorKind::Internal);
        // Close it in the core first (what it exposed stays quarantined until its client's
        // link is torn down); then dropping the handle ends the reply writer, which closes
        // the connection, and the executor sees its queue close.
        let handle = lock(&shared.sessions).remove(&sid);
        close_in_core(&shared, sid, handle.as_ref());
        drop(handle);
    }
}

async fn session(
    shared: Arc<Shared>,
    sid: SessionId,
    mut r: Box<dyn AsyncRead + Send + Unpin>,
    mut w: Box<dyn AsyncWrite + Send + Unpin>,
) {
    let (reply_tx, mut reply_rx) = mpsc::channel::<Vec<u8>>(shared.cfg.reply_queue);
    let (close_tx, mut close_rx) = watch::channel(false);
    let depth = Arc::new(AtomicU64::new(0));
    // The loop's own handle on the reply queue, to wait for room; dropped before the writer
    // is awaited.
    let gate = reply_tx.clone();
    lock(&shared.sessions).insert(
        sid,
        SessionHandle {
            replies: reply_tx,
            jobs: None,
            close: close_tx,
            seen: 0,
            queue_depth: depth.clone(),
            peer: String::new(),
        },
    );
    lock(&shared.unit).open_session(sid);
    let writer = tokio::spawn(async move {
        while let Some(buf) = reply_rx.recv().await {
            if w.write_all(&buf).await.is_err() {
                break;
            }
        }
        let _ = w.shutdown().await;
    });
    let max = shared.cfg.max_message_bytes;
    loop {
        // Backpressure: read the next request only once its answers fit in the reply queue
        // beside those the executor still owes (each queued GET and the one in flight), and
        // one more GET fits in the transfer queue. This loop is the transfer queue's only
        // producer, so the room it waited for is still there when the request is handled.
        let owed = depth.load(Ordering::Relaxed) as usize + 1;
        let room = (owed + 2).min(shared.cfg.reply_queue);
        let jobs = lock(&shared.sessions)
            .get(&sid)
            .and_then(|h| h.jobs.clone());
        let waited = tokio::select! {
            _ = close_rx.changed() => false,
            ok = async {
                if let Some(jobs) = &jobs {
                    if jobs.reserve().await.is_err() {
                        return false;
                    }
                }
                gate.reserve_many(room).await.is_ok()
            } => ok,
        };
        drop(jobs);
        if !waited {
            break;
        }
        let mut prefix = [0u8; proto::LEN_PREFIX];
        let read = tokio::select! {
            _ = close_rx.changed() => break,
            r = r.read_exact(&mut prefix) => r,
        };
        if read.is_err() {
            break;
        }
        let len = match proto::frame_len(prefix, max) {
            Ok(len) => len,
            Err(e) => {
                // The stream cannot be resynchronised without reading the announced bytes.
                crate::metrics::error(ErrorKind::TooLarge);
                send(
                    &shared,
                    sid,
                    0,
                    &Response::error(ErrorKind::TooLarge, e.to_string()),
                );
                break;
            }
        };
        let mut buf = vec![0u8; len];
        if r.read_exact(&mut buf).await.is_err() {
            break;
        }
        match proto::decode_body::<Request>(&buf) {
            Ok((id, req)) => {
                let op = op_name(&req);
                let span = tracing::debug_span!("request", id, op);
                let _g = span.enter();
                let started = Instant::now();
                let handled = {
                    let mut unit = lock(&shared.unit);
                    // Caught inside the lock's scope: the lock is not poisoned, and the
                    // session is closed below, which releases what it held in the core.
                    catch_unwind(AssertUnwindSafe(|| {
                        #[cfg(test)]
                        fault::before_handle(sid, id, &req);
                        let out = unit.handle(started, sid, id, req);
                        unit.trim_memory();
                        out
                    }))
                };
                let out = match handled {
                    Ok(out) => out,
                    Err(p) => {
                        let what = panic_message(&*p);
                        tracing::error!(id, op, panic = %what, "request handling panicked; closing the session");
                        crate::metrics::error(ErrorKind::Internal);
                        send(
                            &shared,
                            sid,
                            id,
                            &Response::error(
                                ErrorKind::Internal,
                                format!(
                                    "the unit failed handling this {op} request ({what}); \
                                     the session is closed, reconnect"
                                ),
                            ),
                        );
                        break;
                    }
                };
                #[cfg(test)]
                fault::after_handle(op);
                crate::metrics::request(op, started.elapsed(), &out);
                dispatch(&shared, out);
            }
            Err((id, e)) => {
                tracing::debug!(id, error = %e, "bad message");
                crate::metrics::error(ErrorKind::Protocol);
                send(
                    &shared,
                    sid,
                    id,
                    &Response::error(ErrorKind::Protocol, e.to_string()),
                );
            }
        }
    }
    // Teardown of the session: no more replies, cancel queued WRITEs, release what the
    // session held in the core (what it exposed stays quarantined until its client's link
    // is torn down), then let the writer flush and close the connection (so a client that
    // sees the connection close finds the session closed).
    let handle = lock(&shared.sessions).remove(&sid);
    close_in_core(&shared, sid, handle.as_ref());
    drop((handle, gate));
    let _ = writer.await;
    tracing::debug!("session closed");
}

fn op_name(req: &Request) -> &'static str {
    match req {
        Request::Hello { .. } => "hello",
        Request::Put {
            inline: Some(_), ..
        } => "put_inline",
        Request::Put { pull: Some(_), .. } => "put_pull",
        Request::Put { .. } => "put_prepare",
        Request::Commit { .. } => "put_commit",
        Request::Cancel { .. } => "cancel",
        Request::Get { .. } => "get",
        Request::GetInto { .. } => "get_into",
        Request::Clear { .. } => "clear",
        Request::DropPartition { .. } => "drop_partition",
        Request::Stats => "stats",
    }
}

pub(super) fn send(shared: &Shared, sid: SessionId, id: u64, resp: &Response) {
    if let Some(h) = lock(&shared.sessions).get(&sid) {
        match proto::encode_frame(id, resp) {
            Ok(buf) => {
                if let Err(mpsc::error::TrySendError::Full(_)) = h.replies.try_send(buf) {
                    // Only answers the session did not wait room for (a prepared PUT that
                    // expired) can find the queue full: the client is not reading. An answer
                    // cannot be dropped silently, so the session ends.
                    tracing::error!(
                        session = sid,
                        id,
                        "reply queue full (the client does not read its answers); closing the session"
                    );
                    crate::metrics::error(ErrorKind::Busy);
                    let _ = h.close.send(true);
                }
            }
            Err(e) => tracing::error!(error = %e, "cannot encode a response"),
        }
    }
}

/// Connects to the client's agent (a blocking connect for some engines), then starts the
/// session's executor: WRITEs to one peer run one at a time, peers run concurrently.
pub(super) async fn accept_peer(shared: Arc<Shared>, sid: SessionId, id: u64, md: Vec<u8>) {
    let agent = shared.agent.clone();
    let peer = tokio::task::spawn_blocking(move || agent.add_remote(&md)).await;
    let peer = match peer {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => {
            send(
                &shared,
                sid,
                id,
                &Response::error(ErrorKind::Transfer, e.to_string()),
            );
            return;
        }
        Err(e) => {
            send(
                &shared,
                sid,
                id,
                &Response::error(ErrorKind::Transfer, e.to_string()),
            );
            return;
        }
    };
    let (tx, rx) = mpsc::channel(shared.cfg.transfer_queue);
    let depth = {
        let mut sessions = lock(&shared.sessions);
        let Some(h) = sessions.get_mut(&sid) else {
            return;
        };
        h.jobs = Some(tx);
        h.peer = peer.name().to_owned();
        h.queue_depth.clone()
    };
    lock(&shared.unit).session_ready(sid);
    let seen = shared.generation.load(Ordering::Acquire);
    if let Some(h) = lock(&shared.sessions).get_mut(&sid) {
        h.seen = seen;
    }
    let welcome = Response::Welcome {
        agent: shared.agent.metadata(),
        backend: shared.agent.kind().to_owned(),
        inline_max: shared.cfg.unit.inline_max,
        align: shared.cfg.unit.align,
    };
    send(&shared, sid, id, &welcome);
    let s = shared.clone();
    lock(&shared.tasks).spawn(executor(s, sid, peer, rx, depth).in_current_span());
}
