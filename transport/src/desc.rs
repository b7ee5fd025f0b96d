//! Descriptors and coalescing.
//!
//! A local descriptor is (registration, offset, length) and keeps its registration alive; a
//! remote descriptor is plain data naming a peer's registration. Coalescing works on plain
//! [`Pair`]s and is a pure function.

use std::fmt;

use crate::registry::RegEntry;
pub use crate::transfer::KeepAlive;
use tessera_sync::Arc;

/// A range of a peer's registered memory: plain data, safe to send to anyone.
///
/// The owner of the memory makes it with [`Registration::remote`](crate::Registration::remote)
/// and sends it to the peer that will read or write it (e.g. inside a control message). The
/// receiving agent checks it against the owner's metadata before a byte moves, and the owner
/// checks it again against its live registrations when the request arrives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct RemoteDesc {
    /// The registration's id in the owner's metadata.
    pub reg: u64,
    /// First byte, relative to the start of the registration.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

impl RemoteDesc {
    /// Size of [`RemoteDesc::to_bytes`]'s output.
    pub const ENCODED_LEN: usize = 24;

    /// A descriptor of `len` bytes at `offset` in registration `reg`.
    pub const fn new(reg: u64, offset: u64, len: u64) -> Self {
        Self { reg, offset, len }
    }

    /// Fixed-size little-endian encoding, for control messages.
    pub fn to_bytes(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        out[..8].copy_from_slice(&self.reg.to_le_bytes());
        out[8..16].copy_from_slice(&self.offset.to_le_bytes());
        out[16..].copy_from_slice(&self.len.to_le_bytes());
        out
    }

    /// Decodes [`RemoteDesc::to_bytes`]'s output; `None` if `bytes` has the wrong length.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != Self::ENCODED_LEN {
            return None;
        }
        let u = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().unwrap_or([0; 8]));
        Some(Self::new(u(0), u(8), u(16)))
    }

    /// One past the last byte, or `None` on overflow.
    pub fn end(&self) -> Option<u64> {
        self.offset.checked_add(self.len)
    }
}

/// A range of this agent's registered memory. It keeps its registration (and, for a pool block,
/// the block) alive, so the memory cannot be deregistered or handed out again while the
/// descriptor or a transfer using it exists.
#[derive(Clone)]
pub struct LocalDesc {
    pub(crate) reg: Arc<RegEntry>,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) keep: Option<KeepAlive>,
}

impl LocalDesc {
    /// The registration's id.
    pub fn reg(&self) -> u64 {
        self.reg.id
    }

    /// First byte, relative to the registration.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false: descriptors are never empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// This range as the peer would name it.
    pub fn to_remote(&self) -> RemoteDesc {
        RemoteDesc::new(self.reg.id, self.offset, self.len)
    }

    /// Address of the first byte in this process.
    pub fn as_ptr(&self) -> *mut u8 {
        // The range was checked against the registration when the descriptor was made.
        self.reg.base().wrapping_add(self.offset as usize)
    }
}

impl fmt::Debug for LocalDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalDesc")
            .field("reg", &self.reg.id)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

/// One end of a [`Pair`]: a registration and an offset in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Loc {
    /// Registration id.
    pub reg: u64,
    /// Offset in the registration.
    pub offset: u64,
}

/// A local range and the remote range of the same length that it is copied to or from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Pair {
    /// This agent's side.
    pub local: Loc,
    /// The peer's side.
    pub remote: Loc,
    /// Length in bytes.
    pub len: u64,
}

impl Pair {
    fn key(&self) -> (Loc, Loc) {
        (self.local, self.remote)
    }

    /// Whether `next` continues `self` on both sides.
    pub(crate) fn continued_by(&self, next: &Pair) -> bool {
        self.local.reg == next.local.reg
            && self.remote.reg == next.remote.reg
            && self.local.offset.checked_add(self.len) == Some(next.local.offset)
            && self.remote.offset.checked_add(self.len) == Some(next.remote.offset)
            && self.len.checked_add(next.len).is_some()
    }
}

/// Merges pairs that are adjacent in the same registration on both sides at once: `(L, R, n)`
/// followed by `(L + n, R + n, m)` becomes `(L, R, n + m)`.
///
/// Pure: the output moves exactly the same bytes to the same places as the input. Empty pairs
/// are dropped. The output is sorted by local then remote position; when several pairs write
/// the same destination bytes, their order is unspecified (as it is within one transfer).
/// O(n) when the input is already sorted by local then remote position, O(n log n) otherwise.
pub fn coalesce(pairs: &[Pair]) -> Vec<Pair> {
    let mut out = Vec::with_capacity(pairs.len().min(1024));
    if pairs.windows(2).all(|w| w[0].key() <= w[1].key()) {
        merge_sorted(pairs.iter().copied(), &mut out);
    } else {
        let mut sorted = pairs.to_vec();
        sorted.sort_unstable_by_key(Pair::key);
        merge_sorted(sorted.into_iter(), &mut out);
    }
    out
}

/// [`coalesce`] in place, reusing `pairs`' allocation.
pub fn coalesce_in_place(pairs: &mut Vec<Pair>) {
    if !pairs.windows(2).all(|w| w[0].key() <= w[1].key()) {
        pairs.sort_unstable_by_key(Pair::key);
    }
    let mut write = 0usize;
    for read in 0..pairs.len() {
        let p = pairs[read];
        if p.len == 0 {
            continue;
        }
        if write > 0 && pairs[write - 1].continued_by(&p) {
            pairs[write - 1].len += p.len;
        } else {
            pairs[write] = p;
            write += 1;
        }
    }
    pairs.truncate(write);
}

