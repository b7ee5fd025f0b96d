//! The stored values and the receive blocks they pin: replacement, CLEAR, and compaction of
//! blocks that are mostly dead.
//!
//! Invariants kept here: `used` is the sum of every entry's logical bytes, each partition's
//! `keys` and `bytes` those of its entries, and each block's `live` the bytes of the entries
//! that pin it (a block with none left is forgotten).

use std::collections::{BTreeMap, HashMap};

use tessera_framecodec::{TensorError, Value, ViewError};

use super::keyed::{IndexMap, KeyedMap};
use super::{err, logical_bytes, Memory, PartitionStats, UnitConfig};
use crate::error::{ErrorKind, MemoryError, RemoteError};

pub(super) struct Entry {
    pub(super) value: Value,
    pub(super) bytes: u64,
    /// The receive block this value pins, if any.
    pub(super) block: Option<u64>,
}

#[derive(Default)]
struct Partition {
    fields: KeyedMap<String, IndexMap<Entry>>,
    keys: u64,
    bytes: u64,
}

/// A partition taken out of the store, its values freed when this drops
/// ([`Store::drop_partition`]).
pub(super) struct Detached(#[allow(dead_code)] Partition);

struct BlockInfo {
    size: u64,
    live: u64,
    partition: String,
}

/// Partitions of stored values and the receive blocks they pin.
#[derive(Default)]
pub(super) struct Store {
    partitions: BTreeMap<String, Partition>,
    blocks: HashMap<u64, BlockInfo>,
    next_block: u64,
    /// Stored logical bytes.
    used: u64,
    /// Bytes copied by compaction since start.
    compacted: u64,
    /// Stored keys, of every partition.
    keys: u64,
    /// What the stored keys cost besides their values (`key_cost` of each).
    overhead: u64,
}

/// A PUT value's rows: one list per field, each of one value per index.
pub(super) fn rows(
    value: Value,
    fields: usize,
    indexes: usize,
) -> Result<Vec<std::vec::IntoIter<Value>>, RemoteError> {
    let Value::List(columns) = value else {
        return Err(err(
            ErrorKind::BadRequest,
            "PUT value is not a list of fields",
        ));
    };
    if columns.len() != fields {
        return Err(err(ErrorKind::BadRequest, "one list per field expected"));
    }
    columns
        .into_iter()
        .map(|c| match c {
            Value::List(items) if items.len() == indexes => Ok(items.into_iter()),
            _ => Err(err(
                ErrorKind::BadRequest,
                "each field needs one value per index",
            )),
        })
        .collect()
}

/// What one stored key of `field` costs against the capacity besides its value: `overhead`
/// plus the key's length (the field name and 8 bytes of index).
pub(super) fn key_cost(overhead: u64, field: &str) -> u64 {
    overhead + field.len() as u64 + 8
}

/// What a PUT would replace: the logical bytes and the number of the keys already stored.
pub(super) struct Replaced {
    pub(super) bytes: u64,
    pub(super) keys: u64,
    /// Their `key_cost`s.
    pub(super) overhead: u64,
}

/// How compaction copies survivors out: the memory to copy into, its alignment, and the dead
/// fraction of a block past which it is compacted (0 disables compaction).
pub(super) struct Compaction<'a, M> {
    pub(super) mem: &'a mut M,
    pub(super) align: u64,
    pub(super) dead_fraction: f64,
    /// `UnitConfig::key_overhead_bytes`.
    pub(super) key_overhead: u64,
}

impl<'a, M> Compaction<'a, M> {
    /// Into `mem`, as `cfg` says (`align`, `compact_dead_fraction`).
    pub(super) fn new(mem: &'a mut M, cfg: &UnitConfig) -> Self {
        Self {
            mem,
            align: cfg.align,
            dead_fraction: cfg.compact_dead_fraction,
            key_overhead: cfg.key_overhead_bytes,
        }
    }

    /// The same, reborrowed for one more step.
    fn again(&mut self) -> Compaction<'_, M> {
        Compaction {
            mem: &mut *self.mem,
            align: self.align,
            dead_fraction: self.dead_fraction,
            key_overhead: self.key_overhead,
        }
    }
}

