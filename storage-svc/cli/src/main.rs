//! `tessera-storage serve | put | get | clear | stats`: the storage unit's binary. It reads the
//! TOML configuration, installs the log subscriber and the Prometheus exporter, and parses the
//! command line; the unit and the client are the `tessera-storage` library's.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Args, Parser, Subcommand};
use tessera_storage::{
    Backend, BusyPoll, Client, ClientConfig, Server, ServerConfig, Token, Value,
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
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a unit until Ctrl-C (or SIGTERM).
    Serve(Serve),
    /// Store a file's bytes (or a string) at one index and field.
    Put {
        #[command(flatten)]
        conn: Conn,
        #[arg(long)]
        partition: String,
        #[arg(long)]
        index: u64,
        #[arg(long)]
        field: String,
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
        #[arg(long)]
        partition: String,
        #[arg(long)]
        index: u64,
        #[arg(long)]
        field: String,
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Clear indexes (all fields), or drop the partition with --all.
    Clear {
        #[command(flatten)]
        conn: Conn,
        #[arg(long)]
        partition: String,
        #[arg(long, value_delimiter = ',')]
        index: Vec<u64>,
        #[arg(long)]
        all: bool,
    },
    /// Print each unit's statistics as JSON-like debug output.
    Stats {
        #[command(flatten)]
        conn: Conn,
    },
}

#[derive(Args)]
struct Conn {
    /// Unit control addresses (repeat or comma-separate for several units).
    #[arg(long, value_delimiter = ',', default_value = "127.0.0.1:7470")]
    unit: Vec<String>,
    #[arg(long, value_parser = backend_parser(), default_value = "shm")]
    backend: Backend,
    #[command(flatten)]
    token: TokenArgs,
    /// tcp backend: this host's address for the client's payload engine (default 127.0.0.1).
    #[arg(long)]
    payload_addr: Option<std::net::SocketAddr>,
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
    #[arg(long, default_value_t = 50)]
    busy_poll_us: u64,
    #[arg(long)]
    bind: Option<String>,
    #[arg(long, value_parser = backend_parser())]
    backend: Option<Backend>,
    /// tcp backend: this host's address that clients reach the payload engine on (port 0
    /// picks one; default 127.0.0.1, this host only).
    #[arg(long)]
    payload_addr: Option<std::net::SocketAddr>,
    /// Logical bytes stored at most.
    #[arg(long)]
    capacity: Option<u64>,
    /// Registered memory at most, in bytes (registered in chunks as needed).
    #[arg(long)]
    pool: Option<u64>,
    /// Bytes of one chunk of registered memory.
    #[arg(long)]
    pool_chunk: Option<u64>,
    /// Idle registered bytes kept at most (free chunks beyond it are deregistered).
    #[arg(long)]
    idle_pool: Option<u64>,
    #[arg(long)]
    leased_limit: Option<u64>,
    #[arg(long)]
    quarantine_limit: Option<u64>,
    /// Milliseconds a closed session's exposed blocks stay quarantined when the payload
    /// engine cannot tell that the client's link is torn down (ucx, nixl, inproc).
    #[arg(long)]
    late_write_grace: Option<u64>,
    #[arg(long)]
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
    /// Serve Prometheus metrics on this address.
    #[arg(long)]
    metrics: Option<std::net::SocketAddr>,
    /// Print the effective configuration as TOML and exit.
    #[arg(long)]
    print_config: bool,
    /// Print "listening ADDR" on stdout once serving (for scripts and tests).
    #[arg(long)]
    announce: bool,
}

/// `--backend`: one of the library's names (`Backend::ALL`, parsed by `Backend::from_str`),
/// listed in `--help` and in the error for any other value.
fn backend_parser() -> impl TypedValueParser<Value = Backend> {
    PossibleValuesParser::new(Backend::ALL.map(Backend::name))
        .try_map(|name| name.parse::<Backend>())
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    tracing_init(cli.log_level.as_deref())?;
    let poll = match &cli.cmd {
        Cmd::Serve(s) if s.busy_poll_us > 0 => Some(
            BusyPoll::new(Duration::from_micros(s.busy_poll_us))
                .context("setting up busy polling")?,
        ),
        _ => None,
    };
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    rt.worker_threads(2).enable_all();
    if let Some(p) = &poll {
        rt.on_thread_park(p.on_park());
    }
    rt.build()?.block_on(run(cli, poll))
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
    let token = c.token.token()?;
    Ok(Client::connect(ClientConfig {
        units: c.unit,
        backend: c.backend,
        token,
        payload_addr: c.payload_addr,
        ..ClientConfig::default()
    })
    .await?)
}

async fn run(cli: Cli, poll: Option<BusyPoll>) -> Result<()> {
    match cli.cmd {
        Cmd::Serve(s) => serve(s, poll).await,
        Cmd::Put {
            conn,
            partition,
            index,
            field,
            file,
            value,
        } => {
            let bytes = match (file, value) {
                (Some(f), _) => std::fs::read(&f).with_context(|| format!("reading {f:?}"))?,
                (None, Some(v)) => v.into_bytes(),
                (None, None) => bail!("give --file or --value"),
            };
            let c = client(conn).await?;
            c.put(
                &partition,
                &[index],
                &[(field, vec![Value::Bytes(bytes.into())])],
            )
            .await?;
            Ok(())
        }
        Cmd::Get {
            conn,
            partition,
            index,
            field,
            out,
        } => {
            let c = client(conn).await?;
            let got = c.get(&partition, &[index], &[&field]).await?;
            let v = &got[0][0];
            match (v, out) {
                (Value::Bytes(b), Some(path)) => std::fs::write(path, b)?,
                (Value::Tensor(t), Some(path)) => std::fs::write(path, t.contiguous()?.data())?,
                (v, _) => println!("{}", summary(v)),
            }
            Ok(())
        }
        Cmd::Clear {
            conn,
            partition,
            index,
            all,
        } => {
            let c = client(conn).await?;
            if all {
                c.drop_partition(&partition).await?;
            } else {
                c.clear(&partition, &index).await?;
            }
            Ok(())
        }
        Cmd::Stats { conn } => {
            let c = client(conn).await?;
            for (i, s) in c.stats().await?.iter().enumerate() {
                println!("unit {i}: {s:#?}");
            }
            Ok(())
        }
    }
}

fn summary(v: &Value) -> String {
    match v {
        Value::Bytes(b) => format!("bytes[{}]", b.len()),
        Value::Tensor(t) => format!("tensor {:?} {:?}", t.dtype(), t.shape()),
        other => format!("{other:?}"),
    }
}

async fn serve(s: Serve, poll: Option<BusyPoll>) -> Result<()> {
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
    if let Some(v) = s.leased_limit {
        cfg.unit.leased_limit = v;
    }
    if let Some(v) = s.quarantine_limit {
        cfg.unit.quarantine_limit = v;
    }
    if let Some(v) = s.late_write_grace {
        cfg.unit.late_write_grace = Duration::from_millis(v);
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
    cfg.busy_poll = poll;
    if s.print_config {
        print!("{}", toml::to_string(&cfg)?);
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
    let server = Server::start(cfg).await?;
    if s.announce {
        println!("listening {}", server.addr());
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    server.shutdown().await;
    Ok(())
}
