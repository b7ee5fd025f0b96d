//! One pipelined control connection to a unit: requests are written from the caller's
//! thread when nothing is queued ahead of them (else by a writer task, in order), and
//! answers matched to their waiters by request id by a reader task, or by a caller waiting on
//! the socket itself ([`inbox`]).

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};
use tessera_sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use tessera_sync::{Arc, Mutex};

use serde_bytes::ByteBuf;
use tessera_framecodec::{Frames, RecvLayout};
use tessera_transport::{auth, Agent, Peer};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};

use super::ClientConfig;
use crate::busy_poll::{self, BusyPoll, Waiting};
use crate::error::{ClientError, ErrorKind};
use crate::outbox::{Direct, OutState};
use crate::plane::BackendExt;
use crate::proto::{self, Credit, Request, Response};
use crate::ring::Ring;

#[allow(unsafe_code)] // FFI: the eventfd and ppoll(2) of callers that wait on the socket.
mod inbox;

use self::inbox::{Answered, Here, Inbox, ReadHalf};

#[derive(Default)]
struct Pending {
    /// Set once the connection is gone: later calls fail at once instead of waiting.
    closed: bool,
    /// Set once the unit answered that the session failed (`peer_failed`, a transfer whose
    /// outcome is unknown, an internal failure): the client opens a new session for the
    /// next request.
    failed: bool,
    map: HashMap<u64, Waiter>,
    /// Polled for answers while one is awaited (`ClientConfig::busy_poll`).
    poll: Option<BusyPoll>,
    /// How long the answers to requests of each shape took lately, where the poller polls
    /// for expected answers ([`BusyPoll::expecting`]).
    timings: Timings,
}

/// Where a request's answer goes.
struct Waiter {
    tx: oneshot::Sender<Result<Response, ClientError>>,
    /// The request was sent outside the runtime's tasks (from `block_on`, as Python's threads
    /// call): its caller sleeps on a thread of its own.
    from_thread: bool,
    /// Where the meta of a [`Response::Writing`] goes, ahead of the answer (a `GetOffer`'s).
    ahead: Option<oneshot::Sender<ByteBuf>>,
    /// The shape its answer's time is learned under ([`timing_key`]), and when it was sent.
    timed: Option<(u64, Instant)>,
    /// Its caller waits on the socket ([`Inbox::answer_here`]): whoever else hands it its
    /// answer wakes it there.
    here: bool,
}

type Waiters = Arc<Mutex<Pending>>;

/// How many requests a client has in flight over all its sessions (each [`Answer`] alive
/// counts one): a caller waits on the socket only for its client's only request.
#[derive(Default)]
pub(super) struct InFlight(AtomicUsize);

impl InFlight {
    fn one(&self) -> Flying<'_> {
        self.0.fetch_add(1, Ordering::Relaxed);
        Flying(self)
    }

    fn alone(&self) -> bool {
        self.0.load(Ordering::Relaxed) == 1
    }
}

/// A request in flight, counted in its client's [`InFlight`] until dropped.
struct Flying<'a>(&'a InFlight);

impl Drop for Flying<'_> {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Where a session's answers arrive, and who waits for them.
struct Replies {
    waiters: Waiters,
    inbox: Arc<Inbox>,
    flying: Arc<InFlight>,
    /// Whether a caller on a thread of its own may wait on the socket itself: where the
    /// client does not busy-poll (its workers poll for the answer instead).
    here: bool,
}

pub(super) struct Conn {
    pub(super) unit: usize,
    out: Outbox,
    replies: Replies,
    next: AtomicU64,
    pub(super) peer: Peer,
    pub(super) inline_max: u64,
    pub(super) align: u64,
    pub(super) timeout: Duration,
    /// PUT payloads are READ by the unit (`Backend::pulls_puts`).
    pub(super) pull: bool,
    /// The session's credits: landing blocks the unit keeps ready for its PUTs.
    credits: Mutex<Vec<Credit>>,
    /// What GETs of one shape (their fields and count of indexes) laid out to lately, to size
    /// the block the next such GET offers.
    shapes: Mutex<OfferSizes>,
}

/// Shapes remembered per session, at most, in each [`PerShape`] (the map is emptied beyond).
const SHAPES: usize = 256;

/// GETs of one shape whose sizes an offer covers: the last this many.
const RECENT: usize = 16;

/// Answers of one shape whose times an expectation follows: the last this many.
const TIMED: usize = 8;

