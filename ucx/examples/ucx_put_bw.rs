//! PUT bandwidth of the UCX engine between two processes, pinned to different cores.
//!
//! `cargo run --release -p tessera-ucx --features testing --example ucx_put_bw [SIZE_MIB] [ITERS]` spawns itself
//! as the target and reports GB/s of `ITERS` puts of `SIZE_MIB` (after one untimed put that
//! pre-touches both buffers). Transports come from `UCX_TLS`, as for `ucx_perftest`;
//! `TESSERA_UCX_ERR_MODE=none` drops peer error handling (compare with `ucx_perftest` without
//! `-e`; the default compares with `ucx_perftest -e`).

#[path = "../../onesided/examples/bw_common/mod.rs"]
mod bw_common;

use bw_common::{announce, gbps, pin, Target};
use tessera_ucx::raw::{RmaOp, UcxEngine};
use tessera_ucx::{ErrorHandling, UcxConfig};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let target = args.get(1).is_some_and(|a| a == "--target");
    let rest = if target { &args[2..] } else { &args[1..] };
    let mib: usize = rest.first().and_then(|s| s.parse().ok()).unwrap_or(256);
    let iters: u32 = rest.get(1).and_then(|s| s.parse().ok()).unwrap_or(10);
    let len = mib << 20;
    // Before the engine exists, so that its progress thread inherits the core.
    pin(usize::from(target));
    let mut buf = vec![1u8; len];
    let mut config = UcxConfig::new(if target { "bw-target" } else { "bw-init" });
    if std::env::var("TESSERA_UCX_ERR_MODE").is_ok_and(|m| m == "none") {
        config.error_handling = ErrorHandling::None;
    }
    if let Some(us) = std::env::var("TESSERA_UCX_BUSY_POLL_US")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        config.busy_poll = std::time::Duration::from_micros(us);
    }
    let engine = UcxEngine::new(config).expect("engine");
    // SAFETY: `buf` outlives the registration (dropped at the end of main, after `region`).
    let region = unsafe { engine.register(buf.as_mut_ptr(), len as u64) }.expect("register");
    if target {
        announce(&[
            format!("ADDR:{}", hex::encode(engine.address())),
            format!("KEY:{}", hex::encode(region.remote_key())),
        ]);
        drop(region);
        return;
    }
    let mut child = Target::spawn(rest);
    let addr = hex::decode(child.next("ADDR:")).expect("hex");
    let key = hex::decode(child.next("KEY:")).expect("hex");
    let ep = engine.connect("bw-target", &addr).expect("connect");
    ep.add_remote(1, &key).expect("key");
    let op = [RmaOp {
        local: &region,
        local_offset: 0,
        remote: 1,
        remote_offset: 0,
        len: len as u64,
    }];
    let gbps = gbps(len as u64, iters, || {
        ep.put(&op, None).expect("post").wait().expect("put");
    });
    println!("ucx engine put {mib} MiB x {iters}: {gbps:.2} GB/s");
    child.finish();
    drop(ep);
    drop(region);
}
