#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod agent;
pub mod auth;
mod copy;
mod desc;
pub mod engine;
mod error;
mod exposure;
mod handshake;
pub mod inproc;
mod interval;
mod metadata;
mod notify;
mod pool;
mod region;
mod registry;
pub mod shm;
mod shm_ring;
pub mod tcp;
#[cfg(feature = "testing")]
pub mod testing;
mod transfer;

pub use agent::Prepared;
pub use agent::{Agent, AgentReport, AnnouncementHold, LinkState, Peer, Registration};
pub use desc::{coalesce, coalesce_in_place, KeepAlive, Loc, LocalDesc, Pair, RemoteDesc};
pub use error::{
    AgentError, BackendError, ConnectError, DescError, MetadataError, PoolError, RegionError,
    RegisterError, RejectReason, Side, TransferError,
};
pub use exposure::{Exposure, Ops};
pub use inproc::Inproc;
pub use notify::{NextNotification, Notification, MAX_NOTIFICATION};
pub use pool::{FrozenBlock, PoolBlock, RegisteredPool};
pub use region::Region;
pub use transfer::{Op, Status, Transfer};

/// How long a unit test waits for a transfer before it fails: a transfer that never completes
/// fails its test rather than hanging the test binary.
#[cfg(test)]
const TEST_WAIT: std::time::Duration = std::time::Duration::from_secs(20);
