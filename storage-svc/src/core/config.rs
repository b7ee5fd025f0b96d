//! The unit's configuration.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tessera_transport::auth::Token;

/// Configuration of the protocol core.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UnitConfig {
    /// Logical bytes the unit stores at most (payloads, strings and 8 bytes per scalar).
    #[serde(with = "crate::units::size")]
    pub capacity_bytes: u64,
    /// Payloads up to this many bytes travel inline in control messages.
    #[serde(with = "crate::units::size")]
    pub inline_max: u64,
    /// Alignment of frames in receive blocks.
    #[serde(with = "crate::units::size")]
    pub align: u64,
    /// Indexes times fields in one request, at most.
    pub max_keys: u64,
    /// Payload bytes of one PUT or GET, at most.
    #[serde(with = "crate::units::size")]
    pub max_payload_bytes: u64,
    /// Bytes of one meta frame, at most.
    #[serde(with = "crate::units::size")]
    pub max_meta_bytes: u64,
    /// Bytes of registered memory leased to prepared PUTs, at most.
    #[serde(with = "crate::units::size")]
    pub leased_limit: u64,
    /// Bytes of registered memory leased to the prepared PUTs of one session, at most (the
    /// capacity they reserve goes with them). Keep it well under `capacity_bytes` (the default
    /// is a quarter of the default capacity), so that a few sessions that prepare PUTs and
    /// never write them cannot leave others no room; a single PUT's payload cannot exceed it.
    #[serde(with = "crate::units::size")]
    pub session_leased_limit: u64,
    /// Bytes of quarantined registered memory, at most; PUTs are refused beyond it.
    #[serde(with = "crate::units::size")]
    pub quarantine_limit: u64,
    /// Bytes of quarantined registered memory of one client's agent, over its open and closed
    /// sessions, at most; its PUTs that need a block are refused beyond it (other clients'
    /// are not, and the unit's `quarantine_limit` refuses only clients holding some).
    #[serde(with = "crate::units::size")]
    pub session_quarantine_limit: u64,
    /// What a stored key costs against `capacity_bytes` besides its value: this many bytes,
    /// plus the key's length (its field name and 8 bytes of index). An empty value is not
    /// free.
    #[serde(with = "crate::units::size")]
    pub key_overhead_bytes: u64,
    /// Stored (field, index) keys, at most.
    pub max_stored_keys: u64,
    /// Keys a multi-key request (GET, CLEAR) handles per hold of the unit's shared state; the
    /// driver yields to other sessions between slices.
    pub slice_keys: u64,
    /// A prepared PUT or GET that sees no COMMIT within this time expires.
    #[serde(with = "crate::units::duration")]
    pub prepare_ttl: Duration,
    /// How long the exposed blocks of a closed session stay quarantined when the payload
    /// engine cannot tell when the client's link is torn down (`ucx`, `nixl`, `inproc`: a
    /// one-sided WRITE leaves no trace at the target). Engines that can tell (`tcp`, `shm`)
    /// hold them until the link is gone instead, however long that takes.
    #[serde(with = "crate::units::duration")]
    pub late_write_grace: Duration,
    /// Bytes of each landing block ("credit") the unit keeps ready for a session that PUTs
    /// payloads it pushes: a PUT whose frames fit one is written there and stored in one
    /// round trip (`PutCredited`), and the unused end of the block goes back to the pool.
    /// 0 turns credits off.
    #[serde(with = "crate::units::size")]
    pub credit_bytes: u64,
    /// Credits one session holds at most: how many of its PUTs may be in flight on one round
    /// trip each.
    pub session_credits: u64,
    /// Bytes of registered memory held as credits by all sessions, at most; beyond it
    /// sessions PUT through a prepared block (two round trips) instead.
    #[serde(with = "crate::units::size")]
    pub credit_limit: u64,
    /// Compact a receive block when this fraction of it is dead (0 disables compaction).
    pub compact_dead_fraction: f64,
    /// Shared secret the client must prove it holds (challenge-response; the token never
    /// travels). Read from a string in configuration files; never serialized or printed.
    #[serde(skip_serializing, deserialize_with = "token::deserialize")]
    pub token: Option<Token>,
}

mod token {
    use serde::{Deserialize, Deserializer};
    use tessera_transport::auth::Token;
    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Token>, D::Error> {
        match Option::<String>::deserialize(d)? {
            None => Ok(None),
            Some(s) => Token::new(s).map(Some).map_err(serde::de::Error::custom),
        }
    }
}

impl Default for UnitConfig {
    fn default() -> Self {
        Self {
            capacity_bytes: 1 << 30,
            inline_max: 64 << 10,
            align: 64,
            max_keys: 1 << 20,
            max_payload_bytes: 16 << 30,
            max_meta_bytes: 64 << 20,
            leased_limit: 16 << 30,
            session_leased_limit: 256 << 20,
            quarantine_limit: 1 << 30,
            session_quarantine_limit: 256 << 20,
            key_overhead_bytes: 64,
            max_stored_keys: 1 << 22,
            slice_keys: 4096,
            prepare_ttl: Duration::from_secs(30),
            late_write_grace: Duration::from_secs(30),
            credit_bytes: 4 << 20,
            session_credits: 2,
            credit_limit: 256 << 20,
            compact_dead_fraction: 0.75,
            token: None,
        }
    }
}
