//! How an engine's error reads as a [`TransferError`]: each adapter says what its error means
//! ([`Fault`]), and the transfer error is built here, the same way for both.

use std::fmt;
use std::time::Duration;

use tessera_transport::{BackendError, Side, TransferError};

/// What an engine's error means for a transfer.
#[derive(Debug)]
pub enum Fault<E> {
    /// The peer died, or the handle on it or this agent's engine is shut down; the text says
    /// which, as the engine reported it.
    PeerGone(String),
    /// The engine gave up waiting for the transfer after this long.
    Timeout(Duration),
    /// Segment `index` falls outside the remote registration the peer's key describes.
    RemoteOutOfRange {
        /// The segment's position.
        index: usize,
        /// Its remote offset.
        offset: u64,
        /// Its length.
        len: u64,
        /// The remote registration's length.
        reg_len: u64,
    },
    /// Segment `index` names a remote registration `id` the peer's handle does not know.
    UnknownRemote {
        /// The segment's position.
        index: usize,
        /// The registration id.
        id: u64,
    },
    /// Anything else: the engine's own error, reported as a backend error.
    Other(E),
}

impl<E: fmt::Display> Fault<E> {
    /// The transfer error naming `peer`, for the engine `kind`; `remote_reg` gives the remote
    /// registration of segment `index`, for range errors.
    pub fn transfer_error(
        self,
        kind: &'static str,
        peer: &str,
        remote_reg: impl Fn(usize) -> u64,
    ) -> TransferError {
        let peer = peer.to_owned();
        match self {
            Fault::PeerGone(detail) => TransferError::PeerGone { peer, detail },
            Fault::Timeout(after) => TransferError::Timeout { peer, after },
            Fault::RemoteOutOfRange {
                index,
                offset,
                len,
                reg_len,
            } => TransferError::OutOfRange {
                peer,
                side: Side::Remote,
                index,
                reg: remote_reg(index),
                offset,
                len,
                reg_len,
            },
            Fault::UnknownRemote { index, id } => TransferError::UnknownRegistration {
                peer,
                side: Side::Remote,
                index,
                reg: id,
            },
            Fault::Other(e) => TransferError::Backend {
                peer,
                source: BackendError::new(kind, e),
            },
        }
    }
}
