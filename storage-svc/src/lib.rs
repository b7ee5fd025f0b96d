#![doc = include_str!("../README.md")]
#![warn(missing_docs)]
// Unsafe code only where an item allows it: the epoll calls of `busy_poll`, the eventfd and
// ppoll of the client's inbox, and in `plane` the views of registered memory, the regions over
// caller frames and the WRITEs from them.
#![deny(unsafe_code)]

#[allow(unsafe_code)] // epoll through libc: the polled sockets' readiness.
mod busy_poll;
mod chunks;
mod client;
#[cfg(feature = "etcd")]
pub mod cluster;
pub mod core;
mod error;
mod metrics;
mod outbox;
mod plane;
pub mod proto;
mod ring;
mod server;
#[doc(hidden)]
pub mod testing;
pub mod units;

pub use crate::busy_poll::BusyPoll;
pub use crate::client::{
    remote_error, Client, ClientConfig, Member, Membership, Modulo, Placement, Rendezvous,
    RepairReport,
};
pub use crate::core::{PartitionStats, PoolStats, Stats, UnitConfig};
pub use crate::error::{ClientError, ErrorKind, MemoryError, PayloadError, RemoteError, WireError};
pub use crate::plane::{Backend, BackendExt, ParseBackendError};
pub use crate::server::{announced_addr, Server, ServerConfig, ServerError};
pub use tessera_framecodec::{DType, Tensor, Value};
pub use tessera_transport::auth::Token;
