//! Control connections: accepting them, a session's request loop (read a request, step the
//! core, send the answers), and connecting to the client's agent after its Hello. A panic
//! in one session closes that session only.

use std::future::Future;
use std::os::fd::AsRawFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tessera_sync::{Arc, Mutex};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, watch};
use tracing::Instrument;

#[cfg(test)]
use super::fault;
use super::partitions::PartitionGuard;
use super::timer::close_in_core;
use super::transfers::{dispatch, executor};
use super::{Listener, SessionHandle, Shared};
use crate::busy_poll::{self, BusyPoll};
use crate::core::{Access, Ahead, SessionId, SlicedPut, Unit};
use crate::error::ErrorKind;
use crate::outbox::{Direct, OutState};
use crate::plane::PoolMemory;
use crate::proto::{self, Request, Response};
use crate::ring::Ring;
use tessera_sync::atomic::{AtomicU64, Ordering};
use tessera_transport::{Agent, ConnectError};

pub(super) async fn accept_loop(
    shared: Arc<Shared>,
    listener: Listener,
    mut stop: watch::Receiver<bool>,
) {
    let mut accept_backoff = Duration::from_millis(10);
    let mut refusals_logged = RateLimit::default();
    let mut accept_logged = RateLimit::default();
    loop {
        let conn = tokio::select! {
            _ = stop.changed() => break,
            c = async {
                match &listener {
                    // Without a second handle (no descriptor left) every answer goes through
                    // the session's writer task.
                    Listener::Tcp(l) => l.accept().await.map(|(s, a)| {
                        let _ = s.set_nodelay(true);
                        let fd = s.as_raw_fd();
                        let direct = Direct::tcp(&s).ok();
                        let (r, w) = s.into_split();
                        let r = BusyPoll::watched(shared.cfg.busy_poll.as_ref(), fd, r, true);
                        (Box::new(r) as Box<dyn AsyncRead + Send + Unpin>,
                         Box::new(w) as Box<dyn AsyncWrite + Send + Unpin>, direct, a.to_string())
                    }),
                    Listener::Unix(l, _) => l.accept().await.map(|(s, _)| {
                        let fd = s.as_raw_fd();
                        let direct = Direct::unix(&s).ok();
                        let (r, w) = s.into_split();
                        let r = BusyPoll::watched(shared.cfg.busy_poll.as_ref(), fd, r, true);
                        (Box::new(r) as Box<dyn AsyncRead + Send + Unpin>,
                         Box::new(w) as Box<dyn AsyncWrite + Send + Unpin>, direct, "unix".to_string())
                    }),
                }
            } => c,
        };
        match conn {
            Ok((r, w, direct, from)) => {
                accept_backoff = Duration::from_millis(10);
                if shared.connections.load(Ordering::Relaxed) >= shared.connection_cap {
                    let n = shared.refused.fetch_add(1, Ordering::Relaxed) + 1;
                    crate::metrics::refused_connection();
                    if refusals_logged.allow() {
                        tracing::warn!(
                            refused = n,
                            cap = shared.connection_cap,
                            "connection limit reached; refusing new connections"
                        );
                    }
                    let s = shared.clone();
                    shared.tasks.lock().spawn(refuse(s, w));
                    drop((r, direct));
                    continue;
                }
                shared.connections.fetch_add(1, Ordering::Relaxed);
                let served = Served(shared.clone());
                let sid = super::next_session();
                let s = shared.clone();
                let span = tracing::info_span!("session", id = sid, %from);
                shared.tasks.lock().spawn(
                    async move {
                        guarded_session(s, sid, r, w, direct).await;
                        drop(served);
                    }
                    .instrument(span),
                );
            }
            Err(e) => {
                let n = shared.accept_errors.fetch_add(1, Ordering::Relaxed) + 1;
                crate::metrics::accept_error();
                if accept_logged.allow() {
                    tracing::warn!(error = %e, failed = n, "accept failed; backing off");
                }
                // Out of descriptors (EMFILE, ENFILE) or another transient failure: back off,
                // longer while it lasts, instead of spinning on a listener that stays ready.
                tokio::select! {
                    _ = stop.changed() => break,
                    _ = tokio::time::sleep(accept_backoff) => {}
                }
                accept_backoff = (accept_backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
    if let Listener::Unix(_, path) = &listener {
        let _ = std::fs::remove_file(path);
    }
}

/// Allows one log line a second.
#[derive(Default)]
struct RateLimit(Option<Instant>);

impl RateLimit {
    fn allow(&mut self) -> bool {
        let now = Instant::now();
        if self
            .0
            .is_some_and(|t| now.duration_since(t) < Duration::from_secs(1))
        {
            return false;
        }
        self.0 = Some(now);
        true
    }
}

/// Answers a connection beyond the cap with a `Busy` error frame (best effort, bounded in
/// time) and closes it.
async fn refuse(shared: Arc<Shared>, mut w: Box<dyn AsyncWrite + Send + Unpin>) {
    let resp = Response::error(
        ErrorKind::Busy,
        format!(
            "the unit serves {} connections at most; retry later",
            shared.connection_cap
        ),
    );
    if let Ok(buf) = proto::encode_frame(0, &resp) {
        let _ = tokio::time::timeout(Duration::from_secs(1), async {
            let _ = w.write_all(&buf).await;
            let _ = w.shutdown().await;
        })
        .await;
    }
}

/// Counts a served connection until dropped.
struct Served(Arc<Shared>);

impl Drop for Served {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::Relaxed);
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
    direct: Option<Direct>,
) {
    let run = CatchUnwind(Box::pin(session(shared.clone(), sid, r, w, direct))).await;
    if let Err(what) = run {
        tracing::error!(panic = %what, "session task panicked; closing it and releasing what it held");
        crate::metrics::error(ErrorKind::Internal);
        // Close it in the core first (what it exposed stays quarantined until its client's
        // link is torn down); then dropping the handle ends the reply writer, which closes
        // the connection, and the executor sees its queue close.
        let handle = shared.sessions.lock().remove(&sid);
        close_in_core(&shared, sid, handle.as_ref());
        drop(handle);
    }
}

async fn session(
    shared: Arc<Shared>,
    sid: SessionId,
    r: Box<dyn AsyncRead + Send + Unpin>,
    mut w: Box<dyn AsyncWrite + Send + Unpin>,
    direct: Option<Direct>,
) {
    let mut r = tokio::io::BufReader::with_capacity(proto::READ_BUFFER, r);
    let (reply_tx, mut reply_rx) = mpsc::channel::<Reply>(shared.cfg.reply_queue);
    let state = Arc::new(Mutex::new(OutState::new(direct)));
    let learns = shared
        .cfg
        .busy_poll
        .as_ref()
        .is_some_and(|p| !p.longest().is_zero());
    // Shared with the writer task: an answer it writes leaves then.
    let next = Arc::new(NextRequest::new(
        shared.cfg.busy_poll.clone().filter(|_| learns),
    ));
    // The loop's own handle on the replies, to wait for room in their queue; dropped before
    // the writer is awaited (the writer ends once every handle is gone).
    let gate = Arc::new(Replies {
        tx: reply_tx,
        state: state.clone(),
        next: next.clone(),
    });
    let (close_tx, mut close_rx) = watch::channel(false);
    let depth = Arc::new(AtomicU64::new(0));
    shared.sessions.lock().insert(
        sid,
        SessionHandle {
            replies: gate.clone(),
            jobs: None,
            close: close_tx,
            seen: 0,
            queue_depth: depth.clone(),
            peer: String::new(),
        },
    );
    shared.unit.lock().open_session(sid);
    let writer = tokio::spawn(async move {
        while let Some(reply) = reply_rx.recv().await {
            let written = w.write_all(&reply.buf[reply.from..]).await;
            let mut state = state.lock();
            match written {
                Ok(()) => state.dequeue(),
                Err(_) => {
                    state.fail();
                    break;
                }
            }
            drop(state);
            next.answer_left();
        }
        let _ = w.shutdown().await;
    });
    let handshake_deadline = Instant::now() + shared.cfg.handshake_timeout;
    let mut authed = false;
    // How long the session's client took to send its next request, lately.
    let mut pauses = Ring::<Duration, PAUSES>::default();
    loop {
        // Backpressure: read the next request only once its answers fit in the reply queue
        // beside those the executor still owes (each queued GET and the one in flight), and
        // one more GET fits in the transfer queue. This loop is the transfer queue's only
        // producer, so the room it waited for is still there when the request is handled.
        let owed = depth.load(Ordering::Relaxed) as usize + 1;
        let room = (owed + 2).min(shared.cfg.reply_queue);
        let jobs = shared
            .sessions
            .lock()
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
                gate.room(room).await.is_ok()
            } => ok,
        };
        drop(jobs);
        if !waited {
            break;
        }
        // Before the session is authenticated its frames are small and the whole handshake
        // has a deadline; after, a request may be up to `max_message_bytes`. Either way, a
        // request whose first byte came must arrive whole within `frame_timeout`.
        if !authed {
            authed = shared.unit.lock().authenticated(sid);
        }
        let (max, first_byte_by) = if authed {
            (shared.cfg.max_message_bytes, None)
        } else {
            (shared.cfg.preauth_message_bytes, Some(handshake_deadline))
        };
        // Waiting for the client (nothing of the next request read yet): from how long the
        // session's latest pauses took, its next request is expected, and a unit whose
        // poller learns (`BusyPoll::expecting`) polls until then rather than park.
        let idle = (learns && r.buffer().is_empty()).then(Instant::now);
        if let Some(since) = idle {
            gate.next.expect_from(since);
        }
        let mut prefix = [0u8; proto::LEN_PREFIX];
        let first = async {
            match first_byte_by {
                Some(t) => tokio::time::timeout_at(t.into(), r.read_exact(&mut prefix[..1]))
                    .await
                    .map_err(|_| ()),
                None => Ok(r.read_exact(&mut prefix[..1]).await),
            }
        };
        let read = tokio::select! {
            _ = close_rx.changed() => break,
            r = first => r,
        };
        if let Some(since) = idle {
            // From the later of the loop's idling and the last answer: a GET's answer leaves
            // the executor once its WRITE is over, after the loop went idle.
            let from = gate.next.answered().map_or(since, |a| a.max(since));
            pauses.record(from.elapsed());
            gate.next.learned(busy_poll::expected_after(&pauses));
        }
        match read {
            Ok(Ok(_)) => {}
            Ok(Err(_)) => break,
            Err(()) => {
                tracing::debug!("handshake not completed in time; closing");
                crate::metrics::error(ErrorKind::Unauthorized);
                send(
                    &shared,
                    sid,
                    0,
                    &Response::error(
                        ErrorKind::Unauthorized,
                        format!(
                            "the handshake was not completed within {:?}",
                            shared.cfg.handshake_timeout
                        ),
                    ),
                );
                break;
            }
        }
        let frame_by = Instant::now() + shared.cfg.frame_timeout;
        let rest = tokio::select! {
            _ = close_rx.changed() => break,
            r = tokio::time::timeout_at(frame_by.into(), r.read_exact(&mut prefix[1..])) => r,
        };
        match rest {
            Ok(Ok(_)) => {}
            Ok(Err(_)) => break,
            Err(_) => {
                slow_frame(&shared, sid);
                break;
            }
        }
        let len = match proto::frame_len(prefix, max) {
            Ok(len) => len,
            Err(e) => {
                // The stream cannot be resynchronised without reading the announced bytes.
                crate::metrics::error(ErrorKind::TooLarge);
                let why = if authed {
                    e.to_string()
                } else {
                    format!(
                        "{e} before the session is authenticated (preauth_message_bytes; a \
                         Hello carries the client's agent metadata)"
                    )
                };
                send(&shared, sid, 0, &Response::error(ErrorKind::TooLarge, why));
                break;
            }
        };
        let mut buf = vec![0u8; len];
        let body = tokio::select! {
            _ = close_rx.changed() => break,
            r = tokio::time::timeout_at(frame_by.into(), r.read_exact(&mut buf)) => r,
        };
        match body {
            Ok(Ok(_)) => {}
            Ok(Err(_)) => break,
            Err(_) => {
                slow_frame(&shared, sid);
                break;
            }
        }
        // A large request (a GET of a million keys) decodes on a thread of its own at a
        // lower priority, so the worker it would hold serves other sessions meanwhile and
        // preempts it when one sends a request.
        let large = buf.len() > LARGE_FRAME;
        let decoded =
            match super::bulk::run_if(large, move || proto::decode_body::<Request>(&buf)).await {
                Some(d) => d,
                None => break,
            };
        match decoded {
            Ok((id, req)) => {
                let op = op_name(&req);
                let span = tracing::debug_span!("request", id, op);
                match &req {
                    Request::Commit { put } => commit_grace(&shared, sid, *put).await,
                    Request::PutCredited {
                        credit,
                        bytes,
                        meta,
                        indexes,
                        fields,
                        ..
                    } => {
                        let large = large_meta(meta, indexes, fields);
                        credit_grace(&shared, sid, id, *credit, *bytes, meta, large).await
                    }
                    _ => {}
                }
                let req = match sliced(&shared, sid, id, req).instrument(span.clone()).await {
                    Ok(out) => {
                        dispatch(&shared, out);
                        continue;
                    }
                    Err(Unsliced::Other(req)) => req,
                    Err(Unsliced::Panicked) => {
                        panicked(&shared, sid, id, op, "its work on a bulk thread panicked");
                        break;
                    }
                };
                // A large PUT's keys out of order are checked, and its meta decoded, off the
                // unit's lock.
                let Some((req, mut ahead)) = ahead_of_put(&shared, req).await else {
                    panicked(&shared, sid, id, op, "its work on a bulk thread panicked");
                    break;
                };
                let started = Instant::now();
                // A request that would see one handled in slices half done (or be seen so)
                // waits for its partition, then is handled while it holds it.
                let mut held = None;
                let mut wait: Option<(String, Access)> = None;
                let mut req = Some(req);
                let step = loop {
                    if let Some((partition, access)) = wait.take() {
                        held = Some(shared.partitions.acquire(&partition, access).await);
                    }
                    let step = {
                        let _g = span.enter();
                        // The standing ranges the handling withdraws or grants (a used
                        // credit, the next one) are announced to the client's engine at once
                        // where the engine does so through shared memory (shm's ring: a few
                        // stores, under the unit's lock too), else after the answer has left,
                        // in one message, and not under the unit's lock.
                        let announcements = Agent::hold_announcements();
                        let mut unit = shared.unit.lock();
                        let pending = req.as_ref().expect("the request, until handled");
                        match held.is_none().then(|| unit.waits(sid, pending)).flatten() {
                            Some(w) => Handled::Wait(w),
                            None => {
                                let req = req.take().expect("the request, until handled");
                                // Caught inside the lock's scope: the lock is not poisoned,
                                // and the session is closed below, which releases what it
                                // held in the core.
                                let handled = catch_unwind(AssertUnwindSafe(|| {
                                    #[cfg(test)]
                                    fault::before_handle(sid, id, &req);
                                    #[cfg(test)]
                                    let watched = match &req {
                                        Request::Get { partition, .. }
                                        | Request::GetOffer { partition, .. } => {
                                            Some(partition.clone())
                                        }
                                        _ => None,
                                    };
                                    let out = unit.handle_slicing(
                                        started,
                                        sid,
                                        id,
                                        req,
                                        std::mem::take(&mut ahead),
                                    );
                                    #[cfg(test)]
                                    if let Some(p) = watched {
                                        fault::get_done(&p);
                                    }
                                    unit.trim_memory();
                                    (out, unit.take_garbage())
                                }));
                                drop(unit);
                                // A dropped partition's values are freed here, outside the
                                // unit's lock.
                                let handled = handled.map(|(out, garbage)| {
                                    drop(garbage);
                                    out
                                });
                                match handled {
                                    Ok(Ok(out)) => {
                                        #[cfg(test)]
                                        fault::after_handle(op);
                                        crate::metrics::request(op, started.elapsed(), &out);
                                        dispatch(&shared, out);
                                        drop(announcements);
                                        Handled::Done
                                    }
                                    Ok(Err(put)) => Handled::Sliced(put),
                                    Err(p) => Handled::Panicked(panic_message(&*p)),
                                }
                            }
                        }
                    };
                    match step {
                        Handled::Wait(w) => {
                            #[cfg(test)]
                            fault::waits(&w.0);
                            wait = Some(w);
                        }
                        other => break other,
                    }
                };
                match step {
                    Handled::Sliced(put) => {
                        let stored = store_sliced(&shared, put, held.take())
                            .instrument(span.clone())
                            .await;
                        let Some(out) = stored else {
                            panicked(&shared, sid, id, op, "storing a slice panicked");
                            break;
                        };
                        let _g = span.enter();
                        #[cfg(test)]
                        fault::after_handle(op);
                        crate::metrics::request(op, started.elapsed(), &out);
                        dispatch(&shared, out);
                    }
                    Handled::Panicked(what) => {
                        panicked(&shared, sid, id, op, &what);
                        break;
                    }
                    Handled::Done | Handled::Wait(_) => {}
                }
                drop(held);
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
    let handle = shared.sessions.lock().remove(&sid);
    close_in_core(&shared, sid, handle.as_ref());
    drop((handle, gate));
    let _ = writer.await;
    tracing::debug!("session closed");
}

/// Answers request `id` (an `op`) whose handling panicked (`what`), before its session
/// closes.
fn panicked(shared: &Arc<Shared>, sid: SessionId, id: u64, op: &str, what: &str) {
    tracing::error!(id, op, panic = %what, "request handling panicked; closing the session");
    crate::metrics::error(ErrorKind::Internal);
    let message = format!(
        "the unit failed handling this {op} request ({what}); the session is closed, reconnect"
    );
    send(
        shared,
        sid,
        id,
        &Response::error(ErrorKind::Internal, message),
    );
}

/// What became of a request handed to the core.
enum Handled {
    /// Answered.
    Done,
    /// It waits for this partition, held by a request handled in slices.
    Wait((String, Access)),
    /// A PUT to store in slices.
    Sliced(Box<SlicedPut<tessera_transport::LocalDesc>>),
    /// Its handling panicked: the session closes.
    Panicked(String),
}

/// Why [`sliced`] did not answer a request.
enum Unsliced {
    /// Not one it slices: it is handled as any other.
    Other(Request),
    /// Its bulk work panicked on its thread: the session closes, as after a panic here.
    Panicked,
}

/// Keys from which a sliced GET checks indexes out of order, and encodes the values it
/// found, on a bulk thread. On the benchmark machine a million keys took 22-32 ms to check
/// out of order (the duplicate check's set; 0.4 ms in order) and 130-170 ms to encode as
/// tensors (27-31 as integers), which a worker would spend away from every other session
/// (all of them, where the unit may use one core and runs one worker). A GET in order whose
/// keys are missing, the hostile suite's `missing_gets`, starts no thread: one per request
/// made the probe's p99 under it 12-22 % longer in three alternations.
pub(super) const BULK_KEYS: usize = 1 << 16;

/// A GET or CLEAR of more than `slice_keys` keys, handled in slices while it holds its
/// partition: the keys are checked and the answer encoded without the unit's lock (on a bulk
/// thread from [`BULK_KEYS`]), and each hold of it looks up one slice or clears a
/// [`write_slice_keys`](crate::core::write_slice_keys) one, yielding to other sessions
/// between slices. Any other request comes back.
async fn sliced(
    shared: &Arc<Shared>,
    sid: SessionId,
    id: u64,
    req: Request,
) -> Result<Vec<crate::core::Output<tessera_transport::LocalDesc>>, Unsliced> {
    let cfg = &shared.cfg.unit;
    let slice = cfg.slice_keys.max(1) as usize;
    // A GET that offers its block is sliced alike; the offer goes with its end.
    let (req, offer) = match req {
        Request::GetOffer {
            partition,
            indexes,
            fields,
            block,
        } if indexes.len().saturating_mul(fields.len().max(1)) > slice => (
            Request::Get {
                partition,
                indexes,
                fields,
            },
            Some(block),
        ),
        other => (other, None),
    };
    match req {
        Request::Get {
            partition,
            indexes,
            fields,
        } if indexes.len().saturating_mul(fields.len().max(1)) > slice => {
            let started = Instant::now();
            let heavy = indexes.len().saturating_mul(fields.len().max(1)) > BULK_KEYS;
            #[cfg(test)]
            fault::check_begins(&partition);
            // Indexes in order are checked in one pass, here; others need a set of them.
            let in_order = crate::core::keys_in_order(&indexes);
            let c = cfg.clone();
            let checked = super::bulk::run_if(heavy && !in_order, move || {
                let r = crate::core::check_keys_ordered(&c, &indexes, &fields, in_order);
                (indexes, fields, r)
            });
            let Some((indexes, fields, checked)) = checked.await else {
                return Err(Unsliced::Panicked);
            };
            if let Err(e) = checked {
                return Ok(vec![crate::core::Output::Reply {
                    session: sid,
                    id,
                    response: Response::Error(e),
                }]);
            }
            // Its partition held to read: no PUT or CLEAR of it lands between two slices.
            let _partition = shared.partitions.acquire(&partition, Access::Read).await;
            let (begun, _hold) = {
                let mut unit = shared.unit.lock();
                #[cfg(test)]
                fault::before_sliced(&partition);
                let hold = CoreHold::new(shared, &mut unit, &partition, Access::Read);
                (unit.get_begin(sid, id, partition, indexes, fields), hold)
            };
            let mut g = match begun {
                Ok(g) => g,
                Err(out) => return Ok(out),
            };
            loop {
                let done = shared.unit.lock().get_step(&mut g);
                #[cfg(test)]
                fault::between_slices(g.partition()).await;
                if done {
                    break;
                }
                tokio::task::yield_now().await;
            }
            #[cfg(test)]
            let g_partition = g.partition().to_owned();
            // The keys missing make a short error; values found, a long encoding.
            let c = cfg.clone();
            let encoded = super::bulk::run_if(heavy && g.found(), move || {
                g.into_columns()
                    .and_then(|cols| crate::core::encode_get(&c, cols))
            });
            let Some(encoded) = encoded.await else {
                return Err(Unsliced::Panicked);
            };
            #[cfg(test)]
            let partition = g_partition;
            let out = {
                let mut unit = shared.unit.lock();
                let out = unit.get_finish(Instant::now(), sid, id, encoded, offer);
                #[cfg(test)]
                fault::get_done(&partition);
                out
            };
            crate::metrics::request("get", started.elapsed(), &out);
            Ok(out)
        }
        Request::Clear {
            partition,
            indexes,
            fields,
        } if indexes.len() > slice => {
            let started = Instant::now();
            if indexes.len() as u64 > cfg.max_keys {
                return Ok(vec![crate::core::Output::Reply {
                    session: sid,
                    id,
                    response: Response::error(ErrorKind::TooLarge, "too many indexes"),
                }]);
            }
            // Its partition held to write: no request sees it half cleared.
            let _partition = shared.partitions.acquire(&partition, Access::Write).await;
            let _hold = CoreHold::new(shared, &mut shared.unit.lock(), &partition, Access::Write);
            // Slices of a removal each, its blocks compacted once all are cleared.
            let per = crate::core::write_slice_keys(cfg);
            let mut released = std::collections::HashSet::new();
            let mut chunks = indexes.chunks(per).peekable();
            while let Some(chunk) = chunks.next() {
                let last = chunks.peek().is_none();
                let response = {
                    let mut unit = shared.unit.lock();
                    let fields = fields.as_deref();
                    let r = unit.clear_step(sid, &partition, chunk, fields, &mut released);
                    if r.is_err() || last {
                        unit.clear_end(std::mem::take(&mut released));
                    }
                    unit.trim_memory();
                    match r {
                        Err(e) => Some(Response::Error(e)),
                        Ok(()) => last.then_some(Response::Done),
                    }
                };
                if let Some(response) = response {
                    let out = vec![crate::core::Output::Reply {
                        session: sid,
                        id,
                        response,
                    }];
                    crate::metrics::request("clear", started.elapsed(), &out);
                    return Ok(out);
                }
                tokio::task::yield_now().await;
            }
            Ok(Vec::new())
        }
        other => Err(Unsliced::Other(other)),
    }
}

/// A PUT's bulk work done off the unit's lock, where doing it under the lock would hold every
/// other session, on the bulk thread: its keys checked where there are more than
/// [`BULK_KEYS`] of them out of order (a set of them; in order, the core's check is one
/// pass), and a prepared PUT's large meta ([`large_meta`]) decoded (one whose payload the
/// client WRITEs, or that carries none). The request comes back with what was done ([`Ahead`]):
/// keys not found valid, or a meta that did not decode, are left for the core, which
/// refuses them and gives back what the request holds. `None` if the work panicked.
async fn ahead_of_put(shared: &Arc<Shared>, req: Request) -> Option<(Request, Ahead)> {
    let (check, decode) = match &req {
        Request::Put {
            indexes,
            fields,
            meta,
            inline,
            pull,
            ..
        } => (
            many_out_of_order(indexes, fields),
            pull.is_none()
                && crate::core::inline_empty(inline)
                && large_meta(meta, indexes, fields),
        ),
        Request::PutCredited {
            indexes, fields, ..
        } => (many_out_of_order(indexes, fields), false),
        _ => (false, false),
    };
    if !check && !decode {
        return Some((req, Ahead::default()));
    }
    #[cfg(test)]
    if let Request::Put { partition, .. } | Request::PutCredited { partition, .. } = &req {
        fault::check_begins(partition);
    }
    let cfg = shared.cfg.unit.clone();
    let decoder = decode.then(|| shared.unit.lock().meta_decoder(u64::MAX));
    super::bulk::run(move || {
        let mut ahead = Ahead::default();
        if let Request::Put {
            indexes,
            fields,
            meta,
            ..
        }
        | Request::PutCredited {
            indexes,
            fields,
            meta,
            ..
        } = &req
        {
            ahead.keys_checked =
                check && crate::core::check_keys_ordered(&cfg, indexes, fields, false).is_ok();
            ahead.meta = decoder.and_then(|(d, align)| d.decode_unbound(meta, align).ok());
        }
        (req, ahead)
    })
    .await
}

/// Whether a PUT's meta takes long to decode: over [`LARGE_FRAME`] bytes, or for more than
/// [`BULK_KEYS`] keys (same-shaped tensors encode as one run: a meta of a few bytes may
/// decode into a million values, 62 ms for 2^18 one-element tensors here).
fn large_meta(meta: &[u8], indexes: &[u64], fields: &[String]) -> bool {
    meta.len() > LARGE_FRAME || indexes.len().saturating_mul(fields.len().max(1)) > BULK_KEYS
}

/// Whether `indexes` x `fields` are more than [`BULK_KEYS`] keys, indexes out of order.
fn many_out_of_order(indexes: &[u64], fields: &[String]) -> bool {
    indexes.len().saturating_mul(fields.len().max(1)) > BULK_KEYS
        && !crate::core::keys_in_order(indexes)
}

/// Stores PUT `put` in slices, yielding to other sessions between them, while it holds its
/// partition to write (`held` where its request waited for it, else taken here); its answer,
/// or `None` if a slice panicked.
pub(super) async fn store_sliced(
    shared: &Arc<Shared>,
    put: Box<SlicedPut<tessera_transport::LocalDesc>>,
    held: Option<PartitionGuard>,
) -> Option<Vec<crate::core::Output<tessera_transport::LocalDesc>>> {
    let mut storing = Storing {
        shared,
        put: Some(put),
    };
    let partition = storing.put.as_ref()?.partition().to_owned();
    let _held = match held {
        Some(g) if g.access() == Access::Write && g.name() == partition => g,
        other => {
            drop(other);
            shared.partitions.acquire(&partition, Access::Write).await
        }
    };
    #[cfg(test)]
    fault::before_sliced(&partition);
    loop {
        let step = {
            let mut unit = shared.unit.lock();
            let put = storing.put.as_mut()?;
            catch_unwind(AssertUnwindSafe(|| {
                let out = unit.put_step(put);
                if out.is_some() {
                    unit.trim_memory();
                }
                out
            }))
        };
        match step {
            Ok(Some(out)) => {
                storing.put = None;
                #[cfg(test)]
                fault::get_done(&partition);
                return Some(out);
            }
            Ok(None) => {
                #[cfg(test)]
                fault::between_slices(&partition).await;
                tokio::task::yield_now().await;
            }
            Err(_) => return None,
        }
    }
}

/// A PUT being stored in slices: where its driver stops before the last one (a panic, the
/// unit stopping), what it holds in the core is given back.
struct Storing<'a> {
    shared: &'a Shared,
    put: Option<Box<SlicedPut<tessera_transport::LocalDesc>>>,
}

impl Drop for Storing<'_> {
    fn drop(&mut self) {
        // Never dropped under the unit's lock: each slice takes and leaves it.
        if let Some(mut put) = self.put.take() {
            self.shared.unit.lock().put_end(&mut put);
        }
    }
}

/// A partition held in the core by a GET or CLEAR handled in slices: given back on drop,
/// never under the unit's lock.
struct CoreHold<'a> {
    shared: &'a Shared,
    partition: String,
    access: Access,
}

impl<'a> CoreHold<'a> {
    fn new(
        shared: &'a Shared,
        unit: &mut Unit<PoolMemory>,
        partition: &str,
        access: Access,
    ) -> Self {
        unit.hold(partition, access);
        Self {
            shared,
            partition: partition.to_owned(),
            access,
        }
    }
}

impl Drop for CoreHold<'_> {
    fn drop(&mut self) {
        self.shared
            .unit
            .lock()
            .release(&self.partition, self.access);
    }
}

