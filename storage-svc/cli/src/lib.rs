//! `tessera-storage serve | put | get | clear | stats`: the storage unit's command line. It
//! reads the TOML configuration, installs the log subscriber and the Prometheus exporter, and
//! parses the command line; the unit and the client are the `tessera-storage` library's.
//!
//! The `tessera-storage` binary and `python -m tessera.storage` both call [`run`], so the two
//! take the same flags.

#![forbid(unsafe_code)]

use std::ffi::OsString;
use std::io::Write;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Args, Parser, Subcommand};
use tessera_storage::units::{fmt_bytes, parse_duration, parse_size};
use tessera_storage::{
    Backend, BusyPoll, Client, ClientConfig, ClientError, ErrorKind, Member, Modulo, Placement,
    Rendezvous, Server, ServerConfig, Stats, Token, Value,
};

#[derive(Parser)]
#[command(
    name = "tessera-storage",
    about = "PUT / GET / CLEAR storage unit and client"
)]
struct Cli {
    /// What to log on stderr, as a filter in `RUST_LOG` syntax (`debug`,
    /// `tessera_storage=debug,warn`, ...); overrides `RUST_LOG`. Default: `RUST_LOG`, else
    /// `warn`. At `debug`, every request's span (`session` > `request` with its id and
    /// operation) is printed as it closes, with its time.
    #[arg(long, global = true, value_name = "FILTER")]
    log_level: Option<String>,
    /// Print nothing on success: no line when the unit starts, no confirmation of a command
    /// (errors still go to stderr; `get` without --out still prints the value).
    #[arg(long, short, global = true)]
    quiet: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a unit until Ctrl-C (or SIGTERM).
    Serve(Box<Serve>),
    /// Store a file's bytes (or a string) at one index and field.
    Put {
        #[command(flatten)]
        conn: Conn,
        #[command(flatten)]
        key: Key,
        /// File whose bytes are stored.
        #[arg(long, conflicts_with = "value")]
        file: Option<PathBuf>,
        /// A string stored as bytes.
        #[arg(long)]
        value: Option<String>,
    },
    /// Read one index and field; writes bytes to --out or prints a summary.
    Get {
        #[command(flatten)]
        conn: Conn,
        #[command(flatten)]
        key: Key,
        /// File the value's bytes are written to (a tensor's in row-major order).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Clear indexes (all fields), or drop the partition with --all.
    Clear {
        #[command(flatten)]
        conn: Conn,
        /// Partition to clear.
        #[arg(long)]
        partition: String,
        #[command(flatten)]
        which: Which,
    },
    /// Print each unit's statistics: a table, or one JSON object per unit with --json.
    Stats {
        #[command(flatten)]
        conn: Conn,
        /// One JSON object per unit and line, every figure of STATS.
        #[arg(long)]
        json: bool,
    },
}

/// What `clear` clears: some indexes or the whole partition, one of them.
#[derive(Args)]
#[group(required = true, multiple = false)]
struct Which {
    /// Indexes to clear, every field of each (comma-separated or repeated).
    #[arg(
        long,
        value_delimiter = ',',
        value_parser = parse_index,
        allow_negative_numbers = true
    )]
    index: Vec<u64>,
    /// Drop the whole partition.
    #[arg(long)]
    all: bool,
}

/// One stored key: partition, index and field.
#[derive(Args)]
struct Key {
    /// Partition the key is in (created by its first PUT).
    #[arg(long)]
    partition: String,
    /// Index of the sample (0 or more).
    #[arg(long, value_parser = parse_index, allow_negative_numbers = true)]
    index: u64,
    /// Field of the sample.
    #[arg(long)]
    field: String,
}

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}[{}].{}", self.partition, self.index, self.field)
    }
}

/// Where a cluster's units are found: etcd, and the cluster's name.
#[derive(Args)]
struct ClusterArgs {
    /// etcd client URLs (http://HOST:PORT; repeat or comma-separate for several) that keep
    /// the cluster's membership (needs a build with the `etcd` feature).
    #[arg(long, value_delimiter = ',', value_name = "URL", requires = "cluster")]
    etcd: Vec<String>,
    /// The cluster's name in etcd (its keys are under /tessera/NAME/).
    #[arg(long, value_name = "NAME", requires = "etcd")]
    cluster: Option<String>,
}

