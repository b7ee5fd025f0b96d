//! [`Ring`]: the last few values of something, kept to learn from (a GET shape's sizes, how
//! long answers or a session's pauses took).

/// The last `N` values recorded, in a ring (`None`: not yet).
pub(crate) struct Ring<T, const N: usize> {
    items: [Option<T>; N],
    next: usize,
}

impl<T: Copy, const N: usize> Default for Ring<T, N> {
    fn default() -> Self {
        Self {
            items: [None; N],
            next: 0,
        }
    }
}

impl<T: Copy, const N: usize> Ring<T, N> {
    /// Records `value` in place of the oldest once `N` are held.
    pub(crate) fn record(&mut self, value: T) {
        self.items[self.next] = Some(value);
        self.next = (self.next + 1) % N;
    }

    /// The values held, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = T> + '_ {
        self.items.iter().flatten().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::Ring;

    #[test]
    fn a_ring_keeps_the_last_n_values() {
        let mut r = Ring::<u32, 3>::default();
        assert_eq!(r.iter().count(), 0);
        for v in 1..=4 {
            r.record(v);
        }
        let mut held: Vec<u32> = r.iter().collect();
        held.sort_unstable();
        assert_eq!(held, [2, 3, 4]);
    }
}
