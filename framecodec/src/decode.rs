//! Meta frame + payload frames -> value, with every payload a slice of its frame.

use std::fmt;
use std::io::Cursor;

use bytes::Bytes;
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::encode::tag;
use crate::tensor::Dims;
use crate::value::tensor_pointer;
use crate::wire::FrameSpec;
use crate::{DType, DecodeError, FrameTable, PathSeg, Tensor, Value};

/// Bounds on what a decoder accepts, all checked before the memory they guard is allocated.
///
/// The defaults suit values of up to millions of tensors; lower them for untrusted peers.
/// `max_depth` also bounds the decoder's recursion, so keep it to a few hundred at most.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Limits {
    /// Deepest nesting of lists and maps; the root is at depth 1 (default 64).
    pub max_depth: u32,
    /// Most payload frames (default 1,048,576).
    pub max_frames: u32,
    /// Most values in the tree, counting every list item, map value and the root (default 2^24).
    pub max_elements: u64,
    /// Most dimensions of one tensor (default 32).
    pub max_rank: u32,
    /// Most payload bytes, summed over the frame table (default 1 TiB).
    pub max_total_bytes: u64,
    /// Largest meta frame (default 256 MiB).
    pub max_meta_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_depth: 64,
            max_frames: 1 << 20,
            max_elements: 1 << 24,
            max_rank: 32,
            max_total_bytes: 1 << 40,
            max_meta_bytes: 256 << 20,
        }
    }
}

impl Limits {
    /// No limits beyond what the format itself bounds (depth stays at 64 to bound recursion).
    pub fn unlimited() -> Self {
        Self {
            max_depth: 64,
            max_frames: u32::MAX,
            max_elements: u64::MAX,
            max_rank: Tensor::MAX_RANK as u32,
            max_total_bytes: u64::MAX,
            max_meta_bytes: u64::MAX,
        }
    }
}

/// Decodes with a set of [`Limits`].
#[derive(Debug, Clone, Default)]
pub struct Decoder {
    limits: Limits,
}

impl Decoder {
    /// A decoder with [`Limits::default`].
    pub fn new() -> Self {
        Self::default()
    }

    /// A decoder with `limits`.
    pub fn with_limits(limits: Limits) -> Self {
        Self { limits }
    }

    /// The limits in force.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Reads the frame table of `meta` (header checks and limits included), without decoding
    /// the body: enough to size and lay out a receive buffer.
    pub fn frame_table(&self, meta: &[u8]) -> Result<FrameTable, DecodeError> {
        FrameTable::parse(meta, &self.limits)
    }

    /// Decodes `meta` with its payload `frames`, each received as its own `Bytes`. Every
    /// tensor and byte string of the result is a slice of one of the frames.
    pub fn decode(&self, meta: &[u8], frames: &[Bytes]) -> Result<Value, DecodeError> {
        let table = self.frame_table(meta)?;
        table.check_frames(frames)?;
        let out = self.body(meta, &table, frames, &[])?;
        Ok(out.unwrap_or(Value::Null))
    }

    /// Decodes `meta` with one contiguous buffer into which the frames were written at the
    /// offsets of [`FrameTable::layout`] with `align`. Every tensor of the result is a slice of
    /// `buf`, so it keeps `buf`'s owner (for example a pool lease) alive.
    pub fn decode_contiguous(
        &self,
        meta: &[u8],
        buf: &Bytes,
        align: u64,
    ) -> Result<Value, DecodeError> {
        let table = self.frame_table(meta)?;
        let frames = table.split(buf, align)?;
        let out = self.body(meta, &table, &frames, &[])?;
        Ok(out.unwrap_or(Value::Null))
    }

