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
/// ([`Response::Writing`]), for the client to decode it while the payload lands. Version 7:
/// meta frames may hold runs (framecodec's `FLAG_RUNS`), and index lists may travel as runs
/// of consecutive indexes ([`index_runs`]).
pub const PROTOCOL_VERSION: u16 = 7;

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
        #[serde(with = "index_runs")]
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
        #[serde(with = "index_runs")]
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
        #[serde(with = "index_runs")]
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
        #[serde(with = "index_runs")]
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
        #[serde(with = "index_runs")]
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

/// What [`encode_frame`] reserves up front: a 4-byte PUT's request, a GET's answer with
/// its value inline.
const SMALL_FRAME: usize = 128;

/// Encodes `body` as a length-prefixed frame.
pub fn encode_frame<T: Serialize>(id: u64, body: &T) -> Result<Vec<u8>, WireError> {
    // Room for a small message from the start: grown from the prefix alone, the buffer was
    // reallocated several times for each answer.
    let mut out = Vec::with_capacity(SMALL_FRAME);
    out.extend_from_slice(&[0u8; LEN_PREFIX]);
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
    // Decoded once where it is well formed. Only a frame that does not decode is read again,
    // loosely, for the id and version its error reports.
    let full = rmp_serde::from_slice::<Envelope<T>>(buf);
    if let Ok(env) = &full {
        if env.v != PROTOCOL_VERSION {
            return Err((env.id, WireError::Version { got: env.v }));
        }
    }
    full.map(|env| (env.id, env.body))
        .map_err(|e| loose_head(buf, e))
}

