//! The UCX engine between two engines in one process: put and get verified byte for byte,
//! chunked registrations, a 1,000-descriptor scatter, notifications after data, validation
//! before posting, peer death and teardown.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use tessera_transport::testing::{finish_or_exit, hang_guard, signal};
use tessera_ucx::raw::{MemRegion, RmaOp, UcxEndpoint, UcxEngine};
use tessera_ucx::{ErrorHandling, RmaKind, Side, UcxConfig, UcxError};

/// Set in the helper process that `two_processes_and_peer_death_mid_transfer` spawns.
const CHILD: &str = "TESSERA_UCX_TEST_CHILD";

/// Heap memory registered with an engine; the registration is dropped before the memory.
struct Reg {
    region: Option<MemRegion>,
    ptr: *mut u8,
    len: usize,
}

impl Reg {
    fn new(engine: &UcxEngine, len: usize, fill: impl Fn(usize) -> u8) -> Self {
        let data: Box<[u8]> = (0..len).map(fill).collect();
        let ptr = Box::into_raw(data).cast::<u8>();
        // SAFETY: `ptr..ptr+len` is a live heap allocation owned by this Reg; Drop frees it
        // only after dropping the registration, and every test waits for its transfers (which
        // hold clones of the registration) before dropping a Reg.
        let region = unsafe { engine.register(ptr, len as u64) }.expect("register");
        Self {
            region: Some(region),
            ptr,
            len,
        }
    }

    fn region(&self) -> &MemRegion {
        self.region.as_ref().expect("registered until drop")
    }

    fn bytes(&self) -> Vec<u8> {
        // SAFETY: the allocation is live; tests read only when no transfer is in flight.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }.to_vec()
    }
}

