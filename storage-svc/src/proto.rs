//! Control-plane messages and their framing: a 4-byte little-endian length, then a msgpack
//! envelope `{v, id, body}`. Pure functions; the tokio layer only moves the bytes.

use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;
use tessera_framecodec::RecvLayout;
use tessera_transport::RemoteDesc;

use crate::error::{ErrorKind, MemoryError, WireError};

/// Protocol version carried by every envelope. Version 2: a PUT may carry the sources of its
/// payload for the unit to READ ([`Request::Put::pull`]). Version 4: the session opens with a
/// challenge-response (`Hello`, `Challenge`, `Auth`, `Welcome`); the token never travels.
/// Version 5: credits, landing blocks kept ready for a session ([`Response::Stored`],
/// [`Request::PutCredited`]): a PUT that fits one takes one round trip; a GET may offer its
/// receive block up front ([`Request::GetOffer`], [`Response::Written`]), one round trip too.
/// Version 6: a GET written into its offered block may have its meta sent ahead of the WRITE
/// ([`Response::Writing`]), for the client to decode it while the payload lands.
pub const PROTOCOL_VERSION: u16 = 6;

/// Label of the unit's proof in [`Response::Challenge`].
pub const UNIT_PROOF: &str = "tessera-storage-unit-v4";
/// Label of the client's proof in [`Request::Auth`].
pub const CLIENT_PROOF: &str = "tessera-storage-client-v4";

/// Bytes of the length prefix.
pub const LEN_PREFIX: usize = 4;

/// Bytes each end of a control connection reads at once: a small message and its prefix
/// (and often those pipelined behind it) in one read; a larger body past what is buffered
/// goes straight into its own buffer.
pub(crate) const READ_BUFFER: usize = 16 << 10;

/// A request, client to unit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Request {
    /// First message of a session: a fresh client nonce and the client's transport metadata
    /// (so the unit can WRITE into the client's receive blocks once the session is open). The
    /// unit answers [`Response::Challenge`]; nothing of the unit's is shown before [`Request::Auth`]
    /// proved the client holds the token.
    Hello {
        /// The client's fresh nonce (`tessera_transport::auth::NONCE_LEN` bytes).
        nonce: ByteBuf,
        /// The client's agent metadata (`Agent::metadata`).
        #[serde(with = "serde_bytes")]
        agent: Vec<u8>,
    },
    /// Second message of a session: the client's proof ([`CLIENT_PROOF`] over the client's
    /// nonce, the unit's nonce and the client's agent metadata) that it holds the token.
    Auth {
        /// HMAC-SHA256 (`tessera_transport::auth::prove`).
        proof: ByteBuf,
    },
    /// Store `values` (a framecodec list of one list per field, one value per index).
    Put {
        /// Partition.
        partition: String,
        /// Global indexes, in the order of each field's list.
        indexes: Vec<u64>,
        /// Field names.
        fields: Vec<String>,
        /// The framecodec meta frame.
        meta: ByteBuf,
        /// The payload frames when they travel inline; `None` asks for a receive block.
        inline: Option<Vec<ByteBuf>>,
        /// Over the one-sided engines (see `Backend::pulls_puts`): where the unit READs the
        /// payload frames from, instead of answering `PutReady` for the client to WRITE.
        /// The client keeps the frames registered until the unit answered.
        #[serde(default)]
        pull: Option<PullSource>,
    },
    /// Store `values` whose payload the client WRITEs into credit `credit` (a landing block
    /// of this session, [`Credit`]), laid out from `meta` at the block's start as for
    /// `PutReady`: a PUT in one round trip. The client may send it before its WRITE is done:
    /// the unit waits (up to its transfer timeout) until the frames are recorded as written,
    /// and refuses the PUT if they are not. It uses the credit up, whatever the answer.
    PutCredited {
        /// Partition.
        partition: String,
        /// Global indexes, in the order of each field's list.
        indexes: Vec<u64>,
        /// Field names.
        fields: Vec<String>,
        /// The framecodec meta frame.
        meta: ByteBuf,
        /// The credit written.
        credit: u64,
        /// Bytes of the non-empty payload frames: the unit waits (briefly) to see that many
        /// recorded as written before it checks every frame landed.
        bytes: u64,
    },
    /// The payload of the PUT prepared under this request id has been written.
    Commit {
        /// Request id of the PUT.
        put: u64,
    },
    /// Abandon a prepared PUT or GET.
    Cancel {
        /// Request id of the PUT or GET.
        of: u64,
        /// Whether a WRITE into the exposed block may have started (then it is quarantined).
        maybe_written: bool,
    },
    /// Read values, returned as one list per field in the requested order.
    Get {
        /// Partition.
        partition: String,
        /// Global indexes.
        indexes: Vec<u64>,
        /// Field names.
        fields: Vec<String>,
    },
    /// A GET that offers a block of the client's receive pool up front: when the values go
    /// through the payload plane and, laid out from their meta at the block's start, fit in
    /// it, the unit WRITEs them there and answers [`Response::Written`] (one round trip), or,
    /// for a large meta, [`Response::Writing`] as the WRITE starts and `GetDone` once it is done;
    /// otherwise it answers as to a GET (`Values`, or `GetReady` for a block of the right
    /// size, and the offered one is not touched).
    GetOffer {
        /// Partition.
        partition: String,
        /// Global indexes.
        indexes: Vec<u64>,
        /// Field names.
        fields: Vec<String>,
        /// The offered block.
        block: RemoteDesc,
    },
    /// The client's receive block for the GET prepared under this request id.
    GetInto {
        /// Request id of the GET.
        get: u64,
        /// The whole receive block, laid out from the GET's meta (see [`frame_descs`]).
        block: RemoteDesc,
    },
    /// Remove indexes (all fields, or only `fields`). Idempotent.
    Clear {
        /// Partition.
        partition: String,
        /// Global indexes.
        indexes: Vec<u64>,
        /// Only these fields; all when `None`.
        fields: Option<Vec<String>>,
    },
    /// Remove a partition. Idempotent.
    DropPartition {
        /// Partition.
        partition: String,
    },
    /// Report keys, bytes and memory.
    Stats,
}

