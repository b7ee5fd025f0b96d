#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod decode;
mod dtype;
mod encode;
mod error;
mod tensor;
mod value;
mod wire;

pub use decode::{decode, decode_contiguous, Decoder, Limits, Unbound};
pub use dtype::DType;
pub use encode::{encode, Encoder, DEFAULT_PACK_BELOW, MIN_RUN};
pub use error::{DecodeError, EncodeError, LayoutError, TensorError, ViewError};
pub use tensor::{Dims, Element, Tensor};
pub use value::{PathSeg, Value};
pub use wire::{
    layout, FrameList, FrameSpec, FrameTable, Frames, RecvLayout, DEFAULT_ALIGN, FLAG_RUNS, MAGIC,
    MAX_FRAME_ALIGN, VERSION,
};

/// Re-exported for the `f16` and `bf16` element types of typed views.
pub use half;
