//! Drives the client's side of a GET ([`GetOp`]): sends what it asks, leases and freezes the
//! receive block, and feeds it the answers.

use tessera_framecodec::Value;

use super::conn::{shape, Conn};
use super::{Client, Slot};
use crate::core::client::{GetOp, GetStep};
use crate::error::ClientError;
use crate::plane::freeze_written;
use crate::proto::Request;
use tessera_transport::engine::WriteWatch;
use tessera_transport::{Exposure, RemoteDesc};

impl Client {
    pub(super) async fn get_unit(
        &self,
        slot: &Slot,
        partition: &str,
        indexes: Vec<u64>,
        fields: Vec<String>,
    ) -> Result<Vec<Vec<Value>>, ClientError> {
        let unit = slot.number;
        let conn = self.conn(slot).await?;
        let conn = &*conn;
        let shape = shape(&fields, indexes.len());
        // A GET of a shape seen before offers a block of about its size up front: one round
        // trip when the values fit it. The block is a standing exposure to the unit's agent,
        // which can then WRITE into it without asking first (`shm`), and its WRITE wakes no
        // thread here: the answer, which follows it, says it landed.
        let offered = conn
            .offer_for(shape)
            .and_then(|size| self.offer(conn, size));
        let (mut op, mut step) = match &offered {
            Some((_, _, _, desc)) => GetOp::offered(
                unit,
                partition,
                indexes,
                fields,
                conn.align,
                self.decoder.clone(),
                *desc,
            ),
            None => GetOp::new(
                unit,
                partition,
                indexes,
                fields,
                conn.align,
                self.decoder.clone(),
            ),
        };
        let mut offered = offered.map(|(b, e, w, _)| (b, (w, e)));
        // The receive block and the bytes of it the frames occupy.
        let mut block: Option<(tessera_transport::PoolBlock, u64)> = None;
        loop {
            step = match step {
                GetStep::Done(r) => {
                    if r.is_ok() && block.is_none() && offered.is_some() {
                        // Answered inline: the values were too small for the payload plane,
                        // so the next GET of this shape offers no block (nor announces one
                        // to the unit) until one of its shape is laid out again.
                        conn.answered_inline(shape);
                    }
                    if op.quarantine_block() {
                        // The unit may still write into the block: keep it out of the pool.
                        if let Some((b, _)) = block.take() {
                            self.quarantine.lock().push(b);
                        }
                        if let Some((b, _)) = offered.take() {
                            self.quarantine.lock().push(b);
                        }
                    }
                    return r;
                }
                GetStep::Send(req @ Request::GetOffer { .. }) => match conn.send_offer(req) {
                    Ok(mut answer) => {
                        // A large meta comes ahead of the WRITE: decoded while the values
                        // land. The answer is awaited from then.
                        if let Some(meta) = answer.ahead().await {
                            op.on_ahead(meta);
                            answer.waiting_from_now();
                        }
                        match answer.wait().await {
                            Err(ClientError::Timeout { .. }) => op.on_timeout(self.timeout),
                            answer => op.on_answer(answer),
                        }
                    }
                    Err(e) => op.on_answer(Err(e)),
                },
                GetStep::Send(req @ Request::GetInto { .. }) => {
                    // The answer's own deadline (which first takes an answer already there).
                    match conn.call(req).await {
                        Err(ClientError::Timeout { .. }) => op.on_timeout(self.timeout),
                        answer => op.on_answer(answer),
                    }
                }
                GetStep::Send(req) => op.on_answer(conn.call(req).await),
                GetStep::Lease { layout } => {
                    conn.laid_out(shape, layout.size);
                    // The values did not fit the offered block, which the unit left alone.
                    if op.offer_untouched() {
                        drop(offered.take());
                    }
                    let len = layout.size.max(1);
                    match self.pool.lease(len, layout.align) {
                        // The unit lays the frames out in the block as this client did.
                        Ok(b) => match b.remote_range(0, len) {
                            Ok(exposed) => {
                                block = Some((b, layout.size));
                                op.on_block(Ok(exposed))
                            }
                            Err(e) => op.on_block(Err(ClientError::Memory(e.into()))),
                        },
                        Err(e) => op.on_block(Err(ClientError::from_pool(e))),
                    }
                }
                GetStep::Land => {
                    let landed = match (block.take(), offered.take()) {
                        (Some(b), _) => Some(b),
                        // Written into the offered block: laid out as its meta says.
                        (None, Some((b, watched))) => {
                            // The watch ends (taking the WRITE's record), then the exposure.
                            drop(watched);
                            let size = op.landed_size().unwrap_or(0);
                            conn.laid_out(shape, size);
                            Some((b, size))
                        }
                        (None, None) => None,
                    };
                    let Some((b, size)) = landed else {
                        return Err(ClientError::ApiMisuse(
                            "a GET landed without a receive block".into(),
                        ));
                    };
                    op.on_landed(freeze_written(b, size)?)
                }
            };
        }
    }

    /// A block of `size` bytes of the receive pool offered to `conn`'s unit, standing: the
    /// block, its exposure, the watch that keeps the unit's WRITE from waking this agent's
    /// engine (its record is taken when the watch ends) and its descriptor. `None` when the
    /// pool has no room for it now (the GET then asks first, as a plain GET does).
    fn offer(
        &self,
        conn: &Conn,
        size: u64,
    ) -> Option<(
        tessera_transport::PoolBlock,
        Exposure,
        WriteWatch,
        RemoteDesc,
    )> {
        let b = self.pool.lease(size.max(1), conn.align).ok()?;
        let exposure = b
            .registration()
            .expose_standing(conn.peer.name(), b.offset(), b.len())
            .ok()?;
        let desc = b.remote().ok()?;
        let watch = exposure.watch_written();
        Some((b, exposure, watch, desc))
    }
}
