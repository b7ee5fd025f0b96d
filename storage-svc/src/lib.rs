//! PUT / GET / CLEAR storage service and client over registered memory.
//!
//! Not implemented yet: this crate reserves its place in the workspace layout.
#![forbid(unsafe_code)]
