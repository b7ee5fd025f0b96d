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
    use std::hash::BuildHasher;

    use super::*;

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
}
