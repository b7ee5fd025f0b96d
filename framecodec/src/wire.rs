//! The meta frame's binary header and frame table, `Frames`, and receive layouts.

use std::ops::Range;

use bytes::Bytes;
use smallvec::SmallVec;

use crate::{DecodeError, LayoutError, Limits};

/// The first four bytes of every meta frame.
pub const MAGIC: [u8; 4] = *b"TSFC";
/// The wire format version this crate writes and reads.
pub const VERSION: u16 = 1;
/// Default alignment of each frame inside a contiguous receive buffer, in bytes.
pub const DEFAULT_ALIGN: u64 = 64;
/// The largest alignment a frame table entry may carry.
pub const MAX_FRAME_ALIGN: u64 = 4096;
/// Header flag: the frame table is written as runs of equal frames, and the body may hold
/// tensor lists (tag 10). See `WIRE.md`.
pub const FLAG_RUNS: u16 = 1;

pub(crate) const HEADER_LEN: usize = 16;
pub(crate) const ENTRY_LEN: usize = 16;

/// Payload frames, inline up to four.
pub type FrameList = SmallVec<[Bytes; 4]>;

/// An encoded value: one small meta frame and the payload frames it refers to.
///
/// Each payload frame is either a caller's own `Bytes` (the same memory, no copy) or the one
/// shared frame into which small payloads were packed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frames {
    /// Header, frame table and msgpack body (see `WIRE.md`).
    pub meta: Bytes,
    /// Payload frames, in frame-table order.
    pub payloads: FrameList,
}

impl Frames {
    /// Sum of the payload frame lengths.
    pub fn payload_bytes(&self) -> u64 {
        self.payloads.iter().map(|f| f.len() as u64).sum()
    }

    /// Number of frames on the wire, the meta frame included.
    pub fn frame_count(&self) -> usize {
        1 + self.payloads.len()
    }

    /// Same as [`layout`].
    pub fn layout(&self, align: u64) -> Result<RecvLayout, LayoutError> {
        layout(self, align)
    }
}

/// One entry of the frame table: a payload frame's length and the alignment it needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameSpec {
    /// Length in bytes.
    pub len: u64,
    /// Alignment its contents need, a power of two (the largest dtype alignment inside).
    pub align: u64,
}

/// The frame table of a meta frame, read without touching the msgpack body: all a receiver
/// needs to size and lay out its receive buffer before any payload arrives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameTable {
    frames: Vec<FrameSpec>,
    total: u64,
    runs: bool,
    pub(crate) body_start: usize,
}

