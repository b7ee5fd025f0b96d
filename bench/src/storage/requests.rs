//! The requests RL makes, against the machine's own limits measured in the same run: the
//! demo's rollout micro-batches against memcpy, a 1,000 x 4 KiB batch and 16 x 16 MiB PUTs
//! against bare shm WRITEs between the same two processes, 4-byte PUTs and GETs against the
//! cross-core round trip, the binary's defaults without pinning, and 32 clients of mixed load.

use std::time::{Duration, Instant};

use anyhow::Result;
use bytes::Bytes;
use futures_util::StreamExt;
use tessera_storage::{Backend, BusyPoll, Client, ClientConfig, DType, Tensor, Value};

use super::{best, gbps, Bare, SMALL_N};
use crate::hostile_load::{quantile, quantile_index, soak, SoakConfig, SoakReport, SMALL_VALUE};
use crate::Report;

/// Rollouts per PUT and GET, as the demo's micro-batch.
const ROLLOUTS: usize = 16;
/// Distinct micro-batches cycled through (their keys are replaced on every pass).
const BATCHES: usize = 8;
/// Timed rollout PUTs and GETs.
const ROLLOUT_N: usize = 1000;
/// PUTs a pipelining rollout worker keeps in flight: the session's credits (two by default),
/// so that each still takes one round trip.
const ROLLOUT_DEPTH: usize = 2;
const MIN_TOKENS: usize = 64;
const MAX_TOKENS: usize = 4096;
const IMAGE: [u64; 3] = [64, 64, 3];
const FIELDS: [&str; 4] = ["tokens", "logprobs", "reward", "image"];

/// splitmix64, as the demo generates its rollouts.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn bytes(&mut self, n: usize) -> Bytes {
        let mut v = Vec::with_capacity(n + 8);
        while v.len() < n {
            v.extend_from_slice(&self.next().to_le_bytes());
        }
        v.truncate(n);
        Bytes::from(v)
    }
}

/// A request's columns: one list of values per field.
type Columns = Vec<(String, Vec<Value>)>;

/// One micro-batch of the demo's shape: token ids i32[n], log-probs f32[n] (n from 64 to
/// 4,096), a scalar f32 reward and a 64x64x3 u8 image per rollout. Returns the columns and
/// their payload bytes.
fn micro_batch(rng: &mut Rng) -> Result<(Columns, u64)> {
    let mut cols: Columns = FIELDS
        .iter()
        .map(|f| ((*f).to_owned(), Vec::with_capacity(ROLLOUTS)))
        .collect();
    let mut bytes = 0;
    for _ in 0..ROLLOUTS {
        let n = MIN_TOKENS + (rng.next() % (MAX_TOKENS - MIN_TOKENS + 1) as u64) as usize;
        let image: u64 = IMAGE.iter().product();
        let tensors = [
            Tensor::new(DType::I32, &[n as u64], rng.bytes(4 * n))?,
            Tensor::new(DType::F32, &[n as u64], rng.bytes(4 * n))?,
            Tensor::new(DType::F32, &[], rng.bytes(4))?,
            Tensor::new(DType::U8, &IMAGE, rng.bytes(image as usize))?,
        ];
        for (col, t) in cols.iter_mut().zip(tensors) {
            bytes += t.data().len() as u64;
            col.1.push(Value::Tensor(t));
        }
    }
    Ok((cols, bytes))
}

