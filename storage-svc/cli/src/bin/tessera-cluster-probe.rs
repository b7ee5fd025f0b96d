//! The client host of `cargo xtask cluster-test`: a client of a cluster (found through etcd)
//! driven one command per line on stdin, answering one line each on stdout, so that the test
//! can kill, partition and restart units and etcd between its steps.
//!
//! - `PUT A B`: stores indexes `A..B` of partition `p`, field `x`, each a 16 KiB tensor whose
//!   bytes follow from its index; `OK <ms>` or `ERR <error>`.
//! - `CHECK A B`: reads them back and compares every byte; `OK <ms>` or `ERR <error>`.
//! - `REPAIR A B`: [`Client::repair`] of them; `OK <checked> <copies> <lost> <ms>`.
//! - `WAIT NAMES MS`: waits until the units in use are `NAMES` (comma-separated, in
//!   placement order, which is by name) and the set is fresh; `OK <ms>` or `ERR <what it saw>`.
//! - `UNITS`: `UNITS <names> STALE <seconds or ->`.
//! - `KEYS`: `KEYS name=keys,...` (a unit that does not answer reads `name=ERR`).

use std::io::BufRead;
use std::net::SocketAddr;
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
}

const PARTITION: &str = "p";
const FIELD: &str = "x";

/// Index `i`'s bytes: a xorshift stream seeded by the index.
fn bytes_of(i: u64, len: usize) -> Vec<u8> {
    let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
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

async fn command(c: &Client, args: &Args, line: &str) -> Result<String> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let t = Instant::now();
    let ms = |t: Instant| t.elapsed().as_millis();
    match words.as_slice() {
        ["PUT", rest @ ..] => {
            let idx = range(rest)?;
            for chunk in idx.chunks(256) {
                let values = chunk
                    .iter()
                    .map(|&i| {
                        let data = bytes_of(i, args.value_bytes);
                        Ok(Value::Tensor(Tensor::from_slice(
                            &[data.len() as u64],
                            &data,
                        )?))
                    })
                    .collect::<Result<Vec<_>>>()?;
                c.put(PARTITION, chunk, &[(FIELD.to_owned(), values)])
                    .await?;
            }
            Ok(format!("OK {}", ms(t)))
        }
        ["CHECK", rest @ ..] => {
            let idx = range(rest)?;
            for chunk in idx.chunks(256) {
                let got = c.get(PARTITION, chunk, &[FIELD]).await?;
                for (&i, v) in chunk.iter().zip(&got[0]) {
                    let t = v.as_tensor().context("not a tensor")?;
                    if t.data() != bytes_of(i, args.value_bytes).as_slice() {
                        bail!("index {i} read back different bytes");
                    }
                }
            }
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
        let c = Client::connect(ClientConfig {
            cluster: Some(cluster),
            units: Vec::new(),
            backend: args.backend,
            payload_addr: args.payload_addr,
            token: Token::from_env("TESSERA_TOKEN")?,
            replicas: args.replicas,
            timeout: args.timeout,
            recv_pool_bytes: 256 << 20,
            ..ClientConfig::default()
        })
        .await
        .context("connecting to the cluster")?;
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
