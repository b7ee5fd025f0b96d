//! The unit's timer: expiries, stats gauges, trimming idle memory, and releasing the
//! quarantine of closed sessions once their clients' links are torn down.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_transport::LinkState;
use tokio::sync::watch;

use super::transfers::dispatch;
use super::{lock, SessionHandle, Shared};
use crate::core::{SessionId, TornDown};

pub(super) async fn timer_loop(shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    loop {
        let next = lock(&shared.unit).poll_timeout();
        let wait = next
            .map(|t| t.saturating_duration_since(Instant::now()))
            .unwrap_or(Duration::from_millis(200))
            .clamp(Duration::from_millis(5), Duration::from_millis(200));
        tokio::select! {
            _ = stop.changed() => break,
            _ = tokio::time::sleep(wait) => {}
        }
        release_torn_down(&shared);
        let out = {
            let mut unit = lock(&shared.unit);
            let out = unit.handle_timeout(Instant::now());
            // Blocks also come back when the executor drops a GET's frames: trim here too.
            unit.trim_memory();
            out
        };
        dispatch(&shared, out);
        crate::metrics::record_stats(&lock(&shared.unit).stats());
    }
}

/// Closes session `sid` in the core. What its client was shown stays quarantined until the
/// client can no longer write into it: engines that can tell when a peer's link is torn down
/// (`tcp`, `shm`) are asked on each tick of the timer; for the others the core's
/// `late_write_grace` runs out.
pub(super) fn close_in_core(shared: &Shared, sid: SessionId, handle: Option<&SessionHandle>) {
    let peer = handle.map(|h| h.peer.clone()).unwrap_or_default();
    let how = if peer.is_empty() || shared.agent.peer_link(&peer) == LinkState::Unknown {
        TornDown::Grace
    } else {
        TornDown::Signalled
    };
    let mut unit = lock(&shared.unit);
    unit.close_session(sid, Instant::now(), how);
    if how == TornDown::Signalled && unit.closed_sessions().contains(&sid) {
        lock(&shared.lingering).insert(sid, peer);
    }
}

/// Releases the quarantine of closed sessions whose client's link is torn down.
pub(super) fn release_torn_down(shared: &Shared) {
    let gone: Vec<SessionId> = lock(&shared.lingering)
        .iter()
        .filter(|(_, peer)| shared.agent.peer_link(peer) != LinkState::Open)
        .map(|(sid, _)| *sid)
        .collect();
    if gone.is_empty() {
        return;
    }
    let mut unit = lock(&shared.unit);
    for sid in gone {
        lock(&shared.lingering).remove(&sid);
        let bytes = unit.release_closed(sid);
        tracing::debug!(
            session = sid,
            bytes,
            "client's link torn down; quarantine released"
        );
    }
    unit.trim_memory();
}
