//! The processes `run` spawns: the storage unit, the producer (a rollout worker) and the
//! consumer (a trainer).
//!
//! Readiness protocol, all through the storage unit:
//! - the producer PUTs a step's rollouts (partition `rollouts`, index `step × rollouts + i`),
//!   then a marker at partition `ready`, index `step`, holding the step's CRC32s;
//! - the consumer polls GET of that marker (a `Missing` error means "not yet"), GETs the
//!   step's rollouts, checks each against the marker, and CLEARs the rollouts and the marker;
//! - the trainer publishes each weight version at partition `weights`, index `version`
//!   (its agent's metadata, the rdt-pool object descriptor and the tensors' CRC32s); the
//!   rollout worker fetches it from the trainer's sender pool into its receiver pool and PUTs
//!   an acknowledgement at partition `weights-ack`, index `version`.
//!
//! Every role watches its stdin: the orchestrator holds the other end, so when it is gone
//! (even killed) the role stops.

use std::io::Read;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use tessera_rdt_pool::{ObjectDescriptor, ReceiverPool, SenderPool, TensorRef};
use tessera_storage::{
    Backend, BackendExt, Client, ClientConfig, ErrorKind, Server, ServerConfig, Tensor, UnitConfig,
    Value,
};
use tessera_transport::Agent;
use tokio::sync::oneshot;

use crate::events::{
    emit, ConsumerReport, Event, Phase, ProducerReport, WeightsReceived, WeightsSent,
};
use crate::workload::{
    check_rollout_shapes, crc_of, fill_weight, weight_specs, Rollout, Workload, FIELDS,
};

/// How long a role waits for its peer's next marker before giving up.
const PEER_TIMEOUT: Duration = Duration::from_secs(120);

/// Flags of the storage unit role.
#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
    /// Payload backend (a `tessera_storage::Backend` name).
    #[arg(long)]
    pub(crate) backend: String,
    /// Control address to bind.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub(crate) bind: String,
    /// Bytes of registered memory.
    #[arg(long)]
    pub(crate) pool: u64,
    /// Logical bytes stored at most.
    #[arg(long)]
    pub(crate) capacity: u64,
}

/// Flags of the producer and consumer roles.
#[derive(Debug, Args)]
pub(crate) struct WorkerArgs {
    /// The unit's control address.
    #[arg(long)]
    pub(crate) unit: String,
    /// Payload backend (a `tessera_storage::Backend` name).
    #[arg(long)]
    pub(crate) backend: String,
    /// Stop after the first step and wait to be killed (for the Ctrl-C test).
    #[arg(long, hide = true)]
    pub(crate) stall: bool,
    #[command(flatten)]
    pub(crate) workload: Workload,
}

/// The storage `Backend` called `name`, or why there is none. Never falls back.
pub(crate) fn backend(name: &str) -> Result<Backend> {
    let offered: Vec<&str> = Backend::ALL
        .iter()
        .filter(|b| **b != Backend::Inproc)
        .map(|b| b.name())
        .collect();
    match name.to_ascii_lowercase().parse::<Backend>() {
        Ok(Backend::Inproc) => bail!(
            "backend `inproc` moves bytes inside one process only, and the demo runs the unit, \
             the producer and the consumer as separate processes; choose one of: {}",
            offered.join(", ")
        ),
        Ok(b) if !b.available() => {
            let feature = b.feature().unwrap_or(name);
            bail!(
                "backend `{name}` is not available: this tessera-demo was built without its \
                 cargo feature `{feature}`. Run `cargo xtask demo --backend {name}`, which \
                 installs UCX and NIXL (`cargo xtask deps`) and builds the demo with the \
                 feature. Nothing was started; there is no fallback."
            )
        }
        Ok(b) => Ok(b),
        Err(_) => bail!(
            "unknown backend `{name}`; choose one of: {}",
            offered.join(", ")
        ),
    }
}

