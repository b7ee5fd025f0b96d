//! GET: inline answers, and the deferred GET (GET_READY, the client's block in GET_INTO, the
//! unit's WRITE, GET_DONE), with the GETs waiting for their block or their WRITE.

use std::collections::HashMap;
use std::time::Instant;

use bytes::Bytes;
use serde_bytes::ByteBuf;
use tessera_framecodec::{Encoder, RecvLayout, Value};
use tessera_transport::RemoteDesc;

use super::{err, Memory, Output, PayloadError, SessionId, Unit};
use crate::error::{ErrorKind, RemoteError};
use crate::proto::{frame_descs, Response};

struct PendingGet {
    /// The payload frames, until they are handed to their WRITE.
    frames: Vec<Bytes>,
    /// Their bytes.
    bytes: u64,
    /// Where the client's block takes them: the layout of the meta sent with `GetReady`.
    layout: RecvLayout,
    writing: bool,
    deadline: Instant,
    /// A `GetOffer` written into the block it offered: its meta goes with the answer
    /// (`Written`), which no `GetReady` carried before.
    offered: Option<ByteBuf>,
}

/// GETs answered `GetReady`, by session and request id, until their WRITE is done.
#[derive(Default)]
pub(super) struct Gets {
    pending: HashMap<(SessionId, u64), PendingGet>,
    /// Payload bytes sent through the payload plane (GET WRITEs done).
    bytes_out: u64,
}

impl Gets {
    pub(super) fn len(&self) -> usize {
        self.pending.len()
    }

    pub(super) fn bytes_out(&self) -> u64 {
        self.bytes_out
    }

    /// Drops GET `of` of `session` if it is not being written; whether it did.
    pub(super) fn cancel(&mut self, session: SessionId, of: u64) -> bool {
        if self.pending.get(&(session, of)).is_some_and(|g| !g.writing) {
            self.pending.remove(&(session, of));
            true
        } else {
            false
        }
    }

    /// Drops every GET of `session`.
    pub(super) fn close_session(&mut self, session: SessionId) {
        self.pending.retain(|(s, _), _| *s != session);
    }

    /// The earliest deadline of a GET not being written.
    pub(super) fn next_deadline(&self) -> Option<Instant> {
        self.pending
            .values()
            .filter(|g| !g.writing)
            .map(|g| g.deadline)
            .min()
    }

    /// Drops the GETs not being written whose deadline passed at `now`.
    pub(super) fn expire(&mut self, now: Instant) {
        self.pending.retain(|_, g| g.writing || g.deadline > now);
    }

    /// Drops every GET (teardown); the bytes sent stay counted.
    pub(super) fn clear(&mut self) {
        self.pending.clear();
    }
}

/// What a GET leads to: an answer, or the WRITE into the block it offered, with the answer
/// sent ahead of it if any ([`Response::Writing`]).
enum Answer<D> {
    Reply(Response),
    Write {
        ahead: Option<Response>,
        write: Box<Output<D>>,
    },
}

/// Metas of at least this many bytes go ahead of the WRITE into an offered block
/// ([`Response::Writing`]): the client decodes them while the payload lands. About 250
/// tensors, whose decode takes longer than the extra message costs; a smaller meta comes
/// with the answer ([`Response::Written`]).
pub const EARLY_META_BYTES: usize = 8 << 10;

/// A GET looked up in slices ([`Unit::get_begin`]).
pub struct SlicedGet {
    session: SessionId,
    id: u64,
    partition: String,
    indexes: Vec<u64>,
    fields: Vec<String>,
    /// The first index not looked up yet.
    next: usize,
    columns: Vec<Vec<Value>>,
    missing: Vec<(String, u64)>,
    missing_count: u64,
}

impl SlicedGet {
    /// Whether every key looked up so far was found: its answer is the values, not an error.
    pub fn found(&self) -> bool {
        self.missing_count == 0
    }

    /// The session and request id.
    pub fn id(&self) -> (SessionId, u64) {
        (self.session, self.id)
    }

    /// The partition.
    pub fn partition(&self) -> &str {
        &self.partition
    }

