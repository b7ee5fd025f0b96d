//! `cargo xtask cluster-test`: a cluster of storage units found through etcd, across network
//! namespaces joined by a bridge.
//!
//! As root it creates six namespaces `tsrcl-h1` .. `tsrcl-h6` on the bridge `tsrcl-br`
//! (10.213.8.1 .. 10.213.8.6/24, nothing else on it): etcd in h1, the units u0, u1 and u2 in
//! h2 .. h4, the client host in h5 (`tessera-cluster-probe`, driven line by line), and in h6
//! the unit that joins later. Over `tcp`, then `ucx` (`UCX_TLS=tcp` on each namespace's link),
//! with two replicas and a 2 s lease:
//!
//! 1. the client PUTs 2,000 values of 16 KiB and reads them back byte for byte;
//! 2. u1 is killed with SIGKILL: every value still reads back, within [`READ_BOUND`], and the
//!    client stops routing to u1 within twice the lease; a repair brings every key back to
//!    two copies on the live units;
//! 3. u3 starts in h6: the client finds it without a restart, new keys land on it, and a repair
//!    moves it its share of the old ones;
//! 4. etcd is stopped for 10 s: reads, writes and repairs go on (none needs etcd), the client
//!    says its set is stale; etcd restarted, the set is fresh again;
//! 5. u3's link is taken down: reads go on (the client falls over after its 3 s timeout), u3
//!    leaves the set when its lease expires; its link back up, it registers again, a repair
//!    gives it back what it missed, and every value reads back.
//!
//! Everything is removed afterwards: the processes by their ids, the namespaces and links by a
//! guard on every return path and by a watcher process that outlives this one.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use crate::two_node::{cleanup_prefix, cleanup_watcher, ip, lines_of, preflight};
use crate::{cargo, deps, step};

const PREFIX: &str = "tsrcl";
const BRIDGE: &str = "tsrcl-br";
const HOSTS: usize = 6;
const ETCD_HOST: usize = 1;
const CLIENT_HOST: usize = 5;
const LATE_HOST: usize = 6;
const CLUSTER: &str = "tsrcl";
const TOKEN: &str = "tessera-cluster-test";
const LEASE: Duration = Duration::from_secs(2);
/// Values the client stores first.
const FIRST: u64 = 2000;
/// How long reading every value may take right after a unit died or was cut off.
const READ_BOUND: Duration = Duration::from_secs(60);
/// How long any one command may take before the test calls it hung.
const COMMAND_BOUND: Duration = Duration::from_secs(120);

fn ns(host: usize) -> String {
    format!("{PREFIX}-h{host}")
}

fn addr(host: usize) -> String {
    format!("10.213.8.{host}")
}

/// The link of `host` inside its namespace.
fn link(host: usize) -> String {
    format!("{PREFIX}-p{host}")
}

fn etcd_url() -> String {
    format!("http://{}:2379", addr(ETCD_HOST))
}

/// Link rate of each unit's host in the benchmark, both ways.
const BENCH_RATE: &str = "1gbit";
/// Values of the benchmark: 256 of 4 MiB, 1 GiB.
const BENCH_VALUES: u64 = 256;
const BENCH_VALUE_BYTES: u64 = 4 << 20;

