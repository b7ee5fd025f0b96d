//! Helpers shared by the two-process bandwidth examples (`ucx_put_bw`, `nixl_write_bw`,
//! `ucx_agent_bw`, `nixl_agent_bw`): pin a process to a core, and pass bytes as hex over the
//! target's stdout, spawn the target and time the transfers. The `Agent`-level runner is
//! `agent.rs` beside this file.

use std::io::{BufRead, BufReader, Lines, Write};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Instant;

/// Pins this process to `cpu`.
pub(crate) fn pin(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes inside it; the call
    // only reads the set.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set);
    }
}

/// The target's side of the handshake: prints `lines` for the initiator, then waits until the
/// initiator writes a line or closes this process's stdin.
pub(crate) fn announce(lines: &[String]) {
    for line in lines {
        println!("{line}");
    }
    std::io::stdout().flush().ok();
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

/// The initiator's side: this executable, spawned as the target.
pub(crate) struct Target {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Target {
    /// Spawns this executable with `--target` and `args`.
    pub(crate) fn spawn(args: &[String]) -> Self {
        let exe = std::env::current_exe().expect("exe");
        let mut child = Command::new(exe)
            .arg("--target")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn target");
        let lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        Self { child, lines }
    }

    /// The next line the target announced, without `prefix` (empty once it is gone).
    pub(crate) fn next(&mut self, prefix: &str) -> String {
        let line = self.lines.next().and_then(Result::ok).unwrap_or_default();
        line.trim_start_matches(prefix).to_owned()
    }

    /// Lets the target exit and waits for it.
    pub(crate) fn finish(mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// Runs `transfer` once untimed (it pre-touches both sides), then `iters` times back to back;
/// returns the GB/s of the timed runs, `len` bytes each.
pub(crate) fn gbps(len: u64, iters: u32, mut transfer: impl FnMut()) -> f64 {
    transfer();
    let start = Instant::now();
    for _ in 0..iters {
        transfer();
    }
    let secs = start.elapsed().as_secs_f64();
    (len as f64 * f64::from(iters)) / secs / 1e9
}
