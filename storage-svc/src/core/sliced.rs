//! Requests handled in slices (a GET, CLEAR or PUT of more than `slice_keys` keys, so that no
//! hold of the unit's shared state grows with a request's key count), and the partitions
//! they hold meanwhile: another request that would see one half done waits for it.
//!
//! A request holds its partition to read (a GET) or to write (a PUT's store, a CLEAR): readers
//! share it, a writer has it alone. The driver orders waiting requests (first come, first
//! served); the core only tells it which request must wait ([`Unit::waits`]), and keeps the
//! holds, so that the check and a request's handling are one step under the unit's lock.
//!
//! Invariant kept here: a PUT stored in slices reserves what it has still to store
//! (`storing`), which the admission of other PUTs counts as reserved.

use std::collections::hash_map::Entry;
use std::collections::HashSet;

use tessera_framecodec::Value;

use super::keyed::KeyedMap;
use super::store::{rows, Compaction};
use super::{logical_bytes, Memory, Output, SessionId, Unit};
use crate::error::RemoteError;
use crate::proto::Request;

/// A slice of a PUT's store (or of a CLEAR) takes `slice_keys` divided by this many keys. A
/// key stored costs several lookups (a random place in a table of megabytes, the value it
/// replaces dropped): on the benchmark machine a slice of 4,096 keys stored into a field of a
/// million took 1.4-1.9 ms, which every other session waits out on a unit of one core, at
/// each of the several steps of its round trip. With slices of 512 keys, the hostile probe's p99 beside a
/// session storing 2^18 keys per PUT was 3.2-5.7 ms; with 128, 1.2-2.2 ms.
const STORE_COST: u64 = 32;

/// Keys a PUT's store or a CLEAR handled in slices writes per hold of the unit's state.
pub fn write_slice_keys(cfg: &super::UnitConfig) -> usize {
    (cfg.slice_keys / STORE_COST).max(1) as usize
}

/// How a request uses the keys of its partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Looks values up (GET).
    Read,
    /// Stores or removes values (PUT, CLEAR, drop).
    Write,
}

#[derive(Default)]
struct Hold {
    readers: u32,
    writer: bool,
}

/// The partitions held by requests handled in slices.
#[derive(Default)]
pub(super) struct Holds {
    by: KeyedMap<String, Hold>,
    /// Bytes still to store of the PUTs being stored in slices, and keys (some of which
    /// may replace stored ones).
    storing: u64,
    storing_keys: u64,
}

impl Holds {
    /// Whether a request using `partition` with `access` would see a request in slices
    /// half done, or be seen half done by it.
    fn conflicts(&self, partition: &str, access: Access) -> bool {
        self.by.get(partition).is_some_and(|h| {
            h.writer
                || match access {
                    Access::Read => false,
                    Access::Write => h.readers > 0,
                }
        })
    }

    fn hold(&mut self, partition: &str, access: Access) {
        let h = self.by.entry(partition.to_owned()).or_default();
        match access {
            Access::Read => h.readers += 1,
            Access::Write => h.writer = true,
        }
    }

    fn release(&mut self, partition: &str, access: Access) {
        let Entry::Occupied(mut h) = self.by.entry(partition.to_owned()) else {
            return;
        };
        match access {
            Access::Read => h.get_mut().readers = h.get().readers.saturating_sub(1),
            Access::Write => h.get_mut().writer = false,
        }
        if h.get().readers == 0 && !h.get().writer {
            h.remove();
        }
    }

    pub(super) fn storing(&self) -> u64 {
        self.storing
    }

    pub(super) fn storing_keys(&self) -> u64 {
        self.storing_keys
    }
}

/// What the driver did off the unit's lock ahead of a request of many keys, so that its
/// handling does not: see [`Unit::handle_slicing`].
#[derive(Default)]
pub struct Ahead {
    /// It checked the request's keys ([`check_keys`](super::check_keys)) and found them valid.
    pub keys_checked: bool,
    /// A PUT's meta, decoded with [`Unit::meta_decoder`] (of `u64::MAX`) and the unit's
    /// alignment, where the PUT asks for a receive block or carries nothing but its meta
    /// ([`inline_empty`](super::inline_empty)): its handling binds it to the block it leases
    /// (or to no bytes) instead of decoding it.
    pub meta: Option<tessera_framecodec::Unbound>,
}

