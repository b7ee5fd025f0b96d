//! [`Nixl`]: the NIXL engine behind the [`Transport`] trait.
//!
//! | trait | here |
//! |---|---|
//! | [`Transport::start`] | [`NixlEngine::new`] (agent named after ours, UCX backend), notifications to [`Host::notify`] |
//! | [`Transport::register`] | `registerMem` (DRAM, chunked); the remote key lists the chunks' addresses and lengths |
//! | [`Transport::address`] | `getLocalMD`: NIXL's own keys travel in it, so it changes with every registration |
//! | [`Transport::connect`] | `loadRemoteMD` (after invalidating a previous instance of a restarted peer) |
//! | [`Connection::post`] | one NIXL request over the plan's segments, with the notification; completion from the engine's waiter thread |
//! | [`Connection::close`] | `invalidateRemoteMD` once the peer's transfers are done |
//!
//! Because the address changes with each registration, a metadata update with new
//! registrations reaches the engine as a new connection to the same peer (the old one is
//! closed once idle); NIXL reloads the peer's metadata in place.
//!
//! **What the target checks.** As with UCX, transfers are one-sided. NIXL itself refuses
//! remote descriptors outside the registrations in the peer's loaded metadata, and so does
//! this engine against the chunk bounds in the key, before posting. A peer still holding the
//! metadata of a registration the target dropped is not refused over software transports.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use super::{NixlConfig, NixlEngine, NixlEngineError, NixlPeer, NixlRegion, XferKind, XferOpDesc};
use crate::backend::{Connection, Host, Op, PeerInfo, RegInfo, Transport, Xfer};
use crate::error::{BackendError, RegisterError, Side, TransferError};
use crate::transfer::Completion;

const KIND: &str = "nixl";

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn backend_error(e: impl std::fmt::Display) -> BackendError {
    BackendError::new(KIND, e)
}

/// The `nixl` backend: one NIXL agent with its UCX backend per agent.
///
/// ```no_run
/// use tessera_transport::{nixl::{Nixl, NixlConfig}, Agent};
/// let agent = Agent::new("sender", Nixl::new(NixlConfig::new("unused"))).unwrap();
/// ```
pub struct Nixl {
    config: NixlConfig,
    engine: Mutex<Option<Arc<NixlEngine>>>,
    regs: Arc<Mutex<HashMap<u64, NixlRegion>>>,
}

impl std::fmt::Debug for Nixl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nixl")
            .field("config", &self.config)
            .finish()
    }
}

impl Nixl {
    /// An engine with these settings. Its name and notification handler are set by the
    /// agent when it starts ([`NixlConfig::name`] and [`NixlConfig::on_notify`] are replaced).
    pub fn new(config: NixlConfig) -> Self {
        Self {
            config,
            engine: Mutex::new(None),
            regs: Arc::default(),
        }
    }

    fn engine(&self) -> Result<Arc<NixlEngine>, BackendError> {
        lock(&self.engine)
            .clone()
            .ok_or_else(|| backend_error("the engine is shut down"))
    }
}

