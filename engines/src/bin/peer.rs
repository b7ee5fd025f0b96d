//! `tessera-transport-peer BACKEND SIZE [NAME]`: the second process of the two-process tests
//! and one agent of `cargo xtask two-node-test`.
//!
//! It makes an agent named NAME (default `peer`) on the engine BACKEND (an [`EngineKind`]
//! name: `shm`, `tcp`, and with the features `ucx` (transports from `UCX_TLS`;
//! `TESSERA_UCX_ERR_MODE=none` drops peer error handling) and `nixl`; `tcp` binds
//! `TESSERA_PEER_TCP_BIND` when set), registers a SIZE-byte region, fills it with `pattern(1)` (regions
//! over 64 MiB are left zeroed: use `FILL`), prints `META <hex>` and `REG <id>`, then answers
//! one command per line on stdin:
//!
//! - `ADD <hex>`: add the parent's metadata; answers `ADDED`.
//! - `CHECK <offset> <len> <seed>`: answers `OK` if the region holds `pattern(seed)` there.
//! - `FILL <seed> [len]`: fills the region's first `len` bytes (all by default) with a fast
//!   word pattern of `seed`; answers `FILLED`.
//! - `SUM <offset> <len>`: answers `SUM <hex>`, a checksum of those bytes.
//! - `NOTE`: waits for a notification; answers `NOTE <from> <msg>`.
//! - `TRYNOTE`: the same without waiting; answers `NONE` when there is none.
//! - `PUSH <reg> <offset> <len>`: writes its region's first `len` bytes to the parent's
//!   registration `reg` at `offset`, with notification `pushed`; answers `PUSHED` or `ERR ...`.
//! - `PUSHFROM <local offset> <reg> <offset> <len>`: the same from `local offset`.
//! - `FLOOD <reg> <offset> <len>`: posts 64 such writes without waiting, answers `FLOODING`
//!   and leaves them in flight (for killing this process mid-transfer).
//! - `REGISTER <len>`: registers a fresh zeroed region of `len` bytes; answers `REG <id>`.
//! - `META`: answers `META <hex>`, the agent's metadata now.
//! - `WRITE <reg> <offset> <hex>`: writes the bytes into registration `reg` (this agent's own
//!   memory, no transfer); answers `WRITTEN`.
//! - `READ <reg> <offset> <len>`: answers `DATA <hex>`, the bytes of registration `reg` there.
//! - `XFER <W|R> <reg> <offset> <parent reg> <parent offset> <len> [note]`: a WRITE to (or READ
//!   from) the parent's registration, with the notification if given, waited for; answers
//!   `DONE` or `ERR ...`.
//! - `EXIT`: exits.

use std::io::{BufRead, Write};
use std::time::Duration;

use std::collections::HashMap;

use tessera_engines::{EngineError, EngineKind, EngineOptions};
use tessera_transport::testing::pattern;
use tessera_transport::{Agent, Peer, Region, Registration, RemoteDesc};

const PATTERN_LIMIT: u64 = 64 << 20;

/// The agent of engine `kind`, with the options the environment gives: `tcp` binds
/// `TESSERA_PEER_TCP_BIND` when set, `TESSERA_TOKEN` is the shm and tcp token when set,
/// `TESSERA_UCX_ERR_MODE=none` drops UCX's peer error handling. Exits with status 2 for a name that is no engine, or an engine not built in.
fn agent(kind: &str, name: &str) -> Agent {
    let kind: EngineKind = kind.parse().unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2);
    });
    let mut options = EngineOptions::default();
    if let Ok(addr) = std::env::var("TESSERA_PEER_TCP_BIND") {
        options.tcp_bind = Some(addr.parse().unwrap_or_else(|_| {
            eprintln!("TESSERA_PEER_TCP_BIND={addr:?} is not a socket address");
            std::process::exit(2);
        }));
    }
    options.token = tessera_transport::auth::Token::from_env("TESSERA_TOKEN").unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2);
    });
    options.ucx_peer_errors = !std::env::var("TESSERA_UCX_ERR_MODE").is_ok_and(|m| m == "none");
    match kind.agent_with(name, &options) {
        Ok(agent) => agent,
        Err(e @ EngineError::NotBuilt { .. }) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
        Err(e) => panic!("agent starts: {e}"),
    }
}

/// The word pattern of `FILL`: cheap enough for a GiB in a debug build.
fn fill_words(region: &Region, seed: u64, len: u64) -> Result<(), tessera_transport::RegionError> {
    const BLOCK: usize = 1 << 20;
    let mut buf = vec![0u8; BLOCK];
    let mut off = 0u64;
    let len = len.min(region.len());
    while off < len {
        let n = (len - off).min(BLOCK as u64) as usize;
        for (i, w) in buf[..n].chunks_mut(8).enumerate() {
            let x = (off / 8 + i as u64)
                .wrapping_add(seed)
                .wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let b = (x ^ (x >> 29)).to_le_bytes();
            w.copy_from_slice(&b[..w.len()]);
        }
        region.write_at(off, &buf[..n])?;
        off += n as u64;
    }
    Ok(())
}