/// A request that did not arrive whole within `frame_timeout`: the connection is closed.
fn slow_frame(shared: &Shared, sid: SessionId) {
    tracing::debug!("request not received in time; closing");
    crate::metrics::error(ErrorKind::Protocol);
    send(
        shared,
        sid,
        0,
        &Response::error(
            ErrorKind::Protocol,
            format!(
                "a request did not arrive whole within {:?}",
                shared.cfg.frame_timeout
            ),
        ),
    );
}

fn op_name(req: &Request) -> &'static str {
    match req {
        Request::Hello { .. } => "hello",
        Request::Auth { .. } => "auth",
        Request::Put {
            inline: Some(_), ..
        } => "put_inline",
        Request::Put { pull: Some(_), .. } => "put_pull",
        Request::Put { .. } => "put_prepare",
        Request::PutCredited { .. } => "put_credited",
        Request::Commit { .. } => "put_commit",
        Request::Cancel { .. } => "cancel",
        Request::Get { .. } => "get",
        Request::GetOffer { .. } => "get_offer",
        Request::GetInto { .. } => "get_into",
        Request::Clear { .. } => "clear",
        Request::DropPartition { .. } => "drop_partition",
        Request::Stats => "stats",
    }
}

pub(super) fn send(shared: &Shared, sid: SessionId, id: u64, resp: &Response) {
    let Some(out) = shared.sessions.lock().get(&sid).map(|h| h.replies.clone()) else {
        return;
    };
    let buf = match proto::encode_frame(id, resp) {
        Ok(buf) => buf,
        Err(e) => return tracing::error!(error = %e, "cannot encode a response"),
    };
    if out.send(buf).is_err() {
        // Only answers the session did not wait room for (a prepared PUT that expired) can
        // find the queue full: the client is not reading. An answer cannot be dropped
        // silently, so the session ends.
        tracing::error!(
            session = sid,
            id,
            "reply queue full (the client does not read its answers); closing the session"
        );
        crate::metrics::error(ErrorKind::Busy);
        if let Some(h) = shared.sessions.lock().get(&sid) {
            let _ = h.close.send(true);
        }
    }
}

