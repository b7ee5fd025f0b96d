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
//! the initiator of the transfer and a client that dies mid-transfer only fails the READ.
//! Memory comes from a [`Memory`] the driver supplies, so tests run it over plain vectors.
//!
//! The state is split by concern, each part owning its invariants: the stored values and
//! their blocks (`store`), sessions and quarantine (`session`), pending PUTs and what they
//! lease (`put`), pending GETs (`get`).
//!
//! The client's side of the same protocol is plain code too ([`client`]): `Client` only
//! drives its machines.

pub mod client;
mod config;
mod credit;
mod get;
mod keyed;
mod put;
mod session;
mod sliced;
mod stats;
mod store;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use serde_bytes::ByteBuf;
use tessera_framecodec::{decode, DecodeError, Decoder, Limits, Value};
use tessera_transport::RemoteDesc;

pub use self::config::UnitConfig;
pub use self::get::{encode_get, EncodedGet, SlicedGet, EARLY_META_BYTES};
pub use self::sliced::{write_slice_keys, Access, Ahead, MaybeSliced, SlicedPut};
pub use self::stats::{PartitionStats, PoolStats, Stats};

use self::credit::Credits;
use self::get::Gets;
pub use self::put::inline_empty;
use self::put::{PutNext, PutRequest, Puts};
use self::session::{Handshake, SessionState, Sessions, Step};
use self::sliced::Holds;
use self::store::{Compaction, Store};
use crate::error::{ErrorKind, MemoryError, PayloadError, RemoteError};
use crate::proto::{handshake_parts, Request, Response, CLIENT_PROOF, UNIT_PROOF};
use keyed::{Keyed, KeyedSet};
use tessera_transport::auth;

/// Identifies a control connection (a session). A client that reconnects is a new session.
pub type SessionId = u64;

/// Where receive blocks come from: a registered pool in the server, vectors in tests.
pub trait Memory {
    /// A leased block; dropping it returns its range.
    type Block: Send + Sync + 'static;
    /// Leases `size` bytes aligned to `align`.
    fn lease(&mut self, size: u64, align: u64) -> Result<Self::Block, MemoryError>;
    /// Where a READ into a block lands (a local descriptor in the server).
    type Dest: Send + 'static;
    /// A descriptor a peer can WRITE to: `len` bytes at `offset` of `block`.
    fn remote(&self, block: &Self::Block, offset: u64, len: u64)
        -> Result<RemoteDesc, MemoryError>;
    /// A destination for a READ of `len` bytes into `block` at `offset`. It may keep the
    /// block's memory alive while the READ is in flight.
    fn dest(&self, block: &Self::Block, offset: u64, len: u64) -> Result<Self::Dest, MemoryError>;
    /// The block's first `len` bytes as `Bytes` that own the block (no copy).
    fn freeze(&self, block: Self::Block, len: u64) -> Bytes;
    /// Length of a block.
    fn block_len(block: &Self::Block) -> u64;
    /// Gives back the block's bytes from `len` on, where nothing else holds the block (a
    /// credit trimmed to the PUT it landed).
    fn shrink(block: &mut Self::Block, len: u64);
    /// Copies `data` into a fresh block and returns it frozen (used by compaction only).
    fn copy_in(&mut self, data: &[u8], align: u64) -> Result<Bytes, MemoryError>;
    /// Lets `peer` WRITE the `ranges` (offset, length) of `block` (a pushed PUT's frames,
    /// touching ones merged) until the returned handle drops, and tells whether they were.
    /// A COMMIT is accepted only once [`Written::is_written`] says every byte landed, so a
    /// block is never published with what it held before.
    fn expose(
        &self,
        block: &Self::Block,
        peer: &str,
        ranges: &[(u64, u64)],
    ) -> Result<Exposed, MemoryError>;
    /// Lets `peer` WRITE all of `block` (a credit) until the returned handle drops, announced
    /// to the engine as standing (`Registration::expose_standing`: over `shm` the client
    /// writes into it without asking first), and tells which of its bytes were written.
    fn expose_landing(&self, block: &Self::Block, peer: &str) -> Result<Landed, MemoryError>;
    /// Pool usage.
    fn usage(&self) -> PoolStats;
    /// Gives back registered memory that is idle beyond the configured limit; returns the
    /// bytes given back. Memory that never shrinks keeps the default.
    fn trim(&mut self) -> u64 {
        0
    }
}

