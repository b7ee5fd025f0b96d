//! `shm`: not yet.
