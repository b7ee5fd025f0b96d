//! One error enum per operation. Each carries the numbers that explain it.

use crate::DType;

/// Why a tensor could not be built from its parts (caller misuse, or a peer's bad meta).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TensorError {
    /// More dimensions than allowed.
    #[error("tensor rank {rank} exceeds the limit of {limit}")]
    RankTooHigh {
        /// Number of dimensions.
        rank: usize,
        /// Largest rank allowed.
        limit: usize,
    },
    /// The strides do not have one entry per dimension.
    #[error("{strides} strides given for a tensor of rank {rank}")]
    StridesRank {
        /// Number of dimensions.
        rank: usize,
        /// Number of strides.
        strides: usize,
    },
    /// `dtype size × shape` (or the strided span) does not fit in 64 bits.
    #[error("the byte size of a {dtype} tensor of rank {rank} overflows 64 bits")]
    SizeOverflow {
        /// Element type.
        dtype: DType,
        /// Number of dimensions.
        rank: usize,
    },
    /// A contiguous tensor's data is not exactly `dtype size × element count` bytes.
    #[error("contiguous {dtype} tensor needs {expected} bytes of data, got {actual}")]
    DataLength {
        /// Element type.
        dtype: DType,
        /// Bytes the shape asks for.
        expected: u64,
        /// Bytes given.
        actual: u64,
    },
    /// A strided tensor's data ends before its last element.
    #[error("strided {dtype} tensor spans {span} bytes, got only {actual}")]
    DataTooShort {
        /// Element type.
        dtype: DType,
        /// Bytes from the first to past the last element.
        span: u64,
        /// Bytes given.
        actual: u64,
    },
}

/// Why a typed view, copy or row of a tensor was refused. Nothing was copied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ViewError {
    /// The requested element type is not the tensor's dtype.
    #[error("requested {requested} elements from a {actual} tensor")]
    DTypeMismatch {
        /// Dtype of the requested element type.
        requested: DType,
        /// Dtype of the tensor.
        actual: DType,
    },
    /// `as_bits` asked for an element of another width.
    #[error("requested {requested}-byte elements from a {actual} tensor ({} bytes each)", .actual.size())]
    WidthMismatch {
        /// Size of the requested element type.
        requested: usize,
        /// Dtype of the tensor.
        actual: DType,
    },
    /// The data does not start at a multiple of the element alignment in memory (for example a
    /// frame received into an unaligned buffer). `to_vec` still works.
    #[error("data at address {address:#x} is not aligned to {align} bytes")]
    Misaligned {
        /// Address of the first byte.
        address: usize,
        /// Alignment the element type needs.
        align: usize,
    },
    /// A slice view needs a contiguous tensor; this one has strides of its own.
    #[error("tensor with shape {shape:?} and strides {strides:?} is not contiguous")]
    NotContiguous {
        /// Shape of the tensor.
        shape: Vec<u64>,
        /// Its strides in elements.
        strides: Vec<u64>,
    },
    /// A `bool` tensor holds a byte other than 0 or 1.
    #[error("bool tensor holds byte {byte} at element {index}")]
    InvalidBool {
        /// Element index in the data.
        index: usize,
        /// The offending byte.
        byte: u8,
    },
    /// Rows were asked of a tensor of rank 0.
    #[error("a tensor of rank 0 has no rows")]
    NoRows,
    /// The row index is past the leading dimension.
    #[error("row {index} requested from a tensor of {rows} rows")]
    RowOutOfRange {
        /// Requested row.
        index: u64,
        /// Size of the leading dimension.
        rows: u64,
    },
    /// A copy would not fit in this address space.
    #[error("copying {bytes} bytes does not fit in this address space")]
    TooLarge {
        /// Bytes the copy would take.
        bytes: u64,
    },
}

