//! Meta frame + payload frames -> value, with every payload a slice of its frame.

use bytes::Bytes;

use crate::encode::tag;
use crate::tensor::Dims;
use crate::value::tensor_pointer;
use crate::wire::{FrameSpec, RecvLayout};
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
        let out = self.body(meta, &table, Payloads::Frames(frames), &[])?;
        Ok(out.0.unwrap_or(Value::Null))
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
        // Laid out as `split` checks it, but each payload is cut from `buf` directly: no
        // list of per-frame slices to build and drop.
        let layout = table.layout_within(buf.len(), align)?;
        let out = self.body(
            meta,
            &table,
            Payloads::Laid {
                buf: Some(buf),
                layout: &layout,
            },
            &[],
        )?;
        Ok(out.0.unwrap_or(Value::Null))
    }

    /// Decodes `meta` before its payload has landed, for a receiver that has the meta first
    /// and the frames later, written into one buffer at the offsets of
    /// [`FrameTable::layout`] with `align`: everything [`Decoder::decode_contiguous`] checks
    /// is checked now, and [`Unbound::bind`] then cuts the payloads from that buffer, which
    /// costs a walk over the value and no parsing.
    pub fn decode_unbound(&self, meta: &[u8], align: u64) -> Result<Unbound, DecodeError> {
        let table = self.frame_table(meta)?;
        let layout = table.layout_within(usize::MAX, align)?;
        let (value, places) = self.body(
            meta,
            &table,
            Payloads::Laid {
                buf: None,
                layout: &layout,
            },
            &[],
        )?;
        Ok(Unbound {
            value: value.unwrap_or(Value::Null),
            places,
            layout,
        })
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
        Ok(self.body(meta, &table, Payloads::Frames(frames), path)?.0)
    }

    fn body(
        &self,
        meta: &[u8],
        table: &FrameTable,
        frames: Payloads<'_>,
        path: &[PathSeg<'_>],
    ) -> Result<(Option<Value>, Vec<Place>), DecodeError> {
        let mut st = State {
            rd: Reader {
                buf: &meta[table.body_start..],
                pos: 0,
                base: table.body_start as u64,
            },
            frames,
            specs: table.frames(),
            limits: &self.limits,
            nodes: 0,
            runs: table.runs(),
            places: Vec::new(),
        };
        let out = st.node(1, path)?;
        if st.rd.pos != st.rd.buf.len() {
            return Err(st.rd.malformed("trailing bytes after the root value"));
        }
        Ok((out, st.places))
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

/// A value decoded before its payload landed ([`Decoder::decode_unbound`]): its tensors and
/// byte strings are empty until [`Unbound::bind`] cuts them from the buffer.
#[derive(Debug)]
pub struct Unbound {
    value: Value,
    places: Vec<Place>,
    layout: RecvLayout,
}

impl Unbound {
    /// Bytes the buffer must hold: the layout's size.
    pub fn size(&self) -> u64 {
        self.layout.size
    }

    /// Where each payload frame goes in the buffer: [`FrameTable::layout`] of the meta with
    /// the alignment it was decoded with.
    pub fn layout(&self) -> &RecvLayout {
        &self.layout
    }

    /// The value, each payload a slice of `buf` (the frames written at the layout's offsets),
    /// as [`Decoder::decode_contiguous`] of the same meta and buffer returns it.
    pub fn bind(self, buf: &Bytes) -> Result<Value, DecodeError> {
        if self.layout.size > buf.len() as u64 {
            return Err(DecodeError::BufferTooShort {
                needed: self.layout.size,
                available: buf.len() as u64,
            });
        }
        let Unbound {
            mut value, places, ..
        } = self;
        let mut places = places.into_iter();
        bind(&mut value, &mut places, buf);
        Ok(value)
    }
}

/// Puts the payloads in, in the order the decoder met them (depth first, in order).
fn bind(value: &mut Value, places: &mut std::vec::IntoIter<Place>, buf: &Bytes) {
    let cut = |places: &mut std::vec::IntoIter<Place>| match places.next().flatten() {
        Some((at, len)) => buf.slice(at..at + len),
        None => Bytes::new(),
    };
    match value {
        Value::Tensor(t) => t.bind(cut(places)),
        Value::Bytes(b) => *b = cut(places),
        Value::List(items) => items.iter_mut().for_each(|v| bind(v, places, buf)),
        Value::Map(entries) => entries.iter_mut().for_each(|(_, v)| bind(v, places, buf)),
        Value::Null
        | Value::Bool(_)
        | Value::I64(_)
        | Value::U64(_)
        | Value::F64(_)
        | Value::Str(_) => {}
    }
}

/// A strict msgpack reader over the meta body: every length is checked against the bytes left.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Offset of `buf` inside the meta frame, for error messages.
    base: u64,
}

impl<'a> Reader<'a> {
    fn malformed(&self, reason: impl Into<String>) -> DecodeError {
        DecodeError::Malformed {
            offset: self.base + self.pos as u64,
            reason: reason.into(),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        match self.buf.get(self.pos..).and_then(|rest| rest.get(..n)) {
            Some(bytes) => {
                self.pos += n;
                Ok(bytes)
            }
            None => Err(self.malformed(format!(
                "{n} bytes expected, {} left",
                self.buf.len() - self.pos
            ))),
        }
    }

    fn byte(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    fn be(&mut self, n: usize) -> Result<u64, DecodeError> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    }

    fn peek(&self) -> Option<u8> {
        self.buf.get(self.pos).copied()
    }

    /// Any msgpack integer, widened.
    fn integer(&mut self) -> Result<i128, DecodeError> {
        let m = self.byte()?;
        Ok(match m {
            0x00..=0x7f => i128::from(m),
            0xe0..=0xff => i128::from(m as i8),
            0xcc => i128::from(self.be(1)?),
            0xcd => i128::from(self.be(2)?),
            0xce => i128::from(self.be(4)?),
            0xcf => i128::from(self.be(8)?),
            0xd0 => i128::from(self.be(1)? as u8 as i8),
            0xd1 => i128::from(self.be(2)? as u16 as i16),
            0xd2 => i128::from(self.be(4)? as u32 as i32),
            0xd3 => i128::from(self.be(8)? as i64),
            _ => {
                self.pos -= 1;
                return Err(self.malformed(format!("integer expected, found marker {m:#04x}")));
            }
        })
    }

    #[inline(always)]
    fn uint(&mut self) -> Result<u64, DecodeError> {
        // A positive fixint (tags, dtype codes, frame numbers, small dims) read in place; the
        // other forms out of line.
        match self.peek() {
            Some(m @ 0x00..=0x7f) => {
                self.pos += 1;
                Ok(u64::from(m))
            }
            _ => self.uint_slow(),
        }
    }

    #[inline(never)]
    fn uint_slow(&mut self) -> Result<u64, DecodeError> {
        // The unsigned markers, the encoder's only ones for unsigned values, read directly;
        // anything else through `integer` (a non-negative signed value is accepted too).
        if let Some(m @ 0xcc..=0xcf) = self.peek() {
            let n = 1usize << (m - 0xcc);
            if let Some(b) = self.buf.get(self.pos + 1..self.pos + 1 + n) {
                self.pos += 1 + n;
                return Ok(b.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b)));
            }
        }
        let v = self.integer()?;
        u64::try_from(v)
            .map_err(|_| self.malformed(format!("unsigned integer expected, found {v}")))
    }

    fn int(&mut self) -> Result<i64, DecodeError> {
        let v = self.integer()?;
        i64::try_from(v).map_err(|_| self.malformed(format!("{v} does not fit in an i64")))
    }

    fn float(&mut self) -> Result<f64, DecodeError> {
        match self.byte()? {
            0xca => Ok(f64::from(f32::from_bits(self.be(4)? as u32))),
            0xcb => Ok(f64::from_bits(self.be(8)?)),
            m => Err(self.malformed(format!("float expected, found marker {m:#04x}"))),
        }
    }

    fn bool(&mut self) -> Result<bool, DecodeError> {
        match self.byte()? {
            0xc2 => Ok(false),
            0xc3 => Ok(true),
            m => Err(self.malformed(format!("bool expected, found marker {m:#04x}"))),
        }
    }

    /// Consumes a nil if one is next.
    fn nil(&mut self) -> bool {
        if self.peek() == Some(0xc0) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    #[inline]
    fn array(&mut self) -> Result<u64, DecodeError> {
        // A fixarray (every node's header, most shapes) read in place.
        if let Some(m @ 0x90..=0x9f) = self.peek() {
            self.pos += 1;
            return Ok(u64::from(m & 0x0f));
        }
        match self.byte()? {
            0xdc => self.be(2),
            0xdd => self.be(4),
            m => Err(self.malformed(format!("array expected, found marker {m:#04x}"))),
        }
    }

    fn map(&mut self) -> Result<u64, DecodeError> {
        match self.byte()? {
            m @ 0x80..=0x8f => Ok(u64::from(m & 0x0f)),
            0xde => self.be(2),
            0xdf => self.be(4),
            m => Err(self.malformed(format!("map expected, found marker {m:#04x}"))),
        }
    }

    fn str(&mut self) -> Result<&'a str, DecodeError> {
        let len = match self.byte()? {
            m @ 0xa0..=0xbf => u64::from(m & 0x1f),
            0xd9 => self.be(1)?,
            0xda => self.be(2)?,
            0xdb => self.be(4)?,
            m => return Err(self.malformed(format!("string expected, found marker {m:#04x}"))),
        };
        let start = self.pos;
        let bytes = self.take(len as usize)?;
        std::str::from_utf8(bytes).map_err(|e| DecodeError::Malformed {
            offset: self.base + (start + e.valid_up_to()) as u64,
            reason: "string is not UTF-8".into(),
        })
    }

    /// Skips one msgpack value of any kind, nesting at most `depth` levels.
    fn skip(&mut self, depth: u32, limit: u32) -> Result<(), DecodeError> {
        if depth > limit {
            return Err(DecodeError::TooDeep { limit });
        }
        let m = self.byte()?;
        let (items, bytes) = match m {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (0, 0),
            0x80..=0x8f => (2 * u64::from(m & 0x0f), 0),
            0x90..=0x9f => (u64::from(m & 0x0f), 0),
            0xa0..=0xbf => (0, u64::from(m & 0x1f)),
            0xc4 | 0xd9 => (0, self.be(1)?),
            0xc5 | 0xda => (0, self.be(2)?),
            0xc6 | 0xdb => (0, self.be(4)?),
            0xc7 => (0, self.be(1)? + 1),
            0xc8 => (0, self.be(2)? + 1),
            0xc9 => (0, self.be(4)? + 1),
            0xca => (0, 4),
            0xcb => (0, 8),
            0xcc | 0xd0 => (0, 1),
            0xcd | 0xd1 => (0, 2),
            0xce | 0xd2 => (0, 4),
            0xcf | 0xd3 => (0, 8),
            0xd4 => (0, 2),
            0xd5 => (0, 3),
            0xd6 => (0, 5),
            0xd7 => (0, 9),
            0xd8 => (0, 17),
            0xdc => (self.be(2)?, 0),
            0xdd => (self.be(4)?, 0),
            0xde => (2 * self.be(2)?, 0),
            0xdf => (2 * self.be(4)?, 0),
            0xc1 => return Err(self.malformed("reserved marker 0xc1")),
        };
        self.take(bytes as usize)?;
        // Each item takes at least one byte, so a lying count ends at the end of the input.
        for _ in 0..items {
            self.skip(depth + 1, limit)?;
        }
        Ok(())
    }
}

