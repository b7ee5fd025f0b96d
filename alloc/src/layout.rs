use crate::AllocError;

/// Size and power-of-two alignment of one item, in bytes.
///
/// Unlike `std::alloc::Layout` it uses `u64` throughout, because it describes ranges of registered
/// or device memory that need not live in this address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Layout {
    size: u64,
    align: u64,
}

impl Layout {
    /// A layout of `size` bytes aligned to `align`; `align` must be a power of two.
    pub const fn new(size: u64, align: u64) -> Result<Self, AllocError> {
        if !align.is_power_of_two() {
            return Err(AllocError::InvalidAlignment { align });
        }
        Ok(Self { size, align })
    }

    /// `count` elements of `elem_size` bytes aligned to `elem_align` (a tensor of one dtype).
    pub const fn array(elem_size: u64, elem_align: u64, count: u64) -> Result<Self, AllocError> {
        match elem_size.checked_mul(count) {
            Some(size) => Self::new(size, elem_align),
            None => Err(AllocError::SizeOverflow {
                size: elem_size,
                align: elem_align,
            }),
        }
    }

    /// Size in bytes.
    pub const fn size(&self) -> u64 {
        self.size
    }

    /// Alignment in bytes, a power of two.
    pub const fn align(&self) -> u64 {
        self.align
    }
}

/// Where [`pack`] puts each item of a group inside one contiguous range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packing {
    /// Offset of each item from the start of the range, aligned to the item's alignment.
    pub offsets: Vec<u64>,
    /// Bytes from the range's start to the end of its last non-empty item (no trailing padding).
    pub size: u64,
    /// The range must start at a multiple of this (the largest alignment of a non-empty item).
    pub align: u64,
    /// Sum of the item sizes, without padding.
    pub payload: u64,
}

/// Lays `items` out back to back, each at the next offset aligned to its own alignment, in O(n).
///
/// Zero-size items take the current cursor and never move it, so they add no padding wherever
/// they stand. There is no trailing padding: the size ends with the last non-empty item.
pub fn pack(items: &[Layout]) -> Result<Packing, AllocError> {
    let mut offsets = Vec::with_capacity(items.len());
    let mut cursor = 0u64;
    let mut align = 1u64;
    let mut payload = 0u64;
    for item in items {
        if item.size == 0 {
            offsets.push(cursor);
            continue;
        }
        let start = align_up(cursor, item.align).ok_or(AllocError::SizeOverflow {
            size: cursor,
            align: item.align,
        })?;
        cursor = start
            .checked_add(item.size)
            .ok_or(AllocError::SizeOverflow {
                size: item.size,
                align: item.align,
            })?;
        offsets.push(start);
        align = align.max(item.align);
        payload += item.size;
    }
    Ok(Packing {
        offsets,
        size: cursor,
        align,
        payload,
    })
}

/// `value` rounded up to a multiple of the power of two `align`, or `None` on overflow.
#[inline]
pub(crate) const fn align_up(value: u64, align: u64) -> Option<u64> {
    match value.checked_add(align - 1) {
        Some(v) => Some(v & !(align - 1)),
        None => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(size: u64, align: u64) -> Layout {
        Layout::new(size, align).unwrap()
    }

    #[test]
    fn pack_matches_per_item_alignment() {
        // int8[3], f64[2], c128[1]: 0, 8, 32 and 48 bytes, as Ray's packer lays them out.
        let p = pack(&[l(3, 1), l(16, 8), l(16, 16)]).unwrap();
        assert_eq!(p.offsets, vec![0, 8, 32]);
        assert_eq!(p.size, 48);
        assert_eq!(p.align, 16);
        assert_eq!(p.payload, 35);
    }

    #[test]
    fn zero_size_items_never_pad() {
        let p = pack(&[l(0, 16), l(12, 4), l(0, 4096), l(12, 4), l(0, 16)]).unwrap();
        assert_eq!(p.offsets, vec![0, 0, 12, 12, 24]);
        assert_eq!(p.size, 24);
        assert_eq!(p.align, 4);
        let empty = pack(&[l(0, 8), l(0, 16)]).unwrap();
        assert_eq!((empty.size, empty.align, empty.payload), (0, 1, 0));
    }

    #[test]
    fn bad_alignment_and_overflow_are_errors() {
        assert_eq!(
            Layout::new(8, 3),
            Err(AllocError::InvalidAlignment { align: 3 })
        );
        assert!(Layout::array(u64::MAX, 1, 2).is_err());
        assert!(pack(&[l(u64::MAX, 1), l(1, 1)]).is_err());
        assert!(pack(&[l(u64::MAX - 2, 1), l(1, 8)]).is_err());
    }
}