impl FrameTable {
    /// Reads and checks the header and frame table of `meta` against `limits`. Allocates only
    /// after the table's length has been checked against the bytes present, and a run's
    /// frames after its repeat has been checked against the header's frame count.
    pub fn parse(meta: &[u8], limits: &Limits) -> Result<Self, DecodeError> {
        let available = meta.len() as u64;
        if available > limits.max_meta_bytes {
            return Err(DecodeError::MetaTooLarge {
                bytes: available,
                limit: limits.max_meta_bytes,
            });
        }
        let Some(header) = meta.get(..HEADER_LEN) else {
            return Err(DecodeError::Truncated {
                needed: HEADER_LEN as u64,
                available,
            });
        };
        let found: [u8; 4] = [header[0], header[1], header[2], header[3]];
        if found != MAGIC {
            return Err(DecodeError::BadMagic { found });
        }
        let version = u16::from_le_bytes([header[4], header[5]]);
        if version != VERSION {
            return Err(DecodeError::UnsupportedVersion {
                version,
                supported: VERSION,
            });
        }
        let flags = u16::from_le_bytes([header[6], header[7]]);
        if flags & !FLAG_RUNS != 0 {
            return Err(DecodeError::UnknownFlags {
                flags: flags & !FLAG_RUNS,
            });
        }
        let runs = flags & FLAG_RUNS != 0;
        let count = u32::from_le_bytes([header[8], header[9], header[10], header[11]]);
        let entries = u32::from_le_bytes([header[12], header[13], header[14], header[15]]);
        if !runs && entries != 0 {
            return Err(DecodeError::Reserved { offset: 12 });
        }
        if count > limits.max_frames {
            return Err(DecodeError::TooManyFrames {
                count: count.into(),
                limit: limits.max_frames,
            });
        }
        // Without runs, one entry per frame.
        let entries = if runs { entries } else { count };
        if entries > count {
            return Err(DecodeError::FrameRuns {
                reason: format!("{entries} table entries for {count} frames"),
            });
        }
        let needed = HEADER_LEN as u64 + ENTRY_LEN as u64 * u64::from(entries);
        if needed > available {
            return Err(DecodeError::Truncated { needed, available });
        }
        // Reserved for what the entries present can hold: with runs, the entries' repeats are
        // reserved as they are checked (each within the header's count, itself within
        // `max_frames`).
        let mut frames = Vec::with_capacity(entries as usize);
        let mut total = 0u64;
        for (i, entry) in meta[HEADER_LEN..needed as usize]
            .chunks_exact(ENTRY_LEN)
            .enumerate()
        {
            let len = u64::from_le_bytes(entry[0..8].try_into().unwrap_or_default());
            let align = u64::from(u32::from_le_bytes(
                entry[8..12].try_into().unwrap_or_default(),
            ));
            let repeat = u32::from_le_bytes(entry[12..16].try_into().unwrap_or_default());
            let repeat = match (runs, repeat) {
                (false, 0) => 1,
                (false, _) => {
                    return Err(DecodeError::Reserved {
                        offset: (HEADER_LEN + i * ENTRY_LEN + 12) as u64,
                    })
                }
                (true, 0) => {
                    return Err(DecodeError::FrameRuns {
                        reason: format!("table entry {i} repeats its frame 0 times"),
                    })
                }
                (true, r) => r,
            };
            // The repeats are checked against the header's count before they are allocated.
            if frames.len() as u64 + u64::from(repeat) > u64::from(count) {
                return Err(DecodeError::FrameRuns {
                    reason: format!("the table's runs hold more than the {count} frames"),
                });
            }
            if !align.is_power_of_two() || align > MAX_FRAME_ALIGN {
                return Err(DecodeError::FrameAlign {
                    frame: frames.len() as u64,
                    align,
                });
            }
            total = total.saturating_add(len.saturating_mul(repeat.into()));
            if total > limits.max_total_bytes {
                return Err(DecodeError::TooLarge {
                    bytes: total,
                    limit: limits.max_total_bytes,
                });
            }
            frames.extend(std::iter::repeat_n(
                FrameSpec { len, align },
                repeat as usize,
            ));
        }
        if frames.len() != count as usize {
            return Err(DecodeError::FrameRuns {
                reason: format!(
                    "the table's runs hold {} frames, the header says {count}",
                    frames.len()
                ),
            });
        }
        Ok(Self {
            frames,
            total,
            runs,
            body_start: needed as usize,
        })
    }

    /// Whether the header says [`FLAG_RUNS`]: the body may hold tensor list runs.
    pub fn runs(&self) -> bool {
        self.runs
    }

    /// The payload frames, in order.
    pub fn frames(&self) -> &[FrameSpec] {
        &self.frames
    }

    /// Sum of the payload frame lengths (checked against `Limits::max_total_bytes`).
    pub fn total_bytes(&self) -> u64 {
        self.total
    }

    /// Where each frame goes in one contiguous receive buffer: frame `i` at an offset aligned
    /// to `max(align, its own alignment)`, back to back in order, with no trailing padding.
    pub fn layout(&self, align: u64) -> Result<RecvLayout, LayoutError> {
        recv_layout(self.frames.iter().copied(), align)
    }

    /// Checks that `frames` match the table in number and lengths.
    pub(crate) fn check_frames(&self, frames: &[Bytes]) -> Result<(), DecodeError> {
        if frames.len() != self.frames.len() {
            return Err(DecodeError::FrameCount {
                expected: self.frames.len() as u64,
                actual: frames.len() as u64,
            });
        }
        for (i, (spec, frame)) in self.frames.iter().zip(frames).enumerate() {
            if spec.len != frame.len() as u64 {
                return Err(DecodeError::FrameLength {
                    frame: i as u64,
                    expected: spec.len,
                    actual: frame.len() as u64,
                });
            }
        }
        Ok(())
    }

    /// Cuts the payload frames out of a contiguous buffer laid out by [`FrameTable::layout`]
    /// with `align`. Each frame is a slice of `buf`: no copy.
    pub fn split(&self, buf: &Bytes, align: u64) -> Result<FrameList, DecodeError> {
        let layout = self.layout_within(buf.len(), align)?;
        Ok((0..self.frames.len())
            .map(|i| buf.slice(layout.range(i)))
            .collect())
    }