/// A session's way out (see [`crate::outbox`]): an answer is written from the thread that
/// makes it when nothing is queued ahead of it, else by the session's writer task.
pub(super) struct Replies {
    tx: mpsc::Sender<Reply>,
    state: Arc<Mutex<OutState>>,
    /// When the session's next request is expected, from its last answer (shared with the
    /// session's writer task, which sends the answers queued behind others).
    next: Arc<NextRequest>,
}

/// When a session's next request is expected, for a unit whose poller learns
/// ([`BusyPoll::expecting`]): as long after an answer as its client's latest pauses after
/// answers took (`busy_poll::expected_after`). Expected from each answer as it leaves, since
/// a GET's answer leaves the executor once its WRITE is over, long after the session's loop
/// went idle: counted from the loop's idling, the pause after a GET (its WRITE, then the
/// client's next step) passed the poller's bound, so no request of a client that alternates
/// GETs and PUTs was polled for, and each one's write woke the unit's core.
struct NextRequest {
    poll: Option<BusyPoll>,
    epoch: Instant,
    /// Nanoseconds from `epoch` to the last answer; 0 before one.
    answered: AtomicU64,
    /// The pause expected after an answer, in nanoseconds; 0 while none is known.
    after: AtomicU64,
}

impl NextRequest {
    fn new(poll: Option<BusyPoll>) -> Self {
        Self {
            poll,
            epoch: Instant::now(),
            answered: AtomicU64::new(0),
            after: AtomicU64::new(0),
        }
    }

