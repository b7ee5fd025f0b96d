//! The payload plane's memory: the registered pool behind [`Memory`], `Bytes` views that own a
//! pool block, and registering caller frames in place. The only `unsafe` of the crate lives
//! here, at the boundary with registered memory.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tessera_transport::{Agent, BackendError, LocalDesc, PoolBlock, Region, RemoteDesc};

use crate::chunks::ChunkPool;
use crate::core::{Memory, PoolStats};

/// Which tessera-transport engine carries payloads. Units and clients must agree; there is
/// never a fallback to another engine.
///
/// `Ucx` and `Nixl` exist in every build, so that a configuration or a command line naming
/// them parses the same everywhere; they are usable only when this crate is built with the
/// cargo feature of the same name. Without it, starting a unit or a client on them fails with
/// an error naming the feature ([`Backend::available`] tells beforehand).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Agents of one process only (tests, embedding a unit in the same process).
    Inproc,
    /// Processes of one host: sealed memfds, one `memcpy` (the default; no system library).
    #[default]
    Shm,
    /// Hosts: one pipelined TCP connection per pair of agents.
    Tcp,
    /// UCP `put` through UCX (cargo feature `ucx`); UCX picks the transport (`UCX_TLS`) and
    /// the interfaces (`UCX_NET_DEVICES`). One-sided: the target never sees a transfer.
    Ucx,
    /// A NIXL agent with its UCX backend (cargo feature `nixl`). One-sided, like `Ucx`.
    Nixl,
}

impl Backend {
    /// The transport's kind string.
    pub fn kind(self) -> &'static str {
        match self {
            Backend::Inproc => "inproc",
            Backend::Shm => "shm",
            Backend::Tcp => "tcp",
            Backend::Ucx => "ucx",
            Backend::Nixl => "nixl",
        }
    }

    /// Whether PUT payloads are pulled: the client names its frames and the unit READs them,
    /// instead of the client WRITEing into a block the unit exposes. True for the one-sided
    /// engines (`ucx`, `nixl`), so that the unit is always the initiator of their transfers:
    /// over UCX's tcp transport a client that dies while it WRITEs into the unit can abort the
    /// unit's process (inside UCX, answering the dead client's emulated put), while an
    /// initiator just sees its request fail. The one place this choice is made.
    pub fn pulls_puts(self) -> bool {
        matches!(self, Backend::Ucx | Backend::Nixl)
    }

    /// The cargo feature of this crate that the backend needs, if any.
    pub fn feature(self) -> Option<&'static str> {
        match self {
            Backend::Inproc | Backend::Shm | Backend::Tcp => None,
            Backend::Ucx => Some("ucx"),
            Backend::Nixl => Some("nixl"),
        }
    }

    /// Whether this build can start agents of this backend (its feature, if any, is on).
    pub fn available(self) -> bool {
        match self {
            Backend::Inproc | Backend::Shm | Backend::Tcp => true,
            Backend::Ucx => cfg!(feature = "ucx"),
            Backend::Nixl => cfg!(feature = "nixl"),
        }
    }

    /// A fresh agent of this backend with a name unique across hosts (host name, process id
    /// and a counter).
    pub fn agent(self, role: &str) -> Result<Agent, tessera_transport::AgentError> {
        self.agent_at(role, None)
    }

    /// Like [`Self::agent`]; for `tcp`, the payload engine listens on and advertises
    /// `payload_addr` (an address of this host that peers can reach, port 0 for any) instead
    /// of 127.0.0.1. `inproc` and `shm` ignore it (they never leave the host). `ucx` and
    /// `nixl` refuse it: UCX chooses its interfaces itself, from `UCX_NET_DEVICES` (and its
    /// transports from `UCX_TLS`), so an address given here could not be honoured.
    ///
    /// A backend whose cargo feature is off fails with an error naming the feature.
    pub fn agent_at(
        self,
        role: &str,
        payload_addr: Option<std::net::SocketAddr>,
    ) -> Result<Agent, tessera_transport::AgentError> {
        if !self.available() {
            return Err(unavailable(self));
        }
        if let (Backend::Ucx | Backend::Nixl, Some(addr)) = (self, payload_addr) {
            return Err(BackendError::new(
                self.kind(),
                format!(
                    "a payload address ({addr}) applies to the tcp backend only; UCX picks \
                     its interfaces from UCX_NET_DEVICES (e.g. UCX_NET_DEVICES=eth0)"
                ),
            )
            .into());
        }
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let name = format!(
            "tessera-{role}-{}-{}-{}",
            host.trim(),
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        match self {
            Backend::Inproc => Agent::new(&name, tessera_transport::Inproc::new()),
            Backend::Shm => Agent::new(&name, tessera_transport::shm::Shm::new()),
            Backend::Tcp => match payload_addr {
                Some(addr) => Agent::new(&name, tessera_transport::tcp::Tcp::bind(addr)),
                None => Agent::new(&name, tessera_transport::tcp::Tcp::new()),
            },
            Backend::Ucx => ucx_agent(&name),
            Backend::Nixl => nixl_agent(&name),
        }
    }
}

fn unavailable(backend: Backend) -> tessera_transport::AgentError {
    let feature = backend.feature().unwrap_or(backend.kind());
    BackendError::new(
        backend.kind(),
        format!(
            "this build of tessera-storage lacks it: build with the cargo feature `{feature}` \
             (its libraries come from `cargo xtask deps`)"
        ),
    )
    .into()
}

