//! `tessera-transport-peer BACKEND SIZE`: the second process of the two-process tests.
//!
//! It makes an agent named `peer` on BACKEND (`shm` or `tcp`), registers a SIZE-byte region
//! filled with `pattern(1)`, prints `META <hex>` and `REG <id>`, then answers one command per
//! line on stdin:
//!
//! - `ADD <hex>`: add the parent's metadata; answers `ADDED`.
//! - `CHECK <offset> <len> <seed>`: answers `OK` if the region holds `pattern(seed)` there.
//! - `NOTE`: waits for a notification; answers `NOTE <from> <msg>`.
//! - `PUSH <reg> <offset> <len>`: writes its region's first `len` bytes to the parent's
//!   registration `reg` at `offset`, with notification `pushed`; answers `PUSHED` or `ERR ...`.
//! - `FLOOD <reg> <offset> <len>`: posts 64 such writes without waiting, answers `FLOODING`
//!   and leaves them in flight (for killing this process mid-transfer).
//! - `EXIT`: exits.

use std::io::{BufRead, Write};
use std::time::Duration;

use tessera_transport::testing::pattern;
use tessera_transport::{shm::Shm, tcp::Tcp, Agent, Peer, Region, RemoteDesc};

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(kind), Some(size)) = (
        args.first(),
        args.get(1).and_then(|s| s.parse::<u64>().ok()),
    ) else {
        eprintln!("usage: tessera-transport-peer shm|tcp SIZE");
        std::process::exit(2);
    };
    let agent = match kind.as_str() {
        "shm" => Agent::new("peer", Shm::new()),
        "tcp" => Agent::new("peer", Tcp::new()),
        other => {
            eprintln!("unknown backend {other}");
            std::process::exit(2);
        }
    }
    .expect("agent starts");
    let region = Region::new(size).expect("region");
    region
        .write_at(0, &pattern(1, size as usize))
        .expect("fill");
    let reg = agent.register(&region).expect("register");
    let mut out = std::io::stdout().lock();
    writeln!(out, "META {}", hex(&agent.metadata())).unwrap();
    writeln!(out, "REG {}", reg.id()).unwrap();
    out.flush().unwrap();
    let mut parent: Option<Peer> = None;
    let mut in_flight = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let words: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| {
            words
                .get(i)
                .and_then(|w| w.parse::<u64>().ok())
                .unwrap_or(0)
        };
        let answer = match words.first().copied() {
            Some("ADD") => match words.get(1).and_then(|h| unhex(h)) {
                Some(meta) => match agent.add_remote(&meta) {
                    Ok(p) => {
                        parent = Some(p);
                        "ADDED".to_owned()
                    }
                    Err(e) => format!("ERR {e}"),
                },
                None => "ERR bad hex".to_owned(),
            },
            Some("CHECK") => {
                let (off, len, seed) = (num(1), num(2), num(3));
                let mut got = vec![0u8; len as usize];
                match region.read_at(off, &mut got) {
                    Ok(()) if got == pattern(seed, len as usize) => "OK".to_owned(),
                    Ok(()) => "BAD".to_owned(),
                    Err(e) => format!("ERR {e}"),
                }
            }
            Some("NOTE") => match agent.wait_notification(Duration::from_secs(60)) {
                Some(n) => format!("NOTE {} {}", n.from, String::from_utf8_lossy(&n.msg)),
                None => "ERR no notification".to_owned(),
            },
            Some("PUSH") => {
                let (r, off, len) = (num(1), num(2), num(3));
                match (&parent, reg.desc(0, len)) {
                    (Some(p), Ok(local)) => {
                        match p.write(&[local], &[RemoteDesc::new(r, off, len)], Some(b"pushed")) {
                            Ok(t) => match t.wait() {
                                Ok(()) => "PUSHED".to_owned(),
                                Err(e) => format!("ERR {e}"),
                            },
                            Err(e) => format!("ERR {e}"),
                        }
                    }
                    (None, _) => "ERR no parent".to_owned(),
                    (_, Err(e)) => format!("ERR {e}"),
                }
            }
            Some("FLOOD") => {
                let (r, off, len) = (num(1), num(2), num(3));
                match (&parent, reg.desc(0, len)) {
                    (Some(p), Ok(local)) => {
                        let remote = [RemoteDesc::new(r, off, len)];
                        let posted: Result<Vec<_>, _> = (0..64)
                            .map(|_| p.write(std::slice::from_ref(&local), &remote, None))
                            .collect();
                        match posted {
                            Ok(transfers) => {
                                in_flight.extend(transfers);
                                "FLOODING".to_owned()
                            }
                            Err(e) => format!("ERR {e}"),
                        }
                    }
                    (None, _) => "ERR no parent".to_owned(),
                    (_, Err(e)) => format!("ERR {e}"),
                }
            }
            Some("EXIT") | None => break,
            Some(other) => format!("ERR unknown command {other}"),
        };
        writeln!(out, "{answer}").unwrap();
        out.flush().unwrap();
    }
}