    /// The pause the session's next request is now expected after (`None`: not known).
    fn learned(&self, after: Option<Duration>) {
        let ns = after.map_or(0, |d| {
            u64::try_from(d.as_nanos()).unwrap_or(u64::MAX).max(1)
        });
        self.after.store(ns, Ordering::Relaxed);
    }

    /// Expects the next request within the learned pause from `since`.
    fn expect_from(&self, since: Instant) {
        let after = self.after.load(Ordering::Relaxed);
        if let (Some(poll), true) = (&self.poll, after > 0) {
            poll.expect(since, Duration::from_nanos(after));
        }
    }

    /// An answer left now.
    fn answer_left(&self) {
        if self.poll.is_none() {
            return;
        }
        let now = Instant::now();
        let ns = u64::try_from(now.duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX);
        self.answered.store(ns.max(1), Ordering::Relaxed);
        self.expect_from(now);
    }

    /// When the last answer left, if one did.
    fn answered(&self) -> Option<Instant> {
        match self.answered.load(Ordering::Relaxed) {
            0 => None,
            ns => Some(self.epoch + Duration::from_nanos(ns)),
        }
    }
}

/// An answer for the writer task, from byte `from` on (the bytes before went out directly).
pub(super) struct Reply {
    buf: Vec<u8>,
    from: usize,
}