    /// The layout with `align`, checked to fit a buffer of `available` bytes.
    pub(crate) fn layout_within(
        &self,
        available: usize,
        align: u64,
    ) -> Result<RecvLayout, DecodeError> {
        let layout = self.layout(align).map_err(|e| match e {
            LayoutError::InvalidAlignment { align } => DecodeError::InvalidAlignment { align },
            _ => DecodeError::TooLarge {
                bytes: u64::MAX,
                limit: u64::MAX,
            },
        })?;
        if layout.size > available as u64 {
            return Err(DecodeError::BufferTooShort {
                needed: layout.size,
                available: available as u64,
            });
        }
        Ok(layout)
    }
}

/// Offsets of the payload frames inside one contiguous receive buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecvLayout {
    /// Offset of each payload frame from the start of the buffer.
    pub offsets: Vec<u64>,
    /// Length of each payload frame.
    pub lens: Vec<u64>,
    /// Bytes from the buffer's start to the end of the last frame.
    pub size: u64,
    /// The buffer must start at a multiple of this for the offsets to keep their alignment.
    pub align: u64,
}

impl RecvLayout {
    /// Byte range of frame `i` in the buffer. Panics when `i` is out of range, like indexing.
    pub fn range(&self, i: usize) -> Range<usize> {
        let start = self.offsets[i] as usize;
        start..start + self.lens[i] as usize
    }
}

/// The receive layout of `frames` with every frame aligned to at least `align` bytes (use
/// [`DEFAULT_ALIGN`], 64, unless the receiver wants more) and to its own table alignment. The
/// receiver computes the same layout from the meta frame alone with [`FrameTable::layout`].
pub fn layout(frames: &Frames, align: u64) -> Result<RecvLayout, LayoutError> {
    let table = FrameTable::parse(&frames.meta, &Limits::unlimited())
        .map_err(|e| LayoutError::Meta(Box::new(e)))?;
    if table.frames.len() != frames.payloads.len() {
        return Err(LayoutError::FrameCount {
            table: table.frames.len(),
            actual: frames.payloads.len(),
        });
    }
    for (i, (spec, frame)) in table.frames.iter().zip(&frames.payloads).enumerate() {
        if spec.len != frame.len() as u64 {
            return Err(LayoutError::FrameLength {
                frame: i,
                table: spec.len,
                actual: frame.len() as u64,
            });
        }
    }
    table.layout(align)
}

fn recv_layout(
    frames: impl ExactSizeIterator<Item = FrameSpec>,
    align: u64,
) -> Result<RecvLayout, LayoutError> {
    if !align.is_power_of_two() {
        return Err(LayoutError::InvalidAlignment { align });
    }
    let mut items = Vec::with_capacity(frames.len());
    let mut lens = Vec::with_capacity(frames.len());
    for f in frames {
        items.push(
            tessera_alloc::Layout::new(f.len, f.align.max(align))
                .map_err(|_| LayoutError::InvalidAlignment { align: f.align })?,
        );
        lens.push(f.len);
    }
    let packing = tessera_alloc::pack(&items).map_err(|_| LayoutError::Overflow)?;
    let size = packing.size;
    if usize::try_from(size).is_err() {
        return Err(LayoutError::Overflow);
    }
    Ok(RecvLayout {
        offsets: packing.offsets,
        lens,
        size,
        align: packing.align.max(align),
    })
}

/// Writes the header and table for `frames` (length, alignment) into a fresh meta buffer:
/// one entry per frame, or with `runs` ([`FLAG_RUNS`]) one per run of equal frames.
pub(crate) fn write_header(out: &mut Vec<u8>, frames: &[FrameSpec], runs: bool) {
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    if !runs {
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&(frames.len() as u32).to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        for f in frames {
            entry(out, f, 0);
        }
        return;
    }
    out.extend_from_slice(&FLAG_RUNS.to_le_bytes());
    out.extend_from_slice(&(frames.len() as u32).to_le_bytes());
    let entries_at = out.len();
    out.extend_from_slice(&[0; 4]);
    let mut entries = 0u32;
    for run in frames.chunk_by(|a, b| a == b) {
        entry(out, &run[0], run.len() as u32);
        entries += 1;
    }
    out[entries_at..entries_at + 4].copy_from_slice(&entries.to_le_bytes());
}