impl Drop for Reg {
    fn drop(&mut self) {
        self.region = None;
        // SAFETY: reclaims the allocation made in `new`, once, after the registration (and,
        // as the tests wait for their transfers, every clone of it) is gone.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}

fn pattern(seed: u8) -> impl Fn(usize) -> u8 {
    move |i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ ((i >> 11) as u8)
}

fn engine(name: &str) -> UcxEngine {
    UcxEngine::new(UcxConfig::new(name)).expect("engine")
}

fn connect(from: &UcxEngine, to: &UcxEngine, regs: &[(u64, &Reg)]) -> UcxEndpoint {
    let ep = from.connect(to.name(), to.address()).expect("connect");
    for (id, r) in regs {
        ep.add_remote(*id, r.region().remote_key())
            .expect("add_remote");
    }
    ep
}

fn op(local: &Reg, local_offset: u64, remote: u64, remote_offset: u64, len: u64) -> RmaOp<'_> {
    RmaOp {
        local: local.region(),
        local_offset,
        remote,
        remote_offset,
        len,
    }
}

fn done(mut p: tessera_ucx::raw::Pending) -> Result<(), UcxError> {
    p.wait_timeout(hang_guard())
        .expect("transfer did not finish")
}

const MIB: usize = 1 << 20;

#[test]
fn put_and_get_of_a_few_mib_verified_byte_for_byte() {
    let a = engine("put-get-a");
    let b = engine("put-get-b");
    let src = Reg::new(&a, 4 * MIB, pattern(7));
    let back = Reg::new(&a, 4 * MIB, |_| 0);
    let dst = Reg::new(&b, 4 * MIB, |_| 0xEE);
    let ep = connect(&a, &b, &[(1, &dst)]);

    done(ep.put(&[op(&src, 0, 1, 0, 4 * MIB as u64)], None).unwrap()).unwrap();
    assert!(dst.bytes() == src.bytes(), "put bytes differ");

    done(ep.get(&[op(&back, 0, 1, 0, 4 * MIB as u64)], None).unwrap()).unwrap();
    assert!(back.bytes() == src.bytes(), "get bytes differ");
}

#[test]
fn without_peer_error_handling_bytes_move_too() {
    let none = |name: &str| {
        let mut c = UcxConfig::new(name);
        c.error_handling = ErrorHandling::None;
        c.busy_poll = Duration::from_micros(50);
        UcxEngine::new(c).unwrap()
    };
    let a = none("none-a");
    let b = none("none-b");
    let src = Reg::new(&a, 2 * MIB, pattern(13));
    let dst = Reg::new(&b, 2 * MIB, |_| 0);
    let ep = connect(&a, &b, &[(1, &dst)]);
    done(
        ep.put(&[op(&src, 0, 1, 0, 2 * MIB as u64)], Some(b"n".to_vec()))
            .unwrap(),
    )
    .unwrap();
    assert!(dst.bytes() == src.bytes());
    assert_eq!(
        b.recv_notification(Some(hang_guard())).map(|n| n.1),
        Some(b"n".to_vec())
    );
}

#[test]
fn chunked_registrations_are_transparent() {
    let mut ca = UcxConfig::new("chunk-a");
    ca.max_chunk = MIB as u64;
    let mut cb = UcxConfig::new("chunk-b");
    cb.max_chunk = 768 << 10;
    let a = UcxEngine::new(ca).unwrap();
    let b = UcxEngine::new(cb).unwrap();
    let len = 3 * MIB + 12_345;
    let src = Reg::new(&a, len, pattern(3));
    let dst = Reg::new(&b, len, |_| 0);
    assert_eq!(src.region().chunks(), 4);
    assert_eq!(dst.region().chunks(), 5);
    let ep = connect(&a, &b, &[(9, &dst)]);
    // Offsets chosen to straddle chunk boundaries on both sides, and one op over all of it.
    let ops = [
        op(&src, MIB as u64 - 100, 9, (768 << 10) - 50, 300_000),
        op(&src, 0, 9, 2 * MIB as u64, MIB as u64 + 12_345),
    ];
    done(ep.put(&ops, None).unwrap()).unwrap();
    let (s, d) = (src.bytes(), dst.bytes());
    let (l0, r0) = (MIB - 100, (768 << 10) - 50);
    assert!(d[r0..r0 + 300_000] == s[l0..l0 + 300_000]);
    assert!(d[2 * MIB..] == s[..MIB + 12_345]);

    let whole = Reg::new(&a, len, |_| 0);
    done(ep.get(&[op(&whole, 0, 9, 0, len as u64)], None).unwrap()).unwrap();
    assert!(whole.bytes() == dst.bytes());
}

#[test]
fn scatter_of_1000_descriptors() {
    let a = engine("scatter-a");
    let b = engine("scatter-b");
    const N: usize = 1000;
    const K: usize = 4096;
    let src = Reg::new(&a, N * K, pattern(11));
    let dst = Reg::new(&b, N * K, |_| 0);
    let ep = connect(&a, &b, &[(1, &dst)]);
    // Block i goes to slot (i * 7) % N: a permutation, so no two writes overlap.
    let ops: Vec<_> = (0..N)
        .map(|i| {
            op(
                &src,
                (i * K) as u64,
                1,
                (((i * 7) % N) * K) as u64,
                K as u64,
            )
        })
        .collect();
    done(ep.put(&ops, None).unwrap()).unwrap();
    let (s, d) = (src.bytes(), dst.bytes());
    for i in 0..N {
        let j = (i * 7) % N;
        assert!(d[j * K..(j + 1) * K] == s[i * K..(i + 1) * K], "block {i}");
    }
    // Gather it back in the inverse order.
    let back = Reg::new(&a, N * K, |_| 0);
    let ops: Vec<_> = (0..N)
        .map(|i| {
            op(
                &back,
                (i * K) as u64,
                1,
                (((i * 7) % N) * K) as u64,
                K as u64,
            )
        })
        .collect();
    done(ep.get(&ops, None).unwrap()).unwrap();
    assert!(back.bytes() == src.bytes());
}

#[test]
fn notification_arrives_after_the_data() {
    let a = engine("notify-a");
    let b = engine("notify-b");
    let src = Reg::new(&a, 2 * MIB, pattern(5));
    let dst = Reg::new(&b, 2 * MIB, |_| 0);
    let ep = connect(&a, &b, &[(1, &dst)]);
    // Not waiting for the sender's completion: the notification alone must imply the data.
    let pending = ep
        .put(
            &[op(&src, 0, 1, 0, 2 * MIB as u64)],
            Some(b"landed".to_vec()),
        )
        .unwrap();
    let (from, msg) = b
        .recv_notification(Some(hang_guard()))
        .expect("no notification");
    assert_eq!(from, "notify-a");
    assert_eq!(msg, b"landed");
    assert!(dst.bytes() == src.bytes(), "notification before the data");
    done(pending).unwrap();
    assert!(b.recv_notification(Some(Duration::ZERO)).is_none());
}

/// Notifications of the largest size (64 KiB: too large to go eagerly, so UCX returns a
/// request that completes later), several in flight at once: each arrives whole, after its
/// data, and every transfer completes.
#[test]
fn the_largest_notifications_arrive_after_their_data() {
    const K: usize = 8;
    let a = engine("big-note-a");
    let b = engine("big-note-b");
    let src = Reg::new(&a, K * MIB, pattern(3));
    let dst = Reg::new(&b, K * MIB, |_| 0);
    let ep = connect(&a, &b, &[(1, &dst)]);
    let note = |k: usize| vec![k as u8; 64 << 10];
    let pending: Vec<_> = (0..K)
        .map(|k| {
            let at = (k * MIB) as u64;
            ep.put(&[op(&src, at, 1, at, MIB as u64)], Some(note(k)))
                .unwrap()
        })
        .collect();
    let mut seen = Vec::new();
    for _ in 0..K {
        let (from, msg) = b
            .recv_notification(Some(hang_guard()))
            .expect("no notification");
        assert_eq!(from, "big-note-a");
        assert_eq!(msg.len(), 64 << 10);
        let k = msg[0] as usize;
        assert!(msg.iter().all(|&x| x == msg[0]));
        let got = &dst.bytes()[k * MIB..(k + 1) * MIB];
        assert!(
            got == &src.bytes()[k * MIB..(k + 1) * MIB],
            "notification {k} before its data"
        );
        seen.push(k);
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..K).collect::<Vec<_>>());
    for p in pending {
        done(p).unwrap();
    }
}

