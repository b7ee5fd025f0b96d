#![doc = include_str!("../README.md")]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use etcd_client::{
    Client, ConnectOptions, EventType, GetOptions, PutOptions, WatchOptions, WatchResponse,
};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

pub mod agents;
pub mod testing;

/// Where a cluster's keys live: etcd's endpoints and the cluster's name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterConfig {
    /// etcd client URLs (`http://10.0.0.1:2379`); any one of them may answer.
    pub endpoints: Vec<String>,
    /// The cluster's name: its members' keys are under `/tessera/<cluster>/`.
    pub cluster: String,
    /// How long an announcement outlives its member's last keep-alive (etcd leases count in
    /// whole seconds, at least its minimum, 2 s by default): the time a dead member stays
    /// listed.
    pub lease_ttl: Duration,
    /// The longest wait between attempts to reach etcd after it failed.
    pub retry_max: Duration,
}

impl ClusterConfig {
    /// A cluster `cluster` kept in the etcd at `endpoints`, with a 5 s lease.
    pub fn new(endpoints: Vec<String>, cluster: impl Into<String>) -> Self {
        Self {
            endpoints,
            cluster: cluster.into(),
            lease_ttl: Duration::from_secs(5),
            retry_max: Duration::from_secs(2),
        }
    }

    /// The prefix of the keys of members of `kind` (`/tessera/<cluster>/<kind>/`).
    pub fn prefix(&self, kind: &str) -> String {
        format!("/tessera/{}/{kind}/", self.cluster)
    }

    /// The lease's TTL in etcd's whole seconds (rounded up, at least 1).
    fn ttl_secs(&self) -> i64 {
        let ms = self.lease_ttl.as_millis().max(1);
        ms.div_ceil(1000).min(i64::MAX as u128) as i64
    }

    fn check(&self, kind: &str, member: Option<&str>) -> Result<(), ClusterError> {
        if self.endpoints.is_empty() {
            return Err(ClusterError::Config("no etcd endpoints".into()));
        }
        for (what, name) in [
            ("cluster", Some(self.cluster.as_str())),
            ("kind", Some(kind)),
        ]
        .into_iter()
        .chain([("member", member)])
        {
            let Some(name) = name else { continue };
            if name.is_empty() || name.contains('/') {
                return Err(ClusterError::Config(format!(
                    "the {what} name {name:?} must be non-empty and have no '/'"
                )));
            }
        }
        Ok(())
    }

    /// Connects to etcd, failing within about `lease_ttl` when it does not answer. HTTP/2
    /// keep-alives notice a silent etcd (a cut link) within the same time.
    async fn connect(&self) -> Result<Client, etcd_client::Error> {
        let within = self
            .lease_ttl
            .clamp(Duration::from_millis(500), Duration::from_secs(5));
        let opts = ConnectOptions::new()
            .with_connect_timeout(within)
            .with_timeout(within)
            .with_keep_alive(within / 2, within / 2)
            .with_keep_alive_while_idle(true);
        let mut client = Client::connect(&self.endpoints, Some(opts)).await?;
        // The channel connects lazily: one round trip proves etcd is there.
        client.status().await?;
        Ok(client)
    }
}

/// What can go wrong when starting to announce or watch.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The configuration cannot work.
    #[error("cluster configuration: {0}")]
    Config(String),
    /// etcd refused or failed a request.
    #[error("etcd at {endpoints}: {source}")]
    Etcd {
        /// The endpoints asked.
        endpoints: String,
        /// What the etcd client said.
        #[source]
        source: etcd_client::Error,
    },
}

impl ClusterError {
    fn etcd(cfg: &ClusterConfig, source: etcd_client::Error) -> Self {
        Self::Etcd {
            endpoints: cfg.endpoints.join(","),
            source,
        }
    }
}

/// Tells once that etcd was lost and once that it came back, not at every retry.
struct Outage {
    what: String,
    down_since: Option<Instant>,
    attempts: u64,
}

impl Outage {
    fn new(what: String) -> Self {
        Self {
            what,
            down_since: None,
            attempts: 0,
        }
    }

