//! The fault-injecting engine: each fault reaches the caller as the error it stands for, after
//! the engine released nothing early, on in-process and shared-memory agents alike.

use std::time::{Duration, Instant};

use tessera_transport::testing::{Fault, Faults, Faulty, HANG_GUARD};
use tessera_transport::{shm::Shm, Agent, Inproc, Op, Region, TransferError};

fn agents(engine: &str, faults: &Faults) -> (Agent, Agent) {
    match engine {
        "inproc" => (
            Agent::new("faulty", Faulty::new(Inproc::new(), faults.clone())).unwrap(),
            Agent::new("plain", Inproc::new()).unwrap(),
        ),
        _ => (
            Agent::new("faulty", Faulty::new(Shm::new(), faults.clone())).unwrap(),
            Agent::new("plain", Shm::new()).unwrap(),
        ),
    }
}

fn each_fault_reaches_the_caller(engine: &str) {
    let faults = Faults::new();
    let (a, b) = agents(engine, &faults);
    let src = Region::new(1 << 16).unwrap();
    src.write_at(0, &[7u8; 4096]).unwrap();
    let dst = Region::new(1 << 16).unwrap();
    let ga = a.register(&src).unwrap();
    let gb = b.register(&dst).unwrap();
    let peer = a.add_remote(&b.metadata()).unwrap();
    let write = |faults_left: usize| {
        let t = peer
            .write(
                &[ga.desc(0, 4096).unwrap()],
                &[gb.remote(0, 4096).unwrap()],
                None,
            )
            .unwrap();
        let r = t.wait_timeout(HANG_GUARD);
        assert_eq!(faults.armed(), faults_left);
        r
    };

    assert_eq!(write(0), Ok(()), "no fault armed: a plain transfer");

    faults.next(Fault::FailAtCompletion);
    match write(0) {
        Err(TransferError::PeerGone { peer, detail }) => {
            assert_eq!(peer, "plain");
            assert!(detail.contains("injected"), "{detail}");
        }
        other => panic!("expected an injected PeerGone, got {other:?}"),
    }

    faults.next(Fault::FailAtSubmission);
    assert!(matches!(write(0), Err(TransferError::PeerGone { .. })));

    faults.next(Fault::LoseCompletion);
    assert!(matches!(write(0), Err(TransferError::StatusLost { .. })));

    faults.next(Fault::Delay(Duration::from_millis(150)));
    let start = Instant::now();
    assert_eq!(write(0), Ok(()));
    assert!(start.elapsed() >= Duration::from_millis(150));

    // A fault armed for READs leaves WRITEs alone until a READ comes.
    faults.next_on(Op::Read, Fault::FailAtCompletion);
    assert_eq!(write(1), Ok(()));
    let t = peer
        .read(
            &[ga.desc(0, 4096).unwrap()],
            &[gb.remote(0, 4096).unwrap()],
            None,
        )
        .unwrap();
    assert!(matches!(
        t.wait_timeout(HANG_GUARD),
        Err(TransferError::PeerGone { .. })
    ));
    assert_eq!((faults.armed(), faults.injected()), (0, 5));

    // Nothing a failed transfer held stays held: the registrations go once their guards do.
    drop((ga, gb, peer));
    let deadline = Instant::now() + HANG_GUARD;
    while a.report().registrations != 0 || b.report().registrations != 0 {
        assert!(Instant::now() < deadline, "registrations still held");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn inproc_faults_reach_the_caller() {
    each_fault_reaches_the_caller("inproc");
}

#[test]
fn shm_faults_reach_the_caller() {
    each_fault_reaches_the_caller("shm");
}
