//! Drives the client's side of a PUT ([`PutOp`]): sends what it asks, registers and WRITEs
//! the frames, and feeds it the answers.

use serde_bytes::ByteBuf;
use tessera_framecodec::{Frames, RecvLayout};
use tessera_sync::Arc;
use tessera_transport::{LocalDesc, RemoteDesc};

use super::conn::Conn;
use super::{Client, Slot};
use crate::core::client::{PutOp, PutStep};
use crate::error::{ClientError, MemoryError, PayloadError};
use crate::plane::{post_write, source_descs};
use crate::proto::{Credit, PullSource};

impl Client {
    pub(super) async fn put_unit(
        &self,
        slot: &Slot,
        partition: &str,
        indexes: Vec<u64>,
        fields: Vec<String>,
        frames: Frames,
    ) -> Result<(), ClientError> {
        let unit = slot.number;
        let conn = self.conn(slot).await?;
        let conn = &*conn;
        let inline = PutOp::is_inline(&frames, conn.inline_max);
        if !inline && conn.pull {
            return self
                .put_pulled(conn, partition, indexes, fields, &frames)
                .await;
        }
        // Laid out once, for the credit it fits and the WRITE into it (a layout that fails
        // is reported by the prepared PUT below).
        let credited = (!inline).then(|| conn.take_credit(&frames)).flatten();
        if let Some(credited) = credited {
            return self
                .put_credited(conn, partition, indexes, fields, frames, credited)
                .await;
        }
        let (mut op, first) = PutOp::new(
            unit,
            partition,
            indexes,
            fields,
            &frames,
            conn.inline_max,
            conn.align,
            None,
        );
        let PutStep::Send(req) = first else {
            return done(first);
        };
        let mut answer = conn.send(req, !inline)?;
        // Where the engine needs them, the frames are registered while the unit prepares its
        // block: once the request is on its way (the writer may share this thread's core).
        answer.sent().await;
        let frames = Arc::new(frames);
        let mut locals = (!inline && self.agent.local_side_needs_registration()).then(|| {
            source_descs(
                &self.agent,
                frames.payloads.iter().filter(|f| !f.is_empty()),
            )
        });
        let mut step = op.on_answer(answer.wait().await);
        loop {
            step = match step {
                PutStep::Done(r) => {
                    self.keep_credits(conn, &mut op);
                    return r;
                }
                PutStep::Send(req) => op.on_answer(conn.call(req).await),
                // A prepared PUT never asks for these (a credited one does, below).
                step @ (PutStep::SendWrite { .. } | PutStep::Await) => {
                    return Err(ClientError::ApiMisuse(format!(
                        "a prepared PUT's machine asked for {step:?}"
                    )))
                }
                PutStep::Write { descs, agent } => {
                    let ready = match (agent, locals.take()) {
                        (_, Some(Err(e))) => Err(ClientError::Memory(e)),
                        (_, None) if inline => {
                            Err(ClientError::ApiMisuse("a WRITE for an inline PUT".into()))
                        }
                        // The unit registered more memory: its peer handle learns the new
                        // registrations before any WRITE names them.
                        (Some(md), locals) => self
                            .agent
                            .add_remote(&md)
                            .map(|_| locals.and_then(Result::ok))
                            .map_err(|source| ClientError::Connect { unit, source }),
                        (None, locals) => Ok(locals.and_then(Result::ok)),
                    };
                    match ready {
                        // Nothing was written: the unit frees the block.
                        Err(e) => op.on_written(Err(e), false),
                        // The block may hold part of the payload if this fails: the unit
                        // quarantines it. No retry.
                        Ok(locals) => op.on_written(
                            self.write_frames(conn, &descs, &frames, locals).await,
                            true,
                        ),
                    }
                }
            };
        }
    }

    /// A PUT into one of the session's credits, which the frames' `layout` fits: one
    /// `PutCredited` stores the frames WRITEn into the credit's block while it travels (over
    /// `shm` a plain copy: the block is a standing exposure), so the copy overlaps the
    /// request's trip and the unit's wake-up.
    async fn put_credited(
        &self,
        conn: &Conn,
        partition: &str,
        indexes: Vec<u64>,
        fields: Vec<String>,
        frames: Frames,
        (credit, layout): (Credit, RecvLayout),
    ) -> Result<(), ClientError> {
        let (mut op, first) = PutOp::credited(
            conn.unit, partition, indexes, fields, &frames, layout, &credit,
        );
        let frames = Arc::new(frames);
        let PutStep::SendWrite { req, descs } = first else {
            return done(first);
        };
        let answer = conn.send(req, false)?;
        let written = self.write_frames(conn, &descs, &frames, None).await;
        let step = match op.on_written(written, true) {
            PutStep::Await => {
                answer.waiting_from_now();
                op.on_answer(answer.wait().await)
            }
            other => {
                // The unit waits for frames that will not come before it refuses the PUT;
                // the session's next requests would wait behind it.
                conn.abandon();
                other
            }
        };
        self.keep_credits(conn, &mut op);
        done(step)
    }

