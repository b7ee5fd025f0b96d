//! The unit's protocol core: a deterministic state machine with no I/O (quinn-proto style).
//!
//! The driver feeds it requests ([`Unit::handle`]), transfer completions
//! ([`Unit::transfer_done`], [`Unit::read_done`]) and the clock ([`Unit::handle_timeout`]); it
//! answers with [`Output`]s that the driver carries out: replies to send, WRITEs and READs to
//! post, sessions to accept or close.
//!
//! A PUT's payload arrives in one of two ways, chosen by the payload backend
//! ([`Unit::set_pull_puts`]): pushed, the client WRITEs into a block the unit leased and
//! exposed (`PutReady`), then COMMITs; pulled (the one-sided engines), the PUT names the
//! client's frames and the unit READs them into the block it leased, so the unit is always
//! the initiator of the transfer and a client that dies mid-transfer only fails the READ. Memory comes from a [`Memory`] the driver supplies, so tests run it over plain
//! vectors.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;
use tessera_framecodec::{decode, Decoder, Encoder, Limits, RecvLayout, Value};
use tessera_transport::RemoteDesc;

use crate::error::{ErrorKind, RemoteError};
use crate::proto::{frame_descs, Request, Response};

/// Identifies a control connection (a session). A client that reconnects is a new session.
pub type SessionId = u64;

/// Where receive blocks come from: a registered pool in the server, vectors in tests.
pub trait Memory {
    /// A leased block; dropping it returns its range.
    type Block: Send + Sync + 'static;
    /// Leases `size` bytes aligned to `align`.
    fn lease(&mut self, size: u64, align: u64) -> Result<Self::Block, String>;
    /// Where a READ into a block lands (a local descriptor in the server).
    type Dest: Send + 'static;
    /// A descriptor a peer can WRITE to: `len` bytes at `offset` of `block`.
    fn remote(&self, block: &Self::Block, offset: u64, len: u64) -> Result<RemoteDesc, String>;
    /// A destination for a READ of `len` bytes into `block` at `offset`. It may keep the
    /// block's memory alive while the READ is in flight.
    fn dest(&self, block: &Self::Block, offset: u64, len: u64) -> Result<Self::Dest, String>;
    /// The block's first `len` bytes as `Bytes` that own the block (no copy).
    fn freeze(&self, block: Self::Block, len: u64) -> Bytes;
    /// Length of a block.
    fn block_len(block: &Self::Block) -> u64;
    /// Copies `data` into a fresh block and returns it frozen (used by compaction only).
    fn copy_in(&mut self, data: &[u8], align: u64) -> Result<Bytes, String>;
    /// Pool usage.
    fn usage(&self) -> PoolStats;
    /// Gives back registered memory that is idle beyond the configured limit; returns the
    /// bytes given back. Memory that never shrinks keeps the default.
    fn trim(&mut self) -> u64 {
        0
    }
}

/// Configuration of the protocol core.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UnitConfig {
    /// Logical bytes the unit stores at most (payloads, strings and 8 bytes per scalar).
    pub capacity_bytes: u64,
    /// Payloads up to this many bytes travel inline in control messages.
    pub inline_max: u64,
    /// Alignment of frames in receive blocks.
    pub align: u64,
    /// Indexes times fields in one request, at most.
    pub max_keys: u64,
    /// Payload bytes of one PUT or GET, at most.
    pub max_payload_bytes: u64,
    /// Bytes of one meta frame, at most.
    pub max_meta_bytes: u64,
    /// Bytes of registered memory leased to prepared PUTs, at most.
    pub leased_limit: u64,
    /// Bytes of quarantined registered memory, at most; PUTs are refused beyond it.
    pub quarantine_limit: u64,
    /// A prepared PUT or GET that sees no COMMIT within this time expires.
    #[serde(with = "millis")]
    pub prepare_ttl: Duration,
    /// How long the exposed blocks of a closed session stay quarantined when the payload
    /// engine cannot tell when the client's link is torn down (`ucx`, `nixl`, `inproc`: a
    /// one-sided WRITE leaves no trace at the target). Engines that can tell (`tcp`, `shm`)
    /// hold them until the link is gone instead, however long that takes.
    #[serde(with = "millis")]
    pub late_write_grace: Duration,
    /// Compact a receive block when this fraction of it is dead (0 disables compaction).
    pub compact_dead_fraction: f64,
    /// Shared secret a Hello must carry.
    pub token: Option<String>,
}

mod millis {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;
    pub(super) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_millis() as u64)
    }
    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_millis(u64::deserialize(d)?))
    }
}

impl Default for UnitConfig {
    fn default() -> Self {
        Self {
            capacity_bytes: 1 << 30,
            inline_max: 64 << 10,
            align: 64,
            max_keys: 1 << 20,
            max_payload_bytes: 16 << 30,
            max_meta_bytes: 64 << 20,
            leased_limit: 16 << 30,
            quarantine_limit: 1 << 30,
            prepare_ttl: Duration::from_secs(30),
            late_write_grace: Duration::from_secs(30),
            compact_dead_fraction: 0.75,
            token: None,
        }
    }
}

/// What the driver must do. `D` is the memory's READ destination ([`Memory::Dest`]).
#[derive(Debug)]
pub enum Output<D = RemoteDesc> {
    /// Send `response` to `session` for request `id`.
    Reply {
        /// Session.
        session: SessionId,
        /// Request id.
        id: u64,
        /// The response.
        response: Response,
    },
    /// The session said a valid Hello: connect to its agent, then answer `Welcome`.
    Accept {
        /// Session.
        session: SessionId,
        /// Request id of the Hello.
        id: u64,
        /// The client's agent metadata.
        agent: Vec<u8>,
    },
    /// WRITE `frames[i]` to `descs[i]` on the session's peer, then call `transfer_done`.
    Write {
        /// Session.
        session: SessionId,
        /// Request id of the `GetInto` to answer.
        id: u64,
        /// Request id of the GET.
        get: u64,
        /// The stored frames.
        frames: Vec<Bytes>,
        /// The client's descriptors.
        descs: Vec<RemoteDesc>,
    },
    /// READ `srcs[i]` from the session's peer into `dests[i]` (a pulled PUT), then call
    /// [`Unit::read_done`] (or [`Unit::read_refused`] when it cannot be queued).
    Read {
        /// Session.
        session: SessionId,
        /// Request id of the PUT, to answer.
        put: u64,
        /// Destinations in the block leased for the PUT.
        dests: Vec<D>,
        /// The client's descriptors, pairwise the same lengths.
        srcs: Vec<RemoteDesc>,
        /// The client's agent metadata, to add before reading.
        agent: Vec<u8>,
    },
    /// Close the session's connection (after sending any reply before it).
    Close {
        /// Session.
        session: SessionId,
    },
}

