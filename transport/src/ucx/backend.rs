//! [`Ucx`]: the UCX engine behind the [`Transport`] trait.
//!
//! | trait | here |
//! |---|---|
//! | [`Transport::start`] | [`UcxEngine::new`], named after the agent, notifications to [`Host::notify`] |
//! | [`Transport::register`] | `ucp_mem_map` (chunked) + `ucp_rkey_pack`; the remote key carries each chunk's address, length and packed rkey |
//! | [`Transport::connect`] / [`Connection::update`] | an endpoint, then `ucp_ep_rkey_unpack` of every announced key; keys no longer announced are destroyed once nothing is pending |
//! | [`Connection::post`] | the plan's segments as `ucp_put_nbx`/`ucp_get_nbx`, one flush, then the notification as an active message; the [`Completion`](crate::Completion) is reported from the progress thread |
//! | [`Connection::close`] | the endpoint is parked: open until the peer fails or the engine stops (UCX pairs it with the peer's endpoint to us), its keys destroyed once its transfers are done |
//! | [`Transport::shutdown`] | transfers fail (after a grace period), endpoints close, then memory handles, worker and context go as their last holders do |
//!
//! **What the target checks.** UCX RMA is one-sided: the target's engine never sees a put or
//! a get, so it cannot validate requests against its live registrations the way `shm` and
//! `tcp` do. What confines a peer is the remote key: the initiator checks every segment
//! against the chunk bounds the target packed into the key (metadata claiming a longer
//! registration than the key covers is refused before anything is posted), and on RDMA
//! hardware the NIC enforces the memory handle's bounds. A peer that keeps using the key of a
//! registration the target has since dropped is **not** refused over software transports
//! (`tcp`, `cma`): the bytes go to the old addresses. Only deregister memory that peers may
//! still write after telling them (a new metadata exchange), or keep it registered.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use super::{MemRegion, RmaKind, RmaOp, UcxConfig, UcxEndpoint, UcxEngine, UcxError};
use crate::backend::{Connection, Host, Op, PeerInfo, RegInfo, Transport, Xfer};
use crate::error::{BackendError, RegisterError, Side, TransferError};
use crate::transfer::Completion;

const KIND: &str = "ucx";
/// How long [`Transport::connect`] waits for the peer to answer.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The `ucx` backend: one UCP context and worker per agent, one endpoint per peer.
///
/// ```no_run
/// use tessera_transport::{ucx::{Ucx, UcxConfig}, Agent};
/// let mut config = UcxConfig::new("unused: the agent's name is used");
/// config.tls = Some("tcp".into());
/// let agent = Agent::new("sender", Ucx::new(config)).unwrap();
/// ```
pub struct Ucx {
    config: UcxConfig,
    engine: Mutex<Option<UcxEngine>>,
    regs: Arc<Mutex<HashMap<u64, MemRegion>>>,
}

impl std::fmt::Debug for Ucx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ucx").field("config", &self.config).finish()
    }
}

impl Ucx {
    /// An engine with these settings. Its name and notification handler are set by the
    /// agent when it starts ([`UcxConfig::name`] and [`UcxConfig::on_notify`] are replaced).
    pub fn new(config: UcxConfig) -> Self {
        Self {
            config,
            engine: Mutex::new(None),
            regs: Arc::default(),
        }
    }

    /// What the engine holds, for leak checks (`None` before start and after shutdown).
    pub fn report(&self) -> Option<super::UcxReport> {
        lock(&self.engine).as_ref().map(UcxEngine::report)
    }
}

fn backend_error(e: impl std::fmt::Display) -> BackendError {
    BackendError::new(KIND, e)
}

impl Transport for Ucx {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn start(&self, host: Host) -> Result<(), BackendError> {
        let mut slot = lock(&self.engine);
        if slot.is_some() {
            return Err(backend_error("the engine was already started"));
        }
        let mut config = self.config.clone();
        config.name = host.name().to_owned();
        config.max_notification = crate::MAX_NOTIFICATION;
        let target = host.clone();
        config.on_notify = Some(Arc::new(move |from: &str, msg: Vec<u8>| {
            target.notify(from, msg);
        }));
        *slot = Some(UcxEngine::new(config).map_err(backend_error)?);
        Ok(())
    }

