//! PUT: inline, prepared and pushed (READY, the client's WRITE, COMMIT or CANCEL), or pulled
//! (the unit READs the client's frames), and the PUTs waiting for their payload.
//!
//! Invariants kept here: `leased` is the sum of the pending PUTs' block lengths and `reserved`
//! that of the capacity they reserve; a PUT leaves `Puts` only through `remove` or
//! `take_session`, which give both back.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use bytes::Bytes;
use serde_bytes::ByteBuf;
use tessera_framecodec::Value;

use super::credit::meta_error;
use super::session::Quarantined;
use super::store::Compaction;
use super::{err, Exposed, Memory, Output, PartitionStats, PayloadError, SessionId, Unit};
use crate::error::{ErrorKind, RemoteError};
use crate::proto::{PullSource, Response};

pub(super) struct PendingPut {
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
    pub(super) reading: bool,
    /// A pushed PUT: its frames' exposure to the client's agent, and what landed in them.
    /// Dropped with the PUT (stored, cancelled or quarantined), which revokes it.
    written: Option<Exposed>,
}

impl PendingPut {
    /// The block, kept so that it is not reused while a late WRITE could reach it.
    pub(super) fn into_quarantined(self) -> Quarantined {
        (
            Box::new((self.buf, self.value)),
            self.block_len,
            self.partition,
        )
    }
}

/// The fields of a PUT request.
pub(super) struct PutRequest {
    pub(super) partition: String,
    pub(super) indexes: Vec<u64>,
    pub(super) fields: Vec<String>,
    pub(super) meta: ByteBuf,
    pub(super) inline: Option<Vec<ByteBuf>>,
    pub(super) pull: Option<PullSource>,
}

/// What a PUT leads to: an answer, or a READ of its payload first.
pub(super) enum PutNext<D> {
    Reply(Response),
    Read(Output<D>),
}

/// PUTs that leased a block and wait for their payload, by session and request id.
#[derive(Default)]
pub(super) struct Puts {
    pending: HashMap<(SessionId, u64), PendingPut>,
    /// Bytes of the blocks leased to them.
    leased: u64,
    /// The same per session (sessions with none are absent).
    session_leased: HashMap<SessionId, u64>,
    /// Logical bytes of capacity they reserve.
    reserved: u64,
    /// Payload bytes received through the payload plane (stored PUTs).
    bytes_in: u64,
}

impl Puts {
    pub(super) fn leased(&self) -> u64 {
        self.leased
    }

    /// Bytes of the blocks leased to the PUTs of `session`.
    pub(super) fn session_leased(&self, session: SessionId) -> u64 {
        self.session_leased.get(&session).copied().unwrap_or(0)
    }

    pub(super) fn reserved(&self) -> u64 {
        self.reserved
    }

    pub(super) fn bytes_in(&self) -> u64 {
        self.bytes_in
    }

    /// Counts `bytes` of payload received through the payload plane (a stored PUT).
    pub(super) fn count_in(&mut self, bytes: u64) {
        self.bytes_in += bytes;
    }

    pub(super) fn len(&self) -> usize {
        self.pending.len()
    }

    /// The partition of PUT `put` of `session`.
    pub(super) fn partition_of(&self, session: SessionId, put: u64) -> Option<&str> {
        self.pending
            .get(&(session, put))
            .map(|p| p.partition.as_str())
    }

    /// Whether PUT `put` of `session` is pulled and its READ queued or in flight.
    pub(super) fn reading(&self, session: SessionId, put: u64) -> bool {
        self.pending.get(&(session, put)).is_some_and(|p| p.reading)
    }

    fn insert(&mut self, key: (SessionId, u64), p: PendingPut) {
        self.leased += p.block_len;
        self.reserved += p.reserved;
        *self.session_leased.entry(key.0).or_default() += p.block_len;
        self.pending.insert(key, p);
    }

    /// Takes PUT `put` of `session` out, giving back its lease and reservation (the block
    /// returns to the pool once the caller drops it, or is quarantined).
    pub(super) fn remove(&mut self, session: SessionId, put: u64) -> Option<PendingPut> {
        let p = self.pending.remove(&(session, put))?;
        self.leased -= p.block_len;
        self.reserved -= p.reserved;
        if let Some(l) = self.session_leased.get_mut(&session) {
            *l -= p.block_len;
            if *l == 0 {
                self.session_leased.remove(&session);
            }
        }
        Some(p)
    }

