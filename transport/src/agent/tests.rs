//! Unit and loom tests of agents, registrations and peers.

use super::*;
use crate::engine::{Connection, Grant, Xfer};
use crate::error::BackendError;
use crate::{RejectReason, RemoteDesc, TransferError};
use tessera_sync::{model, thread};

/// The transfer's outcome: under loom once it completes, otherwise within [`crate::TEST_WAIT`],
/// so that a transfer that never completes fails its test instead of hanging the binary.
fn outcome(t: crate::Transfer) -> Result<(), TransferError> {
    #[cfg(tessera_loom)]
    return t.wait();
    #[cfg(not(tessera_loom))]
    t.wait_timeout(crate::TEST_WAIT)
}

/// An engine that counts registrations and parks posted transfers for the test to
/// complete from another thread.
#[derive(Default)]
struct Counting {
    live: Mutex<i64>,
    parked: Arc<Mutex<Vec<Xfer>>>,
    host: Mutex<Option<Host>>,
    /// Its local side needs no registration (as `inproc`, `shm` and `tcp`).
    by_address: bool,
}

impl Transport for Arc<Counting> {
    fn kind(&self) -> &'static str {
        "counting"
    }
    fn start(&self, host: Host) -> Result<(), BackendError> {
        *self.host.lock() = Some(host);
        Ok(())
    }
    fn register(&self, _: &RegInfo<'_>) -> Result<Vec<u8>, RegisterError> {
        *self.live.lock() += 1;
        Ok(Vec::new())
    }
    fn deregister(&self, _: u64) {
        *self.live.lock() -= 1;
    }
    fn address(&self) -> Vec<u8> {
        Vec::new()
    }
    fn connect(&self, _: &PeerInfo) -> Result<Arc<dyn Connection>, BackendError> {
        Ok(Arc::new(Parking(self.parked.clone())))
    }
    fn local_side_needs_registration(&self) -> bool {
        !self.by_address
    }
    fn tracks_links(&self) -> bool {
        true
    }
    fn shutdown(&self) {}
}

struct Parking(Arc<Mutex<Vec<Xfer>>>);
impl Connection for Parking {
    fn post(&self, xfer: Xfer) {
        self.0.lock().push(xfer);
    }
}

#[test]
fn cache_answers_sub_ranges_and_refcounts() {
    let engine = Arc::new(Counting::default());
    let agent = Agent::new("a", engine.clone()).unwrap();
    let region = Region::anonymous(1 << 16).unwrap();
    let whole = agent.register(&region).unwrap();
    let part = agent.register_range(&region, 4096, 100).unwrap();
    assert_eq!(part.id(), whole.id());
    assert_eq!(part.offset_in_registration(), 4096);
    assert_eq!(
        part.remote(10, 5).unwrap(),
        RemoteDesc::new(whole.id(), 4106, 5)
    );
    assert!(part.desc(0, 101).is_err());
    assert!(part.desc(0, 0).is_err());
    assert_eq!(*engine.live.lock(), 1);
    let desc = whole.desc(0, 10).unwrap();
    drop((whole, part));
    assert_eq!(agent.report().registrations, 1, "the descriptor keeps it");
    drop(desc);
    assert_eq!(agent.report().registrations, 0);
    assert_eq!(*engine.live.lock(), 0);
    let other = Region::anonymous(100).unwrap();
    assert!(agent.register_range(&other, 50, 51).is_err());
}

/// The copy slice an agent sets is the one its engine's copies use, never below the floor.
#[test]
fn the_copy_slice_reaches_the_engine_and_has_a_floor() {
    let engine = Arc::new(Counting::default());
    let agent = Agent::new("a", engine.clone()).unwrap();
    let host = engine.host.lock().clone().unwrap();
    assert_eq!(agent.copy_slice(), crate::copy::SLICE);
    assert_eq!(host.copy_slice(), crate::copy::SLICE);
    agent.set_copy_slice(1 << 20);
    assert_eq!(host.copy_slice(), 1 << 20);
    agent.set_copy_slice(1);
    assert_eq!(host.copy_slice(), crate::copy::MIN_SLICE);
    assert_eq!(agent.copy_slice(), crate::copy::MIN_SLICE);
}

