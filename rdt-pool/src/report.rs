//! Occupancy of a pool.

/// Occupancy of a [`SenderPool`](crate::SenderPool) or [`ReceiverPool`](crate::ReceiverPool)
/// at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolReport {
    /// Bytes of registered memory the pool manages.
    pub capacity: u64,
    /// Bytes taken from the pool's allocator, for any reason.
    pub used: u64,
    /// Bytes of blocks held by live objects: a sender's put objects, or a receiver's fetched
    /// objects whose views (or any slice of them) are still alive.
    pub leased: u64,
    /// Bytes held back because a transfer whose outcome is unknown may still write them. They
    /// return by themselves when the transfer resolves or is torn down.
    pub quarantined: u64,
    /// Bytes free.
    pub free: u64,
    /// Largest free range: the largest block a single tensor could get now.
    pub largest_free: u64,
    /// Live objects.
    pub live_objects: u64,
    /// Bytes of a sender's objects described in place (registered memory outside the pool).
    pub in_place: u64,
}
