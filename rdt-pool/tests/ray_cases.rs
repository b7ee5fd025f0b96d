//! Every row of "Where it breaks" in Ray 2.60's RDT pool, as a regression test, plus the
//! forwarding, quarantine-free failure and destination-buffer paths on the in-process backend.

mod common;

use std::sync::Arc;

use common::{pair, pattern};
use tessera_rdt_pool::{
    DType, DescriptorError, FetchError, FreeError, ObjectDescriptor, Place, PutError, ReceiverPool,
    SenderPool, TensorRef,
};
use tessera_transport::testing::{Fault, Faults, Faulty};
use tessera_transport::{Agent, Inproc, Op, Region, RemoteDesc};

fn f32s(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

#[test]
fn exact_fit_across_objects() {
    // Ray carves each 12-byte object as 16 bytes: the second one does not fit 24 bytes.
    let p = pair(24, 24);
    let a = f32s(&[1.0, 2.0, 3.0]);
    let b = f32s(&[4.0, 5.0, 6.0]);
    let da = p
        .sender
        .put("a", &[TensorRef::new(DType::F32, &[3], &a).unwrap()])
        .unwrap();
    let db = p
        .sender
        .put("b", &[TensorRef::new(DType::F32, &[3], &b).unwrap()])
        .unwrap();
    let r = p.sender.report();
    assert_eq!((r.used, r.free, r.live_objects), (24, 0, 2));
    // The receiver fits both too, exactly.
    let ta = p.receiver.fetch(&da, &p.peer).unwrap().wait().unwrap();
    let tb = p.receiver.fetch(&db, &p.peer).unwrap().wait().unwrap();
    assert_eq!(ta[0].to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0]);
    assert_eq!(tb[0].to_vec::<f32>().unwrap(), [4.0, 5.0, 6.0]);
    assert_eq!(p.receiver.report().free, 0);
}

#[test]
fn trailing_zero_size_tensor() {
    let p = pair(1024, 1024);
    let a = f32s(&[1.0, 2.0]);
    let d = p
        .sender
        .put(
            "t",
            &[
                TensorRef::new(DType::F32, &[2], &a).unwrap(),
                TensorRef::new(DType::F64, &[0], &[]).unwrap(),
            ],
        )
        .unwrap();
    assert_eq!(d.blocks.len(), 1);
    assert!(d.blocks.iter().all(|b| b.remote.len > 0));
    assert_eq!(d.tensors[1].place, None);
    let t = p.receiver.fetch(&d, &p.peer).unwrap().wait().unwrap();
    assert_eq!(t.len(), 2);
    assert_eq!(t[0].to_vec::<f32>().unwrap(), [1.0, 2.0]);
    assert_eq!((t[1].dtype(), t[1].shape()), (DType::F64, &[0u64][..]));
}

#[test]
fn zero_size_tensor_on_a_full_pool() {
    let p = pair(12, 12);
    let a = f32s(&[1.0, 2.0, 3.0]);
    p.sender
        .put("full", &[TensorRef::new(DType::F32, &[3], &a).unwrap()])
        .unwrap();
    assert_eq!(p.sender.report().free, 0);
    // Ray raises a type error here; an empty tensor needs no space.
    let d = p
        .sender
        .put(
            "empty",
            &[TensorRef::new(DType::I64, &[4, 0], &[]).unwrap()],
        )
        .unwrap();
    assert!(d.blocks.is_empty());
    // Anything with bytes is out of memory, with the numbers.
    let one = f32s(&[1.0]);
    match p
        .sender
        .put("more", &[TensorRef::new(DType::F32, &[1], &one).unwrap()])
    {
        Err(PutError::OutOfMemory {
            requested: 4,
            free: 0,
            largest_free: 0,
            previous_released: false,
        }) => {}
        other => panic!("expected out of memory, got {other:?}"),
    }
    // The receiver, full too, still fetches the empty object.
    let full = p.sender.descriptor("full").unwrap();
    let held = p.receiver.fetch(&full, &p.peer).unwrap().wait().unwrap();
    let t = p.receiver.fetch(&d, &p.peer).unwrap().wait().unwrap();
    assert_eq!(t[0].shape(), &[4, 0]);
    match p.receiver.fetch(&full, &p.peer) {
        Err(FetchError::OutOfMemory {
            requested: 12,
            blocks: 1,
            free: 0,
            largest_free: 0,
        }) => {}
        other => panic!("expected out of memory, got {other:?}"),
    }
    drop(held);
}

