//! Tensors: a dtype, a shape, optional strides and a `Bytes` payload, with typed views.

use bytes::Bytes;
use smallvec::SmallVec;

use crate::{DType, TensorError, ViewError};

/// Dimensions or strides, inline up to rank 4.
pub type Dims = SmallVec<[u64; 4]>;

/// An n-dimensional array whose elements live in a [`Bytes`] payload.
///
/// Strides, when present, count elements (not bytes), are non-negative and may be zero (a
/// broadcast dimension); without them the tensor is contiguous in row-major order. Element `idx`
/// lives at byte `dtype.size() × Σ idx[i] × strides[i]` of the payload.
///
/// Cloning a tensor clones its `Bytes` handle, never the data. A decoded tensor's payload is a
/// slice of the buffer it was decoded from and keeps that buffer's owner alive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tensor {
    dtype: DType,
    shape: Dims,
    /// Boxed: strided tensors are the rare case, and a contiguous one stays small to move.
    strides: Option<Box<[u64]>>,
    data: Bytes,
}

impl Tensor {
    /// The largest rank a tensor may have.
    pub const MAX_RANK: usize = 64;

    /// A contiguous tensor over `data`, which must hold exactly `dtype.size() × Π shape` bytes.
    pub fn new(dtype: DType, shape: &[u64], data: Bytes) -> Result<Self, TensorError> {
        Self::from_parts(dtype, shape.into(), None, data)
    }

    /// A strided tensor over `data`; `strides` count elements, one per dimension. `data` must
    /// reach at least past the last element.
    pub fn with_strides(
        dtype: DType,
        shape: &[u64],
        strides: &[u64],
        data: Bytes,
    ) -> Result<Self, TensorError> {
        Self::from_parts(dtype, shape.into(), Some(strides.into()), data)
    }

    /// A contiguous tensor holding a copy of `items`.
    pub fn from_slice<T: Element>(shape: &[u64], items: &[T]) -> Result<Self, TensorError> {
        let data = Bytes::copy_from_slice(T::as_bytes(items));
        Self::new(T::DTYPE, shape, data)
    }

    pub(crate) fn from_parts(
        dtype: DType,
        shape: Dims,
        strides: Option<Dims>,
        data: Bytes,
    ) -> Result<Self, TensorError> {
        let len = data.len() as u64;
        Self::from_parts_of_len(dtype, shape, strides, data, len)
    }

    /// [`Tensor::from_parts`] checked against a payload of `actual` bytes, which `data` holds
    /// or, before the payload landed, will hold once [`Tensor::bind`] puts it in.
    pub(crate) fn from_parts_of_len(
        dtype: DType,
        shape: Dims,
        strides: Option<Dims>,
        data: Bytes,
        actual: u64,
    ) -> Result<Self, TensorError> {
        let rank = shape.len();
        if rank > Self::MAX_RANK {
            return Err(TensorError::RankTooHigh {
                rank,
                limit: Self::MAX_RANK,
            });
        }
        let overflow = TensorError::SizeOverflow { dtype, rank };
        // Also bounds the element count of broadcast (zero-stride) tensors.
        let expected = contiguous_bytes(dtype, &shape).ok_or(overflow.clone())?;
        match &strides {
            None => {
                if expected != actual {
                    return Err(TensorError::DataLength {
                        dtype,
                        expected,
                        actual,
                    });
                }
            }
            Some(strides) => {
                if strides.len() != rank {
                    return Err(TensorError::StridesRank {
                        rank,
                        strides: strides.len(),
                    });
                }
                let span = strided_span(dtype, &shape, strides).ok_or(overflow)?;
                if span > actual {
                    return Err(TensorError::DataTooShort {
                        dtype,
                        span,
                        actual,
                    });
                }
            }
        }
        Ok(Self {
            dtype,
            shape,
            strides: strides.map(|s| s.to_vec().into_boxed_slice()),
            data,
        })
    }

