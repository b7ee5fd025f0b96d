use super::iov::{empty_iov, fill_iov, Cursor, MAX_IOV};
use super::*;
use crate::{Agent, LinkState};

/// Polls `f` until it holds, failing after a generous deadline (a hang guard only).
pub(crate) fn until(what: &str, f: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !f() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what} never happened"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A target sees the link from a peer open once the peer connected, on both ends of the
/// shared link, and closed once the peer's agent is gone and the reader returned; a peer
/// that comes back opens it again.
#[test]
fn peer_link_follows_the_peers_connection() {
    let unit = Agent::new("unit", Tcp::new()).unwrap();
    assert_eq!(unit.peer_link("client"), LinkState::Closed);
    let client = Agent::new("client", Tcp::new()).unwrap();
    let peer = client.add_remote(&unit.metadata()).unwrap();
    assert_eq!(unit.peer_link("client"), LinkState::Open);
    assert_eq!(client.peer_link("unit"), LinkState::Open);
    assert_eq!(unit.peer_link("someone-else"), LinkState::Closed);
    // Dropping the peer handle keeps the link (it is shared and persistent).
    drop(peer);
    assert_eq!(unit.peer_link("client"), LinkState::Open);
    drop(client);
    until("the link closing", || {
        unit.peer_link("client") == LinkState::Closed
    });
    let again = Agent::new("client", Tcp::new()).unwrap();
    let _peer = again.add_remote(&unit.metadata()).unwrap();
    assert_eq!(unit.peer_link("client"), LinkState::Open);
}

#[test]
fn cursor_walks_spans_and_skips_empty_ones() {
    // Addresses are never dereferenced here: only the bookkeeping is checked.
    let spans = [
        (0x1000usize, 10u64),
        (0x2000, 0),
        (0x3000, 5),
        (0x4000, 3 << 30),
    ];
    let mut cur = Cursor::default();
    assert!(!cur.done(&spans));
    let mut iov = empty_iov();
    let k = fill_iov(&spans, &cur, &mut iov, u64::MAX);
    // 10 bytes, an empty entry, 5 bytes, then the 3 GiB span capped at MAX_IOV.
    assert_eq!(k, 4);
    assert_eq!(iov[3].iov_len as u64, MAX_IOV);
    cur.advance(&spans, 12);
    assert_eq!((cur.span, cur.offset), (2, 2));
    cur.advance(&spans, 3);
    assert!(!cur.done(&spans));
    assert_eq!((cur.span, cur.offset), (3, 0));
    cur.advance(&spans, MAX_IOV as usize);
    let k = fill_iov(&spans, &cur, &mut iov, u64::MAX);
    assert_eq!(
        (k, iov[0].iov_base as usize),
        (1, 0x4000 + MAX_IOV as usize)
    );
    cur.advance(&spans, (2 * MAX_IOV) as usize);
    assert!(cur.done(&spans));
}

#[test]
fn a_budget_caps_one_call() {
    let spans = [(0x1000usize, 600u64), (0x2000, 600), (0x3000, 5000)];
    let mut iov = empty_iov();
    let mut cur = Cursor::default();
    // 600 + 400 of the second span: the budget cuts inside it.
    let k = fill_iov(&spans, &cur, &mut iov, 1000);
    let lens: Vec<usize> = iov[..k].iter().map(|v| v.iov_len).collect();
    assert_eq!(lens, [600, 400]);
    cur.advance(&spans, 1000);
    let k = fill_iov(&spans, &cur, &mut iov, 1000);
    let got: Vec<(usize, usize)> = iov[..k]
        .iter()
        .map(|v| (v.iov_base as usize, v.iov_len))
        .collect();
    assert_eq!(got, [(0x2000 + 400, 200), (0x3000, 800)]);
    // Every call of a payload larger than the budget stays within it, and all of it goes.
    let mut cur = Cursor::default();
    let mut sent = 0;
    while !cur.done(&spans) {
        let k = fill_iov(&spans, &cur, &mut iov, 1000);
        let n: usize = iov[..k].iter().map(|v| v.iov_len).sum();
        assert!(n > 0 && n <= 1000);
        cur.advance(&spans, n);
        sent += n;
    }
    assert_eq!(sent, 6200);
}

