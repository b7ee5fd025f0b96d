//! Credits: landing blocks the unit keeps ready for a session, so that a PUT whose frames fit
//! one costs a single round trip. The client WRITEs its frames into the block it holds,
//! laid out from the meta at the block's start as for a prepared PUT, and sends
//! `PutCredited` as the WRITE starts; the unit waits until every frame is recorded as
//! written, keeps the frames' part of the block for the values (the rest goes back to the
//! pool) and stores them like a COMMIT.
//! Answers to pushed PUTs (`Stored`) top the session's credits back up.
//!
//! A credit is exposed to the session's agent from the moment it is granted, as a standing
//! exposure (over `shm` the client writes into it with no round trip at all), so it is
//! treated like a prepared PUT's block: used up by the one `PutCredited` naming it, whatever
//! the answer; back to the pool once its WRITE is recorded whole, otherwise (a refused PUT
//! whose WRITE may still be landing, a session closing with it unused) quarantined with its
//! session.
//!
//! Invariant kept here: `bytes` is the sum of the held credits' block lengths, and
//! `by_session` holds no empty entry.

use std::collections::HashMap;

use bytes::Bytes;
use serde_bytes::ByteBuf;
use tessera_framecodec::{DecodeError, Decoder, Unbound};

use super::put::merged_ranges;
use super::session::Quarantined;
use super::{err, Landed, Memory, SessionId, Unit};
use crate::error::{ErrorKind, RemoteError};
use crate::proto::{Credit, Response};

/// What a credit's size is rounded down to when the credit limit is split among many
/// sessions ([`Unit::credit_share`]).
const CREDIT_GRAIN: u64 = 64 << 10;

/// A credited PUT that passed its checks: its layout's size and its frames' `(offset, len)`
/// ranges.
type Checked = (u64, Vec<(u64, u64)>);

/// One credit: its block and the block's standing exposure to the session's agent.
pub(super) struct Held<B> {
    block: B,
    landing: Landed,
    len: u64,
    /// The meta of the PUT naming it, decoded while its WRITE lands.
    early: Option<Early>,
}

/// A credited PUT's meta decoded before its payload landed ([`Unit::credit_decoded`]), for
/// the request `id` alone: the value to bind, and its frames' merged ranges, so that the
/// PUT's handling neither parses the frame table nor lays it out again.
struct Early {
    id: u64,
    decoded: Result<(Unbound, Vec<(u64, u64)>), DecodeError>,
}

/// The credits of every session.
pub(super) struct Credits<B> {
    by_session: HashMap<SessionId, HashMap<u64, Held<B>>>,
    /// Bytes of the blocks held as credits.
    bytes: u64,
    next: u64,
}

impl<B> Default for Credits<B> {
    fn default() -> Self {
        Self {
            by_session: HashMap::new(),
            bytes: 0,
            next: 1,
        }
    }
}

impl<B> Credits<B> {
    /// Bytes of the blocks held as credits, by every session.
    pub(super) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Bytes of the blocks held as credits by `session`.
    pub(super) fn session_bytes(&self, session: SessionId) -> u64 {
        self.by_session
            .get(&session)
            .map_or(0, |c| c.values().map(|h| h.len).sum())
    }

    fn held(&self, session: SessionId) -> u64 {
        self.by_session.get(&session).map_or(0, |c| c.len() as u64)
    }

    fn insert(&mut self, session: SessionId, held: Held<B>) -> u64 {
        let id = self.next;
        self.next += 1;
        self.bytes += held.len;
        self.by_session.entry(session).or_default().insert(id, held);
        id
    }

    /// Takes credit `id` of `session` out.
    fn take(&mut self, session: SessionId, id: u64) -> Option<Held<B>> {
        let mine = self.by_session.get_mut(&session)?;
        let held = mine.remove(&id)?;
        if mine.is_empty() {
            self.by_session.remove(&session);
        }
        self.bytes -= held.len;
        Some(held)
    }

