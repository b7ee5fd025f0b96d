//! Agents that find each other by name through etcd: metadata announced, peers connected from
//! it, updated when it changes, and dropped when the agent leaves.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_cluster::agents::{AgentDirectory, PeerError};
use tessera_cluster::testing::Etcd;
use tessera_cluster::ClusterConfig;
use tessera_transport::shm::Shm;
use tessera_transport::{Agent, Region, RemoteDesc};

const WAIT: Duration = Duration::from_secs(20);

fn cfg(etcd: &Etcd) -> ClusterConfig {
    let mut cfg = ClusterConfig::new(vec![etcd.url()], "agents-test");
    cfg.lease_ttl = Duration::from_secs(2);
    cfg.retry_max = Duration::from_millis(300);
    cfg
}

/// Writes `byte` over `len` bytes of `reg` at `peer` from a scratch registration of `a`.
fn write(a: &Agent, peer: &tessera_transport::Peer, reg: u64, len: u64, byte: u8) -> bool {
    let src = Region::new(len).unwrap();
    src.fill(0, len, byte).unwrap();
    let g = a.register(&src).unwrap();
    match peer.write(
        &[g.desc(0, len).unwrap()],
        &[RemoteDesc::new(reg, 0, len)],
        None,
    ) {
        Ok(t) => t.wait_timeout(WAIT).is_ok(),
        Err(_) => false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_find_each_other_by_name_and_follow_their_metadata() {
    let etcd = Etcd::start().unwrap();
    let cfg = cfg(&etcd);
    let a = Arc::new(Agent::new("trainer", Shm::new()).unwrap());
    let b = Arc::new(Agent::new("rollout", Shm::new()).unwrap());
    let rb = Region::new(1 << 16).unwrap();
    let gb = b.register(&rb).unwrap();
    let da = AgentDirectory::start(&cfg, a.clone()).unwrap();
    let db = AgentDirectory::start(&cfg, b.clone()).unwrap();
    assert!(db.announcement().registered(WAIT).await);

    // Found by name; its registration is reachable.
    let peer = da.peer("rollout", WAIT).await.unwrap();
    assert_eq!(peer.name(), "rollout");
    let (a2, p2) = (a.clone(), peer.clone());
    let id = gb.id();
    assert!(
        tokio::task::spawn_blocking(move || write(&a2, &p2, id, 4096, 7))
            .await
            .unwrap()
    );
    let mut got = vec![0u8; 4096];
    rb.read_at(0, &mut got).unwrap();
    assert!(got.iter().all(|&x| x == 7));
    assert_eq!(da.peers(), ["rollout"]);

    // A registration made later reaches the peer once republished.
    let rb2 = Region::new(1 << 16).unwrap();
    let gb2 = b.register(&rb2).unwrap();
    db.republish();
    let t = Instant::now();
    loop {
        let (a2, p2, id2) = (a.clone(), peer.clone(), gb2.id());
        let ok = tokio::task::spawn_blocking(move || write(&a2, &p2, id2, 4096, 9))
            .await
            .unwrap();
        if ok {
            break;
        }
        assert!(
            t.elapsed() < WAIT,
            "the new registration never reached the peer"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    rb2.read_at(0, &mut got).unwrap();
    assert!(got.iter().all(|&x| x == 9));

    // An agent that is not there is waited for, then reported.
    let e = da
        .peer("nobody", Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(matches!(e, PeerError::NotFound { .. }), "{e}");

    // The agent leaves: the directory drops its handle, and with ours gone it is no peer.
    db.withdraw().await;
    let t = Instant::now();
    while !da.peers().is_empty() {
        assert!(t.elapsed() < WAIT, "the peer that left was kept");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(peer);
    assert!(a.peer("rollout").is_none());
    drop(da);
}
