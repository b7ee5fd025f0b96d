//! Engines survive hostile peers: garbage on their sockets closes that connection only, and
//! memory that cannot be shared is refused with an error, not a hang.

use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::time::Duration;

use tessera_transport::testing::{pattern, HANG_GUARD};
use tessera_transport::{shm::Shm, tcp::Tcp, Agent, Region, TransferError};

/// The engine address inside an agent's metadata (magic, version, name, kind, address).
fn address(meta: &[u8]) -> Vec<u8> {
    let name = meta[6] as usize;
    let kind = meta[7 + name] as usize;
    let at = 8 + name + kind;
    let len = u32::from_le_bytes(meta[at..at + 4].try_into().unwrap()) as usize;
    meta[at + 4..at + 4 + len].to_vec()
}

fn still_serves(target: &Agent, make: impl Fn(&str) -> Agent) {
    let a = make("honest");
    let ra = Region::new(4096).unwrap();
    let rb = Region::new(4096).unwrap();
    let ga = a.register(&ra).unwrap();
    let gb = target.register(&rb).unwrap();
    ra.write_at(0, &pattern(3, 4096)).unwrap();
    let peer = a.add_remote(&target.metadata()).unwrap();
    let t = peer
        .write(
            &[ga.desc(0, 4096).unwrap()],
            &[gb.remote(0, 4096).unwrap()],
            None,
        )
        .unwrap();
    t.wait_timeout(HANG_GUARD).unwrap();
    let mut got = vec![0u8; 4096];
    rb.read_at(0, &mut got).unwrap();
    assert_eq!(got, pattern(3, 4096));
}

#[test]
fn tcp_target_survives_garbage() {
    let target = Agent::new("target", Tcp::new()).unwrap();
    let addr = String::from_utf8(address(&target.metadata())).unwrap();
    for junk in [
        vec![0xFFu8; 24],                             // bad kind
        [1u8, 1, 0, 0, 255, 255, 255, 255].repeat(3), // descriptor count over the limit
        pattern(9, 10_000),                           // noise
        vec![1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0],     // truncated header
    ] {
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        let _ = s.write_all(&junk);
        drop(s);
    }
    still_serves(&target, |n| Agent::new(n, Tcp::new()).unwrap());
}

#[test]
fn shm_target_survives_garbage() {
    let target = Agent::new("target", Shm::new()).unwrap();
    let name = address(&target.metadata());
    for junk in [
        vec![5u8, 0, 0, 0, 255, 255, 255, 255],
        pattern(4, 5000),
        vec![2, 0, 0, 0, 1, 0, 0, 0, 7],
    ] {
        let addr = SocketAddr::from_abstract_name(&name).unwrap();
        let mut s = UnixStream::connect_addr(&addr).unwrap();
        let _ = s.write_all(&junk);
        drop(s);
    }
    still_serves(&target, |n| Agent::new(n, Shm::new()).unwrap());
}

/// A header announcing a body over the engine's limit (64 MiB) closes the connection at once,
/// before a byte of the body arrives and without making room for it.
#[test]
fn shm_refuses_an_oversized_body_before_it_arrives() {
    let target = Agent::new("target", Shm::new()).unwrap();
    let name = address(&target.metadata());
    let addr = SocketAddr::from_abstract_name(&name).unwrap();
    let mut s = UnixStream::connect_addr(&addr).unwrap();
    let mut header = vec![5u8, 0, 0, 0]; // XFER
    header.extend_from_slice(&((64u32 << 20) + 1).to_le_bytes());
    s.write_all(&header).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut buf = [0u8; 64];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(_) => continue,
            Err(e) => panic!("the target kept the connection open, waiting for the body: {e}"),
        }
    }
    still_serves(&target, |n| Agent::new(n, Shm::new()).unwrap());
}

#[test]
fn shm_refuses_private_memory_as_a_target() {
    let a = Agent::new("a", Shm::new()).unwrap();
    let b = Agent::new("b", Shm::new()).unwrap();
    let private = Region::anonymous(4096).unwrap();
    let gb = b.register(&private).unwrap();
    let ra = Region::anonymous(4096).unwrap(); // private is fine on the local side
    let ga = a.register(&ra).unwrap();
    let peer = a.add_remote(&b.metadata()).unwrap();
    let t = peer
        .write(
            &[ga.desc(0, 64).unwrap()],
            &[gb.remote(0, 64).unwrap()],
            None,
        )
        .unwrap();
    match t.wait_timeout(HANG_GUARD) {
        Err(TransferError::Backend { peer, source }) => {
            assert_eq!(peer, "b");
            assert_eq!(source.backend, "shm");
        }
        other => panic!("expected a backend error, got {other:?}"),
    }
}
