//! What a put takes: a byte view plus dtype, shape and optional strides.

use bytes::Bytes;
use tessera_framecodec::{DType, Dims, Tensor, TensorError};
use tessera_transport::Registration;

use crate::descriptor::tensor_bytes;

/// A tensor to put: a view of bytes with a dtype, a shape and, for a strided view, strides in
/// elements. Only the bytes the view covers are ever copied, never its whole backing storage.
///
/// - [`TensorRef::new`] / [`TensorRef::strided`] borrow the bytes; a put copies them.
/// - [`TensorRef::from_tensor`] shares a framecodec [`Tensor`]'s `Bytes`. When they already
///   live in memory registered with the pool's agent (a tensor fetched by a
///   [`ReceiverPool`](crate::ReceiverPool) of the same agent, or a caller's registration), the
///   put describes them in place, without a copy, and holds the `Bytes` until the object is
///   freed; otherwise it copies them.
/// - [`TensorRef::registered`] names bytes inside a caller's [`Registration`]: described in
///   place; the object holds the registration guard until it is freed.
#[derive(Debug, Clone)]
pub struct TensorRef<'a> {
    pub(crate) dtype: DType,
    pub(crate) shape: Dims,
    pub(crate) strides: Option<Vec<u64>>,
    pub(crate) source: Source<'a>,
    /// Bytes the view covers, contiguous.
    pub(crate) bytes: u64,
}

#[derive(Debug, Clone)]
pub(crate) enum Source<'a> {
    Borrowed(&'a [u8]),
    Shared(Bytes),
    Registered(Registration, u64),
}

fn check_shape(dtype: DType, shape: &[u64]) -> Result<u64, TensorError> {
    if shape.len() > Tensor::MAX_RANK {
        return Err(TensorError::RankTooHigh {
            rank: shape.len(),
            limit: Tensor::MAX_RANK,
        });
    }
    tensor_bytes(dtype, shape).ok_or(TensorError::SizeOverflow {
        dtype,
        rank: shape.len(),
    })
}

fn exact(dtype: DType, expected: u64, actual: u64) -> Result<(), TensorError> {
    if expected == actual {
        Ok(())
    } else {
        Err(TensorError::DataLength {
            dtype,
            expected,
            actual,
        })
    }
}

/// Bytes from the first element to past the last one of a strided view (0 when empty).
fn strided_span(dtype: DType, shape: &[u64], strides: &[u64]) -> Option<u64> {
    if shape.contains(&0) {
        return Some(0);
    }
    let mut last = 0u64;
    for (&d, &s) in shape.iter().zip(strides) {
        last = last.checked_add((d - 1).checked_mul(s)?)?;
    }
    last.checked_add(1)?.checked_mul(dtype.size() as u64)
}

impl<'a> TensorRef<'a> {
    /// A contiguous row-major view of `data`, which must be exactly `dtype × shape` bytes.
    pub fn new(dtype: DType, shape: &[u64], data: &'a [u8]) -> Result<Self, TensorError> {
        let bytes = check_shape(dtype, shape)?;
        exact(dtype, bytes, data.len() as u64)?;
        Ok(Self {
            dtype,
            shape: Dims::from_slice(shape),
            strides: None,
            source: Source::Borrowed(data),
            bytes,
        })
    }

    /// A strided view: element `idx` is at element `Σ idx[i] × strides[i]` of `data`. The put
    /// gathers exactly the covered elements into a contiguous tensor.
    pub fn strided(
        dtype: DType,
        shape: &[u64],
        strides: &[u64],
        data: &'a [u8],
    ) -> Result<Self, TensorError> {
        let bytes = check_shape(dtype, shape)?;
        if strides.len() != shape.len() {
            return Err(TensorError::StridesRank {
                rank: shape.len(),
                strides: strides.len(),
            });
        }
        let span = strided_span(dtype, shape, strides).ok_or(TensorError::SizeOverflow {
            dtype,
            rank: shape.len(),
        })?;
        if span > data.len() as u64 {
            return Err(TensorError::DataTooShort {
                dtype,
                span,
                actual: data.len() as u64,
            });
        }
        Ok(Self {
            dtype,
            shape: Dims::from_slice(shape),
            strides: Some(strides.to_vec()),
            source: Source::Borrowed(data),
            bytes,
        })
    }

    /// `len` bytes at `offset` of a caller's registration, as a contiguous tensor; described
    /// in place by a put.
    pub fn registered(
        dtype: DType,
        shape: &[u64],
        reg: &Registration,
        offset: u64,
    ) -> Result<Self, TensorError> {
        let bytes = check_shape(dtype, shape)?;
        let available = reg.len().saturating_sub(offset);
        if bytes > available {
            return Err(TensorError::DataTooShort {
                dtype,
                span: bytes,
                actual: available,
            });
        }
        Ok(Self {
            dtype,
            shape: Dims::from_slice(shape),
            strides: None,
            source: Source::Registered(reg.clone(), offset),
            bytes,
        })
    }
}

