//! Sender and receiver tensor pools over registered memory.
//!
//! Not implemented yet: this crate reserves its place in the workspace layout.
#![forbid(unsafe_code)]
