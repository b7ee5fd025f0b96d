//! Registered memory, descriptors and one-sided READ/WRITE over several backends.
//!
//! Not implemented yet: this crate reserves its place in the workspace layout.
#![forbid(unsafe_code)]