/// The client's payload frames of a pulled PUT.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PullSource {
    /// One descriptor per payload frame, in the client's registrations (empty frames get a
    /// zero-length descriptor).
    pub descs: Vec<RemoteDesc>,
    /// The client's agent metadata, naming the registrations the descriptors point into.
    pub agent: ByteBuf,
}

/// A landing block the unit keeps ready for one session (see [`Response::Stored`]): the
/// session may WRITE a PUT's frames into it, laid out from the meta at its start with the
/// unit's alignment, then name it in [`Request::PutCredited`]. Each credit serves one PUT.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Credit {
    /// Names it in `PutCredited`.
    pub id: u64,
    /// The whole block.
    pub block: RemoteDesc,
}

/// A response, unit to client, carrying the id of the request it answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Response {
    /// The answer to `Hello`: the unit's fresh nonce and its proof ([`UNIT_PROOF`] over the
    /// client's nonce, the unit's nonce and the client's agent metadata) that it holds the
    /// token. The client checks it before it sends its own proof ([`Request::Auth`]).
    Challenge {
        /// The unit's fresh nonce.
        nonce: ByteBuf,
        /// HMAC-SHA256 (`tessera_transport::auth::prove`).
        proof: ByteBuf,
    },
    /// Session accepted (the answer to `Auth`).
    Welcome {
        /// The unit's agent metadata.
        #[serde(with = "serde_bytes")]
        agent: Vec<u8>,
        /// The unit's backend kind (`"shm"`, `"tcp"`, ...).
        backend: String,
        /// Payloads up to this many bytes may travel inline.
        inline_max: u64,
        /// Receive-block alignment the unit lays frames out with.
        align: u64,
    },
    /// A PUT's receive block is leased: WRITE frame `i` to `descs[i]`, then COMMIT.
    PutReady {
        /// The whole receive block, laid out from the PUT's meta (see [`frame_descs`]).
        block: RemoteDesc,
        /// The unit's agent metadata, when its registered memory changed since this session
        /// last got it (a new chunk the descriptors may point into): add it as the peer's
        /// metadata before writing.
        #[serde(default)]
        agent: Option<ByteBuf>,
    },
    /// A request that changes nothing else completed.
    Done,
    /// A pushed PUT is stored (the answer to `Commit` or `PutCredited`), with new credits
    /// for the session (possibly none): it holds up to the unit's `session_credits`.
    Stored {
        /// Landing blocks for the session's next PUTs.
        credits: Vec<Credit>,
        /// The unit's agent metadata, when its registered memory changed since this session
        /// last got it (a credit may lie in a new chunk): add it before writing.
        #[serde(default)]
        agent: Option<ByteBuf>,
    },
    /// A GET's values inline.
    Values {
        /// Meta frame.
        meta: ByteBuf,
        /// Payload frames.
        frames: Vec<ByteBuf>,
    },
    /// A GET too large to inline: lease a block laid out from `meta`, then send `GetInto`.
    GetReady {
        /// Meta frame.
        meta: ByteBuf,
    },
    /// The payload of a GET has been written into the client's block.
    GetDone,
    /// A `GetOffer`'s values were written into the block it offered, laid out from `meta`.
    Written {
        /// Meta frame.
        meta: ByteBuf,
    },
    /// Statistics.
    Stats(crate::Stats),
    /// The request failed.
    Error(crate::RemoteError),
    /// A `GetOffer`'s values are being written into the block it offered, laid out from
    /// `meta`: the request's next answer, `GetDone` (or the WRITE's failure), says they
    /// landed. Sent ahead of the WRITE when `meta` is large
    /// ([`EARLY_META_BYTES`](crate::core::EARLY_META_BYTES)), so that the client decodes it
    /// meanwhile; a smaller meta comes with the answer, [`Response::Written`].
    Writing {
        /// Meta frame.
        meta: ByteBuf,
    },
}