    /// Takes every PUT of `session` out, as `remove` does.
    pub(super) fn take_session(&mut self, session: SessionId) -> Vec<PendingPut> {
        let ids: Vec<u64> = self
            .pending
            .keys()
            .filter(|(s, _)| *s == session)
            .map(|(_, id)| *id)
            .collect();
        ids.into_iter()
            .filter_map(|id| self.remove(session, id))
            .collect()
    }

    /// The earliest deadline of a prepared PUT (not those being read).
    pub(super) fn next_deadline(&self) -> Option<Instant> {
        self.pending
            .values()
            .filter(|p| !p.reading)
            .map(|p| p.deadline)
            .min()
    }

    /// The prepared PUTs (not those being read) whose deadline passed at `now`.
    pub(super) fn expired(&self, now: Instant) -> Vec<(SessionId, u64)> {
        self.pending
            .iter()
            .filter(|(_, p)| !p.reading && p.deadline <= now)
            .map(|(k, _)| *k)
            .collect()
    }

    /// Leased bytes per partition, into `per`.
    pub(super) fn partition_stats<'a>(&'a self, per: &mut BTreeMap<&'a str, PartitionStats>) {
        for p in self.pending.values() {
            per.entry(&p.partition).or_default().leased_bytes += p.block_len;
        }
    }

    /// Drops every pending PUT (teardown); the bytes received stay counted.
    pub(super) fn clear(&mut self) {
        self.pending.clear();
        self.session_leased.clear();
        self.leased = 0;
        self.reserved = 0;
    }
}

impl<M: Memory> Unit<M> {
    /// Quarantines a PUT whose block may still be written, with its session.
    pub(super) fn quarantine_put(&mut self, session: SessionId, p: PendingPut) {
        let (block, len, partition) = p.into_quarantined();
        self.sessions.quarantine(session, block, len, partition);
    }