    /// Takes every credit of `session` out (its session closed).
    fn take_session(&mut self, session: SessionId) -> Vec<Held<B>> {
        let held: Vec<Held<B>> = self
            .by_session
            .remove(&session)
            .map(|c| c.into_values().collect())
            .unwrap_or_default();
        self.bytes -= held.iter().map(|h| h.len).sum::<u64>();
        held
    }

    /// Drops every credit (teardown).
    pub(super) fn clear(&mut self) {
        self.by_session.clear();
        self.bytes = 0;
    }
}

impl<M: Memory> Unit<M> {
    /// The answer to a pushed PUT that was stored: `Stored` with the session's credits topped
    /// up, where this unit grants credits (`Done` where it does not: pulled PUTs, credits
    /// off).
    pub(super) fn stored(&mut self, session: SessionId) -> Response {
        if self.pull_puts || self.cfg.credit_bytes == 0 || self.cfg.session_credits == 0 {
            return Response::Done;
        }
        Response::Stored {
            credits: self.top_up(session),
            agent: None,
        }
    }

    /// New credits for `session`, up to its share and of its size ([`Unit::credit_share`]),
    /// while the unit-wide `credit_limit`, the leased limits (with the prepared PUTs' leases)
    /// and the pool allow. None when any of them says no: the session then PUTs through
    /// prepared blocks.
    fn top_up(&mut self, session: SessionId) -> Vec<Credit> {
        let (share, size) = self.credit_share();
        let mut out = Vec::new();
        let peer = self.sessions.peer(session).to_owned();
        if peer.is_empty() {
            return out;
        }
        for _ in self.credits.held(session)..share {
            let mine = self.puts.session_leased(session) + self.credits.session_bytes(session);
            let fits = self.credits.bytes() + size <= self.cfg.credit_limit
                && mine + size <= self.cfg.session_leased_limit
                && self.puts.leased() + self.credits.bytes() + size <= self.cfg.leased_limit;
            if !fits {
                break;
            }
            let Ok(block) = self.mem.lease(size, self.cfg.align) else {
                break;
            };
            let (Ok(landing), Ok(desc)) = (
                self.mem.expose_landing(&block, &peer),
                self.mem.remote(&block, 0, size),
            ) else {
                break;
            };
            let len = M::block_len(&block);
            let id = self.credits.insert(
                session,
                Held {
                    block,
                    landing,
                    len,
                    early: None,
                },
            );
            out.push(Credit { id, block: desc });
        }
        out
    }

    /// How many credits one session may hold, and how large each is: `session_credits` of
    /// `credit_bytes`, or, where that many for every session that can hold credits (one
    /// whose agent the driver connected to) would pass `credit_limit`, an even split of the
    /// limit: fewer credits (at least one), and where even one of `credit_bytes` each would
    /// pass it, one smaller credit (the split rounded down to [`CREDIT_GRAIN`], no smaller
    /// than the unit's `inline_max`, below which PUTs travel in their request).
    ///
    /// Granted first come, first served, the limit went to the sessions that asked first, two
    /// credits each, and the others PUT through prepared blocks (two round trips) for as long
    /// as those held theirs: under 32 sessions of mixed requests, 60 % of the PUTs that fit a
    /// credit. A session that holds more than its share (it asked while fewer sessions were
    /// open) keeps what it holds and is not topped up past its share.
    fn credit_share(&self) -> (u64, u64) {
        let ready = self.sessions.ready().max(1) as u64;
        let split = self.cfg.credit_limit / ready;
        let floor = self.cfg.inline_max.max(CREDIT_GRAIN);
        let size = match split >= self.cfg.credit_bytes {
            true => self.cfg.credit_bytes,
            false => (split / CREDIT_GRAIN * CREDIT_GRAIN)
                .max(floor)
                .min(self.cfg.credit_bytes),
        };
        let each = split / size.max(1);
        (each.max(1).min(self.cfg.session_credits), size)
    }

