//! The `storage` suite: a tessera-storage unit in a second process pinned to its own core, a
//! client here, against a single-thread memcpy and a raw TCP stream between the same two
//! processes, measured in the same run; over shm, tcp and, when built with the feature `ucx`
//! (as `cargo xtask bench` builds it), ucx.
//!
//! The unit process is this very binary, started again with `TESSERA_BENCH_STORAGE_UNIT` set
//! to the backend: it runs `unit_main` instead of the suites.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use tessera_storage::{
    Backend, BackendExt, BusyPoll, Client, ClientConfig, Server, ServerConfig, Tensor, UnitConfig,
    Value,
};

use crate::cpu::{affinity, pin, restore_affinity};
use crate::Report;

mod requests;

const UNIT_ENV: &str = "TESSERA_BENCH_STORAGE_UNIT";
/// The core the unit process pins itself to (default `UNIT_CPU`).
const UNIT_CPU_ENV: &str = "TESSERA_BENCH_STORAGE_UNIT_CPU";
/// Set: the unit process busy-polls its sessions for this many microseconds before parking.
const UNIT_POLL_ENV: &str = "TESSERA_BENCH_STORAGE_UNIT_POLL_US";
/// How far past an answer a polling unit process polls for a session's expected next request
/// (`BusyPoll::expecting`); unset, the binary's default (`BusyPoll::SERVE_EXPECT_DEFAULT_US`).
const UNIT_EXPECT_ENV: &str = "TESSERA_BENCH_STORAGE_UNIT_EXPECT_US";
/// Set: only these parts of the suite run (comma-separated: `big`, `batch`, `rollouts`,
/// `put16m`, `small`, `load32`, `unpinned`, `tcp`, `ucx`), to look at one closely (a profiler
/// attached, say); unset, all of them.
const ONLY_ENV: &str = "TESSERA_BENCH_STORAGE_ONLY";
/// The busy-polling window of both processes (`BusyPoll`), except where a key says unpolled.
const POLL: Duration = Duration::from_micros(50);
/// How far past a request the client polls for an answer it expects later than the window
/// (`BusyPoll::expecting`).
const EXPECT: Duration = Duration::from_micros(500);
const BIG: usize = 256 << 20;
const RUNS_BIG: usize = 5;
const RUNS_BATCH: usize = 20;
const BATCH_WARMUP: usize = 100;
const SMALL_N: usize = 2000;
const CLIENT_CPU: usize = 0;
const UNIT_CPU: usize = 1;
const RAW_CHUNK: usize = 1 << 20;
/// Bytes of the bare shm regions on both sides of the reference WRITEs: room for 16 distinct
/// 16 MiB values, as the PUTs they are the reference of move (more than the L3 cache).
const BARE_BYTES: u64 = 256 << 20;

/// The reference for the storage unit's payload path: a shm agent here WRITing into a bare
/// registered region of the unit process, between the same two processes.
struct Bare {
    _agent: tessera_transport::Agent,
    _region: tessera_transport::Region,
    reg: tessera_transport::Registration,
    peer: tessera_transport::Peer,
    peer_reg: u64,
}

impl Bare {
    /// Best of `runs` WRITEs of `n` descriptors of `len` bytes each (after one untimed): the
    /// sources every other slot of this side's region (nothing coalesces), the destinations
    /// packed back to back as in a unit's receive block.
    fn write(&self, runs: usize, n: u64, len: u64) -> Result<Duration> {
        self.write_once(n, len)?;
        let times = (0..runs)
            .map(|_| self.write_once(n, len))
            .collect::<Result<_>>()?;
        Ok(best(times))
    }

    /// One WRITE of [`Bare::write`]'s layout.
    fn write_once(&self, n: u64, len: u64) -> Result<Duration> {
        self.write_at(n, len, 0)
    }

    /// One WRITE of [`Bare::write`]'s layout, `base` bytes into both regions.
    fn write_at(&self, n: u64, len: u64, base: u64) -> Result<Duration> {
        let stride = if n == 1 { len } else { 2 * len };
        let local: Vec<_> = (0..n)
            .map(|i| self.reg.desc(base + i * stride, len))
            .collect::<Result<_, _>>()?;
        let remote: Vec<_> = (0..n)
            .map(|i| tessera_transport::RemoteDesc::new(self.peer_reg, base + i * len, len))
            .collect();
        let t = Instant::now();
        self.peer.write(&local, &remote, None)?.wait()?;
        Ok(t.elapsed())
    }
}

