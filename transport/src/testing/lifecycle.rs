//! Conformance cases about registrations and peers over time: sub-ranges, crossing transfers, restarts, metadata updates, dropped handles, the registration cache, local-only registrations.

use std::time::Duration;

use crate::{Agent, Op, Region, RegisteredPool, RejectReason, RemoteDesc, TransferError};

use super::*;

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
    assert_eq!(b2.wait_notification(hang_guard()).unwrap().msg, b"back");
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