#[test]
fn all_empty_object_makes_no_descriptor() {
    let p = pair(64, 64);
    let d = p
        .sender
        .put(
            "e",
            &[
                TensorRef::new(DType::BF16, &[0, 5], &[]).unwrap(),
                TensorRef::new(DType::Complex128, &[0], &[]).unwrap(),
            ],
        )
        .unwrap();
    assert!(d.blocks.is_empty(), "Ray makes a 0-byte descriptor here");
    let d = ObjectDescriptor::from_bytes(&d.to_bytes().unwrap()).unwrap();
    let t = p.receiver.fetch(&d, &p.peer).unwrap().wait().unwrap();
    assert_eq!(t.len(), 2);
    assert_eq!(p.receiver.report().used, 0);
    p.sender.free("e").unwrap();
}

#[test]
fn failure_after_allocation_leaks_nothing() {
    let p = pair(4096, 4096);
    let a = pattern(1, 64);
    // A view claimed to be registered, but with another agent: refused, nothing held.
    let other = Agent::new("other", Inproc::new()).unwrap();
    let region = Region::new(4096).unwrap();
    let reg = other.register(&region).unwrap();
    let refs = [
        TensorRef::new(DType::U8, &[64], &a).unwrap(),
        TensorRef::registered(DType::F32, &[4], &reg, 0).unwrap(),
    ];
    assert!(matches!(
        p.sender.put("x", &refs),
        Err(PutError::NotRegisteredHere { index: 1 })
    ));
    assert_eq!(p.sender.report().used, 0);
    // Still refused when this agent registered the same memory too: the view names the other
    // agent's registration, whose id means nothing to the peer.
    let _mine = p.sender_agent.register(&region).unwrap();
    assert!(matches!(
        p.sender.put("x", &refs),
        Err(PutError::NotRegisteredHere { index: 1 })
    ));
    assert_eq!(p.sender.report().used, 0);

    // A READ that fails (a registration the peer never announced) frees its blocks at once.
    let d = p.sender.put("x", &refs[..1]).unwrap();
    let mut bad = (*d).clone();
    bad.blocks[0].remote = RemoteDesc::new(999_999, 0, 64);
    assert!(matches!(
        p.receiver.fetch(&bad, &p.peer),
        Err(FetchError::Transfer(_))
    ));
    let r = p.receiver.report();
    assert_eq!((r.used, r.quarantined, r.live_objects), (0, 0, 0));
    // So does one past the end of the peer's registration.
    bad.blocks[0].remote = RemoteDesc::new(d.blocks[0].remote.reg, 1 << 40, 64);
    assert!(p.receiver.fetch(&bad, &p.peer).is_err());
    assert_eq!(p.receiver.report().used, 0);
}

#[test]
fn a_read_failing_at_completion_frees_its_blocks() {
    // The receiver's engine moves the bytes, then reports the READ failed (a link cut during
    // the payload): the fetch fails and its blocks return at once, nothing quarantined.
    let faults = Faults::new();
    let sender_agent = Arc::new(Agent::new("sender", Inproc::new()).unwrap());
    let receiver_agent =
        Arc::new(Agent::new("receiver", Faulty::new(Inproc::new(), faults.clone())).unwrap());
    let sender = SenderPool::new(sender_agent.clone(), 1 << 16).unwrap();
    let receiver = ReceiverPool::new(receiver_agent.clone(), 1 << 16).unwrap();
    let peer = receiver_agent.add_remote(&sender_agent.metadata()).unwrap();
    let a = pattern(3, 4096);
    let d = sender
        .put("x", &[TensorRef::new(DType::U8, &[4096], &a).unwrap()])
        .unwrap();
    for fault in [Fault::FailAtCompletion, Fault::LoseCompletion] {
        faults.next_on(Op::Read, fault);
        let got = receiver.fetch(&d, &peer).unwrap().wait();
        assert!(
            matches!(got, Err(FetchError::Transfer(_))),
            "{fault:?}: {got:?}"
        );
        let r = receiver.report();
        assert_eq!(
            (r.used, r.quarantined, r.live_objects),
            (0, 0, 0),
            "{fault:?}"
        );
    }
    assert_eq!(faults.injected(), 2);
    // And the next fetch, unfaulted, reads the object.
    let views = receiver.fetch(&d, &peer).unwrap().wait().unwrap();
    assert_eq!(views[0].data(), &a[..]);
}

