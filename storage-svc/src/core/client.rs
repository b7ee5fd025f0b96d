//! The client's side of the protocol as plain code, beside the unit's [`Unit`](super::Unit):
//! one machine per operation on one unit ([`PutOp`], [`GetOp`]), fed the unit's answers and
//! the outcome of the client's own steps, answering with the next step ([`PutStep`],
//! [`GetStep`]): a request to send, the frames to WRITE, a receive block to lease, the landed
//! block to decode, or the result. No I/O, no clock: the driver (`Client`) sends, writes,
//! leases and times out, and the tests drive a machine against the unit's core with no
//! sockets (`tests/client_core.rs`).
//!
//! - PUT, pushed: `PUT` → `PUT_READY` → the frames WRITEn into the block → `COMMIT` → `DONE`;
//!   a failure before the WRITE cancels (`maybe_written: false`), after it starts cancels with
//!   `maybe_written: true`. Inline (payload up to `inline_max`): `PUT` → `DONE`.
//! - PUT, credited (a credit the unit granted holds the frames): the frames WRITEn into the
//!   credit's block → `PUT_CREDITED` → `STORED`; one round trip. A pushed PUT's answer,
//!   `STORED`, brings the session new credits ([`PutOp::take_credits`]).
//! - PUT, pulled (the one-sided engines): `PUT` naming the frames → `DONE` once the unit has
//!   READ them.
//! - GET: `GET` → `VALUES` (inline), or `GET_READY` → a block leased from the client's pool →
//!   `GET_INTO` → the unit's WRITE → `GET_DONE` → the block decoded; a failure to lease
//!   cancels the GET. Offered: `GET_OFFER` naming a block leased before → the unit's WRITE →
//!   `WRITTEN` → the block decoded (one round trip); or, the values not fitting the block,
//!   `GET_READY` and on as above (the offered block untouched).

use bytes::Bytes;
use serde_bytes::ByteBuf;
use tessera_framecodec::{
    decode_contiguous, DecodeError, Decoder, Frames, LayoutError, RecvLayout, Unbound, Value,
};
use tessera_transport::RemoteDesc;

use super::decode_inline;
use crate::error::{ClientError, ErrorKind, MemoryError, PayloadError};
use crate::proto::{frame_descs, Credit, PullSource, Request, Response};

/// What the driver does next for a PUT.
#[derive(Debug)]
#[must_use]
pub enum PutStep {
    /// Send this request and feed its answer (or the failure to get one) to
    /// [`PutOp::on_answer`].
    Send(Request),
    /// WRITE the PUT's non-empty payload frames, in order, to `descs` on the unit's agent
    /// (adding the unit's agent metadata `agent` first, when given), then report the outcome
    /// to [`PutOp::on_written`].
    Write {
        /// One descriptor per non-empty frame, in the unit's block.
        descs: Vec<RemoteDesc>,
        /// The unit's new agent metadata (it registered more memory), if any.
        agent: Option<Vec<u8>>,
    },
    /// Send `req` and, while it travels, WRITE the PUT's non-empty frames, in order, to
    /// `descs` (a credit's block); report the WRITE's outcome to [`PutOp::on_written`], then,
    /// when that asks for it ([`PutStep::Await`]), the request's answer to
    /// [`PutOp::on_answer`]. The unit waits to see the frames recorded as written before it
    /// looks at them, so the request and the WRITE may arrive in any order.
    SendWrite {
        /// The `PutCredited`.
        req: Request,
        /// One descriptor per non-empty frame, in the credit's block.
        descs: Vec<RemoteDesc>,
    },
    /// Feed the answer to the request sent with [`PutStep::SendWrite`] to
    /// [`PutOp::on_answer`].
    Await,
    /// The PUT is over.
    Done(Result<(), ClientError>),
}