    /// Decodes only the value at `path` (map keys, list indexes, tensor rows), skipping the
    /// rest of the meta body without building it. `Ok(None)` when the path leads nowhere.
    /// Use [`FrameTable::split`] first to select from a contiguous buffer.
    pub fn select(
        &self,
        meta: &[u8],
        frames: &[Bytes],
        path: &[PathSeg<'_>],
    ) -> Result<Option<Value>, DecodeError> {
        let table = self.frame_table(meta)?;
        table.check_frames(frames)?;
        self.body(meta, &table, frames, path)
    }

    fn body(
        &self,
        meta: &[u8],
        table: &FrameTable,
        frames: &[Bytes],
        path: &[PathSeg<'_>],
    ) -> Result<Option<Value>, DecodeError> {
        let body = &meta[table.body_start..];
        let mut de = rmp_serde::Deserializer::new(Cursor::new(body));
        // Each value level is at most two msgpack levels (node, then list or map).
        let depth = (self.limits.max_depth as usize).saturating_mul(2) + 8;
        de.set_max_depth(depth);
        let mut st = State {
            frames,
            specs: table.frames(),
            limits: &self.limits,
            nodes: 0,
            error: None,
        };
        let seed = NodeSeed {
            st: &mut st,
            depth: 1,
            path,
        };
        let result = seed.deserialize(&mut de);
        let offset = table.body_start as u64 + de.position();
        match result {
            Ok(v) if de.position() == body.len() as u64 => Ok(v),
            Ok(_) => Err(DecodeError::Malformed {
                offset,
                reason: "trailing bytes after the root value".into(),
            }),
            Err(e) => Err(st.error.take().unwrap_or(DecodeError::Malformed {
                offset,
                reason: e.to_string(),
            })),
        }
    }
}

/// Decodes with [`Decoder::new`]; see [`Decoder::decode`].
pub fn decode(meta: &[u8], frames: &[Bytes]) -> Result<Value, DecodeError> {
    Decoder::new().decode(meta, frames)
}

/// Decodes with [`Decoder::new`]; see [`Decoder::decode_contiguous`].
pub fn decode_contiguous(meta: &[u8], buf: &Bytes, align: u64) -> Result<Value, DecodeError> {
    Decoder::new().decode_contiguous(meta, buf, align)
}

struct State<'f> {
    frames: &'f [Bytes],
    specs: &'f [FrameSpec],
    limits: &'f Limits,
    nodes: u64,
    error: Option<DecodeError>,
}

impl State<'_> {
    /// Records the typed error and returns a serde error that unwinds the deserializer.
    fn fail<E: de::Error>(&mut self, e: DecodeError) -> E {
        let msg = e.to_string();
        self.error = Some(e);
        E::custom(msg)
    }

    fn count(&mut self, extra: u64) -> Result<(), DecodeError> {
        self.nodes = self.nodes.saturating_add(extra);
        if self.nodes > self.limits.max_elements {
            return Err(DecodeError::TooManyElements {
                limit: self.limits.max_elements,
            });
        }
        Ok(())
    }

    /// The payload a reference points at, as a slice of its frame.
    fn payload(
        &self,
        node: u64,
        r: Option<(u64, u64, u64)>,
        align: u64,
    ) -> Result<Bytes, DecodeError> {
        let Some((frame, offset, len)) = r else {
            return Ok(Bytes::new());
        };
        let frames = self.frames.len() as u64;
        let (Some(data), Some(spec)) = (
            usize::try_from(frame).ok().and_then(|f| self.frames.get(f)),
            usize::try_from(frame).ok().and_then(|f| self.specs.get(f)),
        ) else {
            return Err(DecodeError::FrameIndex {
                node,
                frame,
                frames,
            });
        };
        let frame_len = data.len() as u64;
        match offset.checked_add(len) {
            Some(end) if end <= frame_len => {}
            _ => {
                return Err(DecodeError::OutOfBounds {
                    node,
                    frame,
                    offset,
                    len,
                    frame_len,
                })
            }
        }
        if len > 0 && (offset % align != 0 || spec.align < align) {
            return Err(DecodeError::Misaligned {
                node,
                frame,
                offset,
                frame_align: spec.align,
                align,
            });
        }
        Ok(data.slice(offset as usize..(offset + len) as usize))
    }
}

fn missing<E: de::Error>(what: &str) -> E {
    E::custom(format_args!("node is missing its {what}"))
}

