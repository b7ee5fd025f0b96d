//! The side-by-side benchmark harness of Tessera. Each suite measures Tessera and its in-run
//! references (memcpy, peer crates, raw sockets) and reports ratios between them.

pub mod alloc;
pub mod codec;
mod cpu;
pub mod hostile;
/// The attacks, probe and soak workload the `hostile` suite shares with the soak test.
#[path = "../../storage-svc/cli/tests/common/hostile.rs"]
mod hostile_load;
pub mod plot;
pub mod pool;
pub mod report;
pub mod storage;
pub mod timing;
pub mod transport;

pub use report::Report;

/// A suite: its name and the function that fills its report.
pub type Suite = (&'static str, fn(&mut Report) -> anyhow::Result<()>);

/// Every suite, in the order `cargo xtask bench` runs them.
pub const SUITES: &[Suite] = &[
    ("alloc", alloc::run),
    ("codec", codec::run),
    ("transport", transport::run),
    ("pool", pool::run),
    ("storage", storage::run),
    ("hostile", hostile::run),
];
