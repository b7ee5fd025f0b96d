//! Units found through a real etcd: a client that names a cluster reads its live units,
//! reaches those that join, fails over from one that died to its replicas and stops routing
//! to it once its lease expired, and keeps serving while etcd is down.

use std::time::{Duration, Instant};

use tessera_cluster::testing::Etcd;
use tessera_storage::cluster::{announce, ClusterConfig, UnitRecord};
use tessera_storage::{Backend, Client, ClientConfig, Server, ServerConfig, Tensor, Value};

const WAIT: Duration = Duration::from_secs(20);

struct Unit {
    server: Server,
    announced: tessera_cluster::Announcement,
}

fn cluster(etcd: &Etcd) -> ClusterConfig {
    let mut cfg = ClusterConfig::new(vec![etcd.url()], "test");
    cfg.lease_ttl = Duration::from_secs(2);
    cfg.retry_max = Duration::from_millis(300);
    cfg
}

/// A unit announced as `name`, registered in etcd.
async fn unit(cluster: &ClusterConfig, name: &str) -> Unit {
    let u = start_unit(cluster, name).await;
    assert!(
        u.announced.registered(WAIT).await,
        "{name} never registered"
    );
    u
}

/// A unit announcing itself as `name`, registered or not yet.
async fn start_unit(cluster: &ClusterConfig, name: &str) -> Unit {
    let server = Server::start(ServerConfig {
        bind: "127.0.0.1:0".into(),
        backend: Backend::Inproc,
        pool_bytes: 16 << 20,
        ..ServerConfig::default()
    })
    .await
    .unwrap();
    let record = UnitRecord {
        control: server.addr().to_owned(),
        engine: "inproc".into(),
        payload: None,
        capacity: 8 << 20,
    };
    let announced = announce(cluster, name, &record).unwrap();
    Unit { server, announced }
}

async fn client(cluster: &ClusterConfig, replicas: usize) -> Client {
    Client::connect(ClientConfig {
        cluster: Some(cluster.clone()),
        units: Vec::new(),
        backend: Backend::Inproc,
        recv_pool_bytes: 16 << 20,
        timeout: Duration::from_secs(5),
        replicas,
        ..ClientConfig::default()
    })
    .await
    .unwrap()
}

/// Index `i`'s value: 64 bytes that say which index they belong to.
fn value(i: u64) -> Value {
    let data: Vec<u8> = (0..64).map(|k| (i as u8).wrapping_mul(31) ^ k).collect();
    Value::Tensor(Tensor::from_slice(&[64], &data).unwrap())
}

async fn put_all(c: &Client, indexes: &[u64]) {
    let cols = vec![("x".to_string(), indexes.iter().map(|&i| value(i)).collect())];
    c.put("p", indexes, &cols).await.unwrap();
}

async fn check_all(c: &Client, indexes: &[u64]) {
    let got = c.get("p", indexes, &["x"]).await.unwrap();
    for (&i, v) in indexes.iter().zip(&got[0]) {
        assert_eq!(v, &value(i), "index {i}");
    }
}