impl Replies {
    /// Writes `buf` or queues what the socket did not take; `Err` when the queue is full.
    /// After a failed write the answer is dropped: the connection is gone.
    fn send(&self, buf: Vec<u8>) -> Result<(), ()> {
        let mut state = self.state.lock();
        let Ok(from) = state.write_now(&buf) else {
            return Ok(());
        };
        if from == buf.len() {
            drop(state);
            self.next.answer_left();
            return Ok(());
        }
        state.queue();
        match self.tx.try_send(Reply { buf, from }) {
            Ok(()) => Ok(()),
            Err(e) => {
                // On a full queue the session closes, after whatever part went out.
                state.not_handed_over(from);
                match e {
                    mpsc::error::TrySendError::Full(_) => Err(()),
                    mpsc::error::TrySendError::Closed(_) => Ok(()),
                }
            }
        }
    }

    /// Waits until `n` more answers fit in the queue; `Err` once the writer is gone.
    pub(super) async fn room(&self, n: usize) -> Result<(), ()> {
        self.tx.reserve_many(n).await.map(drop).map_err(drop)
    }
}

/// A session's pauses between requests that its next one is expected from: the last this many.
const PAUSES: usize = 8;

/// Frames larger than this decode off the session's worker, and PUTs' metas ([`large_meta`]).
const LARGE_FRAME: usize = 1 << 20;

