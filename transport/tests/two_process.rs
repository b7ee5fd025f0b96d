//! `shm` and `tcp` between this process and a real second one (`tessera-transport-peer`).

use std::io::{BufRead, BufReader, Lines, Write};
use std::process::{ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use tessera_transport::testing::{pattern, HANG_GUARD};
use tessera_transport::{
    shm::Shm, tcp::Tcp, Agent, LocalDesc, Op, Region, RemoteDesc, TransferError,
};

struct Child {
    proc: std::process::Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
    meta: Vec<u8>,
    reg: u64,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

impl Child {
    fn spawn(kind: &str, size: u64) -> Self {
        let mut proc = Command::new(env!("CARGO_BIN_EXE_tessera-transport-peer"))
            .args([kind, &size.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("peer process starts");
        let stdin = proc.stdin.take().unwrap();
        let mut lines = BufReader::new(proc.stdout.take().unwrap()).lines();
        let meta = lines.next().unwrap().unwrap();
        let reg = lines.next().unwrap().unwrap();
        Self {
            proc,
            stdin,
            lines,
            meta: unhex(meta.strip_prefix("META ").unwrap()),
            reg: reg.strip_prefix("REG ").unwrap().parse().unwrap(),
        }
    }

    fn cmd(&mut self, line: &str) -> String {
        writeln!(self.stdin, "{line}").unwrap();
        self.stdin.flush().unwrap();
        self.lines.next().expect("peer answers").unwrap()
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.proc.kill();
        let _ = self.proc.wait();
    }
}

fn agent(kind: &str) -> Agent {
    match kind {
        "shm" => Agent::new("parent", Shm::new()).unwrap(),
        _ => Agent::new("parent", Tcp::new()).unwrap(),
    }
}

fn round_trip(kind: &str) {
    const MIB: u64 = 1 << 20;
    let parent = agent(kind);
    let region = Region::new(4 * MIB).unwrap();
    let reg = parent.register(&region).unwrap();
    let mut child = Child::spawn(kind, 4 * MIB);
    let peer = parent.add_remote(&child.meta).unwrap();
    assert_eq!(
        child.cmd(&format!("ADD {}", hex(&parent.metadata()))),
        "ADDED"
    );

    // Scatter WRITE of 100 pieces with a notification.
    let data = pattern(5, 100 * 8192);
    region.write_at(0, &data).unwrap();
    let local: Vec<LocalDesc> = (0..100)
        .map(|i| reg.desc(i * 8192, 8192).unwrap())
        .collect();
    let remote: Vec<RemoteDesc> = (0..100)
        .map(|i| RemoteDesc::new(child.reg, MIB + i * 8192, 8192))
        .collect();
    let t = peer.write(&local, &remote, Some(b"scatter")).unwrap();
    t.wait_timeout(HANG_GUARD).unwrap();
    assert_eq!(child.cmd("NOTE"), "NOTE parent scatter");
    assert_eq!(child.cmd(&format!("CHECK {MIB} {} 5", 100 * 8192)), "OK");

    // READ the child's initial pattern back.
    let t = peer
        .read(
            &[reg.desc(2 * MIB, 2 * MIB).unwrap()],
            &[RemoteDesc::new(child.reg, 2 * MIB, 2 * MIB)],
            None,
        )
        .unwrap();
    t.wait_timeout(HANG_GUARD).unwrap();
    let mut got = vec![0u8; 2 * MIB as usize];
    region.read_at(2 * MIB, &mut got).unwrap();
    let expected = pattern(1, 4 * MIB as usize);
    assert!(
        got == expected[2 * MIB as usize..],
        "READ brought the child's bytes"
    );

    // The child initiates towards us.
    assert_eq!(child.cmd(&format!("PUSH {} 0 65536", reg.id())), "PUSHED");
    let mut got = vec![0u8; 65536];
    region.read_at(0, &mut got).unwrap();
    assert_eq!(got, pattern(1, 65536));
    let note = parent.wait_notification(HANG_GUARD).unwrap();
    assert_eq!(
        (note.from.as_str(), note.msg.as_slice()),
        ("peer", &b"pushed"[..])
    );

    // The child cannot reach past its peer's registration either: our target side refuses.
    let refused = child.cmd(&format!("PUSH {} {} 65536", reg.id(), 4 * MIB - 10));
    assert!(refused.starts_with("ERR"), "{refused}");
    writeln!(child.stdin, "EXIT").unwrap();
    child.stdin.flush().unwrap();
    assert!(child.proc.wait().unwrap().success());
}

fn killed_mid_transfer(kind: &str) {
    const SIZE: u64 = 32 << 20;
    let parent = agent(kind);
    let region = Region::new(SIZE).unwrap();
    let reg = parent.register(&region).unwrap();
    let mut child = Child::spawn(kind, SIZE);
    let peer = parent.add_remote(&child.meta).unwrap();
    let local = [reg.desc(0, SIZE).unwrap()];
    let remote = [RemoteDesc::new(child.reg, 0, SIZE)];
    let baseline = parent.report();
    let prepared = [
        peer.prepare(Op::Write, &local, &remote).unwrap(),
        peer.prepare(Op::Read, &local, &remote).unwrap(),
    ];
    let in_flight: Vec<_> = (0..16)
        .map(|i| prepared[i % 2].post(None).unwrap())
        .collect();
    child.proc.kill().unwrap();
    child.proc.wait().unwrap();
    for t in in_flight {
        match t.wait_timeout(HANG_GUARD) {
            Ok(()) | Err(TransferError::PeerGone { .. }) => {}
            Err(e) => panic!("unexpected: {e}"),
        }
    }
    let mut error = None;
    for _ in 0..100 {
        match prepared[0].post(None).unwrap().wait_timeout(HANG_GUARD) {
            Ok(()) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => {
                error = Some(e);
                break;
            }
        }
    }
    let e = error.expect("a dead peer fails transfers");
    assert!(matches!(e, TransferError::PeerGone { .. }), "{e}");
    assert_eq!(e.peer(), "peer");
    assert_eq!(parent.report().in_flight, 0);
    assert_eq!(parent.report().registrations, baseline.registrations);
    drop((prepared, local, reg, peer));
    assert_eq!(parent.report().registrations, 0, "nothing leaked");
}

/// The initiator dies with transfers in flight: the target releases every pin it granted, so
/// its registrations can still be dropped and nothing leaks.
fn initiator_killed_mid_transfer(kind: &str) {
    const SIZE: u64 = 16 << 20;
    let parent = agent(kind);
    let region = Region::new(SIZE).unwrap();
    let reg = parent.register(&region).unwrap();
    let mut child = Child::spawn(kind, SIZE);
    let _peer = parent.add_remote(&child.meta).unwrap();
    assert_eq!(
        child.cmd(&format!("ADD {}", hex(&parent.metadata()))),
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
    let mut other = Child::spawn(kind, 4096);
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
    .wait_timeout(HANG_GUARD)
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
    round_trip("shm");
}

#[test]
fn tcp_round_trip() {
    round_trip("tcp");
}

#[test]
fn shm_peer_killed_mid_transfer() {
    killed_mid_transfer("shm");
}

#[test]
fn tcp_peer_killed_mid_transfer() {
    killed_mid_transfer("tcp");
}

mod engines_common;

// The conformance cases that make sense with the target in the second process.
two_process_suite!(
    suite_shm,
    Agent::new("parent", Shm::new()).unwrap(),
    "shm",
    &[]
);
two_process_suite!(
    suite_tcp,
    Agent::new("parent", Tcp::new()).unwrap(),
    "tcp",
    &[]
);