/// A peer's permission to WRITE a pushed PUT's frames, and whether it did
/// ([`Memory::expose`]). Dropping it revokes the permission where the engine enforces it.
pub trait Written: Send + Sync {
    /// Whether every exposed byte was written by a WRITE that completed.
    fn is_written(&self) -> bool;
    /// Ready once [`Written::is_written`]; otherwise wakes the task when the engine records
    /// more (shm's DONE is read by the target's thread after the initiator saw its transfer
    /// complete, so a COMMIT may arrive first). Memory that records nothing later is ready.
    fn poll_written(&self, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        let _ = cx;
        std::task::Poll::Ready(())
    }
}

/// A peer's permission to WRITE a credit's block, and which of its bytes it did
/// ([`Memory::expose_landing`]). Dropping it withdraws the permission.
pub trait Landing: Send + Sync {
    /// Whether WRITEs that completed covered every `(offset, len)` of `ranges` (relative to
    /// the block).
    fn ranges_written(&self, ranges: &[(u64, u64)]) -> bool;
    /// Ready once completed WRITEs covered at least `bytes` of the block; otherwise wakes the
    /// task when the engine records more. Memory that records nothing later is ready.
    fn poll_bytes(&self, bytes: u64, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        let _ = (bytes, cx);
        std::task::Poll::Ready(())
    }

    /// Spins for up to `window` until completed WRITEs covered at least `bytes` of the block,
    /// recording meanwhile those the engine lets a spinning thread see
    /// (`Exposure::spin_written`); whether they did. The default spins on nothing.
    fn spin_bytes(&self, bytes: u64, window: std::time::Duration) -> bool {
        let _ = (bytes, window);
        false
    }
}

/// A shared [`Landing`]: the driver clones it to wait for a credited PUT's WRITE off the
/// unit's lock.
pub type Landed = Arc<dyn Landing>;

/// A shared [`Written`]: the driver clones it to wait for a WRITE's record off the unit's
/// lock.
pub type Exposed = Arc<dyn Written>;

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
    /// The session proved it holds the token (`Auth`): connect to its agent, then call
    /// [`Unit::session_ready`] and answer `Welcome` (or close the session when its agent
    /// cannot be added).
    Accept {
        /// Session.
        session: SessionId,
        /// Request id of the Auth.
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

/// How the driver learns that the client of a closed session can no longer write into the
/// blocks it was shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TornDown {
    /// The payload engine tells: the driver calls [`Unit::release_closed`] once it does.
    Signalled,
    /// The engine cannot tell: the blocks are released `late_write_grace` after the close.
    Grace,
}

/// The unit's state machine.
pub struct Unit<M: Memory> {
    cfg: UnitConfig,
    mem: M,
    decoder: Decoder,
    /// Stored values and the blocks they pin.
    store: Store,
    /// Sessions, and the blocks quarantined for them.
    sessions: Sessions,
    /// PUTs waiting for their payload, and what they lease and reserve.
    puts: Puts,
    /// GETs waiting for the client's block or their WRITE.
    gets: Gets,
    /// Landing blocks kept ready for sessions' next PUTs.
    credits: Credits<M::Block>,
    /// PUT payloads are pulled (READ by the unit) instead of pushed.
    pull_puts: bool,
    /// Partitions held by requests handled in slices, and what their PUTs still reserve.
    holds: Holds,
    /// Set while [`Unit::handle_slicing`] handles a request: a PUT of more than
    /// `slice_keys` keys is then left in `sliced_put` instead of stored.
    slicing: bool,
    sliced_put: Option<Box<SlicedPut<M::Dest>>>,
    /// What the driver did ahead of the request [`Unit::handle_slicing`] is handling.
    ahead: Ahead,
    /// Values taken out of the store, for the driver to free ([`Unit::take_garbage`]).
    garbage: Garbage,
}

/// Values the unit took out of its store, freed when this drops: where the driver drops it
/// outside the unit's lock, no other request waits for that (a dropped partition of a
/// million scalars takes tens of milliseconds to free).
#[derive(Default)]
pub struct Garbage(Vec<store::Detached>);

