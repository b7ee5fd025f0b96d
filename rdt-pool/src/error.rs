//! One error enum per operation. Caller misuse, peer misbehaviour and resource exhaustion are
//! kept apart; every variant carries its numbers.

use tessera_alloc::AllocError;
use tessera_transport::{DescError, RegionError, TransferError};

/// Why a [`SenderPool::put`](crate::SenderPool::put) failed. Nothing is left allocated for the
/// put. A re-put's id keeps its previous object, except when [`PutError::OutOfMemory`] says it
/// was released to make room, or when a copy into the previous object's own reused blocks
/// failed (then the id is left free).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PutError {
    /// The pool cannot hold the tensors that need a copy (resource exhaustion).
    #[error(
        "out of memory: {requested} bytes packed requested, {free} bytes free, \
         largest free range {largest_free} bytes{}",
        if *.previous_released { " (the object's previous blocks were released to try)" } else { "" }
    )]
    OutOfMemory {
        /// Bytes the copied tensors need, packed.
        requested: u64,
        /// Free bytes in the pool.
        free: u64,
        /// Largest free range in the pool.
        largest_free: u64,
        /// Whether the id's previous object was released to make room (a re-put); it is then
        /// gone.
        previous_released: bool,
    },
    /// A view said to be registered is not in a live registration of this pool's agent
    /// (caller misuse).
    #[error("tensor {index}: its registration is not one of this agent's")]
    NotRegisteredHere {
        /// Index of the tensor in the put.
        index: usize,
    },
    /// The allocator refused for another reason (caller misuse, such as sizes overflowing).
    #[error(transparent)]
    Alloc(AllocError),
    /// Copying into the pool failed after allocation; everything was rolled back.
    #[error("copy into the pool failed: {0}")]
    Copy(#[from] RegionError),
    /// Describing a block failed after allocation; everything was rolled back.
    #[error("describing the object failed: {0}")]
    Describe(#[from] DescError),
    /// More tensors or blocks than a descriptor may hold (caller misuse).
    #[error("{count} tensors in one object, at most {max}")]
    TooManyTensors {
        /// Tensors given.
        count: usize,
        /// The limit.
        max: usize,
    },
}

/// [`SenderPool::free`](crate::SenderPool::free) of an id the pool does not hold (caller
/// misuse).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FreeError {
    /// No live object has this id.
    #[error("no object with id {id:?}")]
    UnknownObject {
        /// The id, lossily as text.
        id: String,
    },
}

/// Why a fetch failed. Its receive blocks are free again, except after
/// [`FetchError::Timeout`], when they stay quarantined until the transfer resolves.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FetchError {
    /// The descriptor breaks a rule (peer misbehaviour); nothing was allocated or read.
    #[error(transparent)]
    Descriptor(#[from] DescriptorError),
    /// The receive pool cannot hold the object (resource exhaustion).
    #[error(
        "out of memory: {requested} bytes in {blocks} blocks requested, {free} bytes free, \
         largest free range {largest_free} bytes"
    )]
    OutOfMemory {
        /// Bytes of the object.
        requested: u64,
        /// Blocks of the object.
        blocks: usize,
        /// Free bytes in the pool.
        free: u64,
        /// Largest free range in the pool.
        largest_free: u64,
    },
    /// The allocator refused for another reason.
    #[error(transparent)]
    Alloc(AllocError),
    /// The READ failed; its blocks were released at once.
    #[error(transparent)]
    Transfer(TransferError),
    /// The READ did not finish in time. The engine may still write, so its blocks stay
    /// quarantined (see [`PoolReport::quarantined`](crate::PoolReport::quarantined)) until the
    /// transfer resolves or is torn down.
    #[error("fetch from {peer:?} timed out after {after:?}; {quarantined} bytes quarantined")]
    Timeout {
        /// The peer.
        peer: String,
        /// How long was waited.
        after: std::time::Duration,
        /// Bytes held back until the transfer resolves.
        quarantined: u64,
    },
    /// The destination buffer is smaller than the object's packed layout (caller misuse).
    #[error("destination of {len} bytes for an object of {needed} bytes")]
    DestinationTooSmall {
        /// Bytes given.
        len: u64,
        /// Bytes needed.
        needed: u64,
    },
    /// Destinations given for another number of tensors than the object has (caller misuse).
    #[error("{given} destinations for an object of {tensors} tensors")]
    Destinations {
        /// Destinations given.
        given: usize,
        /// Tensors of the object.
        tensors: usize,
    },
    /// A destination is not exactly its tensor's size (caller misuse).
    #[error("destination of tensor {tensor} is {len} bytes; the tensor has {needed}")]
    DestinationMismatch {
        /// Which tensor.
        tensor: usize,
        /// Bytes given.
        len: u64,
        /// Bytes the tensor has.
        needed: u64,
    },
    /// The fetch was polled again after it resolved (caller misuse).
    #[error("the fetch already resolved")]
    AlreadyResolved,
    /// The engine still held a receive block after the transfer resolved.
    #[error("the transfer engine still holds a receive block after completion")]
    StillHeld,
    /// A fetched tensor could not be built (a descriptor that passed validation never
    /// causes this).
    #[error(transparent)]
    Tensor(tessera_framecodec::TensorError),
    /// Building a descriptor of a receive block failed.
    #[error(transparent)]
    Desc(#[from] DescError),
}

