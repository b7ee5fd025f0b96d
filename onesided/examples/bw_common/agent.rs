//! Two-process WRITE bandwidth through the `Agent` API, shared by the `ucx_agent_bw` and
//! `nixl_agent_bw` examples: the initiator (pinned to cpu 0) spawns itself as the target
//! (pinned to cpu 1); both pre-touch their SIZE (256 MiB by default); after one untimed write, `ITERS` writes
//! are timed back to back and the average is printed as `GBPS <value>`.

use crate::bw_common::{announce, gbps, pin, Target};

use tessera_transport::{Agent, Op, Region, RemoteDesc};

/// Runs the initiator or, with `--target`, the target. `make` builds the agent.
pub(crate) fn main(make: impl Fn(&str) -> Agent) {
    let args: Vec<String> = std::env::args().collect();
    let target = args.get(1).is_some_and(|a| a == "--target");
    let rest = if target { &args[2..] } else { &args[1..] };
    // SIZE in MiB, or in KiB with a `K` suffix (`64K`).
    let len: u64 = rest
        .first()
        .and_then(|s| match s.strip_suffix('K') {
            Some(kib) => kib.parse::<u64>().ok().map(|k| k << 10),
            None => s.parse::<u64>().ok().map(|m| m << 20),
        })
        .unwrap_or(256 << 20);
    let iters: u32 = rest.get(1).and_then(|s| s.parse().ok()).unwrap_or(5);
    // Before the engine exists, so that its threads inherit the core.
    pin(usize::from(target));
    let agent = make(if target { "bw-target" } else { "bw-init" });
    let region = Region::new(len).expect("region");
    region.fill(0, len, 0x5a).expect("pre-touch");
    let reg = agent.register(&region).expect("register");
    if target {
        announce(&[
            format!("META {}", hex::encode(agent.metadata())),
            format!("REG {}", reg.id()),
        ]);
        return;
    }
    let mut child = Target::spawn(rest);
    let meta = hex::decode(child.next("META ")).expect("hex");
    let remote_reg: u64 = child.next("REG ").parse().expect("target registration");
    let peer = agent.add_remote(&meta).expect("add the target");
    let prepared = peer
        .prepare(
            Op::Write,
            &[reg.desc(0, len).expect("local")],
            &[RemoteDesc::new(remote_reg, 0, len)],
        )
        .expect("prepare");
    let gbps = gbps(len, iters, || {
        prepared.post(None).expect("post").wait().expect("write");
    });
    println!("GBPS {gbps:.4}");
    child.finish();
}
