//! Transport agents' metadata through etcd, as NIXL's etcd metadata mode keeps it: each agent
//! announces its metadata under `/tessera/<cluster>/agents/<name>` (with the lease of every
//! announcement), peers are looked up by name instead of through a side channel, a peer whose
//! metadata changes (new registrations) is updated, and one whose key vanishes (withdrawn,
//! or its lease expired) is dropped.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tessera_sync::Mutex;

use tessera_transport::{Agent, ConnectError, Peer};
use tokio::sync::watch;

use crate::{Announcement, ClusterConfig, ClusterError, Members, View};

/// The kind under which agents announce their metadata.
pub const AGENTS: &str = "agents";

/// The peers a directory holds, by name, with the metadata each was loaded from.
type Held = Arc<Mutex<HashMap<String, (Vec<u8>, Peer)>>>;

/// Why a peer could not be had.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// No live agent of that name announced itself within the wait.
    #[error("no agent {name:?} in the cluster within {after:?}")]
    NotFound {
        /// The name asked for.
        name: String,
        /// How long it was waited for.
        after: Duration,
    },
    /// Its metadata was found, but connecting to it failed.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// The blocking connect could not run.
    #[error("connecting in the background: {0}")]
    Background(#[from] tokio::task::JoinError),
}

/// An agent in a cluster: its own metadata announced, its peers found by name and followed.
///
/// The directory holds a [`Peer`] handle for every peer it connected; it drops that handle
/// when the peer's key vanishes, so an agent that left is no longer a peer of this one once
/// the callers' own clones of the handle are gone too. Runs on the current tokio runtime.
pub struct AgentDirectory {
    agent: Arc<Agent>,
    announced: Announcement,
    members: Members,
    peers: Held,
    _follower: Follower,
}

/// The task that follows the other agents, stopped when dropped.
struct Follower(tokio::task::JoinHandle<()>);

impl Drop for Follower {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl std::fmt::Debug for AgentDirectory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentDirectory")
            .field("agent", &self.agent.name())
            .field("announced", &self.announced)
            .finish()
    }
}

impl AgentDirectory {
    /// Announces `agent`'s metadata in `cfg`'s cluster and follows the other agents there.
    pub fn start(cfg: &ClusterConfig, agent: Arc<Agent>) -> Result<Self, ClusterError> {
        let announced = Announcement::start(cfg, AGENTS, agent.name(), agent.metadata())?;
        let members = Members::start(cfg, AGENTS)?;
        let peers: Held = Arc::default();
        let task = tokio::spawn(follow(agent.clone(), members.subscribe(), peers.clone()));
        Ok(Self {
            agent,
            announced,
            members,
            peers,
            _follower: Follower(task),
        })
    }

    /// The agent.
    pub fn agent(&self) -> &Arc<Agent> {
        &self.agent
    }

    /// The announcement of this agent's metadata (its state says whether it is registered).
    pub fn announcement(&self) -> &Announcement {
        &self.announced
    }

    /// Announces the agent's metadata again: after it registered or deregistered memory, so
    /// that its peers see the registrations as they are now.
    pub fn republish(&self) {
        self.announced.set_value(self.agent.metadata());
    }

    /// The peer `name`, connected from its announced metadata, waiting up to `wait` for it
    /// to appear. Asked again, the same peer (updated to its latest metadata).
    pub async fn peer(&self, name: &str, wait: Duration) -> Result<Peer, PeerError> {
        let mut rx = self.members.subscribe();
        let found = tokio::time::timeout(wait, rx.wait_for(|v| v.members.contains_key(name)))
            .await
            .ok()
            .and_then(|r| r.ok().map(|v| v.members[name].clone()));
        let Some(meta) = found else {
            return Err(PeerError::NotFound {
                name: name.to_owned(),
                after: wait,
            });
        };
        let agent = self.agent.clone();
        let m = meta.clone();
        let peer = tokio::task::spawn_blocking(move || agent.add_remote(&m)).await??;
        self.peers
            .lock()
            .insert(name.to_owned(), (meta, peer.clone()));
        Ok(peer)
    }

    /// Names of the peers this directory holds a handle on.
    pub fn peers(&self) -> Vec<String> {
        let mut names: Vec<String> = self.peers.lock().keys().cloned().collect();
        names.sort();
        names
    }

    /// Withdraws the agent's metadata (its peers drop it at once) and stops following.
    pub async fn withdraw(self) {
        drop(self._follower);
        self.announced.withdraw().await;
    }
}

/// Applies each new view to the peers held: updated metadata is loaded, a vanished peer's
/// handle dropped.
async fn follow(agent: Arc<Agent>, mut rx: watch::Receiver<Arc<View>>, peers: Held) {
    while rx.changed().await.is_ok() {
        let view = rx.borrow_and_update().clone();
        if !view.synced || view.stale_since.is_some() {
            // Not known to be gone: keep every peer until etcd says.
            continue;
        }
        let (gone, changed) = {
            let held = peers.lock();
            let gone: Vec<String> = held
                .keys()
                .filter(|n| !view.members.contains_key(*n))
                .cloned()
                .collect();
            let changed: Vec<(String, Vec<u8>)> = held
                .iter()
                .filter_map(|(n, (meta, _))| {
                    let now = view.members.get(n)?;
                    (now != meta).then(|| (n.clone(), now.clone()))
                })
                .collect();
            (gone, changed)
        };
        for name in gone {
            tracing::info!(agent = agent.name(), peer = %name, "peer left the cluster; dropped");
            peers.lock().remove(&name);
        }
        for (name, meta) in changed {
            let a = agent.clone();
            let m = meta.clone();
            match tokio::task::spawn_blocking(move || a.add_remote(&m)).await {
                Ok(Ok(peer)) => {
                    peers.lock().insert(name, (meta, peer));
                }
                Ok(Err(e)) => {
                    tracing::warn!(agent = agent.name(), peer = %name, "loading its new metadata: {e}");
                }
                Err(e) => tracing::warn!(peer = %name, "loading its new metadata: {e}"),
            }
        }
    }
}
