//! Value -> meta frame + payload frames.

use bytes::Bytes;
use rmp::encode as mp;
use tessera_alloc::{pack, Layout};

use crate::wire::{has_run, write_header, FrameSpec, ENTRY_LEN, HEADER_LEN};
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
    /// A list of tensors of one dtype, shape and strides whose payloads follow each other
    /// (only under `FLAG_RUNS`).
    pub(crate) const TENSORS: u8 = 10;
}

/// The fewest equal items written as a run: a list of tensors as one tag-10 node, equal
/// frames as one table entry.
pub const MIN_RUN: usize = 4;

/// Encodes values with a packing threshold and limits.
///
/// The limits are the decoder's: a value this encoder accepts is one a decoder with the same
/// [`Limits`] accepts.
#[derive(Debug, Clone)]
pub struct Encoder {
    pack_below: usize,
    limits: Limits,
    runs: bool,
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
    /// Lists that may be written as runs ([`uniform_tensors`]).
    run_lists: usize,
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
            runs: true,
        }
    }

    /// Writes runs ([`FLAG_RUNS`](crate::FLAG_RUNS), on by default): a list of at least
    /// [`MIN_RUN`] tensors of one dtype, shape and strides whose payloads follow each other
    /// (each a frame of its own, or packed one after the other) as one node, and equal frames
    /// as one table entry, so that the meta of 1,000 same-shaped tensors is a few dozen bytes
    /// instead of 32 KB. A value with no such run encodes as it would without. Off, the meta
    /// is readable by decoders that predate runs.
    pub fn runs(mut self, on: bool) -> Self {
        self.runs = on;
        self
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
        self.encode_root(Root::Value(value))
    }

    /// Encodes a list of lists, exactly as [`Encoder::encode`] encodes the [`Value::List`] of
    /// a [`Value::List`] of each of `lists`, without building that value: the columns of a
    /// batch stay where the caller keeps them, with no clone of each value to make and drop.
    pub fn encode_lists(&self, lists: &[&[Value]]) -> Result<Frames, EncodeError> {
        self.encode_root(Root::Lists(lists))
    }

    fn encode_root(&self, root: Root<'_>) -> Result<Frames, EncodeError> {
        let mut walk = Walk {
            limits: &self.limits,
            pack_below: self.pack_below,
            nodes: 0,
            run_lists: 0,
            refs: Vec::new(),
            frames: FrameList::new(),
            specs: Vec::new(),
            small: Vec::new(),
            small_layouts: Vec::new(),
        };
        match root {
            Root::Value(value) => walk.visit(value, 1)?,
            Root::Lists(lists) => walk.visit_lists(lists)?,
        }
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
        let runs = self.runs && (walk.run_lists > 0 || has_run(&walk.specs, MIN_RUN));
        let table = match runs {
            true => ENTRY_LEN,
            false => ENTRY_LEN * walk.specs.len(),
        };
        let mut meta = Vec::with_capacity(HEADER_LEN + table + 64);
        write_header(&mut meta, &walk.specs, runs);
        let mut body = Body {
            out: &mut meta,
            refs: &walk.refs,
            at: 0,
            runs,
        };
        match root {
            Root::Value(value) => body.node(value)?,
            Root::Lists(lists) => body.lists(lists)?,
        }
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

/// What an encode starts from: a value, or a list of lists standing for one.
#[derive(Clone, Copy)]
enum Root<'a> {
    Value(&'a Value),
    Lists(&'a [&'a [Value]]),
}

/// Encodes `value` with [`Encoder::new`].
pub fn encode(value: &Value) -> Result<Frames, EncodeError> {
    Encoder::new().encode(value)
}