/// Whether the frame table written as runs would hold a run of at least `min` equal frames.
pub(crate) fn has_run(frames: &[FrameSpec], min: usize) -> bool {
    frames.chunk_by(|a, b| a == b).any(|run| run.len() >= min)
}

/// One table entry: the frame's length and alignment, and how many times it repeats (0 in
/// a table without runs).
fn entry(out: &mut Vec<u8>, f: &FrameSpec, repeat: u32) {
    out.extend_from_slice(&f.len.to_le_bytes());
    out.extend_from_slice(&(f.align as u32).to_le_bytes());
    out.extend_from_slice(&repeat.to_le_bytes());
}

#[cfg(test)]
#[allow(clippy::field_reassign_with_default)]
mod tests {
    use super::*;

    fn meta(frames: &[FrameSpec]) -> Vec<u8> {
        let mut out = Vec::new();
        write_header(&mut out, frames, false);
        out
    }

    #[test]
    fn header_round_trips_and_lays_out() {
        let specs = [
            FrameSpec { len: 10, align: 1 },
            FrameSpec { len: 0, align: 4 },
            FrameSpec {
                len: 100,
                align: 16,
            },
        ];
        let m = meta(&specs);
        assert_eq!(m.len(), HEADER_LEN + 3 * ENTRY_LEN);
        let t = FrameTable::parse(&m, &Limits::default()).unwrap();
        assert_eq!(t.frames(), &specs);
        assert_eq!(t.total_bytes(), 110);
        let l = t.layout(64).unwrap();
        assert_eq!(l.offsets, vec![0, 10, 64]);
        assert_eq!(l.size, 164);
        assert_eq!(l.align, 64);
        let l = t.layout(1).unwrap();
        assert_eq!(l.offsets, vec![0, 10, 16]);
        assert_eq!(t.layout(3), Err(LayoutError::InvalidAlignment { align: 3 }));
        let buf = Bytes::from(vec![0u8; 164]);
        let parts = t.split(&buf, 64).unwrap();
        assert_eq!(parts[2].as_ptr() as usize - buf.as_ptr() as usize, 64);
        assert_eq!(
            t.split(&buf.slice(..163), 64),
            Err(DecodeError::BufferTooShort {
                needed: 164,
                available: 163
            })
        );
    }

    #[test]
    fn header_errors_carry_numbers() {
        let lim = Limits::default();
        let good = meta(&[FrameSpec { len: 8, align: 8 }]);
        assert_eq!(
            FrameTable::parse(&good[..10], &lim),
            Err(DecodeError::Truncated {
                needed: 16,
                available: 10
            })
        );
        assert_eq!(
            FrameTable::parse(&good[..20], &lim),
            Err(DecodeError::Truncated {
                needed: 32,
                available: 20
            })
        );
        let mut bad = good.clone();
        bad[0] = b'X';
        assert!(matches!(
            FrameTable::parse(&bad, &lim),
            Err(DecodeError::BadMagic { .. })
        ));
        let mut bad = good.clone();
        bad[4] = 2;
        assert_eq!(
            FrameTable::parse(&bad, &lim),
            Err(DecodeError::UnsupportedVersion {
                version: 2,
                supported: 1
            })
        );
        let mut bad = good.clone();
        bad[7] = 0x80;
        assert_eq!(
            FrameTable::parse(&bad, &lim),
            Err(DecodeError::UnknownFlags { flags: 0x8000 })
        );
        let mut bad = good.clone();
        bad[24] = 3;
        assert_eq!(
            FrameTable::parse(&bad, &lim),
            Err(DecodeError::FrameAlign { frame: 0, align: 3 })
        );
        let mut bad = good.clone();
        bad[30] = 1;
        assert_eq!(
            FrameTable::parse(&bad, &lim),
            Err(DecodeError::Reserved { offset: 28 })
        );
        // A huge frame count is refused before anything is allocated for it.
        let mut bad = good.clone();
        bad[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            FrameTable::parse(&bad, &lim),
            Err(DecodeError::TooManyFrames { .. })
        ));
        let mut small = Limits::default();
        small.max_total_bytes = 7;
        assert_eq!(
            FrameTable::parse(&good, &small),
            Err(DecodeError::TooLarge { bytes: 8, limit: 7 })
        );
        small.max_meta_bytes = 8;
        assert!(matches!(
            FrameTable::parse(&good, &small),
            Err(DecodeError::MetaTooLarge { .. })
        ));
    }
}
