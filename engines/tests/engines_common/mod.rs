//! The two-process tests of every backend: this process against a real second one
//! (`tessera-transport-peer`), with the `ucx`/`nixl` transports given in the environment.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Lines, Write};
use std::process::{ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use tessera_transport::testing::{hang_guard, pattern, Target, TargetError};
use tessera_transport::{Agent, LocalDesc, Op, Region, RemoteDesc, TransferError};

pub(crate) struct Child {
    pub(crate) proc: std::process::Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
    pub(crate) meta: Vec<u8>,
    pub(crate) reg: u64,
}

impl Child {
    pub(crate) fn spawn(kind: &str, size: u64, env: &[(&str, &str)]) -> Self {
        let mut proc = Command::new(env!("CARGO_BIN_EXE_tessera-transport-peer"))
            .args([kind, &size.to_string()])
            .envs(env.iter().copied())
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
            meta: hex::decode(meta.strip_prefix("META ").unwrap()).expect("hex"),
            reg: reg.strip_prefix("REG ").unwrap().parse().unwrap(),
        }
    }

    pub(crate) fn cmd(&mut self, line: &str) -> String {
        writeln!(self.stdin, "{line}").unwrap();
        self.stdin.flush().unwrap();
        self.lines.next().expect("peer answers").unwrap()
    }
}

/// The child as the target of the conformance cases written against [`Target`].
impl Target for Child {
    fn name(&self) -> String {
        "peer".to_owned()
    }

    fn metadata(&mut self) -> Vec<u8> {
        let line = self.cmd("META");
        hex::decode(line.strip_prefix("META ").expect("META answer")).expect("hex")
    }

    fn register(&mut self, len: u64) -> u64 {
        let line = self.cmd(&format!("REGISTER {len}"));
        let id = line
            .strip_prefix("REG ")
            .unwrap_or_else(|| panic!("{line}"));
        id.parse().unwrap()
    }

    fn write_at(&mut self, reg: u64, offset: u64, data: &[u8]) {
        assert_eq!(
            self.cmd(&format!("WRITE {reg} {offset} {}", hex::encode(data))),
            "WRITTEN"
        );
    }

    fn read_at(&mut self, reg: u64, offset: u64, len: u64) -> Vec<u8> {
        let line = self.cmd(&format!("READ {reg} {offset} {len}"));
        hex::decode(
            line.strip_prefix("DATA ")
                .unwrap_or_else(|| panic!("{line}")),
        )
        .expect("hex")
    }

    fn add_remote(&mut self, metadata: &[u8]) {
        assert_eq!(self.cmd(&format!("ADD {}", hex::encode(metadata))), "ADDED");
    }

    fn wait_notification(&mut self) -> Option<(String, Vec<u8>)> {
        note(&self.cmd("NOTE"))
    }

    fn try_notification(&mut self) -> Option<(String, Vec<u8>)> {
        note(&self.cmd("TRYNOTE"))
    }

    fn transfer(
        &mut self,
        op: Op,
        local: u64,
        local_offset: u64,
        remote: u64,
        remote_offset: u64,
        len: u64,
        notify: Option<&[u8]>,
    ) -> Result<(), TargetError> {
        let op = match op {
            Op::Write => "W",
            Op::Read => "R",
        };
        let note = notify.map(|n| String::from_utf8(n.to_vec()).expect("a word as note"));
        let line = self.cmd(&format!(
            "XFER {op} {local} {local_offset} {remote} {remote_offset} {len} {}",
            note.unwrap_or_default()
        ));
        if line == "DONE" {
            Ok(())
        } else {
            Err(TargetError::Remote(line))
        }
    }
}

/// `NOTE <from> <msg>` as `(from, msg)`; anything else (`NONE`, `ERR ...`) as none.
fn note(line: &str) -> Option<(String, Vec<u8>)> {
    let rest = line.strip_prefix("NOTE ")?;
    let (from, msg) = rest.split_once(' ').unwrap_or((rest, ""));
    Some((from.to_owned(), msg.as_bytes().to_vec()))
}

/// Instantiates the conformance cases that run with the target in a second process, as a
/// module of tests: `$parent` makes this process's agent, `$kind` and `$env` start the child.
#[macro_export]
macro_rules! two_process_suite {
    ($module:ident, $parent:expr, $kind:expr, $env:expr) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;

            fn run(
                case: fn(&tessera_transport::Agent, &mut dyn tessera_transport::testing::Target),
            ) {
                let parent = $parent;
                let mut child = $crate::engines_common::Child::spawn($kind, 4096, $env);
                case(&parent, &mut child);
                child.exit();
            }

            #[test]
            fn write_then_read() {
                run(tessera_transport::testing::write_then_read_with);
            }
            #[test]
            fn scatter_gather_1000() {
                run(tessera_transport::testing::scatter_gather_1000_with);
            }
            #[test]
            fn notifications() {
                run(tessera_transport::testing::notifications_with);
            }
            #[test]
            fn concurrent_threads() {
                run(tessera_transport::testing::concurrent_threads_with);
            }
            #[test]
            fn metadata_update() {
                run(tessera_transport::testing::metadata_update_with);
            }
        }
    };
}

impl Child {
    /// Asks the child to exit and waits for it.
    pub(crate) fn exit(&mut self) {
        writeln!(self.stdin, "EXIT").unwrap();
        self.stdin.flush().unwrap();
        assert!(self.proc.wait().unwrap().success());
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.proc.kill();
        let _ = self.proc.wait();
    }
}