    /// What credit `credit` of `session` records as written, and its block's length, for the
    /// driver to wait (off the lock) for a credited PUT's WRITE to be recorded before it
    /// hands the PUT over.
    pub fn credit_landing(&self, session: SessionId, credit: u64) -> Option<(Landed, u64)> {
        self.credits
            .by_session
            .get(&session)?
            .get(&credit)
            .map(|h| (h.landing.clone(), h.len))
    }

    /// The decoder and alignment the meta of a credited PUT into a credit of `len` bytes is
    /// decoded with, for the driver to decode it off the lock while the PUT's WRITE lands
    /// ([`Decoder::decode_unbound`]). Its payload may add up to the credit's bytes at most: a
    /// meta that says more is refused before its values are built (a few bytes of meta can
    /// declare runs of many tensors).
    pub fn meta_decoder(&self, len: u64) -> (Decoder, u64) {
        let mut limits = self.decoder.limits().clone();
        limits.max_total_bytes = limits.max_total_bytes.min(len);
        (Decoder::with_limits(limits), self.cfg.align)
    }

    /// What the driver decoded (with [`Unit::meta_decoder`]) of request `id`'s meta, a
    /// `PutCredited` naming credit `credit` of `session`: that request's handling binds it
    /// to the block instead of decoding the meta again. Ignored where the session holds no
    /// such credit.
    pub fn credit_decoded(
        &mut self,
        session: SessionId,
        credit: u64,
        id: u64,
        decoded: Result<Unbound, DecodeError>,
    ) {
        if let Some(held) = self
            .credits
            .by_session
            .get_mut(&session)
            .and_then(|c| c.get_mut(&credit))
        {
            let decoded = decoded.map(|u| {
                let ranges = merged_ranges(&u.layout().offsets, &u.layout().lens);
                (u, ranges)
            });
            held.early = Some(Early { id, decoded });
        }
    }

    /// `PutCredited`: the payload is in credit `credit`. The credit is used up whatever the
    /// outcome; on success its frames' part of the block holds the values and the rest goes
    /// back to the pool. A refused PUT's block goes back to the pool only when every frame is
    /// recorded as written (the client's WRITE is over: the driver waited for its record
    /// before handing the PUT over); otherwise the WRITE may still be landing, and the block is
    /// quarantined with the session.
    #[allow(clippy::too_many_arguments)] // the request's fields, as `Unit::handle` has them
    pub(super) fn put_credited(
        &mut self,
        session: SessionId,
        id: u64,
        partition: &str,
        indexes: &[u64],
        fields: &[String],
        meta: ByteBuf,
        credit: u64,
    ) -> Result<Response, RemoteError> {
        let mut held = self.credits.take(session, credit).ok_or_else(|| {
            err(
                ErrorKind::UnknownTransfer,
                format!("no credit {credit} held by this session"),
            )
        })?;
        // What was decoded while the WRITE landed, if it was this request's meta.
        let early = held.early.take().filter(|e| e.id == id);
        let (size, ranges) =
            match self.check_credited(partition, indexes, fields, &meta, &held, early.as_ref()) {
                Ok(checked) => checked,
                Err((e, written)) => {
                    if !written {
                        let Held { block, len, .. } = held;
                        self.sessions
                            .quarantine(session, Box::new(block), len, String::new());
                    }
                    return Err(e);
                }
            };
        if !held.landing.ranges_written(&ranges) {
            // Refused rather than stored: the block would publish what it held before. The
            // WRITE may still come: the block waits in quarantine.
            let Held { block, len, .. } = held;
            self.sessions
                .quarantine(session, Box::new(block), len, String::new());
            return Err(err(
                ErrorKind::BadRequest,
                format!(
                    "credit {credit} does not hold the PUT's payload: WRITE every frame into \
                     it (the unit waits for them up to its transfer timeout)"
                ),
            ));
        }
        let Held {
            mut block, landing, ..
        } = held;
        // Withdrawn first, so the block is this unit's alone; its unused end goes back.
        drop(landing);
        M::shrink(&mut block, size);
        let block_len = M::block_len(&block);
        let buf: Bytes = self.mem.freeze(block, size);
        // Laid out with the unit's alignment, as the client laid the frames out and the
        // checks above took their ranges.
        let value = match early {
            Some(e) => e.decoded.and_then(|(u, _)| u.bind(&buf)),
            None => self.decoder.decode_contiguous(&meta, &buf, self.cfg.align),
        }
        .map_err(|e| err(ErrorKind::Protocol, format!("decode: {e}")))?;
        self.puts.count_in(size);
        let block_id = self.store.new_block(block_len, partition);
        self.store_value(partition, indexes, fields, value, Some(block_id))?;
        Ok(self.stored(session))
    }