/// Why a value could not be encoded (caller misuse: the value exceeds the encoder's limits,
/// which match what a decoder with the same limits accepts).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// Containers nest deeper than allowed.
    #[error("value nests {depth} levels deep, limit {limit}")]
    TooDeep {
        /// Depth reached.
        depth: u32,
        /// Largest depth allowed.
        limit: u32,
    },
    /// More values than allowed.
    #[error("value holds more than {limit} elements")]
    TooManyElements {
        /// Largest element count allowed.
        limit: u64,
    },
    /// More payload frames than allowed.
    #[error("value needs {count} payload frames, limit {limit}")]
    TooManyFrames {
        /// Frames needed.
        count: u64,
        /// Largest frame count allowed.
        limit: u32,
    },
    /// The payload frames add up to more bytes than allowed.
    #[error("payload frames add up to {bytes} bytes, limit {limit}")]
    TooLarge {
        /// Bytes needed (saturating).
        bytes: u64,
        /// Largest total allowed.
        limit: u64,
    },
    /// A tensor has more dimensions than allowed.
    #[error("tensor rank {rank} exceeds the limit of {limit}")]
    RankTooHigh {
        /// Number of dimensions.
        rank: usize,
        /// Largest rank allowed.
        limit: u32,
    },
    /// The meta frame would exceed its limit.
    #[error("meta frame of {bytes} bytes exceeds the limit of {limit}")]
    MetaTooLarge {
        /// Size of the meta frame.
        bytes: u64,
        /// Largest size allowed.
        limit: u64,
    },
    /// The msgpack serializer failed (it does not for the values this crate builds).
    #[error("msgpack serialization failed: {reason}")]
    Msgpack {
        /// What the serializer said.
        reason: String,
    },
}

/// Why `layout` refused (caller misuse).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    /// The requested alignment is not a power of two.
    #[error("alignment {align} is not a power of two")]
    InvalidAlignment {
        /// The rejected alignment.
        align: u64,
    },
    /// The meta frame of the `Frames` does not parse.
    #[error("meta frame does not parse: {0}")]
    Meta(Box<DecodeError>),
    /// The meta frame's table and the payload list disagree on the number of frames.
    #[error("meta frame lists {table} payload frames, {actual} given")]
    FrameCount {
        /// Frames in the meta frame's table.
        table: usize,
        /// Frames given.
        actual: usize,
    },
    /// A payload frame's length is not the one its table entry gives.
    #[error("payload frame {frame} is {actual} bytes, its table entry says {table}")]
    FrameLength {
        /// Frame index.
        frame: usize,
        /// Length in the table.
        table: u64,
        /// Length of the given frame.
        actual: u64,
    },
    /// Offsets run past `u64::MAX`.
    #[error("receive layout overflows 64 bits")]
    Overflow,
}