/// What a frame whose body did not decode (`e`) reports: its id and version where its head
/// is readable, the head's own error where it is not.
fn loose_head(buf: &[u8], e: rmp_serde::decode::Error) -> (u64, WireError) {
    // Anything after the head is tolerated, so a bad body still yields the id.
    #[derive(Deserialize)]
    struct Loose {
        v: u16,
        id: u64,
        #[allow(dead_code)]
        body: serde::de::IgnoredAny,
    }
    match rmp_serde::from_slice::<Loose>(buf) {
        Err(head) => (0, WireError::Decode(head)),
        Ok(l) if l.v != PROTOCOL_VERSION => (l.id, WireError::Version { got: l.v }),
        Ok(l) => (l.id, WireError::Decode(e)),
    }
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

/// A request's index list on the wire: a msgpack array of the indexes, or, where the list is
/// runs of consecutive indexes (a batch's `0..1000`), a `bin` of little-endian `(first,
/// count)` u64 pairs, one per run: 16 bytes instead of up to 9 per index, encoded and decoded
/// without a call per index. A list of runs expands to at most [`index_runs::MAX`] indexes
/// (a longer one travels as an array), so a few bytes cannot ask for more memory than that.
pub mod index_runs {
    use serde::de::{self, SeqAccess, Visitor};
    use serde::{Deserializer, Serialize, Serializer};

    /// The most indexes a list of runs expands to.
    pub const MAX: u64 = 1 << 20;

    /// Bytes of one run on the wire.
    const RUN: usize = 16;

    /// The runs of `indexes`, when they are at most an eighth as many as the indexes and add
    /// up to at most [`MAX`].
    fn runs(indexes: &[u64]) -> Option<Vec<u8>> {
        let n = indexes.len();
        if n < 16 || n as u64 > MAX {
            return None;
        }
        let mut out = Vec::with_capacity(RUN * 4);
        let (mut first, mut count) = (indexes[0], 1u64);
        for &i in &indexes[1..] {
            if first.checked_add(count) == Some(i) {
                count += 1;
                continue;
            }
            if out.len() / RUN + 1 > n / 8 {
                return None;
            }
            out.extend_from_slice(&first.to_le_bytes());
            out.extend_from_slice(&count.to_le_bytes());
            (first, count) = (i, 1);
        }
        out.extend_from_slice(&first.to_le_bytes());
        out.extend_from_slice(&count.to_le_bytes());
        Some(out)
    }

    /// Writes `indexes` as runs where that is shorter, else as an array.
    pub fn serialize<S: Serializer>(indexes: &Vec<u64>, s: S) -> Result<S::Ok, S::Error> {
        match runs(indexes) {
            Some(bytes) => s.serialize_bytes(&bytes),
            None => indexes.serialize(s),
        }
    }

    /// Reads an array of indexes or a `bin` of runs.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u64>, D::Error> {
        d.deserialize_any(Indexes)
    }

    struct Indexes;

    impl<'de> Visitor<'de> for Indexes {
        type Value = Vec<u64>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an array of indexes or a bin of (first, count) runs")
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u64>, A::Error> {
            // Reserved for no more than a few thousand at first: the array's declared length
            // is the peer's word.
            let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
            while let Some(i) = seq.next_element()? {
                out.push(i);
            }
            Ok(out)
        }

        fn visit_bytes<E: de::Error>(self, b: &[u8]) -> Result<Vec<u64>, E> {
            if b.len() % RUN != 0 {
                return Err(E::custom(format!(
                    "index runs of {} bytes: 16 per run expected",
                    b.len()
                )));
            }
            let pair = |c: &[u8]| {
                let word = |at: usize| {
                    let mut w = [0u8; 8];
                    w.copy_from_slice(&c[at..at + 8]);
                    u64::from_le_bytes(w)
                };
                (word(0), word(8))
            };
            // Checked in full before anything is reserved for them.
            let mut total = 0u64;
            for (first, count) in b.chunks_exact(RUN).map(pair) {
                if count == 0 || first.checked_add(count - 1).is_none() {
                    return Err(E::custom(format!(
                        "index run of {count} from {first} is empty or passes u64::MAX"
                    )));
                }
                total = total.saturating_add(count);
            }
            if total > MAX {
                return Err(E::custom(format!(
                    "index runs of {total} indexes: at most {MAX} travel as runs"
                )));
            }
            let mut out = Vec::with_capacity(total as usize);
            for (first, count) in b.chunks_exact(RUN).map(pair) {
                out.extend(first..=first + (count - 1));
            }
            Ok(out)
        }

        fn visit_byte_buf<E: de::Error>(self, b: Vec<u8>) -> Result<Vec<u64>, E> {
            self.visit_bytes(&b)
        }
    }
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
        // A body this version cannot read: the version is what is reported, with the id.
        let other = |v: u16| Envelope {
            v,
            id: 4,
            body: ("not", "a request"),
        };
        let buf = rmp_serde::to_vec(&other(9)).unwrap();
        let err = decode_body::<Request>(&buf).unwrap_err();
        assert_eq!(err.0, 4);
        assert!(matches!(err.1, WireError::Version { got: 9 }));
        // This version with a bad body: a decode error that still names the request.
        let buf = rmp_serde::to_vec(&other(PROTOCOL_VERSION)).unwrap();
        let err = decode_body::<Request>(&buf).unwrap_err();
        assert_eq!(err.0, 4);
        assert!(matches!(err.1, WireError::Decode(_)));
        // No readable head at all.
        let err = decode_body::<Request>(&[0xc1, 0x00]).unwrap_err();
        assert_eq!(err.0, 0);
        assert!(matches!(err.1, WireError::Decode(_)));
    }

    fn get_of(indexes: Vec<u64>) -> Request {
        Request::Get {
            partition: "p".into(),
            indexes,
            fields: vec!["a".into()],
        }
    }

    /// Lists of long runs of consecutive indexes travel as 16 bytes a run, others as arrays;
    /// both come back as they were.
    #[test]
    fn index_lists_travel_as_runs_where_shorter() {
        let batch: Vec<u64> = (1000..2000).collect();
        let mut two: Vec<u64> = (0..500).collect();
        two.extend(u64::MAX - 499..=u64::MAX);
        let scattered: Vec<u64> = (0..1000).map(|i| i * 3).collect();
        let short: Vec<u64> = (0..15).collect();
        for (indexes, runs) in [
            (batch, true),
            (two, true),
            (scattered, false),
            (short, false),
        ] {
            let req = get_of(indexes.clone());
            let buf = encode_frame(1, &req).unwrap();
            let plain = indexes
                .iter()
                .map(|&i| rmp_serde::to_vec(&i).unwrap().len())
                .sum::<usize>();
            if runs {
                assert!(buf.len() < 100, "{} bytes", buf.len());
            } else {
                assert!(
                    buf.len() > plain,
                    "{} bytes for {plain} of indexes",
                    buf.len()
                );
            }
            assert_eq!(decode_body::<Request>(&buf[4..]).unwrap(), (1, req));
        }
    }

    /// Runs that are empty, pass `u64::MAX`, are cut short or expand past `index_runs::MAX`
    /// are refused as decode errors, before anything is reserved for them.
    #[test]
    fn lying_index_runs_are_refused() {
        let runs = |pairs: &[(u64, u64)], extra: usize| {
            let mut b: Vec<u8> = pairs
                .iter()
                .flat_map(|(f, c)| f.to_le_bytes().into_iter().chain(c.to_le_bytes()))
                .collect();
            b.extend(std::iter::repeat_n(0u8, extra));
            #[derive(Serialize)]
            struct Get<'a> {
                partition: &'a str,
                indexes: ByteBuf,
                fields: Vec<String>,
            }
            #[derive(Serialize)]
            enum Body<'a> {
                Get(Get<'a>),
            }
            let env = Envelope {
                v: PROTOCOL_VERSION,
                id: 5,
                body: Body::Get(Get {
                    partition: "p",
                    indexes: ByteBuf::from(b),
                    fields: vec!["a".into()],
                }),
            };
            rmp_serde::to_vec_named(&env).unwrap()
        };
        let ok = runs(&[(7, 3)], 0);
        assert_eq!(
            decode_body::<Request>(&ok).unwrap(),
            (5, get_of(vec![7, 8, 9]))
        );
        for bad in [
            runs(&[(7, 0)], 0),
            runs(&[(u64::MAX, 2)], 0),
            runs(&[(7, 3)], 5),
            runs(&[(0, index_runs::MAX), (u64::MAX - 1, 1)], 0),
            runs(&[(0, u64::MAX / 2), (0, u64::MAX / 2)], 0),
        ] {
            let (id, e) = decode_body::<Request>(&bad).unwrap_err();
            assert_eq!(id, 5);
            assert!(matches!(e, WireError::Decode(_)), "{e}");
        }
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