impl ClusterArgs {
    /// The cluster named, with a lease of `lease_ttl` (etcd-built binaries only).
    #[cfg(feature = "etcd")]
    fn config(
        &self,
        lease_ttl: Option<Duration>,
    ) -> Option<tessera_storage::cluster::ClusterConfig> {
        let name = self.cluster.clone()?;
        let mut cfg = tessera_storage::cluster::ClusterConfig::new(self.etcd.clone(), name);
        if let Some(ttl) = lease_ttl {
            cfg.lease_ttl = ttl;
        }
        Some(cfg)
    }

    /// A binary built without clusters refuses the flags by name.
    #[cfg(not(feature = "etcd"))]
    fn config(&self, _: Option<Duration>) -> Option<std::convert::Infallible> {
        None
    }

    fn refused_without_etcd(&self) -> Result<()> {
        if cfg!(not(feature = "etcd")) && self.cluster.is_some() {
            bail!(
                "this tessera-storage was built without clusters: --etcd and --cluster need \
                 `cargo build -p tessera-storage-cli --features etcd` (and protoc to build it)"
            );
        }
        Ok(())
    }
}

#[derive(Args)]
struct Conn {
    /// Unit control addresses, HOST:PORT or unix:PATH (repeat or comma-separate for several
    /// units).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "127.0.0.1:7470",
        value_parser = parse_control_addr,
        conflicts_with = "cluster"
    )]
    unit: Vec<String>,
    /// Instead of --unit: the live units of a cluster, found and followed through etcd.
    #[command(flatten)]
    cluster: ClusterArgs,
    /// Payload backend: the unit's (`serve` prints it when it starts).
    #[arg(long, value_parser = backend_parser(), default_value = "shm")]
    backend: Backend,
    #[command(flatten)]
    token: TokenArgs,
    /// tcp backend: this host's address for the client's payload engine (default 127.0.0.1).
    #[arg(long, value_parser = parse_socket_addr)]
    payload_addr: Option<SocketAddr>,
    /// Copies of every value, on that many of the units (1 to their number).
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// Which units hold an index: `modulo` (index % units, copies on the units after it; the
    /// default for --unit) or `rendezvous` (highest-random-weight hashing over the units'
    /// addresses or, in a cluster, their names; the default and the only choice there).
    #[arg(long, value_enum)]
    placement: Option<PlacementArg>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum PlacementArg {
    Modulo,
    Rendezvous,
}

/// Where the shared token comes from: `--token-file`, `TESSERA_TOKEN`, or `--token`.
#[derive(Args)]
struct TokenArgs {
    /// Shared token, given on the command line. Other users of this host can read it in
    /// /proc/PID/cmdline: prefer --token-file or TESSERA_TOKEN.
    #[arg(long, conflicts_with = "token_file")]
    token: Option<String>,
    /// File holding the shared token (without its trailing newline; it must not be readable by
    /// group or others). Default: the TESSERA_TOKEN environment variable, if set.
    #[arg(long, value_name = "PATH")]
    token_file: Option<PathBuf>,
}

impl TokenArgs {
    /// The token: from the file, else the flag, else `TESSERA_TOKEN`, else none.
    fn token(&self) -> Result<Option<Token>> {
        if let Some(path) = &self.token_file {
            return Ok(Some(Token::from_file(path)?));
        }
        if let Some(t) = &self.token {
            return Ok(Some(Token::new(t).context("--token")?));
        }
        Ok(Token::from_env("TESSERA_TOKEN")?)
    }
}

/// The binary runs units and clients in separate processes: `inproc` moves payloads within
/// one process only, so across processes it would hand back memory it never wrote.
fn refuse_inproc(backend: Backend) -> Result<()> {
    if backend == Backend::Inproc {
        bail!(
            "--backend inproc works within one process only; the tessera-storage binary's \
             unit and clients are separate processes: use shm (this host) or tcp"
        );
    }
    Ok(())
}

