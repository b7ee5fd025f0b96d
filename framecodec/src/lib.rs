//! Zero-copy frame codec for nested values with tensors.
//!
//! Not implemented yet: this crate reserves its place in the workspace layout.
#![forbid(unsafe_code)]