#[test]
fn notification_callback_receives_messages() {
    let (tx, rx) = std::sync::mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    let mut cb = UcxConfig::new("cb-b");
    cb.on_notify = Some(std::sync::Arc::new(move |from: &str, msg: Vec<u8>| {
        let _ = tx.lock().unwrap().send((from.to_owned(), msg));
    }));
    let a = engine("cb-a");
    let b = UcxEngine::new(cb).unwrap();
    let src = Reg::new(&a, 4096, pattern(1));
    let dst = Reg::new(&b, 4096, |_| 0);
    let ep = connect(&a, &b, &[(1, &dst)]);
    for i in 0..3u8 {
        done(
            ep.put(&[op(&src, 0, 1, 0, 4096)], Some(vec![i; 100]))
                .unwrap(),
        )
        .unwrap();
    }
    for i in 0..3u8 {
        let (from, msg) = rx.recv_timeout(hang_guard()).expect("notification");
        assert_eq!(from, "cb-a");
        assert_eq!(msg, vec![i; 100]);
    }
}

#[test]
fn invalid_descriptors_are_rejected_before_posting() {
    let a = engine("range-a");
    let b = engine("range-b");
    let src = Reg::new(&a, 64 << 10, pattern(2));
    let dst = Reg::new(&b, 64 << 10, |_| 0x55);
    let ep = connect(&a, &b, &[(1, &dst)]);
    let ran = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let post = |ops: &[RmaOp<'_>]| {
        let ran = ran.clone();
        ep.post(RmaKind::Put, ops, None, move |_| {
            ran.store(true, std::sync::atomic::Ordering::SeqCst)
        })
    };
    // A valid first op followed by one past the remote end: nothing may be posted.
    let err = post(&[op(&src, 0, 1, 0, 4096), op(&src, 0, 1, (64 << 10) - 10, 11)]).unwrap_err();
    assert!(
        matches!(
            err,
            UcxError::OutOfRange {
                side: Side::Remote,
                index: 1,
                ..
            }
        ),
        "{err}"
    );
    let err = post(&[op(&src, 1, 1, 0, 64 << 10)]).unwrap_err();
    assert!(matches!(
        err,
        UcxError::OutOfRange {
            side: Side::Local,
            index: 0,
            ..
        }
    ));
    let err = post(&[op(&src, 0, 1, u64::MAX, 2)]).unwrap_err();
    assert!(matches!(
        err,
        UcxError::OutOfRange {
            side: Side::Remote,
            ..
        }
    ));
    let err = post(&[op(&src, 0, 2, 0, 16)]).unwrap_err();
    assert!(matches!(err, UcxError::UnknownRemote { id: 2, .. }));
    let err = post(&[op(&src, 0, 1, 0, 0)]).unwrap_err();
    assert!(matches!(err, UcxError::OutOfRange { .. }));
    assert!(matches!(post(&[]).unwrap_err(), UcxError::Invalid(_)));
    let big = vec![0u8; (64 << 10) + 1];
    let err = ep.put(&[op(&src, 0, 1, 0, 16)], Some(big)).unwrap_err();
    assert!(matches!(err, UcxError::Invalid(_)));
    // A registration of another engine.
    let foreign = Reg::new(&b, 4096, |_| 0);
    let err = post(&[op(&foreign, 0, 1, 0, 16)]).unwrap_err();
    assert!(matches!(err, UcxError::ForeignRegistration { index: 0 }));
    assert!(!ran.load(std::sync::atomic::Ordering::SeqCst));
    assert!(
        dst.bytes().iter().all(|&x| x == 0x55),
        "a rejected transfer moved bytes"
    );
    // Malformed peer input.
    assert!(matches!(
        ep.add_remote(3, b"garbage").unwrap_err(),
        UcxError::Malformed { .. }
    ));
    assert!(matches!(
        a.connect("x", b"garbage").unwrap_err(),
        UcxError::Malformed { .. }
    ));
    assert_eq!(a.report().pending_transfers, 0);
}

