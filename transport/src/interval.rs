//! An interval index for the registration cache: half-open ranges `start..end` (they may
//! overlap and nest), each with a unique id, answering "which ranges cover `lo..hi`?" in
//! O(log n) expected for the first answer and O(log n) per further one.
//!
//! A treap ordered by `(start, id)` whose nodes carry the largest `end` of their subtree: a
//! subtree whose largest end is below `hi` holds no covering range and is skipped whole, and
//! so is everything right of a node that starts after `lo`. Priorities are a hash of the id,
//! so the shape is deterministic and balanced in expectation.

/// A set of `(start, end, id)` ranges; ids are unique.
///
/// Nodes live in one vector and link by index, with a free list: inserting and removing
/// allocate nothing once the vector has grown to the index's high-water mark.
pub(crate) struct IntervalIndex {
    nodes: Vec<Node>,
    root: Idx,
    /// Head of the list of free slots, linked through `left`.
    free: Idx,
    len: usize,
}

impl Default for IntervalIndex {
    fn default() -> Self {
        Self {
            nodes: Vec::new(),
            root: NIL,
            free: NIL,
            len: 0,
        }
    }
}

type Idx = u32;

/// No node.
const NIL: Idx = Idx::MAX;

struct Node {
    start: u64,
    end: u64,
    /// Largest `end` in this subtree.
    max_end: u64,
    id: u64,
    prio: u64,
    left: Idx,
    right: Idx,
}

impl Default for Node {
    fn default() -> Self {
        Self {
            start: 0,
            end: 0,
            max_end: 0,
            id: 0,
            prio: 0,
            left: NIL,
            right: NIL,
        }
    }
}