/// Pool usage: the registered memory that payloads land in. Idle registered memory is
/// `capacity - used`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolStats {
    /// Registered bytes.
    pub capacity: u64,
    /// Bytes leased.
    pub used: u64,
    /// Largest free range.
    pub largest_free: u64,
    /// Live blocks.
    pub live_blocks: u64,
    /// Registered bytes at most (0: not reported).
    #[serde(default)]
    pub limit: u64,
    /// Idle registered bytes kept at most; entirely free chunks beyond it are deregistered
    /// (0: not reported).
    #[serde(default)]
    pub idle_limit: u64,
    /// Registered chunks.
    #[serde(default)]
    pub chunks: u64,
}

/// Per-partition statistics.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionStats {
    /// Partition name.
    pub name: String,
    /// Stored (field, index) keys.
    pub keys: u64,
    /// Stored logical bytes.
    pub bytes: u64,
    /// Bytes of receive blocks leased to prepared PUTs of this partition.
    pub leased_bytes: u64,
    /// Bytes of this partition's receive blocks in quarantine.
    pub quarantined_bytes: u64,
}

/// Statistics of a unit.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// Per partition, by name.
    pub partitions: Vec<PartitionStats>,
    /// Stored keys.
    pub keys: u64,
    /// Stored logical bytes.
    pub bytes: u64,
    /// Configured capacity in logical bytes.
    pub capacity_bytes: u64,
    /// Registered pool usage.
    pub pool: PoolStats,
    /// Bytes leased to prepared PUTs.
    pub leased_bytes: u64,
    /// Bytes quarantined.
    pub quarantined_bytes: u64,
    /// Prepared PUTs waiting for COMMIT.
    pub pending_puts: u64,
    /// GETs waiting for the client's block or their WRITE.
    pub pending_gets: u64,
    /// Bytes copied by compaction since start.
    pub compacted_bytes: u64,
    /// Payload bytes received through the payload plane.
    pub bytes_in: u64,
    /// Payload bytes sent through the payload plane.
    pub bytes_out: u64,
    /// Open sessions.
    pub sessions: u64,
}

struct Entry {
    value: Value,
    bytes: u64,
    /// The receive block this value pins, if any.
    block: Option<u64>,
}

#[derive(Default)]
struct Partition {
    fields: HashMap<String, HashMap<u64, Entry>>,
    keys: u64,
    bytes: u64,
}

struct BlockInfo {
    size: u64,
    live: u64,
    partition: String,
}

#[derive(PartialEq, Eq)]
enum SessionState {
    New,
    Open,
    Failed,
}

/// A quarantined block: the block (kept only so that it is not reused), its length and its
/// partition.
type Quarantined = (Box<dyn Send + Sync>, u64, String);

struct Session {
    state: SessionState,
    /// Blocks that a late WRITE could still reach, until the session is torn down.
    quarantine: Vec<Quarantined>,
}

/// How the driver learns that the client of a closed session can no longer write into the
/// blocks it was shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TornDown {
    /// The payload engine tells: the driver calls [`Unit::release_closed`] once it does.
    Signalled,
    /// The engine cannot tell: the blocks are released `late_write_grace` after the close.
    Grace,
}

/// What a closed session exposed, quarantined until its client's transfers are torn down.
struct Closed {
    quarantine: Vec<Quarantined>,
    deadline: Option<Instant>,
}

struct PendingPut {
    partition: String,
    indexes: Vec<u64>,
    fields: Vec<String>,
    /// The receive block, frozen at PREPARE before it was exposed: `value`'s views are
    /// slices of it, and the block goes back to the pool once both are gone.
    buf: Bytes,
    /// The PUT's value, decoded at PREPARE (the meta needs no payload byte), so a COMMIT only
    /// stores it. Its views are not read before the payload landed (COMMIT, or the READ done).
    value: Value,
    /// Bytes of the leased block (`M::block_len`).
    block_len: u64,
    /// Bytes of the block the frames occupy.
    size: u64,
    reserved: u64,
    deadline: Instant,
    /// A pulled PUT whose READ is queued or in flight: it waits for `read_done`, not for a
    /// COMMIT, and its deadline is the driver's transfer timeout.
    reading: bool,
}

/// The fields of a PUT request.
struct PutRequest {
    partition: String,
    indexes: Vec<u64>,
    fields: Vec<String>,
    meta: ByteBuf,
    inline: Option<Vec<ByteBuf>>,
    pull: Option<crate::proto::PullSource>,
}

/// What a PUT leads to: an answer, or a READ of its payload first.
enum PutNext<D> {
    Reply(Response),
    Read(Output<D>),
}

struct PendingGet {
    frames: Vec<Bytes>,
    /// Where the client's block takes them: the layout of the meta sent with `GetReady`.
    layout: RecvLayout,
    writing: bool,
    deadline: Instant,
}

/// The unit's state machine.
pub struct Unit<M: Memory> {
    cfg: UnitConfig,
    mem: M,
    decoder: Decoder,
    partitions: BTreeMap<String, Partition>,
    blocks: HashMap<u64, BlockInfo>,
    next_block: u64,
    used: u64,
    reserved: u64,
    leased: u64,
    quarantined: u64,
    compacted: u64,
    bytes_in: u64,
    bytes_out: u64,
    sessions: HashMap<SessionId, Session>,
    closed: HashMap<SessionId, Closed>,
    puts: HashMap<(SessionId, u64), PendingPut>,
    gets: HashMap<(SessionId, u64), PendingGet>,
    /// PUT payloads are pulled (READ by the unit) instead of pushed.
    pull_puts: bool,
}

fn err(kind: ErrorKind, message: impl Into<String>) -> RemoteError {
    RemoteError {
        kind,
        message: message.into(),
        missing: Vec::new(),
    }
}

/// Logical size of a value: payload bytes, string bytes and 8 bytes per scalar.
pub fn logical_bytes(v: &Value) -> u64 {
    match v {
        Value::Null | Value::Bool(_) | Value::I64(_) | Value::U64(_) | Value::F64(_) => 8,
        Value::Str(s) => s.len() as u64,
        Value::Bytes(b) => b.len() as u64,
        Value::Tensor(t) => t.data().len() as u64,
        Value::List(items) => items.iter().map(logical_bytes).sum(),
        Value::Map(items) => items
            .iter()
            .map(|(k, v)| k.len() as u64 + logical_bytes(v))
            .sum(),
    }
}

impl<M: Memory> Unit<M> {
    /// A unit with `cfg`, leasing from `mem`.
    pub fn new(cfg: UnitConfig, mem: M) -> Self {
        let mut limits = Limits::default();
        limits.max_total_bytes = cfg.max_payload_bytes;
        limits.max_meta_bytes = cfg.max_meta_bytes;
        Self {
            decoder: Decoder::with_limits(limits),
            cfg,
            mem,
            partitions: BTreeMap::new(),
            blocks: HashMap::new(),
            next_block: 0,
            used: 0,
            reserved: 0,
            leased: 0,
            quarantined: 0,
            compacted: 0,
            bytes_in: 0,
            bytes_out: 0,
            sessions: HashMap::new(),
            closed: HashMap::new(),
            puts: HashMap::new(),
            gets: HashMap::new(),
            pull_puts: false,
        }
    }

