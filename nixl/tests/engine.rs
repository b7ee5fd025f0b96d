//! The NIXL engine between two agents in one process, and across two processes: write and
//! read verified byte for byte, chunked registrations, a 1,000-descriptor scatter,
//! notifications after data, validation before posting, peer death and teardown.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use tessera_nixl::raw::{NixlEngine, NixlPeer, NixlRegion, Pending, XferOpDesc};
use tessera_nixl::{NixlConfig, NixlEngineError, Side, XferKind};
use tessera_transport::testing::{finish_or_exit, hang_guard, signal};

const MIB: usize = 1 << 20;
/// Set in the helper process that `peer_death_mid_transfer_across_processes` spawns.
const CHILD: &str = "TESSERA_NIXL_TEST_CHILD";

/// Heap memory registered with an engine; the registration is dropped before the memory.
struct Reg {
    region: Option<NixlRegion>,
    ptr: *mut u8,
    len: usize,
}

impl Reg {
    fn new(engine: &NixlEngine, len: usize, fill: impl Fn(usize) -> u8) -> Self {
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

    fn region(&self) -> &NixlRegion {
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

fn engine(name: &str) -> NixlEngine {
    NixlEngine::new(NixlConfig::new(name)).expect("engine")
}

/// `from` loads `to`'s metadata (fetched after `to` registered) and the given keys.
fn connect(from: &NixlEngine, to: &NixlEngine, regs: &[(u64, &Reg)]) -> NixlPeer {
    let peer = from
        .load_remote(&to.metadata().unwrap())
        .expect("load_remote");
    assert_eq!(peer.name(), to.name());
    for (id, r) in regs {
        peer.add_remote(*id, &r.region().remote_key()).unwrap();
    }
    peer
}

fn op(local: &Reg, local_offset: u64, remote: u64, remote_offset: u64, len: u64) -> XferOpDesc<'_> {
    XferOpDesc {
        local: local.region(),
        local_offset,
        remote,
        remote_offset,
        len,
    }
}

fn done(mut p: Pending) -> Result<(), NixlEngineError> {
    p.wait_timeout(hang_guard())
        .expect("transfer did not finish")
}

#[test]
fn write_and_read_of_a_few_mib_verified_byte_for_byte() {
    let a = engine("wr-a");
    let b = engine("wr-b");
    let src = Reg::new(&a, 4 * MIB, pattern(7));
    let back = Reg::new(&a, 4 * MIB, |_| 0);
    let dst = Reg::new(&b, 4 * MIB, |_| 0xEE);
    let peer = connect(&a, &b, &[(1, &dst)]);
    done(
        peer.write(&[op(&src, 0, 1, 0, 4 * MIB as u64)], None)
            .unwrap(),
    )
    .unwrap();
    assert!(dst.bytes() == src.bytes(), "write bytes differ");
    done(
        peer.read(&[op(&back, 0, 1, 0, 4 * MIB as u64)], None)
            .unwrap(),
    )
    .unwrap();
    assert!(back.bytes() == src.bytes(), "read bytes differ");
}

#[test]
fn chunked_registrations_are_transparent() {
    let mut ca = NixlConfig::new("chunk-a");
    ca.max_chunk = MIB as u64;
    let mut cb = NixlConfig::new("chunk-b");
    cb.max_chunk = 768 << 10;
    let a = NixlEngine::new(ca).unwrap();
    let b = NixlEngine::new(cb).unwrap();
    let len = 3 * MIB + 12_345;
    let src = Reg::new(&a, len, pattern(3));
    let dst = Reg::new(&b, len, |_| 0);
    assert_eq!(src.region().chunks(), 4);
    assert_eq!(dst.region().chunks(), 5);
    let peer = connect(&a, &b, &[(9, &dst)]);
    let ops = [
        op(&src, MIB as u64 - 100, 9, (768 << 10) - 50, 300_000),
        op(&src, 0, 9, 2 * MIB as u64, MIB as u64 + 12_345),
    ];
    done(peer.write(&ops, None).unwrap()).unwrap();
    let (s, d) = (src.bytes(), dst.bytes());
    let (l0, r0) = (MIB - 100, (768 << 10) - 50);
    assert!(d[r0..r0 + 300_000] == s[l0..l0 + 300_000]);
    assert!(d[2 * MIB..] == s[..MIB + 12_345]);
    let whole = Reg::new(&a, len, |_| 0);
    done(peer.read(&[op(&whole, 0, 9, 0, len as u64)], None).unwrap()).unwrap();
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
    let peer = connect(&a, &b, &[(1, &dst)]);
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
    done(peer.write(&ops, None).unwrap()).unwrap();
    let (s, d) = (src.bytes(), dst.bytes());
    for i in 0..N {
        let j = (i * 7) % N;
        assert!(d[j * K..(j + 1) * K] == s[i * K..(i + 1) * K], "block {i}");
    }
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
    done(peer.read(&ops, None).unwrap()).unwrap();
    assert!(back.bytes() == src.bytes());
}

#[test]
fn notification_arrives_after_the_data() {
    let a = engine("notify-a");
    let b = engine("notify-b");
    let src = Reg::new(&a, 2 * MIB, pattern(5));
    let dst = Reg::new(&b, 2 * MIB, |_| 0);
    let peer = connect(&a, &b, &[(1, &dst)]);
    let pending = peer
        .write(
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

#[test]
fn notification_callback_receives_messages() {
    let (tx, rx) = std::sync::mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    let mut cb = NixlConfig::new("cb-b");
    cb.on_notify = Some(std::sync::Arc::new(move |from: &str, msg: Vec<u8>| {
        let _ = tx.lock().unwrap().send((from.to_owned(), msg));
    }));
    let a = engine("cb-a");
    let b = NixlEngine::new(cb).unwrap();
    let src = Reg::new(&a, 4096, pattern(1));
    let dst = Reg::new(&b, 4096, |_| 0);
    let peer = connect(&a, &b, &[(1, &dst)]);
    for i in 0..3u8 {
        done(
            peer.write(&[op(&src, 0, 1, 0, 4096)], Some(vec![i; 100]))
                .unwrap(),
        )
        .unwrap();
    }
    let mut got: Vec<Vec<u8>> = (0..3)
        .map(|_| {
            let (from, msg) = rx.recv_timeout(hang_guard()).expect("notification");
            assert_eq!(from, "cb-a");
            msg
        })
        .collect();
    got.sort();
    assert_eq!(got, (0..3u8).map(|i| vec![i; 100]).collect::<Vec<_>>());
}

#[test]
fn invalid_descriptors_are_rejected_before_posting() {
    let a = engine("range-a");
    let b = engine("range-b");
    let src = Reg::new(&a, 64 << 10, pattern(2));
    let dst = Reg::new(&b, 64 << 10, |_| 0x55);
    let peer = connect(&a, &b, &[(1, &dst)]);
    let ran = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let post = |ops: &[XferOpDesc<'_>]| {
        let ran = ran.clone();
        peer.post(XferKind::Write, ops, None, move |_| {
            ran.store(true, std::sync::atomic::Ordering::SeqCst)
        })
    };
    let err = post(&[op(&src, 0, 1, 0, 4096), op(&src, 0, 1, (64 << 10) - 10, 11)]).unwrap_err();
    assert!(
        matches!(
            err,
            NixlEngineError::OutOfRange {
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
        NixlEngineError::OutOfRange {
            side: Side::Local,
            ..
        }
    ));
    let err = post(&[op(&src, 0, 1, u64::MAX, 2)]).unwrap_err();
    assert!(matches!(err, NixlEngineError::OutOfRange { .. }));
    let err = post(&[op(&src, 0, 2, 0, 16)]).unwrap_err();
    assert!(matches!(err, NixlEngineError::UnknownRemote { id: 2, .. }));
    assert!(matches!(
        post(&[]).unwrap_err(),
        NixlEngineError::Invalid(_)
    ));
    let foreign = Reg::new(&b, 4096, |_| 0);
    let err = post(&[op(&foreign, 0, 1, 0, 16)]).unwrap_err();
    assert!(matches!(
        err,
        NixlEngineError::ForeignRegistration { index: 0 }
    ));
    assert!(!ran.load(std::sync::atomic::Ordering::SeqCst));
    assert!(
        dst.bytes().iter().all(|&x| x == 0x55),
        "a rejected transfer moved bytes"
    );
    assert!(matches!(
        peer.add_remote(3, b"garbage").unwrap_err(),
        NixlEngineError::Malformed(_)
    ));
    assert!(a.load_remote(b"garbage").is_err());
    assert_eq!(a.report().pending_transfers, 0);
}

/// A transfer deadline that is not reached fails nothing: with a generous timeout every
/// transfer, in progress over several rounds of the waiter, completes.
#[test]
fn transfers_within_their_timeout_complete() {
    let mut ca = NixlConfig::new("in-time-a");
    ca.timeout = Some(hang_guard());
    let a = NixlEngine::new(ca).unwrap();
    let b = engine("in-time-b");
    let src = Reg::new(&a, 32 * MIB, pattern(9));
    let dst = Reg::new(&b, 32 * MIB, |_| 0);
    let peer = connect(&a, &b, &[(1, &dst)]);
    for _ in 0..8 {
        done(
            peer.write(&[op(&src, 0, 1, 0, 32 * MIB as u64)], None)
                .unwrap(),
        )
        .expect("a transfer well within its timeout");
    }
    assert!(dst.bytes() == src.bytes());
}

#[test]
fn timed_out_transfers_stay_quarantined_until_nixl_finishes_them() {
    let mut ca = NixlConfig::new("quarantine-a");
    ca.timeout = Some(Duration::from_nanos(1));
    let a = NixlEngine::new(ca).unwrap();
    let b = engine("quarantine-b");
    let src = Reg::new(&a, 32 * MIB, pattern(8));
    let dst = Reg::new(&b, 32 * MIB, |_| 0);
    let peer = connect(&a, &b, &[(1, &dst)]);
    match done(
        peer.write(&[op(&src, 0, 1, 0, 32 * MIB as u64)], None)
            .unwrap(),
    ) {
        // Finished in place, before any deadline could be checked.
        Ok(()) => {}
        Err(NixlEngineError::Timeout { .. }) => {
            // The request and its memory are held until NIXL reports the transfer done.
            for _ in 0..100_000 {
                if a.report().quarantined == 0 {
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            assert_eq!(a.report().quarantined, 0, "quarantine never drained");
        }
        Err(e) => panic!("{e}"),
    }
    assert!(dst.bytes() == src.bytes());
}

#[test]
fn teardown_releases_everything() {
    let a = engine("teardown-a");
    let b = engine("teardown-b");
    let (pa, pb) = (a.probe(), b.probe());
    {
        let src = Reg::new(&a, MIB, pattern(4));
        let dst = Reg::new(&b, MIB, |_| 0);
        let peer = connect(&a, &b, &[(1, &dst)]);
        done(
            peer.write(&[op(&src, 0, 1, 0, MIB as u64)], Some(b"x".to_vec()))
                .unwrap(),
        )
        .unwrap();
        assert_eq!(a.report().registrations, 1);
        assert_eq!(a.report().peers, 1);
        drop(peer);
        assert_eq!(a.report().peers, 0, "remote metadata not invalidated");
    }
    assert_eq!(a.report().registrations, 0);
    assert_eq!(b.report().registrations, 0);
    drop(a);
    drop(b);
    assert!(!pa.is_alive() && !pb.is_alive(), "agent leaked");
}

/// The target side of `peer_death_mid_transfer_across_processes`; does nothing unless spawned by it.
#[test]
#[ignore = "helper process of peer_death_mid_transfer_across_processes"]
fn helper_target_process() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let b = engine("death-target");
    let dst = Reg::new(&b, 64 * MIB, |_| 0);
    let mut out = std::io::stdout().lock();
    writeln!(out, "MD:{}", hex::encode(b.metadata().unwrap())).unwrap();
    writeln!(out, "KEY:{}", hex::encode(dst.region().remote_key())).unwrap();
    out.flush().unwrap();
    drop(out);
    // Serve until the parent kills us or closes stdin.
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

/// The helper target process (tcp only, so that its endpoint runs over a socket that dies
/// with it), its stdout (kept open until it is killed, so that it never writes into a closed
/// pipe), its metadata and its registration's key.
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
    let (mut md, mut key) = (None, None);
    let mut seen = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        seen.push(line.chars().take(80).collect::<String>());
        // The test harness may print its own words before ours on the same line.
        if let Some(i) = line.find("MD:") {
            md = Some(hex::decode(&line[i + 3..]).expect("hex"));
        } else if let Some(i) = line.find("KEY:") {
            key = Some(hex::decode(&line[i + 4..]).expect("hex"));
            break;
        }
    }
    let (Some(md), Some(key)) = (md, key) else {
        panic!("the helper printed no metadata: {seen:?}");
    };
    (child, lines, md, key)
}

/// A peer that stops answering (its process stopped, a 64 MiB write to it stuck in its
/// socket): the write fails with a timeout once its deadline passed, not before, and a
/// transfer to another, live peer posted after it completes meanwhile: a stuck transfer holds
/// neither the waiter nor the others. The stuck one's memory stays quarantined until NIXL
/// finishes it (here when the peer is killed).
#[test]
fn a_stalled_peer_times_out_without_holding_the_others() {
    const TIMEOUT: Duration = Duration::from_millis(500);
    let (mut child, lines, md, key) = spawn_target();
    let mut ca = NixlConfig::new("stall-initiator");
    ca.timeout = Some(TIMEOUT);
    let a = NixlEngine::new(ca).unwrap();
    let b = engine("stall-live");
    let all = 64 * MIB as u64;
    let src = Reg::new(&a, 64 * MIB, pattern(5));
    let dst = Reg::new(&b, MIB, |_| 0);
    let stalled = a.load_remote(&md).unwrap();
    stalled.add_remote(1, &key).unwrap();
    let live = connect(&a, &b, &[(1, &dst)]);
    signal(&child, "STOP");
    let posted = std::time::Instant::now();
    let stuck = stalled.write(&[op(&src, 0, 1, 0, all)], None).unwrap();
    // On a thread of its own: a waiter held by the stuck write would block the post itself.
    let first_mib = [op(&src, 0, 1, 0, MIB as u64)];
    let finished = finish_or_exit(
        "a write to a live peer, posted after a stuck one",
        || {
            live.write(&first_mib, None)
                .map(|mut p| p.wait_timeout(hang_guard()))
        },
        || {
            let _ = child.kill();
            let _ = child.wait();
        },
    )
    .expect("posting to the live peer")
    .expect("finished within the hang guard");
    finished.expect("a write to the live peer, posted after the stuck one");
    let outcome = done(stuck);
    let after = posted.elapsed();
    assert!(
        matches!(outcome, Err(NixlEngineError::Timeout { .. })),
        "{outcome:?}"
    );
    assert!(
        after >= TIMEOUT,
        "timed out after {after:?}, before its {TIMEOUT:?}"
    );
    assert!(dst.bytes() == src.bytes()[..MIB]);
    assert_eq!(
        a.report().quarantined,
        1,
        "the stuck write's memory is held"
    );
    signal(&child, "CONT");
    child.kill().unwrap();
    child.wait().unwrap();
    drop(lines);
    for _ in 0..20_000 {
        if a.report().quarantined == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(a.report().quarantined, 0, "quarantine never drained");
}

#[test]
fn peer_death_mid_transfer_across_processes() {
    let (mut child, lines, md, key) = spawn_target();
    let a = engine("death-initiator");
    let all = 64 * MIB as u64;
    let src = Reg::new(&a, 64 * MIB, pattern(9));
    let back = Reg::new(&a, 64 * MIB, |_| 0);
    let peer = a.load_remote(&md).unwrap();
    peer.add_remote(1, &key).unwrap();
    done(peer.write(&[op(&src, 0, 1, 0, all)], None).unwrap()).unwrap();
    done(peer.read(&[op(&back, 0, 1, 0, all)], None).unwrap()).unwrap();
    assert!(back.bytes() == src.bytes(), "bytes differ across processes");

    // Kill the target with a 64 MiB write in flight: it must fail, not hang, and never
    // report success after the target is gone.
    let inflight = peer.write(&[op(&src, 0, 1, 0, all)], None).unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    drop(lines);
    let mut saw = done(inflight).err();
    let mid_transfer = saw.is_some();
    for _ in 0..1000 {
        if saw.is_some() {
            break;
        }
        // The first write may have landed before the kill; keep going until the death shows.
        saw = peer
            .write(&[op(&src, 0, 1, 0, all)], None)
            .and_then(done)
            .err();
    }
    let err = saw.expect("the peer's death was never reported");
    eprintln!("peer death reported as: {err} (by the transfer in flight: {mid_transfer})");
    assert!(
        matches!(
            err,
            NixlEngineError::TransferFailed { .. } | NixlEngineError::Nixl { .. }
        ),
        "{err}"
    );
    assert_eq!(a.report().pending_transfers, 0);
    drop(peer);
    assert_eq!(a.report().peers, 0);
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
    let peer = connect(&a, &b, &[(1, &dst)]);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            // The registrations (not the test's raw buffers) cross the threads.
            let (peer, src, back) = (&peer, src.region(), back.region());
            s.spawn(move || {
                let at = (t * K) as u64;
                let one = |local| XferOpDesc {
                    local,
                    local_offset: at,
                    remote: 1,
                    remote_offset: at,
                    len: K as u64,
                };
                for _ in 0..ROUNDS {
                    done(peer.write(&[one(src)], None).unwrap()).unwrap();
                    done(peer.read(&[one(back)], None).unwrap()).unwrap();
                }
            });
        }
    });
    assert!(dst.bytes() == src.bytes());
    assert!(back.bytes() == src.bytes());
    assert_eq!(a.report().pending_transfers, 0);
}
