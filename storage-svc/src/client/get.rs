//! The client's side of a GET: an inline answer, or GET_READY, a block of the client's pool
//! in GET_INTO, the unit's WRITE and GET_DONE.

use super::*;

impl Client {
    pub(super) async fn get_unit(
        &self,
        unit: usize,
        partition: &str,
        indexes: Vec<u64>,
        fields: Vec<String>,
    ) -> Result<Vec<Vec<Value>>, ClientError> {
        let conn = &self.conns[unit];
        let n = indexes.len();
        let nf = fields.len();
        let req = Request::Get {
            partition: partition.to_owned(),
            indexes,
            fields,
        };
        let (id, resp) = conn.call(req).await?;
        let value = match resp {
            Response::Values { meta, frames } => decode_inline(&meta, frames)?,
            Response::GetReady { meta } => self.get_payload(conn, id, &meta).await?,
            other => return Err(conn.unexpected(other)),
        };
        let bad = || conn.unexpected(Response::GetDone);
        let Value::List(cols) = value else {
            return Err(bad());
        };
        if cols.len() != nf {
            return Err(bad());
        }
        cols.into_iter()
            .map(|c| match c {
                Value::List(items) if items.len() == n => Ok(items),
                _ => Err(bad()),
            })
            .collect()
    }

    async fn get_payload(&self, conn: &Conn, get: u64, meta: &[u8]) -> Result<Value, ClientError> {
        let table = self.decoder.frame_table(meta)?;
        let layout = table.layout(conn.align)?;
        let block = match self.pool.lease(layout.size.max(1), layout.align) {
            Ok(b) => b,
            Err(e) => {
                let _ = conn
                    .call(Request::Cancel {
                        of: get,
                        maybe_written: false,
                    })
                    .await;
                return Err(ClientError::from_pool(e));
            }
        };
        // The unit lays the frames out in the block as this client did.
        let exposed = block
            .remote_range(0, layout.size.max(1))
            .map_err(|e| ClientError::Memory(e.into()))?;
        let done = tokio::time::timeout(
            self.timeout,
            conn.call(Request::GetInto {
                get,
                block: exposed,
            }),
        );
        match done.await {
            Ok(Ok((_, Response::GetDone))) => {}
            Ok(Ok((_, other))) => return Err(conn.unexpected(other)),
            Ok(Err(e)) => {
                if matches!(e, ClientError::Remote { ref source, .. } if source.kind == ErrorKind::Transfer)
                {
                    lock(&self.quarantine).push(block);
                }
                return Err(e);
            }
            Err(_) => {
                // The unit may still write into the block: keep it out of the pool.
                lock(&self.quarantine).push(block);
                return Err(ClientError::Transfer {
                    unit: conn.unit,
                    source: PayloadError::TimedOut {
                        after: self.timeout,
                    },
                });
            }
        }
        let size = layout.size;
        let buf: Bytes = freeze_written(block, size)?;
        Ok(decode_contiguous(meta, &buf, layout.align)?)
    }
}