/// A target that grants a READ and then cuts the link halfway through its payload: the READ
/// fails as the link's loss, never as done with half its bytes. The target is a raw socket
/// speaking the wire format, since an honest engine never cuts itself short.
#[test]
fn a_read_cut_during_its_payload_fails() {
    use std::io::{Read, Write};

    use crate::engine::{PeerInfo, RemoteReg};
    use crate::{Op, Region, RemoteDesc, TransferError};

    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap().to_string().into_bytes();
    let target = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut head = [0u8; HEADER];
        s.read_exact(&mut head).unwrap();
        assert_eq!(head[0], KIND_HELLO);
        let name = u32::from_le_bytes(head[8..12].try_into().unwrap()) as usize;
        let addr = u32::from_le_bytes(head[12..16].try_into().unwrap()) as usize;
        let mut theirs = [0u8; NONCE_LEN];
        s.read_exact(&mut theirs).unwrap();
        s.read_exact(&mut vec![0u8; name + addr]).unwrap();
        let ours = crate::auth::nonce();
        let mut challenge = vec![0u8; HEADER];
        challenge[0] = KIND_CHALLENGE;
        challenge.extend_from_slice(&ours);
        challenge.extend_from_slice(&handshake::target_proof(None, KIND, &theirs, &ours, "raw"));
        s.write_all(&challenge).unwrap();
        s.read_exact(&mut [0u8; HEADER + MAC_LEN]).unwrap();
        let mut ack = [0u8; HEADER];
        ack[0] = KIND_HELLO_ACK;
        s.write_all(&ack).unwrap();
        s.read_exact(&mut head).unwrap();
        assert_eq!((head[0], head[1]), (KIND_XFER, Op::Read.code()));
        let descs = u32::from_le_bytes(head[4..8].try_into().unwrap()) as usize;
        let note = u32::from_le_bytes(head[8..12].try_into().unwrap()) as usize;
        s.read_exact(&mut vec![0u8; descs * 24 + note]).unwrap();
        let mut granted = [0u8; HEADER];
        granted[0] = KIND_RESP;
        s.write_all(&granted).unwrap();
        s.write_all(&[9u8; 2048]).unwrap(); // half of the 4 KiB asked for, then gone
    });
    let a = Agent::new("a", Tcp::new()).unwrap();
    let meta = crate::metadata::encode(&PeerInfo {
        name: "raw".into(),
        kind: KIND.into(),
        address,
        regs: vec![RemoteReg {
            id: 1,
            len: 4096,
            key: Vec::new(),
        }],
    });
    let peer = a.add_remote(&meta).unwrap();
    let region = Region::new(4096).unwrap();
    let reg = a.register(&region).unwrap();
    let t = peer
        .read(
            &[reg.desc(0, 4096).unwrap()],
            &[RemoteDesc::new(1, 0, 4096)],
            None,
        )
        .unwrap();
    target.join().unwrap();
    let outcome = t.wait_timeout(Duration::from_secs(60));
    assert!(
        matches!(outcome, Err(TransferError::PeerGone { ref peer, .. }) if peer == "raw"),
        "{outcome:?}"
    );
}

/// A target whose CHALLENGE carries a proof that does not verify (made under another token,
/// or for another name) is refused by the dialer: `add_remote` fails saying the proofs do not
/// match, and the dialer never sends the impostor its own proof. The target is a raw socket
/// that would acknowledge anything.
#[test]
fn a_dialer_refuses_a_target_whose_proof_does_not_verify() {
    use std::io::{Read, Write};

    use crate::engine::PeerInfo;
    use crate::error::ConnectError;

    let ours = Token::new("the shared secret").unwrap();
    let theirs = Token::new("another secret").unwrap();
    // (the dialer's token, the token the target proves under, the name it proves as)
    for (dialer_token, proving, as_name) in [
        (Some(ours.clone()), Some(theirs), "fake"),
        (Some(ours.clone()), None, "fake"),
        (None, None, "someone-else"),
    ] {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap().to_string().into_bytes();
        let target = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            let mut head = [0u8; HEADER];
            s.read_exact(&mut head).unwrap();
            assert_eq!(head[0], KIND_HELLO);
            let name = u32::from_le_bytes(head[8..12].try_into().unwrap()) as usize;
            let addr = u32::from_le_bytes(head[12..16].try_into().unwrap()) as usize;
            let mut dialer_nonce = [0u8; NONCE_LEN];
            s.read_exact(&mut dialer_nonce).unwrap();
            s.read_exact(&mut vec![0u8; name + addr]).unwrap();
            let nonce = crate::auth::nonce();
            let proof =
                handshake::target_proof(proving.as_ref(), KIND, &dialer_nonce, &nonce, as_name);
            let mut challenge = vec![0u8; HEADER];
            challenge[0] = KIND_CHALLENGE;
            challenge.extend_from_slice(&nonce);
            challenge.extend_from_slice(&proof);
            s.write_all(&challenge).unwrap();
            // An honest dialer hangs up here; one that answers gets acknowledged.
            let mut auth = [0u8; HEADER + MAC_LEN];
            let got_auth = s.read_exact(&mut auth).is_ok();
            if got_auth {
                let mut ack = [0u8; HEADER];
                ack[0] = KIND_HELLO_ACK;
                let _ = s.write_all(&ack);
            }
            got_auth
        });
        let tcp = match &dialer_token {
            Some(t) => Tcp::new().with_token(t.clone()),
            None => Tcp::new(),
        };
        let a = Agent::new("a", tcp).unwrap();
        let meta = crate::metadata::encode(&PeerInfo {
            name: "fake".into(),
            kind: KIND.into(),
            address,
            regs: Vec::new(),
        });
        let outcome = a.add_remote(&meta);
        let expected = handshake::bad_target_proof("fake", dialer_token.as_ref());
        assert!(
            matches!(
                &outcome,
                Err(ConnectError::Backend { peer, source })
                    if peer == "fake" && source.message == expected
            ),
            "{outcome:?}"
        );
        assert!(
            !target.join().unwrap(),
            "the dialer sent its proof to a target that did not prove itself"
        );
    }
}

