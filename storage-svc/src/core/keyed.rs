//! The hasher of the unit's maps and sets keyed by client input (indexes, field names):
//! foldhash, several times faster than the standard library's SipHash on the 8-byte indexes
//! a PUT or GET names by the thousand, and keyed like it. foldhash's own `RandomState` seeds
//! itself from address-space layout and the clock; here the process-wide seed comes from the
//! operating system's random source, and each map draws its own per-map seed from a
//! per-thread stream started from it, so that a client cannot choose indexes that collide.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::hash::BuildHasher;
use std::sync::OnceLock;

use foldhash::fast::{FoldHasher, SeedableRandomState};
use foldhash::SharedSeed;

/// A map keyed by client input.
pub(crate) type KeyedMap<K, V> = HashMap<K, V, Keyed>;
/// A set of client input.
pub(crate) type KeyedSet<T> = HashSet<T, Keyed>;

/// Shards of an [`IndexMap`]: a table grows (moves every entry to a table twice its size) a
/// shard at a time, so that the unit's lock is never held for the move of a whole field of
/// a million keys. Measured on the benchmark machine: storing the millionth key of a field in
/// one table took 350-580 ms, the move of the table and the zeroing of its fresh pages; in 64
/// shards that each take an equal share of the keys, all of them grow at about the same
/// count, and one slice of a PUT took 61-71 ms.
const SHARDS: usize = 64;

/// The slots that the top bits of an index's hash pick a shard from ([`shard_table`]).
const SLOTS: usize = 1024;

/// Which shard each of [`SLOTS`] slots is: shard `s` has a share of them about
/// `2^(s / SHARDS)`, so that its keys pass each size at which a table grows at a count of
/// keys of its own, the shards' counts spread evenly over each doubling: when a field's
/// table grows, a shard at a time does.
fn shard_table() -> &'static [u8; SLOTS] {
    static TABLE: OnceLock<[u8; SLOTS]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let weight = |s: usize| (s as f64 / SHARDS as f64).exp2();
        let total: f64 = (0..SHARDS).map(weight).sum();
        let mut table = [0u8; SLOTS];
        let (mut filled, mut share) = (0, 0.0);
        for s in 0..SHARDS {
            share += weight(s) / total;
            let end = ((share * SLOTS as f64).round() as usize).min(SLOTS);
            table[filled..end].fill(s as u8);
            filled = end;
        }
        table[filled..].fill(SHARDS as u8 - 1);
        table
    })
}

/// A map keyed by client-chosen indexes, in [`SHARDS`] tables chosen by a keyed hash of
/// the index.
pub(crate) struct IndexMap<V> {
    /// Empty, or [`SHARDS`] tables.
    shards: Vec<KeyedMap<u64, V>>,
    pick: Keyed,
    len: usize,
}

impl<V> Default for IndexMap<V> {
    fn default() -> Self {
        Self {
            shards: Vec::new(),
            pick: Keyed::default(),
            len: 0,
        }
    }
}

impl<V> IndexMap<V> {
    fn shard(&self, index: u64) -> usize {
        // The hash's top bits: each table hashes its keys again with a seed of its own, and
        // places them by the low bits.
        let slot = self.pick.hash_one(index) >> (64 - SLOTS.trailing_zeros());
        shard_table()[slot as usize] as usize
    }

    pub(crate) fn get(&self, index: &u64) -> Option<&V> {
        self.shards.get(self.shard(*index))?.get(index)
    }

    pub(crate) fn insert(&mut self, index: u64, value: V) -> Option<V> {
        if self.shards.is_empty() {
            self.shards = (0..SHARDS).map(|_| KeyedMap::default()).collect();
        }
        let s = self.shard(index);
        let prev = self.shards[s].insert(index, value);
        if prev.is_none() {
            self.len += 1;
        }
        prev
    }