    /// Whether PUT payloads that do not travel inline are pulled (the client names its frames
    /// and the unit READs them) or pushed (the unit exposes a block, the client WRITEs and
    /// COMMITs). The driver sets it from its backend; a PUT asking for the other mode is
    /// refused.
    pub fn set_pull_puts(&mut self, pull: bool) {
        self.pull_puts = pull;
    }

    /// The configuration.
    pub fn config(&self) -> &UnitConfig {
        &self.cfg
    }

    /// Gives back idle registered memory beyond its limit ([`Memory::trim`]); the driver
    /// calls it after requests and on its timer. Returns the bytes given back.
    pub fn trim_memory(&mut self) -> u64 {
        self.mem.trim()
    }

    /// A new connection arrived as `session`; it must say Hello first.
    pub fn open_session(&mut self, session: SessionId) {
        self.sessions.insert(
            session,
            Session {
                state: SessionState::New,
                quarantine: Vec::new(),
            },
        );
    }

    /// The driver connected to the session's agent; it may now use the payload plane.
    pub fn session_ready(&mut self, session: SessionId) {
        if let Some(s) = self.sessions.get_mut(&session) {
            if s.state == SessionState::New {
                s.state = SessionState::Open;
            }
        }
    }

    /// Marks a session failed: every later request is refused until it reconnects.
    pub fn fail_session(&mut self, session: SessionId) {
        if let Some(s) = self.sessions.get_mut(&session) {
            s.state = SessionState::Failed;
        }
    }

    /// The session's control connection is gone. Its pending GETs are dropped, and its pulled
    /// PUTs still being read released (their blocks were never exposed). Its prepared pushed
    /// PUTs (each answered READY: their blocks were exposed) and its quarantine stay
    /// quarantined, since the client's WRITEs travel on the payload plane and may still land:
    /// until [`Unit::release_closed`] when `how` is [`TornDown::Signalled`], or until
    /// `late_write_grace` from `now` ([`Unit::handle_timeout`]) when it is [`TornDown::Grace`].
    pub fn close_session(&mut self, session: SessionId, now: Instant, how: TornDown) {
        let puts: Vec<_> = self
            .puts
            .keys()
            .filter(|(s, _)| *s == session)
            .copied()
            .collect();
        self.gets.retain(|(s, _), _| *s != session);
        let mut quarantine = self
            .sessions
            .remove(&session)
            .map(|s| s.quarantine)
            .unwrap_or_default();
        // Every pushed PUT was answered READY in the step that prepared it: all exposed. A
        // pulled PUT's block was never shown to the client; its READ (if in flight) keeps the
        // block's memory itself, so the core releases it.
        for key in puts {
            if let Some(p) = self.puts.remove(&key) {
                if p.reading {
                    self.release_put(p);
                    continue;
                }
                let len = p.block_len;
                self.leased -= len;
                self.reserved -= p.reserved;
                self.quarantined += len;
                quarantine.push((Box::new((p.buf, p.value)), len, p.partition));
            }
        }
        if quarantine.is_empty() {
            return;
        }
        let deadline = match how {
            TornDown::Signalled => None,
            TornDown::Grace => Some(now + self.cfg.late_write_grace),
        };
        tracing::debug!(
            session,
            blocks = quarantine.len(),
            ?how,
            "closed session's exposed blocks stay quarantined"
        );
        self.closed.insert(
            session,
            Closed {
                quarantine,
                deadline,
            },
        );
    }

    /// Closed sessions whose exposed blocks are still quarantined.
    pub fn closed_sessions(&self) -> Vec<SessionId> {
        self.closed.keys().copied().collect()
    }

    /// The client of closed session `session` can no longer write (its link is torn down):
    /// its quarantined blocks go back to the pool. Returns the bytes released.
    pub fn release_closed(&mut self, session: SessionId) -> u64 {
        let Some(c) = self.closed.remove(&session) else {
            return 0;
        };
        let bytes: u64 = c.quarantine.iter().map(|q| q.1).sum();
        self.quarantined -= bytes;
        bytes
    }

    fn release_put(&mut self, p: PendingPut) {
        self.leased -= p.block_len;
        self.reserved -= p.reserved;
    }

    fn quarantine_put(&mut self, session: SessionId, p: PendingPut) {
        let len = p.block_len;
        self.leased -= len;
        self.reserved -= p.reserved;
        self.quarantined += len;
        if let Some(s) = self.sessions.get_mut(&session) {
            s.quarantine
                .push((Box::new((p.buf, p.value)), len, p.partition));
        } else {
            self.quarantined -= len;
        }
    }