#[test]
fn peer_death_surfaces_as_an_error() {
    // tcp only: in one process the shared-memory transports would write into the dead peer's
    // freed memory, and their keepalive cannot see a peer with our own pid die.
    let tcp = |name: &str| {
        let mut c = UcxConfig::new(name);
        c.tls = Some("tcp".into());
        UcxEngine::new(c).unwrap()
    };
    let a = tcp("death-a");
    let b = tcp("death-b");
    let src = Reg::new(&a, MIB, pattern(9));
    let dst = Reg::new(&b, MIB, |_| 0);
    let ep = connect(&a, &b, &[(1, &dst)]);
    done(ep.put(&[op(&src, 0, 1, 0, MIB as u64)], None).unwrap()).unwrap();
    assert!(dst.bytes() == src.bytes());

    let probe = b.probe();
    drop(dst);
    drop(b);
    assert!(!probe.is_alive(), "the dead peer's worker is still alive");

    // Either the post is refused (failure already seen) or the transfer fails; never a hang,
    // never success. Repeat until the failure has been noticed.
    let mut saw = None;
    for _ in 0..1000 {
        let r = ep
            .put(&[op(&src, 0, 1, 0, MIB as u64)], None)
            .and_then(done);
        match r {
            Ok(()) => continue, // data still in flight to a closing socket
            Err(e) => {
                saw = Some(e);
                break;
            }
        }
    }
    let err = saw.expect("the peer's death was never reported");
    eprintln!("peer death reported as: {err}");
    assert!(err.is_peer_gone(), "{err}");
    assert!(ep.failure().is_some());
    let err = ep.put(&[op(&src, 0, 1, 0, 16)], None).unwrap_err();
    assert!(err.is_peer_gone(), "{err}");
    assert_eq!(a.report().pending_transfers, 0);
}

#[test]
fn teardown_releases_everything() {
    let a = engine("teardown-a");
    let b = engine("teardown-b");
    let (pa, pb) = (a.probe(), b.probe());
    {
        let src = Reg::new(&a, MIB, pattern(4));
        let dst = Reg::new(&b, MIB, |_| 0);
        let ep = connect(&a, &b, &[(1, &dst)]);
        let back = connect(&b, &a, &[(1, &src)]);
        done(
            ep.put(&[op(&src, 0, 1, 0, MIB as u64)], Some(b"x".to_vec()))
                .unwrap(),
        )
        .unwrap();
        done(back.get(&[op(&dst, 0, 1, 0, MIB as u64)], None).unwrap()).unwrap();
        assert_eq!(a.report().memory_handles, 1);
        assert_eq!(a.report().endpoints, 1);
        drop(ep);
        drop(back);
    }
    assert_eq!(a.report().memory_handles, 0);
    assert_eq!(b.report().memory_handles, 0);
    // Without handles the endpoints stay open, parked, while the engines live: each is
    // paired with the other side's endpoint.
    assert_eq!(a.report().endpoints, 0);
    assert_eq!(b.report().endpoints, 0);
    assert_eq!(a.report().parked, 1);
    assert_eq!(b.report().parked, 1);
    drop(a);
    drop(b);
    assert!(!pa.is_alive() && !pb.is_alive(), "worker or context leaked");
}