/// Where payloads are cut from: frames received one by one, or one buffer holding them at
/// the offsets of a layout.
#[derive(Clone, Copy)]
enum Payloads<'f> {
    Frames(&'f [Bytes]),
    /// Laid out in one buffer; `None` before the payload landed: each payload's place is
    /// recorded instead (`Decoder::decode_unbound`).
    Laid {
        buf: Option<&'f Bytes>,
        layout: &'f RecvLayout,
    },
}

impl Payloads<'_> {
    fn count(&self) -> usize {
        match self {
            Payloads::Frames(f) => f.len(),
            Payloads::Laid { layout, .. } => layout.offsets.len(),
        }
    }

    /// Frame `i`: the bytes it lies in (none yet for an unbound decode), and its start and
    /// length there.
    fn frame(&self, i: usize) -> Option<(Option<&Bytes>, usize, usize)> {
        match self {
            Payloads::Frames(f) => f.get(i).map(|b| (Some(b), 0, b.len())),
            Payloads::Laid { buf, layout } => {
                let (&at, &len) = (layout.offsets.get(i)?, layout.lens.get(i)?);
                Some((*buf, at as usize, len as usize))
            }
        }
    }
}

/// Decoding state: the reader, the frames payloads are cut from, and the budgets.
struct State<'a, 'f> {
    rd: Reader<'a>,
    frames: Payloads<'f>,
    specs: &'f [FrameSpec],
    limits: &'f Limits,
    nodes: u64,
    /// The header allows tensor list runs (`FLAG_RUNS`).
    runs: bool,
    /// Where each payload lies in the buffer, in the order the value's payloads are met,
    /// while no buffer is bound.
    places: Vec<Place>,
}