    /// The earliest deadline of a prepared transfer.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let puts = self
            .puts
            .values()
            .filter(|p| !p.reading)
            .map(|p| p.deadline);
        let gets = self
            .gets
            .values()
            .filter(|g| !g.writing)
            .map(|g| g.deadline);
        let closed = self.closed.values().filter_map(|c| c.deadline);
        puts.chain(gets).chain(closed).min()
    }

    /// Expires prepared transfers whose deadline passed. A PUT whose block was exposed is
    /// quarantined and its session failed (a WRITE may still land); an expired GET that was
    /// never written just drops its frames. A pulled PUT whose READ is queued or in flight
    /// does not expire here: the driver's transfer timeout ends it through `read_done`.
    pub fn handle_timeout(&mut self, now: Instant) -> Vec<Output<M::Dest>> {
        let expired: Vec<_> = self
            .puts
            .iter()
            .filter(|(_, p)| !p.reading && p.deadline <= now)
            .map(|(k, _)| *k)
            .collect();
        let mut out = Vec::new();
        for key in expired {
            if let Some(p) = self.puts.remove(&key) {
                tracing::warn!(
                    session = key.0,
                    id = key.1,
                    "prepared PUT expired; quarantined"
                );
                self.quarantine_put(key.0, p);
                self.fail_session(key.0);
                out.push(Output::Reply {
                    session: key.0,
                    id: key.1,
                    response: Response::error(ErrorKind::PeerFailed, "prepared PUT expired"),
                });
            }
        }
        self.gets.retain(|_, g| g.writing || g.deadline > now);
        let graced: Vec<_> = self
            .closed
            .iter()
            .filter(|(_, c)| c.deadline.is_some_and(|d| d <= now))
            .map(|(s, _)| *s)
            .collect();
        for session in graced {
            let bytes = self.release_closed(session);
            tracing::debug!(session, bytes, "late-write grace over; quarantine released");
        }
        out
    }

    /// A WRITE posted for `Output::Write` finished.
    pub fn transfer_done(
        &mut self,
        session: SessionId,
        get: u64,
        id: u64,
        result: Result<(), String>,
    ) -> Vec<Output<M::Dest>> {
        let Some(get) = self.gets.remove(&(session, get)) else {
            return Vec::new();
        };
        let response = match result {
            Ok(()) => {
                self.bytes_out += get.frames.iter().map(|f| f.len() as u64).sum::<u64>();
                Response::GetDone
            }
            Err(e) => {
                // The client's block may hold part of the payload: outcome unknown.
                self.fail_session(session);
                Response::error(ErrorKind::Transfer, e)
            }
        };
        vec![Output::Reply {
            session,
            id,
            response,
        }]
    }

    /// The driver could not queue the WRITE of an `Output::Write` (its transfer queue for the
    /// session is full): nothing was written, so the GET is dropped and request `id` answered
    /// with [`ErrorKind::Busy`]; the client may GET again.
    pub fn transfer_refused(
        &mut self,
        session: SessionId,
        get: u64,
        id: u64,
        reason: &str,
    ) -> Vec<Output<M::Dest>> {
        self.gets.remove(&(session, get));
        vec![Output::Reply {
            session,
            id,
            response: Response::error(ErrorKind::Busy, reason),
        }]
    }

    /// The READ posted for `Output::Read` of PUT `put` finished. On success the values are
    /// stored as a COMMIT stores them and the PUT answered; on failure (or the driver's
    /// timeout) the block may still be written by the READ, so it stays quarantined until the
    /// session is torn down, and the session fails. A PUT the session no longer holds (it was
    /// closed meanwhile) is ignored.
    pub fn read_done(
        &mut self,
        session: SessionId,
        put: u64,
        result: Result<(), String>,
    ) -> Vec<Output<M::Dest>> {
        if !self.puts.get(&(session, put)).is_some_and(|p| p.reading) {
            return Vec::new();
        }
        let Some(p) = self.puts.remove(&(session, put)) else {
            return Vec::new();
        };
        let response = match result {
            Ok(()) => self.store_put(p).unwrap_or_else(Response::Error),
            Err(e) => {
                tracing::warn!(session, put, error = %e, "PUT READ failed; block quarantined");
                self.quarantine_put(session, p);
                self.fail_session(session);
                Response::error(ErrorKind::Transfer, e)
            }
        };
        vec![Output::Reply {
            session,
            id: put,
            response,
        }]
    }

    /// The driver could not queue the READ of an `Output::Read` (the session's transfer queue
    /// is full, or it has no executor): nothing was read, so the block is freed and the PUT
    /// answered with `kind` ([`ErrorKind::Busy`] when the client may retry).
    pub fn read_refused(
        &mut self,
        session: SessionId,
        put: u64,
        kind: ErrorKind,
        reason: &str,
    ) -> Vec<Output<M::Dest>> {
        if !self.puts.get(&(session, put)).is_some_and(|p| p.reading) {
            return Vec::new();
        }
        if let Some(p) = self.puts.remove(&(session, put)) {
            self.release_put(p);
        }
        vec![Output::Reply {
            session,
            id: put,
            response: Response::error(kind, reason),
        }]
    }

    /// Handles one request of `session`.
    pub fn handle(
        &mut self,
        now: Instant,
        session: SessionId,
        id: u64,
        req: Request,
    ) -> Vec<Output<M::Dest>> {
        let reply = |response| Output::Reply {
            session,
            id,
            response,
        };
        let state = match self.sessions.get(&session) {
            Some(s) => &s.state,
            None => {
                return vec![reply(Response::error(
                    ErrorKind::NoSession,
                    "unknown session",
                ))]
            }
        };
        match (&req, state) {
            (Request::Hello { .. }, SessionState::New) => {}
            (Request::Hello { .. }, _) => {
                return vec![reply(Response::error(
                    ErrorKind::BadRequest,
                    "second Hello",
                ))]
            }
            (_, SessionState::New) => {
                return vec![reply(Response::error(
                    ErrorKind::NoSession,
                    "say Hello first",
                ))]
            }
            (_, SessionState::Failed) => {
                return vec![reply(Response::error(
                    ErrorKind::PeerFailed,
                    "session failed; reconnect",
                ))]
            }
            (_, SessionState::Open) => {}
        }
        let result = match req {
            Request::Hello { token, agent } => {
                if self.cfg.token.is_some() && token != self.cfg.token {
                    return vec![
                        reply(Response::error(ErrorKind::Unauthorized, "bad token")),
                        Output::Close { session },
                    ];
                }
                return vec![Output::Accept { session, id, agent }];
            }
            Request::Put {
                partition,
                indexes,
                fields,
                meta,
                inline,
                pull,
            } => {
                let put = PutRequest {
                    partition,
                    indexes,
                    fields,
                    meta,
                    inline,
                    pull,
                };
                match self.put(now, session, id, put) {
                    Ok(PutNext::Reply(r)) => Ok(r),
                    Ok(PutNext::Read(o)) => return vec![o],
                    Err(e) => Err(e),
                }
            }
            Request::Commit { put } => self.commit(session, put),
            Request::Cancel { of, .. }
                if self.puts.get(&(session, of)).is_some_and(|p| p.reading) =>
            {
                Err(err(
                    ErrorKind::BadRequest,
                    format!("PUT {of} is being read by the unit; it cannot be cancelled"),
                ))
            }
            Request::Cancel { of, maybe_written } => {
                if let Some(p) = self.puts.remove(&(session, of)) {
                    if maybe_written {
                        self.quarantine_put(session, p);
                    } else {
                        self.release_put(p);
                    }
                    Ok(Response::Done)
                } else if self.gets.get(&(session, of)).is_some_and(|g| !g.writing) {
                    self.gets.remove(&(session, of));
                    Ok(Response::Done)
                } else {
                    Err(err(
                        ErrorKind::UnknownTransfer,
                        format!("nothing prepared as {of}"),
                    ))
                }
            }
            Request::Get {
                partition,
                indexes,
                fields,
            } => self.get(now, session, id, &partition, &indexes, &fields),
            Request::GetInto { get, block } => return self.get_into(session, id, get, block),
            Request::Clear {
                partition,
                indexes,
                fields,
            } => self.clear(&partition, &indexes, fields.as_deref()),
            Request::DropPartition { partition } => {
                if let Some(p) = self.partitions.remove(&partition) {
                    for (_, entries) in p.fields {
                        for (_, e) in entries {
                            self.forget(e);
                        }
                    }
                }
                Ok(Response::Done)
            }
            Request::Stats => Ok(Response::Stats(self.stats())),
        };
        vec![reply(result.unwrap_or_else(Response::Error))]
    }

    fn check_keys(&self, indexes: &[u64], fields: &[String]) -> Result<(), RemoteError> {
        if fields.is_empty() {
            return Err(err(ErrorKind::BadRequest, "no fields"));
        }
        let keys = (indexes.len() as u64).saturating_mul(fields.len() as u64);
        if keys > self.cfg.max_keys {
            return Err(err(
                ErrorKind::TooLarge,
                format!("{keys} keys exceed the maximum of {}", self.cfg.max_keys),
            ));
        }
        let mut seen = HashSet::with_capacity(indexes.len());
        if indexes.iter().any(|i| !seen.insert(*i)) {
            return Err(err(ErrorKind::BadRequest, "duplicate index"));
        }
        let mut seen = HashSet::with_capacity(fields.len());
        if fields.iter().any(|f| !seen.insert(f.as_str())) {
            return Err(err(ErrorKind::BadRequest, "duplicate field"));
        }
        Ok(())
    }

    fn replaced_bytes(&self, partition: &str, indexes: &[u64], fields: &[String]) -> u64 {
        let Some(p) = self.partitions.get(partition) else {
            return 0;
        };
        fields
            .iter()
            .filter_map(|f| p.fields.get(f))
            .flat_map(|m| indexes.iter().filter_map(|i| m.get(i)))
            .map(|e| e.bytes)
            .sum()
    }

    fn put(
        &mut self,
        now: Instant,
        session: SessionId,
        id: u64,
        put: PutRequest,
    ) -> Result<PutNext<M::Dest>, RemoteError> {
        let PutRequest {
            partition,
            indexes,
            fields,
            meta,
            inline,
            pull,
        } = put;
        self.check_keys(&indexes, &fields)?;
        if inline.is_some() && pull.is_some() {
            return Err(err(
                ErrorKind::BadRequest,
                "a PUT is either inline or pulled, not both",
            ));
        }
        let table = self.decoder.frame_table(&meta).map_err(|e| {
            let kind = if e.to_string().contains("limit") {
                ErrorKind::TooLarge
            } else {
                ErrorKind::Protocol
            };
            err(kind, format!("meta frame: {e}"))
        })?;
        let layout = table
            .layout(self.cfg.align)
            .map_err(|e| err(ErrorKind::Protocol, format!("layout: {e}")))?;
        // Reserve the whole block: the stored values are never larger than it, plus scalars.
        let incoming = layout.size + meta.len() as u64;
        let credit = self.replaced_bytes(&partition, &indexes, &fields);
        let need = (self.used + self.reserved + incoming).saturating_sub(credit);
        if need > self.cfg.capacity_bytes {
            return Err(err(
                ErrorKind::Capacity,
                format!(
                    "PUT of {incoming} bytes exceeds capacity: {} of {} bytes stored, {} reserved",
                    self.used, self.cfg.capacity_bytes, self.reserved
                ),
            ));
        }
        let meta = Bytes::from(meta.into_vec());
        if let Some(frames) = inline {
            if table.total_bytes() > self.cfg.inline_max {
                return Err(err(ErrorKind::TooLarge, "inline payload above inline_max"));
            }
            let frames: Vec<Bytes> = frames
                .into_iter()
                .map(|f| Bytes::from(f.into_vec()))
                .collect();
            let value = self
                .decoder
                .decode(&meta, &frames)
                .map_err(|e| err(ErrorKind::Protocol, format!("decode: {e}")))?;
            self.store(&partition, &indexes, &fields, value, None)?;
            return Ok(PutNext::Reply(Response::Done));
        }
        if layout.size == 0 {
            let value = self
                .decoder
                .decode(&meta, &[])
                .map_err(|e| err(ErrorKind::Protocol, format!("decode: {e}")))?;
            self.store(&partition, &indexes, &fields, value, None)?;
            return Ok(PutNext::Reply(Response::Done));
        }
        match (&pull, self.pull_puts) {
            (None, true) => {
                return Err(err(
                    ErrorKind::BadRequest,
                    "this unit's backend pulls PUT payloads: the PUT must name its frames",
                ))
            }
            (Some(_), false) => {
                return Err(err(
                    ErrorKind::BadRequest,
                    "this unit's backend does not pull PUT payloads: ask for a receive block",
                ))
            }
            _ => {}
        }
        if let Some(src) = &pull {
            let matches = src.descs.len() == layout.lens.len()
                && src.descs.iter().zip(&layout.lens).all(|(d, l)| d.len == *l);
            if !matches {
                return Err(err(
                    ErrorKind::BadRequest,
                    "source descriptors do not match the frames",
                ));
            }
        }
        if self.puts.contains_key(&(session, id)) {
            return Err(err(ErrorKind::BadRequest, "request id already prepared"));
        }
        if self.quarantined > self.cfg.quarantine_limit {
            return Err(err(ErrorKind::OutOfMemory, "quarantine limit reached"));
        }
        if self.leased + layout.size > self.cfg.leased_limit {
            return Err(err(
                ErrorKind::OutOfMemory,
                format!(
                    "leased limit: {} of {} bytes leased, {} asked",
                    self.leased, self.cfg.leased_limit, layout.size
                ),
            ));
        }
        let block = self
            .mem
            .lease(layout.size, layout.align)
            .map_err(|e| err(ErrorKind::OutOfMemory, e))?;
        let mut dests = Vec::new();
        let mut srcs = Vec::new();
        if let Some(src) = &pull {
            for (k, (off, len)) in layout.offsets.iter().zip(&layout.lens).enumerate() {
                if *len > 0 {
                    dests.push(
                        self.mem
                            .dest(&block, *off, *len)
                            .map_err(|e| err(ErrorKind::OutOfMemory, e))?,
                    );
                    srcs.push(src.descs[k]);
                }
            }
        }
        let reading = pull.is_some();
        let next = match pull {
            Some(src) => PutNext::Read(Output::Read {
                session,
                put: id,
                dests,
                srcs,
                agent: src.agent.into_vec(),
            }),
            // Pushed: the client lays the frames out in the block as this unit did.
            None => PutNext::Reply(Response::PutReady {
                block: self
                    .mem
                    .remote(&block, 0, layout.size)
                    .map_err(|e| err(ErrorKind::OutOfMemory, e))?,
                agent: None,
            }),
        };
        // Described for the transfer, then frozen and decoded: all before the block is
        // exposed (READY sent, READ posted). A meta that does not decode is refused here,
        // before anything moves, and the block (with the READ's descriptors) goes straight
        // back.
        let block_len = M::block_len(&block);
        let buf = self.mem.freeze(block, layout.size);
        let value = self
            .decoder
            .decode_contiguous(&meta, &buf, layout.align)
            .map_err(|e| err(ErrorKind::Protocol, format!("decode: {e}")))?;
        self.leased += block_len;
        self.reserved += incoming;
        self.puts.insert(
            (session, id),
            PendingPut {
                partition,
                indexes,
                fields,
                buf,
                value,
                block_len,
                size: layout.size,
                reserved: incoming,
                deadline: now + self.cfg.prepare_ttl,
                reading,
            },
        );
        Ok(next)
    }

    fn commit(&mut self, session: SessionId, put: u64) -> Result<Response, RemoteError> {
        if self.puts.get(&(session, put)).is_some_and(|p| p.reading) {
            return Err(err(
                ErrorKind::BadRequest,
                format!("PUT {put} is pulled by the unit; there is nothing to commit"),
            ));
        }
        let p = self
            .puts
            .remove(&(session, put))
            .ok_or_else(|| err(ErrorKind::UnknownTransfer, format!("no prepared PUT {put}")))?;
        self.store_put(p)
    }

    /// Stores the values of a PUT whose payload is in its block (committed or read).
    fn store_put(&mut self, p: PendingPut) -> Result<Response, RemoteError> {
        let len = p.block_len;
        self.leased -= len;
        self.reserved -= p.reserved;
        let size = p.size;
        self.bytes_in += size;
        let block_id = self.next_block;
        self.next_block += 1;
        self.blocks.insert(
            block_id,
            BlockInfo {
                size: len,
                live: 0,
                partition: p.partition.clone(),
            },
        );
        let r = self.store(&p.partition, &p.indexes, &p.fields, p.value, Some(block_id));
        if self.blocks.get(&block_id).is_some_and(|b| b.live == 0) {
            self.blocks.remove(&block_id);
        }
        r.map(|()| Response::Done)
    }

    /// Checks the value's shape, then replaces every key at once.
    fn store(
        &mut self,
        partition: &str,
        indexes: &[u64],
        fields: &[String],
        value: Value,
        block: Option<u64>,
    ) -> Result<(), RemoteError> {
        let Value::List(columns) = value else {
            return Err(err(
                ErrorKind::BadRequest,
                "PUT value is not a list of fields",
            ));
        };
        if columns.len() != fields.len() {
            return Err(err(ErrorKind::BadRequest, "one list per field expected"));
        }
        let mut rows = Vec::with_capacity(columns.len());
        for c in columns {
            match c {
                Value::List(items) if items.len() == indexes.len() => rows.push(items),
                _ => {
                    return Err(err(
                        ErrorKind::BadRequest,
                        "each field needs one value per index",
                    ))
                }
            }
        }
        let mut added = 0u64;
        let mut new_keys = 0u64;
        // What the replaced entries accounted for, per block they came from (the values of one
        // earlier PUT share its block, so runs are merged as they come); their values drop as
        // they are replaced.
        let mut old: Vec<(Option<u64>, u64)> = Vec::new();
        let part = self.partitions.entry(partition.to_owned()).or_default();
        for (field, items) in fields.iter().zip(rows) {
            let map = part.fields.entry(field.clone()).or_default();
            for (index, value) in indexes.iter().zip(items) {
                let bytes = logical_bytes(&value);
                added += bytes;
                let entry = Entry {
                    value,
                    bytes,
                    block,
                };
                match map.insert(*index, entry) {
                    Some(prev) => match old.last_mut() {
                        Some((b, sum)) if *b == prev.block => *sum += prev.bytes,
                        _ => old.push((prev.block, prev.bytes)),
                    },
                    None => new_keys += 1,
                }
            }
        }
        part.keys += new_keys;
        part.bytes += added;
        self.used += added;
        if let Some(b) = block.and_then(|b| self.blocks.get_mut(&b)) {
            b.live += added;
        }
        if let Some(p) = self.partitions.get_mut(partition) {
            p.bytes -= old.iter().map(|(_, bytes)| bytes).sum::<u64>();
        }
        // Each block is released by what left it at once, so a block whose dead fraction
        // passes the threshold only because of this PUT is not compacted halfway through.
        for (block, bytes) in old {
            self.release(bytes, block);
        }
        Ok(())
    }

    /// Accounts for an entry leaving the store (its `Value` drops with it).
    fn forget(&mut self, e: Entry) {
        self.release(e.bytes, e.block);
    }

    /// Accounts for `bytes` of stored values leaving the store, from `block` if any.
    fn release(&mut self, bytes: u64, block: Option<u64>) {
        self.used -= bytes;
        if let Some(id) = block {
            let compact = match self.blocks.get_mut(&id) {
                Some(b) => {
                    b.live -= bytes;
                    if b.live == 0 {
                        self.blocks.remove(&id);
                        false
                    } else {
                        // `live` counts the logical bytes of the values attributed to the
                        // block (scalars and packed small values of the same PUT included), so
                        // it can exceed the block's size: then nothing in it is dead.
                        let f = self.cfg.compact_dead_fraction;
                        let dead = b.size.saturating_sub(b.live);
                        f > 0.0 && dead as f64 > f * b.size as f64
                    }
                }
                None => false,
            };
            if compact {
                self.compact(id);
            }
        }
    }

    /// Copies the survivors of block `id` out, so the block can return to the pool.
    fn compact(&mut self, id: u64) {
        let Some(info) = self.blocks.remove(&id) else {
            return;
        };
        let Some(part) = self.partitions.get_mut(&info.partition) else {
            return;
        };
        let align = self.cfg.align;
        for map in part.fields.values_mut() {
            for e in map.values_mut() {
                if e.block != Some(id) {
                    continue;
                }
                match detach_into(&e.value, &mut self.mem, align) {
                    Ok((v, copied)) => {
                        e.value = v;
                        e.block = None;
                        self.compacted += copied;
                    }
                    Err(msg) => {
                        tracing::debug!(block = id, %msg, "compaction skipped: no memory");
                        e.block = None;
                    }
                }
            }
        }
    }

    fn get(
        &mut self,
        now: Instant,
        session: SessionId,
        id: u64,
        partition: &str,
        indexes: &[u64],
        fields: &[String],
    ) -> Result<Response, RemoteError> {
        self.check_keys(indexes, fields)?;
        let part = self.partitions.get(partition);
        let mut missing = Vec::new();
        let mut columns = Vec::with_capacity(fields.len());
        for f in fields {
            let map = part.and_then(|p| p.fields.get(f));
            let mut items = Vec::with_capacity(indexes.len());
            for i in indexes {
                match map.and_then(|m| m.get(i)) {
                    Some(e) => items.push(e.value.clone()),
                    None => {
                        if missing.len() < 1000 {
                            missing.push((f.clone(), *i));
                        }
                    }
                }
            }
            columns.push(Value::List(items));
        }
        if !missing.is_empty() {
            let mut e = err(
                ErrorKind::Missing,
                format!(
                    "{} key(s) not stored in partition {partition:?}",
                    missing.len()
                ),
            );
            e.missing = missing;
            return Err(e);
        }
        let frames = Encoder::new()
            .encode(&Value::List(columns))
            .map_err(|e| err(ErrorKind::TooLarge, format!("encode: {e}")))?;
        let payload = frames.payload_bytes();
        if payload > self.cfg.max_payload_bytes {
            return Err(err(
                ErrorKind::TooLarge,
                "GET payload above max_payload_bytes",
            ));
        }
        let meta = ByteBuf::from(frames.meta.to_vec());
        if payload <= self.cfg.inline_max {
            return Ok(Response::Values {
                meta,
                frames: frames
                    .payloads
                    .iter()
                    .map(|f| ByteBuf::from(f.to_vec()))
                    .collect(),
            });
        }
        let layout = frames
            .layout(self.cfg.align)
            .map_err(|e| err(ErrorKind::TooLarge, format!("layout: {e}")))?;
        self.gets.insert(
            (session, id),
            PendingGet {
                frames: frames.payloads.iter().cloned().collect(),
                layout,
                writing: false,
                deadline: now + self.cfg.prepare_ttl,
            },
        );
        Ok(Response::GetReady { meta })
    }

    fn get_into(
        &mut self,
        session: SessionId,
        id: u64,
        get: u64,
        block: RemoteDesc,
    ) -> Vec<Output<M::Dest>> {
        let fail = |kind, msg: String| {
            vec![Output::Reply {
                session,
                id,
                response: Response::error(kind, msg),
            }]
        };
        let Some(g) = self.gets.get_mut(&(session, get)) else {
            return fail(ErrorKind::UnknownTransfer, format!("no prepared GET {get}"));
        };
        if g.writing {
            return fail(ErrorKind::BadRequest, format!("GET {get} already written"));
        }
        let descs = match frame_descs(&block, &g.layout) {
            Ok(d) => d,
            Err(e) => return fail(ErrorKind::BadRequest, e),
        };
        g.writing = true;
        let frames: Vec<Bytes> = g.frames.iter().filter(|f| !f.is_empty()).cloned().collect();
        vec![Output::Write {
            session,
            id,
            get,
            frames,
            descs,
        }]
    }

    fn clear(
        &mut self,
        partition: &str,
        indexes: &[u64],
        fields: Option<&[String]>,
    ) -> Result<Response, RemoteError> {
        if (indexes.len() as u64) > self.cfg.max_keys {
            return Err(err(ErrorKind::TooLarge, "too many indexes"));
        }
        let Some(part) = self.partitions.get_mut(partition) else {
            return Ok(Response::Done);
        };
        let mut gone = Vec::new();
        for (name, map) in part.fields.iter_mut() {
            if fields.is_some_and(|fs| !fs.iter().any(|f| f == name)) {
                continue;
            }
            for i in indexes {
                if let Some(e) = map.remove(i) {
                    gone.push(e);
                }
            }
        }
        part.fields.retain(|_, m| !m.is_empty());
        for e in &gone {
            part.keys -= 1;
            part.bytes -= e.bytes;
        }
        if part.fields.is_empty() {
            self.partitions.remove(partition);
        }
        for e in gone {
            self.forget(e);
        }
        Ok(Response::Done)
    }

    /// Current statistics.
    pub fn stats(&self) -> Stats {
        let mut per: BTreeMap<&str, PartitionStats> = BTreeMap::new();
        for (name, p) in &self.partitions {
            let s = per.entry(name).or_default();
            s.keys = p.keys;
            s.bytes = p.bytes;
        }
        for p in self.puts.values() {
            per.entry(&p.partition).or_default().leased_bytes += p.block_len;
        }
        let open = self.sessions.values().map(|s| &s.quarantine);
        for q in open.chain(self.closed.values().map(|c| &c.quarantine)) {
            for (_, len, part) in q {
                per.entry(part).or_default().quarantined_bytes += len;
            }
        }
        let partitions = per
            .into_iter()
            .map(|(name, mut s)| {
                s.name = name.to_owned();
                s
            })
            .collect::<Vec<_>>();
        Stats {
            keys: partitions.iter().map(|p| p.keys).sum(),
            bytes: self.used,
            partitions,
            capacity_bytes: self.cfg.capacity_bytes,
            pool: self.mem.usage(),
            leased_bytes: self.leased,
            quarantined_bytes: self.quarantined,
            pending_puts: self.puts.len() as u64,
            pending_gets: self.gets.len() as u64,
            compacted_bytes: self.compacted,
            bytes_in: self.bytes_in,
            bytes_out: self.bytes_out,
            sessions: self.sessions.len() as u64,
        }
    }

    /// Drops every stored value, prepared transfer and quarantine (ordered teardown: the
    /// driver calls this after its transfers and agent connections are gone).
    pub fn teardown(&mut self) {
        self.puts.clear();
        self.gets.clear();
        self.sessions.clear();
        self.closed.clear();
        self.partitions.clear();
        self.blocks.clear();
        self.used = 0;
        self.reserved = 0;
        self.leased = 0;
        self.quarantined = 0;
    }
}