#[cfg(feature = "ucx")]
fn ucx_agent(name: &str) -> Result<Agent, tessera_transport::AgentError> {
    use tessera_transport::ucx::{Ucx, UcxConfig};
    Agent::new(name, Ucx::new(UcxConfig::new(name)))
}

#[cfg(not(feature = "ucx"))]
fn ucx_agent(_: &str) -> Result<Agent, tessera_transport::AgentError> {
    Err(unavailable(Backend::Ucx))
}

#[cfg(feature = "nixl")]
fn nixl_agent(name: &str) -> Result<Agent, tessera_transport::AgentError> {
    use tessera_transport::nixl::{Nixl, NixlConfig};
    Agent::new(name, Nixl::new(NixlConfig::new(name)))
}

#[cfg(not(feature = "nixl"))]
fn nixl_agent(_: &str) -> Result<Agent, tessera_transport::AgentError> {
    Err(unavailable(Backend::Nixl))
}

/// A pool block as bytes: `Bytes::from_owner(BlockBytes(block))` keeps the block leased until
/// the last slice is gone.
pub(crate) struct BlockBytes(PoolBlock);

impl AsRef<[u8]> for BlockBytes {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: a block is frozen into `BlockBytes` only after the WRITE into it completed
        // (the PUT's COMMIT, or the GET's completion); from then on no descriptor of it is
        // handed out again, so no transfer of this protocol writes it while the slice lives.
        unsafe { self.0.as_slice() }
    }
}

/// Freezes the first `len` bytes of a block whose writes are complete.
pub(crate) fn freeze(block: PoolBlock, len: u64) -> Bytes {
    Bytes::from_owner(BlockBytes(block)).slice(..len as usize)
}

/// The unit's registered memory (chunks of registered pools) as the protocol core's
/// [`Memory`].
pub(crate) struct PoolMemory {
    pub(crate) pool: ChunkPool<std::sync::Arc<Agent>>,
}

impl Memory for PoolMemory {
    type Block = PoolBlock;
    type Dest = LocalDesc;

    fn lease(&mut self, size: u64, align: u64) -> Result<PoolBlock, String> {
        self.pool.lease(size, align)
    }

    fn remote(&self, block: &PoolBlock, offset: u64, len: u64) -> Result<RemoteDesc, String> {
        block.remote_range(offset, len).map_err(|e| e.to_string())
    }

    /// The descriptor keeps the block leased as long as it and any READ using it live, so a
    /// block dropped by the core while its READ is in flight is not leased again before the
    /// READ is gone.
    fn dest(&self, block: &PoolBlock, offset: u64, len: u64) -> Result<LocalDesc, String> {
        block.desc_range(offset, len).map_err(|e| e.to_string())
    }

    fn freeze(&self, block: PoolBlock, len: u64) -> Bytes {
        freeze(block, len)
    }

    fn block_len(block: &PoolBlock) -> u64 {
        block.len()
    }

    fn copy_in(&mut self, data: &[u8], align: u64) -> Result<Bytes, String> {
        if data.is_empty() {
            return Ok(Bytes::new());
        }
        let block = self.lease(data.len() as u64, align)?;
        block.write_at(0, data).map_err(|e| e.to_string())?;
        Ok(freeze(block, data.len() as u64))
    }

    fn usage(&self) -> PoolStats {
        self.pool.usage()
    }

    fn trim(&mut self) -> u64 {
        self.pool.trim()
    }
}

/// Local descriptors of `frames` for a WRITE: memory that already lives in a registration of
/// `agent` (a pool block, a received buffer, a frame registered earlier in the batch) reuses
/// it; other memory is registered in place, each registration owning a reference to its
/// frame. Never copies.
pub(crate) fn source_descs<'a>(
    agent: &Agent,
    frames: impl IntoIterator<Item = &'a Bytes>,
) -> Result<Vec<LocalDesc>, String> {
    frames
        .into_iter()
        .map(|f| {
            let found = agent
                .find_registered(f.as_ptr(), f.len() as u64)
                .and_then(|reg| reg.desc(0, f.len() as u64).ok());
            match found {
                Some(d) => Ok(d),
                None => register_in_place(agent, f),
            }
        })
        .collect()
}

fn register_in_place(agent: &Agent, frame: &Bytes) -> Result<LocalDesc, String> {
    let len = frame.len() as u64;
    let ptr = NonNull::new(frame.as_ptr() as *mut u8).ok_or("null frame")?;
    // SAFETY: `ptr..ptr + len` is the frame's memory, kept alive by the clone of the `Bytes`
    // that the region owns until the region, its registration and every transfer using it are
    // gone. The region is only ever the source of a WRITE, which reads it; nothing writes
    // these bytes (a `Bytes` is immutable), so no reference observes a concurrent change.
    let region = unsafe { Region::from_raw_parts(ptr, len, Some(Box::new(frame.clone()))) }
        .map_err(|e| e.to_string())?;
    let reg = agent.register(&region).map_err(|e| e.to_string())?;
    reg.desc(0, len).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::Backend;

    /// Without its feature, `ucx` or `nixl` is an error naming the feature; with it, a
    /// payload address is refused naming UCX_NET_DEVICES. Never another engine instead.
    #[test]
    fn ucx_and_nixl_refuse_what_they_cannot_honour() {
        let addr = Some("127.0.0.1:0".parse().unwrap());
        for b in [Backend::Ucx, Backend::Nixl] {
            let err = b.agent_at("t", addr).unwrap_err().to_string();
            let expected = if b.available() {
                "UCX_NET_DEVICES".to_owned()
            } else {
                format!("cargo feature `{}`", b.kind())
            };
            assert!(err.contains(&expected), "{err}");
        }
    }
}
