//! The fault-injecting engine: each fault reaches the caller as the error it stands for, after
//! the engine released nothing early, on in-process, shared-memory and tcp agents alike.

use std::time::{Duration, Instant};

use tessera_transport::testing::{hang_guard, pattern, Fault, Faults, Faulty};
use tessera_transport::{shm::Shm, tcp::Tcp, Agent, Inproc, Op, Peer, Region, TransferError};

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
        let r = t.wait_timeout(hang_guard());
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
        t.wait_timeout(hang_guard()),
        Err(TransferError::PeerGone { .. })
    ));
    assert_eq!((faults.armed(), faults.injected()), (0, 5));

    // Nothing a failed transfer held stays held: the registrations go once their guards do.
    drop((ga, gb, peer));
    let deadline = Instant::now() + hang_guard();
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

// ----- cutting the engine's real link ------------------------------------------------------

const BIG: u64 = 64 << 20;

fn agent(engine: &str, name: &str, faults: Option<&Faults>) -> Agent {
    match (engine, faults) {
        ("inproc", Some(f)) => Agent::new(name, Faulty::new(Inproc::new(), f.clone())),
        ("inproc", None) => Agent::new(name, Inproc::new()),
        ("shm", Some(f)) => Agent::new(name, Faulty::new(Shm::new(), f.clone())),
        ("shm", None) => Agent::new(name, Shm::new()),
        (_, Some(f)) => Agent::new(name, Faulty::new(Tcp::new(), f.clone())),
        (_, None) => Agent::new(name, Tcp::new()),
    }
    .unwrap()
}

fn until(what: &str, f: impl Fn() -> bool) {
    let deadline = Instant::now() + hang_guard();
    while !f() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A fresh peer handle on `target`; the target may take a moment to see the old link end
/// (`tcp` refuses a second link under a live name).
fn reconnect(from: &Agent, target: &Agent) -> Peer {
    let deadline = Instant::now() + hang_guard();
    loop {
        match from.add_remote(&target.metadata()) {
            Ok(p) => return p,
            Err(e) => assert!(Instant::now() < deadline, "no new link: {e}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `target` still serves a peer that had nothing to do with the cut.
fn serves_others(engine: &str, target: &Agent) {
    let other = agent(engine, "other", None);
    let ro = Region::new(4096).unwrap();
    ro.write_at(0, &pattern(11, 4096)).unwrap();
    let rt = Region::new(4096).unwrap();
    let go = other.register(&ro).unwrap();
    let gt = target.register(&rt).unwrap();
    let peer = other.add_remote(&target.metadata()).unwrap();
    peer.write(
        &[go.desc(0, 4096).unwrap()],
        &[gt.remote(0, 4096).unwrap()],
        None,
    )
    .unwrap()
    .wait_timeout(hang_guard())
    .unwrap();
    let mut got = vec![0u8; 4096];
    rt.read_at(0, &mut got).unwrap();
    assert_eq!(got, pattern(11, 4096));
}

fn transfer(
    peer: &Peer,
    op: Op,
    local: &tessera_transport::Registration,
    remote: &tessera_transport::Registration,
    len: u64,
) -> Result<(), TransferError> {
    let (l, r) = (local.desc(0, len).unwrap(), remote.remote(0, len).unwrap());
    let t = match op {
        Op::Write => peer.write(&[l], &[r], None),
        Op::Read => peer.read(&[l], &[r], None),
    }
    .unwrap();
    t.wait_timeout(hang_guard())
}

/// A 64 MiB WRITE and READ whose link is cut under them fail with the engine's own error;
/// the peer handle then fails too, a new one works, the target serves others throughout, and
/// once the guards are gone neither agent holds a registration (nor a pin, which would keep
/// one alive).
fn a_cut_link_fails_its_transfers(engine: &str, fault: Fault) {
    let faults = Faults::new();
    let a = agent(engine, "faulty", Some(&faults));
    let b = agent(engine, "target", None);
    let src = Region::new(BIG).unwrap();
    src.write_at(0, &pattern(5, 1 << 20)).unwrap();
    let dst = Region::new(BIG).unwrap();
    let ga = a.register(&src).unwrap();
    let gb = b.register(&dst).unwrap();
    let mut peer = a.add_remote(&b.metadata()).unwrap();
    transfer(&peer, Op::Write, &ga, &gb, 4096).unwrap();
    for op in [Op::Write, Op::Read] {
        faults.next_on(op, fault);
        let outcome = transfer(&peer, op, &ga, &gb, BIG);
        assert_eq!(faults.armed(), 0);
        match (&outcome, fault) {
            (Err(TransferError::PeerGone { peer, detail }), _) => {
                assert_eq!(peer, "target");
                assert!(
                    !detail.contains("injected"),
                    "made up, not the engine's: {detail}"
                );
            }
            // Only a cut that lands late may find the transfer done.
            (Ok(()), Fault::CutLinkAfter(_)) => {}
            _ => panic!("{engine} {op:?}: expected the engine's PeerGone, got {outcome:?}"),
        }
        if outcome.is_err() {
            let later = transfer(&peer, Op::Write, &ga, &gb, 4096);
            assert!(
                matches!(later, Err(TransferError::PeerGone { .. })),
                "a transfer after the cut: {later:?}"
            );
        }
        assert_eq!(a.report().in_flight, 0);
        serves_others(engine, &b);
        drop(peer);
        peer = reconnect(&a, &b);
        transfer(&peer, Op::Write, &ga, &gb, 4096).unwrap();
    }
    drop((ga, gb, peer));
    until("registrations still held", || {
        a.report().registrations == 0 && b.report().registrations == 0
    });
    assert_eq!((a.report().in_flight, b.report().in_flight), (0, 0));
}

#[test]
fn shm_cut_link_fails_a_64mib_write_and_read() {
    a_cut_link_fails_its_transfers("shm", Fault::CutLink);
}

#[test]
fn tcp_cut_link_fails_a_64mib_write_and_read() {
    a_cut_link_fails_its_transfers("tcp", Fault::CutLink);
}

/// A cut landing a moment after the engine took the transfer, inside its payload as a rule:
/// the engine's outcome, never a hang or a leak.
#[test]
fn shm_cut_link_after_a_moment() {
    a_cut_link_fails_its_transfers("shm", Fault::CutLinkAfter(Duration::from_millis(2)));
}

#[test]
fn tcp_cut_link_after_a_moment() {
    a_cut_link_fails_its_transfers("tcp", Fault::CutLinkAfter(Duration::from_millis(2)));
}

/// inproc has no link: the engine completed the transfer inside `post`, so the cut changes
/// nothing.
#[test]
fn inproc_cut_link_changes_nothing() {
    let faults = Faults::new();
    let a = agent("inproc", "faulty", Some(&faults));
    let b = agent("inproc", "target", None);
    let src = Region::new(1 << 16).unwrap();
    src.write_at(0, &pattern(6, 1 << 16)).unwrap();
    let dst = Region::new(1 << 16).unwrap();
    let (ga, gb) = (a.register(&src).unwrap(), b.register(&dst).unwrap());
    let peer = a.add_remote(&b.metadata()).unwrap();
    faults.next(Fault::CutLink);
    transfer(&peer, Op::Write, &ga, &gb, 1 << 16).unwrap();
    assert_eq!(faults.injected(), 1);
    let mut got = vec![0u8; 1 << 16];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(got, pattern(6, 1 << 16));
}