/// Copies a value's payloads into fresh blocks of `mem` (compaction). Small payloads are
/// copied to the heap by `detach_small`; returns the bytes copied.
fn detach_into<M: Memory>(v: &Value, mem: &mut M, align: u64) -> Result<(Value, u64), String> {
    Ok(match v {
        Value::Bytes(b) => {
            let n = b.len() as u64;
            (Value::Bytes(mem.copy_in(b, align)?), n)
        }
        Value::Tensor(t) => {
            let t = t.contiguous().map_err(|e| e.to_string())?;
            let n = t.data().len() as u64;
            let data = mem.copy_in(t.data(), align)?;
            let t = tessera_framecodec::Tensor::new(t.dtype(), t.shape(), data)
                .map_err(|e| e.to_string())?;
            (Value::Tensor(t), n)
        }
        Value::List(items) => {
            let mut out = Vec::with_capacity(items.len());
            let mut n = 0;
            for i in items {
                let (v, c) = detach_into(i, mem, align)?;
                out.push(v);
                n += c;
            }
            (Value::List(out), n)
        }
        Value::Map(items) => {
            let mut out = Vec::with_capacity(items.len());
            let mut n = 0;
            for (k, i) in items {
                let (v, c) = detach_into(i, mem, align)?;
                out.push((k.clone(), v));
                n += c;
            }
            (Value::Map(out), n)
        }
        other => (other.clone(), 0),
    })
}