/// What the driver does next for a GET.
#[derive(Debug)]
#[must_use]
pub enum GetStep {
    /// Send this request and feed its answer (or the failure to get one) to
    /// [`GetOp::on_answer`]; an answer to `GetInto` is awaited at most the client's timeout
    /// ([`GetOp::on_timeout`]).
    Send(Request),
    /// Lease a receive block laid out as `layout` (at least one byte) and report its
    /// descriptor to [`GetOp::on_block`].
    Lease {
        /// Where each frame goes in the block.
        layout: RecvLayout,
    },
    /// The unit wrote the block: freeze its first `layout.size` bytes and hand them to
    /// [`GetOp::on_landed`].
    Land,
    /// The GET is over: one list per field, one value per index.
    Done(Result<Columns, ClientError>),
}

/// An answer the protocol does not allow here: the unit's error, or an unexpected response.
pub fn unexpected(unit: usize, resp: Response) -> ClientError {
    match resp {
        Response::Error(source) => ClientError::Remote { unit, source },
        other => ClientError::Unexpected {
            unit,
            what: format!("{other:?}").chars().take(200).collect(),
        },
    }
}

/// How a PUT's payload travels.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// In the PUT itself.
    Inline,
    /// WRITEn by the client into a block the unit exposes.
    Pushed,
    /// READ by the unit from the frames the PUT names.
    Pulled,
}

enum PutState {
    /// The PUT is on its way.
    Sent(Mode),
    /// The frames are being written into a credit, its `PutCredited` on its way.
    WritingCredit,
    /// The unit answered READY for `put`; the frames are being written.
    Writing {
        put: u64,
    },
    /// The frames are written; COMMIT is on its way.
    Committing,
    /// A CANCEL is on its way; the PUT fails with `error` whatever it is answered.
    Cancelling {
        error: ClientError,
    },
    Done,
}

/// The client's side of one PUT on one unit.
pub struct PutOp {
    unit: usize,
    /// Where the frames go in the unit's block (the unit's alignment), taken once READY came.
    layout: Option<Result<RecvLayout, LayoutError>>,
    /// Non-empty payload frames: one descriptor each.
    nonempty: usize,
    state: PutState,
    /// Credits (and the unit's new metadata) that came with the answer.
    credits: Vec<Credit>,
    agent: Option<Vec<u8>>,
}

