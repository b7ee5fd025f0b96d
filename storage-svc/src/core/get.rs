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
    frames: Vec<Bytes>,
    /// Where the client's block takes them: the layout of the meta sent with `GetReady`.
    layout: RecvLayout,
    writing: bool,
    deadline: Instant,
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

impl<M: Memory> Unit<M> {
    pub(super) fn get(
        &mut self,
        now: Instant,
        session: SessionId,
        id: u64,
        partition: &str,
        indexes: &[u64],
        fields: &[String],
    ) -> Result<Response, RemoteError> {
        self.check_keys(indexes, fields)?;
        let columns = self.store.lookup(partition, indexes, fields)?;
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
        self.gets.pending.insert(
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
        let frames: Vec<Bytes> = g.frames.iter().filter(|f| !f.is_empty()).cloned().collect();
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
                self.gets.bytes_out += get.frames.iter().map(|f| f.len() as u64).sum::<u64>();
                Response::GetDone
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