#[test]
fn engine_outlived_by_handles_tears_down_in_order() {
    let a = engine("order-a");
    let b = engine("order-b");
    let pa = a.probe();
    let src = Reg::new(&a, 64 << 10, pattern(6));
    let dst = Reg::new(&b, 64 << 10, |_| 0);
    let ep = connect(&a, &b, &[(1, &dst)]);
    done(ep.put(&[op(&src, 0, 1, 0, 4096)], None).unwrap()).unwrap();
    drop(a);
    // The worker stays while the endpoint and memory handle exist; posting is refused.
    assert!(pa.is_alive());
    let err = ep.put(&[op(&src, 0, 1, 0, 16)], None).unwrap_err();
    assert!(matches!(err, UcxError::Shutdown(_)), "{err}");
    drop(ep);
    assert!(pa.is_alive());
    drop(src);
    assert!(!pa.is_alive());
}

/// The target side of `two_processes_and_peer_death_mid_transfer`; does nothing unless
/// spawned by it.
#[test]
#[ignore = "helper process of two_processes_and_peer_death_mid_transfer"]
fn helper_target_process() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let b = engine("ucx-target");
    let dst = Reg::new(&b, 64 * MIB, |_| 0);
    let mut out = std::io::stdout().lock();
    writeln!(out, "ADDR:{}", hex::encode(b.address())).unwrap();
    writeln!(out, "KEY:{}", hex::encode(dst.region().remote_key())).unwrap();
    out.flush().unwrap();
    drop(out);
    // Serve (the progress thread does) until the parent kills us or closes stdin.
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

/// The helper target process (tcp only, so that its endpoint runs over a socket that dies
/// with it), its stdout (kept open until it is killed, so that it never writes into a closed
/// pipe), its worker address and its registration's key.
fn spawn_target() -> (
    std::process::Child,
    std::io::Lines<BufReader<std::process::ChildStdout>>,
    Vec<u8>,
    Vec<u8>,
) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "helper_target_process",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .env("UCX_TLS", "tcp")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the helper process");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let (mut addr, mut key) = (None, None);
    let mut seen = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        seen.push(line.chars().take(80).collect::<String>());
        // The test harness may print its own words before ours on the same line.
        if let Some(i) = line.find("ADDR:") {
            addr = Some(hex::decode(&line[i + 5..]).expect("hex"));
        } else if let Some(i) = line.find("KEY:") {
            key = Some(hex::decode(&line[i + 4..]).expect("hex"));
            break;
        }
    }
    let (Some(addr), Some(key)) = (addr, key) else {
        panic!("the helper printed no address: {seen:?}");
    };
    (child, lines, addr, key)
}

/// A peer that stops answering (its process stopped, a 64 MiB put to it stuck in its
/// socket) holds neither the progress thread nor other transfers: a put to a live peer
/// posted after the stuck one completes meanwhile. The stuck one fails once the peer is
/// killed.
#[test]
fn a_stalled_peer_holds_no_other_transfer() {
    let (mut child, lines, addr, key) = spawn_target();
    let a = engine("stall-initiator");
    let b = engine("stall-live");
    let all = 64 * MIB as u64;
    let src = Reg::new(&a, 64 * MIB, pattern(5));
    let dst = Reg::new(&b, MIB, |_| 0);
    let stalled = a.connect("ucx-target", &addr).unwrap();
    stalled.add_remote(1, &key).unwrap();
    done(stalled.put(&[op(&src, 0, 1, 0, MIB as u64)], None).unwrap()).unwrap();
    let live = connect(&a, &b, &[(1, &dst)]);
    signal(&child, "STOP");
    let stuck = stalled.put(&[op(&src, 0, 1, 0, all)], None).unwrap();
    // On a thread of its own: a waiter held by the stuck put would block the post itself.
    let first_mib = [op(&src, 0, 1, 0, MIB as u64)];
    let finished = finish_or_exit(
        "a put to a live peer, posted after a stuck one",
        || {
            live.put(&first_mib, None)
                .map(|mut p| p.wait_timeout(hang_guard()))
        },
        || {
            let _ = child.kill();
            let _ = child.wait();
        },
    )
    .expect("posting to the live peer")
    .expect("finished within the hang guard");
    finished.expect("a put to the live peer, posted after the stuck one");
    assert!(dst.bytes() == src.bytes()[..MIB]);
    signal(&child, "CONT");
    child.kill().unwrap();
    child.wait().unwrap();
    drop(lines);
    assert!(
        done(stuck).is_err(),
        "a put to a killed peer reported success"
    );
}