/// A payload's range in the buffer (`None`: it has no bytes).
type Place = Option<(usize, usize)>;

/// What a tensor node says of its tensor besides its payload.
#[derive(Clone)]
struct TensorHead {
    dtype: DType,
    shape: Dims,
    strides: Option<Dims>,
}

/// Where the payloads of a tensor list run lie: frames `frame ..` one each, or `packed` as
/// `(offset, len, stride)` in `frame`.
struct RunRef {
    frame: u64,
    packed: Option<(u64, u64, u64)>,
    count: u64,
}

/// How many items a node array of each tag has, the tag included.
const ARITY: [u64; 11] = [1, 2, 2, 2, 2, 2, 2, 2, 2, 5, 5];

impl State<'_, '_> {
    fn count(&mut self, extra: u64) -> Result<(), DecodeError> {
        self.nodes = self.nodes.saturating_add(extra);
        if self.nodes > self.limits.max_elements {
            return Err(DecodeError::TooManyElements {
                limit: self.limits.max_elements,
            });
        }
        Ok(())
    }

    /// Elements still allowed: a declared length beyond this is refused before reserving.
    fn check_len(&self, len: u64) -> Result<(), DecodeError> {
        if len > self.limits.max_elements.saturating_sub(self.nodes) {
            return Err(DecodeError::TooManyElements {
                limit: self.limits.max_elements,
            });
        }
        Ok(())
    }

