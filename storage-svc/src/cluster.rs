//! Units found through etcd (the `etcd` feature): a unit announces how to reach it under its
//! cluster's `units` prefix ([`announce`]), and a client follows that set
//! ([`ClientConfig::cluster`](crate::ClientConfig::cluster)).

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tessera_cluster::{Announcement, ClusterError, Members};
use tessera_sync::{Arc, Mutex};

pub use tessera_cluster::{AnnounceState, ClusterConfig};

use crate::client::{Slot, Units};
use crate::error::ClientError;

/// The kind under which units announce themselves (`/tessera/<cluster>/units/<name>`).
pub const UNITS: &str = "units";

/// What a unit announces: how to reach it. Stored as JSON, readable with `etcdctl get`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitRecord {
    /// Its control address (`HOST:PORT` or `unix:PATH`), as clients connect to it.
    pub control: String,
    /// Its payload engine (`shm`, `tcp`, `ucx`, `nixl`).
    pub engine: String,
    /// Its payload engine's address, where it has one of its own (tcp).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload: Option<String>,
    /// Bytes it may store.
    pub capacity: u64,
}

/// Starts announcing unit `name` of `cfg`'s cluster with `record`, on the current tokio
/// runtime (see [`Announcement`]): registered as soon as etcd answers, again after etcd was
/// lost, withdrawn with [`Announcement::withdraw`].
pub fn announce(
    cfg: &ClusterConfig,
    name: &str,
    record: &UnitRecord,
) -> Result<Announcement, ClusterError> {
    let value = serde_json::to_vec(record).expect("a UnitRecord always serializes");
    Announcement::start(cfg, UNITS, name, value)
}

/// A client's view of its cluster: a watch of the units' prefix, and a task that turns each
/// new view into the client's unit set.
pub(crate) struct Discovery {
    members: Members,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Discovery {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Discovery {
    /// Reads the cluster's units (within `timeout`) into `units`, then follows them.
    pub(crate) async fn start(
        cfg: &ClusterConfig,
        timeout: Duration,
        units: &Arc<Mutex<Arc<Units>>>,
    ) -> Result<Self, ClientError> {
        let members =
            Members::start(cfg, UNITS).map_err(|e| ClientError::Membership(e.to_string()))?;
        let Some(first) = members.synced(timeout).await else {
            return Err(ClientError::Membership(format!(
                "etcd at {} did not answer within {timeout:?}",
                cfg.endpoints.join(",")
            )));
        };
        let mut follow = Follow {
            numbers: std::collections::HashMap::new(),
            next: 0,
            bad: std::collections::HashSet::new(),
        };
        *units.lock() = Arc::new(follow.apply(&Units::default(), &first));
        let mut rx = members.subscribe();
        let shared = Arc::downgrade(units);
        let task = tokio::spawn(async move {
            while rx.changed().await.is_ok() {
                let view = rx.borrow_and_update().clone();
                let Some(units) = shared.upgrade() else {
                    return;
                };
                let mut cur = units.lock();
                if cur.revision == view.revision && view.synced {
                    continue;
                }
                *cur = Arc::new(follow.apply(&cur, &view));
            }
        });
        Ok(Self { members, task })
    }

    /// How long the set has been the last known one, if etcd is unreachable.
    pub(crate) fn staleness(&self) -> Option<Duration> {
        self.members.view().staleness()
    }
}

/// Turns views into unit sets, keeping each unit's number and session across views.
struct Follow {
    /// Each name's number, given when first seen and kept if it leaves and returns.
    numbers: std::collections::HashMap<String, usize>,
    next: usize,
    /// Members whose value could not be read, logged once each.
    bad: std::collections::HashSet<String>,
}

impl Follow {
    fn apply(&mut self, cur: &Units, view: &tessera_cluster::View) -> Units {
        let mut out = Units {
            revision: view.revision,
            ..Units::default()
        };
        for (name, value) in &view.members {
            let record: UnitRecord = match serde_json::from_slice(value) {
                Ok(r) => r,
                Err(e) => {
                    if self.bad.insert(name.clone()) {
                        tracing::warn!(unit = %name, "ignoring a unit whose announcement is unreadable: {e}");
                    }
                    continue;
                }
            };
            let kept = cur
                .ids
                .iter()
                .position(|id| id == name)
                .map(|i| cur.slots[i].clone())
                .filter(|s| s.addr == record.control);
            let slot = kept.unwrap_or_else(|| {
                let number = *self.numbers.entry(name.clone()).or_insert_with(|| {
                    self.next += 1;
                    self.next - 1
                });
                tracing::info!(unit = number, name = %name, addr = %record.control, "unit joined");
                Arc::new(Slot::new(number, &record.control))
            });
            out.ids.push(name.clone());
            out.slots.push(slot);
        }
        for (id, slot) in cur.ids.iter().zip(&cur.slots) {
            if !out.ids.contains(id) {
                tracing::info!(unit = slot.number, name = %id, "unit left");
            }
        }
        out
    }
}
