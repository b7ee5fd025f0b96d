//! `run`: starts the storage unit, the consumer and the producer as child processes of this
//! same binary, draws their progress, samples the unit's STATS, and prints the summary.
//!
//! Children run in their own process group, so a Ctrl-C at the terminal reaches only this
//! process, which then stops them by pid and waits for each. Each child also watches its
//! stdin, whose other end only this process holds: if it dies, they stop too.

use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use tessera_storage::{Client, ClientConfig, Stats};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;

use crate::events::{ConsumerReport, Event, Phase, ProducerReport};
use crate::roles::backend;
use crate::summary::{self, fmt_bytes, Outcome};
use crate::workload::{weight_specs, Workload};

/// The engines `run` accepts by name; whether the storage crate offers them is checked
/// before anything starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum BackendName {
    /// Shared memory between processes of one host (no system library).
    Shm,
    /// TCP, across hosts.
    Tcp,
    /// UCX (cargo feature `ucx`; `cargo xtask demo --backend ucx` builds with it).
    Ucx,
    /// NIXL (cargo feature `nixl`; `cargo xtask demo --backend nixl` builds with it).
    Nixl,
}

impl BackendName {
    fn as_str(self) -> &'static str {
        match self {
            BackendName::Shm => "shm",
            BackendName::Tcp => "tcp",
            BackendName::Ucx => "ucx",
            BackendName::Nixl => "nixl",
        }
    }
}

/// Flags of `run`.
#[derive(Debug, Args)]
pub(crate) struct RunArgs {
    /// Payload engine of the storage unit, its clients and the weight pools.
    #[arg(long, value_enum, default_value = "shm")]
    backend: BackendName,
    /// A few steps and an 8 MiB weight set: a few seconds (not with the workload flags).
    #[arg(long, conflicts_with = "Workload")]
    short: bool,
    /// Stop the producer after its first step (for the Ctrl-C test).
    #[arg(long, hide = true)]
    stall: bool,
    #[command(flatten)]
    workload: Workload,
}

/// A child process and the pipe that keeps it alive.
struct Proc {
    name: &'static str,
    pid: u32,
    child: Child,
    stdin: Option<ChildStdin>,
}

/// Every child started so far, in start order.
#[derive(Default)]
struct Procs(Vec<Proc>);

impl Procs {
    fn spawn(&mut self, name: &'static str, args: &[String]) -> Result<(u32, ChildStdout)> {
        let exe = std::env::current_exe().context("locating this binary")?;
        let mut child = Command::new(exe)
            .arg(name)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting the {name}"))?;
        let pid = child.id().context("a just-started child has a pid")?;
        let stdout = child.stdout.take().context("piped stdout")?;
        let stdin = child.stdin.take();
        self.0.push(Proc {
            name,
            pid,
            child,
            stdin,
        });
        Ok((pid, stdout))
    }

    /// Stops every child that still runs: workers are killed by pid; the unit gets its stdin
    /// closed (its ordered shutdown) and is killed if it takes longer than `grace`. Returns
    /// one line per child, and whether the unit shut down by itself.
    async fn stop_all(&mut self, grace: Duration) -> (Vec<String>, bool) {
        let mut lines = Vec::new();
        let mut unit_clean = true;
        for p in self.0.iter_mut().rev() {
            let how = match p.child.try_wait() {
                Ok(Some(status)) => {
                    // A unit stops only when told to.
                    unit_clean &= p.name != "unit";
                    format!("had exited ({status})")
                }
                _ if p.name == "unit" => {
                    p.stdin = None;
                    match tokio::time::timeout(grace, p.child.wait()).await {
                        Ok(Ok(status)) if status.success() => "shut down in order".to_owned(),
                        Ok(Ok(status)) => {
                            unit_clean = false;
                            format!("exited with {status}")
                        }
                        _ => {
                            unit_clean = false;
                            kill(p).await
                        }
                    }
                }
                _ => kill(p).await,
            };
            lines.push(format!("{} (pid {}) {how}", p.name, p.pid));
        }
        lines.reverse();
        (lines, unit_clean)
    }
}