/// The last `N` values recorded for each shape of request (a hash of what the request
/// says), for at most [`SHAPES`] shapes: recording a new one past that starts the map over.
struct PerShape<T, const N: usize>(HashMap<u64, Ring<T, N>>);

impl<T, const N: usize> Default for PerShape<T, N> {
    fn default() -> Self {
        Self(HashMap::new())
    }
}

impl<T: Copy, const N: usize> PerShape<T, N> {
    /// The last values recorded for `key`'s shape.
    fn ring(&self, key: u64) -> Option<&Ring<T, N>> {
        self.0.get(&key)
    }

    fn record(&mut self, key: u64, value: T) {
        if self.0.len() >= SHAPES && !self.0.contains_key(&key) {
            self.0.clear();
        }
        self.0.entry(key).or_default().record(value);
    }

    fn forget(&mut self, key: u64) {
        self.0.remove(&key);
    }
}

/// How large a block the next GET of each shape offers: an eighth above the largest of the
/// last [`RECENT`] GETs of that shape. Values of one shape vary from GET to GET (a rollout
/// micro-batch's token counts); an offer that followed the latest sizes missed the larger
/// ones, which then took a second round trip (a quarter of the benchmark's rollout GETs).
#[derive(Default)]
struct OfferSizes(PerShape<u64, RECENT>);

impl OfferSizes {
    fn offer_for(&self, key: u64) -> Option<u64> {
        let largest = self.0.ring(key)?.iter().max()?;
        Some(largest + largest / 8)
    }

    fn forget(&mut self, key: u64) {
        self.0.forget(key);
    }

    fn laid_out(&mut self, key: u64, size: u64) {
        self.0.record(key, size);
    }
}

/// How long the answers to requests of each shape took lately ([`timing_key`]): the next
/// such request's answer is expected from the last [`TIMED`] ([`busy_poll::expected_after`]).
#[derive(Default)]
struct Timings(PerShape<Duration, TIMED>);

impl Timings {
    fn expected(&self, key: u64) -> Option<Duration> {
        self.0.ring(key).and_then(busy_poll::expected_after)
    }

    fn answered(&mut self, key: u64, took: Duration) {
        self.0.record(key, took);
    }
}

/// The shape a request's answer time is learned under: its kind, its [`shape`] (fields and
/// count of indexes), and for a credited PUT the size class (a power of two) of its payload. `None`
/// for the requests whose time depends on nothing they say (a COMMIT's on its WRITE).
fn timing_key(req: &Request) -> Option<u64> {
    use std::hash::{Hash, Hasher};
    let (kind, fields, indexes, bytes) = match req {
        Request::PutCredited {
            fields,
            indexes,
            bytes,
            ..
        } => (0u8, fields, indexes, *bytes),
        Request::Put {
            fields,
            indexes,
            meta,
            ..
        } => (1, fields, indexes, meta.len() as u64),
        Request::Get {
            fields, indexes, ..
        } => (2, fields, indexes, 0),
        Request::GetOffer {
            fields, indexes, ..
        } => (3, fields, indexes, 0),
        _ => return None,
    };
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (kind, shape(fields, indexes.len()), bytes.checked_ilog2()).hash(&mut h);
    Some(h.finish())
}

/// A request's shape: its fields and how many indexes it names, as the key of `Conn::shapes`
/// (a GET's) and part of a [`timing_key`].
pub(super) fn shape(fields: &[String], indexes: usize) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    fields.hash(&mut h);
    indexes.hash(&mut h);
    h.finish()
}