    /// The values looked up, one list per field, or the keys missing.
    pub fn into_columns(self) -> Result<Vec<Value>, RemoteError> {
        if self.missing_count > 0 {
            return Err(super::store::missing_error(
                &self.partition,
                self.missing_count,
                self.missing,
            ));
        }
        Ok(self.columns.into_iter().map(Value::List).collect())
    }
}

/// The frames a WRITE carries: those with bytes.
fn nonempty(frames: Vec<Bytes>) -> Vec<Bytes> {
    frames.into_iter().filter(|f| !f.is_empty()).collect()
}

/// A GET's answer encoded (its payload checked against `max_payload_bytes`).
pub struct EncodedGet(tessera_framecodec::Frames);

/// Encodes a GET's columns as `cfg` allows. Pure: a driver may run it without the unit.
pub fn encode_get(cfg: &super::UnitConfig, columns: Vec<Value>) -> Result<EncodedGet, RemoteError> {
    let frames = Encoder::new()
        .encode(&Value::List(columns))
        .map_err(|e| err(ErrorKind::TooLarge, format!("encode: {e}")))?;
    if frames.payload_bytes() > cfg.max_payload_bytes {
        return Err(err(
            ErrorKind::TooLarge,
            "GET payload above max_payload_bytes",
        ));
    }
    Ok(EncodedGet(frames))
}

impl<M: Memory> Unit<M> {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn get(
        &mut self,
        now: Instant,
        session: SessionId,
        id: u64,
        partition: &str,
        indexes: &[u64],
        fields: &[String],
        offer: Option<RemoteDesc>,
    ) -> Vec<Output<M::Dest>> {
        let encoded = self.check_keys(indexes, fields).and_then(|()| {
            let columns = self.store.lookup(partition, indexes, fields)?;
            encode_get(&self.cfg, columns)
        });
        self.get_finish(now, session, id, encoded, offer)
    }

    /// Starts a GET that the driver looks up in slices ([`Unit::get_step`]) so that no hold of
    /// the unit's shared state grows with its key count; then it encodes the answer
    /// ([`encode_get`], without the unit) and ends it ([`Unit::get_finish`]). The caller
    /// checked the keys first ([`check_keys`](super::check_keys), also without the unit).
    /// Refused (the answer to send) in a session state that refuses requests.
    pub fn get_begin(
        &self,
        session: SessionId,
        id: u64,
        partition: String,
        indexes: Vec<u64>,
        fields: Vec<String>,
    ) -> Result<SlicedGet, Vec<Output<M::Dest>>> {
        if let Some((kind, why)) = self.refused_by_state(session, super::session::Step::Other) {
            return Err(vec![Output::Reply {
                session,
                id,
                response: Response::error(kind, why),
            }]);
        }
        Ok(SlicedGet {
            session,
            id,
            columns: fields.iter().map(|_| Vec::new()).collect(),
            partition,
            indexes,
            fields,
            next: 0,
            missing: Vec::new(),
            missing_count: 0,
        })
    }

    /// Looks up the next slice of GET `g` (about `slice_keys` keys); whether it is complete.
    pub fn get_step(&self, g: &mut SlicedGet) -> bool {
        let per = (self.cfg.slice_keys.max(1) as usize / g.fields.len().max(1)).max(1);
        let end = (g.next + per).min(g.indexes.len());
        self.store.lookup_into(
            &g.partition,
            &g.indexes[g.next..end],
            &g.fields,
            &mut g.columns,
            &mut g.missing,
            &mut g.missing_count,
        );
        g.next = end;
        g.next == g.indexes.len()
    }

    /// Ends a GET looked up in slices: its answer (`encoded` from [`SlicedGet::into_columns`]
    /// through [`encode_get`], or the keys missing).
    /// A `GetOffer`'s `offer` is the block the client offered.
    pub fn get_finish(
        &mut self,
        now: Instant,
        session: SessionId,
        id: u64,
        encoded: Result<EncodedGet, RemoteError>,
        offer: Option<RemoteDesc>,
    ) -> Vec<Output<M::Dest>> {
        match encoded.and_then(|e| self.answer_get(now, session, id, e, offer)) {
            Ok(Answer::Reply(response)) => vec![Output::Reply {
                session,
                id,
                response,
            }],
            Ok(Answer::Write { ahead, write }) => ahead
                .map(|response| Output::Reply {
                    session,
                    id,
                    response,
                })
                .into_iter()
                .chain([*write])
                .collect(),
            Err(e) => vec![Output::Reply {
                session,
                id,
                response: Response::Error(e),
            }],
        }
    }