/// `cargo xtask bench cluster`: the namespaces of the test, each unit host's link shaped to
/// [`BENCH_RATE`] both ways (tbf), so that the links, not these cores, bound throughput. GET
/// of 1 GiB from one client host spread over 1, 2 and 3 units; PUT of 1 GiB with one and
/// two replicas over 3 units; the time from a unit's SIGKILL to the client no longer routing
/// to it, beside the lease; the time from a unit's start to the client using it. Writes
/// `target/tessera-bench/cluster.json` and `.md`.
pub(crate) fn bench(root: &Path) -> Result<()> {
    preflight()?;
    ensure_tools()?;
    let dir = build_one(root, "tcp", "etcd", true)?;
    cleanup_prefix(PREFIX);
    let _net = Net::create()?;
    for h in 2..=4 {
        // Both ways: the unit's own end (GETs) and the bridge's end (PUTs).
        shape(Some(h), &link(h))?;
        shape(None, &format!("{PREFIX}-v{h}"))?;
    }
    let gib = (BENCH_VALUES * BENCH_VALUE_BYTES) as f64;
    let value_bytes = BENCH_VALUE_BYTES.to_string();
    // Three requests of 16 values (64 MiB) in flight, so that every unit's link stays busy
    // while the slowest unit of one request finishes its share (within a session's 256 MiB
    // lease limit, were all of one unit).
    let probe_args = |r: &'static str| -> Vec<String> {
        [
            "--replicas",
            r,
            "--timeout",
            "60s",
            "--value-bytes",
            &value_bytes,
            "--per-request",
            "16",
            "--in-flight",
            "3",
            "--recv-pool",
            "512MiB",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect()
    };
    let mut m: Vec<(String, f64)> = Vec::new();
    let all = format!("0 {BENCH_VALUES}");
    // GET over 1, 2 and 3 units.
    for n in 1..=3usize {
        let mut etcd = Etcd::start()?;
        let units: Vec<Proc> = (0..n)
            .map(|k| unit_sized(&dir, "tcp", 2 + k, &format!("u{k}"), "2GiB", "1700MiB"))
            .collect::<Result<_>>()?;
        let args = probe_args("1");
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut probe = Probe::start_with(&dir, "tcp", &args)?;
        let names: Vec<String> = (0..n).map(|k| format!("u{k}")).collect();
        probe.timed(&format!("WAIT {} 20000", names.join(",")))?;
        probe.timed(&format!("PUT {all}"))?;
        let best = (0..2)
            .map(|_| probe.timed(&format!("READ {all}")))
            .collect::<Result<Vec<u64>>>()?
            .into_iter()
            .min()
            .unwrap_or(u64::MAX);
        let gbps = gib / (best as f64 / 1e3) / 1e9;
        println!("cluster bench: GET 1 GiB over {n} unit(s): {gbps:.3} GB/s");
        m.push((format!("cluster_get_{n}u_gbps"), gbps));
        drop(probe);
        drop(units);
        etcd.stop()?;
    }
    let one = m[0].1;
    m.push(("cluster_scaling_3u".into(), m[2].1 / (3.0 * one)));
    // PUT with one and two replicas over 3 units, then failover and join.
    let mut etcd = Etcd::start()?;
    let mut units: Vec<Proc> = (0..3)
        .map(|k| unit_sized(&dir, "tcp", 2 + k, &format!("u{k}"), "2GiB", "1700MiB"))
        .collect::<Result<_>>()?;
    for r in ["1", "2"] {
        let args = probe_args(r);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut probe = Probe::start_with(&dir, "tcp", &args)?;
        probe.timed("WAIT u0,u1,u2 20000")?;
        let ms = probe.timed(&format!("PUT {all}"))?;
        let gbps = gib / (ms as f64 / 1e3) / 1e9;
        println!("cluster bench: PUT 1 GiB with {r} replica(s) over 3 units: {gbps:.3} GB/s");
        m.push((format!("cluster_put_r{r}_gbps"), gbps));
        probe.timed("DROP")?;
    }
    let (r1, r2) = (m[m.len() - 2].1, m[m.len() - 1].1);
    m.push(("cluster_put_r2_vs_r1".into(), r2 / r1));
    let mut probe = Probe::start(&dir, "tcp")?;
    probe.timed("WAIT u0,u1,u2 20000")?;
    units[1].signal("KILL")?;
    let failover = probe.timed(&format!("WAIT u0,u2 {}", (LEASE * 4).as_millis()))?;
    m.push(("cluster_failover_ms".into(), failover as f64));
    m.push(("cluster_lease_ttl_ms".into(), LEASE.as_millis() as f64));
    let t = Instant::now();
    units.push(unit(&dir, "tcp", LATE_HOST, "u3")?);
    probe.timed("WAIT u0,u2,u3 20000")?;
    m.push(("cluster_join_ms".into(), t.elapsed().as_secs_f64() * 1e3));
    drop(probe);
    drop(units);
    etcd.stop()?;
    write_bench(root, &m)
}

/// Shapes `dev` (in the namespace of `host`, or the root one) to [`BENCH_RATE`] with tbf.
fn shape(host: Option<usize>, dev: &str) -> Result<()> {
    let mut cmd = match host {
        Some(h) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", &ns(h), "tc"]);
            c
        }
        None => Command::new("tc"),
    };
    cmd.args([
        "qdisc", "add", "dev", dev, "root", "tbf", "rate", BENCH_RATE,
    ])
    .args(["burst", "4mbit", "latency", "100ms"]);
    let ok = cmd.status().context("running tc")?.success();
    if !ok {
        bail!("shaping {dev} with tc failed");
    }
    Ok(())
}

