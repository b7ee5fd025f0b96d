//! `tcp`: not yet.