/// A sub-range's descriptors name the registration's bytes: offsets are relative to the
/// registration, windows end exactly at the sub-range's end, and the address is the byte's.
#[test]
fn sub_range_descriptors_name_the_registrations_bytes() {
    let agent = Agent::new("a", Arc::new(Counting::default())).unwrap();
    let region = Region::anonymous(1 << 16).unwrap();
    let _whole = agent.register(&region).unwrap();
    let part = agent.register_range(&region, 4096, 100).unwrap();
    assert_eq!(part.offset_in_registration(), 4096);
    let d = part.desc(10, 90).unwrap();
    assert_eq!((d.reg(), d.offset(), d.len()), (part.id(), 4106, 90));
    assert!(!d.is_empty());
    assert_eq!(d.to_remote(), RemoteDesc::new(part.id(), 4106, 90));
    assert_eq!(d.as_ptr(), region.as_ptr().wrapping_add(4106));
    assert_eq!(part.desc(99, 1).unwrap().offset(), 4195);
    assert!(part.desc(99, 2).is_err());
    assert!(part.desc(u64::MAX, 2).is_err());
    assert!(part.remote(100, 1).is_err());
    assert_eq!(
        format!("{d:?}"),
        format!("LocalDesc {{ reg: {}, offset: 4106, len: 90 }}", part.id())
    );
}

/// An engine that keeps the default (its local side needs registering) gets a normal
/// registration from `register_local`: the engine is asked, the registry lists it, and
/// the last guard deregisters it.
#[test]
fn register_local_falls_back_where_the_engine_needs_it() {
    let engine = Arc::new(Counting::default());
    let agent = Agent::new("a", engine.clone()).unwrap();
    assert!(agent.local_side_needs_registration());
    let region = Region::anonymous(4096).unwrap();
    let reg = agent.register_local(&region).unwrap();
    assert_eq!(*engine.live.lock(), 1);
    assert_eq!(agent.report().registrations, 1);
    let found = agent.find_registered(region.as_ptr(), 4096).unwrap();
    assert_eq!(found.id(), reg.id());
    drop((reg, found));
    assert_eq!(*engine.live.lock(), 0);
    assert_eq!(agent.report().registrations, 0);
}

#[test]
fn registered_memory_is_found_by_address() {
    let agent = Agent::new("a", Arc::new(Counting::default())).unwrap();
    let region = Region::anonymous(1 << 16).unwrap();
    let other = Region::anonymous(4096).unwrap();
    let reg = agent.register_range(&region, 4096, 8192).unwrap();
    let inside = region.as_ptr().wrapping_add(5000);
    let found = agent.find_registered(inside, 100).unwrap();
    assert_eq!(found.id(), reg.id());
    assert_eq!(found.offset_in_registration(), 5000 - 4096);
    assert_eq!(found.desc(0, 100).unwrap().as_ptr(), inside);
    assert!(found.desc(0, 101).is_err());
    assert!(
        agent.find_registered(inside, 8192).is_none(),
        "runs past the end"
    );
    assert!(
        agent.find_registered(region.as_ptr(), 10).is_none(),
        "before the start"
    );
    assert!(agent.find_registered(other.as_ptr(), 10).is_none());
    assert!(agent.find_registered(inside, 0).is_none());
    // Other buffers of the same registration, described from the window found.
    let later = region.as_ptr().wrapping_add(4096 + 8000);
    let d = found.desc_at(later, 192).unwrap();
    assert_eq!((d.as_ptr(), d.len(), d.reg()), (later, 192, reg.id()));
    let first = found
        .desc_at(region.as_ptr().wrapping_add(4096), 1)
        .unwrap();
    assert_eq!(first.offset(), 0);
    assert!(found.desc_at(later, 193).is_none(), "runs past the end");
    assert!(
        found
            .desc_at(region.as_ptr().wrapping_add(4095), 2)
            .is_none(),
        "before the start"
    );
    assert!(found.desc_at(other.as_ptr(), 10).is_none());
    assert!(found.desc_at(later, 0).is_none());
    drop((reg, found, d, first));
    assert!(agent.find_registered(inside, 100).is_none());
}

