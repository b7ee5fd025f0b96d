//! What a user configures of the UCX engine, and the errors it reports.

use std::fmt;
use std::time::Duration;
use tessera_sync::Arc;

/// Direction of a transfer, seen from the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RmaKind {
    /// Local memory to remote memory (`ucp_put_nbx`).
    Put,
    /// Remote memory to local memory (`ucp_get_nbx`).
    Get,
}

/// Which side of a transfer a descriptor is on: the crate's one [`Side`](tessera_transport::Side).
pub use tessera_transport::Side;

/// Receives notifications: `(sender name, message)`. Runs on the progress thread; keep it short.
pub type NotifyFn = Arc<dyn Fn(&str, Vec<u8>) + Send + Sync>;

/// Settings of one engine.
#[derive(Clone)]
pub struct UcxConfig {
    /// This engine's name, sent with every notification.
    pub name: String,
    /// Transports for this context (`UCX_TLS` syntax, e.g. `"tcp"`); `None` keeps the
    /// environment's choice.
    pub tls: Option<String>,
    /// Registrations larger than this are mapped in chunks of this size (rounded up to 4 KiB).
    pub max_chunk: u64,
    /// The largest notification accepted for sending.
    pub max_notification: usize,
    /// Where notifications go; `None` queues them for the raw engine's `recv_notification`
    /// (an agent's engine always sends them to the agent).
    pub on_notify: Option<NotifyFn>,
    /// Endpoints' error handling. [`ErrorHandling::Peer`] (the default) is what turns a
    /// peer's death into errors; UCX then avoids transports that cannot detect it (such as
    /// cma), which costs bandwidth: `ucx_perftest -e` shows the same drop.
    pub error_handling: ErrorHandling,
    /// After the worker last made progress, the progress thread keeps polling this long
    /// before it arms the event fd and sleeps. Zero (the default) sleeps at once; an idle
    /// engine never polls longer than this. (No gain was measurable on a loaded 2-core
    /// machine for 256 MiB puts; it is here for latency-bound workloads.)
    pub busy_poll: Duration,
}

/// How endpoints handle a peer's failure (`ucp_err_handling_mode_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ErrorHandling {
    /// `UCP_ERR_HANDLING_MODE_PEER`: a dead peer fails the pending transfers and later posts.
    #[default]
    Peer,
    /// `UCP_ERR_HANDLING_MODE_NONE`: all transports, but a dead peer's effect is undefined
    /// (transfers may hang). Only for peers whose death ends the job anyway.
    None,
}

impl UcxConfig {
    /// Defaults: environment transports, 64 GiB chunks, 64 KiB notifications, queued,
    /// peer error handling, no busy polling.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            tls: None,
            max_chunk: 64 << 30,
            max_notification: 64 << 10,
            on_notify: None,
            error_handling: ErrorHandling::Peer,
            busy_poll: Duration::ZERO,
        }
    }
}

impl fmt::Debug for UcxConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UcxConfig")
            .field("name", &self.name)
            .field("tls", &self.tls)
            .field("max_chunk", &self.max_chunk)
            .field("max_notification", &self.max_notification)
            .field("on_notify", &self.on_notify.is_some())
            .field("error_handling", &self.error_handling)
            .field("busy_poll", &self.busy_poll)
            .finish()
    }
}

/// What went wrong in the UCX engine.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UcxError {
    /// A UCP call failed; carries UCX's status code and string.
    #[error("{call} failed: {message} (status {status})")]
    Status {
        /// The UCP function.
        call: &'static str,
        /// The `ucs_status_t` value.
        status: i8,
        /// `ucs_status_string` of it.
        message: String,
    },
    /// The peer died or its endpoint failed; carries the endpoint's error.
    #[error("peer {peer:?} is gone: {message}")]
    PeerGone {
        /// The peer's name as it connected.
        peer: String,
        /// UCX's reason.
        message: String,
    },
    /// A descriptor falls outside its registration (caller misuse); nothing was posted.
    #[error("descriptor {index}: {len} bytes at offset {offset} fall outside the {side} registration of {reg_len} bytes")]
    OutOfRange {
        /// Which side.
        side: Side,
        /// The descriptor's position.
        index: usize,
        /// Its offset.
        offset: u64,
        /// Its length.
        len: u64,
        /// The registration's length.
        reg_len: u64,
    },
    /// A descriptor names a remote registration this endpoint does not know; nothing was posted.
    #[error("descriptor {index}: remote registration {id} is unknown to the endpoint of {peer:?}")]
    UnknownRemote {
        /// The peer.
        peer: String,
        /// The descriptor's position.
        index: usize,
        /// The registration id.
        id: u64,
    },
    /// A local registration of another engine was used (caller misuse).
    #[error("descriptor {index}: the local registration belongs to another engine")]
    ForeignRegistration {
        /// The descriptor's position.
        index: usize,
    },
    /// Caller misuse: empty registration, empty transfer, oversized notification.
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// An address or remote key from a peer is malformed.
    #[error("malformed {what}: {detail}")]
    Malformed {
        /// `address` or `key`.
        what: &'static str,
        /// What is wrong with it.
        detail: &'static str,
    },
    /// The engine was shut down, or the endpoint closed.
    #[error("the UCX engine {0:?} is shut down")]
    Shutdown(String),
    /// The operating system refused (eventfd, epoll, thread).
    #[error("{op} failed: {source}")]
    Os {
        /// The call.
        op: &'static str,
        /// The OS error.
        source: std::io::Error,
    },
}

impl From<tessera_onesided::Malformed> for UcxError {
    fn from(m: tessera_onesided::Malformed) -> Self {
        UcxError::Malformed {
            what: m.what,
            detail: m.detail,
        }
    }
}

impl UcxError {
    /// Whether this error means the peer is gone.
    pub fn is_peer_gone(&self) -> bool {
        matches!(self, UcxError::PeerGone { .. })
    }
}