impl Store {
    /// Stored logical bytes.
    pub(super) fn used(&self) -> u64 {
        self.used
    }

    /// Bytes copied by compaction since start.
    pub(super) fn compacted(&self) -> u64 {
        self.compacted
    }

    /// Stored keys.
    pub(super) fn keys(&self) -> u64 {
        self.keys
    }

    /// What the stored keys cost besides their values.
    pub(super) fn overhead(&self) -> u64 {
        self.overhead
    }

    /// What a PUT of these keys would replace.
    pub(super) fn replaced(
        &self,
        partition: &str,
        indexes: &[u64],
        fields: &[String],
        key_overhead: u64,
    ) -> Replaced {
        let mut r = Replaced {
            bytes: 0,
            keys: 0,
            overhead: 0,
        };
        let Some(p) = self.partitions.get(partition) else {
            return r;
        };
        for f in fields {
            let Some(m) = p.fields.get(f) else { continue };
            for e in indexes.iter().filter_map(|i| m.get(i)) {
                r.bytes += e.bytes;
                r.keys += 1;
                r.overhead += key_cost(key_overhead, f);
            }
        }
        r
    }

    /// A fresh receive block of `size` bytes of `partition`, for the values of one PUT.
    pub(super) fn new_block(&mut self, size: u64, partition: &str) -> u64 {
        let id = self.next_block;
        self.next_block += 1;
        self.blocks.insert(
            id,
            BlockInfo {
                size,
                live: 0,
                partition: partition.to_owned(),
            },
        );
        id
    }

    /// Forgets block `id` if no value pins it (a PUT that stored nothing in it).
    pub(super) fn drop_if_unused(&mut self, id: u64) {
        if self.blocks.get(&id).is_some_and(|b| b.live == 0) {
            self.blocks.remove(&id);
        }
    }

    /// Checks the value's shape, then replaces every key at once.
    pub(super) fn store<M: Memory>(
        &mut self,
        partition: &str,
        indexes: &[u64],
        fields: &[String],
        value: Value,
        block: Option<u64>,
        c: Compaction<'_, M>,
    ) -> Result<(), RemoteError> {
        let mut rows = rows(value, fields.len(), indexes.len())?;
        self.store_rows(partition, indexes, fields, &mut rows, block, c);
        Ok(())
    }

    /// Stores the next `indexes.len()` values of each field's `rows` (one per field, in
    /// order) at `indexes`, replacing the keys stored there; returns the bytes the stored
    /// keys now count for more, their values' and new keys' (a PUT stored in slices gives
    /// that much of its reservation back), and the blocks that held the values replaced.
    pub(super) fn store_rows<M: Memory>(
        &mut self,
        partition: &str,
        indexes: &[u64],
        fields: &[String],
        rows: &mut [std::vec::IntoIter<Value>],
        block: Option<u64>,
        mut c: Compaction<'_, M>,
    ) -> (u64, Vec<u64>) {
        let mut added = 0u64;
        let mut new_keys = 0u64;
        let mut new_overhead = 0u64;
        // What the replaced entries accounted for, per block they came from (the values of one
        // earlier PUT share its block, so runs are merged as they come); their values drop as
        // they are replaced.
        let mut old: Vec<(Option<u64>, u64)> = Vec::new();
        let part = self.partitions.entry(partition.to_owned()).or_default();
        for (field, items) in fields.iter().zip(rows.iter_mut()) {
            let map = part.fields.entry(field.clone()).or_default();
            for (index, value) in indexes.iter().zip(items) {
                let bytes = logical_bytes(&value);
                added += bytes;
                let entry = Entry {
                    value,
                    bytes,
                    block,
                };
                match map.insert(*index, entry) {
                    Some(prev) => match old.last_mut() {
                        Some((b, sum)) if *b == prev.block => *sum += prev.bytes,
                        _ => old.push((prev.block, prev.bytes)),
                    },
                    None => {
                        new_keys += 1;
                        new_overhead += key_cost(c.key_overhead, field);
                    }
                }
            }
        }
        part.keys += new_keys;
        self.keys += new_keys;
        self.overhead += new_overhead;
        part.bytes += added;
        self.used += added;
        if let Some(b) = block.and_then(|b| self.blocks.get_mut(&b)) {
            b.live += added;
        }
        if let Some(p) = self.partitions.get_mut(partition) {
            p.bytes -= old.iter().map(|(_, bytes)| bytes).sum::<u64>();
        }
        // Each block is released by what left it at once, so a block whose dead fraction
        // passes the threshold only because of this PUT (or this slice of it) is not
        // compacted halfway through.
        let mut released = Vec::new();
        for (block, bytes) in old {
            released.extend(block);
            self.release(bytes, block, c.again());
        }
        (added + new_overhead, released)
    }

