//! The conformance suite every backend passes, instantiated per backend by
//! [`conformance_suite!`](crate::conformance_suite).
//!
//! Each function takes a factory that makes a fresh agent of the backend under test, so that
//! engines added later (UCX, NIXL) run the same tests from their own test binaries:
//!
//! ```ignore
//! tessera_transport::conformance_suite!(ucx, |name: &str| {
//!     tessera_transport::Agent::new(name, my_ucx::Ucx::new().unwrap()).unwrap()
//! });
//! ```
//!
//! The functions panic on failure, as tests do; they are not meant for production code.

use std::collections::HashMap;
use std::time::Duration;

use crate::{
    Agent, LocalDesc, Op, Peer, Region, RegisteredPool, Registration, RejectReason, RemoteDesc,
    Side, Status, TransferError,
};

/// Makes a fresh agent of the backend under test.
pub type Factory<'a> = &'a dyn Fn(&str) -> Agent;

/// Generous bound on how long any one transfer may take before the suite calls it a hang.
/// It guards against hangs only; no test asserts speed.
pub const HANG_GUARD: Duration = Duration::from_secs(120);

/// Instantiates the conformance suite as a module of `#[test]`s for one backend.
///
/// `$make` is an expression of type `Fn(&str) -> Agent`. The test over 4 GiB moves 4 GiB of
/// memory and is `#[ignore]`d: run it by name (`big_transfer_over_4gib`).
///
/// One-sided engines, whose targets never see a request, say so with a third argument,
/// `target_checks = KeyBounds` (see [`TargetChecks`]); the default is `Requests`. A
/// configuration that cannot notice a peer's death (UCX without peer error handling, as used
/// for cma) adds `peer_death = undetected`: its two peer-death tests are then `#[ignore]`d,
/// with that reason, rather than left to hang.
#[macro_export]
macro_rules! conformance_suite {
    ($module:ident, $make:expr) => {
        $crate::conformance_suite!($module, $make, target_checks = Requests);
    };
    ($module:ident, $make:expr, target_checks = $checks:ident) => {
        $crate::conformance_suite!(@suite $module, $make, $checks, allow(unused));
    };
    ($module:ident, $make:expr, target_checks = $checks:ident, peer_death = undetected) => {
        $crate::conformance_suite!(
            @suite $module,
            $make,
            $checks,
            ignore = "this configuration cannot detect a peer's death (UCX error handling mode none)"
        );
    };
    (@suite $module:ident, $make:expr, $checks:ident, $peer_death:meta) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;

            fn make(name: &str) -> $crate::Agent {
                let f = $make;
                f(name)
            }

            #[test]
            fn write_then_read() {
                $crate::testing::write_then_read(&make);
            }
            #[test]
            fn scatter_gather_1000() {
                $crate::testing::scatter_gather_1000(&make);
            }
            #[test]
            fn notifications() {
                $crate::testing::notifications(&make);
            }
            #[test]
            fn coalescing_and_prepared() {
                $crate::testing::coalescing_and_prepared(&make);
            }
            #[test]
            fn out_of_range_initiator() {
                $crate::testing::out_of_range_initiator(&make);
            }
            #[test]
            fn out_of_range_target() {
                $crate::testing::out_of_range_target_with(
                    &make,
                    $crate::testing::TargetChecks::$checks,
                );
            }
            #[test]
            #[$peer_death]
            fn peer_death() {
                $crate::testing::peer_death(&make);
            }
            #[test]
            fn sparse_windows_above_4gib() {
                $crate::testing::sparse_windows_above_4gib(&make);
            }
            #[test]
            #[ignore = "moves 4 GiB; run by name"]
            fn big_transfer_over_4gib() {
                $crate::testing::big_transfer_over_4gib(&make);
            }
            #[test]
            fn concurrent_threads() {
                $crate::testing::concurrent_threads(&make);
            }
            #[test]
            fn concurrent_tasks() {
                $crate::testing::concurrent_tasks(&make);
            }
            #[test]
            fn sub_range_registrations() {
                $crate::testing::sub_range_registrations(&make);
            }
            #[test]
            fn crossing_transfers() {
                $crate::testing::crossing_transfers(&make);
            }
            #[test]
            #[$peer_death]
            fn restarted_peer() {
                $crate::testing::restarted_peer(&make);
            }
            #[test]
            fn metadata_update() {
                $crate::testing::metadata_update(&make);
            }
            #[test]
            fn target_drops_its_handle() {
                $crate::testing::target_drops_its_handle(&make);
            }
            #[test]
            fn registration_cache_and_deferred_release() {
                $crate::testing::registration_cache_and_deferred_release(&make);
            }
            #[test]
            fn local_only_registrations() {
                $crate::testing::local_only_registrations(&make);
            }
        }
    };
}

/// The target agent of a case that also runs with the target in a second process: the
/// cases written against it (`*_with`) are the same code in one process ([`LocalTarget`]) and
/// across two (the transport's tests drive `tessera-transport-peer` through it).
pub trait Target {
    /// The target agent's name.
    fn name(&self) -> String;
    /// Its metadata now.
    fn metadata(&mut self) -> Vec<u8>;
    /// Registers a fresh zeroed region of `len` bytes; returns the registration id.
    fn register(&mut self, len: u64) -> u64;
    /// Writes `data` into its registration `reg` at `offset` (its own memory, no transfer).
    fn write_at(&mut self, reg: u64, offset: u64, data: &[u8]);
    /// Reads `len` bytes of its registration `reg` at `offset`.
    fn read_at(&mut self, reg: u64, offset: u64, len: u64) -> Vec<u8>;
    /// Adds the initiator's metadata: the target's handle on the initiator.
    fn add_remote(&mut self, metadata: &[u8]);
    /// The next notification `(from, message)`, waiting up to [`HANG_GUARD`].
    fn wait_notification(&mut self) -> Option<(String, Vec<u8>)>;
    /// The next notification, without waiting.
    fn try_notification(&mut self) -> Option<(String, Vec<u8>)>;
    /// A transfer by the target between its registration `local` and the initiator's
    /// registration `remote`, waited for; the error as text.
    #[allow(clippy::too_many_arguments)]
    fn transfer(
        &mut self,
        op: Op,
        local: u64,
        local_offset: u64,
        remote: u64,
        remote_offset: u64,
        len: u64,
        notify: Option<&[u8]>,
    ) -> Result<(), String>;
}