    /// Puts in the payload this tensor was checked against (`from_parts_of_len`).
    /// The same dtype, shape and strides over `data`, which holds (or, unbound, will hold) as
    /// many bytes as this tensor's payload: the next tensor of a checked run.
    pub(crate) fn with_data(&self, data: Bytes) -> Self {
        Self {
            dtype: self.dtype,
            shape: self.shape.clone(),
            strides: self.strides.clone(),
            data,
        }
    }

    pub(crate) fn bind(&mut self, data: Bytes) {
        self.data = data;
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Size of each dimension.
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// Strides in elements, or `None` for a contiguous row-major tensor.
    pub fn strides(&self) -> Option<&[u64]> {
        self.strides.as_deref()
    }

    /// The payload, exactly as stored (for a strided tensor, every byte its elements span).
    pub fn data(&self) -> &Bytes {
        &self.data
    }

    /// Takes the payload out.
    pub fn into_data(self) -> Bytes {
        self.data
    }

    /// Number of elements, `Π shape` (the shape was checked not to overflow in bytes).
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Whether elements are stored row-major without gaps: no strides, or strides equal to the
    /// row-major ones (ignoring dimensions of size 1).
    pub fn is_contiguous(&self) -> bool {
        match &self.strides {
            None => true,
            Some(strides) => {
                if self.shape.contains(&0) {
                    return true;
                }
                let mut expected = 1u64;
                for (&dim, &stride) in self.shape.iter().zip(strides.iter()).rev() {
                    if dim != 1 && stride != expected {
                        return false;
                    }
                    expected = expected.saturating_mul(dim);
                }
                true
            }
        }
    }

    /// The elements as a slice of `T`, without copying. Fails when `T` is not this tensor's
    /// dtype, when the data is not aligned for `T` in memory, when the tensor is not
    /// contiguous, or (for `bool`) when a byte is neither 0 nor 1.
    pub fn as_slice<T: Element>(&self) -> Result<&[T], ViewError> {
        if T::DTYPE != self.dtype {
            return Err(ViewError::DTypeMismatch {
                requested: T::DTYPE,
                actual: self.dtype,
            });
        }
        self.view_contiguous::<T>()
    }

    /// The elements reinterpreted as `T` of the same width, whatever the dtype: fp8 as `u8`,
    /// f16 or bf16 as `u16`, complex64 as `u64`, and so on. Checks width, alignment and
    /// contiguity, never copies.
    pub fn as_bits<T: Element>(&self) -> Result<&[T], ViewError> {
        if size_of::<T>() != self.dtype.size() {
            return Err(ViewError::WidthMismatch {
                requested: size_of::<T>(),
                actual: self.dtype,
            });
        }
        self.view_contiguous::<T>()
    }

    fn view_contiguous<T: Element>(&self) -> Result<&[T], ViewError> {
        if !self.is_contiguous() {
            return Err(self.not_contiguous());
        }
        let n = usize::try_from(self.numel()).map_err(|_| ViewError::TooLarge {
            bytes: self.data.len() as u64,
        })?;
        if n == 0 {
            return Ok(&[]);
        }
        let bytes = &self.data[..n * size_of::<T>()];
        T::cast(bytes)
    }

    fn not_contiguous(&self) -> ViewError {
        ViewError::NotContiguous {
            shape: self.shape.to_vec(),
            strides: self.strides.as_deref().unwrap_or(&[]).to_vec(),
        }
    }

    /// Copies the elements out in row-major order, gathering a strided tensor; works at any
    /// alignment. Fails only on a dtype mismatch or an invalid `bool` byte.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>, ViewError> {
        if T::DTYPE != self.dtype {
            return Err(ViewError::DTypeMismatch {
                requested: T::DTYPE,
                actual: self.dtype,
            });
        }
        let contiguous = self.contiguous()?;
        let bytes = contiguous.data();
        if let Ok(items) = T::cast(bytes) {
            return Ok(items.to_vec());
        }
        let size = size_of::<T>();
        bytes
            .chunks_exact(size)
            .enumerate()
            .map(|(index, chunk)| {
                T::read(chunk).ok_or(ViewError::InvalidBool {
                    index,
                    byte: chunk[0],
                })
            })
            .collect()
    }