    pub(crate) fn remove(&mut self, index: &u64) -> Option<V> {
        let s = self.shard(*index);
        let prev = self.shards.get_mut(s)?.remove(index);
        if prev.is_some() {
            self.len -= 1;
        }
        prev
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut V> {
        self.shards.iter_mut().flat_map(|m| m.values_mut())
    }
}

/// A [`BuildHasher`] with a random key of its own (see the module's documentation).
#[derive(Clone, Debug)]
pub(crate) struct Keyed(SeedableRandomState);

impl Default for Keyed {
    fn default() -> Self {
        Self(SeedableRandomState::with_seed(
            per_map_seed(),
            shared_seed(),
        ))
    }
}

impl BuildHasher for Keyed {
    type Hasher = FoldHasher<'static>;

    fn build_hasher(&self) -> FoldHasher<'static> {
        self.0.build_hasher()
    }
}

/// A random 64-bit value from the operating system; the clock and an address where it has
/// none to give (the hash stays correct, only less keyed).
fn os_random() -> u64 {
    getrandom::u64().unwrap_or_else(|_| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let local = 0u8;
        t ^ (std::ptr::addr_of!(local) as u64).rotate_left(32)
    })
}

fn shared_seed() -> &'static SharedSeed {
    static SEED: OnceLock<SharedSeed> = OnceLock::new();
    SEED.get_or_init(|| SharedSeed::from_u64(os_random()))
}

/// splitmix64 over a per-thread state started from the operating system's random source.
fn per_map_seed() -> u64 {
    thread_local! {
        static STATE: Cell<u64> = Cell::new(os_random());
    }
    STATE.with(|s| {
        let x = s.get().wrapping_add(0x9e37_79b9_7f4a_7c15);
        s.set(x);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shard_has_slots_and_more_than_the_one_before_about() {
        let table = shard_table();
        let count = |s: u8| table.iter().filter(|t| **t == s).count();
        assert!(table.windows(2).all(|w| w[0] <= w[1]));
        assert!((0..SHARDS as u8).all(|s| count(s) >= 10));
        assert!(
            count(0) < 13 && count(63) > 20,
            "{} {}",
            count(0),
            count(63)
        );
    }

    use std::hash::BuildHasher;

    #[test]
    fn maps_are_keyed_apart_and_hash_consistently() {
        let (a, b) = (Keyed::default(), Keyed::default());
        // One map hashes a key the same way every time.
        assert_eq!(a.hash_one(42u64), a.hash_one(42u64));
        // Two maps disagree on some of a few keys (a shared key would agree on all).
        assert!((0u64..8).any(|k| a.hash_one(k) != b.hash_one(k)));
        let mut m: KeyedMap<u64, u64> = KeyedMap::default();
        for i in 0..10_000 {
            m.insert(i, i * 2);
        }
        assert!((0..10_000).all(|i| m.get(&i) == Some(&(i * 2))));
    }

    #[test]
    fn an_index_map_spreads_its_keys_over_its_shards_and_counts_them() {
        let mut m: IndexMap<u64> = IndexMap::default();
        assert!(m.get(&1).is_none() && m.remove(&1).is_none() && m.is_empty());
        for i in 0..10_000 {
            assert_eq!(m.insert(i, i), None);
        }
        assert_eq!(m.insert(7, 70), Some(7));
        assert_eq!(m.len(), 10_000);
        // Shares from about 1/92 to 2/92 of the keys.
        assert!(m.shards.iter().all(|s| s.len() > 60 && s.len() < 300));
        let (first, last) = (m.shards[..8].iter(), m.shards[56..].iter());
        let (first, last): (usize, usize) =
            (first.map(|s| s.len()).sum(), last.map(|s| s.len()).sum());
        assert!(last > first * 3 / 2, "{first} {last}");
        assert_eq!(m.remove(&7), Some(70));
        assert_eq!(m.remove(&7), None);
        assert_eq!(m.len(), 9_999);
        assert!((0..10_000)
            .filter(|i| *i != 7)
            .all(|i| m.get(&i) == Some(&i)));
        for v in m.values_mut() {
            *v += 1;
        }
        let mut all: Vec<u64> = m.values_mut().map(|v| *v).collect();
        all.sort_unstable();
        assert_eq!(all.len(), 9_999);
        assert_eq!(all[0], 1);
    }
}
