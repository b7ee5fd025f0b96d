#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod error;
mod layout;
mod shared;
mod tlsf;

pub use error::{AllocError, WrongAllocator};
pub use layout::{pack, Layout, Packing};
pub use shared::{Lease, SharedAllocator};
pub use tlsf::{Allocator, Block, Group, Placement, Report};