/// How long a COMMIT waits for the engine to record the WRITE it follows.
const COMMIT_GRACE: Duration = Duration::from_millis(500);

/// The copy speed below which a busy-polling unit stops spinning for a credited PUT's WRITE
/// record and waits for it parked: 4 GB/s (a byte per quarter nanosecond), a fifth of a
/// memcpy here, so that a client copying at its usual speed is spun for.
const COPY_FLOOR_BYTES_PER_NS: u64 = 4;

/// Before a COMMIT is handed to the core: gives the payload engine up to [`COMMIT_GRACE`] to
/// record a WRITE that completed at the client but whose record is still on its way (shm's
/// DONE is read by the engine's own thread), waiting off the unit's lock to be woken by it. A PUT whose frames
/// are written, or that is not a pushed one, passes at once.
async fn commit_grace(shared: &Shared, sid: SessionId, put: u64) {
    let Some(written) = shared.unit.lock().put_written(sid, put) else {
        return;
    };
    let recorded = std::future::poll_fn(|cx| written.poll_written(cx));
    // The record comes from the engine's thread of this process: no spin in its way.
    let _quiet = shared.cfg.busy_poll.as_ref().map(BusyPoll::quiet);
    let _ = tokio::time::timeout(COMMIT_GRACE, recorded).await;
}