/// A checksum of `len` bytes at `offset` (word-wise multiply-xor; not cryptographic).
fn checksum(region: &Region, offset: u64, len: u64) -> Result<u64, tessera_transport::RegionError> {
    const BLOCK: usize = 1 << 20;
    let mut buf = vec![0u8; BLOCK];
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ len;
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(BLOCK as u64) as usize;
        region.read_at(offset + done, &mut buf[..n])?;
        for w in buf[..n].chunks(8) {
            let mut b = [0u8; 8];
            b[..w.len()].copy_from_slice(w);
            h = (h ^ u64::from_le_bytes(b))
                .wrapping_mul(0x0100_0000_01b3)
                .rotate_left(5);
        }
        done += n as u64;
    }
    Ok(h)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(kind), Some(size)) = (
        args.first(),
        args.get(1).and_then(|s| s.parse::<u64>().ok()),
    ) else {
        eprintln!("usage: tessera-transport-peer shm|tcp|ucx|nixl SIZE [NAME]");
        std::process::exit(2);
    };
    let name = args.get(2).map_or("peer", String::as_str);
    let agent = agent(kind, name);
    let region = Region::new(size).expect("region");
    if size <= PATTERN_LIMIT {
        region
            .write_at(0, &pattern(1, size as usize))
            .expect("fill");
    }
    let reg = agent.register(&region).expect("register");
    let mut out = std::io::stdout().lock();
    writeln!(out, "META {}", hex::encode(agent.metadata())).unwrap();
    writeln!(out, "REG {}", reg.id()).unwrap();
    out.flush().unwrap();
    let mut parent: Option<Peer> = None;
    let mut in_flight = Vec::new();
    // Registrations made with REGISTER, by id (the first one above answers to its id too).
    let mut regs: HashMap<u64, Registration> = HashMap::new();
    regs.insert(reg.id(), reg.clone());
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
            Some("ADD") => match words.get(1).and_then(|h| hex::decode(h).ok()) {
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
            Some("FILL") => match fill_words(
                &region,
                num(1),
                words.get(2).map_or(region.len(), |_| num(2)),
            ) {
                Ok(()) => "FILLED".to_owned(),
                Err(e) => format!("ERR {e}"),
            },
            Some("SUM") => match checksum(&region, num(1), num(2)) {
                Ok(h) => format!("SUM {h:016x}"),
                Err(e) => format!("ERR {e}"),
            },
            Some("PUSHFROM") => {
                let (from, r, off, len) = (num(1), num(2), num(3), num(4));
                match (&parent, reg.desc(from, len)) {
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
            Some("TRYNOTE") => match agent.try_notification() {
                Some(n) => format!("NOTE {} {}", n.from, String::from_utf8_lossy(&n.msg)),
                None => "NONE".to_owned(),
            },
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
            Some("REGISTER") => match Region::new(num(1)) {
                Ok(r) => match agent.register(&r) {
                    Ok(g) => {
                        let id = g.id();
                        regs.insert(id, g);
                        format!("REG {id}")
                    }
                    Err(e) => format!("ERR {e}"),
                },
                Err(e) => format!("ERR {e}"),
            },
            Some("META") => format!("META {}", hex::encode(agent.metadata())),
            Some("WRITE") => match (
                regs.get(&num(1)),
                words.get(3).and_then(|h| hex::decode(h).ok()),
            ) {
                (Some(g), Some(bytes)) => {
                    let at = g.offset_in_registration() + num(2);
                    match g.region().write_at(at, &bytes) {
                        Ok(()) => "WRITTEN".to_owned(),
                        Err(e) => format!("ERR {e}"),
                    }
                }
                _ => "ERR unknown registration or bad hex".to_owned(),
            },
            Some("READ") => match regs.get(&num(1)) {
                Some(g) => {
                    let mut got = vec![0u8; num(3) as usize];
                    match g
                        .region()
                        .read_at(g.offset_in_registration() + num(2), &mut got)
                    {
                        Ok(()) => format!("DATA {}", hex::encode(&got)),
                        Err(e) => format!("ERR {e}"),
                    }
                }
                None => "ERR unknown registration".to_owned(),
            },
            Some("XFER") => {
                let (local, loff, r, roff, len) = (num(2), num(3), num(4), num(5), num(6));
                let note = words.get(7).map(|n| n.as_bytes());
                let desc = regs.get(&local).map(|g| g.desc(loff, len));
                match (&parent, desc) {
                    (Some(p), Some(Ok(d))) => {
                        let remote = [RemoteDesc::new(r, roff, len)];
                        let posted = if words.get(1) == Some(&"R") {
                            p.read(&[d], &remote, note)
                        } else {
                            p.write(&[d], &remote, note)
                        };
                        match posted.map(|t| t.wait()) {
                            Ok(Ok(())) => "DONE".to_owned(),
                            Ok(Err(e)) | Err(e) => format!("ERR {e}"),
                        }
                    }
                    (None, _) => "ERR no parent".to_owned(),
                    (_, None) => "ERR unknown registration".to_owned(),
                    (_, Some(Err(e))) => format!("ERR {e}"),
                }
            }
            Some("EXIT") | None => break,
            Some(other) => format!("ERR unknown command {other}"),
        };
        writeln!(out, "{answer}").unwrap();
        out.flush().unwrap();
    }
}
