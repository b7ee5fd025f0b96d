//! Which units hold an index: [`Modulo`] for fixed unit lists (TransferQueue's placement), and
//! [`Rendezvous`] (highest-random-weight) hashing, under which a unit joining or leaving moves
//! only its own share of the keys.

/// Which units hold an index, in the order a GET tries them.
pub trait Placement: Send + Sync {
    /// The unit (in `0..units`) that holds `index` when there is one copy.
    fn unit_of(&self, index: u64, units: usize) -> usize;

    /// Writes into `out` (cleared first) the `r` distinct units that hold `index` of
    /// `partition` (all of them when there are fewer), the first the one a GET asks first.
    /// `ids` name the units in the client's order (their addresses). By default the first is
    /// [`unit_of`](Self::unit_of) and the others the units after it, wrapping around.
    fn replicas(
        &self,
        partition: &str,
        index: u64,
        ids: &[String],
        r: usize,
        out: &mut Vec<usize>,
    ) {
        let _ = partition;
        out.clear();
        let n = ids.len();
        if n == 0 {
            return;
        }
        let first = self.unit_of(index, n);
        out.extend((0..r.min(n)).map(|k| (first + k) % n));
    }
}

/// `index % units`; replicas are the units after it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Modulo;

impl Placement for Modulo {
    fn unit_of(&self, index: u64, units: usize) -> usize {
        (index % units as u64) as usize
    }
}

/// Rendezvous hashing: each unit scores every (partition, index) by a hash of the pair and the
/// unit's name, and the `r` highest scores hold it. Every client computes the same scores
/// (rapidhash v3, whose output the crate keeps stable across releases), so clients agree on
/// placement without talking, as long as they name each unit the same way (the same address
/// string: `127.0.0.1:7470` and `localhost:7470` are two names); removing a unit moves only
/// the keys it held, and adding one moves to it only the keys it now wins.
#[derive(Debug, Clone, Copy, Default)]
pub struct Rendezvous;

impl Rendezvous {
    /// The score of unit `id` for `index` of `partition`.
    pub fn score(partition: &str, index: u64, id: &str) -> u64 {
        let key = key_hash(partition, index);
        mix(key, rapidhash::v3::rapidhash_v3(id.as_bytes()))
    }
}

/// The (partition, index) part of a score: the partition's bytes, a separator no name
/// contains, the index.
fn key_hash(partition: &str, index: u64) -> u64 {
    let mut buf = Vec::with_capacity(partition.len() + 9);
    buf.extend_from_slice(partition.as_bytes());
    buf.push(0xff);
    buf.extend_from_slice(&index.to_le_bytes());
    rapidhash::v3::rapidhash_v3(&buf)
}

/// A score from a key's hash and a unit's: both hashed together, so that neither alone orders
/// the units.
fn mix(key: u64, unit: u64) -> u64 {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&key.to_le_bytes());
    buf[8..].copy_from_slice(&unit.to_le_bytes());
    rapidhash::v3::rapidhash_v3(&buf)
}

impl Placement for Rendezvous {
    /// Rendezvous over the units' positions (their names are not known here).
    fn unit_of(&self, index: u64, units: usize) -> usize {
        let key = key_hash("", index);
        (0..units)
            .max_by_key(|&u| (mix(key, u as u64), std::cmp::Reverse(u)))
            .unwrap_or(0)
    }

    fn replicas(
        &self,
        partition: &str,
        index: u64,
        ids: &[String],
        r: usize,
        out: &mut Vec<usize>,
    ) {
        out.clear();
        let key = key_hash(partition, index);
        let mut scored: Vec<(u64, usize)> = ids
            .iter()
            .enumerate()
            .map(|(u, id)| (mix(key, rapidhash::v3::rapidhash_v3(id.as_bytes())), u))
            .collect();
        // Highest score first; equal scores (never seen) by position.
        scored.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        out.extend(scored.iter().take(r).map(|&(_, u)| u));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("10.0.0.{i}:7470")).collect()
    }

    #[test]
    fn modulo_replicas_follow_the_primary() {
        let mut out = Vec::new();
        Modulo.replicas("p", 7, &ids(3), 2, &mut out);
        assert_eq!(out, [1, 2]);
        Modulo.replicas("p", 8, &ids(3), 3, &mut out);
        assert_eq!(out, [2, 0, 1]);
        Modulo.replicas("p", 8, &ids(2), 5, &mut out);
        assert_eq!(out, [0, 1]);
        Modulo.replicas("p", 8, &[], 2, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn rendezvous_picks_distinct_units_and_spreads_keys() {
        let units = ids(3);
        let mut counts = [0usize; 3];
        let mut out = Vec::new();
        for i in 0..3000 {
            Rendezvous.replicas("p", i, &units, 2, &mut out);
            assert_eq!(out.len(), 2);
            assert_ne!(out[0], out[1]);
            counts[out[0]] += 1;
        }
        // Each unit is first for about a third of the keys.
        assert!(
            counts.iter().all(|&c| (800..1200).contains(&c)),
            "{counts:?}"
        );
        // The same answer on every call, and in every partition its own.
        let mut again = Vec::new();
        Rendezvous.replicas("p", 42, &units, 3, &mut out);
        Rendezvous.replicas("p", 42, &units, 3, &mut again);
        assert_eq!(out, again);
        let differ = (0..100u64).any(|i| {
            Rendezvous.replicas("p", i, &units, 1, &mut out);
            Rendezvous.replicas("q", i, &units, 1, &mut again);
            out != again
        });
        assert!(differ);
    }

    #[test]
    fn a_unit_leaving_moves_only_its_keys() {
        let all = ids(4);
        let fewer: Vec<String> = all.iter().filter(|id| *id != &all[2]).cloned().collect();
        let (mut before, mut after) = (Vec::new(), Vec::new());
        let mut moved = 0;
        for i in 0..2000 {
            Rendezvous.replicas("p", i, &all, 2, &mut before);
            Rendezvous.replicas("p", i, &fewer, 2, &mut after);
            let names = |v: &[usize], set: &[String]| -> Vec<String> {
                v.iter().map(|&u| set[u].clone()).collect()
            };
            let (b, a) = (names(&before, &all), names(&after, &fewer));
            if b.contains(&all[2]) {
                moved += 1;
                // The surviving replica keeps its place in the order.
                let kept: Vec<&String> = b.iter().filter(|n| *n != &all[2]).collect();
                assert!(a.contains(kept[0]));
            } else {
                assert_eq!(a, b, "index {i} moved though its units stayed");
            }
        }
        // About half the keys had the leaving unit among their two.
        assert!((800..1200).contains(&moved), "{moved}");
    }

    #[test]
    fn scores_are_stable_across_releases() {
        // rapidhash v3's output is fixed: a changed score would move keys between the units
        // of a cluster whose clients run different builds.
        assert_eq!(
            Rendezvous::score("p", 1, "10.0.0.1:7470"),
            7_953_091_017_144_694_218
        );
        assert_eq!(Rendezvous::score("", 0, ""), 17_746_546_688_064_229_632);
        assert_eq!(Rendezvous.unit_of(5, 7), 3);
    }
}
