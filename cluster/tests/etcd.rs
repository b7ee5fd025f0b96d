//! Announcements and watches against a real etcd (Debian's `etcd-server`), one private
//! server per test.

use std::time::{Duration, Instant};

use tessera_cluster::testing::Etcd;
use tessera_cluster::{Announcement, ClusterConfig, Members, View};

const WAIT: Duration = Duration::from_secs(20);

fn cfg(etcd: &Etcd, cluster: &str) -> ClusterConfig {
    let mut cfg = ClusterConfig::new(vec![etcd.url()], cluster);
    cfg.lease_ttl = Duration::from_secs(2);
    cfg.retry_max = Duration::from_millis(300);
    cfg
}

/// Waits until the members' view satisfies `ok`; panics naming `what` after `WAIT`.
async fn until(members: &Members, what: &str, ok: impl Fn(&View) -> bool) -> Duration {
    let t = Instant::now();
    let mut rx = members.subscribe();
    let got = tokio::time::timeout(WAIT, rx.wait_for(|v| ok(v))).await;
    assert!(
        matches!(got, Ok(Ok(_))),
        "{what}: not within {WAIT:?}; the view is {:?}",
        members.view()
    );
    t.elapsed()
}

fn names(v: &View) -> Vec<&str> {
    v.members.keys().map(String::as_str).collect()
}

#[tokio::test]
async fn members_are_seen_joining_and_withdrawing() {
    let etcd = Etcd::start().unwrap();
    let cfg = cfg(&etcd, "c1");
    let members = Members::start(&cfg, "units").unwrap();
    let view = members.synced(WAIT).await.expect("etcd read once");
    assert!(view.members.is_empty() && view.stale_since.is_none());
    let a = Announcement::start(&cfg, "units", "a", b"value of a".to_vec()).unwrap();
    let b = Announcement::start(&cfg, "units", "b", b"value of b".to_vec()).unwrap();
    assert!(a.registered(WAIT).await && b.registered(WAIT).await);
    assert_eq!(a.key(), "/tessera/c1/units/a");
    until(&members, "both announced", |v| names(v) == ["a", "b"]).await;
    assert_eq!(members.view().members["a"], b"value of a");
    assert_eq!(
        tessera_cluster::lookup(&cfg, "units", "b").await.unwrap(),
        Some(b"value of b".to_vec())
    );
    assert_eq!(
        tessera_cluster::lookup(&cfg, "units", "z").await.unwrap(),
        None
    );
    // Another cluster and another kind are other prefixes.
    let other = Members::start(&self::cfg(&etcd, "c2"), "units").unwrap();
    let agents = Members::start(&cfg, "agents").unwrap();
    assert!(other.synced(WAIT).await.unwrap().members.is_empty());
    assert!(agents.synced(WAIT).await.unwrap().members.is_empty());
    // A withdrawal revokes the lease: gone well before the TTL.
    let took = {
        let t = Instant::now();
        a.withdraw().await;
        until(&members, "a withdrawn", |v| names(v) == ["b"]).await;
        t.elapsed()
    };
    assert!(took < cfg.lease_ttl, "a withdrawal took {took:?}");
    assert_eq!(b.state().registrations, 1);
    b.withdraw().await;
    until(&members, "b withdrawn", |v| v.members.is_empty()).await;
}

/// A member that stops without withdrawing (its task gone, as when the process dies) is
/// listed until its lease expires, then dropped from every view.
#[tokio::test]
async fn a_member_that_dies_is_dropped_when_its_lease_expires() {
    let etcd = Etcd::start().unwrap();
    let cfg = cfg(&etcd, "c1");
    let members = Members::start(&cfg, "units").unwrap();
    let a = Announcement::start(&cfg, "units", "a", b"a".to_vec()).unwrap();
    assert!(a.registered(WAIT).await);
    until(&members, "a announced", |v| names(v) == ["a"]).await;
    // It keeps its key alive past several TTLs.
    tokio::time::sleep(cfg.lease_ttl * 2).await;
    assert_eq!(names(&members.view()), ["a"]);
    let died = Instant::now();
    drop(a);
    until(&members, "a expired", |v| v.members.is_empty()).await;
    let after = died.elapsed();
    // Within the TTL plus etcd's expiry tick (it checks leases every 500 ms).
    assert!(
        after >= cfg.lease_ttl / 2 && after < cfg.lease_ttl * 2,
        "dropped after {after:?} with a {:?} lease",
        cfg.lease_ttl
    );
}

/// etcd stopped: the view keeps the last known set and says since when it is stale, the
/// announcement says it is not registered; etcd back: both recover on their own, and a
/// member that joined meanwhile is seen.
#[tokio::test]
async fn both_sides_outlive_etcd_being_down() {
    let mut etcd = Etcd::start().unwrap();
    let cfg = cfg(&etcd, "c1");
    let members = Members::start(&cfg, "units").unwrap();
    let a = Announcement::start(&cfg, "units", "a", b"a".to_vec()).unwrap();
    assert!(a.registered(WAIT).await);
    until(&members, "a announced", |v| names(v) == ["a"]).await;
    etcd.stop();
    until(&members, "stale", |v| v.stale_since.is_some()).await;
    assert_eq!(names(&members.view()), ["a"], "the last known set is kept");
    let mut state = a.state();
    let deadline = Instant::now() + WAIT;
    while state.registered {
        assert!(Instant::now() < deadline, "still registered: {state:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
        state = a.state();
    }
    // A member started while etcd is down announces itself once it is back.
    let b = Announcement::start(&cfg, "units", "b", b"b".to_vec()).unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(a.state().failures >= 1 && !b.state().registered);
    etcd.resume().unwrap();
    until(&members, "fresh with both", |v| {
        v.stale_since.is_none() && names(v) == ["a", "b"]
    })
    .await;
    assert!(a.registered(WAIT).await && b.registered(WAIT).await);
    assert_eq!(a.state().failures, 0);
}

/// Configurations that cannot work fail at once, naming what is wrong.
#[tokio::test]
async fn bad_names_are_refused() {
    let cfg = ClusterConfig::new(vec!["http://127.0.0.1:1".into()], "c/1");
    let e = Members::start(&cfg, "units").unwrap_err().to_string();
    assert!(e.contains("cluster name \"c/1\""), "{e}");
    let cfg = ClusterConfig::new(vec!["http://127.0.0.1:1".into()], "c1");
    let e = Announcement::start(&cfg, "units", "", Vec::new())
        .unwrap_err()
        .to_string();
    assert!(e.contains("member name"), "{e}");
    // Unreachable etcd is not a configuration error: it is retried.
    let a = Announcement::start(&cfg, "units", "a", Vec::new()).unwrap();
    assert!(!a.registered(Duration::from_millis(500)).await);
    assert!(a.state().failures >= 1, "{:?}", a.state());
    let e = tessera_cluster::lookup(&cfg, "units", "a")
        .await
        .unwrap_err();
    assert!(
        e.to_string().starts_with("etcd at http://127.0.0.1:1: "),
        "{e}"
    );
}