/// Runs the suite, or the unit process when started as one.
pub fn run(report: &mut Report) -> Result<()> {
    if let Ok(kind) = std::env::var(UNIT_ENV) {
        let code = match unit_main(&kind) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("storage bench unit: {e:#}");
                1
            }
        };
        std::process::exit(code);
    }
    let saved = affinity();
    pin(CLIENT_CPU)?;
    // The hook polls only while a client built with this `BusyPoll` awaits an answer; the
    // unpolled clients leave it idle.
    let poll = BusyPoll::expecting(POLL, EXPECT)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .on_thread_park(poll.on_park())
        .build()?;
    let result = rt.block_on(suite(report, &poll, saved));
    drop(rt);
    if let Some(mask) = saved {
        restore_affinity(&mask);
    }
    result
}

/// Whether the part `name` runs (see [`ONLY_ENV`]).
fn part(name: &str) -> bool {
    std::env::var(ONLY_ENV).map_or(true, |only| only.split(',').any(|p| p.trim() == name))
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn best(mut runs: Vec<Duration>) -> Duration {
    runs.sort();
    runs[0]
}

async fn suite(report: &mut Report, poll: &BusyPoll, mask: Option<libc::cpu_set_t>) -> Result<()> {
    let pinned = format!(
        "client pinned to cpu {CLIENT_CPU}, unit process to cpu {UNIT_CPU}, both busy-poll \
         their control sockets for up to {} us before parking (the client longer for an answer \
         it expects later, up to {} us after the request; the unit for a request it expects \
         later, up to {} us after the answer), the unit's pool prefaulted (`--prefault-pool`)",
        POLL.as_micros(),
        EXPECT.as_micros(),
        unit_expect()?.as_micros()
    );
    // memcpy reference: two pre-touched 256 MiB buffers.
    let src = vec![1u8; BIG];
    let mut dst = vec![2u8; BIG];
    let mut runs = Vec::new();
    for _ in 0..RUNS_BIG {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        runs.push(t.elapsed());
        std::hint::black_box(&dst);
    }
    drop(dst);
    let memcpy = gbps(BIG as u64, best(runs));
    report.put(
        "memcpy_256m_gbps",
        memcpy,
        format!("single-thread memcpy of 256 MiB, pre-touched, best of {RUNS_BIG}"),
    );

    let payload = bytes::Bytes::from(src);
    // `ucx` when this binary is built with tessera-bench's feature `ucx` (`cargo xtask bench`
    // does so): UCX_TLS from the environment (unset: UCX's choice), peer error handling.
    let backends = [Backend::Shm, Backend::Tcp, Backend::Ucx];
    for backend in backends.into_iter().filter(|b| b.available()) {
        let k = backend.name();
        if backend != Backend::Shm && !part(k) {
            continue;
        }
        let mut unit = UnitProc::start(k, Some(UNIT_CPU), Some(POLL))?;
        let client = Client::connect(ClientConfig {
            units: vec![unit.addr.clone()],
            backend,
            recv_pool_bytes: 1 << 30,
            busy_poll: Some(poll.clone()),
            ..ClientConfig::default()
        })
        .await?;
        let cols = vec![("x".to_string(), vec![Value::Bytes(payload.clone())])];
        // Warm-up moves every page once (mappings, first touch of both pools, socket buffers).
        client.put("big", &[0], &cols).await?;
        drop(client.get("big", &[0], &["x"]).await?);
        let mut put = Vec::new();
        let mut get = Vec::new();
        let runs = if backend != Backend::Shm || part("big") {
            RUNS_BIG
        } else {
            1
        };
        for _ in 0..runs {
            let t = Instant::now();
            client.put("big", &[0], &cols).await?;
            put.push(t.elapsed());
            let t = Instant::now();
            let v = client.get("big", &[0], &["x"]).await?;
            get.push(t.elapsed());
            drop(v);
        }
        let (p, g) = (gbps(BIG as u64, best(put)), gbps(BIG as u64, best(get)));
        let path = if backend.pulls_puts() {
            "the unit READs the value from the caller's memory"
        } else {
            "PREPARE, scatter WRITE from the caller's memory, COMMIT"
        };
        report.put(
            &format!("{k}_put_256m_gbps"),
            p,
            format!("PUT of one 256 MiB value over {k} ({path}), best of {RUNS_BIG}; {pinned}"),
        );
        report.put(&format!("{k}_get_256m_gbps"), g, format!("GET of one 256 MiB value over {k} (unit WRITEs into the client's pool), best of {RUNS_BIG}; {pinned}"));
        if backend == Backend::Shm {
            report.put(
                "shm_put_vs_memcpy",
                p / memcpy,
                "shm_put_256m_gbps / memcpy_256m_gbps (goal >= 0.5)",
            );
            report.put(
                "shm_get_vs_memcpy",
                g / memcpy,
                "shm_get_256m_gbps / memcpy_256m_gbps (goal >= 0.5)",
            );
            let bare = unit.bare()?;
            if part("batch") {
                batch(&client, &bare, report, &pinned).await?;
            }
            if part("rollouts") {
                requests::rollouts(&client, report, &pinned, memcpy).await?;
            }
            if part("put16m") {
                requests::put_16m(&client, &bare, report, &pinned, RUNS_BIG).await?;
            }
            if part("small") {
                small(&client, &unit.echo, report, &pinned).await?;
                same_core(report).await?;
            }
            if part("load32") {
                requests::load32(&unit.addr, poll, report, &pinned).await?;
            }
            if part("unpinned") {
                tokio::task::block_in_place(|| requests::unpinned(report, mask))?;
            }
        } else if backend == Backend::Tcp {
            let raw_addr = unit.raw.clone().context("raw sink address")?;
            let raw =
                tokio::task::spawn_blocking(move || raw_tcp(&raw_addr, payload_len())).await??;
            report.put("raw_tcp_256m_gbps", raw, format!("256 MiB over a plain loopback TCP stream to the unit process, pre-touched, best of {RUNS_BIG}; {pinned}"));
            report.put(
                "tcp_put_vs_raw",
                p / raw,
                "tcp_put_256m_gbps / raw_tcp_256m_gbps (goal >= 0.8)",
            );
            report.put(
                "tcp_get_vs_raw",
                g / raw,
                "tcp_get_256m_gbps / raw_tcp_256m_gbps (goal >= 0.8)",
            );
        }
        drop(cols);
        client.drop_partition("big").await?;
        drop(client);
        unit.stop();
    }
    Ok(())
}

fn payload_len() -> usize {
    BIG
}

async fn batch(client: &Client, bare: &Bare, report: &mut Report, pinned: &str) -> Result<()> {
    let n = 1000u64;
    let indexes: Vec<u64> = (0..n).collect();
    let vals: Vec<Value> = indexes
        .iter()
        .map(|i| Value::Tensor(Tensor::from_slice(&[4096], &vec![*i as u8; 4096]).expect("tensor")))
        .collect();
    let cols = vec![("x".to_string(), vals)];
    // Warm-up: a replacing PUT leases a new block while the old one is still stored, so the
    // first few PUTs and GETs each touch fresh pool pages (page faults through both
    // processes' mappings); the steady state reuses them, and each end has learned when
    // the other's next message comes (`BusyPoll::expecting`). The figures are of the steady
    // state. (The first 60-odd PUTs of a link were also slower, about 430 us against 270,
    // until the shm link's ring of WRITE records, which each PUT's record of a few KiB
    // advances by a page, had been faulted in once; its pages are now faulted in when the
    // ring is made and mapped.)
    for _ in 0..BATCH_WARMUP {
        client.put("batch", &indexes, &cols).await?;
        drop(client.get("batch", &indexes, &["x"]).await?);
    }
    let (mut put, mut get) = (Vec::new(), Vec::new());
    for _ in 0..RUNS_BATCH {
        let t = Instant::now();
        client.put("batch", &indexes, &cols).await?;
        put.push(t.elapsed());
        let t = Instant::now();
        let v = client.get("batch", &indexes, &["x"]).await?;
        get.push(t.elapsed());
        drop(v);
    }
    let bytes = n * 4096;
    let (p, g) = (gbps(bytes, best(put)), gbps(bytes, best(get)));
    report.put("batch_put_gbps", p, format!("PUT of 1,000 separate 4 KiB tensors in one request over shm, best of {RUNS_BATCH}; {pinned}"));
    report.put("batch_get_gbps", g, format!("GET of 1,000 separate 4 KiB tensors in one request over shm, best of {RUNS_BATCH}; {pinned}"));
    report.put(
        "batch_put_vs_goal",
        p / 2.6,
        "batch_put_gbps / 2.6 GB/s (goal >= 1)",
    );
    let w = requests::batch_write_gbps(bare, RUNS_BATCH, report)?;
    report.put(
        "batch_put_vs_write",
        p / w,
        "batch_put_gbps / batch_write_gbps (goal >= 0.6)",
    );
    report.put(
        "batch_get_vs_write",
        g / w,
        "batch_get_gbps / batch_write_gbps (goal >= 0.6)",
    );
    client.drop_partition("batch").await?;
    Ok(())
}

async fn small(client: &Client, echo: &str, report: &mut Report, pinned: &str) -> Result<()> {
    let m = small_medians(client, echo).await?;
    report.put(
        "small_put_us",
        m.put,
        format!("round trip of a 4-byte PUT (inline), median of {SMALL_N}; {pinned} (goal <= 50)"),
    );
    report.put(
        "rtt_us",
        m.rtt,
        format!(
            "round trip of one byte over a loopback TCP connection between the same two \
             processes (a thread of the unit process echoes it, blocking reads), median of \
             {SMALL_N} taken in turns with small_put_us and small_get_us: the machine's \
             cross-core round trip when neither end polls"
        ),
    );
    report.put(
        "small_get_us",
        m.get,
        format!("round trip of a 4-byte GET (inline), median of {SMALL_N}; {pinned}"),
    );
    rtts(report, "", m.put, m.get, m.rtt);
    unpolled(report).await
}

/// Medians of the 4-byte PUT, the 4-byte GET and the one-byte echo to the unit process
/// (`echo`), in microseconds.
struct SmallMedians {
    put: f64,
    get: f64,
    rtt: f64,
}

/// Samples taken of one kind before turning to the next (see [`small_medians`]).
const SMALL_TURN: usize = 100;

/// [`SmallMedians`] of `SMALL_N` samples each, after `SMALL_TURN` untimed each, taken in
/// turns of `SMALL_TURN`: the wake-up cost of this shared machine drifts over seconds, and
/// taken in turns the requests and their reference see the same moments.
async fn small_medians(client: &Client, echo: &str) -> Result<SmallMedians> {
    let cols = four_bytes()?;
    let mut echo = Echo::connect(echo)?;
    let (mut put, mut get, mut rtt) = (Vec::new(), Vec::new(), Vec::new());
    for turn in 0..=SMALL_N / SMALL_TURN {
        let timed = turn > 0;
        for _ in 0..SMALL_TURN {
            let t = Instant::now();
            client.put("small", &[0], &cols).await?;
            put.extend(timed.then(|| t.elapsed()));
        }
        for _ in 0..SMALL_TURN {
            let t = Instant::now();
            let v = client.get("small", &[0], &["x"]).await?;
            get.extend(timed.then(|| t.elapsed()));
            drop(v);
        }
        for _ in 0..SMALL_TURN {
            let d = echo.once()?;
            rtt.extend(timed.then_some(d));
        }
    }
    client.drop_partition("small").await?;
    Ok(SmallMedians {
        put: median_us(put),
        get: median_us(get),
        rtt: median_us(rtt),
    })
}

/// The 4-byte PUT's and GET's round trips in units of the unpolled cross-core `rtt`.
fn rtts(report: &mut Report, how: &str, put: f64, get: f64, rtt: f64) {
    for (op, us) in [("put", put), ("get", get)] {
        report.put(
            &format!("small_{op}{how}_rtts"),
            us / rtt,
            format!("small_{op}{how}_us / rtt_us (goal <= 1.3)"),
        );
    }
}

/// A unit process over shm on `cpu` (unpinned when `None`), busy-polling for `poll` if
/// given, and a client of it with the defaults (no busy polling).
async fn shm_unit(cpu: Option<usize>, poll: Option<Duration>) -> Result<(UnitProc, Client)> {
    let unit = UnitProc::start(Backend::Shm.name(), cpu, poll)?;
    let client = Client::connect(ClientConfig {
        units: vec![unit.addr.clone()],
        backend: Backend::Shm,
        recv_pool_bytes: 1 << 20,
        ..ClientConfig::default()
    })
    .await?;
    Ok((unit, client))
}

/// The 4-byte PUT and GET across the same two cores with neither process polling: every
/// message wakes a parked core.
async fn unpolled(report: &mut Report) -> Result<()> {
    let (mut unit, client) = shm_unit(Some(UNIT_CPU), None).await?;
    let m = small_medians(&client, &unit.echo).await?;
    report.put(
        "small_put_unpolled_us",
        m.put,
        format!(
            "small_put_us with neither process busy-polling (client cpu {CLIENT_CPU}, unit cpu \
             {UNIT_CPU}), median of {SMALL_N}"
        ),
    );
    report.put(
        "small_get_unpolled_us",
        m.get,
        format!("small_get_us with neither process busy-polling, median of {SMALL_N}"),
    );
    report.put(
        "rtt_unpolled_us",
        m.rtt,
        format!(
            "rtt_us again, taken in turns with small_put_unpolled_us and \
             small_get_unpolled_us (their ratios' reference), median of {SMALL_N}"
        ),
    );
    rtts(report, "_unpolled", m.put, m.get, m.rtt);
    drop(client);
    unit.stop();
    Ok(())
}

/// The 4-byte PUT again with the unit process on the client's core, neither polling: the
/// round trip without the machine's cross-core wake-up (a second unit, over shm).
async fn same_core(report: &mut Report) -> Result<()> {
    let (mut unit, client) = shm_unit(Some(CLIENT_CPU), None).await?;
    let put = small_put_median_us(&client).await?;
    let echo = unit.echo.clone();
    let rtt = tokio::task::spawn_blocking(move || -> Result<f64> {
        let mut echo = Echo::connect(&echo)?;
        for _ in 0..SMALL_TURN {
            echo.once()?;
        }
        let runs = (0..SMALL_N).map(|_| echo.once()).collect::<Result<_>>()?;
        Ok(median_us(runs))
    })
    .await??;
    report.put(
        "small_put_same_core_us",
        put,
        format!(
            "small_put_unpolled_us with the unit process pinned to the client's cpu \
             {CLIENT_CPU}, median of {SMALL_N}"
        ),
    );
    report.put(
        "rtt_same_core_us",
        rtt,
        format!("rtt_us with both processes on cpu {CLIENT_CPU}, median of {SMALL_N}"),
    );
    drop(client);
    unit.stop();
    Ok(())
}

/// Median round trip of a 4-byte PUT (inline), after 100 untimed.
pub(super) async fn small_put_median_us(client: &Client) -> Result<f64> {
    let cols = four_bytes()?;
    for _ in 0..100 {
        client.put("small", &[0], &cols).await?;
    }
    let mut runs = Vec::with_capacity(SMALL_N);
    for _ in 0..SMALL_N {
        let t = Instant::now();
        client.put("small", &[0], &cols).await?;
        runs.push(t.elapsed());
    }
    Ok(median_us(runs))
}

/// One field of one 4-byte tensor: the small requests' value.
fn four_bytes() -> Result<Vec<(String, Vec<Value>)>> {
    let t = Tensor::from_slice(&[1], &[7i32])?;
    Ok(vec![("x".to_string(), vec![Value::Tensor(t)])])
}

pub(super) fn median_us(mut runs: Vec<Duration>) -> f64 {
    runs.sort();
    runs[runs.len() / 2].as_secs_f64() * 1e6
}

/// A connection to the unit process's echo thread.
struct Echo(TcpStream);

impl Echo {
    fn connect(addr: &str) -> Result<Echo> {
        let s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        Ok(Echo(s))
    }

    /// One byte's round trip (blocking).
    fn once(&mut self) -> Result<Duration> {
        let mut b = [0u8; 1];
        let t = Instant::now();
        self.0.write_all(&[7])?;
        self.0.read_exact(&mut b)?;
        Ok(t.elapsed())
    }
}

/// Echoes every byte back, one connection at a time.
fn echo_bytes(listener: TcpListener) {
    for s in listener.incoming() {
        let Ok(mut s) = s else { return };
        let _ = s.set_nodelay(true);
        let mut b = [0u8; 1];
        while s.read_exact(&mut b).is_ok() && s.write_all(&b).is_ok() {}
    }
}

fn raw_tcp(addr: &str, len: usize) -> Result<f64> {
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let buf = vec![3u8; len];
    let mut ack = [0u8; 1];
    let mut runs = Vec::new();
    for _ in 0..=RUNS_BIG {
        let t = Instant::now();
        for c in buf.chunks(RAW_CHUNK) {
            s.write_all(c)?;
        }
        s.read_exact(&mut ack)?;
        runs.push(t.elapsed());
    }
    runs.remove(0);
    Ok(gbps(len as u64, best(runs)))
}

struct UnitProc {
    child: Child,
    addr: String,
    raw: Option<String>,
    /// A one-byte echo in the unit process: the round trip between the two processes'
    /// cores, the floor under any request's latency.
    echo: String,
    /// A bare shm agent of the unit process: its metadata and the id of its registered
    /// region, the target of the reference WRITEs between the same two processes.
    bare: (Vec<u8>, u64),
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
}

impl UnitProc {
    /// A unit process over `kind` pinned to `cpu` (unpinned when `None`), busy-polling for
    /// `poll` if given.
    fn start(kind: &str, cpu: Option<usize>, poll: Option<Duration>) -> Result<Self> {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.arg("storage").env(UNIT_ENV, kind);
        match cpu {
            Some(cpu) => cmd.env(UNIT_CPU_ENV, cpu.to_string()),
            None => cmd.env(UNIT_CPU_ENV, "none"),
        };
        match poll {
            Some(p) => cmd.env(UNIT_POLL_ENV, p.as_micros().to_string()),
            None => cmd.env_remove(UNIT_POLL_ENV),
        };
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting the unit process")?;
        let mut lines = BufReader::new(child.stdout.take().context("unit stdout")?).lines();
        let mut next = || -> Result<String> {
            lines
                .next()
                .ok_or_else(|| anyhow!("unit exited"))?
                .map_err(Into::into)
        };
        let addr = next()?.strip_prefix("ADDR ").context("ADDR")?.to_owned();
        let raw = next()?
            .strip_prefix("RAW ")
            .map(str::to_owned)
            .filter(|a| a != "-");
        let echo = next()?.strip_prefix("ECHO ").context("ECHO")?.to_owned();
        let bare = next()?;
        let (meta, reg) = bare
            .strip_prefix("BARE ")
            .and_then(|b| b.split_once(' '))
            .context("BARE")?;
        let bare = (hex::decode(meta)?, reg.parse()?);
        Ok(Self {
            child,
            addr,
            raw,
            echo,
            bare,
            lines,
        })
    }

    /// A shm agent here that WRITEs into the unit process's bare region.
    fn bare(&mut self) -> Result<Bare> {
        let agent = tessera_engines::EngineKind::Shm.agent("bench-bare")?;
        let region = tessera_transport::Region::new(BARE_BYTES)?;
        region.fill(0, BARE_BYTES, 0x5A)?;
        let reg = agent.register(&region)?;
        let peer = agent.add_remote(&self.bare.0)?;
        let stdin = self.child.stdin.as_mut().context("unit stdin")?;
        writeln!(stdin, "ADD {}", hex::encode(agent.metadata()))?;
        stdin.flush()?;
        let answer = self.lines.next().ok_or_else(|| anyhow!("unit exited"))??;
        if answer != "ADDED" {
            bail!("unit: {answer}");
        }
        Ok(Bare {
            _agent: agent,
            _region: region,
            reg,
            peer,
            peer_reg: self.bare.1,
        })
    }

    fn stop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

impl Drop for UnitProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How far past an answer the polling unit process polls for an expected request.
fn unit_expect() -> Result<Duration> {
    let us = match std::env::var(UNIT_EXPECT_ENV) {
        Ok(us) => us.parse().context(UNIT_EXPECT_ENV)?,
        Err(_) => BusyPoll::SERVE_EXPECT_DEFAULT_US,
    };
    Ok(Duration::from_micros(us))
}

fn unit_main(kind: &str) -> Result<()> {
    match std::env::var(UNIT_CPU_ENV).as_deref() {
        Ok("none") => {}
        Ok(c) => pin(c.parse().context(UNIT_CPU_ENV)?)?,
        Err(_) => pin(UNIT_CPU)?,
    }
    let backend = match kind.parse::<Backend>()? {
        b @ (Backend::Shm | Backend::Tcp | Backend::Ucx) => b,
        other => bail!("the storage suite's unit runs shm, tcp or ucx, not {other}"),
    };
    let poll = match std::env::var(UNIT_POLL_ENV) {
        Ok(us) => Some(BusyPoll::expecting(
            Duration::from_micros(us.parse().context(UNIT_POLL_ENV)?),
            unit_expect()?,
        )?),
        Err(_) => None,
    };
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    rt.worker_threads(1).enable_all();
    if let Some(p) = &poll {
        rt.on_thread_park(p.on_park());
    }
    let rt = rt.build()?;
    rt.block_on(async {
        let server = Server::start(ServerConfig {
            bind: "127.0.0.1:0".into(),
            backend,
            pool_bytes: 1 << 30,
            prefault_pool: true,
            unit: UnitConfig {
                capacity_bytes: 1 << 30,
                ..UnitConfig::default()
            },
            busy_poll: poll,
            ..ServerConfig::default()
        })
        .await?;
        let raw = if backend == Backend::Tcp {
            let l = TcpListener::bind("127.0.0.1:0")?;
            let a = l.local_addr()?.to_string();
            std::thread::spawn(move || raw_sink(l));
            a
        } else {
            "-".into()
        };
        let echo = TcpListener::bind("127.0.0.1:0")?;
        let echo_addr = echo.local_addr()?.to_string();
        std::thread::spawn(move || echo_bytes(echo));
        let bare = tessera_engines::EngineKind::Shm.agent("bench-bare-target")?;
        let region = tessera_transport::Region::new(BARE_BYTES)?;
        region.fill(0, BARE_BYTES, 0xA5)?;
        let reg = bare.register(&region)?;
        {
            let mut out = std::io::stdout().lock();
            writeln!(out, "ADDR {}", server.addr())?;
            writeln!(out, "RAW {raw}")?;
            writeln!(out, "ECHO {echo_addr}")?;
            writeln!(out, "BARE {} {}", hex::encode(bare.metadata()), reg.id())?;
            out.flush()?;
        }
        // Serve until the parent closes stdin; `ADD <hex>` adds the parent's bare agent.
        tokio::task::spawn_blocking(move || -> Result<()> {
            let mut peers = Vec::new();
            for line in std::io::stdin().lock().lines() {
                let line = line?;
                let answer = match line.strip_prefix("ADD ") {
                    Some(h) => match hex::decode(h)
                        .map_err(anyhow::Error::from)
                        .and_then(|m| bare.add_remote(&m).map_err(anyhow::Error::from))
                    {
                        Ok(p) => {
                            peers.push(p);
                            "ADDED".to_owned()
                        }
                        Err(e) => format!("ERR {e:#}"),
                    },
                    None => format!("ERR unknown command {line}"),
                };
                let mut out = std::io::stdout().lock();
                writeln!(out, "{answer}")?;
                out.flush()?;
            }
            drop(peers);
            drop(reg);
            drop(region);
            Ok(())
        })
        .await??;
        server.shutdown().await;
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(())
}

/// Reads 256 MiB at a time into a pre-touched buffer and acknowledges each with one byte.
fn raw_sink(listener: TcpListener) {
    for s in listener.incoming() {
        let Ok(mut s) = s else { return };
        let _ = s.set_nodelay(true);
        let mut buf = vec![1u8; BIG];
        'outer: loop {
            for chunk in buf.chunks_mut(RAW_CHUNK) {
                if s.read_exact(chunk).is_err() {
                    break 'outer;
                }
            }
            if s.write_all(&[1]).is_err() {
                break;
            }
        }
    }
}
