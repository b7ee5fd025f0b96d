//! The `transport` suite: two processes pinned to different cores, moving registered memory
//! over `shm` and `tcp`, against a single-thread memcpy and a raw TCP stream between the same
//! two processes, measured in the same run; then the `ucx` and `nixl` backends (their
//! examples) and `ucx_perftest`, at 256 MiB and across the sizes of the throughput figure.
//!
//! The second process is this very binary, started again with `TESSERA_BENCH_TRANSPORT_PEER`
//! set: it runs `peer_main` instead of the suites.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use tessera_engines::EngineKind;
use tessera_transport::{
    coalesce, Agent, Loc, LocalDesc, Op, Pair, Peer, Region, Registration, RemoteDesc,
};

use crate::cpu::{affinity, pin, restore_affinity};
use crate::report::{Line, Series};
use crate::timing::{best_of, us};
use crate::Report;

const PEER_ENV: &str = "TESSERA_BENCH_TRANSPORT_PEER";
const MIB: u64 = 1 << 20;
const BIG: u64 = 256 * MIB;
/// The peer's region: 256 MiB for the large transfers, then room for scattered slots.
const PEER_REGION: u64 = BIG + 16 * MIB;
const SCATTER_N: u64 = 1000;
const SCATTER_SZ: u64 = 4096;
const VIEWS_N: u64 = 10_000;
const VIEWS_SZ: u64 = 1024;
const RUNS_BIG: usize = 5;
const RUNS_SMALL: usize = 30;
/// The raw stream moves its 256 MiB in calls of this size (one 256 MiB call measured slower).
const RAW_CHUNK: usize = 1 << 20;
const PARENT_CPU: usize = 0;
const PEER_CPU: usize = 1;

/// Runs the suite, or the peer process when started as one.
pub fn run(report: &mut Report) -> Result<()> {
    if let Ok(kind) = std::env::var(PEER_ENV) {
        let code = match peer_main(&kind) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("transport bench peer: {e:#}");
                1
            }
        };
        std::process::exit(code);
    }
    let saved = affinity();
    pin(PARENT_CPU)?;
    let result = suite(report);
    if let Some(mask) = saved {
        restore_affinity(&mask);
    }
    result
}

