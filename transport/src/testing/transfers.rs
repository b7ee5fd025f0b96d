//! Conformance cases about moving bytes: round trips, copies, scatter-gather, notifications, coalescing, bounds on both sides, peer death, large and concurrent transfers.

use std::time::Duration;

use crate::{
    Agent, LocalDesc, Op, Prepared, Region, RejectReason, RemoteDesc, Side, Status, TransferError,
};

use super::*;

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

/// A WRITE and a READ of 9 MiB and some bytes at offsets off any alignment, each one segment
/// (engines may copy segments this large by other means than small ones): every byte lands,
/// none beside.
pub fn large_unaligned(make: Factory<'_>) {
    let (a, b, a_to_b, _b_to_a) = pair(make);
    const LEN: usize = (9 << 20) + 123;
    let ra = Region::new(24 << 20).unwrap();
    let rb = Region::new(16 << 20).unwrap();
    let ga = a.register(&ra).unwrap();
    let gb = b.register(&rb).unwrap();
    let a_to_b = a.add_remote(&b.metadata()).unwrap_or(a_to_b);
    let data = pattern(7, LEN);
    let n = LEN as u64;
    ra.write_at(3, &data).unwrap();
    let t = a_to_b
        .write(
            &[ga.desc(3, n).unwrap()],
            &[RemoteDesc::new(gb.id(), 61, n)],
            None,
        )
        .unwrap();
    finish(t).unwrap();
    assert!(read(&rb, 61, LEN) == data, "the WRITE landed whole");
    assert_eq!(read(&rb, 0, 61), vec![0; 61], "nothing before the WRITE");
    assert_eq!(read(&rb, 61 + n, 7), vec![0; 7], "nothing after the WRITE");
    let at = (12 << 20) + 1;
    let t = a_to_b
        .read(
            &[ga.desc(at, n).unwrap()],
            &[RemoteDesc::new(gb.id(), 61, n)],
            None,
        )
        .unwrap();
    finish(t).unwrap();
    assert!(read(&ra, at, LEN) == data, "the READ landed whole");
    assert_eq!(read(&ra, at - 5, 5), vec![0; 5], "nothing before the READ");
    assert_eq!(read(&ra, at + n, 5), vec![0; 5], "nothing after the READ");
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

/// One WRITE and one READ whose segments alternate between two registrations on each side:
/// every segment lands in, and comes back from, its own registration.
pub fn across_registrations(make: Factory<'_>) {
    with_local_target(make, across_registrations_with);
}

/// [`across_registrations`] against any [`Target`].
pub fn across_registrations_with(a: &Agent, b: &mut dyn Target) {
    const SZ: u64 = 4096;
    let a_to_b = a.add_remote(&b.metadata()).unwrap();
    b.add_remote(&a.metadata());
    let (r1, r2) = (Region::new(8 * SZ).unwrap(), Region::new(8 * SZ).unwrap());
    let (g1, g2) = (a.register(&r1).unwrap(), a.register(&r2).unwrap());
    let (t1, t2) = (b.register(8 * SZ), b.register(8 * SZ));
    let a_to_b = a.add_remote(&b.metadata()).unwrap_or(a_to_b);
    let data = pattern(5, (8 * SZ) as usize);
    r1.write_at(0, &data[..(4 * SZ) as usize]).unwrap();
    r2.write_at(0, &data[(4 * SZ) as usize..]).unwrap();
    // Segment i: from local registration i % 2, to remote registration (i / 2) % 2, at
    // offsets that differ on both sides.
    let (locals, remotes): (Vec<LocalDesc>, Vec<RemoteDesc>) = (0..8u64)
        .map(|i| {
            let local = if i % 2 == 0 { &g1 } else { &g2 };
            let remote = if (i / 2) % 2 == 0 { t1 } else { t2 };
            (
                local.desc((i / 2) * SZ, SZ).unwrap(),
                RemoteDesc::new(remote, (7 - i) * SZ, SZ),
            )
        })
        .unzip();
    finish(a_to_b.write(&locals, &remotes, None).unwrap()).unwrap();
    for (i, l) in locals.iter().enumerate() {
        let at = (l.offset() as usize) + if i % 2 == 0 { 0 } else { (4 * SZ) as usize };
        let r = &remotes[i];
        assert_eq!(
            b.read_at(r.reg, r.offset, SZ),
            &data[at..at + SZ as usize],
            "segment {i} in the target's registration {}",
            r.reg
        );
    }
    // Back into fresh local registrations, the same way round.
    let (b1, b2) = (Region::new(8 * SZ).unwrap(), Region::new(8 * SZ).unwrap());
    let (h1, h2) = (a.register(&b1).unwrap(), a.register(&b2).unwrap());
    let backs: Vec<LocalDesc> = (0..8u64)
        .map(|i| {
            let local = if i % 2 == 0 { &h1 } else { &h2 };
            local.desc((i / 2) * SZ, SZ).unwrap()
        })
        .collect();
    finish(a_to_b.read(&backs, &remotes, None).unwrap()).unwrap();
    assert_eq!(read(&b1, 0, (4 * SZ) as usize), data[..(4 * SZ) as usize]);
    assert_eq!(read(&b2, 0, (4 * SZ) as usize), data[(4 * SZ) as usize..]);
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

/// A WRITE from memory that is not registered ([`crate::Peer::write_unregistered`]). Where
/// the engine reaches local memory by address, every source lands, sources contiguous in
/// memory and at the peer travel as one segment, the remote side is checked as for any
/// WRITE, and the sources' owner is held until the engine is done, then let go. Where the
/// engine reads only registered memory, the WRITE is refused before a byte moves and the
/// owner let go at once.
pub fn unregistered_sources(make: Factory<'_>) {
    use tessera_sync::Arc;
    let (a, b, _, _) = pair(make);
    let rb = Region::new(1 << 20).unwrap();
    let gb = b.register(&rb).unwrap();
    let a_to_b = a.add_remote(&b.metadata()).unwrap();
    // 100 sources of 64 bytes in a row in one buffer, then 200 buffers of their own.
    let row = pattern(3, 100 * 64);
    let apart: Vec<Vec<u8>> = (0..200u64)
        .map(|i| pattern(100 + i, 1000 + i as usize))
        .collect();
    let mut sources: Vec<(*const u8, u64)> =
        (0..100).map(|i| (row[i * 64..].as_ptr(), 64)).collect();
    sources.extend(apart.iter().map(|v| (v.as_ptr(), v.len() as u64)));
    let mut expected = row.clone();
    for v in &apart {
        expected.extend_from_slice(v);
    }
    let mut at = 4096;
    let remote: Vec<RemoteDesc> = sources
        .iter()
        .map(|&(_, len)| {
            let d = RemoteDesc::new(gb.id(), at, len);
            at += len;
            d
        })
        .collect();
    let owner = Arc::new((row, apart));
    let held = Arc::downgrade(&owner);
    let let_go = |what: &str| {
        let t = std::time::Instant::now();
        while held.upgrade().is_some() {
            assert!(
                t.elapsed() < hang_guard(),
                "{what}: the sources' owner is still held"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    // SAFETY: every source lies in `owner`'s buffers, which nobody writes, and the transfer
    // holds `owner` until the engine is done with them.
    let posted = unsafe { a_to_b.write_unregistered(&sources, &remote, owner, None) };
    if a.local_side_needs_registration() {
        assert!(
            matches!(&posted, Err(TransferError::Mismatch { detail, .. }) if detail.contains("registered")),
            "{posted:?}"
        );
        let_go("refused");
        assert_eq!(read(&rb, 0, 1 << 20), vec![0u8; 1 << 20]);
        return;
    }
    finish(posted.unwrap()).unwrap();
    assert_eq!(read(&rb, 4096, expected.len()), expected);
    assert_eq!(read(&rb, 0, 4096), vec![0u8; 4096], "nothing before");
    let_go("done");
    // The plan: the row is one segment, each buffer of its own another.
    let owner = Arc::new(expected.clone());
    let one: Vec<(*const u8, u64)> = vec![(owner.as_ptr(), 64), (owner[64..].as_ptr(), 64)];
    let two = [
        RemoteDesc::new(gb.id(), 0, 64),
        RemoteDesc::new(gb.id(), 64, 64),
    ];
    // SAFETY: as above, `owner` being the buffer.
    let p =
        unsafe { Prepared::unregistered(a_to_b.core.clone(), &one, &two, owner.clone()) }.unwrap();
    assert_eq!(p.plan().segments().len(), 1);
    drop(p);
    // Checked as any WRITE: lengths pairwise, the peer's registrations and their bounds.
    let cases = [
        (RemoteDesc::new(gb.id(), 0, 65), "length"),
        (RemoteDesc::new(gb.id() ^ 1, 0, 64), "registration"),
        (RemoteDesc::new(gb.id(), (1 << 20) - 32, 64), "range"),
    ];
    for (bad, what) in cases {
        // SAFETY: as above.
        let r = unsafe { a_to_b.write_unregistered(&one[..1], &[bad], owner.clone(), None) };
        match (what, r) {
            ("length", Err(TransferError::Mismatch { .. }))
            | ("registration", Err(TransferError::UnknownRegistration { .. }))
            | ("range", Err(TransferError::OutOfRange { .. })) => {}
            (what, r) => panic!("{what}: {r:?}"),
        }
    }
    // SAFETY: as above (no byte is read).
    let empty = unsafe {
        a_to_b.write_unregistered(
            &[(owner.as_ptr(), 0)],
            &[RemoteDesc::new(gb.id(), 0, 0)],
            owner.clone(),
            None,
        )
    };
    assert!(
        matches!(empty, Err(TransferError::OutOfRange { .. })),
        "an empty pair: {empty:?}"
    );
    assert_eq!(
        read(&rb, 0, 4096),
        vec![0u8; 4096],
        "nothing written by a refused WRITE"
    );
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
    // A descriptor is checked against its own registration, not the one before it.
    let rb2 = Region::new(1 << 12).unwrap();
    let gb2 = b.register(&rb2).unwrap();
    let a_to_b = a.add_remote(&b.metadata()).unwrap();
    let two = [ga.desc(0, 100).unwrap(), ga.desc(100, 100).unwrap()];
    let past_second = [
        gb.remote(0, 100).unwrap(),
        RemoteDesc::new(gb2.id(), 4050, 100),
    ];
    assert!(
        matches!(
            a_to_b.write(&two, &past_second, None),
            Err(TransferError::OutOfRange { index: 1, reg, .. }) if reg == gb2.id()
        ),
        "the second descriptor lies past its own, smaller, registration"
    );
    let then_unknown = [gb.remote(0, 100).unwrap(), unknown[0]];
    assert!(matches!(
        a_to_b.write(&two, &then_unknown, None),
        Err(TransferError::UnknownRegistration { index: 1, .. })
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
    assert_eq!(b.wait_notification(hang_guard()).unwrap().msg, b"big");
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
                    tokio::time::timeout(hang_guard(), xfer)
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
