//! The `tcp` data path allocates nothing per request in steady state: a prepared transfer
//! posted many times costs only the transfer handle's own state.

use tessera_testkit::CountingAlloc;
use tessera_transport::tcp::Tcp;
use tessera_transport::{Agent, LocalDesc, Op, Region, RemoteDesc};

/// Counts every allocation.
#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc::new(0);

#[test]
fn prepared_posts_allocate_only_the_handle() {
    let a = Agent::new("a", Tcp::new()).unwrap();
    let b = Agent::new("b", Tcp::new()).unwrap();
    let ra = Region::new(8 << 20).unwrap();
    let rb = Region::new(8 << 20).unwrap();
    let ga = a.register(&ra).unwrap();
    let gb = b.register(&rb).unwrap();
    let peer = a.add_remote(&b.metadata()).unwrap();
    // 1,000 scattered 4 KiB descriptors each way, nothing adjacent.
    let local: Vec<LocalDesc> = (0..1000)
        .map(|i| ga.desc(i * 8192, 4096).unwrap())
        .collect();
    let remote: Vec<RemoteDesc> = (0..1000)
        .map(|i| gb.remote(((i * 7919) % 1000) * 8192, 4096).unwrap())
        .collect();
    let write = peer.prepare(Op::Write, &local, &remote).unwrap();
    let read = peer.prepare(Op::Read, &local, &remote).unwrap();
    for _ in 0..50 {
        write.post(None).unwrap().wait().unwrap();
        read.post(None).unwrap().wait().unwrap();
    }
    const POSTS: u64 = 400;
    let before = GLOBAL.count();
    for _ in 0..POSTS / 2 {
        write.post(None).unwrap().wait().unwrap();
        read.post(None).unwrap().wait().unwrap();
    }
    let per_post = (GLOBAL.count() - before) as f64 / POSTS as f64;
    // One allocation is the transfer handle's shared state; the engine adds none (a little
    // slack for the channel's amortised block reuse).
    assert!(per_post < 1.1, "{per_post} allocations per post");
}