/// splitmix64: a well-mixed priority from an id.
fn priority(id: u64) -> u64 {
    let mut z = id.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl IntervalIndex {
    /// Number of ranges.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn key(&self, n: Idx) -> (u64, u64) {
        let n = &self.nodes[n as usize];
        (n.start, n.id)
    }

    fn max_end(&self, n: Idx) -> u64 {
        if n == NIL {
            0
        } else {
            self.nodes[n as usize].max_end
        }
    }

    fn update(&mut self, n: Idx) {
        let (l, r) = {
            let node = &self.nodes[n as usize];
            (node.left, node.right)
        };
        let m = self.max_end(l).max(self.max_end(r));
        let node = &mut self.nodes[n as usize];
        node.max_end = node.end.max(m);
    }

    /// Splits subtree `t` into keys `< key` and keys `>= key`.
    fn split(&mut self, t: Idx, key: (u64, u64)) -> (Idx, Idx) {
        if t == NIL {
            return (NIL, NIL);
        }
        if self.key(t) < key {
            let (l, r) = self.split(self.nodes[t as usize].right, key);
            self.nodes[t as usize].right = l;
            self.update(t);
            (t, r)
        } else {
            let (l, r) = self.split(self.nodes[t as usize].left, key);
            self.nodes[t as usize].left = r;
            self.update(t);
            (l, t)
        }
    }

    /// Joins subtrees `a` and `b`, every key of `a` below every key of `b`.
    fn merge(&mut self, a: Idx, b: Idx) -> Idx {
        if a == NIL {
            return b;
        }
        if b == NIL {
            return a;
        }
        if self.nodes[a as usize].prio > self.nodes[b as usize].prio {
            let m = self.merge(self.nodes[a as usize].right, b);
            self.nodes[a as usize].right = m;
            self.update(a);
            a
        } else {
            let m = self.merge(a, self.nodes[b as usize].left);
            self.nodes[b as usize].left = m;
            self.update(b);
            b
        }
    }

    /// Puts node `n` into subtree `t`: it descends to where `n`'s priority belongs and
    /// splits only the subtree below that point.
    fn put(&mut self, t: Idx, n: Idx) -> Idx {
        if t == NIL {
            return n;
        }
        let key = self.key(n);
        if self.nodes[n as usize].prio > self.nodes[t as usize].prio {
            let (l, r) = self.split(t, key);
            let node = &mut self.nodes[n as usize];
            node.left = l;
            node.right = r;
            self.update(n);
            return n;
        }
        if key < self.key(t) {
            let c = self.put(self.nodes[t as usize].left, n);
            self.nodes[t as usize].left = c;
        } else {
            let c = self.put(self.nodes[t as usize].right, n);
            self.nodes[t as usize].right = c;
        }
        let end = self.nodes[n as usize].end;
        let node = &mut self.nodes[t as usize];
        node.max_end = node.max_end.max(end);
        t
    }

    /// Takes the node with `key` out of subtree `t`: the new subtree root and the node.
    fn take(&mut self, t: Idx, key: (u64, u64)) -> (Idx, Idx) {
        if t == NIL {
            return (NIL, NIL);
        }
        let here = self.key(t);
        if key == here {
            let (l, r) = {
                let node = &self.nodes[t as usize];
                (node.left, node.right)
            };
            return (self.merge(l, r), t);
        }
        let hit = if key < here {
            let (c, hit) = self.take(self.nodes[t as usize].left, key);
            self.nodes[t as usize].left = c;
            hit
        } else {
            let (c, hit) = self.take(self.nodes[t as usize].right, key);
            self.nodes[t as usize].right = c;
            hit
        };
        if hit != NIL {
            self.update(t);
        }
        (t, hit)
    }

    fn contains(&self, key: (u64, u64)) -> bool {
        let mut t = self.root;
        while t != NIL {
            let here = self.key(t);
            if key == here {
                return true;
            }
            let n = &self.nodes[t as usize];
            t = if key < here { n.left } else { n.right };
        }
        false
    }

    /// Adds `start..end` as `id` (an id already present is a caller bug and is ignored).
    pub(crate) fn insert(&mut self, start: u64, end: u64, id: u64) {
        if self.contains((start, id)) {
            return;
        }
        let node = Node {
            start,
            end,
            max_end: end,
            id,
            prio: priority(id),
            left: NIL,
            right: NIL,
        };
        let n = if self.free == NIL {
            let n = Idx::try_from(self.nodes.len())
                .ok()
                .filter(|&n| n != NIL)
                .expect("an interval index holds fewer than 2^32 - 1 ranges");
            self.nodes.push(node);
            n
        } else {
            let n = self.free;
            self.free = self.nodes[n as usize].left;
            self.nodes[n as usize] = node;
            n
        };
        self.root = self.put(self.root, n);
        self.len += 1;
    }

    /// Removes the range `id` that starts at `start`; true if it was there.
    pub(crate) fn remove(&mut self, start: u64, id: u64) -> bool {
        let (root, hit) = self.take(self.root, (start, id));
        self.root = root;
        if hit == NIL {
            return false;
        }
        self.nodes[hit as usize] = Node {
            left: self.free,
            ..Node::default()
        };
        self.free = hit;
        self.len -= 1;
        true
    }

    /// The first `f(id)` that is `Some`, over the ids of ranges with `start <= lo` and
    /// `end >= hi`, in ascending `(start, id)` order.
    pub(crate) fn find_covering<T>(
        &self,
        lo: u64,
        hi: u64,
        mut f: impl FnMut(u64) -> Option<T>,
    ) -> Option<T> {
        fn visit<T>(
            nodes: &[Node],
            t: Idx,
            lo: u64,
            hi: u64,
            f: &mut impl FnMut(u64) -> Option<T>,
        ) -> Option<T> {
            if t == NIL {
                return None;
            }
            let n = &nodes[t as usize];
            if n.max_end < hi {
                return None;
            }
            if let Some(found) = visit(nodes, n.left, lo, hi, f) {
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
            visit(nodes, n.right, lo, hi, f)
        }
        visit(&self.nodes, self.root, lo, hi, &mut f)
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
            let mut oracle: Vec<(u64, u64, u64)> = Vec::new();
            let mut next = 1u64;
            for op in ops {
                match op {
                    Op::Insert(s, l) => {
                        let (s, e) = (s as u64, s as u64 + l as u64);
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
                        let (lo, hi) = (s as u64, s as u64 + l as u64);
                        let mut want: Vec<(u64, u64)> = oracle
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
            index.insert(i * 100, i * 100 + 50, i + 1);
        }
        assert!(depth(&index) <= 4 * 14, "depth {}", depth(&index));
        assert_eq!(index.find_covering(123_460, 123_470, Some), None);
        assert_eq!(index.find_covering(123_410, 123_420, Some), Some(1235));
        for i in (0..n).step_by(2) {
            assert!(index.remove(i * 100, i + 1));
        }
        assert!(depth(&index) <= 4 * 13, "depth {}", depth(&index));
        assert_eq!(index.find_covering(123_410, 123_420, Some), None);
        assert_eq!(index.find_covering(123_310, 123_320, Some), Some(1234));
    }

    fn depth(index: &IntervalIndex) -> usize {
        fn at(index: &IntervalIndex, t: Idx) -> usize {
            if t == NIL {
                return 0;
            }
            let n = &index.nodes[t as usize];
            1 + at(index, n.left).max(at(index, n.right))
        }
        at(index, index.root)
    }
}