async fn kill(p: &mut Proc) -> String {
    let _ = p.child.start_kill();
    match p.child.wait().await {
        Ok(status) => format!("killed ({status})"),
        Err(e) => format!("kill failed: {e}"),
    }
}

/// What the drive loop ended with.
enum End {
    Finished(Box<Finished>),
    Failed(anyhow::Error),
    Interrupted(&'static str),
}

struct Finished {
    producer: ProducerReport,
    consumer: ConsumerReport,
    before: Stats,
    after: Stats,
    peak_pool_used: u64,
    peak_registered: u64,
}

/// Runs the demo; returns the process exit code.
pub(crate) async fn run(args: RunArgs) -> Result<i32> {
    let workload = if args.short {
        Workload::short()
    } else {
        args.workload
    };
    workload.validate()?;
    let name = args.backend.as_str();
    let storage_backend = backend(name)?;
    let specs = weight_specs(&workload)?;

    // Signals first, so that a Ctrl-C during start-up is ours too.
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;

    println!(
        "tessera demo · backend {name} · {} steps × {} rollouts (tokens {}..={}, one 64×64×3 u8 \
         image each) · weights {} in {} tensors, synced {} times",
        workload.steps,
        workload.rollouts,
        workload.min_tokens,
        workload.max_tokens,
        fmt_bytes(workload.weight_bytes),
        specs.len(),
        workload.weight_syncs,
    );
    let started = Instant::now();
    let mut procs = Procs::default();
    let bars = Bars::new(&workload);
    let end = {
        let drive = drive(
            &mut procs,
            &workload,
            storage_backend,
            name,
            args.stall,
            &bars,
        );
        tokio::select! {
            r = drive => match r {
                Ok(f) => End::Finished(Box::new(f)),
                Err(e) => End::Failed(e),
            },
            _ = sigint.recv() => End::Interrupted("Ctrl-C"),
            _ = sigterm.recv() => End::Interrupted("SIGTERM"),
        }
    };
    bars.clear();
    let (lines, unit_clean) = procs.stop_all(Duration::from_secs(10)).await;
    match end {
        End::Interrupted(what) => {
            eprintln!("interrupted ({what}): stopped {}", lines.join(", "));
            Ok(130)
        }
        End::Failed(e) => {
            eprintln!("demo failed: {e:#}");
            eprintln!("stopped {}", lines.join(", "));
            Ok(1)
        }
        End::Finished(f) => {
            let errors = summary::print(&Outcome {
                workload: &workload,
                backend: name,
                producer: &f.producer,
                consumer: &f.consumer,
                before: &f.before,
                after: &f.after,
                peak_pool_used: f.peak_pool_used,
                peak_registered: f.peak_registered,
                unit_clean,
                wall: started.elapsed(),
                memcpy_gbps: summary::memcpy_gbps(),
            });
            Ok(if errors == 0 { 0 } else { 1 })
        }
    }
}

/// A message from a worker's stdout.
enum Line {
    Event(Event),
    Text(String),
}

fn forward(
    who: &'static str,
    stdout: ChildStdout,
    tx: mpsc::UnboundedSender<(&'static str, Line)>,
) {
    tokio::spawn(async move {
        let mut lines = BufReader::new(stdout).lines();
        while let Ok(Some(l)) = lines.next_line().await {
            let msg = match serde_json::from_str::<Event>(&l) {
                Ok(e) => Line::Event(e),
                Err(_) => Line::Text(l),
            };
            if tx.send((who, msg)).is_err() {
                break;
            }
        }
    });
}

async fn drive(
    procs: &mut Procs,
    w: &Workload,
    storage_backend: tessera_storage::Backend,
    name: &str,
    stall: bool,
    bars: &Bars,
) -> Result<Finished> {
    // The unit: a pool that holds the whole run's rollouts, so that backpressure is the
    // exception; logical capacity likewise.
    let rollout_bytes = w.total_rollouts() * (8 * w.max_tokens + 4 + 64 * 64 * 3);
    let pool = (rollout_bytes + (64 << 20)).min(1 << 30);
    let (pid, stdout) = procs.spawn(
        "unit",
        &[
            "--backend".into(),
            name.into(),
            "--pool".into(),
            pool.to_string(),
            "--capacity".into(),
            pool.to_string(),
        ],
    )?;
    let mut lines = BufReader::new(stdout).lines();
    let addr = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(l) = lines.next_line().await? {
            if let Some(a) = tessera_storage::announced_addr(&l) {
                return Ok(a.to_owned());
            }
        }
        bail!("the unit exited before listening")
    })
    .await
    .context("the unit did not start within 60 s")??;
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    bars.println(format!(
        "  unit      pid {pid:<7} listening on {addr}, {} of registered memory",
        fmt_bytes(pool)
    ));

