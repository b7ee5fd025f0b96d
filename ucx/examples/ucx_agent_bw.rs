//! WRITE bandwidth of the `ucx` backend through `Agent`, between two pinned processes.
//!
//! `cargo run --release -p tessera-ucx --example ucx_agent_bw [SIZE] [ITERS]`
//! (SIZE in MiB, or KiB with a `K` suffix); transports
//! come from `UCX_TLS`; `TESSERA_UCX_ERR_MODE=none` drops peer error handling (compare with
//! `ucx_perftest` without `-e`; the default compares with `ucx_perftest -e`).

#[path = "../../onesided/examples/bw_common/agent.rs"]
mod agent;
#[path = "../../onesided/examples/bw_common/mod.rs"]
mod bw_common;

use tessera_transport::Agent;
use tessera_ucx::{ErrorHandling, Ucx, UcxConfig};

fn main() {
    agent::main(|name| {
        let mut config = UcxConfig::new(name);
        if std::env::var("TESSERA_UCX_ERR_MODE").is_ok_and(|m| m == "none") {
            config.error_handling = ErrorHandling::None;
        }
        Agent::new(name, Ucx::new(config)).expect("agent")
    });
}