    /// A contiguous tensor with the same elements: a clone when already contiguous (no copy),
    /// otherwise a gathered copy.
    pub fn contiguous(&self) -> Result<Tensor, ViewError> {
        let Some(strides) = self.strides.as_ref().filter(|_| !self.is_contiguous()) else {
            let bytes = self.numel() * self.dtype.size() as u64;
            return Ok(Tensor {
                dtype: self.dtype,
                shape: self.shape.clone(),
                strides: None,
                data: self.data.slice(..bytes as usize),
            });
        };
        let size = self.dtype.size();
        let total = self.numel().checked_mul(size as u64);
        let bytes = total.unwrap_or(u64::MAX);
        let too_large = ViewError::TooLarge { bytes };
        let total = total
            .and_then(|t| usize::try_from(t).ok())
            .ok_or(too_large.clone())?;
        let mut out = Vec::new();
        out.try_reserve_exact(total).map_err(|_| too_large)?;
        if total > 0 {
            let rank = self.shape.len();
            let mut index = vec![0u64; rank];
            // Copy whole innermost runs when the last dimension is dense.
            let run = match (self.shape.last(), strides.last()) {
                (Some(&n), Some(&1)) => n as usize,
                _ => 1,
            };
            let outer = if run > 1 { rank - 1 } else { rank };
            loop {
                let elem: u64 = index.iter().zip(strides.iter()).map(|(i, s)| i * s).sum();
                let start = elem as usize * size;
                out.extend_from_slice(&self.data[start..start + run * size]);
                // Advance the odometer over the outer dimensions.
                let mut d = outer;
                loop {
                    if d == 0 {
                        return Ok(Tensor {
                            dtype: self.dtype,
                            shape: self.shape.clone(),
                            strides: None,
                            data: Bytes::from(out),
                        });
                    }
                    d -= 1;
                    index[d] += 1;
                    if index[d] < self.shape[d] {
                        break;
                    }
                    index[d] = 0;
                }
            }
        }
        Ok(Tensor {
            dtype: self.dtype,
            shape: self.shape.clone(),
            strides: None,
            data: Bytes::new(),
        })
    }

    /// Number of rows: the size of the leading (batch) dimension.
    pub fn rows(&self) -> Result<u64, ViewError> {
        self.shape.first().copied().ok_or(ViewError::NoRows)
    }

    /// Row `index` of the leading dimension, as a tensor whose payload is a slice of this one:
    /// no copy. Splitting a batched value per sample this way lets each sample keep only its
    /// own bytes referenced.
    pub fn row(&self, index: u64) -> Result<Tensor, ViewError> {
        let rows = self.rows()?;
        if index >= rows {
            return Err(ViewError::RowOutOfRange { index, rows });
        }
        let size = self.dtype.size() as u64;
        let shape: Dims = self.shape[1..].into();
        match &self.strides {
            None => {
                // Checked at construction: rows × row_bytes fits in the payload.
                let row_bytes = shape.iter().product::<u64>() * size;
                let start = (index * row_bytes) as usize;
                Ok(Tensor {
                    dtype: self.dtype,
                    shape,
                    strides: None,
                    data: self.data.slice(start..start + row_bytes as usize),
                })
            }
            Some(strides) => {
                let inner: Dims = strides[1..].into();
                // Both fit: they are bounded by the span checked at construction.
                let span = strided_span(self.dtype, &shape, &inner).unwrap_or(0);
                let start = if span == 0 {
                    0
                } else {
                    index * strides[0] * size
                };
                let data = self.data.slice(start as usize..(start + span) as usize);
                let strides = Some(inner.to_vec().into_boxed_slice());
                let mut t = Tensor {
                    dtype: self.dtype,
                    shape,
                    strides,
                    data,
                };
                if t.is_contiguous() && t.data.len() as u64 == t.numel() * size {
                    t.strides = None;
                }
                Ok(t)
            }
        }
    }

