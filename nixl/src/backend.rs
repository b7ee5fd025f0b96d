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
//! What both one-sided adapters do alike lives in tessera-onesided and is shared
//! with `ucx`: the engine slot (started once, taken out at shutdown), the table of local
//! registrations, the connection that keeps the peer's keys in step with each update and
//! drops its handle on close, and posting a plan (its local registrations looked up, its
//! segments handed to the engine, its completion reported exactly once). This file keeps
//! what differs: starting the engine, registering, connecting, what an empty plan or a closed
//! connection becomes, the engine's call that posts, and how the engine's errors read.
//!
//! Because the address changes with each registration, a metadata update with new
//! registrations reaches the engine as a new connection to the same peer (the old one is
//! closed once idle); NIXL reloads the peer's metadata in place.
//!
//! **What the target checks.** As with UCX, transfers are one-sided. NIXL itself refuses
//! remote descriptors outside the registrations in the peer's loaded metadata, and so does
//! this engine against the chunk bounds in the key, before posting. A peer still holding the
//! metadata of a registration the target dropped is not refused over software transports.

use tessera_sync::Arc;

use crate::engine::{
    NixlConfig, NixlEngine, NixlEngineError, NixlPeer, NixlRegion, XferKind, XferOpDesc,
};
use tessera_onesided::{self as onesided, EngineSlot, Fault, Link, PeerHandle, Regs};
use tessera_transport::engine::{
    Connection, Host, Op, PeerInfo, RegInfo, Segment, Transport, Xfer,
};
use tessera_transport::{BackendError, RegisterError, Side, TransferError};

const KIND: &str = "nixl";

fn backend_error(e: impl std::fmt::Display) -> BackendError {
    BackendError::new(KIND, e)
}

/// The `nixl` backend: one NIXL agent with its UCX backend per agent.
///
/// ```no_run
/// use tessera_nixl::{Nixl, NixlConfig};
/// use tessera_transport::Agent;
/// let agent = Agent::new("sender", Nixl::new(NixlConfig::new("unused"))).unwrap();
/// ```
pub struct Nixl {
    config: NixlConfig,
    engine: EngineSlot<NixlEngine>,
    regs: Regs<NixlRegion>,
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
            engine: EngineSlot::new(KIND),
            regs: Regs::default(),
        }
    }
}

impl Transport for Nixl {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn start(&self, host: Host) -> Result<(), BackendError> {
        self.engine.start(|| {
            let mut config = self.config.clone();
            config.name = host.name().to_owned();
            config.max_notification = tessera_transport::MAX_NOTIFICATION;
            config.on_notify = Some(onesided::notify_to(&host));
            NixlEngine::new(config).map_err(backend_error)
        })
    }

    fn register(&self, reg: &RegInfo<'_>) -> Result<Vec<u8>, RegisterError> {
        let engine = self.engine.get()?;
        let owner: Box<dyn Send + Sync> = Box::new(reg.region.clone());
        // SAFETY: `owner` is a handle on the region holding the range, which stays mapped,
        // readable and writable while any handle on it lives; the registration holds it
        // until NIXL released it, including from a transfer's quarantine.
        let mem = unsafe { engine.register_owned(reg.ptr(), reg.len, Some(owner)) }
            .map_err(|e| RegisterError::Backend(backend_error(e)))?;
        let key = mem.remote_key();
        self.regs.insert(reg.id, mem);
        Ok(key)
    }

    fn deregister(&self, id: u64) {
        self.regs.remove(id);
    }

    fn address(&self) -> Vec<u8> {
        self.engine
            .get()
            .ok()
            .and_then(|e| e.metadata().ok())
            .unwrap_or_default()
    }

    fn connect(&self, peer: &PeerInfo) -> Result<Arc<dyn Connection>, BackendError> {
        let engine = self.engine.get()?;
        let handle = engine
            .load_remote_named(&peer.address, Some(&peer.name))
            .map_err(backend_error)?;
        Ok(Link::open(peer, handle, self.regs.clone())?)
    }

    fn shutdown(&self) {
        self.engine.stop();
    }
}

/// A connection is a [`Link`] over the peer's loaded metadata.
impl PeerHandle for NixlPeer {
    type Region = NixlRegion;
    type Op<'a> = XferOpDesc<'a>;
    type Error = NixlEngineError;
    const KIND: &'static str = KIND;
    const CLOSED: &'static str = "the connection to";

    fn add_remote(&self, id: u64, key: &[u8]) -> Result<(), NixlEngineError> {
        NixlPeer::add_remote(self, id, key)
    }

    fn remove_remote(&self, id: u64) {
        NixlPeer::remove_remote(self, id);
    }

    fn op<'a>(local: &'a NixlRegion, s: &Segment) -> XferOpDesc<'a> {
        XferOpDesc {
            local,
            local_offset: s.local_offset,
            remote: s.remote_reg,
            remote_offset: s.remote_offset,
            len: s.len,
        }
    }

    fn remote_of(op: &XferOpDesc<'_>) -> u64 {
        op.remote
    }

    /// One NIXL request over the segments, with the notification.
    fn post_ops(
        &self,
        op: Op,
        ops: &[XferOpDesc<'_>],
        notify: Option<Vec<u8>>,
        done: impl FnOnce(Result<(), NixlEngineError>) + Send + 'static,
    ) -> Result<(), NixlEngineError> {
        let kind = match op {
            Op::Write => XferKind::Write,
            Op::Read => XferKind::Read,
        };
        NixlPeer::post(self, kind, ops, notify, done)
    }

    fn fault(e: NixlEngineError) -> Fault<NixlEngineError> {
        match e {
            NixlEngineError::TransferFailed { source, .. } => {
                Fault::PeerGone(format!("NIXL reported the transfer failed: {source}"))
            }
            NixlEngineError::Shutdown(_) => {
                Fault::PeerGone("this agent's engine is shut down".into())
            }
            NixlEngineError::Timeout { after, .. } => Fault::Timeout(after),
            NixlEngineError::OutOfRange {
                side: Side::Remote,
                index,
                offset,
                len,
                reg_len,
            } => Fault::RemoteOutOfRange {
                index,
                offset,
                len,
                reg_len,
            },
            NixlEngineError::UnknownRemote { index, id, .. } => Fault::UnknownRemote { index, id },
            other => Fault::Other(other),
        }
    }

    /// A closed connection fails the transfer first; a plan with no segments only sends its
    /// notification, if any, in place.
    fn post(link: &Link<Self>, xfer: Xfer) {
        let Xfer { notify, done } = xfer;
        let Some(handle) = link.handle() else {
            let peer = link.peer().to_owned();
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
                    .map_err(|e| Self::transfer_error(link.peer(), e, |_| 0)),
                None => Ok(()),
            };
            done.complete(result);
            return;
        }
        link.post_plan(done, notify, || Ok(handle));
    }
}
