//! Value -> meta frame + payload frames.

use std::cell::Cell;

use bytes::Bytes;
use serde::ser::{SerializeMap, SerializeSeq, SerializeTuple, Serializer};
use serde::Serialize;
use tessera_alloc::{pack, Layout};

use crate::wire::{write_header, FrameSpec, ENTRY_LEN, HEADER_LEN};
use crate::{EncodeError, FrameList, Frames, Limits, Tensor, Value};

/// Payloads shorter than this many bytes are packed into the shared frame by default.
pub const DEFAULT_PACK_BELOW: usize = 4096;

/// Node tags of the meta body (see `WIRE.md`).
pub(crate) mod tag {
    pub(crate) const NULL: u8 = 0;
    pub(crate) const BOOL: u8 = 1;
    pub(crate) const I64: u8 = 2;
    pub(crate) const U64: u8 = 3;
    pub(crate) const F64: u8 = 4;
    pub(crate) const STR: u8 = 5;
    pub(crate) const BYTES: u8 = 6;
    pub(crate) const LIST: u8 = 7;
    pub(crate) const MAP: u8 = 8;
    pub(crate) const TENSOR: u8 = 9;
}

/// Encodes values with a packing threshold and limits.
///
/// The limits are the decoder's: a value this encoder accepts is one a decoder with the same
/// [`Limits`] accepts.
#[derive(Debug, Clone)]
pub struct Encoder {
    pack_below: usize,
    limits: Limits,
}

impl Default for Encoder {
    fn default() -> Self {
        Self::new()
    }
}

/// Where one payload went: frame, offset inside it, length.
type Ref = Option<(u32, u64, u64)>;

struct SmallItem {
    slot: usize,
    data: Bytes,
}

struct Walk<'v> {
    limits: &'v Limits,
    pack_below: usize,
    nodes: u64,
    refs: Vec<Ref>,
    frames: FrameList,
    specs: Vec<FrameSpec>,
    small: Vec<SmallItem>,
    small_layouts: Vec<Layout>,
}

impl Encoder {
    /// An encoder with [`DEFAULT_PACK_BELOW`] and [`Limits::default`].
    pub fn new() -> Self {
        Self {
            pack_below: DEFAULT_PACK_BELOW,
            limits: Limits::default(),
        }
    }

    /// Packs payloads shorter than `bytes` into one shared frame (0 packs nothing). Packing
    /// copies those payloads once; everything at or above the threshold travels as is.
    pub fn pack_below(mut self, bytes: usize) -> Self {
        self.pack_below = bytes;
        self
    }

    /// Refuses values beyond `limits`.
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Encodes `value`. Payloads at or above the packing threshold become frames that are the
    /// caller's own `Bytes` (a reference count, no copy); smaller ones are copied into one shared
    /// frame, each at its dtype's alignment; empty ones need no frame at all.
    pub fn encode(&self, value: &Value) -> Result<Frames, EncodeError> {
        let mut walk = Walk {
            limits: &self.limits,
            pack_below: self.pack_below,
            nodes: 0,
            refs: Vec::new(),
            frames: FrameList::new(),
            specs: Vec::new(),
            small: Vec::new(),
            small_layouts: Vec::new(),
        };
        walk.visit(value, 1)?;
        walk.pack_small()?;
        let count = walk.frames.len() as u64;
        if count > u64::from(self.limits.max_frames) {
            return Err(EncodeError::TooManyFrames {
                count,
                limit: self.limits.max_frames,
            });
        }
        let total = walk
            .specs
            .iter()
            .fold(0u64, |acc, s| acc.saturating_add(s.len));
        if total > self.limits.max_total_bytes {
            return Err(EncodeError::TooLarge {
                bytes: total,
                limit: self.limits.max_total_bytes,
            });
        }
        let mut meta = Vec::with_capacity(HEADER_LEN + ENTRY_LEN * walk.specs.len() + 64);
        write_header(&mut meta, &walk.specs);
        let next = Cell::new(0);
        let node = Node {
            value,
            refs: &walk.refs,
            next: &next,
        };
        rmp_serde::encode::write(&mut meta, &node).map_err(|e| EncodeError::Msgpack {
            reason: e.to_string(),
        })?;
        if meta.len() as u64 > self.limits.max_meta_bytes {
            return Err(EncodeError::MetaTooLarge {
                bytes: meta.len() as u64,
                limit: self.limits.max_meta_bytes,
            });
        }
        Ok(Frames {
            meta: Bytes::from(meta),
            payloads: walk.frames,
        })
    }
}