/// A receiver over a faulty engine, a sender, and an object of 4096 bytes put on it.
fn faulty_pair(
    faults: &Faults,
) -> (
    ReceiverPool,
    SenderPool,
    tessera_transport::Peer,
    Arc<ObjectDescriptor>,
    Vec<u8>,
) {
    let sender_agent = Arc::new(Agent::new("sender", Inproc::new()).unwrap());
    let receiver_agent =
        Arc::new(Agent::new("receiver", Faulty::new(Inproc::new(), faults.clone())).unwrap());
    let sender = SenderPool::new(sender_agent.clone(), 1 << 16).unwrap();
    let receiver = ReceiverPool::new(receiver_agent.clone(), 4096).unwrap();
    let peer = receiver_agent.add_remote(&sender_agent.metadata()).unwrap();
    let a = pattern(5, 4096);
    let d = sender
        .put("x", &[TensorRef::new(DType::U8, &[4096], &a).unwrap()])
        .unwrap();
    (receiver, sender, peer, d, a)
}

/// Waits until the receiver's quarantine is empty again.
fn until_released(receiver: &ReceiverPool) {
    let deadline = std::time::Instant::now() + tessera_transport::testing::hang_guard();
    while receiver.report().quarantined > 0 {
        assert!(std::time::Instant::now() < deadline, "never released");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

#[test]
fn a_fetch_dropped_in_flight_quarantines_its_blocks_until_the_read_ends() {
    // The READ is still running when the fetch is dropped: its block must not be handed out
    // again until the READ is over, or a late write lands in someone else's tensor.
    let faults = Faults::new();
    let (receiver, _sender, peer, d, a) = faulty_pair(&faults);
    faults.next_on(
        Op::Read,
        Fault::Delay(std::time::Duration::from_millis(400)),
    );
    drop(receiver.fetch(&d, &peer).unwrap());
    let r = receiver.report();
    assert_eq!((r.quarantined, r.used), (4096, 4096));
    assert!(matches!(
        receiver.fetch(&d, &peer),
        Err(FetchError::OutOfMemory { .. })
    ));
    until_released(&receiver);
    assert_eq!(receiver.report().used, 0);
    let views = receiver.fetch(&d, &peer).unwrap().wait().unwrap();
    assert_eq!(views[0].data(), &a[..]);
}

#[test]
fn a_fetch_that_times_out_reports_what_it_quarantined() {
    let faults = Faults::new();
    let (receiver, _sender, peer, d, _) = faulty_pair(&faults);
    faults.next_on(
        Op::Read,
        Fault::Delay(std::time::Duration::from_millis(400)),
    );
    let got = receiver
        .fetch(&d, &peer)
        .unwrap()
        .wait_timeout(std::time::Duration::from_millis(20));
    assert!(
        matches!(
            got,
            Err(FetchError::Timeout {
                quarantined: 4096,
                ..
            })
        ),
        "{got:?}"
    );
    assert_eq!(receiver.report().quarantined, 4096);
    until_released(&receiver);
    assert_eq!(receiver.report().used, 0);
}

#[test]
fn a_replacing_put_reuses_the_blocks_of_the_object_it_replaces() {
    let p = pair(4096, 4096);
    let first = pattern(12, 100);
    // Another object first, so that "x" lives at a block that does not start the pool.
    let _a = p
        .sender
        .put("a", &[TensorRef::new(DType::U8, &[100], &first).unwrap()])
        .unwrap();
    let old = p
        .sender
        .put(
            "x",
            &[TensorRef::new(DType::U8, &[64], &first[..64]).unwrap()],
        )
        .unwrap();
    assert!(old.blocks[0].remote.offset > 0);
    let new_data = pattern(13, 64);
    let new = p
        .sender
        .put("x", &[TensorRef::new(DType::U8, &[64], &new_data).unwrap()])
        .unwrap();
    assert_eq!(
        new.blocks[0].remote, old.blocks[0].remote,
        "written in place"
    );
    assert_eq!(p.sender.report().used, 100 + 64);
    let got = p.receiver.fetch(&new, &p.peer).unwrap().wait().unwrap();
    assert_eq!(got[0].data(), &new_data[..]);
}

#[test]
fn slice_outlives_its_parent_view() {
    let p = pair(4096, 64);
    let data = pattern(2, 64);
    let d = p
        .sender
        .put("s", &[TensorRef::new(DType::U8, &[4, 16], &data).unwrap()])
        .unwrap();
    let t = p.receiver.fetch(&d, &p.peer).unwrap().wait().unwrap();
    // u = t[:1]; del t: Ray freed the block under u.
    let u = t[0].row(0).unwrap();
    let raw = t[0].data().slice(48..64);
    drop(t);
    let r = p.receiver.report();
    assert_eq!((r.used, r.leased, r.live_objects), (64, 64, 1));
    // The pool is full while the slices live: a second fetch cannot take their block.
    assert!(matches!(
        p.receiver.fetch(&d, &p.peer),
        Err(FetchError::OutOfMemory { .. })
    ));
    assert_eq!(u.to_vec::<u8>().unwrap(), &data[..16]);
    drop(u);
    assert_eq!(&raw[..], &data[48..]);
    drop(raw);
    let r = p.receiver.report();
    assert_eq!((r.used, r.leased, r.live_objects), (0, 0, 0));
    assert!(p.receiver.fetch(&d, &p.peer).unwrap().wait().is_ok());
}

#[test]
fn free_of_an_unknown_id_is_an_error() {
    let p = pair(64, 64);
    assert_eq!(
        p.sender.free("nope"),
        Err(FreeError::UnknownObject { id: "nope".into() })
    );
}

#[test]
fn hostile_descriptors_allocate_nothing() {
    let p = pair(4096, 4096);
    let a = pattern(3, 32);
    let d = p
        .sender
        .put("h", &[TensorRef::new(DType::U8, &[32], &a).unwrap()])
        .unwrap();
    let mut bad = (*d).clone();
    bad.tensors[0].place = Some(Place {
        block: 0,
        offset: u64::MAX,
    });
    assert!(matches!(
        p.receiver.fetch(&bad, &p.peer),
        Err(FetchError::Descriptor(DescriptorError::OutsideBlock { .. }))
    ));
    let mut bad = (*d).clone();
    bad.blocks[0].align = 1 << 40;
    assert!(p.receiver.fetch(&bad, &p.peer).is_err());
    let mut bad = (*d).clone();
    bad.tensors[0].shape = tessera_framecodec::Dims::from_slice(&[1 << 62, 1 << 62]);
    assert!(p.receiver.fetch(&bad, &p.peer).is_err());
    assert_eq!(p.receiver.report().used, 0);
}

#[test]
fn ten_thousand_views_are_one_block_and_one_read() {
    let p = pair(16 << 20, 16 << 20);
    let data = pattern(4, 10_000 * 1024);
    let refs: Vec<TensorRef<'_>> = data
        .chunks(1024)
        .map(|c| TensorRef::new(DType::F32, &[256], c).unwrap())
        .collect();
    let d = p.sender.put("10k", &refs).unwrap();
    assert_eq!(d.blocks.len(), 1);
    assert_eq!(d.blocks[0].remote.len, 10_000 * 1024);
    let t = p.receiver.fetch(&d, &p.peer).unwrap().wait().unwrap();
    assert_eq!(t.len(), 10_000);
    for (i, t) in t.iter().enumerate().step_by(997) {
        assert_eq!(t.as_slice::<f32>().unwrap().len(), 256);
        assert_eq!(&t.data()[..], &data[i * 1024..(i + 1) * 1024]);
    }
}

#[test]
fn forwarding_received_views_copies_nothing_and_frees_nothing_else() {
    let p = pair(1 << 20, 1 << 20);
    let data = pattern(5, 100 * 64);
    let refs: Vec<TensorRef<'_>> = data
        .chunks(64)
        .map(|c| TensorRef::new(DType::F64, &[8], c).unwrap())
        .collect();
    let d = p.sender.put("orig", &refs).unwrap();
    let fetched = p.receiver.fetch(&d, &p.peer).unwrap().wait().unwrap();

    // The receiving process forwards them with a sender pool on the same agent.
    let forwarder = SenderPool::new(p.receiver_agent.clone(), 4096).unwrap();
    let fwd: Vec<TensorRef<'static>> = fetched.iter().map(TensorRef::from_tensor).collect();
    let f1 = forwarder.put("fwd-1", &fwd).unwrap();
    let f2 = forwarder.put("fwd-2", &fwd[10..20]).unwrap();
    assert_eq!(f1.blocks.len(), 1, "100 adjacent views, one descriptor");
    assert_eq!(f1.blocks[0].remote.reg, p.receiver.registration().id());
    let r = forwarder.report();
    assert_eq!((r.used, r.live_objects), (0, 2), "described in place");
    assert_eq!(r.in_place, 100 * 64 + 10 * 64);
    drop(fetched);
    drop(fwd);
    // The forwarded objects keep the receive block leased.
    assert_eq!(p.receiver.report().used, 100 * 64);
    forwarder.free("fwd-1").unwrap();
    assert_eq!(p.receiver.report().used, 100 * 64, "fwd-2 still holds it");

    // A third agent fetches the forwarded object from the receiving process.
    let third = Arc::new(Agent::new("third", Inproc::new()).unwrap());
    let third_pool = ReceiverPool::new(third.clone(), 1 << 20).unwrap();
    let to_fwd = third.add_remote(&p.receiver_agent.metadata()).unwrap();
    let got = third_pool.fetch(&f2, &to_fwd).unwrap().wait().unwrap();
    for (i, t) in got.iter().enumerate() {
        let j = 10 + i;
        assert_eq!(&t.data()[..], &data[j * 64..(j + 1) * 64]);
    }
    forwarder.free("fwd-2").unwrap();
    assert_eq!(p.receiver.report().used, 0);
    // The original object was never touched.
    assert!(p.sender.contains("orig"));
}

#[test]
fn strided_views_of_registered_memory_are_gathered_not_described_in_place() {
    let p = pair(4096, 4096);
    let values: Vec<u8> = (0..64).collect();
    let d = p
        .sender
        .put("v", &[TensorRef::new(DType::U8, &[64], &values).unwrap()])
        .unwrap();
    let fetched = p.receiver.fetch(&d, &p.peer).unwrap().wait().unwrap();
    // Every other byte of a received view, which lies in the receiver's registered block.
    let strided =
        tessera_rdt_pool::Tensor::with_strides(DType::U8, &[32], &[2], fetched[0].data().clone())
            .unwrap();
    let forwarder = SenderPool::new(p.receiver_agent.clone(), 4096).unwrap();
    let f = forwarder
        .put("odd", &[TensorRef::from_tensor(&strided)])
        .unwrap();
    let r = forwarder.report();
    assert_eq!((r.in_place, r.used), (0, 32), "gathered into the pool");
    let third = Arc::new(Agent::new("third", Inproc::new()).unwrap());
    let third_pool = ReceiverPool::new(third.clone(), 4096).unwrap();
    let to_fwd = third.add_remote(&p.receiver_agent.metadata()).unwrap();
    let got = third_pool.fetch(&f, &to_fwd).unwrap().wait().unwrap();
    let evens: Vec<u8> = (0..64).step_by(2).collect();
    assert_eq!(&got[0].data()[..], &evens[..]);
}

#[test]
fn caller_registrations_are_described_in_place() {
    let p = pair(4096, 4096);
    let region = Region::new(4096).unwrap();
    region.write_at(128, &pattern(6, 256)).unwrap();
    let reg = p.sender_agent.register(&region).unwrap();
    let t = TensorRef::registered(DType::I32, &[64], &reg, 128).unwrap();
    let d = p.sender.put("r", &[t]).unwrap();
    assert_eq!(p.sender.report().used, 0);
    assert_eq!(d.blocks[0].remote, reg.remote(128, 256).unwrap());
    drop(reg);
    // The object keeps the registration alive; the peer needs metadata that announces it.
    let peer = p
        .receiver_agent
        .add_remote(&p.sender_agent.metadata())
        .unwrap();
    let got = p.receiver.fetch(&d, &peer).unwrap().wait().unwrap();
    assert_eq!(&got[0].data()[..], &pattern(6, 256)[..]);
}

#[test]
fn fetch_into_caller_buffers() {
    let p = pair(4096, 4096);
    let a = pattern(7, 10);
    let b = pattern(8, 32);
    let d = p
        .sender
        .put(
            "i",
            &[
                TensorRef::new(DType::U8, &[10], &a).unwrap(),
                TensorRef::new(DType::Complex128, &[2], &b).unwrap(),
            ],
        )
        .unwrap();
    // An unregistered buffer: read through a receive block, copied out once.
    let mut buf = vec![0u8; 64];
    let layout = p.receiver.fetch_into(&d, &p.peer, &mut buf).unwrap();
    assert_eq!(layout.tensors, vec![Some(0), Some(16)]);
    assert_eq!(&buf[..10], &a[..]);
    assert_eq!(&buf[16..48], &b[..]);
    assert_eq!(p.receiver.report().used, 0);
    // Too small a buffer is an error; one of exactly the size is not.
    assert!(matches!(
        p.receiver.fetch_into(&d, &p.peer, &mut [0u8; 47]),
        Err(FetchError::DestinationTooSmall {
            len: 47,
            needed: 48
        })
    ));
    let mut exact = [0u8; 48];
    p.receiver.fetch_into(&d, &p.peer, &mut exact).unwrap();
    assert_eq!(&exact[16..48], &b[..]);
    // A registered buffer: lands directly, no pool block taken.
    let dst = Region::new(4096).unwrap();
    let reg = p.receiver_agent.register(&dst).unwrap();
    let layout = p
        .receiver
        .fetch_into_registered(&d, &p.peer, &reg, 1024)
        .unwrap();
    assert_eq!(layout.size, 48);
    let mut got = vec![0u8; 48];
    dst.read_at(1024, &mut got).unwrap();
    assert_eq!((&got[..10], &got[16..]), (&a[..], &b[..]));
    assert_eq!(p.receiver.report().used, 0);
    assert!(matches!(
        p.receiver.fetch_into_registered(&d, &p.peer, &reg, 4090),
        Err(FetchError::DestinationTooSmall { len: 6, needed: 48 })
    ));
    p.receiver
        .fetch_into_registered(&d, &p.peer, &reg, 4096 - 48)
        .unwrap();
    dst.read_at(4096 - 48, &mut got).unwrap();
    assert_eq!((&got[..10], &got[16..]), (&a[..], &b[..]));
}

#[test]
fn an_object_of_several_blocks_lands_at_its_offset_in_a_registered_buffer() {
    let p = pair(4096, 4096);
    // One tensor in place in a caller registration, one copied into the pool: two blocks.
    let src = Region::new(4096).unwrap();
    let a = pattern(10, 256);
    src.write_at(512, &a).unwrap();
    let sreg = p.sender_agent.register(&src).unwrap();
    let b = pattern(11, 64);
    let d = p
        .sender
        .put(
            "two",
            &[
                TensorRef::registered(DType::U8, &[256], &sreg, 512).unwrap(),
                TensorRef::new(DType::U8, &[64], &b).unwrap(),
            ],
        )
        .unwrap();
    assert_eq!(d.blocks.len(), 2);
    let peer = p
        .receiver_agent
        .add_remote(&p.sender_agent.metadata())
        .unwrap();
    let dst = Region::new(4096).unwrap();
    let reg = p.receiver_agent.register(&dst).unwrap();
    let layout = p
        .receiver
        .fetch_into_registered(&d, &peer, &reg, 1024)
        .unwrap();
    for (i, want) in [&a, &b].into_iter().enumerate() {
        let at = layout.tensors[i].expect("has bytes");
        let mut got = vec![0u8; want.len()];
        dst.read_at(1024 + at, &mut got).unwrap();
        assert_eq!(&got, want, "tensor {i}");
    }
}

#[test]
fn fetch_is_a_future() {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};
    let p = pair(4096, 4096);
    let a = pattern(9, 40);
    let d = p
        .sender
        .put("f", &[TensorRef::new(DType::I32, &[10], &a).unwrap()])
        .unwrap();
    let mut fetch = Box::pin(p.receiver.fetch(&d, &p.peer).unwrap());
    let mut cx = Context::from_waker(Waker::noop());
    // The in-process engine completes before `fetch` returns.
    match fetch.as_mut().poll(&mut cx) {
        Poll::Ready(Ok(t)) => assert_eq!(&t[0].data()[..], &a[..]),
        other => panic!("expected a ready fetch, got {other:?}"),
    }
    assert!(matches!(
        fetch.as_mut().poll(&mut cx),
        Poll::Ready(Err(FetchError::AlreadyResolved))
    ));
    drop(fetch);
    assert_eq!(p.receiver.report().used, 0);
}

#[test]
fn read_into_tensors_lands_each_tensor_in_its_own_buffer() {
    let p = pair(4096, 4096);
    let a = pattern(1, 10);
    let b = pattern(2, 32);
    let d = p
        .sender
        .put(
            "t",
            &[
                TensorRef::new(DType::U8, &[10], &a).unwrap(),
                TensorRef::new(DType::F32, &[0], &[]).unwrap(),
                TensorRef::new(DType::Complex128, &[2], &b).unwrap(),
            ],
        )
        .unwrap();
    // The caller's own memory, registered only as the local side of READs.
    let (ra, rb) = (Region::new(10).unwrap(), Region::new(64).unwrap());
    let (ga, gb) = (
        p.receiver_agent.register_local(&ra).unwrap(),
        p.receiver_agent.register_local(&rb).unwrap(),
    );
    let dsts = [
        Some(ga.desc(0, 10).unwrap()),
        None,
        Some(gb.desc(16, 32).unwrap()),
    ];
    p.receiver
        .read_into_tensors(&d, &p.peer, &dsts)
        .unwrap()
        .expect("a READ")
        .wait()
        .unwrap();
    let (mut got_a, mut got_b) = (vec![0u8; 10], vec![0u8; 32]);
    ra.read_at(0, &mut got_a).unwrap();
    rb.read_at(16, &mut got_b).unwrap();
    assert_eq!((got_a, got_b), (a.clone(), b.clone()));
    assert_eq!(p.receiver.report().used, 0);
    // Every destination is checked before anything is read.
    let wrong = [dsts[0].clone(), None];
    assert!(matches!(
        p.receiver.read_into_tensors(&d, &p.peer, &wrong),
        Err(FetchError::Destinations {
            given: 2,
            tensors: 3
        })
    ));
    let short = [dsts[0].clone(), None, Some(gb.desc(0, 31).unwrap())];
    assert!(matches!(
        p.receiver.read_into_tensors(&d, &p.peer, &short),
        Err(FetchError::DestinationMismatch {
            tensor: 2,
            len: 31,
            needed: 32
        })
    ));
    let extra = [
        dsts[0].clone(),
        Some(gb.desc(0, 4).unwrap()),
        dsts[2].clone(),
    ];
    assert!(matches!(
        p.receiver.read_into_tensors(&d, &p.peer, &extra),
        Err(FetchError::DestinationMismatch {
            tensor: 1,
            len: 4,
            needed: 0
        })
    ));
    let missing = [None, None, dsts[2].clone()];
    assert!(matches!(
        p.receiver.read_into_tensors(&d, &p.peer, &missing),
        Err(FetchError::DestinationMismatch {
            tensor: 0,
            len: 0,
            needed: 10
        })
    ));
    // An object without bytes reads nothing.
    let empty = p
        .sender
        .put("e", &[TensorRef::new(DType::F32, &[0], &[]).unwrap()])
        .unwrap();
    assert!(p
        .receiver
        .read_into_tensors(&empty, &p.peer, &[None])
        .unwrap()
        .is_none());
}
