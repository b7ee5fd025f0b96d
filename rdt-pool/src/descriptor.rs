//! The object descriptor: everything a receiver needs to fetch and rebuild an object's tensors.

use serde::{Deserialize, Serialize};
use tessera_framecodec::{DType, Dims, Tensor};
use tessera_transport::RemoteDesc;

use crate::error::DescriptorError;

/// Most tensors one descriptor may name.
pub const MAX_TENSORS: usize = 1 << 20;
/// Most blocks one descriptor may name.
pub const MAX_BLOCKS: usize = 1 << 20;
/// Largest block alignment a descriptor may ask for.
pub const MAX_ALIGN: u64 = 4096;
/// Largest encoded descriptor [`ObjectDescriptor::from_bytes`] accepts.
pub const MAX_ENCODED: usize = 256 << 20;

/// What a sender returns from a put and a receiver fetches: one remote descriptor per block
/// (the packing is the coalescing), and for each tensor its dtype, shape and place.
///
/// It is plain data (serde, or [`ObjectDescriptor::to_bytes`]); a receiver checks it with
/// [`ObjectDescriptor::validate`] before using it, so a malformed or hostile one is an error
/// value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectDescriptor {
    /// The blocks to read, each one contiguous range of the sender's registered memory.
    pub blocks: Vec<BlockDesc>,
    /// The tensors, in put order.
    pub tensors: Vec<TensorDesc>,
}

/// One block of an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockDesc {
    /// Where the block lives on the sender; never empty.
    pub remote: RemoteDesc,
    /// The alignment a receive buffer for it needs so that every tensor in it is aligned to
    /// its dtype (a power of two, at most [`MAX_ALIGN`]).
    pub align: u64,
}

/// One tensor of an object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorDesc {
    /// Element type.
    #[serde(with = "dtype_code")]
    pub dtype: DType,
    /// Dimensions, row-major contiguous (inline up to rank 4).
    pub shape: Dims,
    /// Where its bytes are; `None` exactly when it has no bytes.
    pub place: Option<Place>,
}

/// Where a tensor's bytes are: a block of the descriptor and an offset in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Place {
    /// Index into [`ObjectDescriptor::blocks`].
    pub block: u32,
    /// First byte, from the block's start.
    pub offset: u64,
}

mod dtype_code {
    use serde::{de::Error, Deserialize, Deserializer, Serializer};
    use tessera_framecodec::DType;

    pub(super) fn serialize<S: Serializer>(d: &DType, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u8(d.code())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DType, D::Error> {
        let code = u8::deserialize(d)?;
        DType::from_code(code).ok_or_else(|| D::Error::custom(format!("unknown dtype code {code}")))
    }
}

/// Bytes of a contiguous tensor, or `None` on overflow.
pub(crate) fn tensor_bytes(dtype: DType, shape: &[u64]) -> Option<u64> {
    shape
        .iter()
        .try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d))
}

impl TensorDesc {
    /// Size in bytes (checked by [`ObjectDescriptor::validate`]; saturates otherwise).
    pub fn bytes(&self) -> u64 {
        tensor_bytes(self.dtype, &self.shape).unwrap_or(u64::MAX)
    }
}

/// Where [`ObjectDescriptor::packed_layout`] puts each block and tensor in one buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedLayout {
    /// Bytes the buffer needs.
    pub size: u64,
    /// The buffer's start must be aligned to this for every tensor to be aligned.
    pub align: u64,
    /// Offset of each block.
    pub blocks: Vec<u64>,
    /// Offset of each tensor; `None` for a tensor without bytes.
    pub tensors: Vec<Option<u64>>,
}

impl ObjectDescriptor {
    /// Total bytes a receiver reads: the sum of the block lengths.
    pub fn bytes(&self) -> u64 {
        self.blocks
            .iter()
            .fold(0u64, |acc, b| acc.saturating_add(b.remote.len))
    }