#[derive(Args)]
struct Serve {
    /// TOML configuration (see --print-config); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Microseconds a worker with nothing to do keeps polling the sessions' sockets before
    /// it parks (0: park at once). A request that arrives within the window skips the
    /// wake-up of a parked core (tens of microseconds on virtual machines), for at most
    /// this much CPU time per idle moment.
    #[arg(long, default_value_t = BusyPoll::SERVE_DEFAULT_US)]
    busy_poll_us: u64,
    /// Microseconds past an answer that a worker keeps polling, beyond --busy-poll-us, for
    /// a session's next request when the session's latest pauses between requests say it
    /// comes by then (0: never past the window). Needs --busy-poll-us above 0.
    #[arg(long, default_value_t = BusyPoll::SERVE_EXPECT_DEFAULT_US)]
    busy_poll_expect_us: u64,
    /// Control-plane address to listen on: HOST:PORT (port 0 picks one) or unix:PATH.
    /// Default 127.0.0.1:7470.
    #[arg(long, value_parser = parse_control_addr)]
    bind: Option<String>,
    /// Payload backend clients must use: shm (this host), tcp, or ucx / nixl where built.
    #[arg(long, value_parser = backend_parser())]
    backend: Option<Backend>,
    /// tcp backend: this host's address that clients reach the payload engine on (port 0
    /// picks one; default 127.0.0.1, this host only).
    #[arg(long, value_parser = parse_socket_addr)]
    payload_addr: Option<SocketAddr>,
    /// Logical bytes stored at most, keys included (sizes: 4096, 512M = 512 x 10^6,
    /// 512MiB = 512 x 2^20).
    #[arg(long, value_parser = parse_size)]
    capacity: Option<u64>,
    /// Registered memory at most (registered in chunks as needed).
    #[arg(long, value_parser = parse_size)]
    pool: Option<u64>,
    /// Size of one chunk of registered memory.
    #[arg(long, value_parser = parse_size)]
    pool_chunk: Option<u64>,
    /// Idle registered memory kept at most (free chunks beyond it are deregistered).
    #[arg(long, value_parser = parse_size)]
    idle_pool: Option<u64>,
    /// Register the whole pool at start and fault every page of it in, so that no request
    /// waits for a registration or a first touch of fresh memory (the pool is resident from
    /// the start; --idle-pool is then ignored).
    #[arg(long)]
    prefault_pool: bool,
    /// Bytes a large copy of the unit (a GET's WRITE over shm) runs between offers of its
    /// core to other threads, at least 64 KiB (default 1 MiB): shorter lets another session's
    /// small request in sooner, at a small cost to the copy.
    #[arg(long, value_parser = parse_size)]
    copy_slice: Option<u64>,
    /// Registered memory leased to prepared PUTs at most; PUTs beyond it are refused.
    #[arg(long, value_parser = parse_size)]
    leased_limit: Option<u64>,
    /// Quarantined registered memory at most (blocks a failed client may still write);
    /// PUTs beyond it are refused.
    #[arg(long, value_parser = parse_size)]
    quarantine_limit: Option<u64>,
    /// How long a closed session's exposed blocks stay quarantined when the payload engine
    /// cannot tell that the client's link is torn down (ucx, nixl): 30s, 500ms, ...
    #[arg(long, value_parser = parse_duration)]
    late_write_grace: Option<Duration>,
    /// Largest control message accepted from an authenticated client.
    #[arg(long, value_parser = parse_size)]
    max_message: Option<u64>,
    /// Answers queued per session, at most (backpressure beyond it).
    #[arg(long)]
    reply_queue: Option<usize>,
    /// GET WRITEs queued per client, at most.
    #[arg(long)]
    transfer_queue: Option<usize>,
    /// Control connections served at once, at most (kept below the open-file limit).
    #[arg(long)]
    max_connections: Option<usize>,
    /// Stored keys, at most.
    #[arg(long)]
    max_stored_keys: Option<u64>,
    #[command(flatten)]
    token: TokenArgs,
    /// Serve Prometheus metrics on this address (HOST:PORT), at /metrics.
    #[arg(long, value_parser = parse_socket_addr)]
    metrics: Option<SocketAddr>,
    /// Print the effective configuration as TOML and exit (the token is never printed).
    #[arg(long)]
    print_config: bool,
    /// Print the "listening ADDR ..." line even with --quiet (for scripts).
    #[arg(long)]
    announce: bool,
    /// Announce the unit in a cluster: registered in etcd under a lease it keeps alive while
    /// it serves, withdrawn when it stops.
    #[command(flatten)]
    cluster: ClusterArgs,
    /// The unit's name in its cluster (default: its control address), which clients place
    /// keys by: a unit restarted under its name gets its share back.
    #[arg(long, requires = "cluster")]
    name: Option<String>,
    /// How long the cluster keeps listing the unit after its last keep-alive, if it dies or
    /// loses etcd (whole seconds; etcd's minimum is 2s).
    #[arg(long, value_parser = parse_duration, requires = "cluster", default_value = "5s")]
    lease_ttl: Duration,
}