impl Conn {
    pub(super) async fn open(
        unit: usize,
        addr: &str,
        cfg: &ClientConfig,
        agent: &Arc<Agent>,
        flying: &Arc<InFlight>,
    ) -> Result<Conn, ClientError> {
        let io = |source| ClientError::Io { unit, source };
        let unreachable = |source| ClientError::Unreachable {
            unit,
            addr: addr.to_owned(),
            source,
        };
        let max = cfg.max_message_bytes;
        let (direct, inbox, fd);
        let (r, w): (ReadHalf, Box<dyn AsyncWrite + Send + Unpin>) =
            if let Some(path) = addr.strip_prefix("unix:") {
                let s = tokio::net::UnixStream::connect(path)
                    .await
                    .map_err(unreachable)?;
                direct = Direct::unix(&s).map_err(io)?;
                inbox = Inbox::new(unit, max, Direct::unix(&s).map_err(io)?).map_err(io)?;
                fd = s.as_raw_fd();
                let (r, w) = s.into_split();
                (ReadHalf::Unix(r), Box::new(w))
            } else {
                let s = tokio::net::TcpStream::connect(addr)
                    .await
                    .map_err(unreachable)?;
                s.set_nodelay(true).map_err(io)?;
                direct = Direct::tcp(&s).map_err(io)?;
                inbox = Inbox::new(unit, max, Direct::tcp(&s).map_err(io)?).map_err(io)?;
                fd = s.as_raw_fd();
                let (r, w) = s.into_split();
                (ReadHalf::Tcp(r), Box::new(w))
            };
        let (tx, rx) = mpsc::unbounded_channel::<Outgoing>();
        let waiters: Waiters = Arc::new(Mutex::new(Pending {
            poll: cfg.busy_poll.clone(),
            ..Pending::default()
        }));
        let state = Arc::new(Mutex::new(OutState::new(Some(direct))));
        tokio::spawn(write_loop(w, rx, state.clone()));
        let out = Outbox { tx, state };
        let replies = Replies {
            waiters,
            inbox: Arc::new(inbox),
            flying: flying.clone(),
            here: cfg.busy_poll.is_none(),
        };
        // Parking workers poll the socket while the reader lives, where the client busy-polls.
        let watch = BusyPoll::watched(cfg.busy_poll.as_ref(), fd, (), false);
        let (inbox, waiters) = (replies.inbox.clone(), replies.waiters.clone());
        tokio::spawn(async move {
            inbox.read_loop(&r, waiters).await;
            // The socket leaves the poller's set before its read half closes it.
            drop(watch);
            drop(r);
        });
        // Challenge-response: the token never travels. The unit proves it holds the token
        // first (over both nonces and what this client sent), then this client.
        let client_nonce = auth::nonce();
        let md_ours = agent.metadata();
        let hello = Request::Hello {
            nonce: ByteBuf::from(client_nonce.to_vec()),
            agent: md_ours.clone(),
        };
        let (_, resp) = call_raw(unit, &out, &replies, 0, hello, cfg.timeout).await?;
        let Response::Challenge { nonce, proof } = resp else {
            return Err(ClientError::Unexpected {
                unit,
                what: format!("{resp:?}").chars().take(200).collect(),
            });
        };
        let parts = proto::handshake_parts(&client_nonce, &nonce, &md_ours);
        if nonce.len() != auth::NONCE_LEN
            || !auth::check(cfg.token.as_ref(), proto::UNIT_PROOF, &parts, &proof)
        {
            return Err(ClientError::Unauthenticated {
                unit,
                had_token: cfg.token.is_some(),
            });
        }
        let proof = auth::prove(cfg.token.as_ref(), proto::CLIENT_PROOF, &parts);
        let auth_req = Request::Auth {
            proof: ByteBuf::from(proof.to_vec()),
        };
        let (_, resp) = call_raw(unit, &out, &replies, 1, auth_req, cfg.timeout).await?;
        let Response::Welcome {
            agent: md,
            backend,
            inline_max,
            align,
        } = resp
        else {
            return Err(ClientError::Unexpected {
                unit,
                what: format!("{resp:?}").chars().take(200).collect(),
            });
        };
        if backend != cfg.backend.name() {
            return Err(ClientError::BackendMismatch {
                unit,
                theirs: backend,
                ours: cfg.backend,
            });
        }
        let a = agent.clone();
        let peer = tokio::task::spawn_blocking(move || a.add_remote(&md))
            .await?
            .map_err(|source| ClientError::Connect { unit, source })?;
        Ok(Conn {
            unit,
            out,
            replies,
            next: AtomicU64::new(2),
            peer,
            inline_max,
            align,
            timeout: cfg.timeout,
            pull: cfg.backend.pulls_puts(),
            credits: Mutex::new(Vec::new()),
            shapes: Mutex::new(OfferSizes::default()),
        })
    }

    /// How large a block a GET of shape `key` ([`shape`]) should offer, from what GETs of its
    /// shape laid out to lately ([`OfferSizes`]); `None` before any did.
    pub(super) fn offer_for(&self, key: u64) -> Option<u64> {
        self.shapes.lock().offer_for(key)
    }

    /// A GET of shape `key` ([`shape`]) came back inline: no offer until one is laid out.
    pub(super) fn answered_inline(&self, key: u64) {
        self.shapes.lock().forget(key);
    }