#[derive(Debug, Clone)]
enum CacheOp {
    Register {
        region: usize,
        offset: u64,
        len: u64,
    },
    DropGuard(usize),
    Desc(usize),
    DropDesc(usize),
    Find {
        region: usize,
        offset: u64,
        len: u64,
    },
}

fn cache_op() -> impl proptest::strategy::Strategy<Value = CacheOp> {
    use proptest::prelude::*;
    prop_oneof![
        (0usize..2, 0u64..8, 1u64..8).prop_map(|(region, o, l)| CacheOp::Register {
            region,
            offset: o * 512,
            len: (l * 512).min(4096 - o * 512),
        }),
        any::<usize>().prop_map(CacheOp::DropGuard),
        any::<usize>().prop_map(CacheOp::Desc),
        any::<usize>().prop_map(CacheOp::DropDesc),
        (0usize..2, 0u64..4096, 1u64..4096).prop_map(|(region, offset, len)| {
            CacheOp::Find {
                region,
                offset,
                len: len.min(4096 - offset).max(1),
            }
        }),
    ]
}

proptest::proptest! {
    /// Random register / drop / describe sequences against a model of which registrations
    /// are live: the cache answers from a live covering registration when there is one,
    /// and the engine sees exactly the live ones.
    #[test]
    fn registration_cache_matches_model(
        ops in proptest::collection::vec(cache_op(), 1..60)
    ) {
        let engine = Arc::new(Counting::default());
        let agent = Agent::new("a", engine.clone()).unwrap();
        let regions = [Region::anonymous(4096).unwrap(), Region::anonymous(4096).unwrap()];
        // Model: registration id -> (region, start, len).
        let mut model: HashMap<u64, (usize, u64, u64)> = HashMap::new();
        let mut guards: Vec<Registration> = Vec::new();
        let mut descs: Vec<LocalDesc> = Vec::new();
        for op in ops {
            match op {
                CacheOp::Register { region, offset, len } => {
                    let covering: Vec<u64> = model
                        .iter()
                        .filter(|(_, &(r, s, l))| r == region && s <= offset && offset + len <= s + l)
                        .map(|(&id, _)| id)
                        .collect();
                    let g = agent.register_range(&regions[region], offset, len).unwrap();
                    if covering.is_empty() {
                        proptest::prop_assert!(!model.contains_key(&g.id()));
                        model.insert(g.id(), (region, offset, len));
                    } else {
                        proptest::prop_assert!(covering.contains(&g.id()), "cache missed");
                    }
                    guards.push(g);
                }
                CacheOp::DropGuard(i) if !guards.is_empty() => {
                    drop(guards.swap_remove(i % guards.len()));
                }
                CacheOp::Desc(i) if !guards.is_empty() => {
                    let g = &guards[i % guards.len()];
                    descs.push(g.desc(0, g.len()).unwrap());
                }
                CacheOp::DropDesc(i) if !descs.is_empty() => {
                    descs.swap_remove(i % descs.len());
                }
                CacheOp::Find { region, offset, len } => {
                    let covering: Vec<u64> = model
                        .iter()
                        .filter(|(_, &(r, s, l))| r == region && s <= offset && offset + len <= s + l)
                        .map(|(&id, _)| id)
                        .collect();
                    let ptr = regions[region].as_ptr().wrapping_add(offset as usize);
                    match agent.find_registered(ptr, len) {
                        Some(found) => {
                            proptest::prop_assert!(covering.contains(&found.id()));
                            proptest::prop_assert_eq!(found.as_ptr(), ptr);
                        }
                        None => proptest::prop_assert!(covering.is_empty(), "lookup missed"),
                    }
                }
                _ => {}
            }
            let live: std::collections::HashSet<u64> = guards
                .iter()
                .map(Registration::id)
                .chain(descs.iter().map(LocalDesc::reg))
                .collect();
            model.retain(|id, _| live.contains(id));
            proptest::prop_assert_eq!(agent.report().registrations, model.len());
            proptest::prop_assert_eq!(*engine.live.lock(), model.len() as i64);
        }
        drop((guards, descs));
        proptest::prop_assert_eq!(agent.report().registrations, 0);
        proptest::prop_assert_eq!(*engine.live.lock(), 0);
    }
}