/// A [`Target`] agent in this process.
pub struct LocalTarget {
    agent: Agent,
    regs: HashMap<u64, Registration>,
    peer: Option<Peer>,
}

impl LocalTarget {
    /// Wraps `agent`.
    pub fn new(agent: Agent) -> Self {
        Self {
            agent,
            regs: HashMap::new(),
            peer: None,
        }
    }
}

impl Target for LocalTarget {
    fn name(&self) -> String {
        self.agent.name().to_owned()
    }

    fn metadata(&mut self) -> Vec<u8> {
        self.agent.metadata()
    }

    fn register(&mut self, len: u64) -> u64 {
        let g = self
            .agent
            .register(&Region::new(len).expect("region"))
            .expect("register");
        let id = g.id();
        self.regs.insert(id, g);
        id
    }

    fn write_at(&mut self, reg: u64, offset: u64, data: &[u8]) {
        let g = &self.regs[&reg];
        g.region()
            .write_at(g.offset_in_registration() + offset, data)
            .expect("write inside the registration");
    }

    fn read_at(&mut self, reg: u64, offset: u64, len: u64) -> Vec<u8> {
        let g = &self.regs[&reg];
        read(
            g.region(),
            g.offset_in_registration() + offset,
            len as usize,
        )
    }

    fn add_remote(&mut self, metadata: &[u8]) {
        self.peer = Some(
            self.agent
                .add_remote(metadata)
                .expect("target adds initiator"),
        );
    }

    fn wait_notification(&mut self) -> Option<(String, Vec<u8>)> {
        self.agent
            .wait_notification(HANG_GUARD)
            .map(|n| (n.from, n.msg))
    }

    fn try_notification(&mut self) -> Option<(String, Vec<u8>)> {
        self.agent.try_notification().map(|n| (n.from, n.msg))
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
    ) -> Result<(), String> {
        let peer = self.peer.as_ref().ok_or("no handle on the initiator")?;
        let l = [self.regs[&local]
            .desc(local_offset, len)
            .map_err(|e| e.to_string())?];
        let r = [RemoteDesc::new(remote, remote_offset, len)];
        let t = match op {
            Op::Write => peer.write(&l, &r, notify),
            Op::Read => peer.read(&l, &r, notify),
        }
        .map_err(|e| e.to_string())?;
        finish(t).map_err(|e| e.to_string())
    }
}

/// Runs a `*_with` case in one process: `agent-a` from `make` and `agent-b` as its target.
pub fn with_local_target(make: Factory<'_>, case: fn(&Agent, &mut dyn Target)) {
    let a = make("agent-a");
    let mut b = LocalTarget::new(make("agent-b"));
    case(&a, &mut b);
}

/// A byte pattern that differs per position and per seed.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn read(region: &Region, offset: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    region
        .read_at(offset, &mut out)
        .expect("read inside the region");
    out
}

/// Two agents that know each other: (a, b, a's handle on b, b's handle on a).
pub fn pair(make: Factory<'_>) -> (Agent, Agent, Peer, Peer) {
    let a = make("agent-a");
    let b = make("agent-b");
    let (a_to_b, b_to_a) = connect(&a, &b);
    (a, b, a_to_b, b_to_a)
}

/// Exchanges metadata both ways.
pub fn connect(a: &Agent, b: &Agent) -> (Peer, Peer) {
    let a_to_b = a.add_remote(&b.metadata()).expect("a adds b");
    let b_to_a = b.add_remote(&a.metadata()).expect("b adds a");
    (a_to_b, b_to_a)
}

fn finish(t: crate::Transfer) -> Result<(), TransferError> {
    match t.wait_timeout(HANG_GUARD) {
        Err(TransferError::Timeout { .. }) => panic!("transfer hung past {HANG_GUARD:?}"),
        other => other,
    }
}

/// WRITE a pattern to the peer, READ it back elsewhere, both directions.
pub fn write_then_read(make: Factory<'_>) {
    with_local_target(make, write_then_read_with);
}

/// [`write_then_read`] against any [`Target`].
pub fn write_then_read_with(a: &Agent, b: &mut dyn Target) {
    let ra = Region::new(1 << 20).unwrap();
    let ga = a.register(&ra).unwrap();
    let gb = b.register(1 << 20);
    let a_to_b = a.add_remote(&b.metadata()).unwrap();
    b.add_remote(&a.metadata());
    let data = pattern(1, 300_000);
    let n = data.len() as u64;
    ra.write_at(100, &data).unwrap();
    let t = a_to_b
        .write(
            &[ga.desc(100, n).unwrap()],
            &[RemoteDesc::new(gb, 5000, n)],
            None,
        )
        .unwrap();
    finish(t).unwrap();
    assert_eq!(b.read_at(gb, 5000, n), data);
    let t = a_to_b
        .read(
            &[ga.desc(600_000, n).unwrap()],
            &[RemoteDesc::new(gb, 5000, n)],
            None,
        )
        .unwrap();
    assert!(matches!(t.status(), Status::Pending | Status::Done));
    finish(t).unwrap();
    assert_eq!(read(&ra, 600_000, data.len()), data);
    // The other direction, on the same pair of agents.
    b.write_at(gb, 0, &pattern(6, 10));
    b.transfer(Op::Write, gb, 0, ga.id(), 0, 10, None).unwrap();
    assert_eq!(read(&ra, 0, 10), pattern(6, 10));
    assert_eq!(a.report().in_flight, 0);
}