    fn answer_get(
        &mut self,
        now: Instant,
        session: SessionId,
        id: u64,
        encoded: EncodedGet,
        offer: Option<RemoteDesc>,
    ) -> Result<Answer<M::Dest>, RemoteError> {
        let EncodedGet(frames) = encoded;
        let payload = frames.payload_bytes();
        let meta = ByteBuf::from(frames.meta.to_vec());
        if payload <= self.cfg.inline_max {
            return Ok(Answer::Reply(Response::Values {
                meta,
                frames: frames
                    .payloads
                    .iter()
                    .map(|f| ByteBuf::from(f.to_vec()))
                    .collect(),
            }));
        }
        let layout = frames
            .layout(self.cfg.align)
            .map_err(|e| err(ErrorKind::TooLarge, format!("layout: {e}")))?;
        if self.gets.pending.contains_key(&(session, id)) {
            return Err(err(ErrorKind::BadRequest, "request id already prepared"));
        }
        let frames: Vec<Bytes> = frames.payloads.into_iter().collect();
        // An offered block that holds the layout is written at once: one round trip.
        if let Some(descs) = offer.and_then(|b| frame_descs(&b, &layout).ok()) {
            // A large meta goes first, and the WRITE's end is answered `GetDone`.
            let (ahead, offered) = match meta.len() >= EARLY_META_BYTES {
                true => (Some(Response::Writing { meta }), None),
                false => (None, Some(meta)),
            };
            self.gets.pending.insert(
                (session, id),
                PendingGet {
                    frames: Vec::new(),
                    bytes: payload,
                    layout,
                    writing: true,
                    deadline: now + self.cfg.prepare_ttl,
                    offered,
                },
            );
            let write = Output::Write {
                session,
                id,
                get: id,
                frames: nonempty(frames),
                descs,
            };
            return Ok(Answer::Write {
                ahead,
                write: Box::new(write),
            });
        }
        self.gets.pending.insert(
            (session, id),
            PendingGet {
                frames,
                bytes: payload,
                layout,
                writing: false,
                deadline: now + self.cfg.prepare_ttl,
                offered: None,
            },
        );
        Ok(Answer::Reply(Response::GetReady { meta }))
    }

    pub(super) fn get_into(
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
        let Some(g) = self.gets.pending.get_mut(&(session, get)) else {
            return fail(ErrorKind::UnknownTransfer, format!("no prepared GET {get}"));
        };
        if g.writing {
            return fail(ErrorKind::BadRequest, format!("GET {get} already written"));
        }
        let descs = match frame_descs(&block, &g.layout) {
            Ok(d) => d,
            Err(e) => return fail(ErrorKind::BadRequest, e.to_string()),
        };
        g.writing = true;
        let frames = nonempty(std::mem::take(&mut g.frames));
        vec![Output::Write {
            session,
            id,
            get,
            frames,
            descs,
        }]
    }

    /// A WRITE posted for `Output::Write` finished.
    pub fn transfer_done(
        &mut self,
        session: SessionId,
        get: u64,
        id: u64,
        result: Result<(), PayloadError>,
    ) -> Vec<Output<M::Dest>> {
        let Some(get) = self.gets.pending.remove(&(session, get)) else {
            return Vec::new();
        };
        let response = match result {
            Ok(()) => {
                self.gets.bytes_out += get.bytes;
                match get.offered {
                    Some(meta) => Response::Written { meta },
                    None => Response::GetDone,
                }
            }
            Err(e) => {
                // The client's block may hold part of the payload: outcome unknown.
                self.fail_session(session);
                Response::error(ErrorKind::Transfer, e.to_string())
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
        self.gets.pending.remove(&(session, get));
        vec![Output::Reply {
            session,
            id,
            response: Response::error(ErrorKind::Busy, reason),
        }]
    }
}
