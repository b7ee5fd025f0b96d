//! WRITE bandwidth of the NIXL engine between two processes, pinned to different cores.
//!
//! `cargo run --release -p tessera-nixl --features testing --example nixl_write_bw [SIZE_MIB] [ITERS]` spawns
//! itself as the target and reports GB/s of `ITERS` writes of `SIZE_MIB` (after one untimed
//! write that pre-touches both buffers). `TESSERA_NIXL_PROGRESS_DELAY_US` sets NIXL's
//! progress-thread delay.

#[path = "../../onesided/examples/bw_common/mod.rs"]
mod bw_common;

use bw_common::{announce, gbps, pin, Target};
use tessera_nixl::raw::{NixlEngine, XferOpDesc};
use tessera_nixl::NixlConfig;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let target = args.get(1).is_some_and(|a| a == "--target");
    let rest = if target { &args[2..] } else { &args[1..] };
    let mib: usize = rest.first().and_then(|s| s.parse().ok()).unwrap_or(256);
    let iters: u32 = rest.get(1).and_then(|s| s.parse().ok()).unwrap_or(10);
    let len = mib << 20;
    // Before the engine exists, so that its threads inherit the core.
    pin(usize::from(target));
    let mut buf = vec![1u8; len];
    let mut config = NixlConfig::new(if target { "bw-target" } else { "bw-init" });
    if let Some(us) = std::env::var("TESSERA_NIXL_PROGRESS_DELAY_US")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        config.progress_delay_us = us;
    }
    let engine = NixlEngine::new(config).expect("engine");
    // SAFETY: `buf` outlives the registration (dropped at the end of main, after `region`).
    let region = unsafe { engine.register(buf.as_mut_ptr(), len as u64) }.expect("register");
    if target {
        announce(&[
            format!("MD:{}", hex::encode(engine.metadata().expect("metadata"))),
            format!("KEY:{}", hex::encode(region.remote_key())),
        ]);
        drop(region);
        return;
    }
    let mut child = Target::spawn(rest);
    let md = hex::decode(child.next("MD:")).expect("hex");
    let key = hex::decode(child.next("KEY:")).expect("hex");
    let peer = engine.load_remote(&md).expect("load_remote");
    peer.add_remote(1, &key).expect("key");
    let op = [XferOpDesc {
        local: &region,
        local_offset: 0,
        remote: 1,
        remote_offset: 0,
        len: len as u64,
    }];
    let gbps = gbps(len as u64, iters, || {
        peer.write(&op, None).expect("post").wait().expect("write");
    });
    println!("nixl engine write {mib} MiB x {iters}: {gbps:.2} GB/s");
    child.finish();
    drop(peer);
    drop(region);
}