fn suite(report: &mut Report) -> Result<()> {
    let pinned = format!("parent pinned to cpu {PARENT_CPU}, peer process to cpu {PEER_CPU}");
    let interleaved = format!(
        "best of {RUNS_BIG}, rounds interleaved with its reference after one untimed warm-up"
    );

    // shm against memcpy, rounds interleaved so that load from other work hits both alike.
    let shm = Session::start("shm")?;
    let mut copy = Memcpy::new();
    let (mut m, mut w, mut r) = (copy.once(), shm.big_once(true)?, shm.big_once(false)?);
    for _ in 0..RUNS_BIG {
        m = m.min(copy.once());
        w = w.min(shm.big_once(true)?);
        r = r.min(shm.big_once(false)?);
    }
    let memcpy_sweep = sweep(|n| Ok(copy.once_sized(n)))?;
    drop(copy);
    let shm_sweep = sweep(|n| shm.sized_once(true, n))?;
    let (m, w, r) = (gbps(BIG, m), gbps(BIG, w), gbps(BIG, r));
    report.put(
        "memcpy_256m_gbps",
        m,
        format!("single-thread copy_from_slice of 256 MiB between pre-touched buffers, cpu {PARENT_CPU}, {interleaved}"),
    );
    report.put(
        "shm_write_256m_gbps",
        w,
        format!(
            "one 256 MiB WRITE into another process's pre-touched region, {interleaved}; {pinned}"
        ),
    );
    report.put(
        "shm_read_256m_gbps",
        r,
        format!("one 256 MiB READ from another process, {interleaved}; {pinned}"),
    );
    report.put(
        "shm_write_256m_vs_memcpy",
        w / m,
        "shm_write_256m_gbps / memcpy_256m_gbps, same run",
    );
    let s = shm.scatter()?;
    report.put(
        "shm_scatter_us_per_desc",
        s,
        format!("1,000 x 4 KiB scattered descriptors in one WRITE (validate, coalesce, post, complete), per descriptor, best of {RUNS_SMALL}"),
    );
    let (prep, post) = shm.prepared_18880()?;
    report.put(
        "shm_prepare_18880_us",
        prep,
        format!(
            "prepare (validate + coalesce) 18,880 scattered 1 KiB descriptors, best of {}",
            RUNS_SMALL / 3
        ),
    );
    report.put(
        "shm_prepared_post_18880_us",
        post,
        format!("post and complete that prepared transfer (target-side validation and 18.4 MiB copied included), best of {RUNS_SMALL}"),
    );
    let (c, vs, raw_views) = shm.views()?;
    report.put(
        "coalesce_10k_us",
        c,
        format!("coalesce() of 10,000 contiguous 1 KiB pairs into one, best of {RUNS_SMALL}"),
    );
    report.put(
        "coalesced_vs_single",
        vs,
        format!("shm WRITE of 10,000 contiguous 1 KiB views (validated and coalesced per call) / one 10 MB descriptor, best of {RUNS_SMALL} each"),
    );
    report.put(
        "uncoalesced_vs_single",
        raw_views,
        format!("the same 10,000 views posted uncoalesced (one segment each, prepared once) / one 10 MB descriptor, best of {RUNS_SMALL}"),
    );
    drop(shm);

    // tcp against a raw stream between the same two processes, interleaved likewise.
    let tcp = Session::start("tcp")?;
    let mut raw = tcp.raw_client()?;
    let (mut x, mut w, mut r) = (raw.once()?, tcp.big_once(true)?, tcp.big_once(false)?);
    for _ in 0..RUNS_BIG {
        x = x.min(raw.once()?);
        w = w.min(tcp.big_once(true)?);
        r = r.min(tcp.big_once(false)?);
    }
    let (x, w, r) = (gbps(BIG, x), gbps(BIG, w), gbps(BIG, r));
    report.put(
        "tcp_write_256m_gbps",
        w,
        format!(
            "one 256 MiB WRITE over loopback TCP into another process, {interleaved}; {pinned}"
        ),
    );
    report.put(
        "raw_tcp_256m_gbps",
        x,
        format!("plain blocking TCP stream between the same two processes: 256 MiB in 1 MiB write_all/read_exact calls + 1-byte ack, {interleaved}"),
    );
    report.put(
        "tcp_write_256m_vs_raw",
        w / x,
        "tcp_write_256m_gbps / raw_tcp_256m_gbps, same run",
    );
    report.put(
        "tcp_read_256m_gbps",
        r,
        format!("one 256 MiB READ over loopback TCP, {interleaved}; {pinned}"),
    );
    let tcp_sweep = sweep(|n| tcp.sized_once(true, n))?;
    let raw_sweep = sweep(|n| raw.once_sized(n))?;
    let line = |label: &str, points| Line {
        label: label.into(),
        points,
    };
    let mut lines = vec![
        line("memcpy (reference)", memcpy_sweep),
        line("shm WRITE", shm_sweep),
        line("tcp WRITE (loopback)", tcp_sweep),
        line("raw TCP stream (reference)", raw_sweep),
    ];
    let mut title = "One WRITE between two pinned processes, by payload size".to_owned();
    let tools = EngineTools::from_env();
    let missing = match &tools {
        Ok(tools) => {
            let (more, missing) = engine_sweep(tools);
            lines.extend(more);
            missing
        }
        Err(e) => {
            eprintln!("transport bench: no ucx, nixl or ucx_perftest measurements: {e:#}");
            vec!["ucx, nixl, ucx_perftest".to_owned()]
        }
    };
    if !missing.is_empty() {
        title.push_str(&format!(" (not measured: {})", missing.join("; ")));
    }
    report.series(Series {
        name: "throughput".into(),
        title,
        x_label: "payload bytes".into(),
        y_label: "GB/s".into(),
        log_x: true,
        lines,
    });
    let s = tcp.scatter()?;
    report.put(
        "tcp_scatter_us_per_desc",
        s,
        format!("1,000 x 4 KiB scattered descriptors in one WRITE over TCP, per descriptor, best of {RUNS_SMALL}"),
    );
    drop(tcp);
    match tools {
        Ok(tools) => engines(report, &tools),
        // Said on stderr and in the figure's title above.
        Err(_) => Ok(()),
    }
}