/// An index: a whole number, 0 or more.
fn parse_index(s: &str) -> Result<u64, String> {
    if s.trim_start().starts_with('-') {
        return Err(format!("{s} is negative: indexes are 0 or more"));
    }
    s.parse()
        .map_err(|_| format!("{s:?} is not an index: indexes are whole numbers, 0 or more"))
}

/// `HOST:PORT`, the host a name or an address, resolved now; IPv4 first where the name has
/// both. Every flag that takes a socket address parses it this way.
fn parse_socket_addr(s: &str) -> Result<SocketAddr, String> {
    let addrs: Vec<SocketAddr> = s
        .to_socket_addrs()
        .map_err(|e| format!("{s:?} is not a HOST:PORT address that resolves: {e}"))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| format!("{s:?} resolves to no address"))
}

/// A control-plane address: `unix:PATH`, or `HOST:PORT` as [`parse_socket_addr`] reads it.
fn parse_control_addr(s: &str) -> Result<String, String> {
    match s.strip_prefix("unix:") {
        Some("") => Err("unix: needs a path, as unix:/run/tessera.sock".into()),
        Some(_) => Ok(s.to_owned()),
        None => parse_socket_addr(s).map(|a| a.to_string()),
    }
}

/// `--backend`: one of the library's names (`Backend::ALL`, parsed by `Backend::from_str`),
/// listed in `--help` and in the error for any other value.
fn backend_parser() -> impl TypedValueParser<Value = Backend> {
    PossibleValuesParser::new(Backend::ALL.map(Backend::name))
        .try_map(|name| name.parse::<Backend>())
}

/// Runs the command line `args` (the program name first) and returns the process's exit
/// status: 0 on success, 1 after an error (said on stderr), 2 for a command line clap refuses.
/// `--help` and `--version` print and return 0.
pub fn run<I, T>(args: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            // Help and version go to stdout, errors to stderr, as clap's own exit does.
            let _ = e.print();
            return u8::try_from(e.exit_code()).unwrap_or(2);
        }
    };
    match start(cli) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {}", report(&e));
            1
        }
    }
}

/// An error and its causes in one line each, every text once: the library's errors name
/// their cause in their own text, so a cause already said is not said again. No backtrace:
/// an error is an outcome, not a bug (a panic still prints its own).
fn report(e: &anyhow::Error) -> String {
    let mut out = e.to_string();
    for cause in e.chain().skip(1) {
        let text = cause.to_string();
        if !out.contains(&text) {
            out.push_str("\n  caused by: ");
            out.push_str(&text);
        }
    }
    if let Some(hint) = e
        .chain()
        .find_map(|c| c.downcast_ref::<ClientError>())
        .and_then(hint)
    {
        out.push_str("\n  hint: ");
        out.push_str(hint);
    }
    out
}

/// What to do about a client error, in this binary's flags.
fn hint(e: &ClientError) -> Option<&'static str> {
    match e {
        ClientError::Unauthenticated { had_token: false, .. } => {
            Some("give the unit's token with --token-file PATH or TESSERA_TOKEN")
        }
        ClientError::Unauthenticated { had_token: true, .. } => {
            Some("check that --token-file (or TESSERA_TOKEN) holds the token the unit was started with")
        }
        ClientError::Unreachable { .. } => Some(
            "check that a unit is serving there (tessera-storage serve prints its address) and --unit",
        ),
        ClientError::Remote { source, .. }
            if source.kind == ErrorKind::BadRequest && source.message.contains("backend") =>
        {
            Some("pass the unit's backend with --backend")
        }
        _ => None,
    }
}

fn start(cli: Cli) -> Result<()> {
    tracing_init(cli.log_level.as_deref())?;
    let poll = match &cli.cmd {
        Cmd::Serve(s) if s.busy_poll_us > 0 => Some(
            BusyPoll::expecting(
                Duration::from_micros(s.busy_poll_us),
                Duration::from_micros(s.busy_poll_expect_us),
            )
            .context("setting up busy polling")?,
        ),
        _ => None,
    };
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    rt.worker_threads(workers()).enable_all();
    if let Some(p) = &poll {
        rt.on_thread_park(p.on_park());
    }
    rt.build()?.block_on(execute(cli, poll))
}