impl PutOp {
    /// A PUT of `frames` (encoded values) at `indexes` x `fields` of `partition` on `unit`,
    /// whose HELLO said `inline_max` and `align`. With `pull` (the unit's backend pulls PUT
    /// payloads), a payload above `inline_max` is named by these sources instead of pushed.
    /// Returns the machine and its first step (the PUT to send).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        unit: usize,
        partition: &str,
        indexes: Vec<u64>,
        fields: Vec<String>,
        frames: &Frames,
        inline_max: u64,
        align: u64,
        pull: Option<PullSource>,
    ) -> (Self, PutStep) {
        let inline = Self::is_inline(frames, inline_max);
        let pull = if inline { None } else { pull };
        let mode = match (inline, &pull) {
            (true, _) => Mode::Inline,
            (false, None) => Mode::Pushed,
            (false, Some(_)) => Mode::Pulled,
        };
        let req = Request::Put {
            partition: partition.to_owned(),
            indexes,
            fields,
            meta: ByteBuf::from(frames.meta.to_vec()),
            inline: inline.then(|| {
                frames
                    .payloads
                    .iter()
                    .map(|f| ByteBuf::from(f.to_vec()))
                    .collect()
            }),
            pull,
        };
        let op = Self {
            unit,
            layout: Some(frames.layout(align)),
            nonempty: frames.payloads.iter().filter(|f| !f.is_empty()).count(),
            state: PutState::Sent(mode),
            credits: Vec::new(),
            agent: None,
        };
        (op, PutStep::Send(req))
    }

    /// A PUT of `frames` into `credit`, one of the session's credits, which `layout` (the
    /// frames laid out with the unit's alignment) fits. The first step sends the
    /// `PutCredited` and WRITEs the frames into the credit's block meanwhile
    /// ([`PutStep::SendWrite`]): the request's trip and the unit's wake-up overlap the copy.
    #[allow(clippy::too_many_arguments)]
    pub fn credited(
        unit: usize,
        partition: &str,
        indexes: Vec<u64>,
        fields: Vec<String>,
        frames: &Frames,
        layout: RecvLayout,
        credit: &Credit,
    ) -> (Self, PutStep) {
        let req = Request::PutCredited {
            partition: partition.to_owned(),
            indexes,
            fields,
            meta: ByteBuf::from(frames.meta.to_vec()),
            credit: credit.id,
            bytes: frames.payload_bytes(),
        };
        let mut op = Self {
            unit,
            layout: Some(Ok(layout)),
            nonempty: frames.payloads.iter().filter(|f| !f.is_empty()).count(),
            state: PutState::Done,
            credits: Vec::new(),
            agent: None,
        };
        let step = match op.descs(&credit.block) {
            Ok(descs) => {
                op.state = PutState::WritingCredit;
                PutStep::SendWrite { req, descs }
            }
            Err(e) => PutStep::Done(Err(e)),
        };
        (op, step)
    }

    /// The credits the unit granted with its answer, and its new agent metadata (to add
    /// before writing into them), if any.
    pub fn take_credits(&mut self) -> (Vec<Credit>, Option<Vec<u8>>) {
        (std::mem::take(&mut self.credits), self.agent.take())
    }

    fn stored(&mut self, credits: Vec<Credit>, agent: Option<ByteBuf>) -> PutStep {
        self.credits = credits;
        self.agent = agent.map(ByteBuf::into_vec);
        PutStep::Done(Ok(()))
    }

    /// Whether the PUT goes inline for a unit that said `inline_max` (then it needs neither
    /// registered frames nor sources).
    pub fn is_inline(frames: &Frames, inline_max: u64) -> bool {
        frames.payload_bytes() <= inline_max
    }

    /// The answer to the last request sent: `(request id, response)`, or why none came.
    pub fn on_answer(&mut self, answer: Result<(u64, Response), ClientError>) -> PutStep {
        let state = std::mem::replace(&mut self.state, PutState::Done);
        match (state, answer) {
            (PutState::Cancelling { error }, _) => PutStep::Done(Err(error)),
            (_, Err(e)) => PutStep::Done(Err(e)),
            (PutState::Sent(_), Ok((_, Response::Done))) => PutStep::Done(Ok(())),
            (PutState::Sent(Mode::Pushed), Ok((put, Response::PutReady { block, agent }))) => {
                match self.descs(&block) {
                    Ok(descs) => {
                        self.state = PutState::Writing { put };
                        PutStep::Write {
                            descs,
                            agent: agent.map(ByteBuf::into_vec),
                        }
                    }
                    Err(error) => self.cancel(put, false, error),
                }
            }
            (PutState::Sent(Mode::Inline), Ok((put, r @ Response::PutReady { .. }))) => {
                // Nothing is written into a block this PUT never asked for: the unit frees it.
                let error = ClientError::Unexpected {
                    unit: self.unit,
                    what: format!("{r:?}").chars().take(200).collect(),
                };
                self.cancel(put, false, error)
            }
            (PutState::Committing, Ok((_, Response::Done))) => PutStep::Done(Ok(())),
            (PutState::Committing, Ok((_, Response::Stored { credits, agent }))) => {
                self.stored(credits, agent)
            }
            (_, Ok((_, other))) => PutStep::Done(Err(unexpected(self.unit, other))),
        }
    }

    /// The WRITE asked for by [`PutStep::Write`] ended: `Ok` once every frame landed; otherwise
    /// the error, and whether any byte may have been written (`false` when the WRITE never
    /// started: the unit's agent or the frames' registration failed).
    pub fn on_written(&mut self, result: Result<(), ClientError>, maybe_written: bool) -> PutStep {
        let put = match std::mem::replace(&mut self.state, PutState::Done) {
            PutState::Writing { put } => put,
            PutState::WritingCredit => {
                // A failed WRITE into a credit leaves nothing to cancel: the unit, finding the
                // frames not written, refuses the PUT and the credit is used up.
                return match result {
                    Ok(()) => {
                        self.state = PutState::Committing;
                        PutStep::Await
                    }
                    Err(e) => PutStep::Done(Err(e)),
                };
            }
            _ => {
                return PutStep::Done(Err(ClientError::ApiMisuse(
                    "on_written without a WRITE asked for".into(),
                )))
            }
        };
        match result {
            Ok(()) => {
                self.state = PutState::Committing;
                PutStep::Send(Request::Commit { put })
            }
            Err(error) => self.cancel(put, maybe_written, error),
        }
    }

    /// Where the frames go in the unit's block: one descriptor per non-empty frame.
    fn descs(&mut self, block: &RemoteDesc) -> Result<Vec<RemoteDesc>, ClientError> {
        let layout = self
            .layout
            .take()
            .ok_or_else(|| ClientError::ApiMisuse("a second READY for one PUT".into()))??;
        let descs = frame_descs(block, &layout)?;
        let frames = self.nonempty;
        if descs.len() != frames {
            return Err(MemoryError::Described {
                frames,
                descs: descs.len(),
            }
            .into());
        }
        Ok(descs)
    }

    fn cancel(&mut self, put: u64, maybe_written: bool, error: ClientError) -> PutStep {
        self.state = PutState::Cancelling { error };
        PutStep::Send(Request::Cancel {
            of: put,
            maybe_written,
        })
    }
}