/// One measurement of an engine tool: (payload bytes, WRITEs) to GB/s.
type SizedRun<'a> = dyn Fn(u64, u32) -> Result<f64> + 'a;

/// The engines' lines of the throughput figure, at the sizes of [`SWEEP`]: the `ucx` backend
/// over tcp and over shared memory, the `nixl` backend, and `ucx_perftest` over tcp. Each
/// point is one run of the tool: the average of as many back-to-back WRITEs as [`best_sized`]
/// times (after one untimed). A tool that fails leaves its line out, named in the result.
fn engine_sweep(tools: &EngineTools) -> (Vec<Line>, Vec<String>) {
    let port = 20_000 + (std::process::id() % 20_000) as u16 + 1;
    let mut lines = Vec::new();
    let mut missing = Vec::new();
    let runs: [(&str, Box<SizedRun<'_>>); 4] = [
        (
            "ucx WRITE (UCX_TLS=tcp)",
            Box::new(|len, iters| agent_bw_sized(&tools.ucx_bw, len, iters, &[("UCX_TLS", "tcp")])),
        ),
        (
            "ucx WRITE (UCX_TLS=posix,cma, no error handling)",
            Box::new(|len, iters| {
                let env = [("UCX_TLS", "posix,cma"), ("TESSERA_UCX_ERR_MODE", "none")];
                agent_bw_sized(&tools.ucx_bw, len, iters, &env)
            }),
        ),
        (
            "nixl WRITE (UCX_TLS=tcp)",
            Box::new(|len, iters| {
                agent_bw_sized(&tools.nixl_bw, len, iters, &[("UCX_TLS", "tcp")])
            }),
        ),
        (
            "ucx_perftest put (UCX_TLS=tcp, -e)",
            Box::new(|len, iters| perftest_sized(tools, "tcp", true, port, len, iters)),
        ),
    ];
    for (label, run) in runs {
        let points: Result<Vec<(f64, f64)>> = SWEEP
            .iter()
            .map(|&len| Ok((len as f64, run(len, sweep_runs(len))?)))
            .collect();
        match points {
            Ok(points) => lines.push(Line {
                label: label.into(),
                points,
            }),
            Err(e) => {
                eprintln!("transport bench: {label} left out of the figure: {e:#}");
                missing.push(label.to_owned());
            }
        }
    }
    (lines, missing)
}

/// Where `cargo xtask bench` put the engine tools (it installs the deps and builds them).
struct EngineTools {
    ucx_bw: String,
    nixl_bw: String,
    perftest: String,
    ucx_libs: String,
}

impl EngineTools {
    fn from_env() -> Result<Self> {
        let var = |k: &str| {
            std::env::var(k).map_err(|_| {
                anyhow!(
                    "{k} is not set: the ucx and nixl keys need the UCX and NIXL deps and the \
                     engine examples; run the suite through `cargo xtask bench transport`, which \
                     installs and builds them"
                )
            })
        };
        Ok(Self {
            ucx_bw: var("TESSERA_BENCH_UCX_BW")?,
            nixl_bw: var("TESSERA_BENCH_NIXL_BW")?,
            perftest: var("TESSERA_BENCH_PERFTEST")?,
            ucx_libs: var("TESSERA_BENCH_UCX_LIBS")?,
        })
    }
}

const ENGINE_ITERS: u32 = 5;
const ENGINE_ROUNDS: usize = 4;
const ENGINE_ENV: &[(&str, &str)] = &[("UCX_MODULES", "^ib"), ("UCX_NET_DEVICES", "lo")];

/// One run of an `*_agent_bw` example: the average GB/s of `ENGINE_ITERS` 256 MiB writes.
fn agent_bw(bin: &str, env: &[(&str, &str)]) -> Result<f64> {
    agent_bw_sized(bin, BIG, ENGINE_ITERS, env)
}

/// One run of an `*_agent_bw` example: the average GB/s of `iters` writes of `len` bytes
/// (a whole number of KiB).
fn agent_bw_sized(bin: &str, len: u64, iters: u32, env: &[(&str, &str)]) -> Result<f64> {
    let out = Command::new(bin)
        .args([format!("{}K", len >> 10), iters.to_string()])
        .envs(ENGINE_ENV.iter().copied())
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {bin}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "{bin} failed ({}): {}{}",
            out.status,
            text,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    text.lines()
        .find_map(|l| l.strip_prefix("GBPS "))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| anyhow!("{bin} printed no GBPS line: {text}"))
}