#[test]
fn bad_names_are_errors() {
    assert!(Agent::new("", Arc::new(Counting::default())).is_err());
    assert!(Agent::new(&"x".repeat(256), Arc::new(Counting::default())).is_err());
}

/// A transfer completed on another thread while its owner drops every handle and waits:
/// the waiter sees the outcome only after the transfer's registration, pool block and
/// in-flight count were released (deferred release, then completion).
#[test]
fn loom_completion_releases_before_waking() {
    model(|| {
        let engine = Arc::new(Counting::default());
        let a = Agent::new("a", engine.clone()).unwrap();
        let b = Agent::new("b", Arc::new(Counting::default())).unwrap();
        let rb = Region::anonymous(4096).unwrap();
        let gb = b.register(&rb).unwrap();
        let peer = a.add_remote(&b.metadata()).unwrap();
        let pool = crate::RegisteredPool::new(&a, 4096).unwrap();
        let block = pool.lease(64, 8).unwrap();
        let t = peer
            .write(&[block.desc().unwrap()], &[gb.remote(0, 64).unwrap()], None)
            .unwrap();
        drop((block, peer));
        let xfer = engine.parked.lock().pop().unwrap();
        let completer = thread::spawn(move || xfer.done.complete(Ok(())));
        assert_eq!(outcome(t), Ok(()));
        assert_eq!(pool.report().used, 0, "block released before completion");
        assert_eq!(a.report().in_flight, 0);
        completer.join().unwrap();
        drop(pool);
        assert_eq!(a.report().registrations, 0);
    });
}

/// A WRITE from a local-only registration completes on another thread while its owner
/// drops the guard and waits: the registration lives until the completion, its release
/// never reaches the engine or the registry, and a listed registration next to it is
/// untouched, whatever the interleaving.
#[test]
fn loom_local_only_registration_outlives_its_transfer() {
    model(|| {
        let engine = Arc::new(Counting {
            by_address: true,
            ..Counting::default()
        });
        let a = Agent::new("a", engine.clone()).unwrap();
        let b = Agent::new("b", Arc::new(Counting::default())).unwrap();
        let rb = Region::anonymous(4096).unwrap();
        let gb = b.register(&rb).unwrap();
        let listed = a.register(&Region::anonymous(4096).unwrap()).unwrap();
        let ra = Region::anonymous(4096).unwrap();
        let local = a.register_local(&ra).unwrap();
        assert_eq!(*engine.live.lock(), 1, "the engine saw only the listed one");
        let peer = a.add_remote(&b.metadata()).unwrap();
        let t = peer
            .write(
                &[local.desc(0, 8).unwrap()],
                &[gb.remote(0, 8).unwrap()],
                None,
            )
            .unwrap();
        let id = local.id();
        drop((local, ra, peer));
        let xfer = engine.parked.lock().pop().unwrap();
        assert_eq!(xfer.plan().segments()[0].local_reg, id, "the plan pins it");
        let completer = thread::spawn(move || xfer.done.complete(Ok(())));
        assert_eq!(outcome(t), Ok(()));
        completer.join().unwrap();
        assert_eq!(a.report().registrations, 1);
        assert_eq!(*engine.live.lock(), 1);
        drop(listed);
        assert_eq!(a.report().registrations, 0);
        assert_eq!(*engine.live.lock(), 0);
    });
}

/// An engine that drops a transfer without reporting it fails the transfer, on any
/// thread, and releases what it held.
#[test]
fn loom_lost_status_is_a_failure() {
    model(|| {
        let engine = Arc::new(Counting::default());
        let a = Agent::new("a", engine.clone()).unwrap();
        let b = Agent::new("b", Arc::new(Counting::default())).unwrap();
        let rb = Region::anonymous(4096).unwrap();
        let gb = b.register(&rb).unwrap();
        let ra = Region::anonymous(4096).unwrap();
        let ga = a.register(&ra).unwrap();
        let peer = a.add_remote(&b.metadata()).unwrap();
        let t = peer
            .write(&[ga.desc(0, 8).unwrap()], &[gb.remote(0, 8).unwrap()], None)
            .unwrap();
        drop(ga);
        let xfer = engine.parked.lock().pop().unwrap();
        let dropper = thread::spawn(move || drop(xfer));
        assert!(matches!(
            outcome(t),
            Err(TransferError::StatusLost { ref peer }) if peer == "b"
        ));
        dropper.join().unwrap();
        assert_eq!(a.report().registrations, 0);
    });
}

