//! What a role tells the orchestrator: one JSON object per line on its stdout. Progress feeds
//! the bars; the final report feeds the summary table. Diagnostics go to stderr.

use std::io::Write;

use serde::{Deserialize, Serialize};

/// A line a producer or consumer prints.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub(crate) enum Event {
    /// `done` of `total` units of `phase` are finished.
    Progress { phase: Phase, done: u64, total: u64 },
    /// What the role is doing now, for the bar of `phase`.
    Stage { phase: Phase, text: String },
    /// The producer stopped after its first step and waits to be killed (`--stall`).
    Stalled,
    /// The producer's final report.
    Producer(Box<ProducerReport>),
    /// The consumer's final report.
    Consumer(Box<ConsumerReport>),
}

/// A phase that has a progress bar.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Phase {
    /// Rollouts PUT (counted in rollouts).
    Produce,
    /// Rollouts GET, verified and CLEARed (counted in rollouts).
    Consume,
    /// Weight bytes fetched and verified.
    Weights,
}

/// Prints `event` as one line and flushes it.
pub(crate) fn emit(event: &Event) {
    let line = serde_json::to_string(event).expect("events serialize");
    let mut out = std::io::stdout().lock();
    // A closed stdout means the orchestrator is gone; the stdin watch ends the process.
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Occupancy of a pool at one moment.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub(crate) struct PoolUse {
    pub(crate) capacity: u64,
    pub(crate) used: u64,
}

impl From<tessera_rdt_pool::PoolReport> for PoolUse {
    fn from(r: tessera_rdt_pool::PoolReport) -> Self {
        PoolUse {
            capacity: r.capacity,
            used: r.used,
        }
    }
}

/// Timings of a series of requests.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct Timings {
    /// Each request's latency, in microseconds.
    pub(crate) latencies_us: Vec<u64>,
    /// Payload bytes the requests moved.
    pub(crate) bytes: u64,
}

impl Timings {
    pub(crate) fn record(&mut self, took: std::time::Duration, bytes: u64) {
        self.latencies_us.push(took.as_micros() as u64);
        self.bytes += bytes;
    }

    /// Seconds spent inside the requests.
    pub(crate) fn busy_secs(&self) -> f64 {
        self.latencies_us.iter().sum::<u64>() as f64 / 1e6
    }
}

/// The producer (rollout worker): PUTs rollouts, then receives the weights.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct ProducerReport {
    pub(crate) puts: Timings,
    /// Seconds from the first PUT to the last step's marker.
    pub(crate) produce_wall_secs: f64,
    pub(crate) rollouts: u64,
    /// PUTs refused for capacity and retried once the consumer made room.
    pub(crate) backpressure_retries: u64,
    pub(crate) weights: WeightsReceived,
}

/// The weight receiver's side of the sync.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct WeightsReceived {
    /// Seconds of each version's fetch (one READ per block), in order.
    pub(crate) fetch_secs: Vec<f64>,
    pub(crate) bytes_per_sync: u64,
    pub(crate) tensors_verified: u64,
    pub(crate) mismatches: u64,
    /// Received tensors whose bytes lie inside the receive pool's registration.
    pub(crate) views_in_pool: u64,
    pub(crate) pool_before: PoolUse,
    pub(crate) pool_holding: PoolUse,
    pub(crate) pool_after: PoolUse,
}

/// The consumer (trainer): GETs, verifies and CLEARs rollouts, then sends the weights.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct ConsumerReport {
    pub(crate) gets: Timings,
    pub(crate) clears: Timings,
    /// Seconds from the first marker seen to the last CLEAR.
    pub(crate) consume_wall_secs: f64,
    pub(crate) rollouts_verified: u64,
    pub(crate) mismatches: u64,
    /// Tensors the GETs returned, and those among them that are views of the client's
    /// registered receive pool.
    pub(crate) tensors_received: u64,
    pub(crate) views_in_pool: u64,
    /// GETs of a step's marker answered "missing" (the producer had not finished the step).
    pub(crate) marker_polls: u64,
    pub(crate) recv_pool_after: u64,
    pub(crate) weights: WeightsSent,
}

/// The weight sender's side of the sync.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct WeightsSent {
    /// Seconds of each version's `SenderPool::put` (packing copy), in order.
    pub(crate) pack_secs: Vec<f64>,
    /// Seconds from each version's publication to the receiver's acknowledgement.
    pub(crate) sync_secs: Vec<f64>,
    pub(crate) tensors: u64,
    pub(crate) bytes: u64,
    /// Remote blocks (one descriptor, one READ entry each) of the last version.
    pub(crate) blocks: u64,
    pub(crate) pool_before: PoolUse,
    pub(crate) pool_holding: PoolUse,
    pub(crate) pool_after: PoolUse,
    /// Bytes described in place (no packing copy).
    pub(crate) in_place: u64,
}