    /// A GET of shape `key` ([`shape`]) laid out to `size` bytes.
    pub(super) fn laid_out(&self, key: u64, size: u64) {
        self.shapes.lock().laid_out(key, size);
    }

    /// Takes a credit whose block holds `frames` laid out with the unit's alignment, if the
    /// session has one: the newest that does. With it comes the layout, for the WRITE's
    /// descriptors; the frames are laid out only where the session holds credits.
    ///
    /// The newest, because that keeps a session's copies in fewer blocks, whose memory is
    /// then more likely still in cache: taken oldest first, the two credits of a session that
    /// PUTs the same 4 MB batch over and over sent its copies through four blocks in turn (16
    /// MiB, past what the benchmark machine's cache kept for it when its neighbours were
    /// busy), newest first through three. Its standing exposure is known to the client's
    /// engine by the time it WRITEs: `shm` takes its ring of announcements before it posts a
    /// transfer (a link whose ring once overflowed announces on its socket instead, and a
    /// WRITE into a range not yet announced asks for a grant: a round trip more, nothing
    /// lost); the other engines grant every WRITE as it comes.
    pub(super) fn take_credit(&self, frames: &Frames) -> Option<(Credit, RecvLayout)> {
        if self.credits.lock().is_empty() {
            return None;
        }
        let layout = frames.layout(self.align).ok()?;
        let mut credits = self.credits.lock();
        let at = newest_fitting(&credits, layout.size)?;
        Some((credits.remove(at), layout))
    }

    /// Credits the unit granted with an answer.
    pub(super) fn add_credits(&self, credits: Vec<Credit>) {
        if !credits.is_empty() {
            self.credits.lock().extend(credits);
        }
    }

    /// Gives this session up: the client's next request opens a new one. For a request the
    /// unit may hold this session's later requests behind for long (a credited PUT whose
    /// WRITE failed: the unit waits up to its transfer timeout for frames that never come).
    pub(super) fn abandon(&self) {
        self.replies.waiters.lock().failed = true;
    }

    /// Whether this session is over: its connection closed, a write to it failed, or the
    /// unit failed it. A failed write ends it before the reader hears the close, which may
    /// be never (a unit that shut its reading side only).
    pub(super) fn ended(&self) -> bool {
        let ended = {
            let w = self.replies.waiters.lock();
            w.closed || w.failed
        };
        ended || self.out.state.lock().broken()
    }

    pub(super) async fn call(&self, req: Request) -> Result<(u64, Response), ClientError> {
        self.send(req, false)?.wait().await
    }

    /// Sends `req`; its answer comes through the returned [`Answer`], which with `confirm`
    /// can also tell when the request is on the socket.
    pub(super) fn send(&self, req: Request, confirm: bool) -> Result<Answer<'_>, ClientError> {
        self.send_with(req, confirm, None)
    }

    /// Sends a `GetOffer`; its answer comes through the returned [`Answer`], and the meta of
    /// a [`Response::Writing`] the unit sends ahead of it through [`Answer::ahead`].
    pub(super) fn send_offer(&self, req: Request) -> Result<Answer<'_>, ClientError> {
        let (tx, rx) = oneshot::channel();
        let mut answer = self.send_with(req, false, Some(tx))?;
        answer.ahead = Some(rx);
        Ok(answer)
    }

    fn send_with(
        &self,
        req: Request,
        confirm: bool,
        ahead: Option<oneshot::Sender<ByteBuf>>,
    ) -> Result<Answer<'_>, ClientError> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        send_raw(
            self.unit,
            &self.out,
            &self.replies,
            id,
            req,
            self.timeout,
            confirm,
            ahead,
        )
    }

    pub(super) fn unexpected(&self, resp: Response) -> ClientError {
        ClientError::Unexpected {
            unit: self.unit,
            what: format!("{resp:?}").chars().take(200).collect(),
        }
    }
}

async fn call_raw(
    unit: usize,
    out: &Outbox,
    replies: &Replies,
    id: u64,
    req: Request,
    timeout: Duration,
) -> Result<(u64, Response), ClientError> {
    send_raw(unit, out, replies, id, req, timeout, false, None)?
        .wait()
        .await
}

/// Where in `credits` (oldest first) the newest whose block holds `size` bytes is.
fn newest_fitting(credits: &[Credit], size: u64) -> Option<usize> {
    credits.iter().rposition(|c| c.block.len >= size)
}