    fn register(&self, reg: &RegInfo<'_>) -> Result<Vec<u8>, RegisterError> {
        let engine = lock(&self.engine);
        let engine = engine.as_ref().ok_or(RegisterError::Backend(backend_error(
            "the engine is shut down",
        )))?;
        let owner: Box<dyn Send + Sync> = Box::new(reg.region.clone());
        // SAFETY: `owner` is a handle on the region holding the range, which stays mapped,
        // readable and writable while any handle on it lives; the memory region holds it
        // until its chunks are unmapped, including from a transfer's quarantine.
        let mem = unsafe { engine.register_owned(reg.ptr(), reg.len, Some(owner)) }
            .map_err(|e| RegisterError::Backend(backend_error(e)))?;
        let key = mem.remote_key().to_vec();
        lock(&self.regs).insert(reg.id, mem);
        Ok(key)
    }

    fn deregister(&self, id: u64) {
        let mem = lock(&self.regs).remove(&id);
        drop(mem);
    }

    fn address(&self) -> Vec<u8> {
        lock(&self.engine)
            .as_ref()
            .map(|e| e.address().to_vec())
            .unwrap_or_default()
    }

    fn connect(&self, peer: &PeerInfo) -> Result<Arc<dyn Connection>, BackendError> {
        let ep = {
            let engine = lock(&self.engine);
            let engine = engine
                .as_ref()
                .ok_or_else(|| backend_error("the engine is shut down"))?;
            engine
                .connect(&peer.name, &peer.address)
                .map_err(backend_error)?
        };
        // Wait for the connection before returning: two agents connecting to each other at
        // once otherwise race their tcp wireups, and UCX 1.22 then lost puts posted on the
        // losing connection (flushed as done ~20 s later, the bytes never written).
        let mut flushed = ep.flush().map_err(backend_error)?;
        match flushed.wait_timeout(CONNECT_TIMEOUT) {
            Some(Ok(())) => {}
            Some(Err(e)) => {
                return Err(backend_error(format!("connecting to {:?}: {e}", peer.name)))
            }
            None => {
                return Err(backend_error(format!(
                    "{:?} did not answer within {CONNECT_TIMEOUT:?}",
                    peer.name
                )))
            }
        }
        let conn = UcxConnection {
            peer: peer.name.clone(),
            ep: Mutex::new(Some(Arc::new(ep))),
            keys: Mutex::new(HashMap::new()),
            regs: self.regs.clone(),
        };
        conn.update(peer)?;
        Ok(Arc::new(conn))
    }

    fn shutdown(&self) {
        let engine = lock(&self.engine).take();
        drop(engine);
    }
}

/// One peer: its endpoint and the keys it announced.
struct UcxConnection {
    peer: String,
    /// Shared so that no lock is held while UCX runs; closed when the last clone drops.
    ep: Mutex<Option<Arc<UcxEndpoint>>>,
    /// Remote registration id -> the key unpacked for it.
    keys: Mutex<HashMap<u64, Vec<u8>>>,
    regs: Arc<Mutex<HashMap<u64, MemRegion>>>,
}

/// A UCX error as a transfer error naming `peer`; `remote_reg` gives the remote registration
/// of op `index`, for range errors.
fn transfer_error(peer: &str, e: UcxError, remote_reg: impl Fn(usize) -> u64) -> TransferError {
    let peer = peer.to_owned();
    match e {
        UcxError::PeerGone { message, .. } => TransferError::PeerGone {
            peer,
            detail: message,
        },
        UcxError::Shutdown(_) => TransferError::PeerGone {
            peer,
            detail: "the endpoint or this agent's engine is shut down".into(),
        },
        UcxError::OutOfRange {
            side: Side::Remote,
            index,
            offset,
            len,
            reg_len,
        } => TransferError::OutOfRange {
            peer,
            side: Side::Remote,
            index,
            reg: remote_reg(index),
            offset,
            len,
            reg_len,
        },
        UcxError::UnknownRemote { index, id, .. } => TransferError::UnknownRegistration {
            peer,
            side: Side::Remote,
            index,
            reg: id,
        },
        other => TransferError::Backend {
            peer,
            source: backend_error(other),
        },
    }
}