/// A peer's request races the owner dropping the last guard: the request is either
/// refused as unknown or pins the registration, which is then deregistered exactly once,
/// after the pin is released.
#[test]
fn loom_target_grant_races_deregistration() {
    model(|| {
        let engine = Arc::new(Counting::default());
        let agent = Agent::new("a", engine.clone()).unwrap();
        let host = engine.host.lock().clone().unwrap();
        let region = Region::anonymous(4096).unwrap();
        let reg = agent.register(&region).unwrap();
        let id = reg.id();
        let dropper = thread::spawn(move || drop(reg));
        let mut grant = Grant::new();
        match host.grant_into(&mut grant, [(id, 0, 64)]) {
            Ok(()) => {
                assert_eq!(grant.len(), 1);
                assert_eq!(*engine.live.lock(), 1, "pinned memory stays registered");
            }
            Err(reason) => assert_eq!(reason, RejectReason::UnknownRegistration),
        }
        dropper.join().unwrap();
        drop(grant);
        assert_eq!(*engine.live.lock(), 0);
        assert_eq!(agent.report().registrations, 0);
    });
}

/// The target's own check of every span a peer asks for, whatever the initiator checked:
/// spans past the end, spans whose end overflows u64, empty spans and unknown ids are refused,
/// and a refused request leaves the grant empty (nothing pinned).
#[test]
fn target_grants_check_every_span_themselves() {
    let engine = Arc::new(Counting::default());
    let agent = Agent::new("a", engine.clone()).unwrap();
    let host = engine.host.lock().clone().unwrap();
    let region = Region::anonymous(8192).unwrap();
    let reg = agent.register(&region).unwrap();
    let id = reg.id();
    let mut grant = Grant::new();
    host.grant_into(&mut grant, [(id, 0, 8192), (id, 8191, 1)])
        .unwrap();
    assert_eq!((grant.len(), grant.bytes()), (2, 8193));
    for (spans, reason) in [
        (vec![(id, 8192, 1)], RejectReason::OutOfRange),
        (vec![(id, 4096, 4097)], RejectReason::OutOfRange),
        (vec![(id, u64::MAX, 2)], RejectReason::OutOfRange),
        (vec![(id, 1, u64::MAX)], RejectReason::OutOfRange),
        (
            vec![(id, 0, 64), (id, u64::MAX - 7, 16)],
            RejectReason::OutOfRange,
        ),
        (vec![(id, 0, 0)], RejectReason::Malformed),
        (
            vec![(id, 0, 64), (id + 1_000, 0, 64)],
            RejectReason::UnknownRegistration,
        ),
    ] {
        assert_eq!(
            host.grant_into(&mut grant, spans.clone()),
            Err(reason),
            "{spans:?}"
        );
        assert!(grant.is_empty(), "{spans:?}: a refused grant pins nothing");
    }
    drop(grant);
    drop(reg);
    assert_eq!(*engine.live.lock(), 0);
}

/// A grant without a peer name never reaches a scoped registration, even inside an exposure
/// (an exposure names its peer): it is refused `NotExposed` and pins nothing, while the same
/// span of an unscoped registration is granted.
#[test]
fn an_anonymous_grant_never_reaches_a_scoped_registration() {
    let engine = Arc::new(Counting::default());
    let agent = Agent::new("a", engine.clone()).unwrap();
    let host = engine.host.lock().clone().unwrap();
    let region = Region::anonymous(8192).unwrap();
    let scoped = agent.register_scoped(&region).unwrap();
    let _exposure = scoped
        .expose("peer", 0, 8192, crate::Ops::READ_WRITE)
        .unwrap();
    let mut grant = Grant::new();
    assert_eq!(
        host.grant_into(&mut grant, [(scoped.id(), 0, 64)]),
        Err(RejectReason::NotExposed)
    );
    assert!(grant.is_empty(), "a refused grant pins nothing");
    let other = Region::anonymous(8192).unwrap();
    let plain = agent.register(&other).unwrap();
    host.grant_into(&mut grant, [(plain.id(), 0, 64)]).unwrap();
    assert_eq!((grant.len(), grant.bytes()), (1, 64));
}