/// One value node; with a non-empty `path`, only the part on the path is built.
struct NodeSeed<'s, 'f, 'p> {
    st: &'s mut State<'f>,
    depth: u32,
    path: &'s [PathSeg<'p>],
}

impl<'de> DeserializeSeed<'de> for NodeSeed<'_, '_, '_> {
    type Value = Option<Value>;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for NodeSeed<'_, '_, '_> {
    type Value = Option<Value>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a value node: an array that starts with a tag")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let st = self.st;
        let node = st.nodes;
        if self.depth > st.limits.max_depth {
            let limit = st.limits.max_depth;
            return Err(st.fail(DecodeError::TooDeep { limit }));
        }
        if self.path.is_empty() {
            st.count(1).map_err(|e| st.fail(e))?;
        }
        let t: u64 = seq.next_element()?.ok_or_else(|| missing("tag"))?;
        let t = match u8::try_from(t) {
            Ok(t) if t <= tag::TENSOR => t,
            _ => return Err(st.fail(DecodeError::UnknownTag { tag: t, node })),
        };
        let depth = self.depth;
        let out = match (t, self.path.split_first()) {
            (_, None) => Some(content(st, node, depth, t, &mut seq)?),
            (tag::LIST, Some((PathSeg::Index(i), rest))) => seq
                .next_element_seed(ListSeed {
                    st,
                    depth,
                    pick: Some((*i, rest)),
                })?
                .ok_or_else(|| missing("items"))?,
            (tag::MAP, Some((PathSeg::Key(k), rest))) => seq
                .next_element_seed(MapSeed {
                    st,
                    depth,
                    pick: Some((k, rest)),
                })?
                .ok_or_else(|| missing("entries"))?,
            (tag::TENSOR, Some((PathSeg::Index(_), _))) => {
                st.count(1).map_err(|e| st.fail(e))?;
                match content(st, node, depth, t, &mut seq)? {
                    Value::Tensor(tensor) => tensor_pointer(&tensor, self.path),
                    _ => None,
                }
            }
            _ => {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                None
            }
        };
        if seq.next_element::<IgnoredAny>()?.is_some() {
            return Err(de::Error::custom("value node has extra items"));
        }
        Ok(out)
    }
}

/// The rest of a node after its tag, decoded in full.
fn content<'de, A: SeqAccess<'de>>(
    st: &mut State<'_>,
    node: u64,
    depth: u32,
    t: u8,
    seq: &mut A,
) -> Result<Value, A::Error> {
    Ok(match t {
        tag::NULL => Value::Null,
        tag::BOOL => Value::Bool(seq.next_element()?.ok_or_else(|| missing("bool"))?),
        tag::I64 => Value::I64(seq.next_element()?.ok_or_else(|| missing("i64"))?),
        tag::U64 => Value::U64(seq.next_element()?.ok_or_else(|| missing("u64"))?),
        tag::F64 => Value::F64(seq.next_element()?.ok_or_else(|| missing("f64"))?),
        tag::STR => Value::Str(seq.next_element()?.ok_or_else(|| missing("string"))?),
        tag::BYTES => {
            let r = seq.next_element()?.ok_or_else(|| missing("payload"))?;
            Value::Bytes(st.payload(node, r, 1).map_err(|e| st.fail(e))?)
        }
        tag::LIST => seq
            .next_element_seed(ListSeed {
                st,
                depth,
                pick: None,
            })?
            .flatten()
            .ok_or_else(|| missing("items"))?,
        tag::MAP => seq
            .next_element_seed(MapSeed {
                st,
                depth,
                pick: None,
            })?
            .flatten()
            .ok_or_else(|| missing("entries"))?,
        _ => Value::Tensor(tensor(st, node, seq)?),
    })
}