/// Writes the benchmark's figures as the harness writes a suite's.
fn write_bench(root: &Path, m: &[(String, f64)]) -> Result<()> {
    let dir = root.join("target/tessera-bench");
    std::fs::create_dir_all(&dir)?;
    let map: serde_json::Map<String, serde_json::Value> = m
        .iter()
        .map(|(k, v)| (k.clone(), serde_json::json!((v * 1e4).round() / 1e4)))
        .collect();
    std::fs::write(
        dir.join("cluster.json"),
        serde_json::to_string_pretty(&map)? + "\n",
    )?;
    let mut md = String::from("| metric | value |\n|---|---:|\n");
    for (k, v) in m {
        md.push_str(&format!("| `{k}` | {v:.3} |\n"));
    }
    std::fs::write(dir.join("cluster.md"), &md)?;
    print!("{md}");
    println!("wrote {}", dir.join("cluster.json").display());
    Ok(())
}

/// etcd, etcdctl (its health check) and protoc (the etcd client's build), from apt.
fn ensure_tools() -> Result<()> {
    deps::ensure_apt("etcd-server", "the cluster test runs etcd")?;
    deps::ensure_apt(
        "etcd-client",
        "the cluster test asks etcd whether it is healthy",
    )?;
    deps::ensure_apt("protobuf-compiler", "the etcd client's build needs protoc")
}

/// Runs the test; see the module docs.
pub(crate) fn run(root: &Path) -> Result<()> {
    let started = Instant::now();
    preflight()?;
    ensure_tools()?;
    deps::install(root).context("installing the backends' dependencies (cargo xtask deps)")?;
    let builds = build(root)?;
    cleanup_prefix(PREFIX);
    let _net = Net::create()?;
    for (backend, dir) in &builds {
        let t = Instant::now();
        let summary =
            scenario(backend, dir).with_context(|| format!("cluster test over {backend}"))?;
        println!(
            "cluster {backend}: {summary} ({:.1} s)",
            t.elapsed().as_secs_f64()
        );
    }
    println!(
        "cluster-test: tcp and ucx passed across {HOSTS} namespaces in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Builds the unit binary and the probe per backend and copies them aside (one output path).
fn build(root: &Path) -> Result<Vec<(&'static str, PathBuf)>> {
    [("tcp", "etcd"), ("ucx", "etcd,ucx")]
        .into_iter()
        .map(|(backend, features)| Ok((backend, build_one(root, backend, features, false)?)))
        .collect()
}

/// The unit binary and the probe built with `features` (in release for a benchmark), copied
/// to `target/cluster-test/<backend>`.
fn build_one(root: &Path, backend: &str, features: &str, release: bool) -> Result<PathBuf> {
    let mut args = vec!["build", "--locked", "-p", "tessera-storage-cli", "--bins"];
    args.extend(["--features", features]);
    if release {
        args.push("--release");
    }
    step(
        &format!("building the unit and the probe for {backend}"),
        cargo(&args),
    )?;
    let profile = if release { "release" } else { "debug" };
    let dir = root.join(format!("target/cluster-test/{backend}-{profile}"));
    std::fs::create_dir_all(&dir)?;
    for bin in ["tessera-storage", "tessera-cluster-probe"] {
        std::fs::copy(root.join("target").join(profile).join(bin), dir.join(bin))
            .with_context(|| format!("copying {bin} to {}", dir.display()))?;
    }
    Ok(dir)
}

/// The namespaces, their links and the bridge; removed on drop, and by a watcher if this
/// process dies.
struct Net {
    watcher: Option<Child>,
}

impl Net {
    fn create() -> Result<Self> {
        let dels: String = (1..=HOSTS)
            .map(|h| format!("ip netns del {} 2>/dev/null; ", ns(h)))
            .collect();
        let watcher = cleanup_watcher(&format!("{dels}ip link del {BRIDGE} 2>/dev/null"))?;
        let net = Self {
            watcher: Some(watcher),
        };
        ip(&["link", "add", BRIDGE, "type", "bridge"])?;
        ip(&["link", "set", BRIDGE, "up"])?;
        for h in 1..=HOSTS {
            let (ns, outer, inner) = (ns(h), format!("{PREFIX}-v{h}"), link(h));
            let cidr = format!("{}/24", addr(h));
            for args in [
                vec!["netns", "add", &ns],
                vec![
                    "link", "add", &outer, "type", "veth", "peer", "name", &inner,
                ],
                vec!["link", "set", &outer, "master", BRIDGE],
                vec!["link", "set", &outer, "up"],
                vec!["link", "set", &inner, "netns", &ns],
                vec!["-n", &ns, "addr", "add", &cidr, "dev", &inner],
                vec!["-n", &ns, "link", "set", &inner, "up"],
                vec!["-n", &ns, "link", "set", "lo", "up"],
            ] {
                ip(&args)?;
            }
        }
        println!("cluster: namespaces {} .. {} on {BRIDGE}", ns(1), ns(HOSTS));
        Ok(net)
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        cleanup_prefix(PREFIX);
        if let Some(mut w) = self.watcher.take() {
            let _ = w.kill();
            let _ = w.wait();
        }
        println!("cluster: namespaces, links and bridge removed");
    }
}

/// A command run in a namespace, with the test's environment for `backend`.
fn in_ns(host: usize, backend: &str, program: &Path) -> Command {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &ns(host)])
        .arg(program)
        .env("TESSERA_TOKEN", TOKEN)
        .env("UCX_MODULES", "^ib")
        .env("UCX_NET_DEVICES", link(host))
        .env_remove("RUST_LOG");
    if backend == "ucx" {
        cmd.env("UCX_TLS", "tcp");
    }
    cmd
}

