//! The workspace README, whose examples of each crate run here as doctests. The demo itself is
//! the `tessera-demo` binary.
#![doc = include_str!("../../README.md")]
#![forbid(unsafe_code)]