fn tensor<'de, A: SeqAccess<'de>>(
    st: &mut State<'_>,
    node: u64,
    seq: &mut A,
) -> Result<Tensor, A::Error> {
    let code: u64 = seq.next_element()?.ok_or_else(|| missing("dtype"))?;
    let Some(dtype) = u8::try_from(code).ok().and_then(DType::from_code) else {
        return Err(st.fail(DecodeError::UnknownDType { code, node }));
    };
    let shape = seq
        .next_element_seed(DimsSeed { st, node })?
        .ok_or_else(|| missing("shape"))?;
    let strides = seq
        .next_element_seed(OptDimsSeed { st, node })?
        .ok_or_else(|| missing("strides"))?;
    let r = seq.next_element()?.ok_or_else(|| missing("payload"))?;
    let data = st
        .payload(node, r, dtype.align() as u64)
        .map_err(|e| st.fail(e))?;
    Tensor::from_parts(dtype, shape, strides, data)
        .map_err(|source| st.fail(DecodeError::Tensor { node, source }))
}

/// Shape or strides: at most `max_rank` integers, refused before allocating beyond that.
struct DimsSeed<'s, 'f> {
    st: &'s mut State<'f>,
    node: u64,
}

impl<'de> DeserializeSeed<'de> for DimsSeed<'_, '_> {
    type Value = Dims;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Dims, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for DimsSeed<'_, '_> {
    type Value = Dims;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array of dimensions")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Dims, A::Error> {
        let limit = self.st.limits.max_rank.min(Tensor::MAX_RANK as u32);
        let too_high = DecodeError::RankTooHigh {
            node: self.node,
            limit,
        };
        if seq.size_hint().is_some_and(|n| n > limit as usize) {
            return Err(self.st.fail(too_high));
        }
        let mut dims = Dims::new();
        while let Some(d) = seq.next_element::<u64>()? {
            if dims.len() >= limit as usize {
                return Err(self.st.fail(too_high));
            }
            dims.push(d);
        }
        Ok(dims)
    }
}

struct OptDimsSeed<'s, 'f> {
    st: &'s mut State<'f>,
    node: u64,
}

impl<'de> DeserializeSeed<'de> for OptDimsSeed<'_, '_> {
    type Value = Option<Dims>;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Option<Dims>, D::Error> {
        d.deserialize_option(self)
    }
}

impl<'de> Visitor<'de> for OptDimsSeed<'_, '_> {
    type Value = Option<Dims>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("nil or an array of strides")
    }

    fn visit_none<E: de::Error>(self) -> Result<Option<Dims>, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Option<Dims>, E> {
        Ok(None)
    }

    fn visit_some<D: de::Deserializer<'de>>(self, d: D) -> Result<Option<Dims>, D::Error> {
        DimsSeed {
            st: self.st,
            node: self.node,
        }
        .deserialize(d)
        .map(Some)
    }
}

/// The items of a list: all of them, or only the one at the picked index.
struct ListSeed<'s, 'f, 'p> {
    st: &'s mut State<'f>,
    depth: u32,
    pick: Option<(u64, &'s [PathSeg<'p>])>,
}

impl<'de> DeserializeSeed<'de> for ListSeed<'_, '_, '_> {
    type Value = Option<Value>;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for ListSeed<'_, '_, '_> {
    type Value = Option<Value>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array of value nodes")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let st = self.st;
        let depth = self.depth + 1;
        if let Some((index, rest)) = self.pick {
            let mut found = None;
            let mut i = 0u64;
            loop {
                if i == index {
                    let seed = NodeSeed {
                        st: &mut *st,
                        depth,
                        path: rest,
                    };
                    match seq.next_element_seed(seed)? {
                        Some(v) => found = v,
                        None => break,
                    }
                } else if seq.next_element::<IgnoredAny>()?.is_none() {
                    break;
                }
                i += 1;
            }
            return Ok(found);
        }
        // Refuse a declared length beyond the element budget before reserving anything.
        let budget = st.limits.max_elements.saturating_sub(st.nodes);
        if let Some(n) = seq.size_hint() {
            if n as u64 > budget {
                let limit = st.limits.max_elements;
                return Err(st.fail(DecodeError::TooManyElements { limit }));
            }
        }
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
        loop {
            let seed = NodeSeed {
                st: &mut *st,
                depth,
                path: &[],
            };
            match seq.next_element_seed(seed)? {
                Some(v) => items.push(v.unwrap_or(Value::Null)),
                None => break,
            }
        }
        Ok(Some(Value::List(items)))
    }
}