/// Two engine readers serving the same peer (one learns the peer's name late) return on
/// their own threads while the owner asks: the peer reads open while either runs and
/// closed once both returned, whatever the interleaving; the count never goes stale.
#[test]
fn loom_peer_link_counts_every_reader() {
    model(|| {
        let engine = Arc::new(Counting::default());
        let agent = Agent::new("a", engine.clone()).unwrap();
        let host = engine.host.lock().clone().unwrap();
        let first = host.link_open("c");
        let mut second = host.link_open("unnamed");
        let reader = thread::spawn(move || {
            second.rename("c");
            drop(second);
        });
        assert_eq!(agent.peer_link("c"), LinkState::Open);
        let other = thread::spawn(move || drop(first));
        reader.join().unwrap();
        other.join().unwrap();
        assert_eq!(agent.peer_link("c"), LinkState::Closed);
        assert_eq!(agent.peer_link("unnamed"), LinkState::Closed);
        assert!(agent.core.host.inbound.lock().is_empty());
    });
}

/// Registering and dropping the same range on two threads: the engine sees balanced
/// register/deregister calls, and the table ends empty, whatever the interleaving.
#[test]
fn loom_registration_cache_refcounts() {
    model(|| {
        let engine = Arc::new(Counting::default());
        let agent = Arc::new(Agent::new("a", engine.clone()).unwrap());
        let region = Region::anonymous(4096).unwrap();
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let agent = agent.clone();
                let region = region.clone();
                thread::spawn(move || {
                    let r = agent.register_range(&region, 0, 64).unwrap();
                    let d = r.desc(0, 8).unwrap();
                    drop(r);
                    d.reg()
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(agent.report().registrations, 0);
        assert_eq!(*engine.live.lock(), 0);
    });
}

/// A prepared transfer posts a notification of exactly `MAX_NOTIFICATION` bytes and delivers
/// it whole; one byte more is refused before anything moves.
#[test]
fn a_prepared_post_takes_a_notification_of_exactly_the_maximum() {
    use crate::{Inproc, Op, MAX_NOTIFICATION};

    let sender = Agent::new("sender", Inproc::new()).unwrap();
    let receiver = Agent::new("receiver", Inproc::new()).unwrap();
    let src = Region::new(4096).unwrap();
    let dst = Region::new(4096).unwrap();
    let gs = sender.register(&src).unwrap();
    let gd = receiver.register(&dst).unwrap();
    let peer = sender.add_remote(&receiver.metadata()).unwrap();
    let prepared = peer
        .prepare(
            Op::Write,
            &[gs.desc(0, 64).unwrap()],
            &[gd.remote(0, 64).unwrap()],
        )
        .unwrap();
    let max = vec![7u8; MAX_NOTIFICATION];
    prepared
        .post(Some(&max))
        .unwrap()
        .wait_timeout(crate::TEST_WAIT)
        .unwrap();
    let note = receiver
        .try_notification()
        .expect("delivered after the data");
    assert_eq!(
        (note.from.as_str(), note.msg.len()),
        ("sender", MAX_NOTIFICATION)
    );
    let over = vec![7u8; MAX_NOTIFICATION + 1];
    assert!(matches!(
        prepared.post(Some(&over)),
        Err(TransferError::NotificationTooLarge { len, max, .. })
            if (len, max) == (MAX_NOTIFICATION + 1, MAX_NOTIFICATION)
    ));
    assert!(receiver.try_notification().is_none());
    // Its debug form is its plan's.
    assert_eq!(format!("{prepared:?}"), format!("{:?}", prepared.plan()));
    assert!(format!("{prepared:?}").contains("receiver"));
}
