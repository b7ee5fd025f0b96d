//! Carrying out the core's outputs: replies, accepted sessions, and each peer's transfers
//! (GET WRITEs, pulled-PUT READs) on that peer's own executor.

use std::panic::{catch_unwind, AssertUnwindSafe};
use tessera_sync::Arc;

use bytes::Bytes;
use tessera_transport::{LocalDesc, Peer, RemoteDesc};
use tokio::sync::mpsc;

use super::connection::{accept_peer, send, CatchUnwind};
#[cfg(test)]
use super::fault;
use super::{Job, Shared};
use crate::core::{Access, Output, SessionId};
use crate::error::{ErrorKind, PayloadError};
use crate::plane::post_write;
use crate::proto::Response;
use tessera_sync::atomic::{AtomicU64, Ordering};

pub(super) fn dispatch(shared: &Arc<Shared>, out: Vec<Output<LocalDesc>>) {
    for o in out {
        match o {
            Output::Reply {
                session,
                id,
                mut response,
            } => {
                if let Response::Error(e) = &response {
                    crate::metrics::error(e.kind);
                }
                if let Response::Stats(s) = &mut response {
                    shared.add_counters(s);
                }
                if let Response::PutReady { agent, .. } | Response::Stored { agent, .. } =
                    &mut response
                {
                    // Descriptors may name a chunk registered after this session last got
                    // the unit's metadata: send it along.
                    let now = shared.generation.load(Ordering::Acquire);
                    let stale = shared
                        .sessions
                        .lock()
                        .get_mut(&session)
                        .is_some_and(|h| std::mem::replace(&mut h.seen, now) != now);
                    if stale {
                        *agent = Some(serde_bytes::ByteBuf::from(shared.agent.metadata()));
                    }
                }
                send(shared, session, id, &response)
            }
            Output::Accept { session, id, agent } => {
                let s = shared.clone();
                shared
                    .tasks
                    .lock()
                    .spawn(accept_peer(s, session, id, agent));
            }
            Output::Write {
                session,
                id,
                get,
                frames,
                descs,
            } => {
                let sessions = shared.sessions.lock();
                let sent = sessions.get(&session).map(|h| {
                    let Some(jobs) = h.jobs.as_ref() else {
                        return Err(false);
                    };
                    match jobs.try_send(Job::Write(id, get, frames, descs)) {
                        Ok(()) => {
                            let depth = h.queue_depth.fetch_add(1, Ordering::Relaxed) + 1;
                            crate::metrics::queue_depth(&h.peer, depth);
                            Ok(())
                        }
                        Err(mpsc::error::TrySendError::Full(_)) => Err(true),
                        Err(mpsc::error::TrySendError::Closed(_)) => Err(false),
                    }
                });
                drop(sessions);
                let out = match sent {
                    Some(Ok(())) => continue,
                    Some(Err(true)) => shared.unit.lock().transfer_refused(
                        session,
                        get,
                        id,
                        "the transfer queue for this client is full; retry",
                    ),
                    _ => shared.unit.lock().transfer_done(
                        session,
                        get,
                        id,
                        Err(PayloadError::NoExecutor),
                    ),
                };
                dispatch(shared, out);
            }
            Output::Read {
                session,
                put,
                dests,
                srcs,
                agent,
            } => {
                let job = Job::Read {
                    put,
                    dests,
                    srcs,
                    agent,
                };
                let sent = match shared.sessions.lock().get(&session) {
                    Some(h) => match h.jobs.as_ref().map(|jobs| jobs.try_send(job)) {
                        Some(Ok(())) => {
                            let depth = h.queue_depth.fetch_add(1, Ordering::Relaxed) + 1;
                            crate::metrics::queue_depth(&h.peer, depth);
                            Ok(())
                        }
                        Some(Err(mpsc::error::TrySendError::Full(_))) => Err(true),
                        _ => Err(false),
                    },
                    None => Err(false),
                };
                let out = match sent {
                    Ok(()) => continue,
                    Err(true) => shared.unit.lock().read_refused(
                        session,
                        put,
                        ErrorKind::Busy,
                        "the transfer queue for this client is full; retry",
                    ),
                    Err(false) => shared.unit.lock().read_refused(
                        session,
                        put,
                        ErrorKind::PeerFailed,
                        "session has no executor",
                    ),
                };
                dispatch(shared, out);
            }
            Output::Close { session } => {
                if let Some(h) = shared.sessions.lock().get(&session) {
                    let _ = h.close.send(true);
                }
            }
        }
    }
}