impl Transport for Nixl {
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
        *slot = Some(Arc::new(NixlEngine::new(config).map_err(backend_error)?));
        Ok(())
    }

    fn register(&self, reg: &RegInfo<'_>) -> Result<Vec<u8>, RegisterError> {
        let engine = self.engine()?;
        let owner: Box<dyn Send + Sync> = Box::new(reg.region.clone());
        // SAFETY: `owner` is a handle on the region holding the range, which stays mapped,
        // readable and writable while any handle on it lives; the registration holds it
        // until NIXL released it, including from a transfer's quarantine.
        let mem = unsafe { engine.register_owned(reg.ptr(), reg.len, Some(owner)) }
            .map_err(|e| RegisterError::Backend(backend_error(e)))?;
        let key = mem.remote_key();
        lock(&self.regs).insert(reg.id, mem);
        Ok(key)
    }

    fn deregister(&self, id: u64) {
        let mem = lock(&self.regs).remove(&id);
        drop(mem);
    }

    fn address(&self) -> Vec<u8> {
        self.engine()
            .ok()
            .and_then(|e| e.metadata().ok())
            .unwrap_or_default()
    }

    fn connect(&self, peer: &PeerInfo) -> Result<Arc<dyn Connection>, BackendError> {
        let engine = self.engine()?;
        let handle = engine
            .load_remote_named(&peer.address, Some(&peer.name))
            .map_err(backend_error)?;
        let conn = NixlConnection {
            peer: peer.name.clone(),
            handle: Mutex::new(Some(Arc::new(handle))),
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

struct NixlConnection {
    peer: String,
    /// Shared so that no lock is held while NIXL runs.
    handle: Mutex<Option<Arc<NixlPeer>>>,
    keys: Mutex<HashMap<u64, Vec<u8>>>,
    regs: Arc<Mutex<HashMap<u64, NixlRegion>>>,
}

fn transfer_error(
    peer: &str,
    e: NixlEngineError,
    remote_reg: impl Fn(usize) -> u64,
) -> TransferError {
    let peer = peer.to_owned();
    match e {
        NixlEngineError::TransferFailed { source, .. } => TransferError::PeerGone {
            peer,
            detail: format!("NIXL reported the transfer failed: {source}"),
        },
        NixlEngineError::Shutdown(_) => TransferError::PeerGone {
            peer,
            detail: "this agent's engine is shut down".into(),
        },
        NixlEngineError::Timeout { after, .. } => TransferError::Timeout { peer, after },
        NixlEngineError::OutOfRange {
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
        NixlEngineError::UnknownRemote { index, id, .. } => TransferError::UnknownRegistration {
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

impl Connection for NixlConnection {
    fn post(&self, xfer: Xfer) {
        let Xfer { notify, done } = xfer;
        let Some(handle) = lock(&self.handle).clone() else {
            let peer = self.peer.clone();
            done.complete(Err(TransferError::PeerGone {
                peer,
                detail: "the connection is closed".into(),
            }));
            return;
        };
        if done.plan().segments().is_empty() {
            let result = match &notify {
                Some(msg) => handle
                    .notify(msg)
                    .map_err(|e| transfer_error(&self.peer, e, |_| 0)),
                None => Ok(()),
            };
            done.complete(result);
            return;
        }
        let mems: Result<Vec<NixlRegion>, u64> = {
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
        let ops: Vec<XferOpDesc<'_>> = done
            .plan()
            .segments()
            .iter()
            .zip(&mems)
            .map(|(s, m)| XferOpDesc {
                local: m,
                local_offset: s.local_offset,
                remote: s.remote_reg,
                remote_offset: s.remote_offset,
                len: s.len,
            })
            .collect();
        let kind = match done.plan().op() {
            Op::Write => XferKind::Write,
            Op::Read => XferKind::Read,
        };
        let slot: Arc<Mutex<Option<Completion>>> = Arc::new(Mutex::new(Some(done)));
        let cb_slot = slot.clone();
        let peer = self.peer.clone();
        let callback = move |r: Result<(), NixlEngineError>| {
            if let Some(done) = lock(&cb_slot).take() {
                done.complete(r.map_err(|e| transfer_error(&peer, e, |_| 0)));
            }
        };
        if let Err(e) = handle.post(kind, &ops, notify, callback) {
            let err = transfer_error(&self.peer, e, |i| ops.get(i).map_or(0, |o| o.remote));
            drop(ops);
            drop(mems);
            if let Some(done) = lock(&slot).take() {
                done.complete(Err(err));
            }
        }
    }

    fn update(&self, peer: &PeerInfo) -> Result<(), BackendError> {
        let handle = lock(&self.handle)
            .clone()
            .ok_or_else(|| backend_error(format!("the connection to {:?} is closed", self.peer)))?;
        let mut keys = lock(&self.keys);
        for r in &peer.regs {
            if keys.get(&r.id) == Some(&r.key) {
                continue;
            }
            handle.add_remote(r.id, &r.key).map_err(|e| {
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
            handle.remove_remote(id);
            keys.remove(&id);
        }
        Ok(())
    }

    fn close(&self) {
        let handle = lock(&self.handle).take();
        drop(handle);
    }
}