/// The entries of a map: all of them, or only the first with the picked key.
struct MapSeed<'s, 'f, 'p> {
    st: &'s mut State<'f>,
    depth: u32,
    pick: Option<(&'s str, &'s [PathSeg<'p>])>,
}

impl<'de> DeserializeSeed<'de> for MapSeed<'_, '_, '_> {
    type Value = Option<Value>;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for MapSeed<'_, '_, '_> {
    type Value = Option<Value>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a map from strings to value nodes")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let st = self.st;
        let depth = self.depth + 1;
        if let Some((key, rest)) = self.pick {
            let mut found = None;
            let mut done = false;
            while let Some(hit) = map.next_key_seed(KeyIs(key))? {
                if hit && !done {
                    done = true;
                    found = map.next_value_seed(NodeSeed {
                        st: &mut *st,
                        depth,
                        path: rest,
                    })?;
                } else {
                    map.next_value::<IgnoredAny>()?;
                }
            }
            return Ok(found);
        }
        let budget = st.limits.max_elements.saturating_sub(st.nodes);
        if let Some(n) = map.size_hint() {
            if n as u64 > budget {
                let limit = st.limits.max_elements;
                return Err(st.fail(DecodeError::TooManyElements { limit }));
            }
        }
        let mut entries = Vec::with_capacity(map.size_hint().unwrap_or(0).min(1024));
        while let Some(k) = map.next_key::<String>()? {
            let v = map.next_value_seed(NodeSeed {
                st: &mut *st,
                depth,
                path: &[],
            })?;
            entries.push((k, v.unwrap_or(Value::Null)));
        }
        Ok(Some(Value::Map(entries)))
    }
}

/// A map key, compared with the wanted one without allocating.
struct KeyIs<'a>(&'a str);

impl<'de> DeserializeSeed<'de> for KeyIs<'_> {
    type Value = bool;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeyIs<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string key")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<bool, E> {
        Ok(v == self.0)
    }
}

#[cfg(test)]
#[allow(clippy::field_reassign_with_default)]
mod tests {
    use super::*;
    use crate::{encode, Encoder, TensorError};

    fn sample() -> Value {
        let ids = Tensor::from_slice(&[2, 3], &[1i64, 2, 3, 4, 5, 6]).unwrap();
        let big = Tensor::new(DType::U8, &[5000], Bytes::from(vec![9u8; 5000])).unwrap();
        Value::map([
            ("ids", ids.into()),
            ("big", big.into()),
            ("name", "x".into()),
            ("n", Value::U64(u64::MAX)),
            ("neg", Value::I64(-3)),
            ("pi", Value::F64(3.5)),
            ("ok", Value::Bool(true)),
            ("none", Value::Null),
            ("raw", Value::Bytes(Bytes::from_static(b"abc"))),
            (
                "list",
                Value::List(vec![Value::I64(1), Value::List(vec![])]),
            ),
        ])
    }

    #[test]
    fn round_trip_through_frames_and_a_contiguous_buffer() {
        let v = sample();
        let f = encode(&v).unwrap();
        assert_eq!(f.payloads.len(), 2);
        assert_eq!(decode(&f.meta, &f.payloads).unwrap(), v);
        let l = f.layout(64).unwrap();
        let mut buf = vec![0u8; l.size as usize];
        for (i, p) in f.payloads.iter().enumerate() {
            buf[l.range(i)].copy_from_slice(p);
        }
        let buf = Bytes::from(buf);
        let back = decode_contiguous(&f.meta, &buf, 64).unwrap();
        assert_eq!(back, v);
        let ids = back.get("ids").unwrap().as_tensor().unwrap();
        let at = ids.data().as_ptr() as usize - buf.as_ptr() as usize;
        assert!(at < buf.len());
    }

