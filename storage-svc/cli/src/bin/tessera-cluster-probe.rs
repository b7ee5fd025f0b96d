//! The client host of `cargo xtask cluster-test`: a client of a cluster (found through etcd)
//! driven one command per line on stdin, answering one line each on stdout, so that the test
//! can kill, partition and restart units and etcd between its steps.
//!
//! Values go in requests of `--per-request` (32), `--in-flight` (1) of them at a time.
//!
//! - `PUT A B`: stores indexes `A..B` of partition `p`, field `x`, each a 16 KiB tensor whose
//!   bytes follow from its index; `OK <ms>` or `ERR <error>`.
//! - `CHECK A B`: reads them back and compares every byte; `OK <ms>` or `ERR <error>`.
//! - `READ A B`: reads them without comparing (for throughput); `OK <bytes> <ms>`.
//! - `DROP`: drops the partition on every unit; `OK <ms>`.
//! - `REPAIR A B`: [`Client::repair`] of them; `OK <checked> <copies> <lost> <ms>`.
//! - `WAIT NAMES MS`: waits until the units in use are `NAMES` (comma-separated, in
//!   placement order, which is by name) and the set is fresh; `OK <ms>` or `ERR <what it saw>`.
//! - `UNITS`: `UNITS <names> STALE <seconds or ->`.
//! - `KEYS`: `KEYS name=keys,...` (a unit that does not answer reads `name=ERR`).

use std::io::BufRead;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use tessera_storage::cluster::ClusterConfig;
use tessera_storage::units::parse_duration;
use tessera_storage::{Backend, Client, ClientConfig, Tensor, Token, Value};

#[derive(Parser)]
struct Args {
    /// etcd client URLs.
    #[arg(long, value_delimiter = ',')]
    etcd: Vec<String>,
    /// The cluster's name.
    #[arg(long)]
    cluster: String,
    /// Payload backend: tcp or ucx.
    #[arg(long)]
    backend: Backend,
    /// This host's address for the client's payload engine (tcp).
    #[arg(long)]
    payload_addr: Option<SocketAddr>,
    /// Copies of every value.
    #[arg(long, default_value_t = 2)]
    replicas: usize,
    /// How long a unit's answer may take before it counts as failed (and a GET falls over).
    #[arg(long, value_parser = parse_duration, default_value = "3s")]
    timeout: Duration,
    /// Bytes of every value.
    #[arg(long, default_value_t = 16 << 10)]
    value_bytes: usize,
    /// Values per request of PUT, CHECK and READ.
    #[arg(long, default_value_t = 32)]
    per_request: usize,
    /// Requests that PUT, CHECK and READ keep in flight at once (a unit leases each
    /// session 256 MiB at most by default).
    #[arg(long, default_value_t = 1)]
    in_flight: usize,
    /// Bytes of the client's receive pool (at least `in_flight` requests).
    #[arg(long, value_parser = tessera_storage::units::parse_size, default_value = "256MiB")]
    recv_pool: u64,
}

/// Runs `each` over `idx` in requests of `args.per_request` indexes, `args.in_flight` at a
/// time; the sum of what they return.
async fn requests<F, Fut>(c: &Arc<Client>, idx: &[u64], args: &Args, each: F) -> Result<u64>
where
    F: Fn(Arc<Client>, Vec<u64>) -> Fut,
    Fut: std::future::Future<Output = Result<u64>> + Send + 'static,
{
    let mut set = tokio::task::JoinSet::new();
    let mut total = 0;
    for chunk in idx.chunks(args.per_request.max(1)) {
        if set.len() >= args.in_flight.max(1) {
            total += set.join_next().await.expect("a request in flight")??;
        }
        set.spawn(each(c.clone(), chunk.to_vec()));
    }
    while let Some(r) = set.join_next().await {
        total += r??;
    }
    Ok(total)
}

const PARTITION: &str = "p";
const FIELD: &str = "x";

/// Index `i`'s bytes: 64-bit words mixed from the index and their position (cheap enough
/// not to weigh on a timed PUT, and different for every index and offset).
fn bytes_of(i: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len.next_multiple_of(8));
    for w in 0..len.div_ceil(8) as u64 {
        let x = (i << 32 ^ w).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        out.extend_from_slice(&(x ^ x >> 31).to_le_bytes());
    }
    out.truncate(len);
    out
}

fn range(words: &[&str]) -> Result<Vec<u64>> {
    let [a, b] = words else {
        bail!("expected A B");
    };
    Ok((a.parse::<u64>()?..b.parse::<u64>()?).collect())
}