    fn failed(&mut self, cfg: &ClusterConfig, e: &dyn std::fmt::Display) {
        self.attempts += 1;
        if self.down_since.is_none() {
            self.down_since = Some(Instant::now());
            tracing::warn!(
                endpoints = %cfg.endpoints.join(","),
                "{}: etcd unreachable ({e}); retrying every {:?} at most",
                self.what,
                cfg.retry_max
            );
        }
    }

    fn recovered(&mut self) {
        if let Some(since) = self.down_since.take() {
            tracing::info!(
                "{}: etcd is back after {:.1?} and {} failed attempts",
                self.what,
                since.elapsed(),
                self.attempts
            );
        }
        self.attempts = 0;
    }

    /// The wait before attempt `attempts + 1`: doubling from 100 ms to `retry_max`.
    fn backoff(&self, cfg: &ClusterConfig) -> Duration {
        let exp = self.attempts.saturating_sub(1).min(16) as u32;
        Duration::from_millis(100)
            .saturating_mul(1 << exp)
            .min(cfg.retry_max)
    }
}

/// The state of an [`Announcement`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AnnounceState {
    /// Whether the key is in etcd under a live lease, as of the last keep-alive.
    pub registered: bool,
    /// The current lease's id, while registered.
    pub lease: Option<i64>,
    /// How many times the key was (re)written: 1 after the first registration, more after
    /// etcd was lost long enough for the lease to expire.
    pub registrations: u64,
    /// Attempts that failed since the last registration.
    pub failures: u64,
    /// The last failure.
    pub last_error: Option<String>,
}

/// A member's key in etcd, kept alive by a task of the current tokio runtime until
/// [`withdraw`](Self::withdraw)n. Dropped without withdrawing, the task stops and the key
/// lives out its lease, as it would if the process had died.
pub struct Announcement {
    key: String,
    value: watch::Sender<Vec<u8>>,
    state: watch::Receiver<AnnounceState>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Announcement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Announcement")
            .field("key", &self.key)
            .field("state", &*self.state.borrow())
            .finish()
    }
}

impl Announcement {
    /// Starts announcing `member` of `kind` with `value`, on the current tokio runtime.
    /// Returns at once: the key is written as soon as etcd answers, and again whenever its
    /// lease was lost. Fails only on a configuration that cannot work.
    pub fn start(
        cfg: &ClusterConfig,
        kind: &str,
        member: &str,
        value: Vec<u8>,
    ) -> Result<Self, ClusterError> {
        cfg.check(kind, Some(member))?;
        let key = format!("{}{member}", cfg.prefix(kind));
        let (tx, rx) = watch::channel(AnnounceState::default());
        let (stop_tx, stop_rx) = oneshot::channel();
        let (value, value_rx) = watch::channel(value);
        let task = tokio::spawn(announce(cfg.clone(), key.clone(), value_rx, tx, stop_rx));
        Ok(Self {
            key,
            value,
            state: rx,
            stop: Some(stop_tx),
            task: Some(task),
        })
    }

    /// The key announced.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Announces `value` from now on: written at once under the same lease when
    /// registered, else at the next registration.
    pub fn set_value(&self, value: Vec<u8>) {
        self.value.send_replace(value);
    }

    /// The announcement's state now.
    pub fn state(&self) -> AnnounceState {
        self.state.borrow().clone()
    }