/// HELLOs the target must refuse (another kind of message first, an empty name, a name or an
/// address over 255 bytes) close the connection without a CHALLENGE; a HELLO whose name and
/// address are 255 bytes each, the most there may be, is challenged.
#[test]
fn malformed_hellos_are_closed_without_a_challenge() {
    use std::io::{Read, Write};

    let unit = Agent::new("unit", Tcp::new()).unwrap();
    let info = crate::metadata::decode(&unit.metadata()).unwrap();
    let addr: SocketAddr = std::str::from_utf8(&info.address).unwrap().parse().unwrap();
    let hello = |kind: u8, name: usize, address: usize| {
        let mut h = vec![0u8; HEADER];
        h[0] = kind;
        h[8..12].copy_from_slice(&(name as u32).to_le_bytes());
        h[12..16].copy_from_slice(&(address as u32).to_le_bytes());
        h.extend_from_slice(&crate::auth::nonce());
        h.extend(std::iter::repeat_n(b'n', name));
        h.extend(std::iter::repeat_n(b'a', address));
        h
    };
    // What the target sends back before it closes (or 4 KiB of it).
    let answer = |bytes: Vec<u8>| {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.write_all(&bytes).unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while got.len() < 4096 {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
            // A challenge is all a well-formed HELLO gets before the dialer's AUTH.
            if got.len() >= HEADER + NONCE_LEN + MAC_LEN {
                break;
            }
        }
        got
    };
    for (what, bytes) in [
        ("another kind first", hello(KIND_AUTH, 6, 9)),
        ("an empty name", hello(KIND_HELLO, 0, 9)),
        ("a 256-byte name", hello(KIND_HELLO, 256, 9)),
        ("a 256-byte address", hello(KIND_HELLO, 6, 256)),
    ] {
        let got = answer(bytes);
        assert!(
            got.first() != Some(&KIND_CHALLENGE),
            "{what}: challenged ({} bytes back)",
            got.len()
        );
    }
    let got = answer(hello(KIND_HELLO, 255, 255));
    assert_eq!(got.first(), Some(&KIND_CHALLENGE), "the largest HELLO");
}

/// Requests whose descriptor lists are larger than the target's first read buffer (64 KiB;
/// 5,000 descriptors of 24 bytes), one after another on a link: each is read whole and no
/// further, so the next one parses, and every byte lands where its descriptor says.
#[test]
fn requests_of_thousands_of_descriptors_follow_each_other() {
    use crate::{LocalDesc, Region, RemoteDesc};

    const N: u64 = 5000;
    const SZ: u64 = 64;
    let a = Agent::new("a", Tcp::new()).unwrap();
    let b = Agent::new("b", Tcp::new()).unwrap();
    let ra = Region::new(2 * N * SZ).unwrap();
    let rb = Region::new(2 * N * SZ).unwrap();
    let ga = a.register(&ra).unwrap();
    let gb = b.register(&rb).unwrap();
    let peer = a.add_remote(&b.metadata()).unwrap();
    let data = crate::testing::pattern(5, (N * SZ) as usize);
    ra.write_at(0, &data).unwrap();
    // Every other slot of b, so that nothing coalesces.
    let remote: Vec<RemoteDesc> = (0..N)
        .map(|i| RemoteDesc::new(gb.id(), 2 * i * SZ, SZ))
        .collect();
    let out: Vec<LocalDesc> = (0..N).map(|i| ga.desc(i * SZ, SZ).unwrap()).collect();
    let back: Vec<LocalDesc> = (0..N).map(|i| ga.desc((N + i) * SZ, SZ).unwrap()).collect();
    for _ in 0..2 {
        let w = peer.write(&out, &remote, None).unwrap();
        w.wait_timeout(crate::testing::hang_guard()).unwrap();
        let r = peer.read(&back, &remote, None).unwrap();
        r.wait_timeout(crate::testing::hang_guard()).unwrap();
    }
    let mut got = vec![0u8; (N * SZ) as usize];
    ra.read_at(N * SZ, &mut got).unwrap();
    assert!(got == data, "bytes read back differ");
    let mut slot = vec![0u8; SZ as usize];
    rb.read_at(2 * (N - 1) * SZ, &mut slot).unwrap();
    assert_eq!(slot, data[((N - 1) * SZ) as usize..]);
}