    /// Keeps the credits a PUT's answer brought, after the unit's new agent metadata (a
    /// credit may lie in memory it registered since). Credits this client cannot reach are
    /// left unused: the PUT's own outcome stands.
    fn keep_credits(&self, conn: &Conn, op: &mut PutOp) {
        let (credits, agent) = op.take_credits();
        if let Some(md) = agent {
            if self.agent.add_remote(&md).is_err() {
                return;
            }
        }
        conn.add_credits(credits);
    }

    /// A PUT whose payload the unit READs: the frames are registered in place (or found in a
    /// registration) and named in the request; they stay registered until the unit answered,
    /// or, when no answer comes, until the client drops.
    async fn put_pulled(
        &self,
        conn: &Conn,
        partition: &str,
        indexes: Vec<u64>,
        fields: Vec<String>,
        frames: &Frames,
    ) -> Result<(), ClientError> {
        let sources = source_descs(
            &self.agent,
            frames.payloads.iter().filter(|f| !f.is_empty()),
        )?;
        let mut it = sources.iter();
        let descs = frames
            .payloads
            .iter()
            .map(|f| match f.is_empty() {
                true => Some(RemoteDesc::new(0, 0, 0)),
                false => it.next().map(LocalDesc::to_remote),
            })
            .collect::<Option<Vec<_>>>()
            .ok_or(MemoryError::Described {
                frames: frames.payloads.iter().filter(|f| !f.is_empty()).count(),
                descs: sources.len(),
            })?;
        let pull = PullSource {
            descs,
            agent: ByteBuf::from(self.agent.metadata()),
        };
        let (mut op, first) = PutOp::new(
            conn.unit,
            partition,
            indexes,
            fields,
            frames,
            conn.inline_max,
            conn.align,
            Some(pull),
        );
        let PutStep::Send(req) = first else {
            return done(first);
        };
        let answer = conn.call(req).await;
        if matches!(answer, Err(ClientError::Timeout { .. })) {
            // No answer: the unit may still be reading these frames.
            self.held_sources
                .lock()
                .push((sources, frames.payloads.iter().cloned().collect()));
        } else {
            drop(sources);
        }
        done(op.on_answer(answer))
    }

    /// WRITEs the non-empty frames to `descs` in the unit's receive block: from `locals`,
    /// their descriptors in order, where they were registered beforehand, else as
    /// [`post_write`] does.
    async fn write_frames(
        &self,
        conn: &Conn,
        descs: &[RemoteDesc],
        frames: &Arc<Frames>,
        locals: Option<Vec<LocalDesc>>,
    ) -> Result<(), ClientError> {
        let terr = |source: PayloadError| ClientError::Transfer {
            unit: conn.unit,
            source,
        };
        let nonempty = || frames.payloads.iter().filter(|f| !f.is_empty());
        let count = nonempty().count();
        if descs.len() != count {
            return Err(MemoryError::Described {
                frames: count,
                descs: descs.len(),
            }
            .into());
        }
        let posted = match locals {
            Some(locals) => conn.peer.write(&locals, descs, None).map_err(Into::into),
            None => post_write(&self.agent, &conn.peer, nonempty(), frames.clone(), descs),
        };
        let t = posted.map_err(|e| match e {
            PayloadError::Memory(e) => ClientError::Memory(e),
            e => terr(e),
        })?;
        let after = self.timeout;
        match tokio::time::timeout(after, t).await {
            Ok(r) => r.map_err(|e| terr(e.into())),
            Err(_) => Err(terr(PayloadError::TimedOut { after })),
        }
    }
}

/// The result of a PUT whose machine asks for nothing more (a pulled PUT's only answer).
fn done(step: PutStep) -> Result<(), ClientError> {
    match step {
        PutStep::Done(r) => r,
        other => Err(ClientError::ApiMisuse(format!(
            "a PUT machine asked for {other:?} where it had nothing left to do"
        ))),
    }
}