/// The demo's rollout PUT and GET: GB/s over the summed latencies, the PUT's p99 over its
/// median, and the PUT's rate against `memcpy` GB/s of the same run.
pub(super) async fn rollouts(
    client: &Client,
    report: &mut Report,
    pinned: &str,
    memcpy: f64,
) -> Result<()> {
    let mut rng = Rng(8);
    let batches = (0..BATCHES)
        .map(|_| micro_batch(&mut rng))
        .collect::<Result<Vec<_>>>()?;
    let indexes: Vec<Vec<u64>> = (0..BATCHES)
        .map(|b| {
            (0..ROLLOUTS as u64)
                .map(|i| (b * ROLLOUTS) as u64 + i)
                .collect()
        })
        .collect();
    // Warm-up: every batch stored twice (a replacing PUT leases a new block first).
    for _ in 0..2 {
        for (b, (cols, _)) in batches.iter().enumerate() {
            client.put("rollouts", &indexes[b], cols).await?;
        }
    }
    let (mut put, mut get) = (Vec::new(), Vec::new());
    let (mut put_bytes, mut get_bytes) = (0u64, 0u64);
    for r in 0..ROLLOUT_N {
        let b = r % BATCHES;
        let (cols, bytes) = &batches[b];
        let t = Instant::now();
        client.put("rollouts", &indexes[b], cols).await?;
        put.push(t.elapsed());
        put_bytes += bytes;
        let t = Instant::now();
        let v = client.get("rollouts", &indexes[b], &FIELDS).await?;
        get.push(t.elapsed());
        get_bytes += bytes;
        drop(v);
    }
    // The same PUTs from a worker that does not wait for one before it sends the next (the
    // keys of requests in flight together differ).
    let t = Instant::now();
    let mut pipelined = futures_util::stream::iter(0..ROLLOUT_N)
        .map(|r| client.put("rollouts", &indexes[r % BATCHES], &batches[r % BATCHES].0))
        .buffer_unordered(ROLLOUT_DEPTH);
    while let Some(r) = pipelined.next().await {
        r?;
    }
    // The same PUTs: the same bytes as the serial pass.
    let pipelined = gbps(put_bytes, t.elapsed());
    let sum = |v: &[Duration]| v.iter().sum::<Duration>();
    let (p, g) = (gbps(put_bytes, sum(&put)), gbps(get_bytes, sum(&get)));
    let (p50, p99) = (quantile(&put, 0.5), quantile(&put, 0.99));
    let how = format!(
        "{ROLLOUT_N} requests of {ROLLOUTS} rollouts (token ids i32[n] and log-probs f32[n], n \
         {MIN_TOKENS}..{MAX_TOKENS}, a scalar f32 reward, a 64x64x3 u8 image: the demo's \
         micro-batch) over shm, payload bytes over the summed latencies; {pinned}"
    );
    report.put("rollout_put_gbps", p, format!("PUT of {how}"));
    report.put("rollout_get_gbps", g, format!("GET of {how}"));
    report.put(
        "rollout_put_p50_us",
        crate::timing::us(p50),
        "median rollout PUT",
    );
    report.put(
        "rollout_put_p99_us",
        crate::timing::us(p99),
        "p99 rollout PUT",
    );
    report.put(
        "rollout_put_p99_over_p50",
        p99.as_secs_f64() / p50.as_secs_f64(),
        "rollout_put_p99_us / rollout_put_p50_us (goal <= 3)",
    );
    report.put(
        "rollout_put_vs_memcpy",
        p / memcpy,
        "rollout_put_gbps / memcpy_256m_gbps (goal >= 0.3)",
    );
    report.put(
        "rollout_put_pipelined_gbps",
        pipelined,
        format!(
            "the same {ROLLOUT_N} PUTs with {ROLLOUT_DEPTH} in flight at a time (a rollout worker \
             that does not wait for one PUT's answer before it sends the next; each lands in a \
             credit), payload bytes over the wall time; {pinned}"
        ),
    );
    report.put(
        "rollout_put_pipelined_vs_memcpy",
        pipelined / memcpy,
        "rollout_put_pipelined_gbps / memcpy_256m_gbps",
    );
    client.drop_partition("rollouts").await?;
    Ok(())
}

/// The 1,000 x 4 KiB batch's bare WRITE reference: the same 1,000 descriptors between the
/// same two processes. Returns its GB/s.
pub(super) fn batch_write_gbps(bare: &Bare, runs: usize, report: &mut Report) -> Result<f64> {
    let w = gbps(1000 * 4096, bare.write(runs, 1000, 4096)?);
    report.put(
        "batch_write_gbps",
        w,
        format!(
            "a bare shm WRITE of 1,000 separate 4 KiB sources into 1,000 packed 4 KiB \
             destinations of the unit process, best of {runs}; client cpu 0, unit process cpu 1"
        ),
    );
    Ok(w)
}