/// Sends `req` as request `id` and returns the wait for its answer: the request is on its way
/// when this returns, so the caller can work while the unit does.
#[allow(clippy::too_many_arguments)] // one call site per kind of request
fn send_raw<'a>(
    unit: usize,
    out: &Outbox,
    replies: &'a Replies,
    id: u64,
    req: Request,
    timeout: Duration,
    confirm: bool,
    ahead: Option<oneshot::Sender<ByteBuf>>,
) -> Result<Answer<'a>, ClientError> {
    let buf = proto::encode_frame(id, &req).map_err(|source| ClientError::Wire { unit, source })?;
    let (otx, orx) = oneshot::channel();
    let waiters = &replies.waiters;
    let polled = {
        let mut w = waiters.lock();
        if w.closed {
            return Err(connection_closed(unit));
        }
        let learns = w.poll.as_ref().is_some_and(|p| !p.longest().is_zero());
        let timed = learns
            .then(|| timing_key(&req))
            .flatten()
            .map(|key| (key, Instant::now()));
        if let (Some(poll), Some((key, sent))) = (&w.poll, timed) {
            if let Some(after) = w.timings.expected(key) {
                poll.expect(sent, after);
            }
        }
        let waiter = Waiter {
            tx: otx,
            from_thread: tokio::task::try_id().is_none(),
            ahead,
            timed,
            here: false,
        };
        w.map.insert(id, waiter);
        w.poll.as_ref().map(BusyPoll::waiting)
    };
    let sent = match out.send(buf, confirm) {
        Ok(sent) => sent,
        Err(()) => {
            waiters.lock().map.remove(&id);
            return Err(connection_closed(unit));
        }
    };
    Ok(Answer {
        unit,
        id,
        rx: orx,
        sent,
        ahead: None,
        replies,
        timeout,
        _polled: polled,
        _flying: replies.flying.one(),
    })
}

fn connection_closed(unit: usize) -> ClientError {
    ClientError::Io {
        unit,
        source: std::io::Error::new(std::io::ErrorKind::ConnectionAborted, "connection closed"),
    }
}

/// A sent request's answer to come.
pub(super) struct Answer<'a> {
    unit: usize,
    id: u64,
    rx: Answered,
    /// Fires once the request is on the socket (when asked for).
    sent: Option<oneshot::Receiver<()>>,
    /// The meta of a [`Response::Writing`] ahead of the answer, for a `GetOffer`.
    ahead: Option<oneshot::Receiver<ByteBuf>>,
    replies: &'a Replies,
    timeout: Duration,
    /// Parking workers poll for the answer while it is awaited.
    _polled: Option<Waiting>,
    _flying: Flying<'a>,
}

impl Answer<'_> {
    /// Until the connection's writer put the request on the socket, gave up, or the answer's
    /// own timeout passed (a unit that stopped reading blocks the writer): the answer then
    /// reports what happened.
    pub(super) async fn sent(&mut self) {
        // `None` also when the caller's thread wrote it: nothing to wait for.
        if let Some(rx) = self.sent.take() {
            let _ = tokio::time::timeout(self.timeout, rx).await;
        }
    }

    /// The meta the unit sent ahead of this `GetOffer`'s answer ([`Response::Writing`]), or
    /// `None` when the answer came without one (or none came in time: [`Answer::wait`] then
    /// says so).
    pub(super) async fn ahead(&mut self) -> Option<ByteBuf> {
        let rx = self.ahead.take()?;
        let start = tokio::time::Instant::now();
        // The reader (or a caller reading the socket) drops the sender with the waiter once
        // the answer came. A caller on a thread of its own reads the meta off the socket as
        // it would the answer: handed over by the reader, it waited for the reader's worker
        // to be scheduled, milliseconds where a busy thread shares its core.
        let meta = self.replies.here(self.id, rx, self.timeout).await;
        // The answer's deadline counts from the request, not from here.
        self.timeout = self.timeout.saturating_sub(start.elapsed());
        meta.flatten()
    }

    /// The caller worked on after sending (a credited PUT's copy, on this thread; a GET's
    /// decoding of the meta sent ahead) and waits from now: the answer's time is learned
    /// from now, and parking workers expect it from now. Timed from the request instead, an
    /// answer that comes soon after that work was expected past the poller's bound, so not
    /// polled for, and its worker woken for it.
    pub(super) fn waiting_from_now(&self) {
        let now = Instant::now();
        let mut w = self.replies.waiters.lock();
        let Pending {
            map, poll, timings, ..
        } = &mut *w;
        let Some((key, from)) = map.get_mut(&self.id).and_then(|w| w.timed.as_mut()) else {
            return;
        };
        *from = now;
        if let (Some(poll), Some(after)) = (poll.as_ref(), timings.expected(*key)) {
            poll.expect(now, after);
        }
    }

    pub(super) async fn wait(self) -> Result<(u64, Response), ClientError> {
        let Self {
            unit,
            id,
            rx,
            replies,
            timeout,
            _polled: _waiting,
            _flying,
            ..
        } = self;
        let waiters = &replies.waiters;
        // A unit that never answers (stopped, or a session task that died) must not hold the
        // caller forever.
        let answer = match replies.here(id, rx, timeout).await {
            Some(answer) => answer,
            None => {
                waiters.lock().map.remove(&id);
                return Err(ClientError::Timeout {
                    unit,
                    after: timeout,
                });
            }
        };
        match answer {
            Some(Ok(Response::Error(source))) => {
                if session_fatal(source.kind) {
                    waiters.lock().failed = true;
                }
                Err(ClientError::Remote { unit, source })
            }
            Some(Ok(r)) => Ok((id, r)),
            Some(Err(e)) => Err(e),
            None => Err(connection_closed(unit)),
        }
    }
}