/// For a credited PUT (request `id`), whose client sends it while it WRITEs the frames:
/// decodes its meta meanwhile, off the unit's lock, for the PUT's handling to bind to the
/// block; then waits, at most the unit's `transfer_timeout` (a WRITE's own bound), until the
/// credit records `bytes` written (what the client says its frames hold; the core then
/// checks each frame's range). Only this session's requests wait meanwhile.
async fn credit_grace(
    shared: &Shared,
    sid: SessionId,
    id: u64,
    credit: u64,
    bytes: u64,
    meta: &[u8],
    large: bool,
) {
    let since = Instant::now();
    let ((landing, len), (decoder, align)) = {
        let unit = shared.unit.lock();
        let Some(landing) = unit.credit_landing(sid, credit) else {
            return;
        };
        let decoder = unit.meta_decoder(landing.1);
        (landing, decoder)
    };
    // A large meta (`large_meta`) decodes off the worker, as a large frame does. If that
    // panics, the request's handling decodes it (and fails) under the unit's lock.
    let decoded = match large {
        true => {
            let meta = meta.to_vec();
            super::bulk::run(move || decoder.decode_unbound(&meta, align)).await
        }
        false => Some(decoder.decode_unbound(meta, align)),
    };
    if let Some(decoded) = decoded {
        shared.unit.lock().credit_decoded(sid, credit, id, decoded);
    }
    let recorded = std::future::poll_fn(|cx| landing.poll_bytes(bytes, cx));
    if recorded_now(&landing, bytes) {
        return;
    }
    // A busy-polling unit spins for the record where the client's engine leaves it for a
    // spinning thread to take (`shm`'s ring): the client is copying as this request travels,
    // so the record is expected, up to the poller's bound past the request plus the time
    // the copy of `bytes` takes at `COPY_FLOOR_BYTES_PER_NS` (a slower one is woken for; a
    // client that says more than its credit holds is spun for as long as the credit's copy).
    if let Some(p) = &shared.cfg.busy_poll {
        let copy = Duration::from_nanos(bytes.min(len) / COPY_FLOOR_BYTES_PER_NS);
        if p.spin_for(since, copy, |d| landing.spin_bytes(bytes, d)) {
            return;
        }
    }
    // Otherwise the record comes from the engine's thread of this process: no spin in its
    // way.
    let _quiet = shared.cfg.busy_poll.as_ref().map(BusyPoll::quiet);
    let _ = tokio::time::timeout(shared.cfg.transfer_timeout, recorded).await;
}