    let client = Client::connect(ClientConfig {
        units: vec![addr.clone()],
        backend: storage_backend,
        recv_pool_bytes: 4 << 20,
        ..ClientConfig::default()
    })
    .await
    .context("connecting to the unit")?;
    let before = client.stats().await?.remove(0);

    let mut worker = vec!["--unit".to_owned(), addr, "--backend".into(), name.into()];
    worker.extend(w.to_args());
    let (tx, mut rx) = mpsc::unbounded_channel();
    let (pid, out) = procs.spawn("consumer", &worker)?;
    forward("consumer", out, tx.clone());
    bars.println(format!(
        "  consumer  pid {pid:<7} the trainer: GETs, verifies and CLEARs rollouts; sends weights"
    ));
    if stall {
        worker.push("--stall".into());
    }
    let (pid, out) = procs.spawn("producer", &worker)?;
    forward("producer", out, tx);
    bars.println(format!(
        "  producer  pid {pid:<7} a rollout worker: PUTs rollouts; receives weights"
    ));

    let mut producer = None;
    let mut consumer = None;
    let mut exited = [false, false];
    let mut peak = before.pool.used;
    let mut peak_registered = before.pool.capacity;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let mut last_sample = Instant::now();
    let check = |who: &str, status: std::io::Result<ExitStatus>| -> Result<()> {
        let status = status?;
        if !status.success() {
            bail!("the {who} exited with {status}; its messages are above");
        }
        Ok(())
    };
    let mut handle = |who: &str, line: Line| match line {
        Line::Event(Event::Progress { phase, done, .. }) => bars.set(phase, done),
        Line::Event(Event::Stage { phase, text }) => bars.stage(phase, text),
        Line::Event(Event::Stalled) => {
            bars.println("  producer  stalled after its first step (--stall)".into())
        }
        Line::Event(Event::Producer(r)) => producer = Some(*r),
        Line::Event(Event::Consumer(r)) => consumer = Some(*r),
        Line::Text(t) => bars.println(format!("  {who}: {t}")),
    };
    let [_unit, cons, prod] = &mut procs.0[..] else {
        bail!("expected the unit, the consumer and the producer");
    };
    while exited != [true, true] {
        tokio::select! {
            Some((who, line)) = rx.recv() => {
                // Progress is sampled too, at most every 5 ms: a short run may end between
                // two ticks, and the unit holds the most while rollouts are in flight.
                let event = matches!(line, Line::Event(_));
                handle(who, line);
                if event && last_sample.elapsed() >= Duration::from_millis(5) {
                    last_sample = Instant::now();
                    if let Ok(s) = client.stats().await {
                        peak = peak.max(s[0].pool.used);
                        peak_registered = peak_registered.max(s[0].pool.capacity);
                    }
                }
            }
            s = prod.child.wait(), if !exited[0] => {
                check("producer", s)?;
                exited[0] = true;
            }
            s = cons.child.wait(), if !exited[1] => {
                check("consumer", s)?;
                exited[1] = true;
            }
            _ = tick.tick() => {
                if let Ok(s) = client.stats().await {
                    peak = peak.max(s[0].pool.used);
                    peak_registered = peak_registered.max(s[0].pool.capacity);
                }
            }
        }
    }
    // Both exited: their stdout ends, so the channel drains and closes.
    while let Some((who, line)) = rx.recv().await {
        handle(who, line);
    }
    // The roles' sessions closed with their processes; what they held exposed (their unused
    // credits) returns once the unit saw their links torn down, on its timer: wait for that
    // (bounded), then look. Anything left then is reported as left.
    let mut after = client.stats().await?.remove(0);
    for _ in 0..250 {
        if after.quarantined_bytes == 0 && after.sessions <= 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        after = client.stats().await?.remove(0);
    }
    bars.finish();
    Ok(Finished {
        producer: producer.context("the producer exited without its report")?,
        consumer: consumer.context("the consumer exited without its report")?,
        before,
        after,
        peak_pool_used: peak,
        peak_registered,
    })
}