    #[test]
    fn select_builds_only_the_path() {
        let v = sample();
        let f = encode(&v).unwrap();
        let d = Decoder::new();
        let got = d.select(&f.meta, &f.payloads, &["ids".into(), 1u64.into()]);
        let row = got.unwrap().unwrap();
        assert_eq!(
            row.as_tensor().unwrap().as_slice::<i64>().unwrap(),
            &[4, 5, 6]
        );
        let got = d.select(&f.meta, &f.payloads, &["list".into(), 1u64.into()]);
        assert_eq!(got.unwrap(), Some(Value::List(vec![])));
        assert_eq!(
            d.select(&f.meta, &f.payloads, &["zz".into()]).unwrap(),
            None
        );
        assert_eq!(
            d.select(&f.meta, &f.payloads, &[7u64.into()]).unwrap(),
            None
        );
        assert_eq!(d.select(&f.meta, &f.payloads, &[]).unwrap(), Some(v));
    }

    #[test]
    fn limits_are_enforced_on_decode() {
        let mut deep = Value::Null;
        for _ in 0..10 {
            deep = Value::List(vec![deep]);
        }
        let f = encode(&deep).unwrap();
        let mut lim = Limits::default();
        lim.max_depth = 5;
        assert_eq!(
            Decoder::with_limits(lim).decode(&f.meta, &[]),
            Err(DecodeError::TooDeep { limit: 5 })
        );
        let mut lim = Limits::default();
        lim.max_elements = 4;
        assert_eq!(
            Decoder::with_limits(lim).decode(&f.meta, &[]),
            Err(DecodeError::TooManyElements { limit: 4 })
        );
        let wide = Value::List(vec![Value::Null; 100]);
        let f = encode(&wide).unwrap();
        let mut lim = Limits::default();
        lim.max_elements = 50;
        assert_eq!(
            Decoder::with_limits(lim).decode(&f.meta, &[]),
            Err(DecodeError::TooManyElements { limit: 50 })
        );
        let t = Tensor::new(DType::U8, &[1; 8], Bytes::from_static(&[1])).unwrap();
        let f = encode(&t.into()).unwrap();
        let mut lim = Limits::default();
        lim.max_rank = 4;
        assert_eq!(
            Decoder::with_limits(lim).decode(&f.meta, &f.payloads),
            Err(DecodeError::RankTooHigh { node: 0, limit: 4 })
        );
    }

    #[test]
    fn frames_must_match_the_table() {
        let f = encode(&sample()).unwrap();
        assert_eq!(
            decode(&f.meta, &f.payloads[..1]),
            Err(DecodeError::FrameCount {
                expected: 2,
                actual: 1
            })
        );
        let mut short = f.payloads.clone();
        short[0] = short[0].slice(1..);
        assert!(matches!(
            decode(&f.meta, &short),
            Err(DecodeError::FrameLength { frame: 0, .. })
        ));
    }

    /// Hand-written meta frames, to reach errors the encoder never produces.
    fn meta_with(frames: &[FrameSpec], body: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        crate::wire::write_header(&mut out, frames);
        out.extend_from_slice(body);
        out
    }

