//! The client's side of a PUT: inline, pushed (READY, WRITE, COMMIT or CANCEL) or pulled
//! (the unit READs the frames named in the PUT).

use super::*;

impl Client {
    pub(super) async fn put_unit(
        &self,
        unit: usize,
        partition: &str,
        indexes: Vec<u64>,
        fields: Vec<String>,
        value: &Value,
    ) -> Result<(), ClientError> {
        let conn = &self.conns[unit];
        let frames = encode(value)?;
        let inline = frames.payload_bytes() <= conn.inline_max;
        if !inline && conn.pull {
            return self
                .put_pulled(conn, partition, indexes, fields, &frames)
                .await;
        }
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
            pull: None,
        };
        let mut answer = conn.send(req, !inline)?;
        // The frames are registered while the unit prepares its block: once the request is
        // on its way (the writer may share this thread's core).
        answer.sent().await;
        let locals = (!inline).then(|| {
            source_descs(
                &self.agent,
                frames.payloads.iter().filter(|f| !f.is_empty()),
            )
        });
        let (id, resp) = answer.wait().await?;
        let ready = match resp {
            Response::Done => return Ok(()),
            Response::PutReady { block, agent } => match (agent, locals) {
                (_, Some(Err(e))) => Err(ClientError::Memory(e)),
                (_, None) => Err(ClientError::Unexpected {
                    unit,
                    what: "READY for an inline PUT".into(),
                }),
                // The unit registered more memory: its peer handle learns the new
                // registrations before any WRITE names them.
                (Some(md), Some(Ok(locals))) => self
                    .agent
                    .add_remote(&md)
                    .map(|_| (block, locals))
                    .map_err(|source| ClientError::Connect { unit, source }),
                (None, Some(Ok(locals))) => Ok((block, locals)),
            },
            other => return Err(conn.unexpected(other)),
        };
        let (block, locals) = match ready {
            Ok(r) => r,
            Err(e) => {
                // Nothing was written: the unit frees the block.
                let _ = conn
                    .call(Request::Cancel {
                        of: id,
                        maybe_written: false,
                    })
                    .await;
                return Err(e);
            }
        };
        if let Err(e) = self.write_frames(conn, &frames, &block, locals).await {
            // The block may hold part of the payload: the unit quarantines it. No retry.
            let _ = conn
                .call(Request::Cancel {
                    of: id,
                    maybe_written: true,
                })
                .await;
            return Err(e);
        }
        match conn.call(Request::Commit { put: id }).await?.1 {
            Response::Done => Ok(()),
            other => Err(conn.unexpected(other)),
        }
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
        let req = Request::Put {
            partition: partition.to_owned(),
            indexes,
            fields,
            meta: ByteBuf::from(frames.meta.to_vec()),
            inline: None,
            pull: Some(PullSource {
                descs,
                agent: ByteBuf::from(self.agent.metadata()),
            }),
        };
        let answer = conn.call(req).await;
        if matches!(answer, Err(ClientError::Timeout { .. })) {
            // No answer: the unit may still be reading these frames.
            lock(&self.held_sources).push((sources, frames.payloads.iter().cloned().collect()));
        } else {
            drop(sources);
        }
        match answer?.1 {
            Response::Done => Ok(()),
            other => Err(conn.unexpected(other)),
        }
    }

    /// WRITEs the non-empty frames, registered as `locals` in order, into the unit's receive
    /// `block`, laid out as the unit lays them out.
    async fn write_frames(
        &self,
        conn: &Conn,
        frames: &Frames,
        block: &RemoteDesc,
        locals: Vec<LocalDesc>,
    ) -> Result<(), ClientError> {
        let terr = |source: PayloadError| ClientError::Transfer {
            unit: conn.unit,
            source,
        };
        let layout = frames.layout(conn.align)?;
        let remotes = frame_descs(block, &layout)?;
        if remotes.len() != locals.len() {
            return Err(MemoryError::Described {
                frames: locals.len(),
                descs: remotes.len(),
            }
            .into());
        }
        let t = conn
            .peer
            .write(&locals, &remotes, None)
            .map_err(|e| terr(e.into()))?;
        drop(locals);
        let after = self.timeout;
        match tokio::time::timeout(after, t).await {
            Ok(r) => r.map_err(|e| terr(e.into())),
            Err(_) => Err(terr(PayloadError::TimedOut { after })),
        }
    }
}