    /// The stored values of `fields` x `indexes`, one list per field; or the keys missing
    /// (at most 1,000 named).
    pub(super) fn lookup(
        &self,
        partition: &str,
        indexes: &[u64],
        fields: &[String],
    ) -> Result<Vec<Value>, RemoteError> {
        let mut columns: Vec<Vec<Value>> = fields
            .iter()
            .map(|_| Vec::with_capacity(indexes.len()))
            .collect();
        let mut missing = Vec::new();
        let mut count = 0;
        self.lookup_into(
            partition,
            indexes,
            fields,
            &mut columns,
            &mut missing,
            &mut count,
        );
        if count > 0 {
            return Err(missing_error(partition, count, missing));
        }
        Ok(columns.into_iter().map(Value::List).collect())
    }

    /// Appends the stored values of `fields` x `indexes` to `columns` (one per field), and
    /// the keys missing to `missing` (at most 1,000 named), counting them in `count`.
    pub(super) fn lookup_into(
        &self,
        partition: &str,
        indexes: &[u64],
        fields: &[String],
        columns: &mut [Vec<Value>],
        missing: &mut Vec<(String, u64)>,
        count: &mut u64,
    ) {
        let part = self.partitions.get(partition);
        for (f, items) in fields.iter().zip(columns.iter_mut()) {
            let map = part.and_then(|p| p.fields.get(f));
            for i in indexes {
                match map.and_then(|m| m.get(i)) {
                    Some(e) if *count == 0 => items.push(e.value.clone()),
                    Some(_) => {}
                    None => {
                        *count += 1;
                        if missing.len() < 1000 {
                            missing.push((f.clone(), *i));
                        }
                    }
                }
            }
        }
    }

    /// Removes `indexes` of `fields` (every field when `None`) from `partition`; returns the
    /// blocks the removed values pinned.
    pub(super) fn clear<M: Memory>(
        &mut self,
        partition: &str,
        indexes: &[u64],
        fields: Option<&[String]>,
        c: Compaction<'_, M>,
    ) -> Vec<u64> {
        let Some(part) = self.partitions.get_mut(partition) else {
            return Vec::new();
        };
        let mut gone = Vec::new();
        let mut overhead = 0;
        for (name, map) in part.fields.iter_mut() {
            if fields.is_some_and(|fs| !fs.iter().any(|f| f == name)) {
                continue;
            }
            for i in indexes {
                if let Some(e) = map.remove(i) {
                    overhead += key_cost(c.key_overhead, name);
                    gone.push(e);
                }
            }
        }
        self.keys -= gone.len() as u64;
        self.overhead -= overhead;
        part.fields.retain(|_, m| !m.is_empty());
        for e in &gone {
            part.keys -= 1;
            part.bytes -= e.bytes;
        }
        if part.fields.is_empty() {
            self.partitions.remove(partition);
        }
        let mut released: Vec<u64> = gone.iter().filter_map(|e| e.block).collect();
        released.dedup();
        self.forget_all(gone, c);
        released
    }

    /// Removes every value of `partition` from the store and its accounts, and hands them
    /// back to be freed: its keys and bytes leave the counts here, its blocks leave the
    /// blocks' map (every value a block holds is of one partition, so none of them has a
    /// value left), and the values themselves drop with what is returned, where the caller
    /// frees them: a partition of a million scalars held the unit's lock for 145 ms when it
    /// was freed here, and for 3.5 us taken out (its freeing, 41 ms, then outside).
    pub(super) fn drop_partition(
        &mut self,
        partition: &str,
        key_overhead: u64,
    ) -> Option<Detached> {
        let p = self.partitions.remove(partition)?;
        for (name, m) in &p.fields {
            self.keys -= m.len() as u64;
            self.overhead -= key_cost(key_overhead, name) * m.len() as u64;
        }
        self.used -= p.bytes;
        self.blocks.retain(|_, b| b.partition != partition);
        Some(Detached(p))
    }