    /// Waits until the key is registered; false when `timeout` passed first.
    pub async fn registered(&self, timeout: Duration) -> bool {
        let mut rx = self.state.clone();
        tokio::time::timeout(timeout, rx.wait_for(|s| s.registered))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Stops keeping the key alive and revokes its lease, so that watchers see it go at
    /// once. Where etcd is unreachable the key lives out its lease.
    pub async fn withdraw(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Announcement {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// How one registration ended.
enum Ended {
    /// Withdrawn: the task is done.
    Withdrawn,
    /// Lost: etcd failed, or the lease expired.
    Lost(String),
}

async fn announce(
    cfg: ClusterConfig,
    key: String,
    mut value: watch::Receiver<Vec<u8>>,
    state: watch::Sender<AnnounceState>,
    mut stop: oneshot::Receiver<()>,
) {
    let mut outage = Outage::new(format!("announcing {key}"));
    loop {
        let why = match register(&cfg, &key, &mut value, &state, &mut outage, &mut stop).await {
            Ended::Withdrawn => return,
            Ended::Lost(why) => why,
        };
        outage.failed(&cfg, &why);
        state.send_modify(|s| {
            s.registered = false;
            s.lease = None;
            s.failures += 1;
            s.last_error = Some(why);
        });
        tokio::select! {
            _ = tokio::time::sleep(outage.backoff(&cfg)) => {}
            _ = &mut stop => return,
        }
    }
}

/// Registers `key` under a fresh lease and keeps it alive until etcd fails, the lease is lost
/// or the announcement is withdrawn (then the lease is revoked).
async fn register(
    cfg: &ClusterConfig,
    key: &str,
    value: &mut watch::Receiver<Vec<u8>>,
    state: &watch::Sender<AnnounceState>,
    outage: &mut Outage,
    stop: &mut oneshot::Receiver<()>,
) -> Ended {
    let lost = |what: &str, e: etcd_client::Error| Ended::Lost(format!("{what}: {e}"));
    let setup = async {
        let mut client = cfg.connect().await.map_err(|e| lost("connecting", e))?;
        let lease = client
            .lease_grant(cfg.ttl_secs(), None)
            .await
            .map_err(|e| lost("granting a lease", e))?;
        let id = lease.id();
        let put = PutOptions::new().with_lease(id);
        let now = value.borrow_and_update().clone();
        if let Err(e) = client.put(key, now, Some(put)).await {
            let _ = client.lease_revoke(id).await;
            return Err(lost("writing the key", e));
        }
        let kept = client
            .lease_keep_alive(id)
            .await
            .map_err(|e| lost("keeping the lease alive", e))?;
        Ok((client, id, lease.ttl(), kept))
    };
    // Withdrawn before it was registered: a lease granted meanwhile lives out its TTL.
    let (mut client, id, ttl, (mut keeper, mut answers)) = tokio::select! {
        setup = setup => match setup {
            Ok(s) => s,
            Err(ended) => return ended,
        },
        _ = &mut *stop => return Ended::Withdrawn,
    };
    let ttl = Duration::from_secs(ttl.max(1) as u64);
    outage.recovered();
    tracing::debug!(key, lease = id, ?ttl, "registered in etcd");
    state.send_modify(|s| {
        s.registered = true;
        s.lease = Some(id);
        s.registrations += 1;
        s.failures = 0;
    });
    // Three keep-alives per TTL: one lost answer does not lose the lease.
    let mut tick = tokio::time::interval(ttl / 3);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = &mut *stop => {
                let _ = tokio::time::timeout(ttl, client.lease_revoke(id)).await;
                return Ended::Withdrawn;
            }
            Ok(()) = value.changed() => {
                let now = value.borrow_and_update().clone();
                let put = PutOptions::new().with_lease(id);
                if let Err(e) = client.put(key, now, Some(put)).await {
                    return lost("writing the new value", e);
                }
            }
            _ = tick.tick() => {
                if let Err(e) = keeper.keep_alive().await {
                    return lost("sending a keep-alive", e);
                }
                match tokio::time::timeout(ttl, answers.message()).await {
                    Ok(Ok(Some(answer))) if answer.ttl() > 0 => {}
                    Ok(Ok(Some(_))) => return Ended::Lost("the lease expired".into()),
                    Ok(Ok(None)) => return Ended::Lost("the keep-alive stream ended".into()),
                    Ok(Err(e)) => return lost("keeping the lease alive", e),
                    Err(_) => return Ended::Lost(format!("no keep-alive answer within {ttl:?}")),
                }
            }
        }
    }
}

/// Reads the value `member` of `kind` announced, if it is live: one request, for a member
/// looked up once (a peer's agent metadata) rather than followed.
pub async fn lookup(
    cfg: &ClusterConfig,
    kind: &str,
    member: &str,
) -> Result<Option<Vec<u8>>, ClusterError> {
    cfg.check(kind, Some(member))?;
    let key = format!("{}{member}", cfg.prefix(kind));
    let mut client = cfg
        .connect()
        .await
        .map_err(|e| ClusterError::etcd(cfg, e))?;
    let got = client
        .get(key, None)
        .await
        .map_err(|e| ClusterError::etcd(cfg, e))?;
    Ok(got.kvs().first().map(|kv| kv.value().to_vec()))
}

/// A watched member set, as last read from etcd.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct View {
    /// Members by name, with the value each announced.
    pub members: BTreeMap<String, Vec<u8>>,
    /// The etcd revision this view is as of.
    pub revision: i64,
    /// Whether etcd has been read at least once (before that the view is empty, not known).
    pub synced: bool,
    /// Since when etcd has been unreachable (the view is the last known one), if it is.
    pub stale_since: Option<Instant>,
}

impl View {
    /// How long the view has been stale, if it is.
    pub fn staleness(&self) -> Option<Duration> {
        self.stale_since.map(|t| t.elapsed())
    }
}

/// The live members of one kind, kept current by a task of the current tokio runtime that
/// watches their prefix (stopped when this is dropped).
pub struct Members {
    view: watch::Receiver<std::sync::Arc<View>>,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for Members {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Members")
            .field("view", &*self.view.borrow())
            .finish()
    }
}

impl Members {
    /// Starts watching the members of `kind`, on the current tokio runtime. Returns at once;
    /// see [`synced`](Self::synced).
    pub fn start(cfg: &ClusterConfig, kind: &str) -> Result<Self, ClusterError> {
        cfg.check(kind, None)?;
        let (tx, rx) = watch::channel(std::sync::Arc::new(View::default()));
        let task = tokio::spawn(follow(cfg.clone(), cfg.prefix(kind), tx));
        Ok(Self { view: rx, task })
    }