/// 16 PUTs of one 16 MiB value each, kept in flight together, against 16 bare WRITEs of
/// 16 MiB one after the other between the same two processes.
pub(super) async fn put_16m(
    client: &Client,
    bare: &Bare,
    report: &mut Report,
    pinned: &str,
    runs: usize,
) -> Result<()> {
    const N: usize = 16;
    const LEN: usize = 16 << 20;
    let mut rng = Rng(16);
    let cols: Vec<Columns> = (0..N)
        .map(|_| vec![("x".to_string(), vec![Value::Bytes(rng.bytes(LEN))])])
        .collect();
    let idx: Vec<[u64; 1]> = (0..N as u64).map(|i| [i]).collect();
    let round = || async {
        let t = Instant::now();
        let puts = (0..N).map(|i| client.put("p16", &idx[i], &cols[i]));
        for r in futures_util::future::join_all(puts).await {
            r?;
        }
        Ok::<_, anyhow::Error>(t.elapsed())
    };
    round().await?;
    let mut times = Vec::new();
    for _ in 0..runs {
        times.push(round().await?);
    }
    let put = gbps((N * LEN) as u64, best(times));
    let mut writes = Vec::new();
    for _ in 0..runs {
        let mut round = Duration::ZERO;
        for _ in 0..N {
            round += bare.write_once(1, LEN as u64)?;
        }
        writes.push(round);
    }
    let write = gbps((N * LEN) as u64, best(writes));
    // The same bytes from 16 distinct sources into 16 distinct destinations, as the PUTs
    // move them: 512 MiB of memory touched, where the hot reference reuses 32 MiB that the
    // L3 cache holds.
    let mut spread = Vec::new();
    for _ in 0..=runs {
        let mut round = Duration::ZERO;
        for i in 0..N as u64 {
            round += bare.write_at(1, LEN as u64, i * LEN as u64)?;
        }
        spread.push(round);
    }
    // The first round maps and touches the pages.
    spread.remove(0);
    let spread = gbps((N * LEN) as u64, best(spread));
    report.put(
        "put_16m_gbps",
        put,
        format!(
            "{N} PUTs of one 16 MiB value each, all in flight, over shm, best of {runs}; {pinned}"
        ),
    );
    report.put(
        "write_16m_hot_gbps",
        write,
        format!(
            "{N} bare shm WRITEs of the same 16 MiB into the same place of the unit process \
             (cache-hot), one after the other, best of {runs}; client cpu 0, unit process cpu 1"
        ),
    );
    report.put(
        "write_16m_gbps",
        spread,
        format!(
            "{N} bare shm WRITEs of 16 MiB, each from its own source into its own place of the \
             unit process as the PUTs' values, one after the other, best of {runs}; client cpu \
             0, unit process cpu 1"
        ),
    );
    report.put(
        "put_16m_vs_write",
        put / spread,
        "put_16m_gbps / write_16m_gbps (goal >= 0.85)",
    );
    client.drop_partition("p16").await?;
    Ok(())
}

/// The 4-byte PUT and GET as users run them: neither process pinned, the client with its
/// defaults on a runtime of its own, the unit with the `tessera-storage` binary's default
/// busy polling and, beside, with none. Runs on a thread of its own whose affinity is the
/// process's original one.
pub(super) fn unpinned(report: &mut Report, mask: Option<libc::cpu_set_t>) -> Result<()> {
    let measured = std::thread::scope(|s| {
        s.spawn(|| -> Result<(f64, f64)> {
            if let Some(m) = &mask {
                crate::cpu::restore_affinity(m);
            }
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            let default = (BusyPoll::SERVE_DEFAULT_US > 0)
                .then(|| Duration::from_micros(BusyPoll::SERVE_DEFAULT_US));
            let once = |poll: Option<Duration>| -> Result<f64> {
                rt.block_on(async {
                    let (mut unit, client) = super::shm_unit(None, poll).await?;
                    let put = super::small_put_median_us(&client).await?;
                    drop(client);
                    unit.stop();
                    Ok(put)
                })
            };
            Ok((once(default)?, once(None)?))
        })
        .join()
        .map_err(|_| anyhow::anyhow!("the unpinned measurement panicked"))?
    })?;
    let (default, unpolled) = measured;
    let window = match BusyPoll::SERVE_DEFAULT_US {
        0 => "does not busy-poll".to_owned(),
        us => format!("busy-polls for up to {us} us"),
    };
    report.put(
        "small_put_default_unpinned_us",
        default,
        format!(
            "4-byte PUT, median of {SMALL_N}, neither process pinned, the client with its \
             defaults (2 runtime workers), the unit with the binary's default busy polling (it \
             {window})"
        ),
    );
    report.put(
        "small_put_unpolled_unpinned_us",
        unpolled,
        "small_put_default_unpinned_us with a unit that does not busy-poll",
    );
    report.put(
        "small_put_default_vs_unpolled_unpinned",
        default / unpolled,
        "small_put_default_unpinned_us / small_put_unpolled_unpinned_us (goal <= 1.05)",
    );
    Ok(())
}

