//! Metrics through the `metrics` facade: per-operation latency (recorded as histograms, which the
//! binary's Prometheus exporter renders as summaries), bytes in and out,
//! registered / idle / leased / quarantined bytes, pool usage, errors by kind and per-peer
//! transfer queue depth. Without an installed recorder (the library default) they cost a
//! branch; the binary installs the Prometheus exporter.

use std::time::Duration;

use crate::core::{Output, Stats};
use crate::error::ErrorKind;
use crate::proto::Response;

pub(crate) fn request<D>(op: &'static str, took: Duration, out: &[Output<D>]) {
    metrics::histogram!("tessera_storage_request_seconds", "op" => op).record(took.as_secs_f64());
    for o in out {
        if let Output::Reply {
            response: Response::Error(e),
            ..
        } = o
        {
            error(e.kind);
        }
    }
}

pub(crate) fn error(kind: ErrorKind) {
    metrics::counter!("tessera_storage_errors_total", "kind" => kind.as_str()).increment(1);
}

pub(crate) fn queue_depth(peer: &str, depth: u64) {
    metrics::gauge!("tessera_storage_transfer_queue_depth", "peer" => peer.to_owned())
        .set(depth as f64);
}

pub(crate) fn record_stats(s: &Stats) {
    metrics::gauge!("tessera_storage_keys").set(s.keys as f64);
    metrics::gauge!("tessera_storage_stored_bytes").set(s.bytes as f64);
    metrics::gauge!("tessera_storage_registered_bytes").set(s.pool.capacity as f64);
    metrics::gauge!("tessera_storage_idle_bytes")
        .set(s.pool.capacity.saturating_sub(s.pool.used) as f64);
    metrics::gauge!("tessera_storage_pool_used_bytes").set(s.pool.used as f64);
    metrics::gauge!("tessera_storage_registered_chunks").set(s.pool.chunks as f64);
    metrics::gauge!("tessera_storage_leased_bytes").set(s.leased_bytes as f64);
    metrics::gauge!("tessera_storage_credit_bytes").set(s.credit_bytes as f64);
    metrics::gauge!("tessera_storage_quarantined_bytes").set(s.quarantined_bytes as f64);
    metrics::gauge!("tessera_storage_compacted_bytes").set(s.compacted_bytes as f64);
    metrics::gauge!("tessera_storage_bytes_in").set(s.bytes_in as f64);
    metrics::gauge!("tessera_storage_bytes_out").set(s.bytes_out as f64);
    metrics::gauge!("tessera_storage_sessions").set(s.sessions as f64);
}

pub(crate) fn refused_connection() {
    metrics::counter!("tessera_storage_refused_connections_total").increment(1);
}

pub(crate) fn accept_error() {
    metrics::counter!("tessera_storage_accept_errors_total").increment(1);
}

/// A repair batch's progress (client side): indexes looked at, copies written, indexes lost.
pub(crate) fn repair(checked: u64, copies: u64, lost: u64) {
    metrics::counter!("tessera_storage_repair_checked_total").increment(checked);
    metrics::counter!("tessera_storage_repair_copies_total").increment(copies);
    metrics::counter!("tessera_storage_repair_lost_total").increment(lost);
}
