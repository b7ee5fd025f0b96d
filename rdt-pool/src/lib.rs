#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod descriptor;
mod error;
mod receiver;
mod report;
mod sender;
mod tensor_ref;

pub use descriptor::{
    BlockDesc, ObjectDescriptor, PackedLayout, Place, TensorDesc, MAX_ALIGN, MAX_BLOCKS,
    MAX_ENCODED, MAX_TENSORS,
};
pub use error::{DescriptorError, FetchError, FreeError, PutError};
pub use receiver::{Fetch, ReceiverPool};
pub use report::PoolReport;
pub use sender::SenderPool;
pub use tensor_ref::TensorRef;
pub use tessera_framecodec::{DType, Tensor};
