//! Drives the client's side of a GET ([`GetOp`]): sends what it asks, leases and freezes the
//! receive block, and feeds it the answers.

use tessera_framecodec::Value;

use super::{Client, Slot};
use crate::core::client::{GetOp, GetStep};
use crate::error::ClientError;
use crate::plane::freeze_written;
use crate::proto::Request;

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
        let (mut op, mut step) = GetOp::new(
            unit,
            partition,
            indexes,
            fields,
            conn.align,
            self.decoder.clone(),
        );
        // The receive block and the bytes of it the frames occupy.
        let mut block: Option<(tessera_transport::PoolBlock, u64)> = None;
        loop {
            step = match step {
                GetStep::Done(r) => {
                    if op.quarantine_block() {
                        // The unit may still write into the block: keep it out of the pool.
                        if let Some((b, _)) = block.take() {
                            self.quarantine.lock().push(b);
                        }
                    }
                    return r;
                }
                GetStep::Send(req @ Request::GetInto { .. }) => {
                    // The answer's own deadline (which first takes an answer already there).
                    match conn.call(req).await {
                        Err(ClientError::Timeout { .. }) => op.on_timeout(self.timeout),
                        answer => op.on_answer(answer),
                    }
                }
                GetStep::Send(req) => op.on_answer(conn.call(req).await),
                GetStep::Lease { layout } => {
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
                    let Some((b, size)) = block.take() else {
                        return Err(ClientError::ApiMisuse(
                            "a GET landed without a receive block".into(),
                        ));
                    };
                    op.on_landed(freeze_written(b, size)?)
                }
            };
        }
    }
}