/// One `ucx_perftest -t ucp_put_bw` of 256 MiB, server pinned to cpu 1 and client to cpu 0.
fn perftest(tools: &EngineTools, tls: &str, errors: bool, port: u16) -> Result<f64> {
    perftest_sized(tools, tls, errors, port, BIG, ENGINE_ITERS)
}

/// One `ucx_perftest -t ucp_put_bw` of `iters` puts of `len` bytes, pinned as [`perftest`].
fn perftest_sized(
    tools: &EngineTools,
    tls: &str,
    errors: bool,
    port: u16,
    len: u64,
    iters: u32,
) -> Result<f64> {
    let size = len.to_string();
    let iters = iters.to_string();
    let port = port.to_string();
    let mut args = vec![
        "-t",
        "ucp_put_bw",
        "-s",
        &size,
        "-n",
        &iters,
        "-w",
        "1",
        "-f",
        "-p",
        &port,
    ];
    if errors {
        args.push("-e");
    }
    let run = |cpu: &str, extra: Option<&str>| {
        let mut cmd = Command::new("taskset");
        cmd.args(["-c", cpu, &tools.perftest])
            .args(extra)
            .args(&args)
            .envs(ENGINE_ENV.iter().copied())
            .env("UCX_TLS", tls)
            .env("LD_LIBRARY_PATH", &tools.ucx_libs)
            .stdin(Stdio::null());
        cmd
    };
    let mut server = run(&PEER_CPU.to_string(), None)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting ucx_perftest (server)")?;
    let mut last_err = None;
    let mut result = None;
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(250));
        let out = run(&PARENT_CPU.to_string(), Some("127.0.0.1"))
            .output()
            .context("running ucx_perftest (client)")?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() {
            result = Some(text);
            break;
        }
        last_err = Some(format!("{text}{}", String::from_utf8_lossy(&out.stderr)));
    }
    let _ = server.kill();
    let _ = server.wait();
    let text = result.ok_or_else(|| {
        anyhow!(
            "ucx_perftest client failed: {}",
            last_err.unwrap_or_default()
        )
    })?;
    // The final line: iterations, latency (3 columns), bandwidth average and overall in MB/s
    // (MiB/s), message rate.
    let fields: Vec<f64> = text
        .lines()
        .rev()
        .find_map(|l| {
            let f: Vec<f64> = l
                .split_whitespace()
                .filter_map(|w| w.parse().ok())
                .collect();
            (f.len() >= 6).then_some(f)
        })
        .ok_or_else(|| anyhow!("no result line in ucx_perftest output: {text}"))?;
    Ok(fields[4] * 1_048_576.0 / 1e9)
}

