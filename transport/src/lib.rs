#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod agent;
mod desc;
pub mod engine;
mod error;
pub mod inproc;
mod interval;
mod metadata;
mod pool;
mod region;
pub mod shm;
mod sync;
pub mod tcp;
#[cfg(feature = "testing")]
pub mod testing;
mod transfer;

pub use agent::{
    Agent, AgentReport, LinkState, NextNotification, Notification, Peer, Registration,
    MAX_NOTIFICATION,
};
pub use desc::{coalesce, coalesce_in_place, KeepAlive, Loc, LocalDesc, Pair, RemoteDesc};
pub use engine::Op;
pub use error::{
    AgentError, BackendError, ConnectError, DescError, MetadataError, PoolError, RegionError,
    RegisterError, RejectReason, Side, TransferError,
};
pub use inproc::Inproc;
pub use pool::{FrozenBlock, PoolBlock, RegisteredPool};
pub use region::Region;
pub use transfer::{Prepared, Status, Transfer};