    /// Every row of the leading dimension, each a slice of this tensor's payload (no copy).
    pub fn unbind(&self) -> Result<Vec<Tensor>, ViewError> {
        (0..self.rows()?).map(|i| self.row(i)).collect()
    }

    /// The same tensor over its own copy of the payload, so it stops keeping a shared receive
    /// buffer alive. This copies, by design; use it for small tensors kept for long.
    pub fn detached(&self) -> Tensor {
        Tensor {
            dtype: self.dtype,
            shape: self.shape.clone(),
            strides: self.strides.clone(),
            data: Bytes::copy_from_slice(&self.data),
        }
    }
}

/// `dtype.size() × Π shape`, or `None` on overflow.
pub(crate) fn contiguous_bytes(dtype: DType, shape: &[u64]) -> Option<u64> {
    shape
        .iter()
        .try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d))
}

/// Bytes from the first element to past the last one, or `None` on overflow. Zero when any
/// dimension is zero.
pub(crate) fn strided_span(dtype: DType, shape: &[u64], strides: &[u64]) -> Option<u64> {
    if shape.contains(&0) {
        return Some(0);
    }
    let mut last = 0u64;
    for (&dim, &stride) in shape.iter().zip(strides) {
        last = last.checked_add((dim - 1).checked_mul(stride)?)?;
    }
    last.checked_add(1)?.checked_mul(dtype.size() as u64)
}

mod sealed {
    #![allow(unreachable_pub)]
    pub trait Sealed {}
}

/// A Rust type that matches one dtype, for typed views and copies.
///
/// | dtype | `T` |
/// |---|---|
/// | bool, u8 … i64, f32, f64 | the Rust primitive |
/// | f16, bf16 | [`half::f16`], [`half::bf16`] |
/// | complex64, complex128 | `[f32; 2]`, `[f64; 2]` (real, imaginary) |
/// | fp8 e4m3 / e5m2 | none: read their bits with [`Tensor::as_bits::<u8>`](Tensor::as_bits) |
///
/// Sealed: implemented in this crate only.
pub trait Element: Copy + sealed::Sealed + 'static {
    /// The dtype this type stands for.
    const DTYPE: DType;

    /// Views `bytes` as elements, without copying.
    #[doc(hidden)]
    fn cast(bytes: &[u8]) -> Result<&[Self], ViewError>;

    /// Reads one element from `size_of::<Self>()` bytes at any alignment; `None` for an
    /// invalid bit pattern.
    #[doc(hidden)]
    fn read(bytes: &[u8]) -> Option<Self>;

    /// The bytes of `items`.
    #[doc(hidden)]
    fn as_bytes(items: &[Self]) -> &[u8];
}

fn misaligned<T>(bytes: &[u8]) -> ViewError {
    ViewError::Misaligned {
        address: bytes.as_ptr() as usize,
        align: align_of::<T>(),
    }
}

macro_rules! pod_element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            fn cast(bytes: &[u8]) -> Result<&[Self], ViewError> {
                // The caller passes a whole number of elements, so only alignment can fail.
                bytemuck::try_cast_slice(bytes).map_err(|_| misaligned::<$t>(bytes))
            }
            fn read(bytes: &[u8]) -> Option<Self> {
                bytemuck::try_pod_read_unaligned(bytes).ok()
            }
            fn as_bytes(items: &[Self]) -> &[u8] {
                bytemuck::cast_slice(items)
            }
        }
    )*};
}

pod_element! {
    u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, u64 => U64, i64 => I64,
    half::f16 => F16, half::bf16 => BF16, f32 => F32, f64 => F64,
    [f32; 2] => Complex64, [f64; 2] => Complex128,
}