/// Whether `landing` records `bytes` written already.
fn recorded_now(landing: &crate::core::Landed, bytes: u64) -> bool {
    let waker = std::task::Waker::noop();
    landing
        .poll_bytes(bytes, &mut Context::from_waker(waker))
        .is_ready()
}

/// Connects to the client's agent (a blocking connect for some engines), then starts the
/// session's executor: WRITEs to one peer run one at a time, peers run concurrently.
pub(super) async fn accept_peer(shared: Arc<Shared>, sid: SessionId, id: u64, md: Vec<u8>) {
    let timeout = shared.cfg.peer_add_timeout;
    let fail = |kind: ErrorKind, why: String| {
        tracing::warn!(session = sid, error = %why, "cannot add the client's agent; closing the session");
        send(&shared, sid, id, &Response::error(kind, why));
        shared.unit.lock().fail_session(sid);
        if let Some(h) = shared.sessions.lock().get(&sid) {
            let _ = h.close.send(true);
        }
    };
    // At most `max_peer_adds` at once, each within `peer_add_timeout`: a client whose agent
    // cannot be reached holds one permit (the blocking call keeps it until it returns), never
    // the unit's blocking threads or other sessions' handshakes for long.
    let permit = match tokio::time::timeout(timeout, shared.peer_adds.clone().acquire_owned()).await
    {
        Ok(Ok(p)) => p,
        _ => {
            return fail(
                ErrorKind::Transfer,
                format!(
                    "too many clients' agents are being connected to; none became free within \
                 {timeout:?}"
                ),
            )
        }
    };
    let agent = shared.agent.clone();
    let add = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        agent.add_remote(&md)
    });
    let peer = match tokio::time::timeout(timeout, add).await {
        Ok(Ok(Ok(p))) => p,
        // Worded for the client, whose backend is the one to change.
        Ok(Ok(Err(ConnectError::BackendMismatch { ours, theirs, .. }))) => {
            return fail(
                ErrorKind::BadRequest,
                format!(
                    "this unit uses the {ours} backend and the client {theirs}: connect with \
                     the {ours} backend"
                ),
            )
        }
        Ok(Ok(Err(e))) => {
            return fail(
                ErrorKind::Transfer,
                format!("cannot connect to the client's agent: {e}"),
            )
        }
        Ok(Err(e)) => {
            return fail(
                ErrorKind::Transfer,
                format!("connecting to the client's agent failed: {e}"),
            )
        }
        Err(_) => {
            return fail(
                ErrorKind::Transfer,
                format!("the client's agent could not be connected to within {timeout:?}"),
            )
        }
    };
    let (tx, rx) = mpsc::channel(shared.cfg.transfer_queue);
    let depth = {
        let mut sessions = shared.sessions.lock();
        let Some(h) = sessions.get_mut(&sid) else {
            return;
        };
        h.jobs = Some(tx);
        h.peer = peer.name().to_owned();
        h.queue_depth.clone()
    };
    shared.unit.lock().session_ready(sid, peer.name());
    let seen = shared.generation.load(Ordering::Acquire);
    if let Some(h) = shared.sessions.lock().get_mut(&sid) {
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
    shared
        .tasks
        .lock()
        .spawn(executor(s, sid, peer, rx, depth).in_current_span());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each answer, whoever sends it, expects the session's next request the learned pause
    /// later; before a pause is learned, or without a learning poller, nothing is expected,
    /// and the last answer's time is what the next pause counts from.
    #[test]
    fn each_answer_expects_the_next_request_after_the_learned_pause() {
        let poll =
            BusyPoll::expecting(Duration::from_micros(50), Duration::from_millis(1)).unwrap();
        let next = NextRequest::new(Some(poll.clone()));
        assert!(next.answered().is_none());
        next.answer_left();
        assert!(poll.expected().is_none(), "nothing learned yet");
        let first = next.answered().expect("the answer's time");
        let pause = Duration::from_micros(200);
        next.learned(Some(pause));
        std::thread::sleep(Duration::from_millis(2));
        let before = Instant::now();
        next.answer_left();
        let after = Instant::now();
        let at = next.answered().unwrap();
        assert!(at > first && before <= at && at <= after);
        let expected = poll.expected().expect("the next request expected");
        assert!(before + pause <= expected && expected <= after + pause);
        // Forgotten: a later answer expects nothing more.
        next.learned(None);
        std::thread::sleep(Duration::from_millis(2));
        next.answer_left();
        assert_eq!(poll.expected(), Some(expected));
        // A unit that does not poll keeps no times.
        let unpolled = NextRequest::new(None);
        unpolled.learned(Some(pause));
        unpolled.answer_left();
        assert!(unpolled.answered().is_none());
    }
}