    /// Checks every rule a receiver relies on, without allocating: counts against the limits,
    /// non-empty blocks with a power-of-two alignment, ranks, `dtype × shape` without overflow,
    /// a place exactly for tensors with bytes, and every tensor inside its block.
    pub fn validate(&self) -> Result<(), DescriptorError> {
        if self.tensors.len() > MAX_TENSORS {
            return Err(DescriptorError::TooManyTensors {
                count: self.tensors.len(),
                max: MAX_TENSORS,
            });
        }
        if self.blocks.len() > MAX_BLOCKS {
            return Err(DescriptorError::TooManyBlocks {
                count: self.blocks.len(),
                max: MAX_BLOCKS,
            });
        }
        for (block, b) in self.blocks.iter().enumerate() {
            if b.remote.len == 0 {
                return Err(DescriptorError::EmptyBlock { block });
            }
            if b.remote.end().is_none() {
                return Err(DescriptorError::BlockOverflow { block });
            }
            if !b.align.is_power_of_two() || b.align > MAX_ALIGN {
                return Err(DescriptorError::BadAlign {
                    block,
                    align: b.align,
                });
            }
        }
        for (tensor, t) in self.tensors.iter().enumerate() {
            if t.shape.len() > Tensor::MAX_RANK {
                return Err(DescriptorError::RankTooHigh {
                    tensor,
                    rank: t.shape.len(),
                    max: Tensor::MAX_RANK,
                });
            }
            let bytes =
                tensor_bytes(t.dtype, &t.shape).ok_or(DescriptorError::SizeOverflow { tensor })?;
            match (bytes, t.place) {
                (0, None) => {}
                (0, Some(_)) => return Err(DescriptorError::PlaceForEmpty { tensor }),
                (_, None) => return Err(DescriptorError::MissingPlace { tensor, bytes }),
                (_, Some(p)) => {
                    let b =
                        self.blocks
                            .get(p.block as usize)
                            .ok_or(DescriptorError::UnknownBlock {
                                tensor,
                                block: p.block,
                                blocks: self.blocks.len(),
                            })?;
                    if p.offset.checked_add(bytes).is_none_or(|e| e > b.remote.len) {
                        return Err(DescriptorError::OutsideBlock {
                            tensor,
                            offset: p.offset,
                            bytes,
                            block_len: b.remote.len,
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// Compact encoding (msgpack).
    pub fn to_bytes(&self) -> Result<Vec<u8>, DescriptorError> {
        rmp_serde::to_vec(self).map_err(|e| DescriptorError::Encode(e.to_string()))
    }

    /// Decodes [`ObjectDescriptor::to_bytes`]'s output and validates it.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, DescriptorError> {
        if bytes.len() > MAX_ENCODED {
            return Err(DescriptorError::TooLarge {
                len: bytes.len(),
                max: MAX_ENCODED,
            });
        }
        let d: Self =
            rmp_serde::from_slice(bytes).map_err(|e| DescriptorError::Decode(e.to_string()))?;
        d.validate()?;
        Ok(d)
    }

    /// Where each block and tensor lands when the whole object is read into one buffer: the
    /// blocks back to back, each at its alignment. Validate first.
    pub fn packed_layout(&self) -> Result<PackedLayout, DescriptorError> {
        self.validate()?;
        let mut blocks = Vec::with_capacity(self.blocks.len());
        let mut cursor = 0u64;
        let mut align = 1u64;
        for b in &self.blocks {
            let start = cursor
                .checked_add(b.align - 1)
                .map(|v| v & !(b.align - 1))
                .ok_or(DescriptorError::LayoutOverflow)?;
            cursor = start
                .checked_add(b.remote.len)
                .ok_or(DescriptorError::LayoutOverflow)?;
            align = align.max(b.align);
            blocks.push(start);
        }
        let tensors = self
            .tensors
            .iter()
            .map(|t| t.place.map(|p| blocks[p.block as usize] + p.offset))
            .collect();
        Ok(PackedLayout {
            size: cursor,
            align,
            blocks,
            tensors,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn count_and_alignment_limits_are_inclusive() {
        let mut d = desc();
        d.blocks[0].align = MAX_ALIGN;
        assert_eq!(d.validate(), Ok(()));
        d.blocks[0].align = MAX_ALIGN * 2;
        assert_eq!(
            d.validate(),
            Err(DescriptorError::BadAlign {
                block: 0,
                align: MAX_ALIGN * 2,
            })
        );
        d.blocks[0].align = 16;
        let empty = TensorDesc {
            dtype: DType::U8,
            shape: smallvec::smallvec![0],
            place: None,
        };
        d.tensors.resize(MAX_TENSORS, empty.clone());
        assert_eq!(d.validate(), Ok(()));
        d.tensors.push(empty);
        assert_eq!(
            d.validate(),
            Err(DescriptorError::TooManyTensors {
                count: MAX_TENSORS + 1,
                max: MAX_TENSORS,
            })
        );
        let mut d = desc();
        d.blocks.resize(MAX_BLOCKS, d.blocks[0]);
        assert_eq!(d.validate(), Ok(()));
        d.blocks.push(d.blocks[0]);
        assert_eq!(
            d.validate(),
            Err(DescriptorError::TooManyBlocks {
                count: MAX_BLOCKS + 1,
                max: MAX_BLOCKS,
            })
        );
    }

    #[test]
    fn rank_and_encoded_size_limits_are_inclusive() {
        let mut d = desc();
        d.tensors[0].shape = std::iter::repeat_n(1, Tensor::MAX_RANK - 1)
            .chain([3])
            .collect();
        assert_eq!(d.validate(), Ok(()), "rank {} is allowed", Tensor::MAX_RANK);
        d.tensors[0].shape.push(1);
        assert_eq!(
            d.validate(),
            Err(DescriptorError::RankTooHigh {
                tensor: 0,
                rank: Tensor::MAX_RANK + 1,
                max: Tensor::MAX_RANK,
            })
        );
        // Exactly the largest encoding is decoded (and this one is not msgpack); one byte more
        // is refused before decoding.
        let junk = vec![0xc1u8; MAX_ENCODED];
        assert!(matches!(
            ObjectDescriptor::from_bytes(&junk),
            Err(DescriptorError::Decode(_))
        ));
        let junk = vec![0xc1u8; MAX_ENCODED + 1];
        assert_eq!(
            ObjectDescriptor::from_bytes(&junk),
            Err(DescriptorError::TooLarge {
                len: MAX_ENCODED + 1,
                max: MAX_ENCODED,
            })
        );
    }

    fn desc() -> ObjectDescriptor {
        ObjectDescriptor {
            blocks: vec![BlockDesc {
                remote: RemoteDesc::new(7, 64, 48),
                align: 16,
            }],
            tensors: vec![
                TensorDesc {
                    dtype: DType::I8,
                    shape: smallvec::smallvec![3],
                    place: Some(Place {
                        block: 0,
                        offset: 0,
                    }),
                },
                TensorDesc {
                    dtype: DType::Complex128,
                    shape: smallvec::smallvec![2],
                    place: Some(Place {
                        block: 0,
                        offset: 16,
                    }),
                },
                TensorDesc {
                    dtype: DType::F32,
                    shape: smallvec::smallvec![0, 5],
                    place: None,
                },
            ],
        }
    }

    #[test]
    fn round_trips_and_validates() {
        let d = desc();
        let bytes = d.to_bytes().unwrap();
        assert_eq!(ObjectDescriptor::from_bytes(&bytes).unwrap(), d);
        let l = d.packed_layout().unwrap();
        assert_eq!((l.size, l.align), (48, 16));
        assert_eq!(l.tensors, vec![Some(0), Some(16), None]);
    }

    #[test]
    fn hostile_descriptors_are_errors() {
        let mut d = desc();
        d.tensors[1].place = Some(Place {
            block: 0,
            offset: 40,
        });
        assert!(matches!(
            d.validate(),
            Err(DescriptorError::OutsideBlock { tensor: 1, .. })
        ));
        let mut d = desc();
        d.tensors[1].place = Some(Place {
            block: 0,
            offset: u64::MAX - 4,
        });
        assert!(d.validate().is_err());
        let mut d = desc();
        d.tensors[0].shape = smallvec::smallvec![u64::MAX, 2];
        assert!(matches!(
            d.validate(),
            Err(DescriptorError::SizeOverflow { tensor: 0 })
        ));
        let mut d = desc();
        d.tensors[2].place = Some(Place {
            block: 0,
            offset: 0,
        });
        assert!(d.validate().is_err());
        let mut d = desc();
        d.tensors[0].place = None;
        assert!(d.validate().is_err());
        let mut d = desc();
        d.tensors[0].place = Some(Place {
            block: 9,
            offset: 0,
        });
        assert!(d.validate().is_err());
        let mut d = desc();
        d.blocks[0].align = 24;
        assert!(d.validate().is_err());
        let mut d = desc();
        d.blocks[0].remote.len = 0;
        assert!(d.validate().is_err());
        let mut d = desc();
        d.blocks[0].remote.offset = u64::MAX;
        assert!(d.validate().is_err());
        let mut d = desc();
        d.tensors[0].shape = smallvec::smallvec![1; 65];
        assert!(d.validate().is_err());
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..256)) {
            let _ = ObjectDescriptor::from_bytes(&bytes);
        }

        #[test]
        fn mutated_encodings_never_panic(i in 0usize..200, v in proptest::num::u8::ANY) {
            let mut bytes = desc().to_bytes().unwrap();
            let n = bytes.len();
            bytes[i % n] = v;
            if let Ok(d) = ObjectDescriptor::from_bytes(&bytes) {
                d.packed_layout().unwrap();
            }
        }
    }
}