/// Rollouts per second for people: `16.5k/s`, `830/s`, `4.2/s`.
fn fmt_rate(per_sec: f64) -> String {
    if !per_sec.is_finite() || per_sec <= 0.0 {
        "-".into()
    } else if per_sec >= 1e6 {
        format!("{:.1}M/s", per_sec / 1e6)
    } else if per_sec >= 1e4 {
        format!("{:.1}k/s", per_sec / 1e3)
    } else if per_sec >= 100.0 {
        format!("{per_sec:.0}/s")
    } else {
        format!("{per_sec:.1}/s")
    }
}

/// The three progress bars (drawn on stderr, only when it is a terminal).
struct Bars {
    multi: MultiProgress,
    produce: ProgressBar,
    consume: ProgressBar,
    weights: ProgressBar,
}

impl Bars {
    fn new(w: &Workload) -> Bars {
        let multi = MultiProgress::with_draw_target(ProgressDrawTarget::stderr());
        let count = ProgressStyle::with_template(
            "{prefix:>10} {bar:36.cyan/blue} {pos:>6}/{len} rollouts {rate:>10} {msg}",
        )
        .expect("a valid template")
        .with_key(
            "rate",
            |s: &indicatif::ProgressState, w: &mut dyn std::fmt::Write| {
                let _ = write!(w, "{}", fmt_rate(s.per_sec()));
            },
        )
        .progress_chars("=> ");
        let bytes = ProgressStyle::with_template(
            "{prefix:>10} {bar:36.green/blue} {binary_bytes:>10}/{binary_total_bytes} verified {msg}",
        )
        .expect("a valid template")
        .progress_chars("=> ");
        let bar = |len: u64, style: &ProgressStyle, prefix: &'static str| {
            let b = multi.add(ProgressBar::new(len));
            b.set_style(style.clone());
            b.set_prefix(prefix);
            b
        };
        Bars {
            produce: bar(w.total_rollouts(), &count, "PUT"),
            consume: bar(w.total_rollouts(), &count, "GET+CLEAR"),
            weights: bar(w.weight_bytes * w.weight_syncs, &bytes, "weights"),
            multi,
        }
    }

    fn bar(&self, phase: Phase) -> &ProgressBar {
        match phase {
            Phase::Produce => &self.produce,
            Phase::Consume => &self.consume,
            Phase::Weights => &self.weights,
        }
    }

    fn set(&self, phase: Phase, done: u64) {
        self.bar(phase).set_position(done);
    }

    fn stage(&self, phase: Phase, text: String) {
        self.bar(phase).set_message(text);
    }

    /// Prints a line on stdout without tearing the bars.
    fn println(&self, line: String) {
        self.multi.suspend(|| println!("{line}"));
    }

    fn finish(&self) {
        for b in [&self.produce, &self.consume, &self.weights] {
            b.finish_with_message("done");
        }
    }

    fn clear(&self) {
        let _ = self.multi.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_read_as_people_write_them() {
        assert_eq!(fmt_rate(16_477.705_185_108_6), "16.5k/s");
        assert_eq!(fmt_rate(830.2), "830/s");
        assert_eq!(fmt_rate(4.25), "4.2/s");
        assert_eq!(fmt_rate(2.5e6), "2.5M/s");
        assert_eq!(fmt_rate(0.0), "-");
        assert_eq!(fmt_rate(f64::INFINITY), "-");
    }
}