enum GetState {
    Sent,
    /// A `GetOffer` is on its way; the unit may WRITE into the offered block.
    Offered,
    /// The unit prepared GET `get`; a block is being leased.
    Leasing {
        get: u64,
        meta: ByteBuf,
        layout: RecvLayout,
    },
    /// GET_INTO is on its way, or the unit said it writes into the offered block
    /// ([`Response::Writing`]); the unit WRITEs into the block. `ahead`: the meta decoded
    /// meanwhile, when it was.
    Writing {
        meta: ByteBuf,
        layout: RecvLayout,
        ahead: Option<Result<Unbound, DecodeError>>,
    },
    /// GET_DONE came; the block is being frozen.
    Landing {
        meta: ByteBuf,
        layout: RecvLayout,
        ahead: Option<Result<Unbound, DecodeError>>,
    },
    /// The unit sent a meta ahead of its WRITE that does not lay out: the GET fails once the
    /// WRITE is over, and the block stays out of the pool.
    Spoiled {
        error: ClientError,
    },
    Cancelling {
        error: ClientError,
    },
    Done,
}

/// The values of one GET on one unit: one list per field, one value per index.
pub type Columns = Vec<Vec<Value>>;

/// The client's side of one GET on one unit.
pub struct GetOp {
    unit: usize,
    indexes: usize,
    fields: usize,
    align: u64,
    decoder: Decoder,
    state: GetState,
    /// The block may hold part of a WRITE: keep it out of the pool.
    quarantine: bool,
}

impl GetOp {
    fn start(
        unit: usize,
        indexes: &[u64],
        fields: &[String],
        align: u64,
        decoder: Decoder,
        state: GetState,
    ) -> Self {
        Self {
            unit,
            indexes: indexes.len(),
            fields: fields.len(),
            align,
            decoder,
            state,
            quarantine: false,
        }
    }

    /// A GET of `indexes` x `fields` of `partition` on `unit`, whose HELLO said `align`;
    /// `decoder` checks the answer's meta frame. Returns the machine and the GET to send.
    pub fn new(
        unit: usize,
        partition: &str,
        indexes: Vec<u64>,
        fields: Vec<String>,
        align: u64,
        decoder: Decoder,
    ) -> (Self, GetStep) {
        let op = Self::start(unit, &indexes, &fields, align, decoder, GetState::Sent);
        let req = Request::Get {
            partition: partition.to_owned(),
            indexes,
            fields,
        };
        (op, GetStep::Send(req))
    }

