#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod agent;
mod backend;
mod desc;
mod error;
pub mod inproc;
mod interval;
mod metadata;
mod pool;
mod region;
pub mod shm;
mod sync;
pub mod tcp;
pub mod testing;
mod transfer;

pub use agent::{
    Agent, AgentReport, LinkState, NextNotification, Notification, Peer, Registration,
    MAX_NOTIFICATION,
};
pub use backend::{
    Connection, Grant, Host, LinkGuard, Op, PeerInfo, RegInfo, RemoteReg, Transport, Xfer,
};
pub use desc::{coalesce, coalesce_in_place, KeepAlive, Loc, LocalDesc, Pair, RemoteDesc};
pub use error::{
    AgentError, BackendError, ConnectError, DescError, MetadataError, PoolError, RegionError,
    RegisterError, RejectReason, Side, TransferError,
};
pub use inproc::Inproc;
pub use pool::{FrozenBlock, PoolBlock, RegisteredPool};
pub use region::Region;
pub use transfer::{Completion, Plan, Prepared, Segment, Status, Transfer};