/// A descriptor broke a rule. Raised by [`ObjectDescriptor::validate`](crate::ObjectDescriptor::validate)
/// and its decoders.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DescriptorError {
    /// Not a well-formed encoding.
    #[error("malformed descriptor: {0}")]
    Decode(String),
    /// Encoding failed.
    #[error("descriptor encoding failed: {0}")]
    Encode(String),
    /// The encoding is longer than allowed.
    #[error("encoded descriptor of {len} bytes, at most {max}")]
    TooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Too many tensors.
    #[error("{count} tensors, at most {max}")]
    TooManyTensors {
        /// Tensors named.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// Too many blocks.
    #[error("{count} blocks, at most {max}")]
    TooManyBlocks {
        /// Blocks named.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// A zero-length block.
    #[error("block {block} is empty")]
    EmptyBlock {
        /// Its index.
        block: usize,
    },
    /// A block's end overflows 64 bits.
    #[error("block {block} ends past 2^64")]
    BlockOverflow {
        /// Its index.
        block: usize,
    },
    /// A block alignment that is not a power of two or too large.
    #[error("block {block}: alignment {align} is not a power of two up to 4096")]
    BadAlign {
        /// Its index.
        block: usize,
        /// The alignment.
        align: u64,
    },
    /// A tensor of too many dimensions.
    #[error("tensor {tensor}: rank {rank}, at most {max}")]
    RankTooHigh {
        /// Its index.
        tensor: usize,
        /// Its rank.
        rank: usize,
        /// The limit.
        max: usize,
    },
    /// `dtype size × shape` overflows 64 bits.
    #[error("tensor {tensor}: byte size overflows 64 bits")]
    SizeOverflow {
        /// Its index.
        tensor: usize,
    },
    /// A tensor with bytes and no place.
    #[error("tensor {tensor} has {bytes} bytes but no place")]
    MissingPlace {
        /// Its index.
        tensor: usize,
        /// Its size.
        bytes: u64,
    },
    /// A tensor without bytes that names a place.
    #[error("tensor {tensor} has no bytes but names a place")]
    PlaceForEmpty {
        /// Its index.
        tensor: usize,
    },
    /// A place naming a block that does not exist.
    #[error("tensor {tensor} names block {block} of {blocks}")]
    UnknownBlock {
        /// Its index.
        tensor: usize,
        /// The block named.
        block: u32,
        /// Blocks in the descriptor.
        blocks: usize,
    },
    /// A tensor that does not lie inside its block.
    #[error("tensor {tensor}: {bytes} bytes at {offset} fall outside its block of {block_len}")]
    OutsideBlock {
        /// Its index.
        tensor: usize,
        /// Its offset.
        offset: u64,
        /// Its size.
        bytes: u64,
        /// The block's length.
        block_len: u64,
    },
    /// The packed layout does not fit in 64 bits.
    #[error("the object's packed layout overflows 64 bits")]
    LayoutOverflow,
}