    /// The checks of a credited PUT before its payload is looked at: its layout's size and
    /// its frames' ranges (from `early`, its meta decoded while its WRITE landed, where that
    /// succeeded), or why it is refused and whether its frames are all recorded as written
    /// (only then may the block go straight back to the pool).
    fn check_credited(
        &self,
        partition: &str,
        indexes: &[u64],
        fields: &[String],
        meta: &ByteBuf,
        held: &Held<M::Block>,
        early: Option<&Early>,
    ) -> Result<Checked, (RemoteError, bool)> {
        let (size, ranges) = match early.map(|e| &e.decoded) {
            Some(Ok((u, ranges))) => (u.size(), ranges.clone()),
            _ => {
                let table = self
                    .decoder
                    .frame_table(meta)
                    .map_err(|e| (meta_error(e), false))?;
                let layout = table
                    .layout(self.cfg.align)
                    .map_err(|e| (err(ErrorKind::Protocol, format!("layout: {e}")), false))?;
                let ranges = merged_ranges(&layout.offsets, &layout.lens);
                (layout.size, ranges)
            }
        };
        // This request's meta, decoded ahead, was refused (a payload past the credit's bytes
        // among others): refused as the decoder said.
        if let Some(Err(e)) = early.map(|e| &e.decoded) {
            return Err((meta_error(e.clone()), held.landing.ranges_written(&ranges)));
        }
        if size > held.len {
            let e = err(
                ErrorKind::TooLarge,
                format!(
                    "a PUT of {size} bytes laid out does not fit its credit of {} bytes",
                    held.len
                ),
            );
            return Err((e, false));
        }
        let written = held.landing.ranges_written(&ranges);
        self.check_keys(indexes, fields)
            .and_then(|()| self.admit_put(partition, indexes, fields, size, meta.len() as u64))
            .map_err(|e| (e, written))?;
        Ok((size, ranges))
    }

    /// The credits of a closed session: quarantined like its exposed blocks (a WRITE into
    /// them may still be on its way).
    pub(super) fn close_credits(&mut self, session: SessionId) -> Vec<Quarantined> {
        self.credits
            .take_session(session)
            .into_iter()
            .map(|h| {
                let Held { block, len, .. } = h;
                (Box::new(block) as Box<dyn Send + Sync>, len, String::new())
            })
            .collect()
    }
}

/// The unit's error for a meta frame the decoder refused.
pub(super) fn meta_error(e: DecodeError) -> RemoteError {
    let kind = if matches!(
        e,
        DecodeError::MetaTooLarge { .. }
            | DecodeError::TooManyFrames { .. }
            | DecodeError::TooLarge { .. }
            | DecodeError::TooDeep { .. }
            | DecodeError::TooManyElements { .. }
            | DecodeError::RankTooHigh { .. }
    ) {
        ErrorKind::TooLarge
    } else {
        ErrorKind::Protocol
    };
    err(kind, format!("meta frame: {e}"))
}