/// WRITE with a notification, READ back, and the child writing to us with a notification;
/// the child's out-of-range write is refused before it moves a byte.
pub(crate) fn round_trip(parent: &Agent, kind: &str, env: &[(&str, &str)]) {
    const MIB: u64 = 1 << 20;
    let region = Region::new(4 * MIB).unwrap();
    let reg = parent.register(&region).unwrap();
    let mut child = Child::spawn(kind, 4 * MIB, env);
    let peer = parent.add_remote(&child.meta).unwrap();
    assert_eq!(
        child.cmd(&format!("ADD {}", hex::encode(parent.metadata()))),
        "ADDED"
    );

    let data = pattern(5, 100 * 8192);
    region.write_at(0, &data).unwrap();
    let local: Vec<LocalDesc> = (0..100)
        .map(|i| reg.desc(i * 8192, 8192).unwrap())
        .collect();
    let remote: Vec<RemoteDesc> = (0..100)
        .map(|i| RemoteDesc::new(child.reg, MIB + i * 8192, 8192))
        .collect();
    let t = peer.write(&local, &remote, Some(b"scatter")).unwrap();
    t.wait_timeout(hang_guard()).unwrap();
    assert_eq!(child.cmd("NOTE"), "NOTE parent scatter");
    assert_eq!(child.cmd(&format!("CHECK {MIB} {} 5", 100 * 8192)), "OK");

    let t = peer
        .read(
            &[reg.desc(2 * MIB, 2 * MIB).unwrap()],
            &[RemoteDesc::new(child.reg, 2 * MIB, 2 * MIB)],
            None,
        )
        .unwrap();
    t.wait_timeout(hang_guard()).unwrap();
    let mut got = vec![0u8; 2 * MIB as usize];
    region.read_at(2 * MIB, &mut got).unwrap();
    let expected = pattern(1, 4 * MIB as usize);
    assert!(
        got == expected[2 * MIB as usize..],
        "READ brought the child's bytes"
    );

    assert_eq!(child.cmd(&format!("PUSH {} 0 65536", reg.id())), "PUSHED");
    let mut got = vec![0u8; 65536];
    region.read_at(0, &mut got).unwrap();
    assert_eq!(got, pattern(1, 65536));
    let note = parent.wait_notification(hang_guard()).unwrap();
    assert_eq!(
        (note.from.as_str(), note.msg.as_slice()),
        ("peer", &b"pushed"[..])
    );

    let refused = child.cmd(&format!("PUSH {} {} 65536", reg.id(), 4 * MIB - 10));
    assert!(refused.starts_with("ERR"), "{refused}");
    child.exit();
}

/// The child (target) is killed with transfers in flight: every transfer resolves, later
/// ones fail naming the peer, nothing leaks; a restarted child is reached again.
pub(crate) fn killed_mid_transfer(parent: &Agent, kind: &str, env: &[(&str, &str)]) {
    const SIZE: u64 = 32 << 20;
    let region = Region::new(SIZE).unwrap();
    let reg = parent.register(&region).unwrap();
    let mut child = Child::spawn(kind, SIZE, env);
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
        match t.wait_timeout(hang_guard()) {
            Ok(()) | Err(TransferError::PeerGone { .. }) => {}
            Err(e) => panic!("unexpected: {e}"),
        }
    }
    let mut error = None;
    for _ in 0..100 {
        match prepared[0].post(None).unwrap().wait_timeout(hang_guard()) {
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
    drop(prepared);

    // A restarted peer under the same name is reached through the same handle.
    let mut again = Child::spawn(kind, 4096, env);
    let same = parent.add_remote(&again.meta).unwrap();
    assert_eq!(same.name(), peer.name());
    region.write_at(0, &pattern(8, 4096)).unwrap();
    peer.write(
        &[reg.desc(0, 4096).unwrap()],
        &[RemoteDesc::new(again.reg, 0, 4096)],
        None,
    )
    .unwrap()
    .wait_timeout(hang_guard())
    .unwrap();
    assert_eq!(again.cmd("CHECK 0 4096 8"), "OK");
    drop((local, reg, peer, same));
    assert_eq!(parent.report().registrations, 0, "nothing leaked");
}

/// The child (initiator) is killed, `rounds` times, while 64 WRITEs of 32 MiB into this
/// process are in flight: this process (the target) stays alive, and a fresh child then
/// writes into the same registration with a notification, and is written to.
pub(crate) fn initiator_killed_mid_write(
    parent: &Agent,
    kind: &str,
    env: &[(&str, &str)],
    rounds: usize,
) {
    const SIZE: u64 = 32 << 20;
    let region = Region::new(SIZE).unwrap();
    let reg = parent.register(&region).unwrap();
    for _ in 0..rounds {
        let mut child = Child::spawn(kind, SIZE, env);
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
    }

    // Still alive and serving: a new peer writes into us and we write into it.
    let mut other = Child::spawn(kind, 65536, env);
    let peer = parent.add_remote(&other.meta).unwrap();
    assert_eq!(
        other.cmd(&format!("ADD {}", hex::encode(parent.metadata()))),
        "ADDED"
    );
    assert_eq!(other.cmd(&format!("PUSH {} 0 65536", reg.id())), "PUSHED");
    let mut got = vec![0u8; 65536];
    region.read_at(0, &mut got).unwrap();
    assert_eq!(got, pattern(1, 65536));
    let note = parent.wait_notification(hang_guard()).unwrap();
    assert_eq!(
        (note.from.as_str(), note.msg.as_slice()),
        ("peer", &b"pushed"[..])
    );
    region.write_at(0, &pattern(8, 4096)).unwrap();
    peer.write(
        &[reg.desc(0, 4096).unwrap()],
        &[RemoteDesc::new(other.reg, 0, 4096)],
        None,
    )
    .unwrap()
    .wait_timeout(hang_guard())
    .unwrap();
    assert_eq!(other.cmd("CHECK 0 4096 8"), "OK");
    other.exit();
}
