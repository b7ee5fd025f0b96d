//! An interval index for the registration cache: half-open ranges `start..end` (they may
//! overlap and nest), each with a unique id, answering "which ranges cover `lo..hi`?" in
//! O(log n) expected for the first answer and O(log n) per further one.
//!
//! A treap ordered by `(start, id)` whose nodes carry the largest `end` of their subtree: a
//! subtree whose largest end is below `hi` holds no covering range and is skipped whole, and
//! so is everything right of a node that starts after `lo`. Priorities are a hash of the id,
//! so the shape is deterministic and balanced in expectation.

/// A set of `(start, end, id)` ranges; ids are unique.
#[derive(Default)]
pub(crate) struct IntervalIndex {
    root: Link,
    len: usize,
}

type Link = Option<Box<Node>>;

struct Node {
    start: u128,
    end: u128,
    id: u64,
    prio: u64,
    /// Largest `end` in this subtree.
    max_end: u128,
    left: Link,
    right: Link,
}

impl Node {
    fn key(&self) -> (u128, u64) {
        (self.start, self.id)
    }

    fn update(&mut self) {
        let mut m = self.end;
        for child in [&self.left, &self.right].into_iter().flatten() {
            m = m.max(child.max_end);
        }
        self.max_end = m;
    }
}

/// splitmix64: a well-mixed priority from an id.
fn priority(id: u64) -> u64 {
    let mut z = id.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Splits `t` into keys `< key` and keys `>= key`.
fn split(t: Link, key: (u128, u64)) -> (Link, Link) {
    match t {
        None => (None, None),
        Some(mut n) => {
            if n.key() < key {
                let (l, r) = split(n.right.take(), key);
                n.right = l;
                n.update();
                (Some(n), r)
            } else {
                let (l, r) = split(n.left.take(), key);
                n.left = r;
                n.update();
                (l, Some(n))
            }
        }
    }
}

/// Joins two treaps where every key of `a` is below every key of `b`.
fn merge(a: Link, b: Link) -> Link {
    match (a, b) {
        (None, t) | (t, None) => t,
        (Some(mut x), Some(mut y)) => {
            if x.prio > y.prio {
                x.right = merge(x.right.take(), Some(y));
                x.update();
                Some(x)
            } else {
                y.left = merge(Some(x), y.left.take());
                y.update();
                Some(y)
            }
        }
    }
}

impl IntervalIndex {
    /// Number of ranges.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Adds `start..end` as `id` (an id already present is a caller bug and is ignored).
    pub(crate) fn insert(&mut self, start: u128, end: u128, id: u64) {
        let (l, r) = split(self.root.take(), (start, id));
        let (dup, r) = split(r, (start, id.saturating_add(1)));
        let added = dup.is_none();
        let node = dup.or_else(|| {
            Some(Box::new(Node {
                start,
                end,
                id,
                prio: priority(id),
                max_end: end,
                left: None,
                right: None,
            }))
        });
        self.root = merge(merge(l, node), r);
        if added {
            self.len += 1;
        }
    }

    /// Removes the range `id` that starts at `start`; true if it was there.
    pub(crate) fn remove(&mut self, start: u128, id: u64) -> bool {
        let (l, r) = split(self.root.take(), (start, id));
        let (hit, r) = split(r, (start, id.saturating_add(1)));
        self.root = merge(l, r);
        let removed = hit.is_some();
        if removed {
            self.len -= 1;
        }
        removed
    }

    /// The first `f(id)` that is `Some`, over the ids of ranges with `start <= lo` and
    /// `end >= hi`, in ascending `(start, id)` order.
    pub(crate) fn find_covering<T>(
        &self,
        lo: u128,
        hi: u128,
        mut f: impl FnMut(u64) -> Option<T>,
    ) -> Option<T> {
        fn visit<T>(
            link: &Link,
            lo: u128,
            hi: u128,
            f: &mut impl FnMut(u64) -> Option<T>,
        ) -> Option<T> {
            let n = link.as_deref()?;
            if n.max_end < hi {
                return None;
            }
            if let Some(found) = visit(&n.left, lo, hi, f) {
                return Some(found);
            }
            if n.start > lo {
                return None;
            }
            if n.end >= hi {
                if let Some(found) = f(n.id) {
                    return Some(found);
                }
            }
            visit(&n.right, lo, hi, f)
        }
        visit(&self.root, lo, hi, &mut f)
    }
}

impl Drop for IntervalIndex {
    /// Frees the nodes without recursion.
    fn drop(&mut self) {
        let mut stack: Vec<Box<Node>> = self.root.take().into_iter().collect();
        while let Some(mut n) = stack.pop() {
            stack.extend(n.left.take());
            stack.extend(n.right.take());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u8, u8),
        Remove(usize),
        Query(u8, u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (any::<u8>(), 1u8..64).prop_map(|(s, l)| Op::Insert(s, l)),
            any::<usize>().prop_map(Op::Remove),
            (any::<u8>(), 1u8..64).prop_map(|(s, l)| Op::Query(s, l)),
        ]
    }

    proptest! {
        /// Random inserts, removals and queries against a plain list of ranges: the index
        /// reports exactly the covering ranges, in `(start, id)` order.
        #[test]
        fn matches_a_naive_oracle(ops in proptest::collection::vec(op(), 1..200)) {
            let mut index = IntervalIndex::default();
            let mut oracle: Vec<(u128, u128, u64)> = Vec::new();
            let mut next = 1u64;
            for op in ops {
                match op {
                    Op::Insert(s, l) => {
                        let (s, e) = (s as u128, s as u128 + l as u128);
                        index.insert(s, e, next);
                        oracle.push((s, e, next));
                        next += 1;
                    }
                    Op::Remove(i) if !oracle.is_empty() => {
                        let (s, _, id) = oracle.swap_remove(i % oracle.len());
                        prop_assert!(index.remove(s, id));
                        prop_assert!(!index.remove(s, id));
                    }
                    Op::Remove(_) => {}
                    Op::Query(s, l) => {
                        let (lo, hi) = (s as u128, s as u128 + l as u128);
                        let mut want: Vec<(u128, u64)> = oracle
                            .iter()
                            .filter(|&&(s, e, _)| s <= lo && e >= hi)
                            .map(|&(s, _, id)| (s, id))
                            .collect();
                        want.sort_unstable();
                        let want: Vec<u64> = want.into_iter().map(|(_, id)| id).collect();
                        let mut got = Vec::new();
                        let none: Option<()> = index.find_covering(lo, hi, |id| {
                            got.push(id);
                            None
                        });
                        prop_assert!(none.is_none());
                        prop_assert_eq!(&got, &want);
                        // The first answer stops the search.
                        prop_assert_eq!(index.find_covering(lo, hi, Some), want.first().copied());
                    }
                }
                prop_assert_eq!(index.len(), oracle.len());
            }
        }
    }

    /// Many disjoint ranges inserted in address order (the worst case of an unbalanced
    /// tree): the treap stays shallow, and a lookup that nothing covers answers nothing.
    #[test]
    fn stays_shallow_under_sorted_inserts() {
        let mut index = IntervalIndex::default();
        let n = 1u64 << 14;
        for i in 0..n {
            index.insert(i as u128 * 100, i as u128 * 100 + 50, i + 1);
        }
        assert!(depth(&index.root) <= 4 * 14, "depth {}", depth(&index.root));
        assert_eq!(index.find_covering(123_460, 123_470, Some), None);
        assert_eq!(index.find_covering(123_410, 123_420, Some), Some(1235));
        for i in (0..n).step_by(2) {
            assert!(index.remove(i as u128 * 100, i + 1));
        }
        assert!(depth(&index.root) <= 4 * 13, "depth {}", depth(&index.root));
        assert_eq!(index.find_covering(123_410, 123_420, Some), None);
        assert_eq!(index.find_covering(123_310, 123_320, Some), Some(1234));
    }

    fn depth(l: &Link) -> usize {
        l.as_ref()
            .map_or(0, |n| 1 + depth(&n.left).max(depth(&n.right)))
    }
}