    /// The view now.
    pub fn view(&self) -> std::sync::Arc<View> {
        self.view.borrow().clone()
    }

    /// A receiver that sees every new view.
    pub fn subscribe(&self) -> watch::Receiver<std::sync::Arc<View>> {
        self.view.clone()
    }

    /// Waits until etcd has been read once, for at most `timeout`.
    pub async fn synced(&self, timeout: Duration) -> Option<std::sync::Arc<View>> {
        let mut rx = self.view.clone();
        let got = tokio::time::timeout(timeout, rx.wait_for(|v| v.synced)).await;
        match got {
            Ok(Ok(v)) => Some(v.clone()),
            _ => None,
        }
    }
}

impl Drop for Members {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn follow(cfg: ClusterConfig, prefix: String, view: watch::Sender<std::sync::Arc<View>>) {
    let mut outage = Outage::new(format!("watching {prefix}"));
    loop {
        let why = watch_once(&cfg, &prefix, &view, &mut outage).await;
        outage.failed(&cfg, &why);
        view.send_if_modified(|v| {
            if v.stale_since.is_some() {
                return false;
            }
            std::sync::Arc::make_mut(v).stale_since = Some(Instant::now());
            true
        });
        if view.is_closed() {
            return;
        }
        tokio::time::sleep(outage.backoff(&cfg)).await;
    }
}

/// Reads the prefix, then follows its events until something fails; returns why.
async fn watch_once(
    cfg: &ClusterConfig,
    prefix: &str,
    view: &watch::Sender<std::sync::Arc<View>>,
    outage: &mut Outage,
) -> String {
    let mut client = match cfg.connect().await {
        Ok(c) => c,
        Err(e) => return format!("connecting: {e}"),
    };
    let got = match client
        .get(prefix, Some(GetOptions::new().with_prefix()))
        .await
    {
        Ok(g) => g,
        Err(e) => return format!("reading {prefix}: {e}"),
    };
    let revision = got.header().map_or(0, |h| h.revision());
    let members: BTreeMap<String, Vec<u8>> = got
        .kvs()
        .iter()
        .filter_map(|kv| name_of(prefix, kv.key()).map(|n| (n, kv.value().to_vec())))
        .collect();
    let opts = WatchOptions::new()
        .with_prefix()
        .with_start_revision(revision + 1);
    let mut stream = match client.watch(prefix, Some(opts)).await {
        Ok(s) => s,
        Err(e) => return format!("watching {prefix}: {e}"),
    };
    outage.recovered();
    view.send_replace(std::sync::Arc::new(View {
        members,
        revision,
        synced: true,
        stale_since: None,
    }));
    loop {
        let answer: WatchResponse = match stream.message().await {
            Ok(Some(a)) => a,
            Ok(None) => return "the watch stream ended".into(),
            Err(e) => return format!("watching {prefix}: {e}"),
        };
        if answer.canceled() {
            // Compacted past our revision, or etcd cancelled it: read the prefix anew.
            return format!("the watch was cancelled: {}", answer.cancel_reason());
        }
        let events = answer.events();
        if events.is_empty() {
            continue;
        }
        view.send_modify(|v| {
            let v = std::sync::Arc::make_mut(v);
            for event in events {
                let Some(kv) = event.kv() else { continue };
                let Some(name) = name_of(prefix, kv.key()) else {
                    continue;
                };
                match event.event_type() {
                    EventType::Put => {
                        v.members.insert(name, kv.value().to_vec());
                    }
                    EventType::Delete => {
                        v.members.remove(&name);
                    }
                }
                v.revision = v.revision.max(kv.mod_revision());
            }
        });
    }
}

/// The member name of `key` under `prefix` (none for keys further down).
fn name_of(prefix: &str, key: &[u8]) -> Option<String> {
    let rest = key.strip_prefix(prefix.as_bytes())?;
    let name = std::str::from_utf8(rest).ok()?;
    (!name.is_empty() && !name.contains('/')).then(|| name.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_prefixes() {
        let cfg = ClusterConfig::new(vec!["http://127.0.0.1:2379".into()], "c1");
        assert_eq!(cfg.prefix("units"), "/tessera/c1/units/");
        assert_eq!(
            name_of("/tessera/c1/units/", b"/tessera/c1/units/10.0.0.1:7470").as_deref(),
            Some("10.0.0.1:7470")
        );
        assert_eq!(
            name_of("/tessera/c1/units/", b"/tessera/c1/units/a/b"),
            None
        );
        assert_eq!(name_of("/tessera/c1/units/", b"/tessera/c1/units/"), None);
        assert_eq!(name_of("/tessera/c1/units/", b"/tessera/c2/units/x"), None);
        assert!(cfg.check("units", Some("a/b")).is_err());
        assert!(cfg.check("", None).is_err());
        let mut none = cfg.clone();
        none.endpoints.clear();
        assert!(none.check("units", None).is_err());
        assert!(cfg.check("units", Some("u1")).is_ok());
    }

    #[test]
    fn ttls_round_up_to_whole_seconds() {
        let mut cfg = ClusterConfig::new(vec!["x".into()], "c");
        for (ms, secs) in [(1, 1), (999, 1), (1000, 1), (1001, 2), (5000, 5)] {
            cfg.lease_ttl = Duration::from_millis(ms);
            assert_eq!(cfg.ttl_secs(), secs, "{ms} ms");
        }
    }

    #[test]
    fn backoff_doubles_up_to_its_cap() {
        let cfg = ClusterConfig::new(vec!["x".into()], "c");
        let mut o = Outage::new("t".into());
        let mut waits = Vec::new();
        for _ in 0..8 {
            o.failed(&cfg, &"down");
            waits.push(o.backoff(&cfg).as_millis());
        }
        assert_eq!(waits, [100, 200, 400, 800, 1600, 2000, 2000, 2000]);
        o.recovered();
        o.failed(&cfg, &"down");
        assert_eq!(o.backoff(&cfg).as_millis(), 100);
    }
}