/// A PUT whose values are stored in slices ([`Unit::put_step`]), answered once the last one
/// is. It holds its partition to write until then.
pub struct SlicedPut<D> {
    partition: String,
    indexes: Vec<u64>,
    fields: Vec<String>,
    rows: Vec<std::vec::IntoIter<Value>>,
    block: Option<u64>,
    /// The blocks that held values it replaced: compacted, where due, once it is stored (a
    /// block it replaces every value of is then simply freed, not copied out halfway).
    released: HashSet<u64>,
    next: usize,
    /// What it has still to store, reserved.
    reserved: u64,
    /// Sent once it is stored.
    answer: Vec<Output<D>>,
}

impl<D> SlicedPut<D> {
    /// Its partition.
    pub fn partition(&self) -> &str {
        &self.partition
    }
}

/// What a request handled by [`Unit::handle_slicing`] leads to: its answer, or a PUT to
/// store in slices (its answer sent once it is stored).
pub type MaybeSliced<D> = Result<Vec<Output<D>>, Box<SlicedPut<D>>>;

/// The partition a request uses, and how; `None` for one that names none.
fn uses(req: &Request) -> Option<(&str, Access)> {
    match req {
        Request::Get { partition, .. } | Request::GetOffer { partition, .. } => {
            Some((partition, Access::Read))
        }
        Request::Put { partition, .. }
        | Request::PutCredited { partition, .. }
        | Request::Clear { partition, .. }
        | Request::DropPartition { partition } => Some((partition, Access::Write)),
        _ => None,
    }
}

impl<M: Memory> Unit<M> {
    /// Handles `req` as [`Unit::handle`] does, except that a PUT of more than `slice_keys`
    /// keys that is ready to store is not stored yet: it comes back as a [`SlicedPut`],
    /// holding its partition, for the driver to store ([`Unit::put_step`]) and then send
    /// its answer. The driver checked [`Unit::waits`] first, and did what `ahead` says.
    pub fn handle_slicing(
        &mut self,
        now: std::time::Instant,
        session: SessionId,
        id: u64,
        req: Request,
        ahead: Ahead,
    ) -> MaybeSliced<M::Dest> {
        self.ahead = ahead;
        let out = self.slicing_stores(|unit| unit.handle(now, session, id, req));
        self.ahead = Ahead::default();
        out
    }

    /// [`Unit::read_done`] as [`Unit::handle_slicing`] handles a request: a pulled PUT of
    /// more than `slice_keys` keys comes back to be stored in slices. The driver checked
    /// [`Unit::read_waits`] first.
    pub fn read_done_slicing(
        &mut self,
        session: SessionId,
        put: u64,
        result: Result<(), crate::error::PayloadError>,
    ) -> MaybeSliced<M::Dest> {
        self.slicing_stores(|unit| unit.read_done(session, put, result))
    }

    fn slicing_stores(
        &mut self,
        step: impl FnOnce(&mut Self) -> Vec<Output<M::Dest>>,
    ) -> MaybeSliced<M::Dest> {
        self.slicing = true;
        let out = step(self);
        self.slicing = false;
        match self.sliced_put.take() {
            Some(mut p) => {
                p.answer = out;
                Err(p)
            }
            None => Ok(out),
        }
    }

    /// Stores the next slice of `p` ([`write_slice_keys`]); once the last one
    /// is, compacts the blocks it emptied where due, gives its partition and what it reserved
    /// back and returns its answer.
    pub fn put_step(&mut self, p: &mut SlicedPut<M::Dest>) -> Option<Vec<Output<M::Dest>>> {
        let per = (write_slice_keys(&self.cfg) / p.fields.len().max(1)).max(1);
        let end = (p.next + per).min(p.indexes.len());
        // Compaction waits for the last slice.
        let c = Compaction {
            dead_fraction: 0.0,
            ..Compaction::new(&mut self.mem, &self.cfg)
        };
        let (added, released) = self.store.store_rows(
            &p.partition,
            &p.indexes[p.next..end],
            &p.fields,
            &mut p.rows,
            p.block,
            c,
        );
        p.released.extend(released);
        let back = added.min(p.reserved);
        p.reserved -= back;
        self.holds.storing -= back;
        let keys = ((end - p.next) * p.fields.len()) as u64;
        self.holds.storing_keys -= keys;
        p.next = end;
        if p.next < p.indexes.len() {
            return None;
        }
        self.put_end(p);
        Some(std::mem::take(&mut p.answer))
    }

    /// Ends `p` where it stands: compacts the blocks it emptied where due, and gives back its
    /// partition and what it still reserves. [`Unit::put_step`] calls it once the last slice
    /// is stored; a driver that stops storing `p` before (its answer is not sent) calls it
    /// itself.
    pub fn put_end(&mut self, p: &mut SlicedPut<M::Dest>) {
        self.compact_released(std::mem::take(&mut p.released));
        self.holds.storing -= p.reserved;
        p.reserved = 0;
        self.holds.storing_keys -= ((p.indexes.len() - p.next) * p.fields.len()) as u64;
        if let Some(b) = p.block {
            self.store.drop_if_unused(b);
        }
        p.next = p.indexes.len();
        self.holds.release(&p.partition, Access::Write);
    }

