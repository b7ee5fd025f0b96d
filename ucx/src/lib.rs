#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod backend;
mod config;
// The raw engine is the crate's own; the feature `testing` exposes it as `raw`.
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub, dead_code))]
mod engine;
mod key;
#[allow(clippy::all)]
mod sys;

pub use backend::Ucx;
pub use config::{ErrorHandling, NotifyFn, RmaKind, Side, UcxConfig, UcxError};
pub use engine::UcxReport;

/// The raw engine under [`Ucx`]: context, worker, endpoints, memory regions and requests,
/// driven without an agent. Only for the engine's own tests and the `ucx_put_bw` example
/// (cargo feature `testing`); users go through [`Ucx`].
#[cfg(feature = "testing")]
pub mod raw {
    pub use crate::engine::{MemRegion, Pending, RmaOp, UcxEndpoint, UcxEngine, UcxProbe};
}
