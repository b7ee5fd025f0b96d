//! What a unit reports about itself (STATS).

use serde::{Deserialize, Serialize};

/// Pool usage: the registered memory that payloads land in. Idle registered memory is
/// `capacity - used`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolStats {
    /// Registered bytes.
    pub capacity: u64,
    /// Bytes leased.
    pub used: u64,
    /// Largest free range.
    pub largest_free: u64,
    /// Live blocks.
    pub live_blocks: u64,
    /// Registered bytes at most (0: not reported).
    #[serde(default)]
    pub limit: u64,
    /// Idle registered bytes kept at most; entirely free chunks beyond it are deregistered
    /// (0: not reported).
    #[serde(default)]
    pub idle_limit: u64,
    /// Registered chunks.
    #[serde(default)]
    pub chunks: u64,
}

/// Per-partition statistics.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionStats {
    /// Partition name.
    pub name: String,
    /// Stored (field, index) keys.
    pub keys: u64,
    /// Stored logical bytes.
    pub bytes: u64,
    /// Bytes of receive blocks leased to prepared PUTs of this partition.
    pub leased_bytes: u64,
    /// Bytes of this partition's receive blocks in quarantine.
    pub quarantined_bytes: u64,
}

/// Statistics of a unit.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// Per partition, by name.
    pub partitions: Vec<PartitionStats>,
    /// Stored keys.
    pub keys: u64,
    /// Stored logical bytes.
    pub bytes: u64,
    /// Configured capacity in logical bytes.
    pub capacity_bytes: u64,
    /// Registered pool usage.
    pub pool: PoolStats,
    /// Bytes leased to prepared PUTs.
    pub leased_bytes: u64,
    /// Bytes quarantined.
    pub quarantined_bytes: u64,
    /// Prepared PUTs waiting for COMMIT.
    pub pending_puts: u64,
    /// GETs waiting for the client's block or their WRITE.
    pub pending_gets: u64,
    /// Bytes copied by compaction since start.
    pub compacted_bytes: u64,
    /// Payload bytes received through the payload plane.
    pub bytes_in: u64,
    /// Payload bytes sent through the payload plane.
    pub bytes_out: u64,
    /// Open sessions.
    pub sessions: u64,
    /// Stored bytes charged against `capacity_bytes`: `bytes` plus what each key costs
    /// (`UnitConfig::key_overhead_bytes` and the key's length).
    #[serde(default)]
    pub charged_bytes: u64,
    /// Control connections being served (the server's; 0 from the core alone).
    #[serde(default)]
    pub connections: u64,
    /// Connections refused at `ServerConfig::max_connections`.
    #[serde(default)]
    pub refused_connections: u64,
    /// Accepts that failed (`EMFILE`, `ENFILE`, ...).
    #[serde(default)]
    pub accept_errors: u64,
    /// Bytes of registered memory held as credits: landing blocks kept ready for open
    /// sessions' next PUTs (`UnitConfig::credit_bytes`). Part of `pool.used`; a closed
    /// session's unused credits move to `quarantined_bytes`.
    #[serde(default)]
    pub credit_bytes: u64,
}