/// A message on the wire.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope<T> {
    /// Protocol version.
    pub v: u16,
    /// Request id (responses carry the id of their request).
    pub id: u64,
    /// The message.
    pub body: T,
}

/// Encodes `body` as a length-prefixed frame.
pub fn encode_frame<T: Serialize>(id: u64, body: &T) -> Result<Vec<u8>, WireError> {
    let mut out = vec![0u8; LEN_PREFIX];
    let env = Envelope {
        v: PROTOCOL_VERSION,
        id,
        body,
    };
    rmp_serde::encode::write(&mut out, &env).map_err(WireError::Encode)?;
    let len = u32::try_from(out.len() - LEN_PREFIX).map_err(|_| WireError::TooLarge {
        len: out.len() as u64,
        max: u32::MAX as u64,
    })?;
    out[..LEN_PREFIX].copy_from_slice(&len.to_le_bytes());
    Ok(out)
}

/// Reads a length prefix and checks it against `max` before anything is allocated for it.
pub fn frame_len(prefix: [u8; LEN_PREFIX], max: u64) -> Result<usize, WireError> {
    let len = u32::from_le_bytes(prefix) as u64;
    if len > max {
        return Err(WireError::TooLarge { len, max });
    }
    Ok(len as usize)
}

/// Decodes one frame body (without its prefix). The id is recovered whenever the envelope
/// parses that far, so an error can still name the request.
pub fn decode_body<T: for<'de> Deserialize<'de>>(buf: &[u8]) -> Result<(u64, T), (u64, WireError)> {
    #[derive(Deserialize)]
    struct Head {
        v: u16,
        id: u64,
    }
    // Tolerate anything after the head, so a bad body still yields the id.
    #[derive(Deserialize)]
    struct Loose {
        v: u16,
        id: u64,
        #[allow(dead_code)]
        body: serde::de::IgnoredAny,
    }
    let head = rmp_serde::from_slice::<Loose>(buf)
        .map(|l| Head { v: l.v, id: l.id })
        .map_err(|e| (0, WireError::Decode(e)))?;
    if head.v != PROTOCOL_VERSION {
        return Err((head.id, WireError::Version { got: head.v }));
    }
    let env: Envelope<T> =
        rmp_serde::from_slice(buf).map_err(|e| (head.id, WireError::Decode(e)))?;
    Ok((env.id, env.body))
}