impl sealed::Sealed for bool {}
impl Element for bool {
    const DTYPE: DType = DType::Bool;
    fn cast(bytes: &[u8]) -> Result<&[Self], ViewError> {
        bytemuck::checked::try_cast_slice(bytes).map_err(|_| {
            let index = bytes.iter().position(|&b| b > 1).unwrap_or(0);
            ViewError::InvalidBool {
                index,
                byte: bytes.get(index).copied().unwrap_or(0),
            }
        })
    }
    fn read(bytes: &[u8]) -> Option<Self> {
        match bytes {
            [0] => Some(false),
            [1] => Some(true),
            _ => None,
        }
    }
    fn as_bytes(items: &[Self]) -> &[u8] {
        bytemuck::cast_slice(items)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_tensor(shape: &[u64]) -> Tensor {
        let n: u64 = shape.iter().product();
        let items: Vec<f32> = (0..n).map(|i| i as f32).collect();
        Tensor::from_slice(shape, &items).unwrap()
    }

    #[test]
    fn construction_checks_lengths_and_overflow() {
        assert_eq!(
            Tensor::new(DType::F32, &[2, 3], Bytes::from(vec![0u8; 23])),
            Err(TensorError::DataLength {
                dtype: DType::F32,
                expected: 24,
                actual: 23
            })
        );
        assert_eq!(
            Tensor::new(DType::F64, &[u64::MAX / 4, 3], Bytes::new()),
            Err(TensorError::SizeOverflow {
                dtype: DType::F64,
                rank: 2
            })
        );
        assert_eq!(
            Tensor::with_strides(DType::U8, &[2, 2], &[1], Bytes::new()),
            Err(TensorError::StridesRank {
                rank: 2,
                strides: 1
            })
        );
        assert_eq!(
            Tensor::with_strides(DType::U16, &[2, 3], &[1, 2], Bytes::from(vec![0u8; 9])),
            Err(TensorError::DataTooShort {
                dtype: DType::U16,
                span: 12,
                actual: 9
            })
        );
        assert!(Tensor::with_strides(DType::U16, &[2, 0], &[u64::MAX, 9], Bytes::new()).is_ok());
        // Strides whose span overflows u64 are refused, wherever the overflow happens (a
        // wrapped span would let a one-byte payload pass for a tensor reaching 2^64 bytes).
        for (dtype, shape, strides) in [
            (DType::U8, &[3u64][..], &[1u64 << 63][..]), // (dim - 1) * stride
            (DType::U8, &[2, 2][..], &[u64::MAX, 1][..]), // the sum over dimensions
            (DType::U8, &[2][..], &[u64::MAX][..]),      // the last element's end
            (DType::F32, &[2][..], &[1 << 62][..]),      // times the element size
        ] {
            assert_eq!(
                Tensor::with_strides(dtype, shape, strides, Bytes::from_static(&[0; 4])),
                Err(TensorError::SizeOverflow {
                    dtype,
                    rank: shape.len()
                }),
                "{shape:?} {strides:?}"
            );
        }
        // A broadcast tensor may span one element, but its element count must still fit.
        assert_eq!(
            Tensor::with_strides(
                DType::U8,
                &[1 << 40, 1 << 40],
                &[0, 0],
                Bytes::from_static(&[1])
            ),
            Err(TensorError::SizeOverflow {
                dtype: DType::U8,
                rank: 2
            })
        );
        assert!(Tensor::new(DType::U8, &[0; 65], Bytes::new()).is_err());
    }

    #[test]
    fn typed_views_check_dtype_and_alignment() {
        let t = f32_tensor(&[2, 2]);
        assert_eq!(t.as_slice::<f32>().unwrap(), &[0.0, 1.0, 2.0, 3.0]);
        assert_eq!(
            t.as_slice::<i32>(),
            Err(ViewError::DTypeMismatch {
                requested: DType::I32,
                actual: DType::F32
            })
        );
        assert_eq!(t.as_bits::<u32>().unwrap()[1], 1.0f32.to_bits());
        assert!(matches!(
            t.as_bits::<u16>(),
            Err(ViewError::WidthMismatch { requested: 2, .. })
        ));
        // Shift the payload by one byte: the view refuses, the copy still works.
        let mut raw = vec![0u8; 17];
        raw[1..].copy_from_slice(t.data());
        let shifted = Bytes::from(raw).slice(1..);
        let odd = Tensor::new(DType::F32, &[4], shifted).unwrap();
        if odd.data().as_ptr() as usize % 4 != 0 {
            assert!(matches!(
                odd.as_slice::<f32>(),
                Err(ViewError::Misaligned { align: 4, .. })
            ));
        }
        assert_eq!(odd.to_vec::<f32>().unwrap(), vec![0.0, 1.0, 2.0, 3.0]);
    }

    #[test]
    fn half_complex_bool_and_fp8() {
        let h = [half::bf16::from_f32(1.5), half::bf16::from_f32(-2.0)];
        let t = Tensor::from_slice(&[2], &h).unwrap();
        assert_eq!(t.dtype(), DType::BF16);
        assert_eq!(t.to_vec::<half::bf16>().unwrap(), h);
        let c = Tensor::from_slice(&[1], &[[1.0f64, -1.0]]).unwrap();
        assert_eq!(c.dtype(), DType::Complex128);
        assert_eq!(c.data().len(), 16);
        let b = Tensor::new(DType::Bool, &[3], Bytes::from_static(&[1, 0, 2])).unwrap();
        assert_eq!(
            b.as_slice::<bool>(),
            Err(ViewError::InvalidBool { index: 2, byte: 2 })
        );
        assert_eq!(
            b.to_vec::<bool>(),
            Err(ViewError::InvalidBool { index: 2, byte: 2 })
        );
        let f8 = Tensor::new(DType::F8E5M2, &[3], Bytes::from_static(&[1, 2, 3])).unwrap();
        assert_eq!(f8.as_bits::<u8>().unwrap(), &[1, 2, 3]);
        assert!(f8.as_slice::<u8>().is_err());
    }

    #[test]
    fn strided_views_and_gather() {
        // The transpose of a 2x3 row-major matrix [[0,1,2],[3,4,5]].
        let base = f32_tensor(&[2, 3]);
        let t = Tensor::with_strides(DType::F32, &[3, 2], &[1, 3], base.data().clone()).unwrap();
        assert!(!t.is_contiguous());
        assert!(matches!(
            t.as_slice::<f32>(),
            Err(ViewError::NotContiguous { .. })
        ));
        assert_eq!(
            t.to_vec::<f32>().unwrap(),
            vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]
        );
        assert_eq!(t.row(1).unwrap().to_vec::<f32>().unwrap(), vec![1.0, 4.0]);
        // Row-major strides given explicitly count as contiguous.
        let same = Tensor::with_strides(DType::F32, &[2, 3], &[3, 1], base.data().clone()).unwrap();
        assert!(same.is_contiguous());
        assert_eq!(same.as_slice::<f32>().unwrap().len(), 6);
        // A broadcast dimension.
        let b =
            Tensor::with_strides(DType::F32, &[3, 2], &[0, 1], base.data().slice(0..8)).unwrap();
        assert_eq!(
            b.to_vec::<f32>().unwrap(),
            vec![0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
        );
    }

    #[test]
    fn rows_are_slices_of_the_batch() {
        let t = f32_tensor(&[4, 3]);
        let rows = t.unbind().unwrap();
        assert_eq!(rows.len(), 4);
        for (i, r) in rows.iter().enumerate() {
            assert_eq!(r.shape(), &[3]);
            assert_eq!(
                r.data().as_ptr() as usize,
                t.data().as_ptr() as usize + i * 12
            );
        }
        assert_eq!(
            t.row(4),
            Err(ViewError::RowOutOfRange { index: 4, rows: 4 })
        );
        let scalar = Tensor::new(DType::U8, &[], Bytes::from_static(&[7])).unwrap();
        assert_eq!(scalar.row(0), Err(ViewError::NoRows));
        let d = t.detached();
        assert_eq!(d, t);
        assert_ne!(d.data().as_ptr(), t.data().as_ptr());
    }
}
