//! WRITE bandwidth of the `nixl` backend through `Agent`, between two pinned processes.
//!
//! `cargo run --release -p tessera-nixl --example nixl_agent_bw [SIZE] [ITERS]`
//! (SIZE in MiB, or KiB with a `K` suffix); NIXL's
//! UCX backend takes its transports from `UCX_TLS`.

#[path = "../../onesided/examples/bw_common/agent.rs"]
mod agent;
#[path = "../../onesided/examples/bw_common/mod.rs"]
mod bw_common;

use tessera_nixl::{Nixl, NixlConfig};
use tessera_transport::Agent;

fn main() {
    agent::main(|name| Agent::new(name, Nixl::new(NixlConfig::new(name))).expect("agent"));
}