/// 32 sessions of mixed PUT/GET/CLEAR (the reliability soak's workload, no attackers)
/// against the pinned, polling unit, whose pool is prefaulted, as the sessions' receive pools
/// are: timed after a warm-up, so that the figures are those of a unit in service rather than
/// of its first touches of memory (see `prefault_pool` in the storage crate's README).
pub(super) async fn load32(
    addr: &str,
    poll: &BusyPoll,
    report: &mut Report,
    pinned: &str,
) -> Result<()> {
    let (secs, warmup) = (5, 2);
    let r = soak(
        ClientConfig {
            units: vec![addr.to_owned()],
            backend: Backend::Shm,
            recv_pool_bytes: 80 << 20,
            prefault_recv_pool: true,
            busy_poll: Some(poll.clone()),
            ..ClientConfig::default()
        },
        SoakConfig {
            sessions: 32,
            duration: Duration::from_secs(secs),
            warmup: Duration::from_secs(warmup),
            // No attackers here: the generator's threads give way to the sessions' worker.
            give_way: true,
            ..SoakConfig::default()
        },
    )
    .await;
    anyhow::ensure!(
        r.lost == 0 && r.corrupt == 0 && r.failed == 0,
        "the 32-client load lost {}, corrupted {} and failed {} requests: {:?}",
        r.lost,
        r.corrupt,
        r.failed,
        r.notes
    );
    let (p50, p99) = (quantile(&r.put, 0.5), quantile(&r.put, 0.99));
    let how = format!(
        "32 sessions of mixed PUT/GET/CLEAR (the soak's values, 1 KiB..64 MiB, mostly small), \
         timed for {secs} s after all connected and {warmup} s of warm-up, no attackers; the \
         unit's pool and the sessions' 80 MiB receive pools prefaulted; {pinned}"
    );
    report.put(
        "load32_put_p50_us",
        crate::timing::us(p50),
        format!("median PUT of {} completed, {how}", r.put.len()),
    );
    report.put(
        "load32_put_p99_us",
        crate::timing::us(p99),
        format!("p99 PUT, {how}"),
    );
    report.put(
        "load32_put_p99_over_p50",
        p99.as_secs_f64() / p50.as_secs_f64(),
        "load32_put_p99_us / load32_put_p50_us (goal <= 4): over every PUT, so that the p99 is \
         that of the 1..64 MiB values the mix holds 5 % of, the median that of a 1..64 KiB one",
    );
    let small: Vec<Duration> = sized(&r, |len| len <= SMALL_VALUE);
    let (s50, s99) = (quantile(&small, 0.5), quantile(&small, 0.99));
    report.put(
        "load32_small_put_p99_over_p50",
        s99.as_secs_f64() / s50.as_secs_f64(),
        format!(
            "p99 over median of the {} PUTs of values up to 64 KiB (80 % of the mix) in the same \
             load: the tail of one size",
            small.len()
        ),
    );
    // The PUTs that take a credit when their session holds one (up to the unit's default
    // `credit_bytes`).
    let medium: Vec<Duration> = sized(&r, |len| len > SMALL_VALUE && len <= MEDIUM_VALUE);
    report.put(
        "load32_medium_put_p50_us",
        crate::timing::us(quantile(&medium, 0.5)),
        format!(
            "median of the {} PUTs of values over 64 KiB and up to 4 MiB in the same load (a \
             credit's size: one round trip where the session holds a credit, PREPARE and \
             COMMIT where not)",
            medium.len()
        ),
    );
    report.put(
        "load32_medium_put_p99_us",
        crate::timing::us(quantile(&medium, 0.99)),
        "p99 of the same PUTs",
    );
    report.put(
        "load32_put_p99_slowdown",
        p99_slowdown(&r),
        "p99 over every PUT of the same load of its time over the median time of the PUTs of \
         its size class (values of 2^k..2^(k+1) bytes): the tail of each size against its own \
         median, where load32_put_p99_over_p50 sets a 64 MiB PUT against a 4 KiB one",
    );
    Ok(())
}

/// The largest value of `load32_medium_put_*`: the unit's default credit.
const MEDIUM_VALUE: usize = 4 << 20;

/// The PUT times of `r` whose value size passes `keep`.
fn sized(r: &SoakReport, keep: impl Fn(usize) -> bool) -> Vec<Duration> {
    r.put
        .iter()
        .zip(&r.put_bytes)
        .filter(|(_, len)| keep(**len))
        .map(|(t, _)| *t)
        .collect()
}

/// The p99 of every PUT's time over the median of its size class (a power of two).
fn p99_slowdown(r: &SoakReport) -> f64 {
    let class = |len: usize| len.max(1).ilog2();
    let mut medians = std::collections::HashMap::new();
    for &len in &r.put_bytes {
        medians
            .entry(class(len))
            .or_insert_with(|| quantile(&sized(r, |l| class(l) == class(len)), 0.5));
    }
    let mut slowdowns: Vec<f64> = r
        .put
        .iter()
        .zip(&r.put_bytes)
        .map(|(t, len)| t.as_secs_f64() / medians[&class(*len)].as_secs_f64())
        .collect();
    if slowdowns.is_empty() {
        return 0.0;
    }
    slowdowns.sort_by(f64::total_cmp);
    slowdowns[quantile_index(slowdowns.len(), 0.99)]
}
