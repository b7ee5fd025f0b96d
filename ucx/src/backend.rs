//! [`Ucx`]: the UCX engine behind the [`Transport`] trait.
//!
//! | trait | here |
//! |---|---|
//! | [`Transport::start`] | [`UcxEngine::new`], named after the agent, notifications to [`Host::notify`] |
//! | [`Transport::register`] | `ucp_mem_map` (chunked) + `ucp_rkey_pack`; the remote key carries each chunk's address, length and packed rkey |
//! | [`Transport::connect`] / [`Connection::update`] | an endpoint, then `ucp_ep_rkey_unpack` of every announced key; keys no longer announced are destroyed once nothing is pending |
//! | [`Connection::post`] | the plan's segments as `ucp_put_nbx`/`ucp_get_nbx`, one flush, then the notification as an active message; the [`Completion`](tessera_transport::engine::Completion) is reported from the progress thread |
//! | [`Connection::close`] | the endpoint is parked: open until the peer fails or the engine stops (UCX pairs it with the peer's endpoint to us), its keys destroyed once its transfers are done |
//! | [`Transport::shutdown`] | transfers fail (after a grace period), endpoints close, then memory handles, worker and context go as their last holders do |
//!
//! What both one-sided adapters do alike lives in tessera-onesided and is shared
//! with `nixl`: the engine slot (started once, taken out at shutdown), the table of local
//! registrations, the connection that keeps the peer's keys in step with each update and
//! drops its handle on close, and posting a plan (its local registrations looked up, its
//! segments handed to the engine, its completion reported exactly once). This file keeps
//! what differs: starting the engine, registering, connecting, what an empty plan or a closed
//! connection becomes, the engine's call that posts, and how the engine's errors read.
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

use tessera_sync::Arc;

use crate::engine::{MemRegion, RmaOp, UcxEndpoint, UcxEngine};
use crate::{RmaKind, UcxConfig, UcxError};
use tessera_onesided::{self as onesided, EngineSlot, Fault, Link, PeerHandle, Regs};
use tessera_transport::engine::{
    Connection, Host, Op, PeerInfo, RegInfo, Segment, Transport, Xfer,
};
use tessera_transport::{BackendError, RegisterError, Side};

const KIND: &str = "ucx";
/// How long [`Transport::connect`] waits for the peer to answer.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// The `ucx` backend: one UCP context and worker per agent, one endpoint per peer.
///
/// ```no_run
/// use tessera_transport::Agent;
/// use tessera_ucx::{Ucx, UcxConfig};
/// let mut config = UcxConfig::new("unused: the agent's name is used");
/// config.tls = Some("tcp".into());
/// let agent = Agent::new("sender", Ucx::new(config)).unwrap();
/// ```
pub struct Ucx {
    config: UcxConfig,
    engine: EngineSlot<UcxEngine>,
    regs: Regs<MemRegion>,
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
            engine: EngineSlot::new(KIND),
            regs: Regs::default(),
        }
    }

    /// What the engine holds, for leak checks (`None` before start and after shutdown).
    pub fn report(&self) -> Option<crate::UcxReport> {
        self.engine.get().ok().map(|e| e.report())
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
        self.engine.start(|| {
            let mut config = self.config.clone();
            config.name = host.name().to_owned();
            config.max_notification = tessera_transport::MAX_NOTIFICATION;
            config.on_notify = Some(onesided::notify_to(&host));
            UcxEngine::new(config).map_err(backend_error)
        })
    }

    fn register(&self, reg: &RegInfo<'_>) -> Result<Vec<u8>, RegisterError> {
        let engine = self.engine.get()?;
        let owner: Box<dyn Send + Sync> = Box::new(reg.region.clone());
        // SAFETY: `owner` is a handle on the region holding the range, which stays mapped,
        // readable and writable while any handle on it lives; the memory region holds it
        // until its chunks are unmapped, including from a transfer's quarantine.
        let mem = unsafe { engine.register_owned(reg.ptr(), reg.len, Some(owner)) }
            .map_err(|e| RegisterError::Backend(backend_error(e)))?;
        let key = mem.remote_key().to_vec();
        self.regs.insert(reg.id, mem);
        Ok(key)
    }

    fn deregister(&self, id: u64) {
        self.regs.remove(id);
    }

    fn address(&self) -> Vec<u8> {
        self.engine
            .get()
            .map(|e| e.address().to_vec())
            .unwrap_or_default()
    }

    fn connect(&self, peer: &PeerInfo) -> Result<Arc<dyn Connection>, BackendError> {
        let ep = self
            .engine
            .get()?
            .connect(&peer.name, &peer.address)
            .map_err(backend_error)?;
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
        Ok(Link::open(peer, ep, self.regs.clone())?)
    }

    fn shutdown(&self) {
        self.engine.stop();
    }
}

/// A connection is a [`Link`] over the peer's endpoint.
impl PeerHandle for UcxEndpoint {
    type Region = MemRegion;
    type Op<'a> = RmaOp<'a>;
    type Error = UcxError;
    const KIND: &'static str = KIND;
    const CLOSED: &'static str = "the endpoint of";

    fn add_remote(&self, id: u64, key: &[u8]) -> Result<(), UcxError> {
        UcxEndpoint::add_remote(self, id, key)
    }

    fn remove_remote(&self, id: u64) {
        UcxEndpoint::remove_remote(self, id);
    }

    fn op<'a>(local: &'a MemRegion, s: &Segment) -> RmaOp<'a> {
        RmaOp {
            local,
            local_offset: s.local_offset,
            remote: s.remote_reg,
            remote_offset: s.remote_offset,
            len: s.len,
        }
    }

    fn remote_of(op: &RmaOp<'_>) -> u64 {
        op.remote
    }

    /// The segments as puts or gets, one flush, then the notification as an active message.
    fn post_ops(
        &self,
        op: Op,
        ops: &[RmaOp<'_>],
        notify: Option<Vec<u8>>,
        done: impl FnOnce(Result<(), UcxError>) + Send + 'static,
    ) -> Result<(), UcxError> {
        let kind = match op {
            Op::Write => RmaKind::Put,
            Op::Read => RmaKind::Get,
        };
        UcxEndpoint::post(self, kind, ops, notify, done)
    }

    fn fault(e: UcxError) -> Fault<UcxError> {
        match e {
            UcxError::PeerGone { message, .. } => Fault::PeerGone(message),
            UcxError::Shutdown(_) => {
                Fault::PeerGone("the endpoint or this agent's engine is shut down".into())
            }
            UcxError::OutOfRange {
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
            UcxError::UnknownRemote { index, id, .. } => Fault::UnknownRemote { index, id },
            other => Fault::Other(other),
        }
    }

    /// A plan with nothing to move and nothing to say completes at once. Otherwise the local
    /// registrations are looked up before the endpoint, and a closed connection fails the
    /// transfer as a shut-down endpoint.
    fn post(link: &Link<Self>, xfer: Xfer) {
        let Xfer { notify, done } = xfer;
        if done.plan().segments().is_empty() && notify.is_none() {
            done.complete(Ok(()));
            return;
        }
        link.post_plan(done, notify, || {
            link.handle()
                .ok_or_else(|| UcxError::Shutdown(link.peer().to_owned()))
        });
    }
}