pub(super) async fn executor(
    shared: Arc<Shared>,
    sid: SessionId,
    peer: Peer,
    mut rx: mpsc::Receiver<Job>,
    depth: Arc<AtomicU64>,
) {
    let label = peer.name().to_owned();
    while let Some(job) = rx.recv().await {
        crate::metrics::queue_depth(&label, depth.fetch_sub(1, Ordering::Relaxed) - 1);
        let (id, get, frames, descs) = match job {
            Job::Write(id, get, frames, descs) => (id, get, frames, descs),
            Job::Read {
                put,
                dests,
                srcs,
                agent,
            } => {
                let result = CatchUnwind(Box::pin(read(&shared, &agent, &dests, &srcs)))
                    .await
                    .unwrap_or_else(|what| {
                        tracing::error!(session = sid, put, panic = %what, "PUT READ panicked");
                        crate::metrics::error(ErrorKind::Internal);
                        Err(PayloadError::Panicked {
                            what: "reading this PUT",
                            message: what.0,
                        })
                    });
                // The destinations keep the block leased until the READ is gone.
                drop(dests);
                if let Err(e) = &result {
                    tracing::warn!(session = sid, put, error = %e, "PUT READ failed");
                }
                // Stored as a PUT request is: after what holds its partition, in slices
                // where it is large.
                let mut held = None;
                let mut result = Some(result);
                let done = loop {
                    let step = {
                        let mut unit = shared.unit.lock();
                        match held.is_none().then(|| unit.read_waits(sid, put)).flatten() {
                            Some(partition) => Err(partition),
                            None => Ok(catch_unwind(AssertUnwindSafe(|| {
                                let result = result.take().expect("the READ's result, once");
                                unit.read_done_slicing(sid, put, result)
                            }))),
                        }
                    };
                    match step {
                        Ok(done) => break done,
                        Err(partition) => {
                            held = Some(shared.partitions.acquire(&partition, Access::Write).await)
                        }
                    }
                };
                let out = match done {
                    Ok(Ok(out)) => Some(out),
                    Ok(Err(p)) => super::connection::store_sliced(&shared, p, held).await,
                    Err(_) => None,
                };
                match out {
                    Some(out) => dispatch(&shared, out),
                    None => {
                        tracing::error!(session = sid, put, "storing a pulled PUT panicked");
                        crate::metrics::error(ErrorKind::Internal);
                        let why = "the unit failed storing this PUT; it may be partly stored";
                        send(
                            &shared,
                            sid,
                            put,
                            &Response::error(ErrorKind::Internal, why),
                        );
                    }
                }
                continue;
            }
        };
        let result = CatchUnwind(Box::pin(async {
            #[cfg(test)]
            fault::before_write(sid, get);
            write(&shared, &peer, frames, &descs).await
        }))
        .await
        .unwrap_or_else(|what| {
            tracing::error!(session = sid, get, panic = %what, "GET WRITE panicked");
            crate::metrics::error(ErrorKind::Internal);
            Err(PayloadError::Panicked {
                what: "writing this GET",
                message: what.0,
            })
        });
        if let Err(e) = &result {
            tracing::warn!(session = sid, get, error = %e, "GET WRITE failed");
        }
        let out = shared.unit.lock().transfer_done(sid, get, id, result);
        dispatch(&shared, out);
    }
    crate::metrics::queue_depth(&label, 0);
}

async fn write(
    shared: &Shared,
    peer: &Peer,
    frames: Vec<Bytes>,
    descs: &[RemoteDesc],
) -> Result<(), PayloadError> {
    let frames = Arc::new(frames);
    let t = post_write(&shared.agent, peer, frames.iter(), frames.clone(), descs)?;
    drop(frames);
    let after = shared.cfg.transfer_timeout;
    match tokio::time::timeout(after, t).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(PayloadError::TimedOut { after }),
    }
}

/// READs a pulled PUT's frames from the client into the unit's block. The client's metadata
/// names the registrations its frames live in (registered for this PUT): the peer learns them
/// first.
async fn read(
    shared: &Shared,
    metadata: &[u8],
    dests: &[LocalDesc],
    srcs: &[RemoteDesc],
) -> Result<(), PayloadError> {
    let peer = shared.agent.add_remote(metadata)?;
    let t = peer.read(dests, srcs, None)?;
    let after = shared.cfg.transfer_timeout;
    match tokio::time::timeout(after, t).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(PayloadError::TimedOut { after }),
    }
}