/// A process of the test, killed by its id when dropped.
struct Proc {
    name: String,
    child: Child,
}

impl Proc {
    fn signal(&mut self, signal: &str) -> Result<()> {
        let pid = self.child.id().to_string();
        let ok = Command::new("kill")
            .args([&format!("-{signal}"), &pid])
            .status()?
            .success();
        if !ok {
            bail!("kill -{signal} {pid} ({}) failed", self.name);
        }
        Ok(())
    }

    /// SIGTERM, then waits (SIGKILL after 10 s).
    fn stop(&mut self) -> Result<()> {
        self.signal("TERM")?;
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(10) {
            if self.child.try_wait()?.is_some() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
        Ok(())
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// etcd in its namespace, on its data directory (kept across a restart, removed on drop).
struct Etcd {
    data: PathBuf,
    proc: Option<Proc>,
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.proc = None;
        let _ = std::fs::remove_dir_all(&self.data);
    }
}

impl Etcd {
    fn start() -> Result<Self> {
        let data =
            std::env::temp_dir().join(format!("tessera-cluster-etcd-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&data);
        let mut etcd = Self { data, proc: None };
        etcd.resume()?;
        Ok(etcd)
    }

    fn resume(&mut self) -> Result<()> {
        let client = etcd_url();
        let peer = format!("http://{}:2380", addr(ETCD_HOST));
        let child = in_ns(ETCD_HOST, "tcp", Path::new("etcd"))
            .args(["--name", "tsrcl"])
            .arg("--data-dir")
            .arg(&self.data)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("tsrcl={peer}")])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting etcd")?;
        self.proc = Some(Proc {
            name: "etcd".into(),
            child,
        });
        let t = Instant::now();
        loop {
            let healthy = in_ns(ETCD_HOST, "tcp", Path::new("etcdctl"))
                .args(["--endpoints", &client, "endpoint", "health"])
                .env("ETCDCTL_API", "3")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if healthy {
                return Ok(());
            }
            if t.elapsed() > Duration::from_secs(30) {
                bail!("etcd was not healthy within 30 s");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn stop(&mut self) -> Result<()> {
        if let Some(mut p) = self.proc.take() {
            p.stop()?;
        }
        Ok(())
    }
}

/// A unit in its namespace, announced in the cluster as `name`.
fn unit(dir: &Path, backend: &str, host: usize, name: &str) -> Result<Proc> {
    unit_sized(dir, backend, host, name, "512MiB", "400MiB")
}

/// A unit with `pool` bytes of registered memory and room for `capacity` bytes of values.
fn unit_sized(
    dir: &Path,
    backend: &str,
    host: usize,
    name: &str,
    pool: &str,
    capacity: &str,
) -> Result<Proc> {
    let a = addr(host);
    let mut cmd = in_ns(host, backend, &dir.join("tessera-storage"));
    cmd.args(["serve", "--announce", "--backend", backend])
        .args(["--bind", &format!("{a}:7470")])
        .args(["--etcd", &etcd_url(), "--cluster", CLUSTER, "--name", name])
        .args(["--lease-ttl", &format!("{}s", LEASE.as_secs())])
        .args(["--pool", pool, "--capacity", capacity])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if backend == "tcp" {
        cmd.args(["--payload-addr", &format!("{a}:0")]);
    }
    let mut child = cmd.spawn().with_context(|| format!("starting {name}"))?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?)
        .read_line(&mut line)?;
    if !line.starts_with("listening ") {
        let _ = child.kill();
        let _ = child.wait();
        bail!("{name} did not start: {line:?}");
    }
    Ok(Proc {
        name: name.to_owned(),
        child,
    })
}

/// The client host's probe, one command per line.
struct Probe {
    /// Killed by its id when the probe is dropped.
    _proc: Proc,
    stdin: ChildStdin,
    lines: Receiver<String>,
}

impl Probe {
    fn start(dir: &Path, backend: &str) -> Result<Self> {
        Self::start_with(dir, backend, &["--replicas", "2", "--timeout", "3s"])
    }

    fn start_with(dir: &Path, backend: &str, args: &[&str]) -> Result<Self> {
        let mut cmd = in_ns(CLIENT_HOST, backend, &dir.join("tessera-cluster-probe"));
        cmd.args([
            "--etcd",
            &etcd_url(),
            "--cluster",
            CLUSTER,
            "--backend",
            backend,
        ])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
        if backend == "tcp" {
            cmd.args(["--payload-addr", &format!("{}:0", addr(CLIENT_HOST))]);
        }
        let mut child = cmd.spawn().context("starting the probe")?;
        let stdin = child.stdin.take().ok_or_else(|| anyhow!("no stdin"))?;
        let stdout = child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?;
        let lines = lines_of(stdout);
        let mut probe = Self {
            _proc: Proc {
                name: "probe".into(),
                child,
            },
            stdin,
            lines,
        };
        let ready = probe.answer()?;
        if ready != "READY" {
            bail!("the probe did not start: {ready:?}");
        }
        Ok(probe)
    }

    fn answer(&mut self) -> Result<String> {
        self.lines
            .recv_timeout(COMMAND_BOUND)
            .map_err(|e| anyhow!("the probe gave no answer within {COMMAND_BOUND:?} ({e})"))
    }

    /// Sends `line`; the answer after `OK `, or an error naming the command.
    fn ok(&mut self, line: &str) -> Result<String> {
        writeln!(self.stdin, "{line}")?;
        self.stdin.flush()?;
        let got = self.answer()?;
        match got.strip_prefix("OK") {
            Some(rest) => Ok(rest.trim().to_owned()),
            None => bail!("{line}: {got}"),
        }
    }

    /// Milliseconds the command took, as the probe said.
    fn timed(&mut self, line: &str) -> Result<u64> {
        let rest = self.ok(line)?;
        let ms = rest.split_whitespace().last().unwrap_or_default();
        ms.parse()
            .map_err(|_| anyhow!("{line}: no time in {rest:?}"))
    }

    fn line(&mut self, line: &str) -> Result<String> {
        writeln!(self.stdin, "{line}")?;
        self.stdin.flush()?;
        self.answer()
    }

    /// Keys per unit name.
    fn keys(&mut self) -> Result<Vec<(String, Option<u64>)>> {
        let got = self.line("KEYS")?;
        let list = got
            .strip_prefix("KEYS ")
            .ok_or_else(|| anyhow!("KEYS: {got}"))?;
        Ok(list
            .split(',')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.parse().ok()))
            .collect())
    }

    /// `REPAIR a b`: (checked, copies, lost).
    fn repair(&mut self, a: u64, b: u64) -> Result<(u64, u64, u64)> {
        let rest = self.ok(&format!("REPAIR {a} {b}"))?;
        let n: Vec<u64> = rest
            .split_whitespace()
            .map(|w| w.parse().unwrap_or(u64::MAX))
            .collect();
        match n.as_slice() {
            [checked, copies, lost, _] => Ok((*checked, *copies, *lost)),
            _ => bail!("REPAIR: {rest}"),
        }
    }
}

fn within(what: &str, ms: u64, bound: Duration) -> Result<()> {
    if Duration::from_millis(ms) > bound {
        bail!("{what} took {ms} ms, more than {bound:?}");
    }
    Ok(())
}

fn scenario(backend: &str, dir: &Path) -> Result<String> {
    let mut etcd = Etcd::start()?;
    let _u0 = unit(dir, backend, 2, "u0")?;
    let mut u1 = unit(dir, backend, 3, "u1")?;
    let _u2 = unit(dir, backend, 4, "u2")?;
    let mut probe = Probe::start(dir, backend)?;
    let wait = |p: &mut Probe, names: &str, bound: Duration| -> Result<u64> {
        p.timed(&format!("WAIT {names} {}", bound.as_millis()))
    };
    wait(&mut probe, "u0,u1,u2", Duration::from_secs(20))?;

    // 1. 2,000 values, two copies each.
    let put_ms = probe.timed(&format!("PUT 0 {FIRST}"))?;
    probe.timed(&format!("CHECK 0 {FIRST}"))?;

    // 2. u1 killed: every value still reads back; u1 leaves the set; a repair restores r = 2.
    u1.signal("KILL")?;
    let _ = u1.child.wait();
    let read_after_kill = probe.timed(&format!("CHECK 0 {FIRST}"))?;
    within(
        "reading every value after u1 died",
        read_after_kill,
        READ_BOUND,
    )?;
    let failover = wait(&mut probe, "u0,u2", LEASE * 2 + Duration::from_secs(1))?;
    let (checked, copies, lost) = probe.repair(0, FIRST)?;
    if checked != FIRST || lost != 0 || copies == 0 {
        bail!("repair after u1 died: checked {checked}, copied {copies}, lost {lost}");
    }
    let total: u64 = probe.keys()?.iter().filter_map(|(_, k)| *k).sum();
    if total != 2 * FIRST {
        bail!(
            "after the repair the units hold {total} keys, not {}",
            2 * FIRST
        );
    }

    // 3. u3 joins: found without a restart, new keys land on it.
    let mut u3 = unit(dir, backend, LATE_HOST, "u3")?;
    let join = wait(&mut probe, "u0,u2,u3", Duration::from_secs(20))?;
    probe.timed(&format!("PUT {FIRST} {}", FIRST + 600))?;
    probe.timed(&format!("CHECK 0 {}", FIRST + 600))?;
    let on_u3 = probe
        .keys()?
        .into_iter()
        .find(|(n, _)| n == "u3")
        .and_then(|(_, k)| k)
        .unwrap_or(0);
    if on_u3 == 0 {
        bail!("u3 received none of the new keys");
    }
    let (_, moved, lost) = probe.repair(0, FIRST + 600)?;
    if lost != 0 {
        bail!("repair after u3 joined lost {lost}");
    }

    // 4. etcd down for 10 s: nothing that needs no etcd fails.
    etcd.stop()?;
    let down = Instant::now();
    probe.timed(&format!("CHECK 0 {}", FIRST + 600))?;
    probe.timed(&format!("PUT {} {}", FIRST + 600, FIRST + 700))?;
    probe.timed(&format!("CHECK {} {}", FIRST + 600, FIRST + 700))?;
    while down.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(200));
    }
    let units = probe.line("UNITS")?;
    if !units.starts_with("UNITS u0,u2,u3 STALE ") || units.ends_with(" -") {
        bail!("with etcd down for 10 s the client says {units:?}");
    }
    etcd.resume()?;
    let fresh = wait(&mut probe, "u0,u2,u3", Duration::from_secs(30))?;