/// Ends the process when stdin closes: the orchestrator that holds it is gone.
fn watch_parent(role: &'static str, on_close: Option<oneshot::Sender<()>>) {
    std::thread::spawn(move || {
        let mut sink = [0u8; 64];
        let mut stdin = std::io::stdin();
        while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
        match on_close {
            Some(tx) => {
                let _ = tx.send(());
            }
            None => {
                eprintln!("{role}: the orchestrator is gone; stopping");
                std::process::exit(1);
            }
        }
    });
}

/// The storage unit: serves until stdin closes or SIGTERM, then shuts down in order.
pub(crate) async fn serve(args: ServeArgs) -> Result<()> {
    let (tx, closed) = oneshot::channel();
    watch_parent("unit", Some(tx));
    let server = Server::start(ServerConfig {
        bind: args.bind,
        backend: backend(&args.backend)?,
        pool_bytes: args.pool,
        unit: UnitConfig {
            capacity_bytes: args.capacity,
            ..UnitConfig::default()
        },
        ..ServerConfig::default()
    })
    .await
    .context("starting the storage unit")?;
    println!("listening {}", server.addr());
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = closed => {}
        _ = term.recv() => {}
    }
    server.shutdown().await;
    Ok(())
}

async fn connect(args: &WorkerArgs, recv_pool_bytes: u64) -> Result<Client> {
    Client::connect(ClientConfig {
        units: vec![args.unit.clone()],
        backend: backend(&args.backend)?,
        recv_pool_bytes,
        ..ClientConfig::default()
    })
    .await
    .with_context(|| format!("connecting to the unit at {}", args.unit))
}

/// GETs `fields` at `partition`/`index`, polling while the key is missing. Returns the
/// values (one per field) and how many polls found nothing.
async fn poll_get(
    client: &Client,
    partition: &str,
    index: u64,
    fields: &[&str],
) -> Result<(Vec<Value>, u64)> {
    let started = Instant::now();
    let mut polls = 0;
    loop {
        match client.get(partition, &[index], fields).await {
            Ok(cols) => return Ok((cols.into_iter().map(|mut c| c.remove(0)).collect(), polls)),
            Err(e) if e.kind() == Some(ErrorKind::Missing) => {
                polls += 1;
                if started.elapsed() > PEER_TIMEOUT {
                    bail!("{partition}/{index} did not appear within {PEER_TIMEOUT:?}");
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Err(e) => return Err(e).with_context(|| format!("GET {partition}/{index}")),
        }
    }
}

fn bytes_of(v: &Value, what: &str) -> Result<bytes::Bytes> {
    match v {
        Value::Bytes(b) => Ok(b.clone()),
        other => bail!("{what}: expected bytes, got {other:?}"),
    }
}

fn tensor_of<'a>(v: &'a Value, what: &str) -> Result<&'a Tensor> {
    v.as_tensor()
        .with_context(|| format!("{what}: expected a tensor"))
}

