#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod backend;
// The raw engine is the crate's own; the feature `testing` exposes it as `raw`.
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub, dead_code))]
mod engine;

pub use backend::Nixl;
pub use engine::{NixlConfig, NixlEngineError, NotifyFn, Side, XferKind};

/// The raw engine under [`Nixl`]: the NIXL agent, its peers, registrations and requests,
/// driven without a Tessera agent. Only for the engine's own tests and the `nixl_write_bw`
/// example (cargo feature `testing`); users go through [`Nixl`].
#[cfg(feature = "testing")]
pub mod raw {
    pub use crate::engine::{
        NixlEngine, NixlPeer, NixlProbe, NixlRegion, NixlReport, Pending, XferOpDesc,
    };
}