/// The runtime's workers: two, or one where the process may run on one core only (pinned,
/// or a cgroup's quota). Two workers on one core took turns at the scheduler's pace: a
/// session's request woken on the worker that was not running waited for the other's time
/// slice to end (a millisecond or more) while that one served a GET of a million keys, where
/// one worker runs it between two of that GET's slices.
fn workers() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get().min(2))
}

/// Logs to stderr through a `tracing` subscriber, filtered by `--log-level` or `RUST_LOG`.
fn tracing_init(level: Option<&str>) -> Result<()> {
    use tracing_subscriber::fmt::format::FmtSpan;
    use tracing_subscriber::EnvFilter;
    let filter = match level {
        Some(l) => EnvFilter::try_new(l).with_context(|| format!("--log-level {l:?}"))?,
        None => EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")),
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_span_events(FmtSpan::CLOSE)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init()
        .map_err(|e| anyhow::anyhow!("installing the log subscriber: {e}"))
}

async fn client(c: Conn) -> Result<Client> {
    refuse_inproc(c.backend)?;
    c.cluster.refused_without_etcd()?;
    let token = c.token.token()?;
    let cluster = c.cluster.config(None);
    let placement: Box<dyn Placement> = match (c.placement, &cluster) {
        (Some(PlacementArg::Modulo), Some(_)) => bail!(
            "--placement modulo needs a fixed --unit list: in a cluster, a unit joining would \
             move nearly every key (leave it out for rendezvous)"
        ),
        (Some(PlacementArg::Modulo), None) | (None, None) => Box::new(Modulo),
        (Some(PlacementArg::Rendezvous), _) | (None, Some(_)) => Box::new(Rendezvous),
    };
    let cfg = ClientConfig {
        units: c.unit,
        #[cfg(feature = "etcd")]
        cluster,
        backend: c.backend,
        token,
        payload_addr: c.payload_addr,
        replicas: c.replicas,
        ..ClientConfig::default()
    };
    Ok(Client::connect_with(cfg, placement).await?)
}

async fn execute(cli: Cli, poll: Option<BusyPoll>) -> Result<()> {
    let say = Say { quiet: cli.quiet };
    match cli.cmd {
        Cmd::Serve(s) => serve(*s, poll, say).await,
        Cmd::Put {
            conn,
            key,
            file,
            value,
        } => {
            let bytes = match (file, value) {
                (Some(f), _) => std::fs::read(&f).with_context(|| format!("reading {f:?}"))?,
                (None, Some(v)) => v.into_bytes(),
                (None, None) => bail!("give --file PATH or --value TEXT: what to store"),
            };
            let len = bytes.len() as u64;
            let c = client(conn).await?;
            let t = Instant::now();
            c.put(
                &key.partition,
                &[key.index],
                &[(key.field.clone(), vec![Value::Bytes(bytes.into())])],
            )
            .await?;
            say.line(format_args!(
                "stored {key}: {} in {}",
                fmt_bytes(len),
                took(t)
            ));
            Ok(())
        }
        Cmd::Get { conn, key, out } => {
            let c = client(conn).await?;
            let t = Instant::now();
            let got = c.get(&key.partition, &[key.index], &[&key.field]).await?;
            let v = &got[0][0];
            let written = match (v, &out) {
                (Value::Bytes(b), Some(path)) => {
                    std::fs::write(path, b).with_context(|| format!("writing {path:?}"))?;
                    b.len()
                }
                (Value::Tensor(tensor), Some(path)) => {
                    let data = tensor.contiguous()?;
                    std::fs::write(path, data.data())
                        .with_context(|| format!("writing {path:?}"))?;
                    data.data().len()
                }
                (v, Some(_)) => bail!(
                    "{key} holds {}, not bytes or a tensor: leave out --out to print it",
                    summary(v)
                ),
                (v, None) => {
                    println!("{}", summary(v));
                    return Ok(());
                }
            };
            if let Some(path) = out {
                say.line(format_args!(
                    "wrote {key} to {}: {} in {}",
                    path.display(),
                    fmt_bytes(written as u64),
                    took(t)
                ));
            }
            Ok(())
        }
        Cmd::Clear {
            conn,
            partition,
            which: Which { index, all },
        } => {
            let c = client(conn).await?;
            let t = Instant::now();
            if all {
                c.drop_partition(&partition).await?;
                say.line(format_args!("dropped partition {partition} in {}", took(t)));
            } else {
                c.clear(&partition, &index).await?;
                say.line(format_args!(
                    "cleared {} index(es) of partition {partition} in {}",
                    index.len(),
                    took(t)
                ));
            }
            Ok(())
        }
        Cmd::Stats { conn, json } => {
            let c = client(conn).await?;
            let each = c.stats_each().await;
            let m = c.membership();
            if m.revision > 0 && !json {
                let names: Vec<&str> = m.units.iter().map(|u| u.name.as_str()).collect();
                let fresh = match m.stale_for {
                    None => String::new(),
                    Some(t) => format!(" (etcd unreachable for {t:.1?}: the last known set)"),
                };
                say.line(format_args!(
                    "{} unit(s) as of etcd revision {}: {}{fresh}",
                    names.len(),
                    m.revision,
                    names.join(", ")
                ));
            }
            if json {
                for (member, r) in &each {
                    match r {
                        Ok(s) => println!("{}", serde_json::to_string(s)?),
                        Err(e) => println!(
                            "{}",
                            serde_json::json!({
                                "unit": member.number,
                                "name": member.name,
                                "error": e.to_string(),
                            })
                        ),
                    }
                }
            } else {
                print!("{}", stats_table(&each));
            }
            // With a fixed list every unit is expected to answer.
            if m.revision == 0 {
                if let Some((_, Err(e))) = each.into_iter().find(|(_, r)| r.is_err()) {
                    return Err(e.into());
                }
            }
            Ok(())
        }
    }
}

/// Where confirmations go: stdout, one line each, unless `--quiet`.
#[derive(Clone, Copy)]
struct Say {
    quiet: bool,
}

impl Say {
    fn line(self, what: std::fmt::Arguments<'_>) {
        if !self.quiet {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{what}");
            let _ = out.flush();
        }
    }
}

/// Time since `t`, for a confirmation.
fn took(t: Instant) -> String {
    let s = t.elapsed().as_secs_f64();
    if s < 1.0 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

/// STATS of each unit as a table, a row per unit (or its error), then its partitions.
fn stats_table(each: &[(Member, Result<Stats, ClientError>)]) -> String {
    let mut out = format!(
        "{:<5} {:>9} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>8}\n",
        "unit",
        "keys",
        "stored",
        "charged",
        "capacity",
        "pool used",
        "registered",
        "quarantine",
        "sessions"
    );
    for (member, r) in each {
        let s = match r {
            Ok(s) => s,
            Err(e) => {
                out.push_str(&format!("{:<5} {e}\n", member.number));
                continue;
            }
        };
        out.push_str(&format!(
            "{:<5} {:>9} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>8}\n",
            member.number,
            s.keys,
            fmt_bytes(s.bytes),
            fmt_bytes(s.charged_bytes),
            fmt_bytes(s.capacity_bytes),
            fmt_bytes(s.pool.used),
            fmt_bytes(s.pool.capacity),
            fmt_bytes(s.quarantined_bytes),
            s.sessions
        ));
        for p in &s.partitions {
            out.push_str(&format!(
                "  partition {:?}: {} keys, {}\n",
                p.name,
                p.keys,
                fmt_bytes(p.bytes)
            ));
        }
    }
    out
}

fn summary(v: &Value) -> String {
    match v {
        Value::Bytes(b) => format!("bytes[{}]", b.len()),
        Value::Tensor(t) => format!("tensor {:?} {:?}", t.dtype(), t.shape()),
        other => format!("{other:?}"),
    }
}

async fn serve(s: Serve, poll: Option<BusyPoll>, say: Say) -> Result<()> {
    let mut cfg: ServerConfig = match &s.config {
        Some(path) => {
            let text =
                std::fs::read_to_string(path).with_context(|| format!("reading {path:?}"))?;
            toml::from_str(&text).with_context(|| format!("parsing {path:?}"))?
        }
        None => ServerConfig::default(),
    };
    if let Some(v) = s.bind {
        cfg.bind = v;
    }
    if let Some(v) = s.backend {
        cfg.backend = v;
    }
    if let Some(v) = s.payload_addr {
        cfg.payload_addr = Some(v);
    }
    if let Some(v) = s.capacity {
        cfg.unit.capacity_bytes = v;
    }
    if let Some(v) = s.pool {
        cfg.pool_bytes = v;
    }
    if let Some(v) = s.pool_chunk {
        cfg.pool_chunk_bytes = v;
    }
    if let Some(v) = s.idle_pool {
        cfg.idle_pool_bytes = v;
    }
    if s.prefault_pool {
        cfg.prefault_pool = true;
    }
    if let Some(v) = s.copy_slice {
        cfg.copy_slice_bytes = v;
    }
    if let Some(v) = s.leased_limit {
        cfg.unit.leased_limit = v;
    }
    if let Some(v) = s.quarantine_limit {
        cfg.unit.quarantine_limit = v;
    }
    if let Some(v) = s.late_write_grace {
        cfg.unit.late_write_grace = v;
    }
    if let Some(v) = s.max_message {
        cfg.max_message_bytes = v;
    }
    if let Some(v) = s.reply_queue {
        cfg.reply_queue = v;
    }
    if let Some(v) = s.transfer_queue {
        cfg.transfer_queue = v;
    }
    if let Some(v) = s.max_connections {
        cfg.max_connections = v;
    }
    if let Some(v) = s.max_stored_keys {
        cfg.unit.max_stored_keys = v;
    }
    if let Some(t) = s.token.token()? {
        cfg.unit.token = Some(t);
    }
    refuse_inproc(cfg.backend)?;
    s.cluster.refused_without_etcd()?;
    cfg.busy_poll = poll;
    if s.print_config {
        print!("{}", toml::to_string(&cfg)?);
        if cfg.unit.token.is_some() {
            println!(
                "# [unit] token: set, never printed (give it with --token-file or TESSERA_TOKEN)"
            );
        }
        return Ok(());
    }
    if let Some(addr) = s.metrics {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            // A peer's queue-depth series goes once the peer has been quiet this long, so
            // clients coming and going do not grow the exposition forever; the unit's own
            // gauges are refreshed every 200 ms and stay.
            .idle_timeout(
                metrics_util::MetricKindMask::GAUGE,
                Some(Duration::from_secs(300)),
            )
            .install()
            .context("starting the metrics endpoint")?;
    }
    let bind = cfg.bind.clone();
    let engine = cfg.backend;
    let (pool, capacity) = (cfg.pool_bytes, cfg.unit.capacity_bytes);
    // Announced where it is known before the engine starts (a port 0 is picked later).
    #[cfg(feature = "etcd")]
    let payload = cfg.payload_addr.filter(|a| a.port() != 0);
    let server = Server::start(cfg)
        .await
        .with_context(|| format!("starting a unit on {bind}"))?;
    let metrics = s
        .metrics
        .map_or_else(String::new, |a| format!(", metrics http://{a}/metrics"));
    Say {
        quiet: say.quiet && !s.announce,
    }
    .line(format_args!(
        "listening {} (engine {}, pool {}, capacity {}, {} worker(s){metrics})",
        server.addr(),
        engine.name(),
        fmt_bytes(pool),
        fmt_bytes(capacity),
        tokio::runtime::Handle::current().metrics().num_workers(),
    ));
    #[cfg(feature = "etcd")]
    let announced = match s.cluster.config(Some(s.lease_ttl)) {
        Some(cluster) => {
            let record = tessera_storage::cluster::UnitRecord {
                control: server.addr().to_owned(),
                engine: engine.name().to_owned(),
                payload: payload.map(|a| a.to_string()),
                capacity,
            };
            Some(announce(&cluster, s.name.as_deref(), record)?)
        }
        None => None,
    };
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    // Withdrawn first: clients stop routing to the unit before it stops answering.
    #[cfg(feature = "etcd")]
    if let Some(a) = announced {
        a.withdraw().await;
    }
    server.shutdown().await;
    Ok(())
}

/// Starts announcing the unit of `record` in `cluster` as `name` (default: its control
/// address).
#[cfg(feature = "etcd")]
fn announce(
    cluster: &tessera_storage::cluster::ClusterConfig,
    name: Option<&str>,
    record: tessera_storage::cluster::UnitRecord,
) -> Result<tessera_cluster::Announcement> {
    if let Ok(addr) = record.control.parse::<SocketAddr>() {
        if addr.ip().is_unspecified() {
            bail!(
                "a unit in a cluster announces its --bind address, and {addr} is no address a \
                 client can reach: bind the address of this host that clients use"
            );
        }
    }
    let name = name.unwrap_or(&record.control);
    tessera_storage::cluster::announce(cluster, name, &record)
        .with_context(|| format!("announcing {name} in cluster {}", cluster.cluster))
}
