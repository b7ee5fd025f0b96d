//! `shm` and `tcp` between this process and a real second one (`tessera-transport-peer`),
//! through the same driver as the `ucx` and `nixl` two-process tests.

use std::time::Duration;

use tessera_engines::EngineKind;
use tessera_transport::testing::{hang_guard, pattern};
use tessera_transport::{Agent, Region, RemoteDesc};

mod engines_common;
use engines_common::{killed_mid_transfer, round_trip, Child};

fn agent(kind: &str) -> Agent {
    let kind: EngineKind = kind.parse().unwrap();
    kind.agent("parent").unwrap()
}

/// The initiator dies with transfers in flight: the target releases every pin it granted, so
/// its registrations can still be dropped and nothing leaks.
fn initiator_killed_mid_transfer(kind: &str) {
    const SIZE: u64 = 16 << 20;
    let parent = agent(kind);
    let region = Region::new(SIZE).unwrap();
    let reg = parent.register(&region).unwrap();
    let mut child = Child::spawn(kind, SIZE, &[]);
    let _peer = parent.add_remote(&child.meta).unwrap();
    assert_eq!(
        child.cmd(&format!("ADD {}", hex::encode(parent.metadata()))),
        "ADDED"
    );
    assert_eq!(
        child.cmd(&format!("FLOOD {} 0 {SIZE}", reg.id())),
        "FLOODING"
    );
    child.proc.kill().unwrap();
    child.proc.wait().unwrap();
    drop(reg);
    // The engine notices the dead connection on its own; pins it held go with it.
    let mut released = false;
    for _ in 0..1000 {
        if parent.report().registrations == 0 {
            released = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        released,
        "the target still pins a dead initiator's transfer"
    );
    // And it still serves others.
    let mut other = Child::spawn(kind, 4096, &[]);
    let peer = parent.add_remote(&other.meta).unwrap();
    let r2 = Region::new(4096).unwrap();
    let g2 = parent.register(&r2).unwrap();
    r2.write_at(0, &pattern(8, 4096)).unwrap();
    peer.write(
        &[g2.desc(0, 4096).unwrap()],
        &[RemoteDesc::new(other.reg, 0, 4096)],
        None,
    )
    .unwrap()
    .wait_timeout(hang_guard())
    .unwrap();
    assert_eq!(other.cmd("CHECK 0 4096 8"), "OK");
}

#[test]
fn shm_initiator_killed_mid_transfer() {
    initiator_killed_mid_transfer("shm");
}

#[test]
fn tcp_initiator_killed_mid_transfer() {
    initiator_killed_mid_transfer("tcp");
}

#[test]
fn shm_round_trip() {
    round_trip(&agent("shm"), "shm", &[]);
}

#[test]
fn tcp_round_trip() {
    round_trip(&agent("tcp"), "tcp", &[]);
}

#[test]
fn shm_peer_killed_mid_transfer() {
    killed_mid_transfer(&agent("shm"), "shm", &[]);
}

#[test]
fn tcp_peer_killed_mid_transfer() {
    killed_mid_transfer(&agent("tcp"), "tcp", &[]);
}

// The conformance cases that make sense with the target in the second process.
two_process_suite!(
    suite_shm,
    EngineKind::Shm.agent("parent").unwrap(),
    "shm",
    &[]
);
two_process_suite!(
    suite_tcp,
    EngineKind::Tcp.agent("parent").unwrap(),
    "tcp",
    &[]
);