    /// Accounts for entries leaving the store (their `Value`s drop with them).
    fn forget_all<M: Memory>(&mut self, gone: Vec<Entry>, mut c: Compaction<'_, M>) {
        for e in gone {
            self.release(e.bytes, e.block, c.again());
        }
    }

    /// Accounts for `bytes` of stored values leaving the store, from `block` if any.
    fn release<M: Memory>(&mut self, bytes: u64, block: Option<u64>, c: Compaction<'_, M>) {
        self.used -= bytes;
        let Some(id) = block else { return };
        if let Some(b) = self.blocks.get_mut(&id) {
            b.live -= bytes;
            if b.live == 0 {
                self.blocks.remove(&id);
                return;
            }
        }
        self.compact_if_due(id, c);
    }

    /// Compacts block `id` where its dead fraction passed `c`'s.
    pub(super) fn compact_if_due<M: Memory>(&mut self, id: u64, c: Compaction<'_, M>) {
        // `live` counts the logical bytes of the values attributed to the block (scalars and
        // packed small values of the same PUT included), so it can exceed the block's size:
        // then nothing in it is dead.
        let due = self.blocks.get(&id).is_some_and(|b| {
            let dead = b.size.saturating_sub(b.live);
            c.dead_fraction > 0.0 && dead as f64 > c.dead_fraction * b.size as f64
        });
        if due {
            self.compact(id, c);
        }
    }

    /// Copies the survivors of block `id` out, so the block can return to the pool.
    fn compact<M: Memory>(&mut self, id: u64, c: Compaction<'_, M>) {
        let Some(info) = self.blocks.remove(&id) else {
            return;
        };
        let Some(part) = self.partitions.get_mut(&info.partition) else {
            return;
        };
        for map in part.fields.values_mut() {
            for e in map.values_mut() {
                if e.block != Some(id) {
                    continue;
                }
                match detach_into(&e.value, c.mem, c.align) {
                    Ok((v, copied)) => {
                        e.value = v;
                        e.block = None;
                        self.compacted += copied;
                    }
                    Err(error) => {
                        tracing::debug!(block = id, %error, "compaction skipped: no memory");
                        e.block = None;
                    }
                }
            }
        }
    }

    /// Keys and bytes per partition, into `per`.
    pub(super) fn partition_stats<'a>(&'a self, per: &mut BTreeMap<&'a str, PartitionStats>) {
        for (name, p) in &self.partitions {
            let s = per.entry(name).or_default();
            s.keys = p.keys;
            s.bytes = p.bytes;
        }
    }

    /// Drops every value and block (teardown); the compaction count stays.
    pub(super) fn clear_all(&mut self) {
        self.partitions.clear();
        self.blocks.clear();
        self.used = 0;
        self.keys = 0;
        self.overhead = 0;
    }
}

/// The answer naming the keys missing of `partition`: `count` of them, `missing` named.
pub(super) fn missing_error(
    partition: &str,
    count: u64,
    missing: Vec<(String, u64)>,
) -> RemoteError {
    const NAMED: usize = 8;
    let mut named: Vec<String> = missing
        .iter()
        .take(NAMED)
        .map(|(field, index)| format!("index {index} field {field:?}"))
        .collect();
    if count > named.len() as u64 {
        named.push(format!("{} more", count - named.len() as u64));
    }
    let mut e = err(
        ErrorKind::Missing,
        format!(
            "{count} key(s) not stored in partition {partition:?}: {}",
            named.join(", ")
        ),
    );
    e.missing = missing;
    e
}