/// Encodes `value` with [`Encoder::new`].
pub fn encode(value: &Value) -> Result<Frames, EncodeError> {
    Encoder::new().encode(value)
}

impl Walk<'_> {
    fn visit(&mut self, value: &Value, depth: u32) -> Result<(), EncodeError> {
        if depth > self.limits.max_depth {
            return Err(EncodeError::TooDeep {
                depth,
                limit: self.limits.max_depth,
            });
        }
        self.nodes += 1;
        if self.nodes > self.limits.max_elements {
            return Err(EncodeError::TooManyElements {
                limit: self.limits.max_elements,
            });
        }
        match value {
            Value::Bytes(b) => self.payload(b, 1),
            Value::Tensor(t) => {
                self.check_rank(t)?;
                self.payload(t.data(), t.dtype().align() as u64)
            }
            Value::List(items) => items.iter().try_for_each(|v| self.visit(v, depth + 1)),
            Value::Map(entries) => entries
                .iter()
                .try_for_each(|(_, v)| self.visit(v, depth + 1)),
            _ => Ok(()),
        }
    }

    fn check_rank(&self, t: &Tensor) -> Result<(), EncodeError> {
        let rank = t.shape().len();
        if rank as u64 > u64::from(self.limits.max_rank) {
            return Err(EncodeError::RankTooHigh {
                rank,
                limit: self.limits.max_rank,
            });
        }
        Ok(())
    }

    fn payload(&mut self, data: &Bytes, align: u64) -> Result<(), EncodeError> {
        let slot = self.refs.len();
        if data.is_empty() {
            self.refs.push(None);
        } else if data.len() < self.pack_below {
            self.refs.push(None);
            self.small.push(SmallItem {
                slot,
                data: data.clone(),
            });
            // `align` is a dtype size: a power of two.
            self.small_layouts
                .push(Layout::new(data.len() as u64, align).map_err(|_| self.too_large())?);
        } else {
            let frame = u32::try_from(self.frames.len()).map_err(|_| self.too_many_frames())?;
            self.refs.push(Some((frame, 0, data.len() as u64)));
            self.frames.push(data.clone());
            self.specs.push(FrameSpec {
                len: data.len() as u64,
                align,
            });
        }
        Ok(())
    }

    fn pack_small(&mut self) -> Result<(), EncodeError> {
        if self.small.is_empty() {
            return Ok(());
        }
        let frame = u32::try_from(self.frames.len()).map_err(|_| self.too_many_frames())?;
        let packing = pack(&self.small_layouts).map_err(|_| self.too_large())?;
        let size = usize::try_from(packing.size).map_err(|_| self.too_large())?;
        let mut buf = Vec::with_capacity(size);
        for (item, &offset) in self.small.iter().zip(&packing.offsets) {
            buf.resize(offset as usize, 0);
            buf.extend_from_slice(&item.data);
            self.refs[item.slot] = Some((frame, offset, item.data.len() as u64));
        }
        self.frames.push(Bytes::from(buf));
        self.specs.push(FrameSpec {
            len: packing.size,
            align: packing.align,
        });
        Ok(())
    }

    fn too_large(&self) -> EncodeError {
        EncodeError::TooLarge {
            bytes: u64::MAX,
            limit: self.limits.max_total_bytes,
        }
    }

    fn too_many_frames(&self) -> EncodeError {
        EncodeError::TooManyFrames {
            count: self.frames.len() as u64 + 1,
            limit: self.limits.max_frames,
        }
    }
}

/// A value node serialized with the payload references the walk assigned, in the same
/// depth-first order.
struct Node<'a> {
    value: &'a Value,
    refs: &'a [Ref],
    next: &'a Cell<usize>,
}

impl Node<'_> {
    fn child<'b>(&'b self, value: &'b Value) -> Node<'b> {
        Node {
            value,
            refs: self.refs,
            next: self.next,
        }
    }

    fn take_ref<E: serde::ser::Error>(&self) -> Result<Ref, E> {
        let i = self.next.get();
        self.next.set(i + 1);
        self.refs
            .get(i)
            .copied()
            .ok_or_else(|| E::custom("payload reference missing"))
    }
}

struct Dims<'a>(&'a [u64]);

impl Serialize for Dims<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.0.len()))?;
        for d in self.0 {
            seq.serialize_element(d)?;
        }
        seq.end()
    }
}

struct Items<'a>(&'a Node<'a>, &'a [Value]);

impl Serialize for Items<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.1.len()))?;
        for v in self.1 {
            seq.serialize_element(&self.0.child(v))?;
        }
        seq.end()
    }
}

struct Entries<'a>(&'a Node<'a>, &'a [(String, Value)]);