impl Connection for UcxConnection {
    fn post(&self, xfer: Xfer) {
        let Xfer { notify, done } = xfer;
        if done.plan().segments().is_empty() && notify.is_none() {
            done.complete(Ok(()));
            return;
        }
        // Handles on the local registrations, taken out of the table so that no lock is
        // held while UCX runs (a completion reported in place may deregister).
        let mems: Result<Vec<MemRegion>, u64> = {
            let regs = lock(&self.regs);
            done.plan()
                .segments()
                .iter()
                .map(|s| regs.get(&s.local_reg).cloned().ok_or(s.local_reg))
                .collect()
        };
        let mems = match mems {
            Ok(m) => m,
            Err(reg) => {
                let peer = self.peer.clone();
                done.complete(Err(TransferError::UnknownRegistration {
                    peer,
                    side: Side::Local,
                    index: 0,
                    reg,
                }));
                return;
            }
        };
        let ops: Vec<RmaOp<'_>> = done
            .plan()
            .segments()
            .iter()
            .zip(&mems)
            .map(|(s, m)| RmaOp {
                local: m,
                local_offset: s.local_offset,
                remote: s.remote_reg,
                remote_offset: s.remote_offset,
                len: s.len,
            })
            .collect();
        let kind = match done.plan().op() {
            Op::Write => RmaKind::Put,
            Op::Read => RmaKind::Get,
        };
        // The completion is reported by the engine's callback, or here when nothing was
        // posted (the callback is then dropped unrun).
        let slot: Arc<Mutex<Option<Completion>>> = Arc::new(Mutex::new(Some(done)));
        let cb_slot = slot.clone();
        let peer = self.peer.clone();
        let callback = move |r: Result<(), UcxError>| {
            if let Some(done) = lock(&cb_slot).take() {
                done.complete(r.map_err(|e| transfer_error(&peer, e, |_| 0)));
            }
        };
        let ep = lock(&self.ep).clone();
        let posted = match ep {
            Some(ep) => ep.post(kind, &ops, notify, callback),
            None => Err(UcxError::Shutdown(self.peer.clone())),
        };
        if let Err(e) = posted {
            let err = transfer_error(&self.peer, e, |i| ops.get(i).map_or(0, |o| o.remote));
            drop(ops);
            drop(mems);
            if let Some(done) = lock(&slot).take() {
                done.complete(Err(err));
            }
        }
    }

    fn update(&self, peer: &PeerInfo) -> Result<(), BackendError> {
        let ep = lock(&self.ep).clone();
        let ep =
            ep.ok_or_else(|| backend_error(format!("the endpoint of {:?} is closed", self.peer)))?;
        let mut keys = lock(&self.keys);
        for r in &peer.regs {
            if keys.get(&r.id) == Some(&r.key) {
                continue;
            }
            ep.add_remote(r.id, &r.key).map_err(|e| {
                backend_error(format!(
                    "key of registration {} of {:?}: {e}",
                    r.id, peer.name
                ))
            })?;
            keys.insert(r.id, r.key.clone());
        }
        let gone: Vec<u64> = keys
            .keys()
            .filter(|id| !peer.regs.iter().any(|r| r.id == **id))
            .copied()
            .collect();
        for id in gone {
            ep.remove_remote(id);
            keys.remove(&id);
        }
        Ok(())
    }

    fn close(&self) {
        let ep = lock(&self.ep).take();
        drop(ep);
    }
}