impl TensorRef<'static> {
    /// Shares `tensor`'s bytes (a reference count, no copy here).
    pub fn from_tensor(tensor: &Tensor) -> Self {
        Self {
            dtype: tensor.dtype(),
            shape: Dims::from_slice(tensor.shape()),
            strides: tensor.strides().map(<[u64]>::to_vec),
            source: Source::Shared(tensor.data().clone()),
            // The tensor checked its byte size when it was built.
            bytes: tensor_bytes(tensor.dtype(), tensor.shape()).unwrap_or(0),
        }
    }
}

impl TensorRef<'_> {
    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Dimensions.
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// Bytes the view covers (what a copy moves).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Whether the view is row-major without gaps.
    pub(crate) fn is_contiguous(&self) -> bool {
        let Some(strides) = &self.strides else {
            return true;
        };
        if self.bytes == 0 {
            return true;
        }
        let mut expected = 1u64;
        for (&d, &s) in self.shape.iter().zip(strides).rev() {
            if d != 1 && s != expected {
                return false;
            }
            expected = expected.saturating_mul(d);
        }
        true
    }

    /// The raw bytes the view starts at, for the borrowed and shared sources.
    pub(crate) fn data(&self) -> Option<&[u8]> {
        match &self.source {
            Source::Borrowed(d) => Some(d),
            Source::Shared(b) => Some(b),
            Source::Registered(..) => None,
        }
    }

    /// Writes the covered bytes, contiguous, through `emit` (one call per contiguous run).
    pub(crate) fn gather(&self, mut emit: impl FnMut(&[u8])) {
        let Some(data) = self.data() else { return };
        if self.bytes == 0 {
            return;
        }
        let size = self.dtype.size();
        let Some(strides) = self.strides.as_ref().filter(|_| !self.is_contiguous()) else {
            emit(&data[..self.bytes as usize]);
            return;
        };
        // The innermost dimension is one run when its stride is 1, else one element per run.
        let rank = self.shape.len();
        let (run_elems, outer_rank) = match strides.last() {
            Some(1) => (self.shape[rank - 1] as usize, rank - 1),
            _ => (1, rank),
        };
        let run = run_elems * size;
        let mut idx = vec![0u64; outer_rank];
        loop {
            let elem: u64 = idx.iter().zip(strides).map(|(i, s)| i * s).sum();
            let at = elem as usize * size;
            emit(&data[at..at + run]);
            // Odometer over the outer dimensions.
            let mut d = outer_rank;
            loop {
                if d == 0 {
                    return;
                }
                d -= 1;
                idx[d] += 1;
                if idx[d] < self.shape[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_views_gather_only_their_elements() {
        // A 3x4 u8 matrix; its transpose (4x3, strides [1, 4]) and every other column.
        let data: Vec<u8> = (0..12).collect();
        let t = TensorRef::strided(DType::U8, &[4, 3], &[1, 4], &data).unwrap();
        let mut out = Vec::new();
        t.gather(|run| out.extend_from_slice(run));
        assert_eq!(out, [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]);
        let cols = TensorRef::strided(DType::U8, &[3, 2], &[4, 2], &data[1..]).unwrap();
        let mut out = Vec::new();
        cols.gather(|run| out.extend_from_slice(run));
        assert_eq!(out, [1, 3, 5, 7, 9, 11]);
        // Rows of a wider storage: runs of whole rows, never the storage's tail.
        let rows = TensorRef::strided(DType::U16, &[2, 2], &[3, 1], &data[..10]).unwrap();
        let mut out = Vec::new();
        rows.gather(|run| out.extend_from_slice(run));
        assert_eq!(out, [0, 1, 2, 3, 6, 7, 8, 9]);
        assert_eq!(rows.bytes(), 8);
    }

    #[test]
    fn bad_views_are_errors() {
        assert!(TensorRef::new(DType::F32, &[3], &[0; 11]).is_err());
        assert!(TensorRef::new(DType::F32, &[u64::MAX, 2], &[]).is_err());
        assert!(TensorRef::strided(DType::F32, &[2, 2], &[2], &[0; 16]).is_err());
        assert!(TensorRef::strided(DType::F32, &[2, 2], &[4, 1], &[0; 16]).is_err());
        assert!(TensorRef::strided(DType::F32, &[2, 2], &[u64::MAX, 1], &[0; 16]).is_err());
        assert!(TensorRef::strided(DType::F32, &[0, 2], &[100, 1], &[]).is_ok());
    }
}