impl Serialize for Entries<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.1.len()))?;
        for (k, v) in self.1 {
            map.serialize_entry(k, &self.0.child(v))?;
        }
        map.end()
    }
}

impl Serialize for Node<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.value {
            Value::Null => {
                let mut t = s.serialize_tuple(1)?;
                t.serialize_element(&tag::NULL)?;
                t.end()
            }
            Value::Bool(b) => pair(s, tag::BOOL, b),
            Value::I64(v) => pair(s, tag::I64, v),
            Value::U64(v) => pair(s, tag::U64, v),
            Value::F64(v) => pair(s, tag::F64, v),
            Value::Str(v) => pair(s, tag::STR, v.as_str()),
            Value::Bytes(_) => pair(s, tag::BYTES, &self.take_ref::<S::Error>()?),
            Value::List(items) => pair(s, tag::LIST, &Items(self, items)),
            Value::Map(entries) => pair(s, tag::MAP, &Entries(self, entries)),
            Value::Tensor(tensor) => {
                let r = self.take_ref::<S::Error>()?;
                let mut t = s.serialize_tuple(5)?;
                t.serialize_element(&tag::TENSOR)?;
                t.serialize_element(&tensor.dtype().code())?;
                t.serialize_element(&Dims(tensor.shape()))?;
                t.serialize_element(&tensor.strides().map(Dims))?;
                t.serialize_element(&r)?;
                t.end()
            }
        }
    }
}

fn pair<S: Serializer, T: Serialize + ?Sized>(s: S, tag: u8, v: &T) -> Result<S::Ok, S::Error> {
    let mut t = s.serialize_tuple(2)?;
    t.serialize_element(&tag)?;
    t.serialize_element(v)?;
    t.end()
}

#[cfg(test)]
#[allow(clippy::field_reassign_with_default)]
mod tests {
    use super::*;
    use crate::DType;

    #[test]
    fn large_payloads_are_the_callers_bytes() {
        let data = Bytes::from(vec![7u8; 8192]);
        let t = Tensor::new(DType::F32, &[2048], data.clone()).unwrap();
        let f = encode(&Value::List(vec![t.into(), Value::Bytes(data.clone())])).unwrap();
        assert_eq!(f.payloads.len(), 2);
        for p in &f.payloads {
            assert_eq!(p.as_ptr(), data.as_ptr());
            assert_eq!(p.len(), data.len());
        }
    }

    #[test]
    fn small_payloads_share_one_frame_at_their_alignment() {
        let items: Vec<Value> = (0..1000)
            .map(|i| {
                let dtype = [DType::U8, DType::F32, DType::Complex128][i % 3];
                let n = (i % 5) as u64;
                let data = Bytes::from(vec![i as u8; n as usize * dtype.size()]);
                Tensor::new(dtype, &[n], data).unwrap().into()
            })
            .collect();
        let f = encode(&Value::List(items)).unwrap();
        assert_eq!(f.frame_count(), 2);
        let e = Encoder::new().pack_below(0).encode(&Value::List(vec![
            Value::Bytes(Bytes::from_static(b"x")),
            Value::Bytes(Bytes::new()),
        ]));
        // Nothing is packed below 0; empty payloads need no frame.
        assert_eq!(e.unwrap().payloads.len(), 1);
    }

    #[test]
    fn limits_are_enforced_on_encode() {
        let mut deep = Value::Null;
        for _ in 0..10 {
            deep = Value::List(vec![deep]);
        }
        let mut lim = Limits::default();
        lim.max_depth = 5;
        assert_eq!(
            Encoder::new().limits(lim.clone()).encode(&deep),
            Err(EncodeError::TooDeep { depth: 6, limit: 5 })
        );
        lim.max_depth = 64;
        lim.max_elements = 3;
        assert_eq!(
            Encoder::new().limits(lim.clone()).encode(&deep),
            Err(EncodeError::TooManyElements { limit: 3 })
        );
        lim.max_elements = 100;
        lim.max_frames = 1;
        let two = Value::List(vec![
            Value::Bytes(Bytes::from(vec![0; 5000])),
            Value::Bytes(Bytes::from(vec![0; 5000])),
        ]);
        assert_eq!(
            Encoder::new().limits(lim.clone()).encode(&two),
            Err(EncodeError::TooManyFrames { count: 2, limit: 1 })
        );
        lim.max_frames = 8;
        lim.max_total_bytes = 9999;
        assert_eq!(
            Encoder::new().limits(lim).encode(&two),
            Err(EncodeError::TooLarge {
                bytes: 10000,
                limit: 9999
            })
        );
    }
}