/// Why a value could not be copied out of its block (it then stays where it is).
#[derive(Debug, thiserror::Error)]
enum CompactionError {
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error(transparent)]
    View(#[from] ViewError),
    #[error(transparent)]
    Tensor(#[from] TensorError),
}

/// Copies a value's payloads into fresh blocks of `mem` (compaction). Small payloads are
/// copied to the heap by `detach_small`; returns the bytes copied.
fn detach_into<M: Memory>(
    v: &Value,
    mem: &mut M,
    align: u64,
) -> Result<(Value, u64), CompactionError> {
    Ok(match v {
        Value::Bytes(b) => {
            let n = b.len() as u64;
            (Value::Bytes(mem.copy_in(b, align)?), n)
        }
        Value::Tensor(t) => {
            let t = t.contiguous()?;
            let n = t.data().len() as u64;
            let data = mem.copy_in(t.data(), align)?;
            let t = tessera_framecodec::Tensor::new(t.dtype(), t.shape(), data)?;
            (Value::Tensor(t), n)
        }
        Value::List(items) => {
            let mut out = Vec::with_capacity(items.len());
            let mut n = 0;
            for i in items {
                let (v, c) = detach_into(i, mem, align)?;
                out.push(v);
                n += c;
            }
            (Value::List(out), n)
        }
        Value::Map(items) => {
            let mut out = Vec::with_capacity(items.len());
            let mut n = 0;
            for (k, i) in items {
                let (v, c) = detach_into(i, mem, align)?;
                out.push((k.clone(), v));
                n += c;
            }
            (Value::Map(out), n)
        }
        other => (other.clone(), 0),
    })
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use serde_bytes::ByteBuf;
    use tessera_framecodec::{Tensor, Value};

    use crate::core::{Output, Unit, UnitConfig};
    use crate::proto::{Request, Response};
    use crate::testing::{handshake, VecMem};

    /// A committed PUT that stores nothing (its value does not fit its keys) leaves no record
    /// of its block behind; one that stores keeps it until its last value is cleared.
    #[test]
    fn a_block_is_recorded_only_while_values_pin_it() {
        // A plain test without the loom cfg; under it, one model (VecMem's counters are loom's).
        tessera_sync::model(|| {
            let mem = VecMem::new(u64::MAX);
            // No credits: the memory below is the stored blocks' alone.
            let cfg = UnitConfig {
                inline_max: 16,
                credit_bytes: 0,
                ..UnitConfig::default()
            };
            let mut unit = Unit::new(cfg, mem.clone());
            let now = Instant::now();
            unit.open_session(1);
            let out = handshake::open(&mut unit, now, 1, 0, vec![], None);
            assert!(matches!(out[..], [Output::Accept { .. }]));
            unit.session_ready(1, "client");
            let t = Tensor::from_slice(&[256], &[0u8; 256]).unwrap();
            let put = |unit: &mut Unit<VecMem>, id: u64, values: usize| {
                let v = Value::List(vec![Value::List(vec![Value::Tensor(t.clone()); values])]);
                let frames = tessera_framecodec::encode(&v).unwrap();
                let req = Request::Put {
                    partition: "p".into(),
                    indexes: vec![1],
                    fields: vec!["x".into()],
                    meta: ByteBuf::from(frames.meta.to_vec()),
                    inline: None,
                    pull: None,
                };
                let out = unit.handle(now, 1, id, req);
                assert!(
                    matches!(
                        out[..],
                        [Output::Reply {
                            response: Response::PutReady { .. },
                            ..
                        }]
                    ),
                    "{out:?}"
                );
                match unit
                    .handle(now, 1, id + 100, Request::Commit { put: id })
                    .remove(0)
                {
                    Output::Reply { response, .. } => response,
                    other => panic!("{other:?}"),
                }
            };
            // Two values for one index: refused at COMMIT, nothing stored.
            assert!(matches!(put(&mut unit, 1, 2), Response::Error(_)));
            assert!(unit.store.blocks.is_empty());
            assert_eq!((unit.stats().keys, mem.live()), (0, 0));
            assert_eq!(put(&mut unit, 2, 1), Response::Done);
            assert_eq!(unit.store.blocks.len(), 1);
            let clear = Request::Clear {
                partition: "p".into(),
                indexes: vec![1],
                fields: None,
            };
            assert_eq!(unit.handle(now, 1, 3, clear).len(), 1);
            assert!(unit.store.blocks.is_empty());
            assert_eq!(mem.live(), 0);
        });
    }
}