    /// A GET of `indexes` x `fields` of `partition` on `unit` that offers `block`, a block
    /// of the client's receive pool: when the values fit it laid out from their meta at its
    /// start, the unit WRITEs them there and answers `Written` (the driver then lands the
    /// block, [`GetStep::Land`]); otherwise the GET goes on as [`GetOp::new`]'s does and the
    /// offered block was never touched ([`GetOp::offer_untouched`]). An answer that does not
    /// come in time ([`GetOp::on_timeout`]) leaves the offered block to quarantine.
    pub fn offered(
        unit: usize,
        partition: &str,
        indexes: Vec<u64>,
        fields: Vec<String>,
        align: u64,
        decoder: Decoder,
        block: RemoteDesc,
    ) -> (Self, GetStep) {
        let op = Self::start(unit, &indexes, &fields, align, decoder, GetState::Offered);
        let req = Request::GetOffer {
            partition: partition.to_owned(),
            indexes,
            fields,
            block,
        };
        (op, GetStep::Send(req))
    }

    /// The bytes of the block the values occupy, once [`GetStep::Land`] was asked for.
    pub fn landed_size(&self) -> Option<u64> {
        match &self.state {
            GetState::Landing { layout, .. } => Some(layout.size),
            _ => None,
        }
    }

    /// After the answer to a `GetOffer`: whether the unit left the offered block alone (it
    /// answered inline, asked for a block of another size, or refused the GET before any
    /// WRITE), so that it can go back to the pool.
    pub fn offer_untouched(&self) -> bool {
        !self.quarantine && !matches!(self.state, GetState::Landing { .. })
    }

    /// The answer to the last request sent: `(request id, response)`, or why none came.
    pub fn on_answer(&mut self, answer: Result<(u64, Response), ClientError>) -> GetStep {
        let state = std::mem::replace(&mut self.state, GetState::Done);
        match (state, answer) {
            (GetState::Cancelling { error }, _) => GetStep::Done(Err(error)),
            (GetState::Offered, Ok((_, Response::Written { meta }))) => {
                match self.layout_of(&meta) {
                    Ok(layout) => {
                        self.state = GetState::Landing {
                            meta,
                            layout,
                            ahead: None,
                        };
                        GetStep::Land
                    }
                    Err(e) => GetStep::Done(Err(e)),
                }
            }
            (GetState::Offered, Ok((get, Response::GetReady { meta }))) => {
                self.on_answer_ready(get, meta)
            }
            (GetState::Writing { .. } | GetState::Offered, Err(e)) => {
                // A failed WRITE may have reached the block: outcome unknown.
                if matches!(&e, ClientError::Remote { source, .. } if source.kind == ErrorKind::Transfer)
                {
                    self.quarantine = true;
                }
                GetStep::Done(Err(e))
            }
            (
                GetState::Writing {
                    meta,
                    layout,
                    ahead,
                },
                Ok((_, Response::GetDone)),
            ) => {
                self.state = GetState::Landing {
                    meta,
                    layout,
                    ahead,
                };
                GetStep::Land
            }
            (GetState::Spoiled { error }, _) => {
                self.quarantine = true;
                GetStep::Done(Err(error))
            }
            (_, Err(e)) => GetStep::Done(Err(e)),
            (GetState::Sent | GetState::Offered, Ok((_, Response::Values { meta, frames }))) => {
                GetStep::Done(
                    decode_inline(&meta, frames)
                        .map_err(Into::into)
                        .and_then(|v| self.columns(v)),
                )
            }
            (GetState::Sent, Ok((get, Response::GetReady { meta }))) => {
                self.on_answer_ready(get, meta)
            }
            (_, Ok((_, other))) => GetStep::Done(Err(unexpected(self.unit, other))),
        }
    }

    /// Where the frames `meta` describes lie in the block they are written into.
    fn layout_of(&self, meta: &[u8]) -> Result<RecvLayout, ClientError> {
        let table = self.decoder.frame_table(meta)?;
        Ok(table.layout(self.align)?)
    }

