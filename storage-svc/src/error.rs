//! Errors: what the unit answers ([`RemoteError`]), what framing reports ([`WireError`]) and
//! what the client returns ([`ClientError`]).

use serde::{Deserialize, Serialize};

/// What went wrong, as the unit reports it. Caller misuse, peer misbehaviour and resource
/// exhaustion are kept apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Keys asked for are not stored (`RemoteError::missing` names them).
    Missing,
    /// The request is malformed or inconsistent (caller misuse).
    BadRequest,
    /// The message could not be decoded or is of another protocol version.
    Protocol,
    /// A size exceeds a configured maximum.
    TooLarge,
    /// Storing this would exceed the unit's byte capacity; nothing was stored.
    Capacity,
    /// The unit's registered memory (or its leased / quarantined limit) is exhausted.
    OutOfMemory,
    /// The token is missing or wrong.
    Unauthorized,
    /// The session must say Hello first.
    NoSession,
    /// The session failed earlier (a transfer outcome is unknown); reconnect as a new session.
    PeerFailed,
    /// No prepared PUT or GET has this id (expired, cancelled or never made).
    UnknownTransfer,
    /// A payload transfer failed.
    Transfer,
    /// The unit is shutting down.
    ShuttingDown,
    /// A queue of the unit for this client is full (its transfer queue); nothing was done.
    /// Retry later.
    Busy,
    /// The unit failed while handling the request (a bug, isolated to the session): the
    /// session is closed and what it held released; other sessions carry on. Reconnect.
    Internal,
}

impl ErrorKind {
    /// A short stable name, used as a metrics label.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Missing => "missing",
            ErrorKind::BadRequest => "bad_request",
            ErrorKind::Protocol => "protocol",
            ErrorKind::TooLarge => "too_large",
            ErrorKind::Capacity => "capacity",
            ErrorKind::OutOfMemory => "out_of_memory",
            ErrorKind::Unauthorized => "unauthorized",
            ErrorKind::NoSession => "no_session",
            ErrorKind::PeerFailed => "peer_failed",
            ErrorKind::UnknownTransfer => "unknown_transfer",
            ErrorKind::Transfer => "transfer",
            ErrorKind::ShuttingDown => "shutting_down",
            ErrorKind::Internal => "internal",
            ErrorKind::Busy => "busy",
        }
    }
}

/// An error answered by a unit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{}: {message}", kind.as_str())]
pub struct RemoteError {
    /// What kind of failure.
    pub kind: ErrorKind,
    /// Human-readable detail.
    pub message: String,
    /// For [`ErrorKind::Missing`]: the `(field, index)` keys not stored.
    pub missing: Vec<(String, u64)>,
}

/// Framing and message decoding errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// A frame is longer than the configured maximum.
    #[error("message of {len} bytes exceeds the maximum of {max}")]
    TooLarge {
        /// Announced length.
        len: u64,
        /// Configured maximum.
        max: u64,
    },
    /// Another protocol version.
    #[error("protocol version {got} is not supported")]
    Version {
        /// The version received.
        got: u16,
    },
    /// The bytes are not a valid message.
    #[error("malformed message: {0}")]
    Decode(String),
    /// A message could not be encoded.
    #[error("cannot encode message: {0}")]
    Encode(String),
}

/// Errors of the client API.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The unit answered with an error.
    #[error("unit {unit}: {source}")]
    Remote {
        /// Which unit.
        unit: usize,
        /// Its answer.
        #[source]
        source: RemoteError,
    },
    /// The control connection failed.
    #[error("connection to unit {unit}: {source}")]
    Io {
        /// Which unit.
        unit: usize,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A message was malformed.
    #[error("unit {unit}: {source}")]
    Wire {
        /// Which unit.
        unit: usize,
        /// The error.
        #[source]
        source: WireError,
    },
    /// The unit answered something the protocol does not allow here.
    #[error("unit {unit}: unexpected response {what}")]
    Unexpected {
        /// Which unit.
        unit: usize,
        /// What came.
        what: String,
    },
    /// A payload transfer or the client's transport failed. The outcome of the operation is
    /// unknown and it is not retried.
    #[error("unit {unit}: transport: {message}")]
    Transport {
        /// Which unit.
        unit: usize,
        /// Detail.
        message: String,
    },
    /// Encoding or decoding values failed.
    #[error("codec: {0}")]
    Codec(String),
    /// The caller passed inconsistent arguments.
    #[error("misuse: {0}")]
    ApiMisuse(String),
    /// The client's receive pool cannot hold the values requested.
    #[error("client receive pool: {0}")]
    OutOfMemory(String),
    /// The unit did not answer within the client's timeout; the outcome is unknown and the
    /// request is not retried.
    #[error("unit {unit}: no answer within {after:?}")]
    Timeout {
        /// Which unit.
        unit: usize,
        /// The timeout that passed.
        after: std::time::Duration,
    },
}

/// A name that is no [`Backend`](crate::Backend)'s (`Backend::from_str`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown backend `{name}`; expected one of inproc, shm, tcp, ucx, nixl")]
pub struct ParseBackendError {
    /// The name given.
    pub name: String,
}

impl ClientError {
    /// The unit's error kind, if the unit answered with an error.
    pub fn kind(&self) -> Option<ErrorKind> {
        match self {
            ClientError::Remote { source, .. } => Some(source.kind),
            _ => None,
        }
    }
}