/// The producer: a rollout worker. PUTs every step's rollouts and its marker, then receives
/// the trainer's weight versions.
pub(crate) async fn producer(args: WorkerArgs) -> Result<()> {
    watch_parent("producer", None);
    let w = &args.workload;
    let client = connect(&args, 16 << 20).await?;
    let mut report = ProducerReport::default();
    let total = w.total_rollouts();
    let started = Instant::now();
    for step in 0..w.steps {
        let mut crcs = Vec::with_capacity(w.rollouts as usize);
        let mut first = 0;
        while first < w.rollouts {
            let last = (first + w.micro_batch).min(w.rollouts);
            let indexes: Vec<u64> = (first..last).map(|i| w.index(step, i)).collect();
            let mut columns: Vec<(String, Vec<Value>)> = FIELDS
                .iter()
                .map(|f| ((*f).to_owned(), Vec::with_capacity(indexes.len())))
                .collect();
            let mut bytes = 0;
            for &index in &indexes {
                let r = Rollout::generate(w, index);
                crcs.push(r.crc());
                bytes += r.bytes();
                for (col, v) in columns.iter_mut().zip(r.into_values()) {
                    col.1.push(v);
                }
            }
            let took = put_with_backpressure(&client, &indexes, &columns, &mut report).await?;
            report.puts.record(took, bytes);
            report.rollouts += indexes.len() as u64;
            emit(&Event::Progress {
                phase: Phase::Produce,
                done: report.rollouts,
                total,
            });
            first = last;
        }
        let marker = Tensor::from_slice(&[crcs.len() as u64], &crcs)?;
        client
            .put(
                "ready",
                &[step],
                &[("crc32".into(), vec![Value::Tensor(marker)])],
            )
            .await
            .with_context(|| format!("PUT of step {step}'s marker"))?;
        if args.stall {
            emit(&Event::Stalled);
            std::future::pending::<()>().await;
        }
    }
    report.produce_wall_secs = started.elapsed().as_secs_f64();
    report.weights = receive_weights(&args, &client).await?;
    emit(&Event::Producer(Box::new(report)));
    Ok(())
}