fn names(c: &Client) -> String {
    let m = c.membership();
    let names: Vec<String> = m.units.into_iter().map(|u| u.name).collect();
    names.join(",")
}

async fn command(c: &Arc<Client>, args: &Args, line: &str) -> Result<String> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let t = Instant::now();
    let ms = |t: Instant| t.elapsed().as_millis();
    match words.as_slice() {
        ["PUT", rest @ ..] => {
            let len = args.value_bytes;
            requests(c, &range(rest)?, args, move |c, chunk| async move {
                let values = chunk
                    .iter()
                    .map(|&i| {
                        let data = bytes_of(i, len);
                        Ok(Value::Tensor(Tensor::from_slice(&[len as u64], &data)?))
                    })
                    .collect::<Result<Vec<_>>>()?;
                c.put(PARTITION, &chunk, &[(FIELD.to_owned(), values)])
                    .await?;
                Ok(0)
            })
            .await?;
            Ok(format!("OK {}", ms(t)))
        }
        ["CHECK", rest @ ..] => {
            let len = args.value_bytes;
            requests(c, &range(rest)?, args, move |c, chunk| async move {
                let got = c.get(PARTITION, &chunk, &[FIELD]).await?;
                for (&i, v) in chunk.iter().zip(&got[0]) {
                    let t = v.as_tensor().context("not a tensor")?;
                    if t.data() != bytes_of(i, len).as_slice() {
                        bail!("index {i} read back different bytes");
                    }
                }
                Ok(0)
            })
            .await?;
            Ok(format!("OK {}", ms(t)))
        }
        ["READ", rest @ ..] => {
            let bytes = requests(c, &range(rest)?, args, |c, chunk| async move {
                let got = c.get(PARTITION, &chunk, &[FIELD]).await?;
                let mut bytes = 0u64;
                for v in &got[0] {
                    bytes += v.as_tensor().context("not a tensor")?.data().len() as u64;
                }
                Ok(bytes)
            })
            .await?;
            Ok(format!("OK {bytes} {}", ms(t)))
        }
        ["DROP"] => {
            c.drop_partition(PARTITION).await?;
            Ok(format!("OK {}", ms(t)))
        }
        ["REPAIR", rest @ ..] => {
            let idx = range(rest)?;
            let r = c.repair(PARTITION, &idx, &[FIELD]).await?;
            Ok(format!(
                "OK {} {} {} {}",
                r.checked,
                r.copies,
                r.lost.len(),
                ms(t)
            ))
        }
        ["WAIT", want, bound] => {
            let bound = Duration::from_millis(bound.parse()?);
            loop {
                if names(c) == *want && c.membership().stale_for.is_none() {
                    return Ok(format!("OK {}", ms(t)));
                }
                if t.elapsed() > bound {
                    bail!(
                        "after {bound:?} the units are {:?} (stale: {:?})",
                        names(c),
                        c.membership().stale_for
                    );
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        ["UNITS"] => {
            let stale = c
                .membership()
                .stale_for
                .map_or("-".to_owned(), |d| format!("{:.1}", d.as_secs_f64()));
            Ok(format!("UNITS {} STALE {stale}", names(c)))
        }
        ["KEYS"] => {
            let each: Vec<String> = c
                .stats_each()
                .await
                .into_iter()
                .map(|(m, r)| match r {
                    Ok(s) => format!("{}={}", m.name, s.keys),
                    Err(_) => format!("{}=ERR", m.name),
                })
                .collect();
            Ok(format!("KEYS {}", each.join(",")))
        }
        _ => bail!("unknown command {line:?}"),
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut cluster = ClusterConfig::new(args.etcd.clone(), args.cluster.clone());
        cluster.retry_max = Duration::from_millis(500);
        let c = Arc::new(
            Client::connect(ClientConfig {
                cluster: Some(cluster),
                units: Vec::new(),
                backend: args.backend,
                payload_addr: args.payload_addr,
                token: Token::from_env("TESSERA_TOKEN")?,
                replicas: args.replicas,
                timeout: args.timeout,
                recv_pool_bytes: args.recv_pool,
                ..ClientConfig::default()
            })
            .await
            .context("connecting to the cluster")?,
        );
        println!("READY");
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        while let Some(line) = rx.recv().await {
            let answer = match command(&c, &args, &line).await {
                Ok(a) => a,
                Err(e) => format!("ERR {}", format!("{e:#}").replace('\n', " ")),
            };
            println!("{answer}");
        }
        Ok(())
    })
}