/// The agents' copy counters (`AgentReport::copied_write_bytes`, `copied_read_bytes`), for
/// engines that count their copies: a WRITE and a READ of `n` bytes each add exactly `n` to
/// the two agents together, once; a rejected transfer adds nothing.
pub fn copies_are_counted(make: Factory<'_>) {
    let (a, b, a_to_b, _b_to_a) = pair(make);
    let ra = Region::new(1 << 20).unwrap();
    let rb = Region::new(1 << 20).unwrap();
    let ga = a.register(&ra).unwrap();
    let gb = b.register(&rb).unwrap();
    let a_to_b = a.add_remote(&b.metadata()).unwrap_or(a_to_b);
    let copied = || {
        let (ra, rb) = (a.report(), b.report());
        (
            ra.copied_write_bytes + rb.copied_write_bytes,
            ra.copied_read_bytes + rb.copied_read_bytes,
        )
    };
    assert_eq!(copied(), (0, 0));
    let n = 300_001u64;
    // Three scattered segments of one WRITE.
    let local = [
        ga.desc(0, 1).unwrap(),
        ga.desc(4096, 100_000).unwrap(),
        ga.desc(200_000, n - 100_001).unwrap(),
    ];
    let remote = [
        gb.remote(7, 1).unwrap(),
        gb.remote(10_000, 100_000).unwrap(),
        gb.remote(500_000, n - 100_001).unwrap(),
    ];
    finish(a_to_b.write(&local, &remote, None).unwrap()).unwrap();
    assert_eq!(copied(), (n, 0));
    finish(a_to_b.read(&local, &remote, None).unwrap()).unwrap();
    assert_eq!(copied(), (n, n));
    // Out of the target's range: refused before a byte moves.
    let bad = a_to_b
        .write(
            &[ga.desc(0, 64).unwrap()],
            &[RemoteDesc::new(gb.id(), (1 << 20) - 32, 64)],
            None,
        )
        .map_err(|_| ())
        .and_then(|t| finish(t).map_err(|_| ()));
    assert!(bad.is_err());
    assert_eq!(copied(), (n, n));
}

/// One transfer of 1,000 scattered 4 KiB descriptors, written in a shuffled order and read
/// back gathered into one contiguous range.
pub fn scatter_gather_1000(make: Factory<'_>) {
    with_local_target(make, scatter_gather_1000_with);
}

/// [`scatter_gather_1000`] against any [`Target`].
pub fn scatter_gather_1000_with(a: &Agent, b: &mut dyn Target) {
    const N: u64 = 1000;
    const SZ: u64 = 4096;
    let a_to_b = a.add_remote(&b.metadata()).unwrap();
    b.add_remote(&a.metadata());
    let ra = Region::new(N * SZ * 3).unwrap();
    let ga = a.register(&ra).unwrap();
    let gb = b.register(N * SZ * 2);
    let a_to_b = a.add_remote(&b.metadata()).unwrap_or(a_to_b);
    let data = pattern(2, (N * SZ) as usize);
    ra.write_at(0, &data).unwrap();
    // Local i (contiguous) goes to remote slot perm(i), every other 4 KiB slot.
    let perm = |i: u64| (i * 7919) % N;
    let local: Vec<LocalDesc> = (0..N).map(|i| ga.desc(i * SZ, SZ).unwrap()).collect();
    let remote: Vec<RemoteDesc> = (0..N)
        .map(|i| RemoteDesc::new(gb, perm(i) * 2 * SZ, SZ))
        .collect();
    finish(a_to_b.write(&local, &remote, None).unwrap()).unwrap();
    for i in [0, 1, 499, 998, 999] {
        let off = (i * SZ) as usize;
        assert_eq!(
            b.read_at(gb, perm(i) * 2 * SZ, SZ),
            &data[off..off + SZ as usize],
            "slot {i}"
        );
    }
    // Gather back into [N*SZ, 2*N*SZ) of a.
    let local: Vec<LocalDesc> = (0..N).map(|i| ga.desc((N + i) * SZ, SZ).unwrap()).collect();
    finish(a_to_b.read(&local, &remote, None).unwrap()).unwrap();
    assert_eq!(read(&ra, N * SZ, (N * SZ) as usize), data);
}

/// Notifications arrive after the data landed, with the sender's name; a notification can be
/// sent alone.
pub fn notifications(make: Factory<'_>) {
    with_local_target(make, notifications_with);
}

/// [`notifications`] against any [`Target`].
pub fn notifications_with(a: &Agent, b: &mut dyn Target) {
    let ra = Region::new(1 << 16).unwrap();
    let ga = a.register(&ra).unwrap();
    let gb = b.register(1 << 16);
    let a_to_b = a.add_remote(&b.metadata()).unwrap();
    b.add_remote(&a.metadata());
    let data = pattern(3, 50_000);
    ra.write_at(0, &data).unwrap();
    let t = a_to_b
        .write(
            &[ga.desc(0, 50_000).unwrap()],
            &[RemoteDesc::new(gb, 1000, 50_000)],
            Some(b"batch-7 ready"),
        )
        .unwrap();
    let (from, msg) = b.wait_notification().expect("notification arrives");
    // Read the target's memory as soon as the notification is seen: the data must be there.
    assert_eq!(b.read_at(gb, 1000, 50_000), data);
    assert_eq!(from, a.name());
    assert_eq!(msg, b"batch-7 ready");
    finish(t).unwrap();
    finish(a_to_b.notify(b"just a note").unwrap()).unwrap();
    let (_, msg) = b.wait_notification().expect("bare notification");
    assert_eq!(msg, b"just a note");
    // A READ may carry one too.
    finish(
        a_to_b
            .read(
                &[ga.desc(0, 8).unwrap()],
                &[RemoteDesc::new(gb, 0, 8)],
                Some(b"read"),
            )
            .unwrap(),
    )
    .unwrap();
    assert_eq!(b.wait_notification().unwrap().1, b"read");
    assert!(b.try_notification().is_none());
    let big = vec![0u8; crate::MAX_NOTIFICATION + 1];
    assert!(matches!(
        a_to_b.notify(&big),
        Err(TransferError::NotificationTooLarge { .. })
    ));
}