/// The UCX and NIXL backends against `ucx_perftest` of the same UCX build, same run.
fn engines(report: &mut Report, tools: &EngineTools) -> Result<()> {
    let port = 20_000 + (std::process::id() % 20_000) as u16;
    let how = format!(
        "{ENGINE_ITERS} back-to-back 256 MiB WRITEs through Agent (ucx backend, ucx_agent_bw \
         example) after one untimed, initiator pinned to cpu {PARENT_CPU}, target to cpu \
         {PEER_CPU}, both regions pre-touched, average; best of {ENGINE_ROUNDS} rounds \
         interleaved with ucx_perftest (and, over tcp, with the nixl backend)"
    );
    let perf_how = format!(
        "ucx_perftest -t ucp_put_bw -s 256MiB -n {ENGINE_ITERS} -w 1 of the same UCX 1.22 \
         build (.deps/ucx), taskset server cpu {PEER_CPU} / client cpu {PARENT_CPU}, average \
         bandwidth; best of {ENGINE_ROUNDS} rounds"
    );
    let (mut ucx_tcp, mut nixl) = (0.0, 0.0f64);
    for (label, tls, errors) in [("tcp", "tcp", true), ("shm", "posix,cma", false)] {
        let mut env = vec![("UCX_TLS", tls)];
        if !errors {
            env.push(("TESSERA_UCX_ERR_MODE", "none"));
        }
        let (mut ours, mut theirs) = (0.0f64, 0.0f64);
        for _ in 0..ENGINE_ROUNDS {
            ours = ours.max(agent_bw(&tools.ucx_bw, &env)?);
            theirs = theirs.max(perftest(tools, tls, errors, port)?);
            if label == "tcp" {
                // NIXL over the same UCX_TLS in the same rounds: this machine's load drifts
                // over tens of seconds, and a ratio of rounds taken minutes apart measures
                // the drift.
                nixl = nixl.max(agent_bw(&tools.nixl_bw, &env)?);
            }
        }
        let mode = if errors {
            "peer error handling (ours: UCP_ERR_HANDLING_MODE_PEER; perftest: -e)"
        } else {
            "no error handling (ours: ErrorHandling::None; perftest: without -e), which cma needs"
        };
        report.put(
            &format!("ucx_{label}_put_256m_gbps"),
            ours,
            format!("{how}; UCX_TLS={tls}, {mode}"),
        );
        report.put(
            &format!("ucx_perftest_{label}_put_256m_gbps"),
            theirs,
            format!("{perf_how}; UCX_TLS={tls}, {mode}"),
        );
        report.put(
            &format!("ucx_{label}_vs_perftest"),
            ours / theirs,
            format!("ucx_{label}_put_256m_gbps / ucx_perftest_{label}_put_256m_gbps, same run"),
        );
        if label == "tcp" {
            ucx_tcp = ours;
        }
    }
    report.put(
        "nixl_write_256m_gbps",
        nixl,
        format!(
            "{ENGINE_ITERS} back-to-back 256 MiB WRITEs through Agent (nixl backend: NIXL 1.5.1 \
             with its UCX backend and bundled UCX 1.23, peer error handling), UCX_TLS=tcp, \
             pinned cpu {PARENT_CPU} / {PEER_CPU}, pre-touched, average; best of {ENGINE_ROUNDS} rounds \
             interleaved with the ucx backend's and ucx_perftest's tcp rounds"
        ),
    );
    report.put(
        "nixl_vs_ucx",
        nixl / ucx_tcp,
        "nixl_write_256m_gbps / ucx_tcp_put_256m_gbps (both UCX_TLS=tcp with peer error handling), same run",
    );
    Ok(())
}

/// Payload sizes of the throughput-by-size figure: 64 KiB to 256 MiB.
const SWEEP: [u64; 7] = [64 << 10, 256 << 10, MIB, 4 * MIB, 16 * MIB, 64 * MIB, BIG];

/// Runs of one size: enough to move about 1 GiB, 3 to 200.
fn sweep_runs(len: u64) -> u32 {
    ((1u64 << 30) / len).clamp(3, 200) as u32
}

/// Best time of `f(len)` over [`sweep_runs`] runs, after one untimed warm-up.
fn best_sized(len: u64, mut f: impl FnMut(u64) -> Result<Duration>) -> Result<Duration> {
    let runs = sweep_runs(len);
    f(len)?;
    let mut best = Duration::MAX;
    for _ in 0..runs {
        best = best.min(f(len)?);
    }
    Ok(best)
}