fn merge_sorted(pairs: impl Iterator<Item = Pair>, out: &mut Vec<Pair>) {
    for p in pairs {
        if p.len == 0 {
            continue;
        }
        match out.last_mut() {
            Some(last) if last.continued_by(&p) => last.len += p.len,
            _ => out.push(p),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn remote_descs_encode_little_endian_and_refuse_other_lengths() {
        let d = RemoteDesc::new(0x0102_0304_0506_0708, 9, u64::MAX - 1);
        let bytes = d.to_bytes();
        assert_eq!(&bytes[..8], &0x0102_0304_0506_0708u64.to_le_bytes());
        assert_eq!(&bytes[8..16], &9u64.to_le_bytes());
        assert_eq!(&bytes[16..], &(u64::MAX - 1).to_le_bytes());
        assert_eq!(RemoteDesc::from_bytes(&bytes), Some(d));
        assert_eq!(RemoteDesc::from_bytes(&bytes[..23]), None);
        assert_eq!(RemoteDesc::from_bytes(&[0; 25]), None);
        assert_eq!(RemoteDesc::from_bytes(&[]), None);
        assert_eq!(RemoteDesc::new(1, 2, 3).end(), Some(5));
        assert_eq!(RemoteDesc::new(1, u64::MAX, 1).end(), None);
    }

    fn pair(lr: u64, lo: u64, rr: u64, ro: u64, len: u64) -> Pair {
        Pair {
            local: Loc {
                reg: lr,
                offset: lo,
            },
            remote: Loc {
                reg: rr,
                offset: ro,
            },
            len,
        }
    }

    /// The naive oracle: repeatedly merge any two pairs that continue each other, in any
    /// order, until nothing changes. Quadratic and obviously right.
    fn naive(pairs: &[Pair]) -> Vec<Pair> {
        let mut v: Vec<Pair> = pairs.iter().copied().filter(|p| p.len > 0).collect();
        loop {
            let mut merged = false;
            'outer: for i in 0..v.len() {
                for j in 0..v.len() {
                    if i != j && v[i].continued_by(&v[j]) {
                        v[i].len += v[j].len;
                        v.remove(j);
                        merged = true;
                        break 'outer;
                    }
                }
            }
            if !merged {
                return v;
            }
        }
    }

    /// Every (local byte, remote byte) mapping, as a sorted multiset.
    fn bytes(pairs: &[Pair]) -> Vec<(u64, u64, u64, u64)> {
        let mut out = Vec::new();
        for p in pairs {
            for i in 0..p.len {
                out.push((
                    p.local.reg,
                    p.local.offset + i,
                    p.remote.reg,
                    p.remote.offset + i,
                ));
            }
        }
        out.sort_unstable();
        out
    }

    #[test]
    fn merges_runs_on_both_sides_only() {
        let input = [
            pair(1, 0, 9, 100, 4),
            pair(1, 4, 9, 104, 4),  // continues both sides
            pair(1, 8, 9, 200, 4),  // local continues, remote jumps
            pair(1, 12, 9, 204, 0), // empty: dropped
            pair(2, 12, 9, 204, 4), // other local registration
        ];
        let out = coalesce(&input);
        assert_eq!(
            out,
            vec![
                pair(1, 0, 9, 100, 8),
                pair(1, 8, 9, 200, 4),
                pair(2, 12, 9, 204, 4)
            ]
        );
        let mut v = input.to_vec();
        coalesce_in_place(&mut v);
        assert_eq!(v, out);
    }

    #[test]
    fn unsorted_input_is_sorted_first() {
        let input: Vec<Pair> = (0..100u64)
            .rev()
            .map(|i| pair(1, i * 8, 2, i * 8, 8))
            .collect();
        assert_eq!(coalesce(&input), vec![pair(1, 0, 2, 0, 800)]);
    }

    #[test]
    fn lengths_beyond_4gib_merge_without_truncation() {
        let input = [
            pair(1, 0, 2, 0, 3 << 30),
            pair(1, 3 << 30, 2, 3 << 30, 3 << 30),
        ];
        assert_eq!(coalesce(&input), vec![pair(1, 0, 2, 0, 6 << 30)]);
        let overflow = [
            pair(1, 0, 2, 0, u64::MAX),
            pair(1, u64::MAX, 2, u64::MAX, 1),
        ];
        assert_eq!(coalesce(&overflow).len(), 2);
    }

    fn arb_pairs() -> impl Strategy<Value = Vec<Pair>> {
        // Local ranges never overlap (as in a real transfer's sources or destinations), so the
        // minimal result is unique and the oracle can be compared exactly.
        proptest::collection::vec(
            (0u64..2, 0u64..6, 0u64..3, 0u64..2, 0u64..3, any::<bool>()),
            0..40,
        )
        .prop_map(|items| {
            let mut cursor = [0u64; 2];
            let mut out = Vec::new();
            for (lreg, gap, len, rreg, rgap, remote_follows) in items {
                let lo = cursor[lreg as usize] + if gap < 3 { 0 } else { gap };
                cursor[lreg as usize] = lo + len;
                let ro = if remote_follows { lo } else { lo * 3 + rgap };
                out.push(pair(lreg, lo, rreg, ro, len));
            }
            out
        })
        .prop_shuffle()
    }

    proptest! {
        #[test]
        fn coalesce_matches_naive_oracle(pairs in arb_pairs()) {
            let fast = coalesce(&pairs);
            let mut slow = naive(&pairs);
            slow.sort_unstable_by_key(Pair::key);
            prop_assert_eq!(bytes(&fast), bytes(&pairs));
            prop_assert_eq!(&fast, &slow);
            let mut in_place = pairs.clone();
            coalesce_in_place(&mut in_place);
            prop_assert_eq!(&in_place, &fast);
            // Idempotent, and nothing left to merge.
            prop_assert_eq!(&coalesce(&fast), &fast);
        }
    }
}