/// Whether an answer of this kind means the unit ended the session.
fn session_fatal(kind: ErrorKind) -> bool {
    matches!(
        kind,
        ErrorKind::PeerFailed | ErrorKind::Transfer | ErrorKind::Internal
    )
}

/// How long a waiter whose deadline passed still gives the connection's reader to hand over
/// an answer that is already there (a process resumed after SIGSTOP sees its timers and
/// its sockets ready at once, in no particular order).
const LATE_ANSWER_GRACE: Duration = Duration::from_millis(200);

/// The answer on `rx` (`Some(None)` when its sender went away), or `None` once `deadline`
/// (the end of the request's `timeout`) passed without one. When the deadline fires, an answer
/// that has arrived meanwhile is taken first: the reader is given a moment to deliver what the
/// socket already holds before the wait counts as a timeout.
async fn deadline_or_answer<T>(
    mut rx: oneshot::Receiver<T>,
    deadline: Instant,
    timeout: Duration,
) -> Option<Option<T>> {
    if let Ok(a) = tokio::time::timeout_at(deadline.into(), &mut rx).await {
        return Some(a.ok());
    }
    match rx.try_recv() {
        Ok(a) => return Some(Some(a)),
        Err(oneshot::error::TryRecvError::Closed) => return Some(None),
        Err(oneshot::error::TryRecvError::Empty) => {}
    }
    tokio::time::timeout(LATE_ANSWER_GRACE.min(timeout), &mut rx)
        .await
        .ok()
        .map(Result::ok)
}

impl Replies {
    /// What request `id` waits for on `rx` (its answer, or the meta sent ahead of it) within
    /// `timeout`, as [`deadline_or_answer`] gives it. A caller on a thread of its own whose
    /// request is its client's only one waits on the socket ([`Inbox::answer_here`]), a slice
    /// at a time. Before each slice the other futures of its `block_on` run: those that send
    /// requests are then in flight, and this one waits as a future like them.
    async fn here<T>(
        &self,
        id: u64,
        mut rx: oneshot::Receiver<T>,
        timeout: Duration,
    ) -> Option<Option<T>> {
        let deadline = Instant::now() + timeout;
        if self.here && waits_on_a_thread() {
            loop {
                tokio::task::yield_now().await;
                if !self.flying.alone() {
                    break;
                }
                let until = Instant::now() + inbox::SLICE;
                match self
                    .inbox
                    .answer_here(&self.waiters, id, rx, until, deadline)
                {
                    Ok(answer) => return answer,
                    Err(Here::Slice(back)) => rx = back,
                    Err(other) => {
                        rx = other.rx();
                        break;
                    }
                }
            }
        }
        deadline_or_answer(rx, deadline, timeout).await
    }
}

/// Whether this future is driven by a thread that has nothing else to do meanwhile: a
/// `block_on` of a multi-threaded runtime (whose workers serve the tasks), not a task nor a
/// current-thread runtime (where the thread is the only one to run the tasks).
fn waits_on_a_thread() -> bool {
    tokio::task::try_id().is_none()
        && tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
}