/// Decodes an inline GET answer.
pub fn decode_inline(meta: &[u8], frames: Vec<ByteBuf>) -> Result<Value, String> {
    let frames: Vec<Bytes> = frames
        .into_iter()
        .map(|f| Bytes::from(f.into_vec()))
        .collect();
    decode(meta, &frames).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sync::{model, thread, Arc, Mutex};
    use crate::testing::VecMem;

    fn prepare(unit: &mut Unit<VecMem>, now: Instant, id: u64) -> Response {
        let t = tessera_framecodec::Tensor::from_slice(&[256], &[0u8; 256]).unwrap();
        let v = Value::List(vec![Value::List(vec![Value::Tensor(t)])]);
        let frames = tessera_framecodec::encode(&v).unwrap();
        let out = unit.handle(
            now,
            1,
            id,
            Request::Put {
                partition: "p".into(),
                indexes: vec![id],
                fields: vec!["x".into()],
                meta: ByteBuf::from(frames.meta.to_vec()),
                inline: None,
                pull: None,
            },
        );
        match out.into_iter().next() {
            Some(Output::Reply { response, .. }) => response,
            other => panic!("{other:?}"),
        }
    }

    /// A session's teardown, its executor finishing a GET and the timer expiring its prepared
    /// PUT, in any order on three threads: the leased and quarantined accounting ends at zero
    /// and every block is back.
    #[test]
    fn loom_session_executor_and_timer_release_everything() {
        model(|| {
            let leased = VecMem::new(u64::MAX);
            let cfg = UnitConfig {
                inline_max: 16,
                ..UnitConfig::default()
            };
            let mut unit = Unit::new(cfg.clone(), leased.clone());
            let now = Instant::now();
            unit.open_session(1);
            unit.session_ready(1);
            // A prepared PUT that expires, one cancelled after exposure (quarantined), a
            // stored value and a GET of it being written.
            assert!(matches!(
                prepare(&mut unit, now, 1),
                Response::PutReady { .. }
            ));
            assert!(matches!(
                prepare(&mut unit, now, 2),
                Response::PutReady { .. }
            ));
            let cancel = Request::Cancel {
                of: 2,
                maybe_written: true,
            };
            assert_eq!(unit.handle(now, 1, 3, cancel).len(), 1);
            assert!(matches!(
                prepare(&mut unit, now, 4),
                Response::PutReady { .. }
            ));
            assert_eq!(unit.handle(now, 1, 40, Request::Commit { put: 4 }).len(), 1);
            let get = Request::Get {
                partition: "p".into(),
                indexes: vec![4],
                fields: vec!["x".into()],
            };
            assert!(matches!(
                unit.handle(now, 1, 5, get).into_iter().next(),
                Some(Output::Reply {
                    response: Response::GetReady { .. },
                    ..
                })
            ));
            let into = Request::GetInto {
                get: 5,
                block: RemoteDesc::new(7, 0, 256),
            };
            assert!(matches!(
                unit.handle(now, 1, 6, into).into_iter().next(),
                Some(Output::Write { .. })
            ));
            let s = unit.stats();
            assert!(s.leased_bytes > 0 && s.quarantined_bytes > 0 && s.pending_gets == 1);
            let exposed = s.leased_bytes + s.quarantined_bytes;

            let unit = Arc::new(Mutex::new(unit));
            let executor = {
                let unit = unit.clone();
                thread::spawn(move || {
                    unit.lock().unwrap().transfer_done(1, 5, 6, Ok(()));
                })
            };
            let timer = {
                let unit = unit.clone();
                thread::spawn(move || {
                    unit.lock().unwrap().handle_timeout(now + cfg.prepare_ttl);
                })
            };
            unit.lock()
                .unwrap()
                .close_session(1, now, TornDown::Signalled);
            executor.join().unwrap();
            timer.join().unwrap();
            let mut unit = unit.lock().unwrap();
            // Both exposed blocks (the expired or still prepared PUT and the cancelled one)
            // stay quarantined until the client's link is known gone.
            let s = unit.stats();
            assert_eq!((s.quarantined_bytes, s.leased_bytes), (exposed, 0), "{s:?}");
            assert_eq!(unit.closed_sessions(), vec![1]);
            assert!(unit.release_closed(1) > 0);
            let s = unit.stats();
            assert_eq!(
                (
                    s.leased_bytes,
                    s.quarantined_bytes,
                    s.pending_puts,
                    s.pending_gets
                ),
                (0, 0, 0, 0)
            );
            assert_eq!(s.sessions, 0);
            assert_eq!(s.keys, 1, "the stored value stays");
            unit.teardown();
            drop(unit);
            assert_eq!(leased.live(), 0, "every block is back");
        });
    }

    /// A pulled PUT's READ completing on the executor, the session's teardown and the timer,
    /// in any order on three threads: the READ's block is stored or released exactly once and
    /// the accounting ends at zero.
    #[test]
    fn loom_pulled_put_read_teardown_and_timer() {
        model(|| {
            let leased = VecMem::new(u64::MAX);
            let cfg = UnitConfig {
                inline_max: 16,
                ..UnitConfig::default()
            };
            let mut unit = Unit::new(cfg.clone(), leased.clone());
            unit.set_pull_puts(true);
            let now = Instant::now();
            unit.open_session(1);
            unit.session_ready(1);
            let t = tessera_framecodec::Tensor::from_slice(&[256], &[0u8; 256]).unwrap();
            let v = Value::List(vec![Value::List(vec![Value::Tensor(t)])]);
            let frames = tessera_framecodec::encode(&v).unwrap();
            let descs = frames
                .payloads
                .iter()
                .map(|f| RemoteDesc::new(3, 0, f.len() as u64))
                .collect();
            let put = Request::Put {
                partition: "p".into(),
                indexes: vec![1],
                fields: vec!["x".into()],
                meta: ByteBuf::from(frames.meta.to_vec()),
                inline: None,
                pull: Some(crate::proto::PullSource {
                    descs,
                    agent: ByteBuf::new(),
                }),
            };
            assert!(matches!(
                unit.handle(now, 1, 1, put).into_iter().next(),
                Some(Output::Read { put: 1, .. })
            ));
            assert!(unit.stats().leased_bytes > 0);

            let unit = Arc::new(Mutex::new(unit));
            let executor = {
                let unit = unit.clone();
                thread::spawn(move || {
                    unit.lock().unwrap().read_done(1, 1, Ok(()));
                })
            };
            let timer = {
                let unit = unit.clone();
                thread::spawn(move || {
                    unit.lock().unwrap().handle_timeout(now + cfg.prepare_ttl);
                })
            };
            unit.lock()
                .unwrap()
                .close_session(1, now, TornDown::Signalled);
            executor.join().unwrap();
            timer.join().unwrap();
            let mut unit = unit.lock().unwrap();
            let s = unit.stats();
            assert_eq!(
                (
                    s.leased_bytes,
                    s.quarantined_bytes,
                    s.pending_puts,
                    s.sessions
                ),
                (0, 0, 0, 0)
            );
            assert!(s.keys <= 1);
            assert_eq!(unit.release_closed(1), 0, "nothing held for late WRITEs");
            unit.teardown();
            drop(unit);
            assert_eq!(leased.live(), 0, "every block is back");
        });
    }
}