/// 10,000 contiguous 64-byte views coalesce into one segment; the prepared transfer posts many
/// times and moves the right bytes.
pub fn coalescing_and_prepared(make: Factory<'_>) {
    let a = make("agent-a");
    let b = make("agent-b");
    let ra = Region::new(1 << 20).unwrap();
    let rb = Region::new(1 << 20).unwrap();
    let ga = a.register(&ra).unwrap();
    let gb = b.register(&rb).unwrap();
    let (a_to_b, _) = connect(&a, &b);
    let local: Vec<LocalDesc> = (0..10_000).map(|i| ga.desc(i * 64, 64).unwrap()).collect();
    let remote: Vec<RemoteDesc> = (0..10_000)
        .map(|i| gb.remote(4096 + i * 64, 64).unwrap())
        .collect();
    let prepared = a_to_b.prepare(Op::Write, &local, &remote).unwrap();
    assert_eq!(prepared.plan().segments().len(), 1);
    assert_eq!(prepared.plan().bytes(), 640_000);
    for round in 0..5u64 {
        let data = pattern(10 + round, 640_000);
        ra.write_at(0, &data).unwrap();
        finish(prepared.post(None).unwrap()).unwrap();
        assert_eq!(read(&rb, 4096, 640_000), data);
    }
    // Shuffled order coalesces too.
    let mut idx: Vec<usize> = (0..10_000).collect();
    idx.reverse();
    let l2: Vec<LocalDesc> = idx.iter().map(|&i| local[i].clone()).collect();
    let r2: Vec<RemoteDesc> = idx.iter().map(|&i| remote[i]).collect();
    let p2 = a_to_b.prepare(Op::Read, &l2, &r2).unwrap();
    assert_eq!(p2.plan().segments().len(), 1);
    // Without coalescing the engine sees every pair, and moves the same bytes.
    let p3 = a_to_b.prepare_uncoalesced(Op::Write, &l2, &r2).unwrap();
    assert_eq!(p3.plan().segments().len(), 10_000);
    let data = pattern(99, 640_000);
    ra.write_at(0, &data).unwrap();
    finish(p3.post(None).unwrap()).unwrap();
    assert_eq!(read(&rb, 4096, 640_000), data);
}

/// Remote descriptors outside what the peer announced are refused before a byte moves.
pub fn out_of_range_initiator(make: Factory<'_>) {
    let (a, b, a_to_b, _) = pair(make);
    let ra = Region::new(1 << 16).unwrap();
    let rb = Region::new(1 << 16).unwrap();
    let ga = a.register(&ra).unwrap();
    let gb = b.register(&rb).unwrap();
    let a_to_b = a.add_remote(&b.metadata()).unwrap_or(a_to_b);
    rb.fill(0, 1 << 16, 0xAB).unwrap();
    let local = [ga.desc(0, 100).unwrap()];
    let past_end = [RemoteDesc::new(gb.id(), (1 << 16) - 50, 100)];
    match a_to_b.write(&local, &past_end, None) {
        Err(TransferError::OutOfRange {
            side: Side::Remote,
            index: 0,
            ref peer,
            ..
        }) => assert_eq!(peer, "agent-b"),
        other => panic!("expected out of range, got {other:?}"),
    }
    let wrapping = [RemoteDesc::new(gb.id(), u64::MAX - 10, 100)];
    assert!(matches!(
        a_to_b.read(&local, &wrapping, None),
        Err(TransferError::OutOfRange { .. })
    ));
    let unknown = [RemoteDesc::new(gb.id() + 1_000_000, 0, 100)];
    assert!(matches!(
        a_to_b.write(&local, &unknown, None),
        Err(TransferError::UnknownRegistration { .. })
    ));
    let short = [RemoteDesc::new(gb.id(), 0, 99)];
    assert!(matches!(
        a_to_b.write(&local, &short, None),
        Err(TransferError::Mismatch { .. })
    ));
    assert!(matches!(
        a_to_b.write(&local, &[], None),
        Err(TransferError::Mismatch { .. })
    ));
    // A local descriptor of another agent is refused.
    let gb_local = [gb.desc(0, 100).unwrap()];
    assert!(matches!(
        a_to_b.write(&gb_local, &[gb.remote(0, 100).unwrap()], None),
        Err(TransferError::Mismatch { .. })
    ));
    assert_eq!(read(&rb, 0, 16), vec![0xAB; 16], "nothing moved");
    assert_eq!(a.report().in_flight, 0);
}

/// What a backend's targets check, for [`out_of_range_target_with`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetChecks {
    /// The target's engine sees every request and validates it against its live
    /// registrations (`inproc`, `shm`, `tcp`): forged lengths and dropped registrations are
    /// rejected by the target.
    Requests,
    /// One-sided RMA (`ucx`, `nixl`): the target never sees a request. The remote key, which
    /// the target packed with its registration's true bounds, confines the initiator: forged
    /// lengths in the metadata fail with [`TransferError::OutOfRange`] before anything is
    /// posted, and nothing outside the registration is touched. A key of a registration the
    /// target has since dropped is *not* detected over software transports (tcp, cma), so
    /// that part of the test is not run; on RDMA hardware the NIC refuses it.
    KeyBounds,
}

/// [`out_of_range_target_with`] for engines whose targets see every request.
pub fn out_of_range_target(make: Factory<'_>) {
    out_of_range_target_with(make, TargetChecks::Requests);
}

/// The target validates every request against its live registrations: a peer holding stale
/// or forged metadata is refused, and nothing outside a registration is touched. With
/// [`TargetChecks::KeyBounds`], the keys' bounds refuse forged lengths instead (see there).
pub fn out_of_range_target_with(make: Factory<'_>, checks: TargetChecks) {
    let a = make("agent-a");
    let b = make("agent-b");
    let ra = Region::new(1 << 16).unwrap();
    let rb = Region::new(1 << 17).unwrap();
    let ga = a.register(&ra).unwrap();
    // b registers only the first half of its region; the second half is a canary.
    let gb = b.register_range(&rb, 0, 1 << 16).unwrap();
    rb.fill(0, 1 << 17, 0xCD).unwrap();
    let _ = a.add_remote(&b.metadata()).unwrap();
    // Forge b's metadata: claim its registration is twice as long.
    let mut info = crate::metadata::decode(&b.metadata()).unwrap();
    for r in &mut info.regs {
        r.len *= 2;
    }
    let a_to_b = a.add_remote(&crate::metadata::encode(&info)).unwrap();
    let local = [ga.desc(0, 4096).unwrap()];
    let beyond = [RemoteDesc::new(gb.id(), 1 << 16, 4096)];
    for op in [Op::Write, Op::Read] {
        let t = a_to_b
            .prepare(op, &local, &beyond)
            .unwrap()
            .post(None)
            .unwrap();
        match (checks, finish(t)) {
            (
                TargetChecks::Requests,
                Err(TransferError::Rejected {
                    reason: RejectReason::OutOfRange,
                    ref peer,
                }),
            )
            | (
                TargetChecks::KeyBounds,
                Err(TransferError::OutOfRange {
                    side: Side::Remote,
                    ref peer,
                    ..
                }),
            ) => assert_eq!(peer, "agent-b"),
            (_, other) => panic!("expected a refusal ({checks:?}), got {other:?}"),
        }
    }
    assert_eq!(read(&rb, 1 << 16, 4096), vec![0xCD; 4096], "canary intact");
    if checks == TargetChecks::KeyBounds {
        // The connection still works afterwards.
        let a_to_b = a.add_remote(&b.metadata()).unwrap();
        finish(
            a_to_b
                .write(&local, &[gb.remote(0, 4096).unwrap()], None)
                .unwrap(),
        )
        .unwrap();
        return;
    }
    // A registration the target dropped is refused too, even though a still knows it.
    let gone = b.register(&Region::new(4096).unwrap()).unwrap();
    let a_to_b = a.add_remote(&b.metadata()).unwrap();
    let stale = [gone.remote(0, 4096).unwrap()];
    drop(gone);
    let t = a_to_b.write(&local, &stale, None).unwrap();
    assert!(matches!(
        finish(t),
        Err(TransferError::Rejected {
            reason: RejectReason::UnknownRegistration,
            ..
        })
    ));
    // The connection still works afterwards.
    finish(
        a_to_b
            .write(&local, &[gb.remote(0, 4096).unwrap()], None)
            .unwrap(),
    )
    .unwrap();
}