    /// Capacity to reserve for `len` items: never more than the bytes left could hold.
    fn capacity(&self, len: u64) -> usize {
        let left = (self.rd.buf.len() - self.rd.pos) as u64;
        len.min(left / 2) as usize
    }

    fn skip_limit(&self) -> u32 {
        self.limits.max_depth.saturating_mul(2).saturating_add(8)
    }

    /// One value node; with a non-empty `path`, only the part on the path is built.
    fn node(&mut self, depth: u32, path: &[PathSeg<'_>]) -> Result<Option<Value>, DecodeError> {
        let node = self.nodes;
        if depth > self.limits.max_depth {
            return Err(DecodeError::TooDeep {
                limit: self.limits.max_depth,
            });
        }
        if path.is_empty() {
            self.count(1)?;
        }
        let items = self.rd.array()?;
        if items == 0 {
            return Err(self.rd.malformed("value node without a tag"));
        }
        let t = self.rd.uint()?;
        let arity = match ARITY.get(t as usize) {
            Some(_) if t == u64::from(tag::TENSORS) && !self.runs => {
                return Err(DecodeError::UnknownTag { tag: t, node })
            }
            Some(&a) if t < ARITY.len() as u64 => a,
            _ => return Err(DecodeError::UnknownTag { tag: t, node }),
        };
        if items != arity {
            return Err(self.rd.malformed(format!(
                "node with tag {t} has {items} items, {arity} expected"
            )));
        }
        let t = t as u8;
        match (t, path.split_first()) {
            (_, None) => self.content(node, depth, t).map(Some),
            (tag::LIST, Some((PathSeg::Index(i), rest))) => {
                let len = self.rd.array()?;
                let mut found = None;
                for j in 0..len {
                    if j == *i {
                        found = self.node(depth + 1, rest)?;
                    } else {
                        self.rd.skip(0, self.skip_limit())?;
                    }
                }
                Ok(found)
            }
            (tag::MAP, Some((PathSeg::Key(k), rest))) => {
                let len = self.rd.map()?;
                let mut found = None;
                let mut done = false;
                for _ in 0..len {
                    let key = self.rd.str()?;
                    if !done && key == *k {
                        done = true;
                        found = self.node(depth + 1, rest)?;
                    } else {
                        self.rd.skip(0, self.skip_limit())?;
                    }
                }
                Ok(found)
            }
            (tag::TENSOR, Some((PathSeg::Index(_), _))) => {
                self.count(1)?;
                match self.content(node, depth, t)? {
                    Value::Tensor(tensor) => Ok(tensor_pointer(&tensor, path)),
                    _ => Ok(None),
                }
            }
            (tag::TENSORS, Some((PathSeg::Index(i), rest))) => {
                let (head, run) = self.tensors_head(node)?;
                if *i >= run.count {
                    return Ok(None);
                }
                self.count(1)?;
                let item = self.run_item(node, &head, &run, *i)?;
                match rest.is_empty() {
                    true => Ok(Some(Value::Tensor(item))),
                    false => Ok(tensor_pointer(&item, rest)),
                }
            }
            _ => {
                for _ in 1..arity {
                    self.rd.skip(0, self.skip_limit())?;
                }
                Ok(None)
            }
        }
    }

    /// The items of a node after its tag, decoded in full.
    fn content(&mut self, node: u64, depth: u32, t: u8) -> Result<Value, DecodeError> {
        Ok(match t {
            tag::NULL => Value::Null,
            tag::BOOL => Value::Bool(self.rd.bool()?),
            tag::I64 => Value::I64(self.rd.int()?),
            tag::U64 => Value::U64(self.rd.uint()?),
            tag::F64 => Value::F64(self.rd.float()?),
            tag::STR => Value::Str(self.rd.str()?.to_owned()),
            tag::BYTES => {
                let r = self.reference()?;
                Value::Bytes(self.payload(node, r, 1)?)
            }
            tag::LIST => {
                let len = self.rd.array()?;
                self.check_len(len)?;
                let mut items = Vec::with_capacity(self.capacity(len));
                for _ in 0..len {
                    items.push(self.node(depth + 1, &[])?.unwrap_or(Value::Null));
                }
                Value::List(items)
            }
            tag::MAP => {
                let len = self.rd.map()?;
                self.check_len(len)?;
                let mut entries = Vec::with_capacity(self.capacity(len));
                for _ in 0..len {
                    let key = self.rd.str()?.to_owned();
                    let value = self.node(depth + 1, &[])?.unwrap_or(Value::Null);
                    entries.push((key, value));
                }
                Value::Map(entries)
            }
            tag::TENSORS => {
                let (head, run) = self.tensors_head(node)?;
                // Counted as the tensors a list node would hold, and refused past the limits
                // before anything is reserved for them.
                self.check_len(run.count)?;
                self.count(run.count)?;
                let mut items = Vec::with_capacity(run.count as usize);
                // The first tensor is checked as any; those after it differ from it only in
                // where their payload lies.
                let first = self.run_item(node, &head, &run, 0)?;
                items.push(Value::Tensor(first.clone()));
                for i in 1..run.count {
                    let next = match self.run_next(&first, &run, i) {
                        Some(t) => t,
                        None => self.run_item(node, &head, &run, i)?,
                    };
                    items.push(Value::Tensor(next));
                }
                Value::List(items)
            }
            _ => Value::Tensor(self.tensor(node)?),
        })
    }

    /// The items of a tensor list node (tag 10) after its tag: what its tensors share, and
    /// where their payloads lie, checked to lie inside the frames before any is built.
    fn tensors_head(&mut self, node: u64) -> Result<(TensorHead, RunRef), DecodeError> {
        let head = self.tensor_head(node)?;
        let n = self.rd.array()?;
        let (frame, packed) = match n {
            2 => (self.rd.uint()?, None),
            5 => {
                let frame = self.rd.uint()?;
                let (offset, len, stride) = (self.rd.uint()?, self.rd.uint()?, self.rd.uint()?);
                (frame, Some((offset, len, stride)))
            }
            _ => {
                return Err(self
                    .rd
                    .malformed(format!("tensor list run has {n} items, 2 or 5 expected")))
            }
        };
        let count = self.rd.uint()?;
        if count == 0 {
            return Err(self.rd.malformed("tensor list run of no tensors"));
        }
        let frames = self.frames.count() as u64;
        let run = RunRef {
            frame,
            packed,
            count,
        };
        let fits = match packed {
            // One frame each: all of them in the table.
            None => frame.checked_add(count).is_some_and(|end| end <= frames),
            // Every item inside the frame, none overlapping the next (so their count is
            // bounded by the frame's bytes).
            Some((offset, len, stride)) => {
                let frame_len = usize::try_from(frame)
                    .ok()
                    .and_then(|f| self.frames.frame(f))
                    .map(|(_, _, l)| l as u64);
                let end = (count - 1)
                    .checked_mul(stride)
                    .and_then(|d| d.checked_add(offset))
                    .and_then(|d| d.checked_add(len));
                len > 0
                    && stride >= len
                    && matches!((end, frame_len), (Some(end), Some(fl)) if end <= fl)
            }
        };
        if !fits {
            return Err(self.rd.malformed(format!(
                "tensor list run of {count} from frame {frame} does not lie inside the frames"
            )));
        }
        Ok((head, run))
    }

    /// Tensor `i` of a tensor list run whose first tensor `first` was built and checked:
    /// `None` where `i` needs checks of its own (a strided run, a frame of another length or
    /// alignment, a stride off the dtype's alignment), for [`State::run_item`] to make.
    fn run_next(&mut self, first: &Tensor, run: &RunRef, i: u64) -> Option<Tensor> {
        if first.strides().is_some() {
            return None;
        }
        // Its payload's length (unbound, its data is still empty).
        let len = crate::tensor::contiguous_bytes(first.dtype(), first.shape())?;
        let align = first.dtype().align() as u64;
        let (frame, offset) = match run.packed {
            // The run's extent was checked against the frame (`tensors_head`).
            Some((offset, _, stride)) if stride % align == 0 => (run.frame, offset + i * stride),
            Some(_) => return None,
            None => {
                let f = usize::try_from(run.frame + i).ok()?;
                let spec = self.specs.get(f)?;
                if spec.len != len || spec.align < align {
                    return None;
                }
                (run.frame + i, 0)
            }
        };
        let (data, start, _) = self.frames.frame(usize::try_from(frame).ok()?)?;
        let at = start + offset as usize;
        let data = match data {
            Some(data) => data.slice(at..at + len as usize),
            None => {
                self.places.push(Some((at, len as usize)));
                Bytes::new()
            }
        };
        Some(first.with_data(data))
    }

    /// Tensor `i` of a tensor list run.
    fn run_item(
        &mut self,
        node: u64,
        head: &TensorHead,
        run: &RunRef,
        i: u64,
    ) -> Result<Tensor, DecodeError> {
        let r = match run.packed {
            None => {
                let frame = run.frame + i;
                let len = usize::try_from(frame)
                    .ok()
                    .and_then(|f| self.frames.frame(f))
                    .map_or(0, |(_, _, l)| l as u64);
                (frame, 0, len)
            }
            Some((offset, len, stride)) => (run.frame, offset + i * stride, len),
        };
        self.tensor_of(node, head.clone(), Some(r))
    }

    fn tensor(&mut self, node: u64) -> Result<Tensor, DecodeError> {
        let head = self.tensor_head(node)?;
        let r = self.reference()?;
        self.tensor_of(node, head, r)
    }

    /// A tensor node's dtype, shape and strides.
    fn tensor_head(&mut self, node: u64) -> Result<TensorHead, DecodeError> {
        let code = self.rd.uint()?;
        let Some(dtype) = u8::try_from(code).ok().and_then(DType::from_code) else {
            return Err(DecodeError::UnknownDType { code, node });
        };
        let shape = self.dims(node)?;
        let strides = if self.rd.nil() {
            None
        } else {
            Some(self.dims(node)?)
        };
        Ok(TensorHead {
            dtype,
            shape,
            strides,
        })
    }

    /// The tensor of `head` over the payload `r` points at.
    fn tensor_of(
        &mut self,
        node: u64,
        head: TensorHead,
        r: Option<(u64, u64, u64)>,
    ) -> Result<Tensor, DecodeError> {
        let TensorHead {
            dtype,
            shape,
            strides,
        } = head;
        let len = r.map_or(0, |(_, _, len)| len);
        let data = self.payload(node, r, dtype.align() as u64)?;
        // A broadcast tensor's logical size may exceed its payload: bound it like the payloads,
        // so that a later explicit copy stays within what the limits allow.
        if let Some(bytes) = crate::tensor::contiguous_bytes(dtype, &shape) {
            if bytes > self.limits.max_total_bytes {
                return Err(DecodeError::TooLarge {
                    bytes,
                    limit: self.limits.max_total_bytes,
                });
            }
        }
        Tensor::from_parts_of_len(dtype, shape, strides, data, len)
            .map_err(|source| DecodeError::Tensor { node, source })
    }

    /// Shape or strides: at most `max_rank` integers, refused before reserving beyond that.
    fn dims(&mut self, node: u64) -> Result<Dims, DecodeError> {
        let len = self.rd.array()?;
        let limit = self.limits.max_rank.min(Tensor::MAX_RANK as u32);
        if len > u64::from(limit) {
            return Err(DecodeError::RankTooHigh { node, limit });
        }
        // Up to the inline capacity, read into an array and moved in whole.
        let mut inline = [0u64; 4];
        if let Some(head) = inline.get_mut(..len as usize) {
            for d in head {
                *d = self.rd.uint()?;
            }
            return Ok(Dims::from_buf_and_len(inline, len as usize));
        }
        let mut dims = Dims::with_capacity(len as usize);
        for _ in 0..len {
            dims.push(self.rd.uint()?);
        }
        Ok(dims)
    }

    /// `nil` or `[frame, offset, len]`.
    fn reference(&mut self) -> Result<Option<(u64, u64, u64)>, DecodeError> {
        if self.rd.nil() {
            return Ok(None);
        }
        let n = self.rd.array()?;
        if n != 3 {
            return Err(self
                .rd
                .malformed(format!("payload reference has {n} items, 3 expected")));
        }
        Ok(Some((self.rd.uint()?, self.rd.uint()?, self.rd.uint()?)))
    }

    /// The payload a reference points at, as a slice of its frame.
    fn payload(
        &mut self,
        node: u64,
        r: Option<(u64, u64, u64)>,
        align: u64,
    ) -> Result<Bytes, DecodeError> {
        let unbound = matches!(self.frames, Payloads::Laid { buf: None, .. });
        let Some((frame, offset, len)) = r else {
            if unbound {
                self.places.push(None);
            }
            return Ok(Bytes::new());
        };
        let frames = self.frames.count() as u64;
        let index = usize::try_from(frame).ok();
        let (Some((data, start, frame_len)), Some(spec)) = (
            index.and_then(|f| self.frames.frame(f)),
            index.and_then(|f| self.specs.get(f)),
        ) else {
            return Err(DecodeError::FrameIndex {
                node,
                frame,
                frames,
            });
        };
        let frame_len = frame_len as u64;
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
        let at = start + offset as usize;
        match data {
            Some(data) => Ok(data.slice(at..at + len as usize)),
            None => {
                self.places.push(Some((at, len as usize)));
                Ok(Bytes::new())
            }
        }
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
        crate::wire::write_header(&mut out, frames, false);
        out.extend_from_slice(body);
        out
    }

    /// `value`'s frames laid out in one buffer with `align`, and its meta.
    fn laid(value: &Value, align: u64) -> (Bytes, Bytes) {
        let f = encode(value).unwrap();
        let l = f.layout(align).unwrap();
        let mut buf = vec![0u8; l.size as usize];
        for (i, p) in f.payloads.iter().enumerate() {
            buf[l.range(i)].copy_from_slice(p);
        }
        (f.meta, Bytes::from(buf))
    }

    /// Every payload's address, depth first.
    fn addresses(v: &Value, out: &mut Vec<(usize, usize)>) {
        match v {
            Value::Tensor(t) => out.push((t.data().as_ptr() as usize, t.data().len())),
            Value::Bytes(b) => out.push((b.as_ptr() as usize, b.len())),
            Value::List(items) => items.iter().for_each(|v| addresses(v, out)),
            Value::Map(e) => e.iter().for_each(|(_, v)| addresses(v, out)),
            _ => {}
        }
    }

    #[test]
    fn an_unbound_decode_binds_to_what_a_contiguous_decode_returns() {
        let packed = Tensor::from_slice(&[3], &[1u16, 2, 3]).unwrap();
        let strided = Tensor::from_parts(
            DType::I32,
            [2u64, 2].as_slice().into(),
            Some([1u64, 2].as_slice().into()),
            Bytes::from(vec![5u8; 16]),
        )
        .unwrap();
        let empty = Tensor::from_slice::<f32>(&[0], &[]).unwrap();
        let v = Value::map([
            ("sample", sample()),
            ("packed", packed.into()),
            ("strided", strided.into()),
            ("empty", empty.into()),
            ("nothing", Value::Bytes(Bytes::new())),
            (
                "rows",
                Value::List(
                    (0..50u32)
                        .map(|i| {
                            Tensor::from_slice(&[i as u64 + 1], &vec![i; i as usize + 1])
                                .unwrap()
                                .into()
                        })
                        .collect(),
                ),
            ),
        ]);
        for align in [64, 4096] {
            let (meta, buf) = laid(&v, align);
            let unbound = Decoder::new().decode_unbound(&meta, align).unwrap();
            assert_eq!(unbound.size(), buf.len() as u64);
            let bound = unbound.bind(&buf).unwrap();
            let direct = decode_contiguous(&meta, &buf, align).unwrap();
            assert_eq!(bound, v);
            assert_eq!(bound, direct);
            let (mut a, mut b) = (Vec::new(), Vec::new());
            addresses(&bound, &mut a);
            addresses(&direct, &mut b);
            let base = buf.as_ptr() as usize;
            let inside =
                |&(p, n): &(usize, usize)| n == 0 || (p >= base && p + n <= base + buf.len());
            assert_eq!(
                a.iter().filter(|x| x.1 > 0).collect::<Vec<_>>(),
                b.iter().filter(|x| x.1 > 0).collect::<Vec<_>>()
            );
            assert!(a.iter().all(inside));
        }
    }

    #[test]
    fn an_unbound_decode_refuses_what_a_contiguous_one_does_and_a_short_buffer_at_bind() {
        let spec = [FrameSpec { len: 16, align: 4 }];
        let buf = Bytes::from(vec![0u8; 64]);
        for body in [
            &[0x95, 9, 11, 0x91, 2, 0xc0, 0x93, 0, 2, 8][..],
            &[0x95, 9, 11, 0x91, 2, 0xc0, 0x93, 0, 12, 8],
            &[0x95, 9, 11, 0x91, 2, 0xc0, 0x93, 3, 0, 8],
            &[0x95, 9, 11, 0x91, 3, 0xc0, 0x93, 0, 0, 8],
            &[0x95, 9, 11, 0x91, 2, 0xc0, 0x93, 0, 0, 8, 0],
        ] {
            let m = meta_with(&spec, body);
            let unbound = Decoder::new().decode_unbound(&m, 64).unwrap_err();
            let direct = decode_contiguous(&m, &buf, 64).unwrap_err();
            assert_eq!(unbound.to_string(), direct.to_string());
        }
        let m = meta_with(&spec, &[0x95, 9, 11, 0x91, 2, 0xc0, 0x93, 0, 8, 8]);
        let unbound = Decoder::new().decode_unbound(&m, 64).unwrap();
        assert!(matches!(
            unbound.bind(&buf.slice(..15)),
            Err(DecodeError::BufferTooShort {
                needed: 16,
                available: 15
            })
        ));
    }

    #[test]
    fn a_contiguous_buffer_bounds_each_payload_by_its_own_frame() {
        // Two 16-byte frames laid out back to back in one 64-aligned buffer of 80 bytes.
        let spec = [
            FrameSpec { len: 16, align: 4 },
            FrameSpec { len: 16, align: 4 },
        ];
        let buf = Bytes::from(vec![0u8; 80]);
        // Frame 1, offset 8, 8 bytes: the buffer's bytes 72..80.
        let m = meta_with(&spec, &[0x95, 9, 11, 0x91, 2, 0xc0, 0x93, 1, 8, 8]);
        let v = decode_contiguous(&m, &buf, 64).unwrap();
        let t = v.as_tensor().unwrap();
        assert_eq!(t.data().as_ptr() as usize - buf.as_ptr() as usize, 72);
        // Frame 0, offset 12, 8 bytes: inside the buffer, past its frame.
        let m = meta_with(&spec, &[0x95, 9, 11, 0x91, 2, 0xc0, 0x93, 0, 12, 8]);
        assert!(matches!(
            decode_contiguous(&m, &buf, 64),
            Err(DecodeError::OutOfBounds {
                frame: 0,
                frame_len: 16,
                ..
            })
        ));
        // No frame 2.
        let m = meta_with(&spec, &[0x95, 9, 11, 0x91, 2, 0xc0, 0x93, 2, 0, 8]);
        assert!(matches!(
            decode_contiguous(&m, &buf, 64),
            Err(DecodeError::FrameIndex {
                frame: 2,
                frames: 2,
                ..
            })
        ));
        // A buffer shorter than the layout.
        assert!(matches!(
            decode_contiguous(&m, &buf.slice(..79), 64),
            Err(DecodeError::BufferTooShort { needed: 80, .. })
        ));
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