/// The connection's way out (see [`crate::outbox`]).
struct Outbox {
    tx: mpsc::UnboundedSender<Outgoing>,
    state: Arc<Mutex<OutState>>,
}

impl Outbox {
    /// Writes `buf` or queues what is left of it. Returns, with `confirm`, what fires once
    /// the writer task wrote it (`None`: already on the socket); `Err` when the connection
    /// is gone.
    fn send(&self, buf: Vec<u8>, confirm: bool) -> Result<Option<oneshot::Receiver<()>>, ()> {
        let mut state = self.state.lock();
        let from = state.write_now(&buf)?;
        if from == buf.len() {
            return Ok(None);
        }
        let (written, sent) = match confirm {
            true => {
                let (tx, rx) = oneshot::channel();
                (Some(tx), Some(rx))
            }
            false => (None, None),
        };
        state.queue();
        if self.tx.send(Outgoing { buf, from, written }).is_err() {
            state.not_handed_over(from);
            return Err(());
        }
        Ok(sent)
    }
}

/// A request for the connection's writer (from byte `from` on: the caller wrote the bytes
/// before it), and whom to tell once it is on the socket.
struct Outgoing {
    buf: Vec<u8>,
    from: usize,
    written: Option<oneshot::Sender<()>>,
}

async fn write_loop(
    mut w: Box<dyn AsyncWrite + Send + Unpin>,
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
    state: Arc<Mutex<OutState>>,
) {
    while let Some(out) = rx.recv().await {
        if w.write_all(&out.buf[out.from..]).await.is_err() {
            state.lock().fail();
            break;
        }
        state.lock().dequeue();
        if let Some(tx) = out.written {
            let _ = tx.send(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_transport::RemoteDesc;

    /// An offer covers the largest of the last [`RECENT`] GETs of its shape, an eighth
    /// above, whatever came between; older sizes age out, an inline answer forgets the
    /// shape, and shapes past [`SHAPES`] start the map over.
    #[test]
    fn offers_cover_the_largest_recent_get_of_their_shape() {
        let mut o = OfferSizes::default();
        assert_eq!(o.offer_for(1), None);
        o.laid_out(1, 800);
        for _ in 0..RECENT - 1 {
            o.laid_out(1, 80);
        }
        assert_eq!(o.offer_for(1), Some(900));
        o.laid_out(1, 80);
        assert_eq!(o.offer_for(1), Some(90));
        o.laid_out(2, 16);
        assert_eq!((o.offer_for(1), o.offer_for(2)), (Some(90), Some(18)));
        o.forget(1);
        assert_eq!(o.offer_for(1), None);
        for key in 3..=SHAPES as u64 + 1 {
            o.laid_out(key, 8);
        }
        o.laid_out(2, 16);
        assert_eq!(o.offer_for(2), Some(18), "a shape it holds keeps the map");
        o.laid_out(0, 8);
        assert_eq!((o.offer_for(0), o.offer_for(2)), (Some(9), None));
    }

    /// A PUT takes the newest credit its frames fit, not the oldest.
    #[test]
    fn a_put_takes_the_newest_credit_it_fits() {
        let credit = |id, len| Credit {
            id,
            block: RemoteDesc::new(7, id << 22, len),
        };
        let held = [credit(1, 4 << 20), credit(2, 4 << 20), credit(3, 1 << 20)];
        assert_eq!(newest_fitting(&held, 2 << 20), Some(1));
        assert_eq!(newest_fitting(&held, 1 << 20), Some(2));
        assert_eq!(newest_fitting(&held, 8 << 20), None);
        assert_eq!(newest_fitting(&[], 1), None);
    }

    /// An answer is expected after the median of the last [`TIMED`] of its shape, a quarter
    /// above: one slow answer does not move it, older times age out, and shapes past
    /// [`SHAPES`] start the map over.
    #[test]
    fn answers_are_expected_after_the_median_of_their_shape() {
        let us = Duration::from_micros;
        let mut t = Timings::default();
        assert_eq!(t.expected(1), None);
        t.answered(1, us(200));
        assert_eq!(t.expected(1), Some(us(250)));
        t.answered(1, us(100_000));
        t.answered(1, us(200));
        assert_eq!(t.expected(1), Some(us(250)), "one slow answer");
        for _ in 0..TIMED {
            t.answered(1, us(400));
        }
        assert_eq!(t.expected(1), Some(us(500)));
        for key in 2..=SHAPES as u64 + 1 {
            t.answered(key, us(8));
        }
        assert_eq!(t.expected(1), None);
        assert_eq!(t.expected(SHAPES as u64 + 1), Some(us(10)));
    }

    /// A caller that worked after sending (a credited PUT's copy) and waits from now: its
    /// answer's time counts from now, and the poller expects it the learned time from now,
    /// not from the request (which put it past the poller's bound: not polled for).
    #[test]
    fn an_answer_waited_for_after_the_copy_is_timed_and_expected_from_then() {
        let us = Duration::from_micros;
        let poll = BusyPoll::expecting(us(50), us(500)).unwrap();
        let waiters: Waiters = Arc::new(Mutex::new(Pending {
            poll: Some(poll.clone()),
            ..Pending::default()
        }));
        let key = 7;
        let sent = Instant::now() - Duration::from_millis(2);
        let (tx, rx) = oneshot::channel();
        {
            let mut w = waiters.lock();
            w.timings.answered(key, us(100));
            w.map.insert(
                1,
                Waiter {
                    tx,
                    from_thread: false,
                    ahead: None,
                    timed: Some((key, sent)),
                    here: false,
                },
            );
        }
        let (sock, _unit) = std::os::unix::net::UnixStream::pair().unwrap();
        let replies = Replies {
            waiters: waiters.clone(),
            inbox: Arc::new(Inbox::over(0, sock).unwrap()),
            flying: Arc::default(),
            here: false,
        };
        let answer = Answer {
            unit: 0,
            id: 1,
            rx,
            sent: None,
            ahead: None,
            replies: &replies,
            timeout: Duration::from_secs(1),
            _polled: None,
            _flying: replies.flying.one(),
        };
        let before = Instant::now();
        answer.waiting_from_now();
        let after = Instant::now();
        let (_, from) = waiters.lock().map[&1].timed.unwrap();
        assert!(
            from >= before && from <= after,
            "timed from the request still"
        );
        let expected = poll.expected().expect("expected from now");
        assert!(expected >= before + us(125) && expected <= after + us(125));
    }

    /// A caller waits on the socket only from a thread that has nothing else to run: the
    /// `block_on` of a multi-threaded runtime, not a task nor a current-thread runtime's
    /// `block_on` (which runs the tasks, an in-process unit's too).
    #[test]
    fn only_a_multi_threaded_runtimes_block_on_waits_on_the_socket() {
        assert!(!waits_on_a_thread(), "outside any runtime");
        let multi = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .unwrap();
        assert!(multi.block_on(async { waits_on_a_thread() }));
        let in_task = multi.block_on(async { tokio::spawn(async { waits_on_a_thread() }).await });
        assert!(!in_task.unwrap(), "in a task");
        let current = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        assert!(!current.block_on(async { waits_on_a_thread() }));
    }

    /// Requests of one kind, fields, count and (for a credited PUT) payload size class share
    /// a shape; anything else tells them apart, and requests that carry no shape have none.
    #[test]
    fn answer_times_are_learned_per_request_shape() {
        let desc = RemoteDesc::new(0, 0, 0);
        let put = |indexes: Vec<u64>, field: &str, bytes| Request::PutCredited {
            partition: "p".into(),
            indexes,
            fields: vec![field.into()],
            meta: ByteBuf::new(),
            credit: 0,
            bytes,
        };
        let get = |indexes: Vec<u64>| Request::GetOffer {
            partition: "p".into(),
            indexes,
            fields: vec!["x".into()],
            block: desc,
        };
        let key = |r: &Request| timing_key(r).unwrap();
        assert_eq!(
            key(&put(vec![1, 2], "x", 4096)),
            key(&put(vec![7, 8], "x", 8000))
        );
        assert_ne!(
            key(&put(vec![1, 2], "x", 4096)),
            key(&put(vec![1, 2], "x", 8192))
        );
        assert_ne!(
            key(&put(vec![1, 2], "x", 4096)),
            key(&put(vec![1], "x", 4096))
        );
        assert_ne!(
            key(&put(vec![1, 2], "x", 4096)),
            key(&put(vec![1, 2], "y", 4096))
        );
        assert_ne!(key(&put(vec![1, 2], "x", 0)), key(&get(vec![1, 2])));
        assert_eq!(key(&get(vec![1, 2])), key(&get(vec![3, 4])));
        assert_eq!(timing_key(&Request::Commit { put: 1 }), None);
        assert_eq!(timing_key(&Request::Stats), None);
    }
}