/// The target dies with transfers in flight: every transfer resolves (done or a peer error,
/// never a hang), later ones fail, and the survivor leaks no registration.
pub fn peer_death(make: Factory<'_>) {
    let a = make("agent-a");
    let b = make("agent-b");
    let len: u64 = 8 << 20;
    let ra = Region::new(len).unwrap();
    let rb = Region::new(len).unwrap();
    let ga = a.register(&ra).unwrap();
    let gb = b.register(&rb).unwrap();
    let (a_to_b, _) = connect(&a, &b);
    let local = [ga.desc(0, len).unwrap()];
    let remote = [gb.remote(0, len).unwrap()];
    let before = a.report();
    let in_flight: Vec<_> = (0..8)
        .map(|i| {
            let op = if i % 2 == 0 { Op::Write } else { Op::Read };
            a_to_b
                .prepare(op, &local, &remote)
                .unwrap()
                .post(None)
                .unwrap()
        })
        .collect();
    drop(gb);
    drop(b);
    for t in in_flight {
        match finish(t) {
            Ok(()) | Err(TransferError::PeerGone { .. }) => {}
            Err(TransferError::Rejected {
                reason: RejectReason::ShuttingDown | RejectReason::UnknownRegistration,
                ..
            }) => {}
            Err(e) => panic!("unexpected error {e}"),
        }
    }
    // Later transfers fail with an error that names the peer.
    let mut failed = None;
    for _ in 0..50 {
        match finish(a_to_b.write(&local, &remote, None).unwrap()) {
            Err(e) => {
                failed = Some(e);
                break;
            }
            Ok(()) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    let e = failed.expect("writes to a dead peer fail");
    assert_eq!(e.peer(), "agent-b");
    assert!(
        matches!(
            e,
            TransferError::PeerGone { .. } | TransferError::Rejected { .. }
        ),
        "{e}"
    );
    assert_eq!(a.report().in_flight, 0);
    assert_eq!(a.report().registrations, before.registrations);
    drop((local, ga, a_to_b));
    assert_eq!(a.report().registrations, 0, "no registration leaked");
}

/// Descriptors above 4 GiB in sparse regions: offsets and lengths are 64-bit throughout.
pub fn sparse_windows_above_4gib(make: Factory<'_>) {
    let (a, b, _, _) = pair(make);
    let len: u64 = (5 << 30) + 4096;
    let ra = Region::new(len).unwrap();
    let rb = Region::new(len).unwrap();
    let ga = a.register(&ra).unwrap();
    let gb = b.register(&rb).unwrap();
    let a_to_b = a.add_remote(&b.metadata()).unwrap();
    let offsets = [(4u64 << 30) + 1, (4 << 30) + (1 << 29), len - 4096];
    for (i, &off) in offsets.iter().enumerate() {
        ra.write_at(off, &pattern(20 + i as u64, 4096)).unwrap();
    }
    let local: Vec<LocalDesc> = offsets.iter().map(|&o| ga.desc(o, 4096).unwrap()).collect();
    let remote: Vec<RemoteDesc> = offsets
        .iter()
        .map(|&o| gb.remote(o - 1, 4096).unwrap())
        .collect();
    finish(a_to_b.write(&local, &remote, None).unwrap()).unwrap();
    for (i, &off) in offsets.iter().enumerate() {
        assert_eq!(read(&rb, off - 1, 4096), pattern(20 + i as u64, 4096));
    }
    // A single descriptor longer than 4 GiB validates and coalesces without truncation.
    let big = (4u64 << 30) + 8192;
    let l = [
        ga.desc(0, big / 2).unwrap(),
        ga.desc(big / 2, big / 2).unwrap(),
    ];
    let r = [
        gb.remote(4096, big / 2).unwrap(),
        gb.remote(4096 + big / 2, big / 2).unwrap(),
    ];
    let p = a_to_b.prepare(Op::Write, &l, &r).unwrap();
    assert_eq!(p.plan().segments().len(), 1);
    assert_eq!(p.plan().segments()[0].len, big);
}

/// One WRITE of more than 4 GiB from sparse private memory into a sparse shared region: 4 GiB
/// of RAM once, and about as many bytes copied.
pub fn big_transfer_over_4gib(make: Factory<'_>) {
    let (a, b, _, _) = pair(make);
    let len: u64 = (4 << 30) + 3 * 4096;
    let src = Region::anonymous(len).unwrap();
    let dst = Region::new(len).unwrap();
    let ga = a.register(&src).unwrap();
    let gb = b.register(&dst).unwrap();
    let a_to_b = a.add_remote(&b.metadata()).unwrap();
    let marks = [7u64, (1 << 32) - 3, (1 << 32) + 5, len - 9];
    for (i, &m) in marks.iter().enumerate() {
        src.write_at(m, &[i as u8 + 1; 4]).unwrap();
    }
    dst.write_at(1 << 31, b"gone").unwrap();
    let t = a_to_b
        .write(
            &[ga.desc(0, len).unwrap()],
            &[gb.remote(0, len).unwrap()],
            Some(b"big"),
        )
        .unwrap();
    finish(t).unwrap();
    for (i, &m) in marks.iter().enumerate() {
        assert_eq!(read(&dst, m, 4), vec![i as u8 + 1; 4], "mark at {m}");
    }
    assert_eq!(read(&dst, 1 << 31, 4), vec![0; 4], "overwritten");
    assert_eq!(b.wait_notification(HANG_GUARD).unwrap().msg, b"big");
}

/// Several threads transfer on the same peer at once, each to its own range.
pub fn concurrent_threads(make: Factory<'_>) {
    with_local_target(make, concurrent_threads_with);
}

/// [`concurrent_threads`] against any [`Target`].
pub fn concurrent_threads_with(a: &Agent, b: &mut dyn Target) {
    const T: u64 = 4;
    const CHUNK: u64 = 64 * 1024;
    let a_to_b = a.add_remote(&b.metadata()).unwrap();
    b.add_remote(&a.metadata());
    let ra = Region::new(T * CHUNK * 2).unwrap();
    let ga = a.register(&ra).unwrap();
    let gb = b.register(T * CHUNK);
    let a_to_b = a.add_remote(&b.metadata()).unwrap_or(a_to_b);
    std::thread::scope(|s| {
        for t in 0..T {
            let (ga, ra, a_to_b) = (ga.clone(), ra.clone(), a_to_b.clone());
            s.spawn(move || {
                for round in 0..20u64 {
                    let data = pattern(100 + t * 1000 + round, CHUNK as usize);
                    ra.write_at(t * CHUNK, &data).unwrap();
                    let l = [ga.desc(t * CHUNK, CHUNK).unwrap()];
                    let r = [RemoteDesc::new(gb, t * CHUNK, CHUNK)];
                    finish(a_to_b.write(&l, &r, None).unwrap()).unwrap();
                    let back = [ga.desc((T + t) * CHUNK, CHUNK).unwrap()];
                    finish(a_to_b.read(&back, &r, None).unwrap()).unwrap();
                    assert_eq!(read(&ra, (T + t) * CHUNK, CHUNK as usize), data);
                }
            });
        }
    });
    assert_eq!(a.report().in_flight, 0);
}

/// Several tokio tasks await transfers (the `Future` side of [`crate::Transfer`]).
pub fn concurrent_tasks(make: Factory<'_>) {
    let (a, b, _, _) = pair(make);
    const T: u64 = 8;
    const CHUNK: u64 = 16 * 1024;
    let ra = Region::new(T * CHUNK).unwrap();
    let rb = Region::new(T * CHUNK).unwrap();
    let ga = a.register(&ra).unwrap();
    let gb = b.register(&rb).unwrap();
    let a_to_b = a.add_remote(&b.metadata()).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut tasks = Vec::new();
        for t in 0..T {
            let (ga, gb, ra, a_to_b) = (ga.clone(), gb.clone(), ra.clone(), a_to_b.clone());
            tasks.push(tokio::spawn(async move {
                for round in 0..10u64 {
                    let data = pattern(7000 + t * 100 + round, CHUNK as usize);
                    ra.write_at(t * CHUNK, &data).unwrap();
                    let l = [ga.desc(t * CHUNK, CHUNK).unwrap()];
                    let r = [gb.remote(t * CHUNK, CHUNK).unwrap()];
                    let xfer = a_to_b.write(&l, &r, None).unwrap();
                    tokio::time::timeout(HANG_GUARD, xfer)
                        .await
                        .expect("no hang")
                        .unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    });
    for t in 0..T {
        assert_eq!(
            read(&rb, t * CHUNK, CHUNK as usize),
            pattern(7000 + t * 100 + 9, CHUNK as usize)
        );
    }
    drop(b);
}

/// Registrations of a part of a region, on both sides: offsets are relative to the
/// registration, and nothing outside it is touched.
pub fn sub_range_registrations(make: Factory<'_>) {
    let (a, b, _, _) = pair(make);
    let ra = Region::new(64 * 1024).unwrap();
    let rb = Region::new(64 * 1024).unwrap();
    rb.fill(0, 64 * 1024, 0xEE).unwrap();
    let ga = a.register_range(&ra, 12_288, 8192).unwrap();
    let gb = b.register_range(&rb, 20_480, 8192).unwrap();
    let a_to_b = a.add_remote(&b.metadata()).unwrap();
    ra.write_at(12_288 + 100, &pattern(31, 5000)).unwrap();
    finish(
        a_to_b
            .write(
                &[ga.desc(100, 5000).unwrap()],
                &[gb.remote(3000, 5000).unwrap()],
                None,
            )
            .unwrap(),
    )
    .unwrap();
    assert_eq!(read(&rb, 20_480 + 3000, 5000), pattern(31, 5000));
    assert_eq!(read(&rb, 20_480 + 2999, 1), vec![0xEE]);
    assert_eq!(read(&rb, 20_480 + 8000, 1), vec![0xEE]);
    // A window the cache answered from a larger registration.
    let inner = b.register_range(&rb, 20_480 + 4096, 1024).unwrap();
    assert_eq!(inner.id(), gb.id());
    finish(
        a_to_b
            .read(
                &[ga.desc(0, 1024).unwrap()],
                &[inner.remote(0, 1024).unwrap()],
                None,
            )
            .unwrap(),
    )
    .unwrap();
    assert_eq!(read(&ra, 12_288, 1024), read(&rb, 20_480 + 4096, 1024));
    // The last byte is reachable; one past it is not.
    assert!(gb.remote(8191, 1).is_ok());
    assert!(gb.remote(8191, 2).is_err());
    assert!(matches!(
        a_to_b.write(
            &[ga.desc(0, 2).unwrap()],
            &[RemoteDesc::new(gb.id(), 8191, 2)],
            None
        ),
        Err(TransferError::OutOfRange { .. })
    ));
}

/// Both agents write and read large payloads to and from each other at the same time, so
/// payloads cross on whatever connections the engine uses; nothing deadlocks and every byte
/// arrives.
pub fn crossing_transfers(make: Factory<'_>) {
    const LEN: u64 = 8 << 20;
    let (a, b, a_to_b, b_to_a) = pair(make);
    let ra = Region::new(3 * LEN).unwrap();
    let rb = Region::new(3 * LEN).unwrap();
    let ga = a.register(&ra).unwrap();
    let gb = b.register(&rb).unwrap();
    let a_to_b = a.add_remote(&b.metadata()).unwrap_or(a_to_b);
    let b_to_a = b.add_remote(&a.metadata()).unwrap_or(b_to_a);
    ra.write_at(0, &pattern(51, LEN as usize)).unwrap();
    rb.write_at(0, &pattern(52, LEN as usize)).unwrap();
    let mut transfers = Vec::new();
    for _ in 0..4 {
        // a's [0, LEN) -> b's [LEN, 2 LEN) and b's [0, LEN) -> a's [LEN, 2 LEN), while each
        // also reads the other's [0, LEN) into its [2 LEN, 3 LEN).
        transfers.push(
            a_to_b
                .write(
                    &[ga.desc(0, LEN).unwrap()],
                    &[gb.remote(LEN, LEN).unwrap()],
                    None,
                )
                .unwrap(),
        );
        transfers.push(
            b_to_a
                .write(
                    &[gb.desc(0, LEN).unwrap()],
                    &[ga.remote(LEN, LEN).unwrap()],
                    None,
                )
                .unwrap(),
        );
        transfers.push(
            a_to_b
                .read(
                    &[ga.desc(2 * LEN, LEN).unwrap()],
                    &[gb.remote(0, LEN).unwrap()],
                    None,
                )
                .unwrap(),
        );
        transfers.push(
            b_to_a
                .read(
                    &[gb.desc(2 * LEN, LEN).unwrap()],
                    &[ga.remote(0, LEN).unwrap()],
                    None,
                )
                .unwrap(),
        );
    }
    for t in transfers {
        finish(t).unwrap();
    }
    assert!(read(&rb, LEN, LEN as usize) == pattern(51, LEN as usize));
    assert!(read(&ra, LEN, LEN as usize) == pattern(52, LEN as usize));
    assert!(read(&ra, 2 * LEN, LEN as usize) == pattern(52, LEN as usize));
    assert!(read(&rb, 2 * LEN, LEN as usize) == pattern(51, LEN as usize));
}

/// A peer that died and came back under the same name is reached again through the same
/// handle once its new metadata is added.
pub fn restarted_peer(make: Factory<'_>) {
    let a = make("agent-a");
    let ra = Region::new(4096).unwrap();
    let ga = a.register(&ra).unwrap();
    ra.write_at(0, &pattern(41, 4096)).unwrap();
    let b = make("agent-b");
    let rb = Region::new(4096).unwrap();
    let gb = b.register(&rb).unwrap();
    let a_to_b = a.add_remote(&b.metadata()).unwrap();
    let local = [ga.desc(0, 4096).unwrap()];
    finish(
        a_to_b
            .write(&local, &[gb.remote(0, 4096).unwrap()], None)
            .unwrap(),
    )
    .unwrap();
    drop((gb, b));
    let mut failed = false;
    for _ in 0..50 {
        match a_to_b.notify(b"anyone?").map(finish) {
            Ok(Ok(())) => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                failed = true;
                break;
            }
        }
    }
    assert!(failed, "a dead peer is reported");
    let b2 = make("agent-b");
    let rb2 = Region::new(4096).unwrap();
    let gb2 = b2.register(&rb2).unwrap();
    let again = a.add_remote(&b2.metadata()).unwrap();
    assert_eq!(again.name(), "agent-b");
    finish(
        a_to_b
            .write(&local, &[gb2.remote(0, 4096).unwrap()], Some(b"back"))
            .unwrap(),
    )
    .unwrap();
    assert_eq!(read(&rb2, 0, 4096), pattern(41, 4096));
    assert_eq!(b2.wait_notification(HANG_GUARD).unwrap().msg, b"back");
}

/// New metadata from a known peer replaces the old on the same handle.
pub fn metadata_update(make: Factory<'_>) {
    with_local_target(make, metadata_update_with);
}

/// [`metadata_update`] against any [`Target`].
pub fn metadata_update_with(a: &Agent, b: &mut dyn Target) {
    let a_to_b = a.add_remote(&b.metadata()).unwrap();
    b.add_remote(&a.metadata());
    let ra = Region::new(4096).unwrap();
    let ga = a.register(&ra).unwrap();
    let gb = b.register(4096);
    let l = [ga.desc(0, 64).unwrap()];
    let r = [RemoteDesc::new(gb, 0, 64)];
    assert!(matches!(
        a_to_b.write(&l, &r, None),
        Err(TransferError::UnknownRegistration { .. })
    ));
    let again = a.add_remote(&b.metadata()).unwrap();
    assert_eq!(again.name(), a_to_b.name());
    assert_eq!(a_to_b.registration_len(gb), Some(4096));
    ra.write_at(0, &pattern(5, 64)).unwrap();
    finish(a_to_b.write(&l, &r, None).unwrap()).unwrap();
    assert_eq!(b.read_at(gb, 0, 64), pattern(5, 64));
    assert_eq!(a.report().peers, 1);
    let mismatch = Agent::new("other-kind", crate::Inproc::new()).unwrap();
    if a.kind() != "inproc" {
        assert!(matches!(
            a.add_remote(&mismatch.metadata()),
            Err(crate::ConnectError::BackendMismatch { .. })
        ));
    }
    assert!(a.add_remote(&a.metadata()).is_err());
    assert!(a.add_remote(b"garbage").is_err());
}

/// The target drops its handle on the initiator (as `pair(..)` callers that ignore it do)
/// while the initiator keeps writing: every write still lands. (UCX pairs the two agents'
/// endpoints into one connection; closing the target's tore down the initiator's.)
pub fn target_drops_its_handle(make: Factory<'_>) {
    let (a, b, a_to_b, b_to_a) = pair(make);
    let ra = Region::new(64 * 1024).unwrap();
    let rb = Region::new(64 * 1024).unwrap();
    let ga = a.register(&ra).unwrap();
    let gb = b.register(&rb).unwrap();
    let a_to_b = a.add_remote(&b.metadata()).unwrap_or(a_to_b);
    drop(b_to_a);
    for round in 0..50u64 {
        let len = 64 + (round % 5) * 4096;
        let data = pattern(300 + round, len as usize);
        ra.write_at(0, &data).unwrap();
        finish(
            a_to_b
                .write(
                    &[ga.desc(0, len).unwrap()],
                    &[gb.remote(0, len).unwrap()],
                    None,
                )
                .unwrap(),
        )
        .unwrap_or_else(|e| panic!("write {round}: {e}"));
        assert_eq!(read(&rb, 0, len as usize), data, "write {round} landed");
    }
}

/// Re-registering is a cache hit; a pool block, its descriptor and a prepared transfer keep
/// the block leased and the memory registered until the last of them is gone.
pub fn registration_cache_and_deferred_release(make: Factory<'_>) {
    let (a, b, _, _) = pair(make);
    let region = Region::new(1 << 20).unwrap();
    let g1 = a.register(&region).unwrap();
    let g2 = a.register(&region).unwrap();
    let g3 = a.register_range(&region, 4096, 4096).unwrap();
    assert_eq!(g1.id(), g2.id());
    assert_eq!(g1.id(), g3.id());
    assert_eq!(a.report().registrations, 1);
    drop((g1, g2, g3));
    assert_eq!(a.report().registrations, 0);

    let pool = RegisteredPool::new(&a, 1 << 20).unwrap();
    let rb = Region::new(1 << 20).unwrap();
    let gb = b.register(&rb).unwrap();
    let a_to_b = a.add_remote(&b.metadata()).unwrap();
    let block = pool.lease(5000, 64).unwrap();
    block.write_at(0, &pattern(9, 5000)).unwrap();
    let prepared = a_to_b
        .prepare(
            Op::Write,
            &[block.desc().unwrap()],
            &[gb.remote(0, 5000).unwrap()],
        )
        .unwrap();
    drop(block);
    assert!(
        pool.report().used >= 5000,
        "the prepared transfer keeps the block"
    );
    finish(prepared.post(None).unwrap()).unwrap();
    assert_eq!(read(&rb, 0, 5000), pattern(9, 5000));
    drop(prepared);
    assert_eq!(pool.report().used, 0);
    let reg_id = pool.registration().id();
    drop(pool);
    assert_eq!(
        a.report().registrations,
        0,
        "registration {reg_id} released"
    );
}

/// [`Agent::register_local`]. Where the engine needs no local registration, the registration is
/// local-only: it is the source of a WRITE and the destination of a READ, it is absent from
/// the agent's metadata and report and from lookups by address, a peer naming its id (with
/// forged metadata) is refused as an unknown registration and touches nothing, and dropping
/// it while a transfer using it is in flight is safe. Where the engine needs one, it is a
/// normal registration, listed like any other.
pub fn local_only_registrations(make: Factory<'_>) {
    let (a, b, a_to_b, _) = pair(make);
    let rb = Region::new(8 << 20).unwrap();
    let gb = b.register(&rb).unwrap();
    let a_to_b = a.add_remote(&b.metadata()).unwrap_or(a_to_b);
    let before = a.report();
    let listed = |id: u64| {
        crate::metadata::decode(&a.metadata())
            .unwrap()
            .regs
            .iter()
            .any(|r| r.id == id)
    };
    let local_only = !a.local_side_needs_registration();

    let n = 20_000usize;
    let ra = Region::new(1 << 16).unwrap();
    ra.write_at(0, &pattern(70, n)).unwrap();
    let la = a.register_local(&ra).unwrap();
    let report = a.report();
    if local_only {
        assert_eq!(report.registrations, before.registrations, "never listed");
        assert_eq!(report.registered_bytes, before.registered_bytes);
        assert!(!listed(la.id()), "absent from the metadata");
        assert!(a.find_registered(ra.as_ptr(), 10).is_none());
    } else {
        assert_eq!(report.registrations, before.registrations + 1);
        assert!(listed(la.id()), "a normal registration");
        assert_eq!(a.find_registered(ra.as_ptr(), 10).unwrap().id(), la.id());
    }

    // The source of a WRITE and the destination of a READ.
    finish(
        a_to_b
            .write(
                &[la.desc(0, n as u64).unwrap()],
                &[gb.remote(1000, n as u64).unwrap()],
                None,
            )
            .unwrap(),
    )
    .unwrap();
    assert_eq!(read(&rb, 1000, n), pattern(70, n));
    rb.write_at(200_000, &pattern(71, n)).unwrap();
    finish(
        a_to_b
            .read(
                &[la.desc(30_000, n as u64).unwrap()],
                &[gb.remote(200_000, n as u64).unwrap()],
                None,
            )
            .unwrap(),
    )
    .unwrap();
    assert_eq!(read(&ra, 30_000, n), pattern(71, n));

    if local_only {
        // A peer that names it anyway (forged metadata) is refused, both ways, and the
        // memory is untouched.
        let mut info = crate::metadata::decode(&a.metadata()).unwrap();
        info.regs.push(crate::engine::RemoteReg {
            id: la.id(),
            len: ra.len(),
            key: Vec::new(),
        });
        let b_to_a = b.add_remote(&crate::metadata::encode(&info)).unwrap();
        let gb_desc = [gb.desc(0, 4096).unwrap()];
        let forged = [RemoteDesc::new(la.id(), 0, 4096)];
        for op in [Op::Write, Op::Read] {
            let t = b_to_a.prepare(op, &gb_desc, &forged).unwrap();
            match finish(t.post(None).unwrap()) {
                Err(TransferError::Rejected {
                    reason: RejectReason::UnknownRegistration,
                    ref peer,
                }) => assert_eq!(peer, "agent-a"),
                other => panic!("{op:?} naming a local-only registration: {other:?}"),
            }
        }
        assert_eq!(read(&ra, 0, 4096), pattern(70, 4096), "untouched");
    }

    // Dropped, with its region, while a WRITE from it is in flight: the plan keeps it.
    let len = 8usize << 20;
    let big = Region::new(len as u64).unwrap();
    big.write_at(0, &pattern(72, len)).unwrap();
    let lbig = a.register_local(&big).unwrap();
    let t = a_to_b
        .write(
            &[lbig.desc(0, len as u64).unwrap()],
            &[gb.remote(0, len as u64).unwrap()],
            None,
        )
        .unwrap();
    drop((lbig, big, la, ra));
    finish(t).unwrap();
    assert_eq!(read(&rb, 0, len), pattern(72, len));
    let after = a.report();
    assert_eq!(after.registrations, before.registrations);
    assert_eq!(after.registered_bytes, before.registered_bytes);
    assert_eq!(after.in_flight, 0);
}
