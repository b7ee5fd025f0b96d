//! `tessera-demo`: Tessera end to end on one machine, as `cargo xtask demo` runs it.
//!
//! `run` starts a storage unit, a consumer (a trainer) and a producer (a rollout worker) as
//! separate processes of this binary. The producer PUTs RL rollouts step by step; the consumer
//! GETs, verifies and CLEARs them as they become ready; then the trainer syncs an LLM-shaped
//! weight set to the rollout worker through a sender and a receiver pool (tessera-rdt-pool).
//! Every byte is checked against a CRC32 its sender computed, and the run ends with a summary
//! of throughput, latency, pool usage and copies. The other subcommands are the roles `run`
//! spawns.
//!
//! It never falls back to another engine: a backend this build lacks (`ucx` and `nixl` need
//! the cargo features of the same name) is an error before anything starts.
#![forbid(unsafe_code)]

mod events;
mod orchestrator;
mod roles;
mod summary;
mod workload;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "tessera-demo",
    about = "Tessera end to end: a storage unit, a producer and a consumer as processes"
)]
struct Cli {
    #[command(subcommand)]
    role: Role,
}

#[derive(Subcommand)]
enum Role {
    /// Run the demo: start the unit, the consumer and the producer, print the summary.
    Run(orchestrator::RunArgs),
    /// The storage unit (started by `run`; stops when its stdin closes).
    Unit(roles::ServeArgs),
    /// The producer, a rollout worker (started by `run`).
    Producer(roles::WorkerArgs),
    /// The consumer, a trainer (started by `run`).
    Consumer(roles::WorkerArgs),
}

/// mimalloc: glibc's allocator gives back the top of its heap as soon as more than 128 KiB
/// of it is free, so a request that allocates and frees more (the descriptors and values of a
/// batch of a thousand tensors) faulted its pages in again each time.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let cli = Cli::parse();
    let code = match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            1
        }
    };
    std::process::exit(code)
}

fn run(cli: Cli) -> Result<i32> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        match cli.role {
            Role::Run(a) => orchestrator::run(a).await,
            Role::Unit(a) => roles::serve(a).await.map(|()| 0),
            Role::Producer(a) => roles::producer(a).await.map(|()| 0),
            Role::Consumer(a) => roles::consumer(a).await.map(|()| 0),
        }
    })
}