    /// Clears one slice of a CLEAR handled in slices (its driver holds the partition), as a
    /// CLEAR of those indexes does, except that the blocks it leaves mostly dead are added to
    /// `released` and compacted by [`Unit::clear_end`] once every slice is cleared, not
    /// halfway (the next slices would clear what the compaction copied). Refused in a session
    /// state that refuses requests.
    pub fn clear_step(
        &mut self,
        session: SessionId,
        partition: &str,
        indexes: &[u64],
        fields: Option<&[String]>,
        released: &mut HashSet<u64>,
    ) -> Result<(), RemoteError> {
        if let Some((kind, why)) = self.refused_by_state(session, super::session::Step::Other) {
            return Err(super::err(kind, why));
        }
        let c = Compaction {
            dead_fraction: 0.0,
            ..Compaction::new(&mut self.mem, &self.cfg)
        };
        released.extend(self.store.clear(partition, indexes, fields, c));
        Ok(())
    }

    /// Ends a CLEAR handled in slices ([`Unit::clear_step`]): compacts the blocks it left
    /// mostly dead, where due.
    pub fn clear_end(&mut self, released: HashSet<u64>) {
        self.compact_released(released);
    }

    fn compact_released(&mut self, released: HashSet<u64>) {
        for id in released {
            let c = Compaction::new(&mut self.mem, &self.cfg);
            self.store.compact_if_due(id, c);
        }
    }

    /// The partition `req` of `session` would wait for, and how it uses it, where a request
    /// handled in slices holds it and `req` would see that request half done (or be seen
    /// so): the driver waits for the partition, then handles `req` while it holds it.
    pub fn waits(&self, session: SessionId, req: &Request) -> Option<(String, Access)> {
        if self.holds.by.is_empty() {
            return None;
        }
        let (partition, access) = match req {
            Request::Commit { put } => (self.puts.partition_of(session, *put)?, Access::Write),
            other => uses(other)?,
        };
        self.holds
            .conflicts(partition, access)
            .then(|| (partition.to_owned(), access))
    }

    /// Whether the READ of pulled PUT `put` of `session`, once done ([`Unit::read_done`]),
    /// would store into a partition held by a request in slices, as its COMMIT would if it
    /// were pushed; its partition if so.
    pub fn read_waits(&self, session: SessionId, put: u64) -> Option<String> {
        self.waits(session, &Request::Commit { put })
            .map(|(partition, _)| partition)
    }

    /// A request handled in slices holds `partition` with `access` until [`Unit::release`].
    pub fn hold(&mut self, partition: &str, access: Access) {
        self.holds.hold(partition, access);
    }

    /// Ends a hold of [`Unit::hold`].
    pub fn release(&mut self, partition: &str, access: Access) {
        self.holds.release(partition, access);
    }

    /// Where [`Unit::handle_slicing`] asked for it and the PUT has more than `slice_keys`
    /// keys: takes its value to store in slices (its shape checked, its partition held) and
    /// returns `None`; else gives the value back for the caller to store at once.
    pub(super) fn slice_store(
        &mut self,
        partition: &str,
        indexes: &[u64],
        fields: &[String],
        value: Value,
        block: Option<u64>,
    ) -> Result<Option<Value>, RemoteError> {
        let keys = indexes.len().saturating_mul(fields.len());
        if !self.slicing || keys as u64 <= self.cfg.slice_keys || self.sliced_put.is_some() {
            return Ok(Some(value));
        }
        let rows = rows(value, fields.len(), indexes.len())?;
        let overhead: u64 = fields
            .iter()
            .map(|f| super::store::key_cost(self.cfg.key_overhead_bytes, f))
            .sum::<u64>()
            .saturating_mul(indexes.len() as u64);
        let reserved = rows
            .iter()
            .flat_map(|r| r.as_slice())
            .map(logical_bytes)
            .sum::<u64>()
            + overhead;
        self.holds.storing += reserved;
        self.holds.storing_keys += keys as u64;
        self.holds.hold(partition, Access::Write);
        self.sliced_put = Some(Box::new(SlicedPut {
            partition: partition.to_owned(),
            indexes: indexes.to_vec(),
            fields: fields.to_vec(),
            rows,
            block,
            released: HashSet::new(),
            next: 0,
            reserved,
            answer: Vec::new(),
        }));
        Ok(None)
    }
}
