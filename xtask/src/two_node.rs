//! `cargo xtask two-node-test`: two agents in two network namespaces joined by a veth pair.
//!
//! As root it creates the namespaces `tsr2n-a` and `tsr2n-b` with the veth pair
//! `tsr2n-va`/`tsr2n-vb` (10.213.7.1/30 and 10.213.7.2/30; no other traffic), runs one
//! `tessera-transport-peer` in each, and for each of `tcp`, `ucx` (`UCX_TLS=tcp`,
//! `UCX_NET_DEVICES` = the veth) and `nixl` (the same UCX settings):
//!
//! 1. moves 1 GiB each way and compares checksums of what was sent and what arrived;
//! 2. kills the target while a 1 GiB write is in flight: the initiator must report an error
//!    within [`ERROR_BOUND`];
//! 3. starts the target again and moves 64 MiB to it, checked the same way.
//!
//! The namespaces and links are removed afterwards: by a guard on every return path, and by a
//! watcher process (immune to Ctrl-C) that removes them once this process is gone however it
//! ended. Stale ones with the same prefix are removed at start.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use crate::{cargo, deps, step};

const PREFIX: &str = "tsr2n";
const NS_A: &str = "tsr2n-a";
const NS_B: &str = "tsr2n-b";
const VETH_A: &str = "tsr2n-va";
const VETH_B: &str = "tsr2n-vb";
const ADDR_A: &str = "10.213.7.1";
const ADDR_B: &str = "10.213.7.2";
const GIB: u64 = 1 << 30;
/// Each agent's region: its own GiB to send, then room for the GiB it receives.
const REGION: u64 = 2 * GIB;
const RESTART_LEN: u64 = 64 << 20;
/// How long the initiator may take to report a killed target.
const ERROR_BOUND: Duration = Duration::from_secs(30);
/// How long any one command may take before the test calls it hung.
const COMMAND_BOUND: Duration = Duration::from_secs(120);

