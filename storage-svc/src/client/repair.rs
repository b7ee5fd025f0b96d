//! Repair: copies of keys that lost a replica (a unit gone, a unit that joined and now ranks
//! among an index's replicas) written back to the units the placement names now.

use std::collections::BTreeSet;

use tessera_framecodec::{encode, Value};

use super::{join_all, Client, Slot};
use crate::error::ClientError;

/// What [`Client::repair`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RepairReport {
    /// Indexes looked at.
    pub checked: u64,
    /// Indexes that lacked a copy on at least one of their replicas.
    pub under_replicated: u64,
    /// Copies written (an index copied to two units counts twice).
    pub copies: u64,
    /// Indexes that no replica holds (every field): nothing to copy from. A key that was
    /// never stored reads the same.
    pub lost: Vec<u64>,
}

/// Most keys a unit names in one missing answer: a batch asks for no more.
const NAMED_MISSING: usize = 1000;

impl Client {
    /// Brings every one of `indexes` of `partition` back to [`replicas`](Self::replicas)
    /// copies of `fields` on the units its placement names now: each replica is asked which
    /// keys it lacks, and those are copied from one that has them (through this client: read
    /// into its receive pool, written to the units that lack them). Run it after a unit was
    /// lost (every key that had a copy there has one fewer) or joined (it ranks first for its
    /// share of keys, which were stored elsewhere). Indexes are handled in batches the
    /// receive pool can hold; progress is logged per batch and counted in the metrics
    /// `tessera_storage_repair_{checked,copies,lost}_total`.
    ///
    /// An index counts as held by a unit only with every field: a replica missing one field
    /// gets all of them again.
    pub async fn repair(
        &self,
        partition: &str,
        indexes: &[u64],
        fields: &[&str],
    ) -> Result<RepairReport, ClientError> {
        let mut report = RepairReport::default();
        let batch = (NAMED_MISSING / fields.len().max(1)).max(1);
        for (n, chunk) in indexes.chunks(batch).enumerate() {
            let before = report.clone();
            self.repair_batch(partition, chunk, fields, &mut report)
                .await?;
            crate::metrics::repair(
                report.checked - before.checked,
                report.copies - before.copies,
                (report.lost.len() - before.lost.len()) as u64,
            );
            tracing::info!(
                partition,
                done = (n * batch + chunk.len()),
                of = indexes.len(),
                copies = report.copies,
                lost = report.lost.len(),
                "repairing"
            );
        }
        Ok(report)
    }

    async fn repair_batch(
        &self,
        partition: &str,
        indexes: &[u64],
        fields: &[&str],
        report: &mut RepairReport,
    ) -> Result<(), ClientError> {
        let units = self.current();
        let r = self.cfg.replicas;
        let places = self.placements(&units, r, partition, indexes)?;
        let fields: Vec<String> = fields.iter().map(|f| (*f).to_owned()).collect();
        // Which replicas hold each position, and the values of one that does.
        let mut held: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); indexes.len()];
        let mut values: Vec<Option<Vec<Value>>> = vec![None; indexes.len()];
        let per = self.split(&units, r, partition, indexes)?;
        let asks = units
            .slots
            .iter()
            .zip(per)
            .enumerate()
            .map(|(u, (slot, positions))| {
                let fields = fields.clone();
                async move {
                    let got = self
                        .holdings(slot, partition, indexes, &positions, fields)
                        .await;
                    (u, got)
                }
            });
        for (u, got) in join_all(asks.collect()).await {
            // A unit that cannot answer holds nothing this repair can use or trust.
            let Ok((present, cols)) = got else { continue };
            for (k, &p) in present.iter().enumerate() {
                held[p].insert(u);
                if values[p].is_none() {
                    values[p] = Some(cols.iter().map(|c| c[k].clone()).collect());
                }
            }
        }
        report.checked += indexes.len() as u64;
        // Per unit: the positions it must be given.
        let mut give: Vec<Vec<usize>> = vec![Vec::new(); units.slots.len()];
        for (p, on) in places.chunks(r).enumerate() {
            if held[p].is_empty() || values[p].is_none() {
                report.lost.push(indexes[p]);
                continue;
            }
            let lacking: Vec<usize> = on
                .iter()
                .copied()
                .filter(|u| !held[p].contains(u))
                .collect();
            if !lacking.is_empty() {
                report.under_replicated += 1;
            }
            for u in lacking {
                give[u].push(p);
            }
        }
        let writes = units
            .slots
            .iter()
            .zip(give)
            .filter(|(_, g)| !g.is_empty())
            .map(|(slot, positions)| {
                let idx: Vec<u64> = positions.iter().map(|&p| indexes[p]).collect();
                let value = Value::List(
                    (0..fields.len())
                        .map(|f| {
                            Value::List(
                                positions
                                    .iter()
                                    .map(|&p| values[p].as_ref().expect("held")[f].clone())
                                    .collect(),
                            )
                        })
                        .collect(),
                );
                let n = idx.len() as u64;
                let fields = fields.clone();
                async move {
                    let frames = encode(&value)?;
                    self.put_unit(slot, partition, idx, fields, frames)
                        .await
                        .map(|()| n)
                }
            });
        for written in join_all(writes.collect()).await {
            report.copies += written?;
        }
        Ok(())
    }

    /// Which of `positions` (of `indexes`) the unit of `slot` holds with every field, and
    /// their values (one column per field, in the order of the positions returned).
    async fn holdings(
        &self,
        slot: &Slot,
        partition: &str,
        indexes: &[u64],
        positions: &[usize],
        fields: Vec<String>,
    ) -> Result<(Vec<usize>, Vec<Vec<Value>>), ClientError> {
        let mut present: Vec<usize> = positions.to_vec();
        // An answer names what is missing; the next reads the rest (again if a CLEAR raced).
        loop {
            if present.is_empty() {
                return Ok((present, Vec::new()));
            }
            let idx: Vec<u64> = present.iter().map(|&p| indexes[p]).collect();
            match self.get_unit(slot, partition, idx, fields.clone()).await {
                Ok(cols) => return Ok((present, cols)),
                Err(ClientError::Remote { source, .. }) if !source.missing.is_empty() => {
                    let lacking: BTreeSet<u64> = source.missing.iter().map(|(_, i)| *i).collect();
                    let before = present.len();
                    present.retain(|&p| !lacking.contains(&indexes[p]));
                    if present.len() == before {
                        // Named keys this batch did not ask for: nothing to learn from it.
                        return Err(ClientError::Remote {
                            unit: slot.number,
                            source,
                        });
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }
}