    // 5. u3 cut off: reads fall over, u3 leaves; back, it registers again and is repaired.
    ip(&[
        "-n",
        &ns(LATE_HOST),
        "link",
        "set",
        &link(LATE_HOST),
        "down",
    ])?;
    let read_cut = probe.timed(&format!("CHECK 0 {}", FIRST + 700))?;
    within("reading every value with u3 cut off", read_cut, READ_BOUND)?;
    wait(&mut probe, "u0,u2", LEASE * 2 + Duration::from_secs(5))?;
    probe.timed(&format!("PUT {} {}", FIRST + 700, FIRST + 800))?;
    ip(&["-n", &ns(LATE_HOST), "link", "set", &link(LATE_HOST), "up"])?;
    let rejoin = wait(&mut probe, "u0,u2,u3", Duration::from_secs(30))?;
    let (_, back, lost) = probe.repair(0, FIRST + 800)?;
    if lost != 0 {
        bail!("repair after u3 came back lost {lost}");
    }
    probe.timed(&format!("CHECK 0 {}", FIRST + 800))?;
    u3.stop()?;
    drop(probe);
    etcd.stop()?;
    Ok(format!(
        "2,000 values put in {put_ms} ms; u1 killed: all read back in {read_after_kill} ms, \
         dropped after {failover} ms (lease {} s), repair copied {copies}; u3 found after \
         {join} ms, holds {on_u3} new keys, repair moved {moved}; etcd down 10 s: nothing \
         failed, fresh {fresh} ms after restart; u3 cut off: all read back in {read_cut} ms, \
         rejoined after {rejoin} ms, repair copied {back}",
        LEASE.as_secs()
    ))
}