impl Walk<'_> {
    /// Counts one node at `depth` against the limits.
    fn enter(&mut self, depth: u32) -> Result<(), EncodeError> {
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
        Ok(())
    }

    /// A list of lists, walked as the value it stands for.
    fn visit_lists(&mut self, lists: &[&[Value]]) -> Result<(), EncodeError> {
        self.enter(1)?;
        lists.iter().try_for_each(|items| {
            self.enter(2)?;
            self.runs_of(items);
            items.iter().try_for_each(|v| self.visit(v, 3))
        })
    }

    fn visit(&mut self, value: &Value, depth: u32) -> Result<(), EncodeError> {
        self.enter(depth)?;
        match value {
            Value::Bytes(b) => self.payload(b, 1),
            Value::Tensor(t) => {
                self.check_rank(t)?;
                self.payload(t.data(), t.dtype().align() as u64)
            }
            Value::List(items) => {
                self.runs_of(items);
                items.iter().try_for_each(|v| self.visit(v, depth + 1))
            }
            Value::Map(entries) => entries
                .iter()
                .try_for_each(|(_, v)| self.visit(v, depth + 1)),
            _ => Ok(()),
        }
    }

    /// Counts `items` as a list that may be written as a run, and makes room for their
    /// payloads at once (a batch of a thousand would grow each list ten times).
    fn runs_of(&mut self, items: &[Value]) {
        let Some(Value::Tensor(first)) = items.first() else {
            return;
        };
        if !uniform_tensors(items) {
            return;
        }
        self.run_lists += 1;
        let n = items.len();
        self.refs.reserve(n);
        if first.data().len() < self.pack_below {
            self.small.reserve(n);
            self.small_layouts.reserve(n);
        } else {
            self.frames.reserve(n);
            self.specs.reserve(n);
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

/// Writes the meta body: every value node as `WIRE.md` describes it, with the payload
/// references the walk assigned, in the same depth-first order. Each item goes through rmp's
/// own writers, so the bytes are msgpack's most compact form, as the decoder reads them.
struct Body<'a> {
    out: &'a mut Vec<u8>,
    /// Every payload's reference, in walk order, and the next one's position.
    refs: &'a [Ref],
    at: usize,
    /// Lists of tensors may be written as runs (the header says [`FLAG_RUNS`](crate::FLAG_RUNS)).
    runs: bool,
}

/// Whether `items` are at least [`MIN_RUN`] tensors of one dtype, shape and strides, each
/// with a payload of the same length: a list the body may write as one tag-10 node, if their
/// payloads follow each other. (Strided tensors of one shape may hold payloads of different
/// lengths, on both sides of the packing threshold: one packed at the start of the shared
/// frame would pass for a frame of its own.)
fn uniform_tensors(items: &[Value]) -> bool {
    let Some(Value::Tensor(first)) = items.first() else {
        return false;
    };
    let len = first.data().len();
    len > 0
        && items.len() >= MIN_RUN
        && items.iter().all(|v| match v {
            Value::Tensor(t) => {
                t.data().len() == len
                    && t.dtype() == first.dtype()
                    && t.shape() == first.shape()
                    && t.strides() == first.strides()
            }
            _ => false,
        })
}

/// Where the payloads of a tensor list written as a run lie.
enum Run {
    /// Item `i` is all of frame `first + i`.
    Frames { first: u32 },
    /// Item `i` is bytes `offset + i × stride ..` (`len` of them) of `frame`.
    Packed {
        frame: u32,
        offset: u64,
        len: u64,
        stride: u64,
    },
}

/// What rmp's writers report; a `Vec` never refuses bytes, so this is never reached.
fn msgpack(e: impl std::fmt::Display) -> EncodeError {
    EncodeError::Msgpack {
        reason: e.to_string(),
    }
}

impl Body<'_> {
    fn array(&mut self, len: usize) -> Result<(), EncodeError> {
        // A fixarray, the node headers' and shapes' form, without the writer's dispatch.
        if len < 16 {
            self.out.push(0x90 | len as u8);
            return Ok(());
        }
        let len = u32::try_from(len).map_err(msgpack)?;
        mp::write_array_len(self.out, len).map_err(msgpack)?;
        Ok(())
    }

    fn uint(&mut self, v: u64) -> Result<(), EncodeError> {
        // A positive fixint (tags, dtype codes, frame numbers), likewise.
        if v < 0x80 {
            self.out.push(v as u8);
            return Ok(());
        }
        mp::write_uint(self.out, v).map_err(msgpack)?;
        Ok(())
    }

    /// A node's array header and its tag.
    fn head(&mut self, items: usize, t: u8) -> Result<(), EncodeError> {
        self.array(items)?;
        self.uint(u64::from(t))
    }

    fn dims(&mut self, dims: &[u64]) -> Result<(), EncodeError> {
        self.array(dims.len())?;
        dims.iter().try_for_each(|&d| self.uint(d))
    }

    /// What a tensor node (and a tensor list node, for all its tensors) says besides where
    /// the payload lies: dtype, shape, and strides (`nil` when contiguous).
    fn tensor_head(&mut self, t: &Tensor) -> Result<(), EncodeError> {
        self.uint(u64::from(t.dtype().code()))?;
        self.dims(t.shape())?;
        match t.strides() {
            Some(strides) => self.dims(strides),
            None => mp::write_nil(self.out).map_err(msgpack),
        }
    }

    /// The next payload reference: `nil` or `[frame, offset, len]`.
    fn reference(&mut self) -> Result<(), EncodeError> {
        let r = self.refs.get(self.at);
        self.at += 1;
        match r {
            None => Err(msgpack("payload reference missing")),
            Some(None) => mp::write_nil(self.out).map_err(msgpack),
            Some(&Some((frame, offset, len))) => {
                self.array(3)?;
                self.uint(u64::from(frame))?;
                self.uint(offset)?;
                self.uint(len)
            }
        }
    }

    /// How the payloads of `items` follow each other, when the list can be written as a run:
    /// each a whole frame of its own in order, or packed at one stride in one frame.
    fn run_of(&self, items: &[Value]) -> Option<Run> {
        if !self.runs || !uniform_tensors(items) {
            return None;
        }
        let refs = self.refs.get(self.at..self.at + items.len())?;
        let (f0, o0, l0) = refs[0]?;
        let (_, o1, _) = refs[1]?;
        // A frame of its own holds its payload and nothing else (`Walk::payload`).
        let whole = |i: usize, (f, o, _): (u32, u64, u64)| {
            o == 0 && u64::from(f) == u64::from(f0) + i as u64
        };
        if o0 == 0
            && refs
                .iter()
                .enumerate()
                .all(|(i, r)| r.is_some_and(|r| whole(i, r)))
        {
            return Some(Run::Frames { first: f0 });
        }
        let stride = o1.checked_sub(o0)?;
        let packed = |i: usize, (f, o, l): (u32, u64, u64)| {
            f == f0
                && l == l0
                && Some(o)
                    == (i as u64)
                        .checked_mul(stride)
                        .and_then(|d| d.checked_add(o0))
        };
        (stride >= l0
            && refs
                .iter()
                .enumerate()
                .all(|(i, r)| r.is_some_and(|r| packed(i, r))))
        .then_some(Run::Packed {
            frame: f0,
            offset: o0,
            len: l0,
            stride,
        })
    }

    /// A tensor list node (tag 10) of `items`, whose payloads lie as `run` says.
    fn tensors(&mut self, items: &[Value], run: Run) -> Result<(), EncodeError> {
        let Some(Value::Tensor(first)) = items.first() else {
            return Err(msgpack("a tensor run without tensors"));
        };
        self.head(5, tag::TENSORS)?;
        self.tensor_head(first)?;
        let count = items.len() as u64;
        match run {
            Run::Frames { first } => {
                self.array(2)?;
                self.uint(u64::from(first))?;
            }
            Run::Packed {
                frame,
                offset,
                len,
                stride,
            } => {
                self.array(5)?;
                self.uint(u64::from(frame))?;
                self.uint(offset)?;
                self.uint(len)?;
                self.uint(stride)?;
            }
        }
        self.uint(count)?;
        self.at += items.len();
        Ok(())
    }

    /// A list node of `items`.
    fn list(&mut self, items: &[Value]) -> Result<(), EncodeError> {
        if let Some(run) = self.run_of(items) {
            return self.tensors(items, run);
        }
        self.head(2, tag::LIST)?;
        self.array(items.len())?;
        items.iter().try_for_each(|v| self.node(v))
    }

    /// The list node of the list nodes of `lists`.
    fn lists(&mut self, lists: &[&[Value]]) -> Result<(), EncodeError> {
        self.head(2, tag::LIST)?;
        self.array(lists.len())?;
        lists.iter().try_for_each(|items| self.list(items))
    }

    fn node(&mut self, value: &Value) -> Result<(), EncodeError> {
        match value {
            Value::Null => self.head(1, tag::NULL),
            Value::Bool(b) => {
                self.head(2, tag::BOOL)?;
                mp::write_bool(self.out, *b).map_err(msgpack)
            }
            Value::I64(v) => {
                self.head(2, tag::I64)?;
                mp::write_sint(self.out, *v).map_err(msgpack)?;
                Ok(())
            }
            Value::U64(v) => {
                self.head(2, tag::U64)?;
                self.uint(*v)
            }
            Value::F64(v) => {
                self.head(2, tag::F64)?;
                mp::write_f64(self.out, *v).map_err(msgpack)
            }
            Value::Str(v) => {
                self.head(2, tag::STR)?;
                mp::write_str(self.out, v).map_err(msgpack)
            }
            Value::Bytes(_) => {
                self.head(2, tag::BYTES)?;
                self.reference()
            }
            Value::List(items) => self.list(items),
            Value::Map(entries) => {
                self.head(2, tag::MAP)?;
                let len = u32::try_from(entries.len()).map_err(msgpack)?;
                mp::write_map_len(self.out, len).map_err(msgpack)?;
                entries.iter().try_for_each(|(k, v)| {
                    mp::write_str(self.out, k).map_err(msgpack)?;
                    self.node(v)
                })
            }
            Value::Tensor(tensor) => {
                self.head(5, tag::TENSOR)?;
                self.tensor_head(tensor)?;
                self.reference()
            }
        }
    }
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

    /// A list of lists encodes as the value it stands for: the same meta, the same frames (the
    /// caller's own bytes), the same refusals at the limits.
    #[test]
    fn lists_encode_as_the_value_they_stand_for() {
        let big = Bytes::from(vec![5u8; 8192]);
        let a: Vec<Value> = vec![
            Tensor::from_slice(&[3], &[1.0f32, 2.0, 3.0])
                .unwrap()
                .into(),
            Tensor::new(DType::U8, &[8192], big.clone()).unwrap().into(),
            Value::Bytes(Bytes::from_static(b"xy")),
            Value::List(vec![Value::I64(-1), Value::from("s")]),
        ];
        let b: Vec<Value> = vec![
            Value::Null,
            Value::Bytes(big),
            Value::U64(7),
            Value::Bool(true),
        ];
        let empty: Vec<Value> = Vec::new();
        let cases: [&[&[Value]]; 4] = [&[&a, &b], &[&a], &[&empty, &b], &[]];
        for lists in cases {
            let value = Value::List(lists.iter().map(|l| Value::List(l.to_vec())).collect());
            let want = encode(&value).unwrap();
            let got = Encoder::new().encode_lists(lists).unwrap();
            assert_eq!(got.meta, want.meta);
            assert_eq!(got.payloads.len(), want.payloads.len());
            for (g, w) in got.payloads.iter().zip(&want.payloads) {
                assert_eq!(g, w);
            }
        }
        let value = Value::List(vec![Value::List(a.clone()), Value::List(b.clone())]);
        for (depth, elements) in [(3, 1000), (2, 1000), (4, 3), (4, 5), (4, 10)] {
            let mut lim = Limits::default();
            lim.max_depth = depth;
            lim.max_elements = elements;
            let e = Encoder::new().limits(lim);
            assert_eq!(
                e.encode_lists(&[&a, &b]),
                e.encode(&value),
                "{depth} {elements}"
            );
        }
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
