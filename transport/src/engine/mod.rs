//! The engine SPI: the one trait every engine implements, and what the agent hands an engine.
//! A user of agents, regions and transfers never needs this module; an engine crate (the
//! in-tree `inproc`, `shm` and `tcp`, or `tessera-ucx` and `tessera-nixl`) implements it.
//!
//! The split follows what NIXL and UCX need, so that their engines fit without changing it:
//!
//! | here | UCX | NIXL |
//! |---|---|---|
//! | [`Transport::register`] returns the remote key | `ucp_mem_map` + `ucp_rkey_pack` | `registerMem` |
//! | [`Transport::address`] | worker address | `getLocalMD` |
//! | [`Transport::connect`] / [`Connection::update`] | endpoint + `ucp_ep_rkey_unpack` | `loadRemoteMD` |
//! | [`Connection::post`] + [`Completion`] | `ucp_put_nbx`/`ucp_get_nbx` per segment, flush, callback | `createXferReq` + `postXferReq`, `getXferStatus` |
//! | notification in [`Xfer`], [`Host::notify`] | active message after the flush | `notifMsg`, `getNotifs` |
//! | [`Connection::close`], [`Transport::shutdown`] | endpoint close, `ucp_mem_unmap`, worker, context | `invalidateRemoteMD`, agent drop |
//!
//! The agent layer above does everything that is the same for all engines: the registration
//! cache and refcounts, metadata encoding, validation of remote descriptors, coalescing,
//! keeping in-flight resources alive, typed completion, and the notification queue.

mod host;
mod traits;
pub mod wire;

pub use crate::transfer::{Completion, Op, Plan, Segment};
pub(crate) use host::HostShared;
pub use host::{Grant, Host, LinkGuard};
pub use traits::{Connection, PeerInfo, RegInfo, RemoteReg, Standing, Transport, WriteWatch, Xfer};