/// Waits until the client's unit names are `names`; returns how long that took.
async fn until_units(c: &Client, names: &[&str]) -> Duration {
    let t = Instant::now();
    loop {
        let m = c.membership();
        let now: Vec<&str> = m.units.iter().map(|u| u.name.as_str()).collect();
        if now == names {
            return t.elapsed();
        }
        assert!(t.elapsed() < WAIT, "units {now:?}, waiting for {names:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_follows_units_joining_and_leaving() {
    let etcd = Etcd::start().unwrap();
    let cfg = cluster(&etcd);
    let u0 = unit(&cfg, "u0").await;
    let u1 = unit(&cfg, "u1").await;
    let c = client(&cfg, 1).await;
    // Read at connect: no wait.
    let names: Vec<String> = c.membership().units.into_iter().map(|u| u.name).collect();
    assert_eq!(names, ["u0", "u1"]);
    let first: Vec<u64> = (0..200).collect();
    put_all(&c, &first).await;
    check_all(&c, &first).await;
    let m = c.membership();
    assert_eq!(m.stale_for, None);
    assert!(m.revision > 0);
    // A unit that joins is found without a restart and takes its share of new keys.
    let u2 = unit(&cfg, "u2").await;
    until_units(&c, &["u0", "u1", "u2"]).await;
    let second: Vec<u64> = (1000..1300).collect();
    put_all(&c, &second).await;
    check_all(&c, &second).await;
    let on_u2 = u2.server.stats().keys;
    assert!(
        (50..150).contains(&on_u2),
        "u2 holds {on_u2} of 300 new keys"
    );
    assert_eq!(c.membership().units[2].number, 2);
    // A unit that withdraws (orderly shutdown) leaves at once.
    u2.announced.withdraw().await;
    u2.server.shutdown().await;
    until_units(&c, &["u0", "u1"]).await;
    // Keys placed on u0 and u1 stay where they were.
    check_all(&c, &first).await;
    drop((u0, u1));
}

/// r = 2 over three units: a unit killed without withdrawing (its lease left to expire) costs
/// no value: GETs fall over to the other replica at once, and the client stops routing to it
/// within twice the lease's TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_unit_is_failed_over_then_dropped() {
    let etcd = Etcd::start().unwrap();
    let cfg = cluster(&etcd);
    let u0 = unit(&cfg, "u0").await;
    let u1 = unit(&cfg, "u1").await;
    let u2 = unit(&cfg, "u2").await;
    let c = client(&cfg, 2).await;
    let all: Vec<u64> = (0..300).collect();
    put_all(&c, &all).await;
    let stored: u64 = [&u0, &u1, &u2].iter().map(|u| u.server.stats().keys).sum();
    assert_eq!(stored, 600, "two copies of each key");
    // Killed: the announcement's task stops (as the process would) and the unit is gone.
    let died = Instant::now();
    drop(u1.announced);
    u1.server.shutdown().await;
    check_all(&c, &all).await;
    assert_eq!(c.units(), 3, "still listed until its lease expires");
    until_units(&c, &["u0", "u2"]).await;
    let gone = died.elapsed();
    assert!(
        gone < cfg.lease_ttl * 2,
        "routed to a dead unit for {gone:?}"
    );
    // Reads need no failover now. A repair copies every key that had a copy on u1 back to
    // its second replica among the live units; a second repair finds nothing to do.
    check_all(&c, &all).await;
    let on_u1 = 600
        - [&u0, &u2]
            .iter()
            .map(|u| u.server.stats().keys)
            .sum::<u64>();
    let report = c.repair("p", &all, &["x"]).await.unwrap();
    assert_eq!(report.checked, 300);
    assert_eq!((report.under_replicated, report.copies), (on_u1, on_u1));
    assert!(report.lost.is_empty(), "{:?}", report.lost);
    assert_eq!(u0.server.stats().keys + u2.server.stats().keys, 600);
    let again = c.repair("p", &all, &["x"]).await.unwrap();
    assert_eq!((again.under_replicated, again.copies), (0, 0));
    // Indexes never stored have nothing to copy from.
    let none = c.repair("p", &[7000, 7001], &["x"]).await.unwrap();
    assert_eq!(none.lost, [7000, 7001]);
    check_all(&c, &all).await;
    // New PUTs go to the two live units.
    let more: Vec<u64> = (500..600).collect();
    put_all(&c, &more).await;
    check_all(&c, &more).await;
    drop((u0, u2));
}

/// etcd down: the client keeps its last known set, says since when it is stale, and every
/// request goes on; etcd back: the set is fresh again and a unit that joined meanwhile is
/// found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_need_no_etcd_once_the_set_is_known() {
    let mut etcd = Etcd::start().unwrap();
    let cfg = cluster(&etcd);
    let u0 = unit(&cfg, "u0").await;
    let u1 = unit(&cfg, "u1").await;
    let c = client(&cfg, 2).await;
    etcd.stop();
    let t = Instant::now();
    while c.membership().stale_for.is_none() {
        assert!(t.elapsed() < WAIT, "never stale");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let all: Vec<u64> = (0..100).collect();
    put_all(&c, &all).await;
    check_all(&c, &all).await;
    c.clear("p", &all[..10]).await.unwrap();
    assert_eq!(c.units(), 2);
    // A unit started while etcd is down serves, and registers once etcd is back.
    let u2 = start_unit(&cfg, "u2").await;
    assert!(!u2.announced.registered(Duration::from_millis(300)).await);
    etcd.resume().unwrap();
    assert!(u2.announced.registered(WAIT).await);
    until_units(&c, &["u0", "u1", "u2"]).await;
    assert_eq!(c.membership().stale_for, None);
    check_all(&c, &all[10..]).await;
    drop((u0, u1, u2));
}

/// A cluster with no etcd to answer fails the client's start within its timeout, saying so.
#[tokio::test]
async fn no_etcd_fails_the_client_clearly() {
    let cfg = ClusterConfig::new(vec!["http://127.0.0.1:1".into()], "test");
    let t = Instant::now();
    let e = Client::connect(ClientConfig {
        cluster: Some(cfg),
        units: Vec::new(),
        backend: Backend::Inproc,
        timeout: Duration::from_secs(1),
        ..ClientConfig::default()
    })
    .await
    .err()
    .expect("no etcd");
    assert!(t.elapsed() < Duration::from_secs(5));
    assert_eq!(
        e.to_string(),
        "cluster membership: etcd at http://127.0.0.1:1 did not answer within 1s"
    );
}