/// What both proofs of a session's handshake cover, in order: the client's nonce, the unit's
/// nonce, the client's agent metadata.
pub fn handshake_parts<'a>(client: &'a [u8], unit: &'a [u8], agent: &'a [u8]) -> [&'a [u8]; 3] {
    [client, unit, agent]
}

impl Response {
    /// An error response.
    pub fn error(kind: ErrorKind, message: impl Into<String>) -> Self {
        Response::Error(crate::RemoteError {
            kind,
            message: message.into(),
            missing: Vec::new(),
        })
    }
}

/// Where each non-empty payload frame goes in a receive block: frame `i` at
/// `block.offset + layout.offsets[i]`, where `layout` is what framecodec computes from the
/// meta with the unit's alignment (HELLO's `align`). Both ends compute it, so the block
/// travels as one descriptor however many frames it holds. A block shorter than the layout
/// is an error.
pub fn frame_descs(
    block: &RemoteDesc,
    layout: &RecvLayout,
) -> Result<Vec<RemoteDesc>, MemoryError> {
    if block.len < layout.size {
        return Err(MemoryError::BlockTooSmall {
            len: block.len,
            need: layout.size,
        });
    }
    if block.offset.checked_add(layout.size).is_none() {
        return Err(MemoryError::BlockOverflow);
    }
    // Every frame ends within `layout.size`, so no offset below overflows.
    Ok(layout
        .offsets
        .iter()
        .zip(&layout.lens)
        .filter(|(_, len)| **len > 0)
        .map(|(off, len)| RemoteDesc::new(block.reg, block.offset + off, *len))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let req = Request::Get {
            partition: "p".into(),
            indexes: vec![1, 2],
            fields: vec!["a".into()],
        };
        let buf = encode_frame(7, &req).unwrap();
        let len = frame_len(buf[..4].try_into().unwrap(), 1 << 20).unwrap();
        assert_eq!(len, buf.len() - 4);
        let (id, back) = decode_body::<Request>(&buf[4..]).unwrap();
        assert_eq!((id, back), (7, req));
    }

    #[test]
    fn oversized_and_bad_version() {
        assert!(frame_len(100u32.to_le_bytes(), 99).is_err());
        assert_eq!(
            frame_len(100u32.to_le_bytes(), 100).unwrap(),
            100,
            "max is inclusive"
        );
        let env = Envelope {
            v: 9,
            id: 3,
            body: Request::Stats,
        };
        let buf = rmp_serde::to_vec(&env).unwrap();
        let err = decode_body::<Request>(&buf).unwrap_err();
        assert_eq!(err.0, 3);
        assert!(matches!(err.1, WireError::Version { got: 9 }));
    }

    /// Frames land at the block's offset plus the layout's; empty frames get nothing; a
    /// block shorter than the layout or one whose end overflows is refused.
    #[test]
    fn frame_descs_follow_the_layout() {
        let layout = RecvLayout {
            offsets: vec![0, 64, 64, 128],
            lens: vec![10, 0, 50, 8],
            size: 136,
            align: 64,
        };
        let block = RemoteDesc::new(3, 1000, 136);
        assert_eq!(
            frame_descs(&block, &layout).unwrap(),
            vec![
                RemoteDesc::new(3, 1000, 10),
                RemoteDesc::new(3, 1064, 50),
                RemoteDesc::new(3, 1128, 8),
            ]
        );
        assert!(frame_descs(&RemoteDesc::new(3, 1000, 135), &layout).is_err());
        assert!(frame_descs(&RemoteDesc::new(3, u64::MAX - 100, 136), &layout).is_err());
    }
}