#[test]
fn two_processes_and_peer_death_mid_transfer() {
    let (mut child, lines, addr, key) = spawn_target();
    let a = engine("ucx-initiator");
    let src = Reg::new(&a, 64 * MIB, pattern(12));
    let back = Reg::new(&a, 64 * MIB, |_| 0);
    let ep = a.connect("ucx-target", &addr).unwrap();
    ep.add_remote(1, &key).unwrap();
    let all = 64 * MIB as u64;
    done(ep.put(&[op(&src, 0, 1, 0, all)], None).unwrap()).unwrap();
    done(ep.get(&[op(&back, 0, 1, 0, all)], None).unwrap()).unwrap();
    assert!(back.bytes() == src.bytes(), "bytes differ across processes");

    // Kill the target with a 64 MiB put in flight: the transfer must fail, not hang, and
    // never report success after the target is gone.
    let inflight = ep.put(&[op(&src, 0, 1, 0, all)], None).unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    drop(lines);
    let mut saw = done(inflight).err();
    let mid_transfer = saw.is_some();
    for _ in 0..1000 {
        if saw.is_some() {
            break;
        }
        // The first put may have landed before the kill; keep going until the death shows.
        saw = ep.put(&[op(&src, 0, 1, 0, all)], None).and_then(done).err();
    }
    let err = saw.expect("the peer's death was never reported");
    eprintln!("peer death reported as: {err} (by the transfer in flight: {mid_transfer})");
    assert!(err.is_peer_gone(), "{err}");
    let err = ep.put(&[op(&src, 0, 1, 0, 16)], None).unwrap_err();
    assert!(err.is_peer_gone(), "{err}");
    assert_eq!(a.report().pending_transfers, 0);
}

#[test]
fn concurrent_transfers_from_several_threads() {
    const THREADS: usize = 4;
    const ROUNDS: usize = 25;
    const K: usize = 64 << 10;
    let a = engine("conc-a");
    let b = engine("conc-b");
    let src = Reg::new(&a, THREADS * K, pattern(21));
    let back = Reg::new(&a, THREADS * K, |_| 0);
    let dst = Reg::new(&b, THREADS * K, |_| 0);
    let ep = connect(&a, &b, &[(1, &dst)]);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            // The registrations (not the test's raw buffers) cross the threads.
            let (ep, src, back) = (&ep, src.region(), back.region());
            s.spawn(move || {
                let at = (t * K) as u64;
                let one = |local| RmaOp {
                    local,
                    local_offset: at,
                    remote: 1,
                    remote_offset: at,
                    len: K as u64,
                };
                for _ in 0..ROUNDS {
                    done(ep.put(&[one(src)], None).unwrap()).unwrap();
                    done(ep.get(&[one(back)], None).unwrap()).unwrap();
                }
            });
        }
    });
    assert!(dst.bytes() == src.bytes());
    assert!(back.bytes() == src.bytes());
    assert_eq!(a.report().pending_transfers, 0);
}

#[test]
fn a_peer_closing_its_endpoint_does_not_break_ours() {
    for tls in ["tcp", "posix,cma,tcp"].repeat(10) {
        let make = |name: &str| {
            let mut c = UcxConfig::new(name);
            c.tls = Some(tls.into());
            UcxEngine::new(c).unwrap()
        };
        let a = make("closing-a");
        let b = make("closing-b");
        let src = Reg::new(&a, 64 * 1024, pattern(3));
        let dst = Reg::new(&b, 64 * 1024, |_| 0);
        let a_to_b = connect(&a, &b, &[(1, &dst)]);
        done(a_to_b.flush().unwrap()).unwrap();
        let b_to_a = connect(&b, &a, &[]);
        done(b_to_a.flush().unwrap()).unwrap();
        drop(b_to_a);
        for round in 0..200u64 {
            let len = 64 + (round % 7) * 4096;
            let off = (round % 3) * 64;
            done(a_to_b.put(&[op(&src, off, 1, 0, len)], None).unwrap())
                .unwrap_or_else(|e| panic!("{tls}: put {round}: {e}"));
            let got = dst.bytes();
            assert!(
                got[..len as usize] == src.bytes()[off as usize..(off + len) as usize],
                "{tls}: put {round} reported done, bytes missing"
            );
        }
    }
}