    pub(super) fn put(
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
        if self.pull_puts && inline.is_none() && pull.is_none() {
            // The one-sided engines record no trace of a WRITE at the target, so a pushed
            // PUT's COMMIT could not be told from one whose payload never came.
            return Err(err(
                ErrorKind::BadRequest,
                "this unit pulls PUT payloads over its engine: name the frames (`pull`)",
            ));
        }
        // A meta the driver decoded ahead (`ahead_meta`) gives the layout; any other is read
        // here.
        let unbound = match pull.is_none() && inline_empty(&inline) {
            true => self.ahead.meta.take(),
            false => None,
        };
        let (total_bytes, layout) = match &unbound {
            Some(u) => (u.size(), u.layout().clone()),
            None => {
                let table = self.decoder.frame_table(&meta).map_err(meta_error)?;
                let layout = table
                    .layout(self.cfg.align)
                    .map_err(|e| err(ErrorKind::Protocol, format!("layout: {e}")))?;
                (table.total_bytes(), layout)
            }
        };
        let incoming = self.admit_put(
            &partition,
            &indexes,
            &fields,
            layout.size,
            meta.len() as u64,
        )?;
        let meta = Bytes::from(meta.into_vec());
        if let Some(frames) = inline {
            if total_bytes > self.cfg.inline_max {
                return Err(err(ErrorKind::TooLarge, "inline payload above inline_max"));
            }
            let frames: Vec<Bytes> = frames
                .into_iter()
                .map(|f| Bytes::from(f.into_vec()))
                .collect();
            let value = match unbound {
                Some(u) => u.bind(&Bytes::new()),
                None => self.decoder.decode(&meta, &frames),
            }
            .map_err(|e| err(ErrorKind::Protocol, format!("decode: {e}")))?;
            self.store_value(&partition, &indexes, &fields, value, None)?;
            return Ok(PutNext::Reply(Response::Done));
        }
        if layout.size == 0 {
            let value = match unbound {
                Some(u) => u.bind(&Bytes::new()),
                None => self.decoder.decode(&meta, &[]),
            }
            .map_err(|e| err(ErrorKind::Protocol, format!("decode: {e}")))?;
            self.store_value(&partition, &indexes, &fields, value, None)?;
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
        if self.puts.pending.contains_key(&(session, id)) {
            return Err(err(ErrorKind::BadRequest, "request id already prepared"));
        }
        let mine = self.sessions.session_quarantined(session);
        if mine >= self.cfg.session_quarantine_limit {
            return Err(err(
                ErrorKind::OutOfMemory,
                format!(
                    "this client's quarantine is full ({mine} of {} bytes, left by PUTs that \
                     expired or were cancelled); it is released once no late WRITE can land \
                     (the session closed and its link torn down)",
                    self.cfg.session_quarantine_limit
                ),
            ));
        }
        // The unit's limit fails only sessions whose agent holds quarantined blocks: a client
        // that never left a block behind is not refused for what others left.
        if mine > 0 && self.sessions.quarantined() > self.cfg.quarantine_limit {
            return Err(err(
                ErrorKind::OutOfMemory,
                format!(
                    "the unit's quarantine limit is reached ({} bytes), {mine} of them left by                      this client's sessions",
                    self.sessions.quarantined()
                ),
            ));
        }
        // Credits have bounds of their own (`session_credits`, `credit_limit`): a session's
        // largest PUT does not shrink because it holds some.
        let mine = self.puts.session_leased(session);
        if mine + layout.size > self.cfg.session_leased_limit {
            return Err(err(
                ErrorKind::OutOfMemory,
                format!(
                    "session leased limit (session_leased_limit): {mine} of {} bytes leased, {} asked",
                    self.cfg.session_leased_limit, layout.size
                ),
            ));
        }
        let leased = self.puts.leased();
        if leased + layout.size > self.cfg.leased_limit {
            return Err(err(
                ErrorKind::OutOfMemory,
                format!(
                    "leased limit: {} of {} bytes leased, {} asked",
                    leased, self.cfg.leased_limit, layout.size
                ),
            ));
        }
        let block = self
            .mem
            .lease(layout.size, layout.align)
            .map_err(|e| err(ErrorKind::OutOfMemory, e.to_string()))?;
        let mut dests = Vec::new();
        let mut srcs = Vec::new();
        if let Some(src) = &pull {
            for (k, (off, len)) in layout.offsets.iter().zip(&layout.lens).enumerate() {
                if *len > 0 {
                    dests.push(
                        self.mem
                            .dest(&block, *off, *len)
                            .map_err(|e| err(ErrorKind::OutOfMemory, e.to_string()))?,
                    );
                    srcs.push(src.descs[k]);
                }
            }
        }
        let reading = pull.is_some();
        let written = if pull.is_none() {
            let ranges = merged_ranges(&layout.offsets, &layout.lens);
            let peer = self.sessions.peer(session);
            Some(
                self.mem
                    .expose(&block, peer, &ranges)
                    .map_err(|e| err(ErrorKind::OutOfMemory, e.to_string()))?,
            )
        } else {
            None
        };
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
                    .map_err(|e| err(ErrorKind::OutOfMemory, e.to_string()))?,
                agent: None,
            }),
        };
        // Described for the transfer, then frozen and decoded: all before the block is
        // exposed (READY sent, READ posted). A meta that does not decode is refused here,
        // before anything moves, and the block (with the READ's descriptors) goes straight
        // back.
        let block_len = M::block_len(&block);
        let buf = self.mem.freeze(block, layout.size);
        // Laid out with the unit's alignment, as the client lays the frames out (the
        // layout's own alignment, larger where a frame asks for more, is the block's).
        let value = match unbound {
            Some(u) => u.bind(&buf),
            None => self.decoder.decode_contiguous(&meta, &buf, self.cfg.align),
        }
        .map_err(|e| err(ErrorKind::Protocol, format!("decode: {e}")))?;
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
                written,
            },
        );
        Ok(next)
    }

    /// Whether a PUT of `size` bytes laid out and `meta_len` of meta, at `indexes` x
    /// `fields` of `partition`, fits the unit's capacity (in bytes, keys included) and its
    /// stored-key limit. Returns the capacity it reserves.
    pub(super) fn admit_put(
        &self,
        partition: &str,
        indexes: &[u64],
        fields: &[String],
        size: u64,
        meta_len: u64,
    ) -> Result<u64, RemoteError> {
        // Reserve the whole block: the stored values are never larger than it, plus scalars;
        // and what each new key costs besides its value (an empty value is not free).
        let overhead = self.cfg.key_overhead_bytes;
        let keys_cost: u64 = fields
            .iter()
            .map(|f| super::store::key_cost(overhead, f))
            .sum::<u64>()
            .saturating_mul(indexes.len() as u64);
        let keys = indexes.len() as u64 * fields.len() as u64;
        let incoming = size + meta_len + keys_cost;
        let used = self.store.used() + self.store.overhead();
        let reserved = self.puts.reserved() + self.holds.storing();
        let stored = self.store.keys() + self.holds.storing_keys();
        let fits = |credit: u64, new_keys: u64| {
            let need = (used + reserved + incoming).saturating_sub(credit);
            (
                need <= self.cfg.capacity_bytes,
                stored + new_keys <= self.cfg.max_stored_keys,
            )
        };
        // What the keys it replaces free counts only where the PUT would not fit without it:
        // a look-up of each key, under the unit's lock, saved for the PUTs that need it.
        if fits(0, keys) == (true, true) {
            return Ok(incoming);
        }
        let replaced = self.store.replaced(partition, indexes, fields, overhead);
        let new_keys = keys - replaced.keys;
        let (room, key_room) = fits(replaced.bytes + replaced.overhead, new_keys);
        if !room {
            return Err(err(
                ErrorKind::Capacity,
                format!(
                    "PUT of {incoming} bytes ({} of values, {} of metadata, {keys_cost} for its \
                     keys: {overhead} bytes and the key's length each) exceeds capacity: \
                     {used} of {} bytes stored (keys included), {reserved} reserved",
                    size, meta_len, self.cfg.capacity_bytes
                ),
            ));
        }
        if !key_room {
            return Err(err(
                ErrorKind::Capacity,
                format!(
                    "PUT of {new_keys} new keys exceeds the stored-key limit: {stored} of {} \
                     keys stored",
                    self.cfg.max_stored_keys
                ),
            ));
        }
        Ok(incoming)
    }

    pub(super) fn commit(&mut self, session: SessionId, put: u64) -> Result<Response, RemoteError> {
        if self.puts.reading(session, put) {
            return Err(err(
                ErrorKind::BadRequest,
                format!("PUT {put} is pulled by the unit; there is nothing to commit"),
            ));
        }
        let pending = self
            .puts
            .pending
            .get(&(session, put))
            .ok_or_else(|| err(ErrorKind::UnknownTransfer, format!("no prepared PUT {put}")))?;
        if pending.written.as_ref().is_some_and(|w| !w.is_written()) {
            // Refused rather than zeroed: publishing the block would expose what it held
            // before (another client's cleared value), and zeroing every block before it is
            // exposed would cost a second pass over every payload. The PUT stays prepared (a
            // WRITE still landing may complete it) until it is committed again, cancelled or
            // expires.
            return Err(err(
                ErrorKind::BadRequest,
                format!(
                    "COMMIT of PUT {put} before its payload was written: WRITE every frame                      into the block the unit answered, then COMMIT"
                ),
            ));
        }
        let p = self
            .puts
            .remove(session, put)
            .ok_or_else(|| err(ErrorKind::UnknownTransfer, format!("no prepared PUT {put}")))?;
        self.store_put(p)?;
        Ok(self.stored(session))
    }

    /// What PUT `put` of `session` exposed, for the driver to wait (off the lock) for its
    /// WRITE's completion to be recorded before it hands over the COMMIT.
    pub fn put_written(&self, session: SessionId, put: u64) -> Option<Exposed> {
        self.puts.pending.get(&(session, put))?.written.clone()
    }

    /// CANCEL of `of`: a prepared PUT is released, or quarantined when its block may have been
    /// written; a GET not yet written is dropped.
    pub(super) fn cancel(
        &mut self,
        session: SessionId,
        of: u64,
        maybe_written: bool,
    ) -> Result<Response, RemoteError> {
        if self.puts.reading(session, of) {
            return Err(err(
                ErrorKind::BadRequest,
                format!("PUT {of} is being read by the unit; it cannot be cancelled"),
            ));
        }
        if let Some(p) = self.puts.remove(session, of) {
            if maybe_written {
                self.quarantine_put(session, p);
            }
            Ok(Response::Done)
        } else if self.gets.cancel(session, of) {
            Ok(Response::Done)
        } else {
            Err(err(
                ErrorKind::UnknownTransfer,
                format!("nothing prepared as {of}"),
            ))
        }
    }

    /// Stores the values of a PUT whose payload is in its block (committed or read). It was
    /// taken out of `Puts` already.
    fn store_put(&mut self, p: PendingPut) -> Result<(), RemoteError> {
        self.puts.bytes_in += p.size;
        let block_id = self.store.new_block(p.block_len, &p.partition);
        self.store_value(&p.partition, &p.indexes, &p.fields, p.value, Some(block_id))
    }

    /// Stores a PUT's value (see `Store::store`), compacting into this unit's memory, or
    /// leaves it to be stored in slices (`slice_store`); a fresh `block` nothing was stored
    /// in is forgotten.
    pub(super) fn store_value(
        &mut self,
        partition: &str,
        indexes: &[u64],
        fields: &[String],
        value: Value,
        block: Option<u64>,
    ) -> Result<(), RemoteError> {
        let Some(value) = self.slice_store(partition, indexes, fields, value, block)? else {
            return Ok(());
        };
        let c = Compaction::new(&mut self.mem, &self.cfg);
        let r = self
            .store
            .store(partition, indexes, fields, value, block, c);
        if let Some(b) = block {
            self.store.drop_if_unused(b);
        }
        r
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
        result: Result<(), PayloadError>,
    ) -> Vec<Output<M::Dest>> {
        if !self.puts.reading(session, put) {
            return Vec::new();
        }
        let Some(p) = self.puts.remove(session, put) else {
            return Vec::new();
        };
        let response = match result {
            Ok(()) => match self.store_put(p) {
                Ok(()) => Response::Done,
                Err(e) => Response::Error(e),
            },
            Err(e) => {
                tracing::warn!(session, put, error = %e, "PUT READ failed; block quarantined");
                self.quarantine_put(session, p);
                self.fail_session(session);
                Response::error(ErrorKind::Transfer, e.to_string())
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
        if !self.puts.reading(session, put) {
            return Vec::new();
        }
        self.puts.remove(session, put);
        vec![Output::Reply {
            session,
            id: put,
            response: Response::error(kind, reason),
        }]
    }
}

/// Whether a PUT's inline frames, if any, are all empty: its meta is all it carries, and
/// what the driver decoded of it ahead binds to an empty buffer.
pub fn inline_empty(inline: &Option<Vec<ByteBuf>>) -> bool {
    inline
        .as_ref()
        .is_none_or(|fs| fs.iter().all(|f| f.is_empty()))
}

/// The frames' `(offset, len)` ranges, empty ones left out and touching ones merged, so that a
/// WRITE the client coalesced across adjacent frames lies inside one exposed range.
pub(super) fn merged_ranges(offsets: &[u64], lens: &[u64]) -> Vec<(u64, u64)> {
    let mut frames: Vec<(u64, u64)> = offsets
        .iter()
        .zip(lens)
        .filter(|(_, l)| **l > 0)
        .map(|(o, l)| (*o, *l))
        .collect();
    frames.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(frames.len());
    for (o, l) in frames {
        match out.last_mut() {
            Some((po, pl)) if *po + *pl >= o => *pl = (*pl).max(o + l - *po),
            _ => out.push((o, l)),
        }
    }
    out
}

#[cfg(test)]
mod merge_tests {
    use super::merged_ranges;

    #[test]
    fn touching_frames_merge_and_gaps_stay() {
        assert_eq!(
            merged_ranges(&[128, 0, 64, 300], &[64, 64, 0, 4]),
            vec![(0, 64), (128, 64), (300, 4)]
        );
        assert_eq!(merged_ranges(&[0, 64], &[64, 64]), vec![(0, 128)]);
        assert!(merged_ranges(&[0], &[0]).is_empty());
    }

    #[test]
    fn a_merged_range_keeps_its_start_and_covers_its_last_frame() {
        assert_eq!(
            merged_ranges(&[192, 64, 128], &[64, 64, 64]),
            vec![(64, 192)]
        );
        // A frame inside the range does not extend it.
        assert_eq!(merged_ranges(&[64, 80], &[64, 16]), vec![(64, 64)]);
        assert_eq!(
            merged_ranges(&[4096, 64, 4160], &[64, 64, 32]),
            vec![(64, 64), (4096, 96)]
        );
    }
}