/// (payload bytes, GB/s) for every size of [`SWEEP`].
fn sweep(mut f: impl FnMut(u64) -> Result<Duration>) -> Result<Vec<(f64, f64)>> {
    SWEEP
        .iter()
        .map(|&len| Ok((len as f64, gbps(len, best_sized(len, &mut f)?))))
        .collect()
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// The memcpy reference: two pre-touched 256 MiB buffers.
struct Memcpy {
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl Memcpy {
    fn new() -> Self {
        Self {
            src: vec![1u8; BIG as usize],
            dst: vec![2u8; BIG as usize],
        }
    }

    fn once(&mut self) -> Duration {
        self.once_sized(BIG)
    }

    fn once_sized(&mut self, len: u64) -> Duration {
        let len = len as usize;
        let start = Instant::now();
        self.dst[..len].copy_from_slice(&self.src[..len]);
        let d = start.elapsed();
        std::hint::black_box(&self.dst);
        d
    }
}

/// The raw TCP reference: a plain blocking stream to the peer's sink.
struct RawClient {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl RawClient {
    fn once(&mut self) -> Result<Duration> {
        self.once_sized(BIG)
    }

    /// Sends an 8-byte length, then that many bytes, and waits for the one-byte ack.
    fn once_sized(&mut self, len: u64) -> Result<Duration> {
        let mut ack = [0u8; 1];
        let start = Instant::now();
        self.stream.write_all(&len.to_le_bytes())?;
        for chunk in self.buf[..len as usize].chunks(RAW_CHUNK) {
            self.stream.write_all(chunk)?;
        }
        self.stream.read_exact(&mut ack)?;
        Ok(start.elapsed())
    }
}

// ----- the parent side --------------------------------------------------------------------

struct Session {
    child: Child,
    stdin: ChildStdin,
    lines: std::io::Lines<BufReader<ChildStdout>>,
    agent: Agent,
    _region: Region,
    reg: Registration,
    peer: Peer,
    peer_reg: u64,
    raw_addr: Option<String>,
}

impl Session {
    fn start(kind: &str) -> Result<Self> {
        let exe = std::env::current_exe()?;
        let mut child = Command::new(exe)
            .arg("transport")
            .env(PEER_ENV, kind)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting the peer process")?;
        let stdin = child.stdin.take().context("peer stdin")?;
        let mut lines = BufReader::new(child.stdout.take().context("peer stdout")?).lines();
        let mut next = || -> Result<String> {
            lines
                .next()
                .ok_or_else(|| anyhow!("peer exited"))?
                .map_err(Into::into)
        };
        let meta = hex::decode(next()?.strip_prefix("META ").context("META")?)?;
        let peer_reg: u64 = next()?.strip_prefix("REG ").context("REG")?.parse()?;
        let raw_addr = next()?
            .strip_prefix("RAW ")
            .map(str::to_owned)
            .filter(|a| a != "-");
        let agent = kind.parse::<EngineKind>()?.agent("bench")?;
        let region = Region::new(BIG + 16 * MIB)?;
        region.fill(0, region.len(), 0x5A)?;
        let reg = agent.register(&region)?;
        let peer = agent.add_remote(&meta)?;
        let mut s = Self {
            child,
            stdin,
            lines,
            agent,
            _region: region,
            reg,
            peer,
            peer_reg,
            raw_addr,
        };
        let meta = hex::encode(s.agent.metadata());
        s.cmd(&format!("ADD {meta}"))?;
        Ok(s)
    }

    fn cmd(&mut self, line: &str) -> Result<String> {
        writeln!(self.stdin, "{line}")?;
        self.stdin.flush()?;
        let answer = self.lines.next().ok_or_else(|| anyhow!("peer exited"))??;
        if answer.starts_with("ERR") {
            bail!("peer: {answer}");
        }
        Ok(answer)
    }

    fn timed(&self, local: &[LocalDesc], remote: &[RemoteDesc], write: bool) -> Result<Duration> {
        let start = Instant::now();
        let t = if write {
            self.peer.write(local, remote, None)?
        } else {
            self.peer.read(local, remote, None)?
        };
        t.wait()?;
        Ok(start.elapsed())
    }

    fn best(
        &self,
        runs: usize,
        local: &[LocalDesc],
        remote: &[RemoteDesc],
        write: bool,
    ) -> Result<Duration> {
        // One untimed warm-up moves every page once (mappings, first touch, socket buffers).
        self.timed(local, remote, write)?;
        let mut best = Duration::MAX;
        for _ in 0..runs {
            best = best.min(self.timed(local, remote, write)?);
        }
        Ok(best)
    }

    fn big_once(&self, write: bool) -> Result<Duration> {
        self.sized_once(write, BIG)
    }

    fn sized_once(&self, write: bool, len: u64) -> Result<Duration> {
        let local = [self.reg.desc(0, len)?];
        let remote = [RemoteDesc::new(self.peer_reg, 0, len)];
        self.timed(&local, &remote, write)
    }

    fn scatter(&self) -> Result<f64> {
        // Every other 4 KiB slot on both sides, the remote order permuted: nothing coalesces.
        let local: Vec<LocalDesc> = (0..SCATTER_N)
            .map(|i| self.reg.desc(BIG + i * 2 * SCATTER_SZ, SCATTER_SZ))
            .collect::<Result<_, _>>()?;
        let remote: Vec<RemoteDesc> = (0..SCATTER_N)
            .map(|i| {
                let slot = (i * 7919) % SCATTER_N;
                RemoteDesc::new(self.peer_reg, BIG + slot * 2 * SCATTER_SZ, SCATTER_SZ)
            })
            .collect();
        let d = self.best(RUNS_SMALL, &local, &remote, true)?;
        Ok(us(d) / SCATTER_N as f64)
    }

    /// A prepared transfer of 18,880 scattered 1 KiB descriptors (the count NIXL users
    /// reported 46 ms to post), posted and completed: (µs to prepare, µs per post).
    fn prepared_18880(&self) -> Result<(f64, f64)> {
        const N: u64 = 18_880;
        const SZ: u64 = 1024;
        let local: Vec<LocalDesc> = (0..N)
            .map(|i| self.reg.desc(i * 2 * SZ, SZ))
            .collect::<Result<_, _>>()?;
        let remote: Vec<RemoteDesc> = (0..N)
            .map(|i| RemoteDesc::new(self.peer_reg, ((i * 7919) % N) * 2 * SZ, SZ))
            .collect();
        let mut prepare = Duration::MAX;
        let mut prepared = None;
        for _ in 0..RUNS_SMALL / 3 {
            let start = Instant::now();
            let p = self.peer.prepare(Op::Write, &local, &remote)?;
            prepare = prepare.min(start.elapsed());
            prepared = Some(p);
        }
        let prepared = prepared.context("prepared")?;
        prepared.post(None)?.wait()?;
        let mut post = Duration::MAX;
        for _ in 0..RUNS_SMALL {
            let start = Instant::now();
            prepared.post(None)?.wait()?;
            post = post.min(start.elapsed());
        }
        Ok((us(prepare), us(post)))
    }

    fn views(&self) -> Result<(f64, f64, f64)> {
        let pairs: Vec<Pair> = (0..VIEWS_N)
            .map(|i| Pair {
                local: Loc {
                    reg: 1,
                    offset: i * VIEWS_SZ,
                },
                remote: Loc {
                    reg: 2,
                    offset: i * VIEWS_SZ,
                },
                len: VIEWS_SZ,
            })
            .collect();
        let c = best_of(RUNS_SMALL, || (), |()| coalesce(&pairs));
        let local: Vec<LocalDesc> = (0..VIEWS_N)
            .map(|i| self.reg.desc(i * VIEWS_SZ, VIEWS_SZ))
            .collect::<Result<_, _>>()?;
        let remote: Vec<RemoteDesc> = (0..VIEWS_N)
            .map(|i| RemoteDesc::new(self.peer_reg, i * VIEWS_SZ, VIEWS_SZ))
            .collect();
        let views = self.best(RUNS_SMALL, &local, &remote, true)?;
        let exact = self.peer.prepare_uncoalesced(Op::Write, &local, &remote)?;
        exact.post(None)?.wait()?;
        let mut uncoalesced = Duration::MAX;
        for _ in 0..RUNS_SMALL {
            let start = Instant::now();
            exact.post(None)?.wait()?;
            uncoalesced = uncoalesced.min(start.elapsed());
        }
        let total = VIEWS_N * VIEWS_SZ;
        let single = self.best(
            RUNS_SMALL,
            &[self.reg.desc(0, total)?],
            &[RemoteDesc::new(self.peer_reg, 0, total)],
            true,
        )?;
        Ok((
            us(c),
            views.as_secs_f64() / single.as_secs_f64(),
            uncoalesced.as_secs_f64() / single.as_secs_f64(),
        ))
    }

    fn raw_client(&self) -> Result<RawClient> {
        let addr = self
            .raw_addr
            .as_deref()
            .context("the tcp peer has a raw listener")?;
        let stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        // Its own pre-touched source, as large as the engine's.
        let buf = vec![0x5Au8; BIG as usize];
        Ok(RawClient { stream, buf })
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "EXIT");
        let _ = self.stdin.flush();
        let _ = self.child.wait();
    }
}

// ----- the peer process -------------------------------------------------------------------

fn peer_main(kind: &str) -> Result<()> {
    pin(PEER_CPU)?;
    let agent = match kind.parse::<EngineKind>()? {
        k @ (EngineKind::Shm | EngineKind::Tcp) => k.agent("bench-peer")?,
        other => bail!("the transport suite's peer runs shm or tcp, not {other}"),
    };
    let region = Region::new(PEER_REGION)?;
    region.fill(0, PEER_REGION, 0xA5)?;
    let reg = agent.register(&region)?;
    let raw = if kind == "tcp" {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?.to_string();
        std::thread::spawn(move || raw_sink(listener));
        addr
    } else {
        "-".to_owned()
    };
    let mut out = std::io::stdout().lock();
    writeln!(out, "META {}", hex::encode(agent.metadata()))?;
    writeln!(out, "REG {}", reg.id())?;
    writeln!(out, "RAW {raw}")?;
    out.flush()?;
    let mut peer = None;
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let answer = match line.split_once(' ') {
            Some(("ADD", h)) => {
                peer = Some(agent.add_remote(&hex::decode(h)?)?);
                "ADDED".to_owned()
            }
            _ if line == "EXIT" => break,
            _ => format!("ERR unknown command {line}"),
        };
        writeln!(out, "{answer}")?;
        out.flush()?;
    }
    drop(peer);
    Ok(())
}

/// Reads length-prefixed messages of up to 256 MiB into a pre-touched buffer and acknowledges
/// each with one byte.
fn raw_sink(listener: TcpListener) {
    for s in listener.incoming() {
        let Ok(s) = s else { return };
        raw_sink_one(s);
    }
}

fn raw_sink_one(mut s: TcpStream) {
    let _ = s.set_nodelay(true);
    let Ok(region) = Region::new(BIG) else { return };
    let _ = region.fill(0, BIG, 1);
    // SAFETY: this thread is the only user of its private region.
    let buf = unsafe { region.as_mut_slice() };
    loop {
        let mut len = [0u8; 8];
        if s.read_exact(&mut len).is_err() {
            return;
        }
        let len = u64::from_le_bytes(len);
        if len > BIG {
            return;
        }
        for chunk in buf[..len as usize].chunks_mut(RAW_CHUNK) {
            if s.read_exact(chunk).is_err() {
                return;
            }
        }
        if s.write_all(&[1]).is_err() {
            return;
        }
    }
}