/// Runs the test; see the module docs.
pub(crate) fn run(root: &Path) -> Result<()> {
    let started = Instant::now();
    preflight()?;
    deps::install(root).context("installing the backends' dependencies (cargo xtask deps)")?;
    let bins = build_peers(root)?;
    cleanup();
    let _net = Net::create()?;
    for (kind, bin) in &bins {
        let t = Instant::now();
        let line = backend(kind, bin).with_context(|| format!("two-node test of {kind}"))?;
        println!(
            "two-node {kind}: {line} ({:.1} s)",
            t.elapsed().as_secs_f64()
        );
    }
    println!(
        "two-node-test: tcp, ucx and nixl passed between {ADDR_A} and {ADDR_B} in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

pub(crate) fn preflight() -> Result<()> {
    let uid = Command::new("id")
        .arg("-u")
        .output()
        .context("running id -u")?;
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
        bail!("this test creates network namespaces and must run as root");
    }
    let ip = Command::new("ip").args(["netns", "list"]).output();
    match ip {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => bail!(
            "`ip netns` is unavailable here ({}): two-node-test needs iproute2 and network \
             namespaces",
            String::from_utf8_lossy(&out.stderr).trim()
        ),
        Err(e) => bail!("`ip` (iproute2) is not installed: {e}; two-node-test needs it"),
    }
}

/// Builds the peer helper once per backend feature and copies each binary aside (they share
/// one output path).
fn build_peers(root: &Path) -> Result<Vec<(&'static str, PathBuf)>> {
    let dir = root.join("target/two-node");
    std::fs::create_dir_all(&dir)?;
    let mut out = Vec::new();
    for (kind, feature) in [("nixl", Some("nixl")), ("tcp", None), ("ucx", Some("ucx"))] {
        let mut args = vec![
            "build",
            "--locked",
            "-p",
            "tessera-engines",
            "--bin",
            "tessera-transport-peer",
        ];
        let features = match feature {
            Some(f) => format!("peer,{f}"),
            None => "peer".to_owned(),
        };
        args.extend(["--features", &features]);
        step(
            &format!("building the peer helper for {kind}"),
            cargo(&args),
        )?;
        let dst = dir.join(format!("peer-{kind}"));
        std::fs::copy(root.join("target/debug/tessera-transport-peer"), &dst)
            .with_context(|| format!("copying the peer helper to {}", dst.display()))?;
        out.push((kind, dst));
    }
    // Run in the order the issue lists them.
    out.sort_by_key(|(k, _)| ["tcp", "ucx", "nixl"].iter().position(|x| x == k));
    Ok(out)
}

pub(crate) fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .with_context(|| format!("running ip {}", args.join(" ")))?;
    if !out.status.success() {
        bail!(
            "ip {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Removes every namespace and link of ours, ignoring what is already gone.
fn cleanup() {
    cleanup_prefix(PREFIX);
}

/// Removes every namespace and link whose name starts with `prefix`, ignoring what is already
/// gone.
pub(crate) fn cleanup_prefix(prefix: &str) {
    if let Ok(out) = Command::new("ip").args(["netns", "list"]).output() {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if let Some(name) = line.split_whitespace().next() {
                if name.starts_with(prefix) {
                    let _ = ip(&["netns", "del", name]);
                }
            }
        }
    }
    if let Ok(out) = Command::new("ip").args(["-o", "link", "show"]).output() {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let name = line.split(':').nth(1).map(str::trim).unwrap_or("");
            let name = name.split('@').next().unwrap_or("");
            if name.starts_with(prefix) {
                let _ = ip(&["link", "del", name]);
            }
        }
    }
}

/// A watcher process that runs the shell `removals` once this process is gone, however it
/// ended. It ignores SIGINT (Ctrl-C reaches the whole process group) and the like.
pub(crate) fn cleanup_watcher(removals: &str) -> Result<Child> {
    let script = format!(
        "trap '' INT TERM HUP; while kill -0 {pid} 2>/dev/null; do sleep 1; done; \
         {removals}; exit 0",
        pid = std::process::id()
    );
    Command::new("sh")
        .args(["-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting the cleanup watcher")
}

/// The namespaces and the veth pair; removed on drop, and by a watcher if this process dies.
struct Net {
    watcher: Option<Child>,
}

impl Net {
    fn create() -> Result<Self> {
        let watcher = cleanup_watcher(&format!(
            "ip netns del {NS_A} 2>/dev/null; ip netns del {NS_B} 2>/dev/null; \
             ip link del {VETH_A} 2>/dev/null"
        ))?;
        let net = Self {
            watcher: Some(watcher),
        };
        for args in [
            vec!["netns", "add", NS_A],
            vec!["netns", "add", NS_B],
            vec![
                "link", "add", VETH_A, "type", "veth", "peer", "name", VETH_B,
            ],
            vec!["link", "set", VETH_A, "netns", NS_A],
            vec!["link", "set", VETH_B, "netns", NS_B],
            vec!["-n", NS_A, "addr", "add", "10.213.7.1/30", "dev", VETH_A],
            vec!["-n", NS_B, "addr", "add", "10.213.7.2/30", "dev", VETH_B],
            vec!["-n", NS_A, "link", "set", VETH_A, "up"],
            vec!["-n", NS_B, "link", "set", VETH_B, "up"],
            vec!["-n", NS_A, "link", "set", "lo", "up"],
            vec!["-n", NS_B, "link", "set", "lo", "up"],
        ] {
            ip(&args)?;
        }
        println!(
            "two-node: namespaces {NS_A} ({ADDR_A} on {VETH_A}) and {NS_B} ({ADDR_B} on {VETH_B})"
        );
        Ok(net)
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        cleanup();
        if let Some(mut w) = self.watcher.take() {
            let _ = w.kill();
            let _ = w.wait();
        }
        println!("two-node: namespaces and veth pair removed");
    }
}

/// One agent process inside a namespace.
struct Node {
    name: &'static str,
    proc: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    meta: String,
    reg: u64,
}

impl Node {
    fn spawn(bin: &Path, kind: &str, ns: &str, name: &'static str) -> Result<Self> {
        let (addr, dev) = if ns == NS_A {
            (ADDR_A, VETH_A)
        } else {
            (ADDR_B, VETH_B)
        };
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", ns])
            .arg(bin)
            .args([kind, &REGION.to_string(), name])
            .env("UCX_MODULES", "^ib")
            .env("UCX_TLS", "tcp")
            .env("UCX_NET_DEVICES", dev)
            .env("TESSERA_PEER_TCP_BIND", format!("{addr}:0"))
            // tcp off loopback needs a token (shm and tcp peers prove it to each other).
            .env("TESSERA_TOKEN", "tessera-two-node-test")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut proc = cmd
            .spawn()
            .with_context(|| format!("starting {name} in {ns}"))?;
        let stdin = proc.stdin.take().ok_or_else(|| anyhow!("no stdin"))?;
        let stdout = proc.stdout.take().ok_or_else(|| anyhow!("no stdout"))?;
        let lines = lines_of(stdout);
        let mut node = Self {
            name,
            proc,
            stdin,
            lines,
            meta: String::new(),
            reg: 0,
        };
        let meta = node.answer(COMMAND_BOUND)?;
        let reg = node.answer(COMMAND_BOUND)?;
        node.meta = meta
            .strip_prefix("META ")
            .ok_or_else(|| anyhow!("{name}: expected META, got {meta:?}"))?
            .to_owned();
        node.reg = reg
            .strip_prefix("REG ")
            .and_then(|r| r.parse().ok())
            .ok_or_else(|| anyhow!("{name}: expected REG, got {reg:?}"))?;
        Ok(node)
    }

    fn send(&mut self, line: &str) -> Result<()> {
        writeln!(self.stdin, "{line}")?;
        self.stdin.flush()?;
        Ok(())
    }

    fn answer(&mut self, bound: Duration) -> Result<String> {
        self.lines
            .recv_timeout(bound)
            .map_err(|e| anyhow!("{}: no answer within {bound:?} ({e})", self.name))
    }

    fn cmd(&mut self, line: &str) -> Result<String> {
        self.send(line)?;
        self.answer(COMMAND_BOUND)
    }

    fn expect(&mut self, line: &str, want: &str) -> Result<()> {
        let got = self.cmd(line)?;
        if got != want {
            bail!(
                "{}: {} answered {got:?}, expected {want:?}",
                self.name,
                line.split(' ').next().unwrap_or(line)
            );
        }
        Ok(())
    }

    fn sum(&mut self, offset: u64, len: u64) -> Result<String> {
        let got = self.cmd(&format!("SUM {offset} {len}"))?;
        got.strip_prefix("SUM ")
            .map(str::to_owned)
            .ok_or_else(|| anyhow!("{}: SUM answered {got:?}", self.name))
    }

    fn kill(&mut self) {
        let _ = self.proc.kill();
        let _ = self.proc.wait();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The lines a child writes to `stdout`, read on a thread of their own.
pub(crate) fn lines_of(stdout: std::process::ChildStdout) -> Receiver<String> {
    let (tx, lines) = channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    lines
}

/// Adds each node's metadata to the other.
fn introduce(a: &mut Node, b: &mut Node) -> Result<()> {
    let (ma, mb) = (a.meta.clone(), b.meta.clone());
    a.expect(&format!("ADD {mb}"), "ADDED")?;
    b.expect(&format!("ADD {ma}"), "ADDED")?;
    Ok(())
}

/// `from` writes `len` bytes of its region at `src` into `to`'s region at `dst`; the
/// checksums of both ranges must agree.
fn push_checked(from: &mut Node, to: &mut Node, src: u64, dst: u64, len: u64) -> Result<f64> {
    let t = Instant::now();
    from.expect(&format!("PUSHFROM {src} {} {dst} {len}", to.reg), "PUSHED")?;
    let secs = t.elapsed().as_secs_f64();
    let sent = from.sum(src, len)?;
    let got = to.sum(dst, len)?;
    if sent != got {
        bail!(
            "checksum mismatch {} -> {}: sent {sent}, received {got}",
            from.name,
            to.name
        );
    }
    Ok(len as f64 / secs / 1e9)
}

fn backend(kind: &str, bin: &Path) -> Result<String> {
    let mut a = Node::spawn(bin, kind, NS_A, "node-a")?;
    let mut b = Node::spawn(bin, kind, NS_B, "node-b")?;
    a.expect(&format!("FILL 1 {GIB}"), "FILLED")?;
    b.expect(&format!("FILL 2 {GIB}"), "FILLED")?;
    introduce(&mut a, &mut b)?;
    let ab = push_checked(&mut a, &mut b, 0, GIB, GIB)?;
    let ba = push_checked(&mut b, &mut a, 0, GIB, GIB)?;

    // Kill the target while a 1 GiB write to it is in flight.
    a.send(&format!("PUSHFROM 0 {} {GIB} {GIB}", b.reg))?;
    std::thread::sleep(Duration::from_millis(50));
    let killed = Instant::now();
    b.kill();
    let answer = a
        .answer(ERROR_BOUND)
        .context("the initiator did not report the killed target in time")?;
    let waited = killed.elapsed();
    let error = if answer.starts_with("ERR") {
        answer
    } else {
        // The write finished before the kill landed: the next one must fail.
        let again = a.cmd(&format!("PUSHFROM 0 {} 0 {GIB}", b.reg))?;
        if !again.starts_with("ERR") {
            bail!("writes to a killed target still succeed: {again:?}");
        }
        again
    };
    println!(
        "two-node {kind}: target killed mid-transfer, initiator reported after {:.2} s: {error}",
        waited.as_secs_f64()
    );

    // A restarted target works again.
    let mut b2 = Node::spawn(bin, kind, NS_B, "node-b")?;
    introduce(&mut a, &mut b2)?;
    let restarted = push_checked(&mut a, &mut b2, 0, 0, RESTART_LEN)?;
    drop(b2);
    drop(a);
    Ok(format!(
        "1 GiB a->b {ab:.2} GB/s, b->a {ba:.2} GB/s, checksums equal; killed target reported in \
         {:.2} s; restarted target took 64 MiB ({restarted:.2} GB/s)",
        waited.as_secs_f64()
    ))
}