/// Why received frames did not decode. Peer misbehaviour and exhausted limits are told apart;
/// nothing is allocated beyond what the checked input justifies.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The meta frame ends before its header or frame table does.
    #[error("meta frame truncated: {needed} bytes needed, {available} present")]
    Truncated {
        /// Bytes needed.
        needed: u64,
        /// Bytes present.
        available: u64,
    },
    /// The meta frame does not start with the magic bytes.
    #[error("bad magic {found:02x?}, expected \"TSFC\"")]
    BadMagic {
        /// The first four bytes.
        found: [u8; 4],
    },
    /// A format version this decoder does not read.
    #[error("wire format version {version} is not supported (this decoder reads {supported})")]
    UnsupportedVersion {
        /// Version in the header.
        version: u16,
        /// Version this decoder reads.
        supported: u16,
    },
    /// Flags this decoder does not know are set.
    #[error("unknown header flags {flags:#06x}")]
    UnknownFlags {
        /// The unknown flag bits.
        flags: u16,
    },
    /// A frame table written as runs ([`crate::FLAG_RUNS`]) that does not add up: an entry
    /// repeated zero times, more entries than frames, or runs that hold another number of
    /// frames than the header says.
    #[error("frame table runs: {reason}")]
    FrameRuns {
        /// What does not add up.
        reason: String,
    },
    /// A reserved field is not zero.
    #[error("reserved field at byte {offset} of the meta frame is not zero")]
    Reserved {
        /// Byte offset of the field.
        offset: u64,
    },
    /// The meta frame is larger than allowed.
    #[error("meta frame of {bytes} bytes exceeds the limit of {limit}")]
    MetaTooLarge {
        /// Size of the meta frame.
        bytes: u64,
        /// Largest size allowed.
        limit: u64,
    },
    /// More payload frames than allowed.
    #[error("{count} payload frames exceed the limit of {limit}")]
    TooManyFrames {
        /// Frames in the table.
        count: u64,
        /// Largest count allowed.
        limit: u32,
    },
    /// The payload frames add up to more bytes than allowed, or a (broadcast) tensor's logical
    /// size exceeds the same limit.
    #[error("{bytes} payload bytes (saturating) exceed the limit of {limit}")]
    TooLarge {
        /// Total in the table or logical tensor size, saturating at `u64::MAX`.
        bytes: u64,
        /// Largest total allowed.
        limit: u64,
    },
    /// A frame table alignment is not a power of two at most 4096.
    #[error("frame {frame} has alignment {align}; a power of two up to 4096 is required")]
    FrameAlign {
        /// Frame index.
        frame: u64,
        /// Its alignment.
        align: u64,
    },
    /// A different number of payload frames than the table lists was given.
    #[error("meta frame lists {expected} payload frames, {actual} given")]
    FrameCount {
        /// Frames in the table.
        expected: u64,
        /// Frames given.
        actual: u64,
    },
    /// A payload frame's length differs from its table entry.
    #[error("payload frame {frame} is {actual} bytes, the table says {expected}")]
    FrameLength {
        /// Frame index.
        frame: u64,
        /// Length in the table.
        expected: u64,
        /// Length received.
        actual: u64,
    },
    /// The contiguous receive buffer is shorter than its layout.
    #[error("receive buffer of {available} bytes is shorter than its layout ({needed} bytes)")]
    BufferTooShort {
        /// Bytes the layout needs.
        needed: u64,
        /// Bytes in the buffer.
        available: u64,
    },
    /// The alignment given for a contiguous buffer is not a power of two.
    #[error("alignment {align} is not a power of two")]
    InvalidAlignment {
        /// The rejected alignment.
        align: u64,
    },
    /// Containers nest deeper than allowed.
    #[error("value nests deeper than the limit of {limit}")]
    TooDeep {
        /// Largest depth allowed.
        limit: u32,
    },
    /// More values than allowed.
    #[error("value holds more than {limit} elements")]
    TooManyElements {
        /// Largest element count allowed.
        limit: u64,
    },
    /// A tensor has more dimensions than allowed.
    #[error("tensor at node {node} has more than {limit} dimensions")]
    RankTooHigh {
        /// Index of the value, in depth-first order.
        node: u64,
        /// Largest rank allowed.
        limit: u32,
    },
    /// A node kind this version does not define.
    #[error("unknown node tag {tag} at node {node}")]
    UnknownTag {
        /// The tag.
        tag: u64,
        /// Index of the value, in depth-first order.
        node: u64,
    },
    /// A dtype code this version does not define.
    #[error("unknown dtype code {code} at node {node}")]
    UnknownDType {
        /// The code.
        code: u64,
        /// Index of the value, in depth-first order.
        node: u64,
    },
    /// A payload reference names a frame that does not exist.
    #[error("node {node} refers to payload frame {frame} of {frames}")]
    FrameIndex {
        /// Index of the value, in depth-first order.
        node: u64,
        /// Frame index in the reference.
        frame: u64,
        /// Number of payload frames.
        frames: u64,
    },
    /// A payload reference runs past the end of its frame.
    #[error(
        "node {node} refers to bytes {offset}..+{len} of frame {frame}, which has {frame_len}"
    )]
    OutOfBounds {
        /// Index of the value, in depth-first order.
        node: u64,
        /// Frame index.
        frame: u64,
        /// Offset in the frame.
        offset: u64,
        /// Length of the payload.
        len: u64,
        /// Length of the frame.
        frame_len: u64,
    },
    /// A tensor payload is not placed at its dtype's alignment within an aligned frame.
    #[error("node {node}: offset {offset} in frame {frame} (aligned to {frame_align}) breaks the {align}-byte alignment of its dtype")]
    Misaligned {
        /// Index of the value, in depth-first order.
        node: u64,
        /// Frame index.
        frame: u64,
        /// Offset in the frame.
        offset: u64,
        /// Alignment of the frame in the table.
        frame_align: u64,
        /// Alignment of the dtype.
        align: u64,
    },
    /// A tensor's shape, strides and payload disagree.
    #[error("tensor at node {node}: {source}")]
    Tensor {
        /// Index of the value, in depth-first order.
        node: u64,
        /// What is wrong with it.
        source: TensorError,
    },
    /// The meta body is not well-formed msgpack of the expected schema.
    #[error("malformed meta body near byte {offset}: {reason}")]
    Malformed {
        /// Byte offset in the meta frame where decoding stopped.
        offset: u64,
        /// What was wrong.
        reason: String,
    },
}