impl Garbage {
    /// Whether there is nothing to free.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
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
            store: Store::default(),
            sessions: Sessions::default(),
            puts: Puts::default(),
            gets: Gets::default(),
            credits: Credits::default(),
            pull_puts: false,
            holds: Holds::default(),
            slicing: false,
            sliced_put: None,
            ahead: Ahead::default(),
            garbage: Garbage::default(),
        }
    }

    /// What the requests handled since the last call took out of the store (the values of a
    /// dropped partition), for the caller to free once it has let go of the unit's lock.
    pub fn take_garbage(&mut self) -> Garbage {
        std::mem::take(&mut self.garbage)
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

    /// The earliest deadline of a prepared transfer.
    pub fn poll_timeout(&self) -> Option<Instant> {
        [
            self.puts.next_deadline(),
            self.gets.next_deadline(),
            self.sessions.next_deadline(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Expires prepared transfers whose deadline passed. A PUT whose block was exposed is
    /// quarantined and its session failed (a WRITE may still land); an expired GET that was
    /// never written just drops its frames. A pulled PUT whose READ is queued or in flight
    /// does not expire here: the driver's transfer timeout ends it through `read_done`.
    pub fn handle_timeout(&mut self, now: Instant) -> Vec<Output<M::Dest>> {
        let mut out = Vec::new();
        for (session, id) in self.puts.expired(now) {
            if let Some(p) = self.puts.remove(session, id) {
                tracing::warn!(session, id, "prepared PUT expired; quarantined");
                self.quarantine_put(session, p);
                self.fail_session(session);
                out.push(Output::Reply {
                    session,
                    id,
                    response: Response::error(ErrorKind::PeerFailed, "prepared PUT expired"),
                });
                // The failed session is closed, so what it holds in quarantine is released
                // once its client's link is torn down instead of piling up while it stays
                // connected.
                if !out
                    .iter()
                    .any(|o| matches!(o, Output::Close { session: s } if *s == session))
                {
                    out.push(Output::Close { session });
                }
            }
        }
        self.gets.expire(now);
        self.sessions.expire(now);
        out
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
        let step = match req {
            Request::Hello { .. } => Step::Hello,
            Request::Auth { .. } => Step::Auth,
            _ => Step::Other,
        };
        if let Some((kind, why)) = self.refused_by_state(session, step) {
            // A handshake message out of turn ends an unauthenticated session; other requests
            // are only refused (the driver's handshake deadline ends a session that never
            // authenticates).
            if !self.authenticated(session) && !matches!(step, Step::Other) {
                return vec![reply(Response::error(kind, why)), Output::Close { session }];
            }
            return vec![reply(Response::error(kind, why))];
        }
        let result = match req {
            Request::Hello { nonce, agent } => {
                if nonce.len() != auth::NONCE_LEN {
                    return vec![
                        reply(Response::error(
                            ErrorKind::Protocol,
                            format!("a Hello's nonce has {} bytes", auth::NONCE_LEN),
                        )),
                        Output::Close { session },
                    ];
                }
                let unit_nonce = auth::nonce();
                let proof = auth::prove(
                    self.cfg.token.as_ref(),
                    UNIT_PROOF,
                    &handshake_parts(&nonce, &unit_nonce, &agent),
                );
                self.sessions.set_state(
                    session,
                    SessionState::Challenged(Box::new(Handshake {
                        client_nonce: nonce.into_vec(),
                        unit_nonce: unit_nonce.to_vec(),
                        agent,
                    })),
                );
                Ok(Response::Challenge {
                    nonce: ByteBuf::from(unit_nonce.to_vec()),
                    proof: ByteBuf::from(proof.to_vec()),
                })
            }
            Request::Auth { proof } => {
                let Some(h) = self.sessions.take_handshake(session) else {
                    return vec![
                        reply(Response::error(ErrorKind::BadRequest, "Auth out of turn")),
                        Output::Close { session },
                    ];
                };
                let parts = handshake_parts(&h.client_nonce, &h.unit_nonce, &h.agent);
                if !auth::check(self.cfg.token.as_ref(), CLIENT_PROOF, &parts, &proof) {
                    self.sessions.set_state(session, SessionState::Failed);
                    return vec![
                        reply(Response::error(
                            ErrorKind::Unauthorized,
                            "the client did not prove it holds the unit's token",
                        )),
                        Output::Close { session },
                    ];
                }
                return vec![Output::Accept {
                    session,
                    id,
                    agent: h.agent,
                }];
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
            Request::PutCredited {
                partition,
                indexes,
                fields,
                meta,
                credit,
                bytes: _,
            } => self.put_credited(session, id, &partition, &indexes, &fields, meta, credit),
            Request::Commit { put } => self.commit(session, put),
            Request::Cancel { of, maybe_written } => self.cancel(session, of, maybe_written),
            Request::Get {
                partition,
                indexes,
                fields,
            } => return self.get(now, session, id, &partition, &indexes, &fields, None),
            Request::GetOffer {
                partition,
                indexes,
                fields,
                block,
            } => return self.get(now, session, id, &partition, &indexes, &fields, Some(block)),
            Request::GetInto { get, block } => return self.get_into(session, id, get, block),
            Request::Clear {
                partition,
                indexes,
                fields,
            } => self.clear(&partition, &indexes, fields.as_deref()),
            Request::DropPartition { partition } => {
                let dropped = self
                    .store
                    .drop_partition(&partition, self.cfg.key_overhead_bytes);
                self.garbage.0.extend(dropped);
                Ok(Response::Done)
            }
            Request::Stats => Ok(Response::Stats(self.stats())),
        };
        vec![reply(result.unwrap_or_else(Response::Error))]
    }

    fn check_keys(&self, indexes: &[u64], fields: &[String]) -> Result<(), RemoteError> {
        match self.ahead.keys_checked {
            true => Ok(()),
            false => check_keys(&self.cfg, indexes, fields),
        }
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
        let c = Compaction::new(&mut self.mem, &self.cfg);
        self.store.clear(partition, indexes, fields, c);
        Ok(Response::Done)
    }

    /// Current statistics.
    pub fn stats(&self) -> Stats {
        let mut per: BTreeMap<&str, PartitionStats> = BTreeMap::new();
        self.store.partition_stats(&mut per);
        self.puts.partition_stats(&mut per);
        self.sessions.partition_stats(&mut per);
        let partitions = per
            .into_iter()
            .map(|(name, mut s)| {
                s.name = name.to_owned();
                s
            })
            .collect::<Vec<_>>();
        Stats {
            keys: partitions.iter().map(|p| p.keys).sum(),
            bytes: self.store.used(),
            partitions,
            capacity_bytes: self.cfg.capacity_bytes,
            pool: self.mem.usage(),
            leased_bytes: self.puts.leased(),
            quarantined_bytes: self.sessions.quarantined(),
            pending_puts: self.puts.len() as u64,
            pending_gets: self.gets.len() as u64,
            compacted_bytes: self.store.compacted(),
            bytes_in: self.puts.bytes_in(),
            bytes_out: self.gets.bytes_out(),
            sessions: self.sessions.len() as u64,
            charged_bytes: self.store.used() + self.store.overhead(),
            connections: 0,
            refused_connections: 0,
            accept_errors: 0,
            credit_bytes: self.credits.bytes(),
        }
    }

    /// Drops every stored value, prepared transfer and quarantine (ordered teardown: the
    /// driver calls this after its transfers and agent connections are gone).
    pub fn teardown(&mut self) {
        self.credits.clear();
        self.puts.clear();
        self.gets.clear();
        self.sessions.clear();
        self.store.clear_all();
    }
}

/// Checks the keys of a PUT or GET against `cfg` (fields given, `max_keys`, no duplicates).
/// Pure: a driver may run it before it takes the unit's shared state.
pub fn check_keys(cfg: &UnitConfig, indexes: &[u64], fields: &[String]) -> Result<(), RemoteError> {
    check_keys_ordered(cfg, indexes, fields, keys_in_order(indexes))
}

/// Whether `indexes` increase (the usual request): then they cannot repeat, and checking
/// that they do not takes this one pass, where other orders take a set of them.
pub fn keys_in_order(indexes: &[u64]) -> bool {
    indexes.windows(2).all(|w| w[0] < w[1])
}

/// [`check_keys`] of indexes known to increase or not ([`keys_in_order`]).
pub fn check_keys_ordered(
    cfg: &UnitConfig,
    indexes: &[u64],
    fields: &[String],
    in_order: bool,
) -> Result<(), RemoteError> {
    if fields.is_empty() {
        return Err(err(ErrorKind::BadRequest, "no fields"));
    }
    let keys = (indexes.len() as u64).saturating_mul(fields.len() as u64);
    if keys > cfg.max_keys {
        return Err(err(
            ErrorKind::TooLarge,
            format!("{keys} keys exceed the maximum of {}", cfg.max_keys),
        ));
    }
    if !in_order {
        let mut seen = KeyedSet::with_capacity_and_hasher(indexes.len(), Keyed::default());
        if indexes.iter().any(|i| !seen.insert(*i)) {
            return Err(err(ErrorKind::BadRequest, "duplicate index"));
        }
    }
    let mut seen = KeyedSet::with_capacity_and_hasher(fields.len(), Keyed::default());
    if fields.iter().any(|f| !seen.insert(f.as_str())) {
        return Err(err(ErrorKind::BadRequest, "duplicate field"));
    }
    Ok(())
}

/// Decodes an inline GET answer.
pub fn decode_inline(meta: &[u8], frames: Vec<ByteBuf>) -> Result<Value, DecodeError> {
    let frames: Vec<Bytes> = frames
        .into_iter()
        .map(|f| Bytes::from(f.into_vec()))
        .collect();
    decode(meta, &frames)
}
