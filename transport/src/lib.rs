//! Registered memory, descriptors and one-sided READ/WRITE over several backends.
//!
//! Not implemented yet: this crate reserves its place in the workspace layout.
#![cfg_attr(not(any(feature = "ucx", feature = "nixl")), forbid(unsafe_code))]

#[cfg(feature = "nixl")]
pub mod nixl;
#[cfg(feature = "ucx")]
pub mod ucx;
