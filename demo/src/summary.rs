//! The summary table printed at the end of `run`.

use std::fmt::Write;
use std::time::Duration;

use tessera_storage::Stats;

use crate::events::{ConsumerReport, PoolUse, ProducerReport};
use crate::workload::Workload;

/// Everything the summary is made of.
pub(crate) struct Outcome<'a> {
    pub(crate) workload: &'a Workload,
    pub(crate) backend: &'a str,
    pub(crate) producer: &'a ProducerReport,
    pub(crate) consumer: &'a ConsumerReport,
    pub(crate) before: &'a Stats,
    pub(crate) after: &'a Stats,
    pub(crate) peak_pool_used: u64,
    /// Most registered memory the unit held at once (it grows in chunks up to its limit).
    pub(crate) peak_registered: u64,
    pub(crate) unit_clean: bool,
    pub(crate) wall: Duration,
    /// This machine's single-thread memcpy, measured after the run ([`memcpy_gbps`]).
    pub(crate) memcpy_gbps: f64,
}

/// Bytes of the memcpy reference: more than a last-level cache holds.
const MEMCPY_BYTES: usize = 64 << 20;

/// A single-thread memcpy of [`MEMCPY_BYTES`] between pre-touched buffers, best of 5, in
/// decimal GB/s: the machine's own limit, which the rollout PUT is set against (as
/// `rollout_put_vs_memcpy` in `cargo xtask bench storage`).
pub(crate) fn memcpy_gbps() -> f64 {
    let src = vec![0x5au8; MEMCPY_BYTES];
    // Touched, not only zeroed: a zeroed allocation may be pages not mapped yet.
    let mut dst = vec![0xa5u8; MEMCPY_BYTES];
    let best = (0..5)
        .map(|_| {
            let t = std::time::Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&dst);
            t.elapsed()
        })
        .min()
        .unwrap_or_default();
    MEMCPY_BYTES as f64 / best.as_secs_f64().max(1e-9) / 1e9
}

pub(crate) use tessera_storage::units::fmt_bytes;

/// Decimal gigabytes per second, as NCCL and NIXL report bandwidth.
fn gbps(bytes: u64, secs: f64) -> String {
    if secs <= 0.0 {
        return "-".into();
    }
    format!("{:.2}", bytes as f64 / secs / 1e9)
}

fn fmt_secs(s: f64) -> String {
    if s < 1.0 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

fn fmt_us(us: u64) -> String {
    if us < 1000 {
        format!("{us} µs")
    } else {
        format!("{:.2} ms", us as f64 / 1e3)
    }
}

/// Nearest-rank percentile of `sorted`.
pub(crate) fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2]
    }
}

/// A table: a header row and rows, columns left-aligned except those named numeric.
struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
    right: Vec<bool>,
}

impl Table {
    fn new(header: &[&str], right: &[bool]) -> Table {
        Table {
            header: header.iter().map(|s| (*s).to_owned()).collect(),
            rows: Vec::new(),
            right: right.to_vec(),
        }
    }

    fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    fn render(&self, out: &mut String) {
        let n = self.header.len();
        let width: Vec<usize> = (0..n)
            .map(|c| {
                std::iter::once(&self.header)
                    .chain(&self.rows)
                    .map(|r| r.get(c).map_or(0, |s| s.chars().count()))
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let line = |cells: &[String], out: &mut String| {
            let mut s = String::new();
            for (c, w) in width.iter().enumerate() {
                let cell = cells.get(c).map_or("", String::as_str);
                let pad = w - cell.chars().count();
                if c > 0 {
                    s.push_str("  ");
                }
                if self.right.get(c).copied().unwrap_or(false) {
                    s.push_str(&" ".repeat(pad));
                    s.push_str(cell);
                } else {
                    s.push_str(cell);
                    s.push_str(&" ".repeat(pad));
                }
            }
            let _ = writeln!(out, "  {}", s.trim_end());
        };
        line(&self.header, out);
        let total: usize = width.iter().sum::<usize>() + 2 * (n - 1);
        let _ = writeln!(out, "  {}", "-".repeat(total));
        for r in &self.rows {
            line(r, out);
        }
    }
}

fn used(p: PoolUse) -> String {
    format!("{} of {}", fmt_bytes(p.used), fmt_bytes(p.capacity))
}

/// The unit's row label, with its registration limit (`pool_bytes`) when it reports one.
fn unit_label(limit: u64) -> String {
    if limit == 0 {
        "storage unit (STATS)".to_owned()
    } else {
        format!("storage unit (STATS, limit {})", fmt_bytes(limit))
    }
}

/// Prints the summary on stdout and returns the number of errors it found.
pub(crate) fn print(o: &Outcome<'_>) -> u64 {
    let (w, p, c) = (o.workload, o.producer, o.consumer);
    let (ws, wr) = (&c.weights, &p.weights);
    let mut errors = Vec::<String>::new();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\nSummary · backend {} · {} rollouts in {} steps · {} of weights × {} syncs · wall {}\n",
        o.backend,
        w.total_rollouts(),
        w.steps,
        fmt_bytes(w.weight_bytes),
        w.weight_syncs,
        fmt_secs(o.wall.as_secs_f64()),
    );

    // Throughput.
    let mut t = Table::new(
        &["phase", "bytes", "time", "GB/s", "what is timed"],
        &[false, true, true, true, false],
    );
    let put_busy = p.puts.busy_secs();
    let get_busy = c.gets.busy_secs();
    t.row(vec![
        "rollouts PUT".into(),
        fmt_bytes(p.puts.bytes),
        fmt_secs(put_busy),
        gbps(p.puts.bytes, put_busy),
        format!(
            "{} PUTs of {} rollouts, time inside put()",
            p.puts.latencies_us.len(),
            w.micro_batch
        ),
    ]);
    t.row(vec![
        "rollouts produced".into(),
        fmt_bytes(p.puts.bytes),
        fmt_secs(p.produce_wall_secs),
        gbps(p.puts.bytes, p.produce_wall_secs),
        "producer wall time, generating the data included".into(),
    ]);
    t.row(vec![
        "rollouts GET".into(),
        fmt_bytes(c.gets.bytes),
        fmt_secs(get_busy),
        gbps(c.gets.bytes, get_busy),
        format!(
            "{} GETs of {} rollouts, time inside get()",
            c.gets.latencies_us.len(),
            w.micro_batch
        ),
    ]);
    t.row(vec![
        "rollouts consumed".into(),
        fmt_bytes(c.gets.bytes),
        fmt_secs(c.consume_wall_secs),
        gbps(c.gets.bytes, c.consume_wall_secs),
        "consumer wall time: waiting, GET, checksums, CLEAR".into(),
    ]);
    let pack = median(&ws.pack_secs);
    t.row(vec![
        "weights pack".into(),
        fmt_bytes(ws.bytes),
        fmt_secs(pack),
        gbps(ws.bytes, pack),
        format!(
            "SenderPool::put, {} tensors into {} block(s), median of {}",
            ws.tensors,
            ws.blocks,
            ws.pack_secs.len()
        ),
    ]);
    if let Some(first) = wr.fetch_secs.first() {
        t.row(vec![
            "weights fetch, first".into(),
            fmt_bytes(wr.bytes_per_sync),
            fmt_secs(*first),
            gbps(wr.bytes_per_sync, *first),
            "ReceiverPool::fetch, one READ; fresh pages on both sides".into(),
        ]);
    }
    if wr.fetch_secs.len() > 1 {
        let warm = median(&wr.fetch_secs[1..]);
        t.row(vec![
            "weights fetch, warm".into(),
            fmt_bytes(wr.bytes_per_sync),
            fmt_secs(warm),
            gbps(wr.bytes_per_sync, warm),
            format!(
                "the same, median of the {} later syncs",
                wr.fetch_secs.len() - 1
            ),
        ]);
    }
    let sync = median(&ws.sync_secs);
    t.row(vec![
        "weights sync".into(),
        fmt_bytes(ws.bytes),
        fmt_secs(sync),
        gbps(ws.bytes, sync),
        format!(
            "publish descriptor → fetch → verify {} checksums → ack, median",
            ws.tensors
        ),
    ]);
    let _ = writeln!(out, "Throughput");
    t.render(&mut out);

    // Latency.
    let mut t = Table::new(
        &["request", "n", "p50", "p90", "p99", "max"],
        &[false, true, true, true, true, true],
    );
    for (name, lat) in [
        (
            format!("PUT ({} rollouts)", w.micro_batch),
            &p.puts.latencies_us,
        ),
        (
            format!("GET ({} rollouts)", w.micro_batch),
            &c.gets.latencies_us,
        ),
        (
            format!("CLEAR ({} indexes)", w.micro_batch),
            &c.clears.latencies_us,
        ),
    ] {
        let mut s = lat.clone();
        s.sort_unstable();
        t.row(vec![
            name,
            s.len().to_string(),
            fmt_us(percentile(&s, 50.0)),
            fmt_us(percentile(&s, 90.0)),
            fmt_us(percentile(&s, 99.0)),
            fmt_us(s.last().copied().unwrap_or(0)),
        ]);
    }
    let _ = writeln!(out, "\nLatency (client side, one request each)");
    t.render(&mut out);
    let mut puts = p.puts.latencies_us.clone();
    puts.sort_unstable();
    let p50 = percentile(&puts, 50.0);
    if p50 > 0 && put_busy > 0.0 && o.memcpy_gbps > 0.0 {
        let _ = writeln!(
            out,
            "  rollout PUT against the machine: {} GB/s inside put() is {:.3} of a \
             single-thread memcpy ({:.2} GB/s, {} pre-touched, best of 5, after the run); \
             p99 is {:.2}x p50",
            gbps(p.puts.bytes, put_busy),
            p.puts.bytes as f64 / put_busy / 1e9 / o.memcpy_gbps,
            o.memcpy_gbps,
            fmt_bytes(MEMCPY_BYTES as u64),
            percentile(&puts, 99.0) as f64 / p50 as f64,
        );
    }

    // Pools.
    let mut t = Table::new(
        &["pool", "before", "peak / holding", "after"],
        &[false, true, true, true],
    );
    // The unit's pool: leased bytes of the bytes registered at that moment (registered
    // memory grows in chunks up to the limit, and shrinks back when idle).
    let unit = |s: &Stats| PoolUse {
        capacity: s.pool.capacity,
        used: s.pool.used,
    };
    t.row(vec![
        unit_label(o.before.pool.limit),
        used(unit(o.before)),
        used(PoolUse {
            capacity: o.peak_registered.max(o.before.pool.capacity),
            used: o.peak_pool_used,
        }),
        used(unit(o.after)),
    ]);
    t.row(vec![
        "trainer SenderPool".into(),
        used(ws.pool_before),
        used(ws.pool_holding),
        used(ws.pool_after),
    ]);
    t.row(vec![
        "rollout ReceiverPool".into(),
        used(wr.pool_before),
        used(wr.pool_holding),
        used(wr.pool_after),
    ]);
    let _ = writeln!(
        out,
        "\nRegistered pools (peak: STATS sampled every 100 ms and as the roles report progress; the unit's: leased of registered then, which grows in chunks up to the limit; holding: while a version is live)"
    );
    t.render(&mut out);
    let leaks = [
        ("storage unit keys", o.after.keys),
        ("storage unit pool", o.after.pool.used),
        ("storage unit leased", o.after.leased_bytes),
        ("storage unit quarantined", o.after.quarantined_bytes),
        ("trainer sender pool", ws.pool_after.used),
        ("rollout receiver pool", wr.pool_after.used),
        ("consumer's GET pool", c.recv_pool_after),
    ];
    for (what, n) in leaks {
        if n != 0 {
            errors.push(format!("{what}: {n} left after the run"));
        }
    }

    // Copies.
    let s = o.after;
    let mut t = Table::new(
        &["payload", "bytes", "copies", "counted from"],
        &[false, true, true, false],
    );
    let payload = p.puts.bytes + c.gets.bytes;
    let copied = s.bytes_in + s.bytes_out + s.compacted_bytes;
    // Over the one-sided engines the unit READs a PUT's frames from the client; over the
    // others the client WRITEs them into the unit's block.
    let put_copy = match o.backend {
        "ucx" | "nixl" => "the unit's READ of the client's frames into its block",
        _ => "the client's WRITE into the unit's block",
    };
    t.row(vec![
        "rollouts PUT".into(),
        fmt_bytes(p.puts.bytes),
        ratio(s.bytes_in, p.puts.bytes),
        format!("unit STATS bytes_in {}: {put_copy}", fmt_bytes(s.bytes_in)),
    ]);
    t.row(vec![
        "rollouts GET".into(),
        fmt_bytes(c.gets.bytes),
        ratio(s.bytes_out, c.gets.bytes),
        format!(
            "unit STATS bytes_out {}: the unit's WRITE into the client's block",
            fmt_bytes(s.bytes_out)
        ),
    ]);
    t.row(vec![
        "unit compaction".into(),
        fmt_bytes(s.compacted_bytes),
        String::new(),
        "unit STATS compacted_bytes".into(),
    ]);
    t.row(vec![
        "rollouts, all".into(),
        fmt_bytes(payload),
        ratio(copied, payload),
        "(bytes_in + bytes_out + compacted) / payload".into(),
    ]);
    let synced = ws.bytes * ws.pack_secs.len() as u64;
    t.row(vec![
        "weights pack".into(),
        fmt_bytes(synced),
        ratio(synced - ws.in_place.min(synced), synced),
        format!(
            "SenderPool::put copies each view once ({} described in place)",
            fmt_bytes(ws.in_place)
        ),
    ]);
    t.row(vec![
        "weights fetch".into(),
        fmt_bytes(wr.bytes_per_sync * wr.fetch_secs.len() as u64),
        "1.00".into(),
        "the transport's READ into the receive block".into(),
    ]);
    t.row(vec![
        "weights on receive".into(),
        String::new(),
        "0".into(),
        format!(
            "{}/{} tensors are views of the receive pool",
            wr.views_in_pool,
            wr.tensors_verified + wr.mismatches
        ),
    ]);
    let _ = writeln!(out, "\nCopies (per payload byte)");
    t.render(&mut out);
    let _ = writeln!(
        out,
        "  GET results: {}/{} tensors are views of the consumer's registered receive pool",
        c.views_in_pool, c.tensors_received
    );

    // Checks.
    let expected_rollouts = w.total_rollouts();
    if c.rollouts_verified != expected_rollouts {
        errors.push(format!(
            "{} of {expected_rollouts} rollouts verified",
            c.rollouts_verified
        ));
    }
    if c.mismatches > 0 {
        errors.push(format!(
            "{} rollouts differ from their checksums",
            c.mismatches
        ));
    }
    let expected_weights = ws.tensors * w.weight_syncs;
    if wr.tensors_verified != expected_weights {
        errors.push(format!(
            "{} of {expected_weights} weight tensors verified",
            wr.tensors_verified
        ));
    }
    if wr.mismatches > 0 {
        errors.push(format!(
            "{} weight tensors differ from their checksums",
            wr.mismatches
        ));
    }
    if !o.unit_clean {
        errors.push("the storage unit did not shut down in order".into());
    }
    let _ = writeln!(out, "\nChecks");
    let _ = writeln!(
        out,
        "  checksums (CRC32): {}/{} rollouts, {}/{} weight tensors",
        c.rollouts_verified, expected_rollouts, wr.tensors_verified, expected_weights
    );
    let _ = writeln!(
        out,
        "  readiness: {} marker polls found a step not ready yet; {} PUTs waited for capacity",
        c.marker_polls, p.backpressure_retries
    );
    let _ = writeln!(
        out,
        "  after the run: {} keys, {} used in the unit's pool; storage unit {}",
        o.after.keys,
        fmt_bytes(o.after.pool.used),
        if o.unit_clean {
            "shut down in order"
        } else {
            "did NOT shut down in order"
        }
    );
    for e in &errors {
        let _ = writeln!(out, "  error: {e}");
    }
    let _ = writeln!(out, "  errors: {}", errors.len());
    print!("{out}");
    errors.len() as u64
}

fn ratio(copied: u64, payload: u64) -> String {
    if payload == 0 {
        return "-".into();
    }
    format!("{:.2}", copied as f64 / payload as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 50.0), 50);
        assert_eq!(percentile(&v, 90.0), 90);
        assert_eq!(percentile(&v, 99.0), 99);
        assert_eq!(percentile(&[7], 99.0), 7);
        assert_eq!(percentile(&[], 50.0), 0);
    }

    /// The unit's row names its registration limit when the unit reports one.
    #[test]
    fn unit_row_names_the_registration_limit() {
        assert_eq!(unit_label(2 << 30), "storage unit (STATS, limit 2.00 GiB)");
        assert_eq!(unit_label(0), "storage unit (STATS)");
    }
}
