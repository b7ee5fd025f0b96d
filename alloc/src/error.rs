use crate::Block;

/// Why an allocation was refused. Nothing was taken when one of these is returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AllocError {
    /// No free range can hold the request at its alignment (resource exhaustion).
    #[error(
        "out of memory: {requested} bytes aligned to {align} requested, \
         {free} bytes free, largest free range {largest_free} bytes"
    )]
    OutOfMemory {
        /// Bytes asked for (for a group: its packed size).
        requested: u64,
        /// Alignment asked for (for a group: its largest item alignment).
        align: u64,
        /// Free bytes in the whole allocator.
        free: u64,
        /// Size of the largest free range, before alignment.
        largest_free: u64,
    },
    /// The alignment is not a power of two (caller misuse).
    #[error("alignment {align} is not a power of two")]
    InvalidAlignment {
        /// The rejected alignment.
        align: u64,
    },
    /// Sizes and alignments add up past `u64::MAX` (caller misuse).
    #[error("size {size} with alignment {align} overflows a 64-bit offset")]
    SizeOverflow {
        /// The size that overflowed once padded.
        size: u64,
        /// The alignment it was padded to.
        align: u64,
    },
}

/// A block was handed to an allocator that did not grant it. The block comes back untouched so
/// the caller can return it to its owner: nothing is lost and nothing is corrupted.
#[derive(Debug, thiserror::Error)]
#[error("block at offset {} ({} bytes) belongs to another allocator", .block.offset(), .block.size())]
pub struct WrongAllocator {
    block: Block,
}

impl WrongAllocator {
    pub(crate) fn new(block: Block) -> Self {
        Self { block }
    }

    /// Takes the rejected block back.
    pub fn into_block(self) -> Block {
        self.block
    }
}