    #[test]
    fn hostile_bodies_give_typed_errors() {
        // [9, 11, [2], nil, [0, 2, 8]]: an f32 tensor at offset 2 of a 4-aligned frame.
        let spec = [FrameSpec { len: 16, align: 4 }];
        let frame = [Bytes::from(vec![0u8; 16])];
        let m = meta_with(&spec, &[0x95, 9, 11, 0x91, 2, 0xc0, 0x93, 0, 2, 8]);
        assert!(matches!(
            decode(&m, &frame),
            Err(DecodeError::Misaligned {
                offset: 2,
                align: 4,
                ..
            })
        ));
        // Runs past the frame.
        let m = meta_with(&spec, &[0x95, 9, 11, 0x91, 2, 0xc0, 0x93, 0, 12, 8]);
        assert!(matches!(
            decode(&m, &frame),
            Err(DecodeError::OutOfBounds {
                offset: 12,
                len: 8,
                frame_len: 16,
                ..
            })
        ));
        // Wrong frame index.
        let m = meta_with(&spec, &[0x95, 9, 11, 0x91, 2, 0xc0, 0x93, 3, 0, 8]);
        assert!(matches!(
            decode(&m, &frame),
            Err(DecodeError::FrameIndex { frame: 3, .. })
        ));
        // Shape disagrees with the payload length.
        let m = meta_with(&spec, &[0x95, 9, 11, 0x91, 3, 0xc0, 0x93, 0, 0, 8]);
        assert!(matches!(
            decode(&m, &frame),
            Err(DecodeError::Tensor {
                source: TensorError::DataLength { .. },
                ..
            })
        ));
        // Shape whose byte size overflows.
        let mut body = vec![0x95, 9, 12, 0x92];
        body.extend_from_slice(&[0xcf, 0x10, 0, 0, 0, 0, 0, 0, 0]);
        body.extend_from_slice(&[0xcf, 0x10, 0, 0, 0, 0, 0, 0, 0]);
        body.extend_from_slice(&[0xc0, 0xc0]);
        assert!(matches!(
            decode(&meta_with(&[], &body), &[]),
            Err(DecodeError::Tensor {
                source: TensorError::SizeOverflow { .. },
                ..
            })
        ));
        // Unknown dtype and tag, a list that claims 2^32-1 items, trailing bytes.
        let m = meta_with(&[], &[0x95, 9, 99, 0x90, 0xc0, 0xc0]);
        assert!(matches!(
            decode(&m, &[]),
            Err(DecodeError::UnknownDType { code: 99, .. })
        ));
        let m = meta_with(&[], &[0x91, 42]);
        assert!(matches!(
            decode(&m, &[]),
            Err(DecodeError::UnknownTag { tag: 42, .. })
        ));
        let m = meta_with(&[], &[0x92, 7, 0xdd, 0xff, 0xff, 0xff, 0xff]);
        assert!(matches!(
            decode(&m, &[]),
            Err(DecodeError::TooManyElements { .. })
        ));
        let m = meta_with(&[], &[0x91, 0, 0x91]);
        assert!(matches!(
            decode(&m, &[]),
            Err(DecodeError::Malformed { offset: 18, .. })
        ));
        let m = meta_with(&[], &[]);
        assert!(matches!(
            decode(&m, &[]),
            Err(DecodeError::Malformed { .. })
        ));
    }

    #[test]
    fn typed_views_of_decoded_tensors_are_aligned_in_a_laid_out_buffer() {
        let items: Vec<Value> = (0..50)
            .map(|i| {
                let n = i % 7;
                let data: Vec<f64> = (0..n).map(|x| x as f64).collect();
                Tensor::from_slice(&[n as u64], &data).unwrap().into()
            })
            .chain([Value::Bytes(Bytes::from_static(b"xyz"))])
            .collect();
        let v = Value::List(items);
        let f = Encoder::new().encode(&v).unwrap();
        assert_eq!(f.payloads.len(), 1);
        let l = f.layout(64).unwrap();
        // Start at a 64-byte boundary, as a pool block would.
        let mut buf = bytes::BytesMut::with_capacity(l.size as usize + 64);
        buf.resize(buf.as_ptr().align_offset(64), 0);
        let start = buf.len();
        buf.resize(start + l.size as usize, 0);
        for (i, p) in f.payloads.iter().enumerate() {
            let r = l.range(i);
            buf[start + r.start..start + r.end].copy_from_slice(p);
        }
        let buf = buf.freeze().slice(start..);
        assert_eq!(buf.as_ptr() as usize % 64, 0);
        let back = decode_contiguous(&f.meta, &buf, 64).unwrap();
        for (i, item) in back.clone().into_list().into_iter().take(50).enumerate() {
            let t = item.as_tensor().unwrap();
            assert_eq!(t.as_slice::<f64>().unwrap().len(), i % 7);
        }
        assert_eq!(back, v);
    }
}