    /// `GetReady`: a block of the layout `meta` asks for is to be leased.
    fn on_answer_ready(&mut self, get: u64, meta: ByteBuf) -> GetStep {
        let layout = match self.layout_of(&meta) {
            Ok(l) => l,
            Err(e) => return GetStep::Done(Err(e)),
        };
        self.state = GetState::Leasing {
            get,
            meta,
            layout: layout.clone(),
        };
        GetStep::Lease { layout }
    }

    /// The block asked for by [`GetStep::Lease`]: its descriptor, or why there is none (the
    /// GET is then cancelled and fails with that error).
    pub fn on_block(&mut self, block: Result<RemoteDesc, ClientError>) -> GetStep {
        let GetState::Leasing { get, meta, layout } =
            std::mem::replace(&mut self.state, GetState::Done)
        else {
            return GetStep::Done(Err(ClientError::ApiMisuse(
                "on_block without a block asked for".into(),
            )));
        };
        match block {
            Ok(block) => {
                self.state = GetState::Writing {
                    meta,
                    layout,
                    ahead: None,
                };
                GetStep::Send(Request::GetInto { get, block })
            }
            Err(error) => {
                self.state = GetState::Cancelling { error };
                GetStep::Send(Request::Cancel {
                    of: get,
                    maybe_written: false,
                })
            }
        }
    }

    /// No answer to GET_INTO came in time: the unit may still write into the block.
    pub fn on_timeout(&mut self, after: std::time::Duration) -> GetStep {
        self.state = GetState::Done;
        self.quarantine = true;
        GetStep::Done(Err(ClientError::Transfer {
            unit: self.unit,
            source: PayloadError::TimedOut { after },
        }))
    }

    /// The landed block's bytes (the first `layout.size` of it), frozen: the values are
    /// views of it.
    pub fn on_landed(&mut self, buf: Bytes) -> GetStep {
        let GetState::Landing { meta, ahead, .. } =
            std::mem::replace(&mut self.state, GetState::Done)
        else {
            return GetStep::Done(Err(ClientError::ApiMisuse(
                "on_landed without a block landed".into(),
            )));
        };
        let value = match ahead {
            // Decoded while the payload landed: only the binding is left.
            Some(unbound) => unbound.and_then(|u| u.bind(&buf)),
            None => decode_contiguous(&meta, &buf, self.align),
        };
        GetStep::Done(value.map_err(Into::into).and_then(|v| self.columns(v)))
    }

    /// [`Response::Writing`], ahead of the answer to a `GetOffer`: the unit WRITEs the values
    /// into the offered block, laid out from `meta`, which is decoded now, while they land.
    /// The request's answer is still to come ([`GetOp::on_answer`]).
    pub fn on_ahead(&mut self, meta: ByteBuf) {
        let state = std::mem::replace(&mut self.state, GetState::Done);
        self.state = match state {
            GetState::Offered => match self.layout_of(&meta) {
                Ok(layout) => {
                    let ahead = Some(self.decoder.decode_unbound(&meta, self.align));
                    GetState::Writing {
                        meta,
                        layout,
                        ahead,
                    }
                }
                Err(error) => GetState::Spoiled { error },
            },
            // Only a `GetOffer` is answered ahead.
            _ => GetState::Spoiled {
                error: unexpected(self.unit, Response::Writing { meta }),
            },
        };
    }

    /// Whether the receive block must be kept out of the pool (a WRITE into it may still
    /// land): the driver holds it until the client drops.
    pub fn quarantine_block(&self) -> bool {
        self.quarantine
    }

    /// The answer's value as one list per field, each with one value per index.
    fn columns(&self, value: Value) -> Result<Columns, ClientError> {
        let bad = || unexpected(self.unit, Response::GetDone);
        let Value::List(cols) = value else {
            return Err(bad());
        };
        if cols.len() != self.fields {
            return Err(bad());
        }
        cols.into_iter()
            .map(|c| match c {
                Value::List(items) if items.len() == self.indexes => Ok(items),
                _ => Err(bad()),
            })
            .collect()
    }
}