/// PUTs one micro-batch; a PUT refused for capacity is retried once the consumer has made
/// room (nothing of a refused PUT is stored). Returns the accepted PUT's latency.
async fn put_with_backpressure(
    client: &Client,
    indexes: &[u64],
    columns: &[(String, Vec<Value>)],
    report: &mut ProducerReport,
) -> Result<Duration> {
    let waiting = Instant::now();
    loop {
        let t = Instant::now();
        match client.put("rollouts", indexes, columns).await {
            Ok(()) => return Ok(t.elapsed()),
            Err(e)
                if matches!(e.kind(), Some(ErrorKind::Capacity | ErrorKind::OutOfMemory))
                    && waiting.elapsed() < PEER_TIMEOUT =>
            {
                report.backpressure_retries += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(e) => {
                return Err(e).with_context(|| format!("PUT of rollouts {indexes:?}"));
            }
        }
    }
}

/// The rollout worker's side of the weight sync: a receiver pool, one fetch per version,
/// every tensor checked, then an acknowledgement.
async fn receive_weights(args: &WorkerArgs, client: &Client) -> Result<WeightsReceived> {
    let w = &args.workload;
    let specs = weight_specs(w)?;
    let backend = backend(&args.backend)?;
    let agent = Arc::new(backend.role_agent("rollout")?);
    // Room for the set at any alignment, and for a late quarantine.
    let pool = ReceiverPool::new(agent.clone(), w.weight_bytes + (64 << 20))?;
    let mut out = WeightsReceived {
        pool_before: pool.report().into(),
        bytes_per_sync: w.weight_bytes,
        ..WeightsReceived::default()
    };
    let mut peer = None;
    let mut verified_bytes = 0;
    for version in 0..w.weight_syncs {
        emit(&Event::Stage {
            phase: Phase::Weights,
            text: format!("v{version}: waiting for the trainer"),
        });
        let (got, _) = poll_get(
            client,
            "weights",
            version,
            &["agent", "descriptor", "crc32"],
        )
        .await?;
        if peer.is_none() {
            let meta = bytes_of(&got[0], "agent")?;
            let a = agent.clone();
            let p = tokio::task::spawn_blocking(move || a.add_remote(&meta))
                .await?
                .context("connecting to the trainer's agent")?;
            peer = Some(p);
        }
        let peer = peer.as_ref().expect("connected above");
        let desc = ObjectDescriptor::from_bytes(&bytes_of(&got[1], "descriptor")?)?;
        let crcs = tensor_of(&got[2], "crc32")?.to_vec::<u32>()?;
        emit(&Event::Stage {
            phase: Phase::Weights,
            text: format!("v{version}: fetching {} blocks", desc.blocks.len()),
        });
        let t = Instant::now();
        let tensors = pool.fetch(&desc, peer)?.await?;
        out.fetch_secs.push(t.elapsed().as_secs_f64());
        out.pool_holding = pool.report().into();
        emit(&Event::Stage {
            phase: Phase::Weights,
            text: format!("v{version}: verifying"),
        });
        if tensors.len() != specs.len() || crcs.len() != specs.len() {
            bail!(
                "weight version {version}: {} tensors and {} checksums, expected {}",
                tensors.len(),
                crcs.len(),
                specs.len()
            );
        }
        for ((t, spec), crc) in tensors.iter().zip(&specs).zip(&crcs) {
            let ok = t.dtype() == spec.dtype
                && t.shape() == spec.shape.as_slice()
                && t.data().len() as u64 == spec.bytes()
                && crc_of([t]) == *crc;
            if ok {
                out.tensors_verified += 1;
            } else {
                out.mismatches += 1;
                eprintln!(
                    "producer: weight {} of version {version} differs",
                    spec.name
                );
            }
            let data = t.data();
            if agent
                .find_registered(data.as_ptr(), data.len() as u64)
                .is_some()
            {
                out.views_in_pool += 1;
            }
            verified_bytes += spec.bytes();
            emit(&Event::Progress {
                phase: Phase::Weights,
                done: verified_bytes,
                total: w.weight_bytes * w.weight_syncs,
            });
        }
        drop(tensors);
        client
            .put(
                "weights-ack",
                &[version],
                &[("verified".into(), vec![Value::U64(out.tensors_verified)])],
            )
            .await
            .context("PUT of the weight acknowledgement")?;
    }
    out.pool_after = pool.report().into();
    Ok(out)
}

/// The consumer: a trainer. GETs, checks and CLEARs each step's rollouts as they become
/// ready, then sends its weight versions.
pub(crate) async fn consumer(args: WorkerArgs) -> Result<()> {
    watch_parent("consumer", None);
    let w = &args.workload;
    let client = connect(&args, 64 << 20).await?;
    let mut report = ConsumerReport::default();
    let total = w.total_rollouts();
    let mut started = None;
    let mut done = 0;
    for step in 0..w.steps {
        let (marker, polls) = poll_get(&client, "ready", step, &["crc32"]).await?;
        started.get_or_insert_with(Instant::now);
        report.marker_polls += polls;
        let crcs = tensor_of(&marker[0], "crc32")?.to_vec::<u32>()?;
        if crcs.len() as u64 != w.rollouts {
            bail!("step {step}'s marker holds {} checksums", crcs.len());
        }
        let mut first = 0;
        while first < w.rollouts {
            let last = (first + w.micro_batch).min(w.rollouts);
            let indexes: Vec<u64> = (first..last).map(|i| w.index(step, i)).collect();
            let t = Instant::now();
            let cols = client
                .get("rollouts", &indexes, &FIELDS)
                .await
                .with_context(|| format!("GET of rollouts {indexes:?}"))?;
            let took = t.elapsed();
            let mut bytes = 0;
            for (k, crc) in crcs[first as usize..last as usize].iter().enumerate() {
                let fields: Vec<&Tensor> = cols
                    .iter()
                    .map(|c| tensor_of(&c[k], "rollout field"))
                    .collect::<Result<_>>()?;
                let fields: [&Tensor; 4] = fields.try_into().expect("four fields");
                for t in fields {
                    let data = t.data();
                    bytes += data.len() as u64;
                    report.tensors_received += 1;
                    if client
                        .agent()
                        .find_registered(data.as_ptr(), data.len() as u64)
                        .is_some()
                    {
                        report.views_in_pool += 1;
                    }
                }
                match check_rollout_shapes(fields) {
                    Ok(()) if crc_of(fields) == *crc => report.rollouts_verified += 1,
                    Ok(()) => {
                        report.mismatches += 1;
                        eprintln!("consumer: rollout {} differs", indexes[k]);
                    }
                    Err(why) => {
                        report.mismatches += 1;
                        eprintln!("consumer: rollout {} has {why}", indexes[k]);
                    }
                }
            }
            report.gets.record(took, bytes);
            drop(cols);
            let t = Instant::now();
            client
                .clear("rollouts", &indexes)
                .await
                .with_context(|| format!("CLEAR of rollouts {indexes:?}"))?;
            report.clears.record(t.elapsed(), 0);
            done += indexes.len() as u64;
            emit(&Event::Progress {
                phase: Phase::Consume,
                done,
                total,
            });
            first = last;
        }
        client.clear("ready", &[step]).await?;
    }
    report.consume_wall_secs = started.map_or(0.0, |s| s.elapsed().as_secs_f64());
    report.recv_pool_after = client.recv_pool_used();
    report.weights = send_weights(&args, &client).await?;
    emit(&Event::Consumer(Box::new(report)));
    Ok(())
}

/// The trainer's side of the weight sync: a sender pool, each version packed into it and
/// published through the unit, held until the rollout worker acknowledges it.
async fn send_weights(args: &WorkerArgs, client: &Client) -> Result<WeightsSent> {
    let w = &args.workload;
    let specs = weight_specs(w)?;
    let agent: Arc<Agent> = Arc::new(backend(&args.backend)?.role_agent("trainer")?);
    let pool = SenderPool::new(agent.clone(), w.weight_bytes + (64 << 20))?;
    let meta = bytes::Bytes::from(agent.metadata());
    let mut out = WeightsSent {
        pool_before: pool.report().into(),
        tensors: specs.len() as u64,
        bytes: w.weight_bytes,
        ..WeightsSent::default()
    };
    let mut bufs: Vec<Vec<u8>> = specs
        .iter()
        .map(|s| vec![0u8; s.bytes() as usize])
        .collect();
    for version in 0..w.weight_syncs {
        emit(&Event::Stage {
            phase: Phase::Weights,
            text: format!("v{version}: the trainer writes new weights"),
        });
        let mut crcs = Vec::with_capacity(specs.len());
        for (i, (buf, spec)) in bufs.iter_mut().zip(&specs).enumerate() {
            fill_weight(w, version, i as u64, buf);
            crcs.push(crc32fast::hash(buf));
            debug_assert_eq!(buf.len() as u64, spec.bytes());
        }
        let refs = specs
            .iter()
            .zip(&bufs)
            .map(|(s, b)| TensorRef::new(s.dtype, &s.shape, b))
            .collect::<Result<Vec<_>, _>>()?;
        emit(&Event::Stage {
            phase: Phase::Weights,
            text: format!("v{version}: packing into the sender pool"),
        });
        let t = Instant::now();
        let desc = pool.put("weights", &refs)?;
        out.pack_secs.push(t.elapsed().as_secs_f64());
        out.pool_holding = pool.report().into();
        out.in_place = pool.report().in_place;
        out.blocks = desc.blocks.len() as u64;
        let t = Instant::now();
        let crc_tensor = Tensor::from_slice(&[crcs.len() as u64], &crcs)?;
        client
            .put(
                "weights",
                &[version],
                &[
                    ("agent".into(), vec![Value::Bytes(meta.clone())]),
                    (
                        "descriptor".into(),
                        vec![Value::Bytes(desc.to_bytes()?.into())],
                    ),
                    ("crc32".into(), vec![Value::Tensor(crc_tensor)]),
                ],
            )
            .await
            .context("publishing the weight descriptor")?;
        poll_get(client, "weights-ack", version, &["verified"]).await?;
        out.sync_secs.push(t.elapsed().as_secs_f64());
        client.clear("weights", &[version]).await?;
        client.clear("weights-ack", &[version]).await?;
    }
    pool.free("weights")?;
    out.pool_after = pool.report().into();
    Ok(out)
}
