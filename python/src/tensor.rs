//! `tessera.Tensor`: a tensor in memory Rust owns (a GET's receive block, a fetched object's
//! pool block), shared with NumPy and torch without a copy. Every view made from it keeps it,
//! and so its block, alive; the block returns to its pool when the last one is gone.

use std::ffi::c_void;

use dlpark::ffi::{DLDevice, DLManagedTensor, DLManagedTensorVersioned};
use dlpark::metadata::Dynamic;
use dlpark::python::consumer::exchange::ExchangeApi;
use dlpark::python::{export_dlpack, DlpackExporter, ExportRequest};
use dlpark::{DlpackFlags, Managed, ManagedTensorBase};
use numpy::npyffi::{self, NpyTypes, NPY_ARRAY_WRITEABLE, PY_ARRAY_API};
use numpy::{PyArrayDescr, PyArrayDescrMethods};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use tessera_framecodec::Tensor;

use crate::dtype;
use crate::errors::{self, field};

/// A tensor whose memory tessera owns; `numpy()`, `torch()`, `np.from_dlpack` and
/// `torch.from_dlpack` view it in place. Views are writable: the memory is this process's
/// alone (torch ignores DLPack's read-only flag in any case).
#[pyclass(name = "Tensor", module = "tessera", frozen)]
pub(crate) struct PyTensor {
    pub(crate) tensor: Tensor,
}

fn shape_i64(t: &Tensor) -> Vec<i64> {
    t.shape().iter().map(|&d| d as i64).collect()
}

/// Strides in elements: the tensor's own, or row-major ones.
fn strides_i64(t: &Tensor) -> Vec<i64> {
    match t.strides() {
        Some(s) => s.iter().map(|&s| s as i64).collect(),
        None => {
            let shape = t.shape();
            let mut out = vec![1i64; shape.len()];
            for i in (0..shape.len().saturating_sub(1)).rev() {
                out[i] = out[i + 1] * shape[i + 1].max(1) as i64;
            }
            out
        }
    }
}

/// A DLPack managed tensor over `t`'s memory, owning a handle on it.
fn managed<M: ManagedTensorBase>(t: &Tensor) -> PyResult<Managed<M>> {
    let data = t.data().clone();
    let ptr = data.as_ptr() as *mut c_void;
    let mut init = Dynamic::new(shape_i64(t), strides_i64(t))
        .initialize_as::<M>(Box::new(data))
        .map_err(|e| errors::tessera(format!("exporting a tensor through DLPack: {e}")))?;
    init.set_data(ptr)
        .set_dtype(dtype::to_dlpack(t.dtype()))
        .set_device(DLDevice::CPU);
    // SAFETY: the data pointer is the start of the tensor's `Bytes`, which the managed
    // tensor's own context (the boxed clone above) keeps alive until its deleter runs; shape
    // and strides are the tensor's, checked against its byte length when it was built, so
    // every element they address lies inside those bytes; the dtype is the tensor's and the
    // device the host's.
    Ok(unsafe { init.finish() })
}

impl DlpackExporter for PyTensor {
    fn device(&self) -> DLDevice {
        DLDevice::CPU
    }

    fn flags(&self) -> DlpackFlags {
        DlpackFlags::empty()
    }

    fn prepare_export(&self, _py: Python<'_>, _request: &ExportRequest<'_>) -> PyResult<()> {
        Ok(())
    }

    fn export_legacy(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensor>> {
        managed(&self.tensor)
    }

    fn export_versioned(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensorVersioned>> {
        managed(&self.tensor)
    }
}

#[pymethods]
impl PyTensor {
    /// The dtype's torch name (`"float32"`, `"bfloat16"`, ...).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.tensor.dtype().name()
    }

    #[getter]
    fn shape(&self) -> Vec<u64> {
        self.tensor.shape().to_vec()
    }

    /// Strides in elements, or `None` when contiguous.
    #[getter]
    fn strides(&self) -> Option<Vec<u64>> {
        self.tensor.strides().map(<[u64]>::to_vec)
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.tensor.data().len()
    }

    /// Address of the first byte.
    #[getter]
    fn data_ptr(&self) -> usize {
        self.tensor.data().as_ptr() as usize
    }

    /// A NumPy array viewing this tensor's memory.
    fn numpy<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        numpy_view(slf)
    }

    /// A torch tensor viewing this tensor's memory (`torch.from_dlpack`).
    fn torch<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        torch_view(slf)
    }

    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let request = ExportRequest::parse(stream.as_ref(), max_version, dl_device, copy)?;
        export_dlpack(self, py, request)
    }

    fn __dlpack_device__(&self) -> (u32, i32) {
        (DLDevice::CPU.device_type.0, 0)
    }

    fn __repr__(&self) -> String {
        format!(
            "tessera.Tensor(dtype={}, shape={:?}, nbytes={})",
            self.tensor.dtype(),
            self.tensor.shape(),
            self.tensor.data().len()
        )
    }
}

/// A NumPy array over `owner`'s memory whose `base` is `owner`.
pub(crate) fn numpy_view<'py>(owner: &Bound<'py, PyTensor>) -> PyResult<Bound<'py, PyAny>> {
    let py = owner.py();
    let t = &owner.get().tensor;
    let typestr = dtype::to_numpy(t.dtype()).ok_or_else(|| {
        errors::error(
            "UsageError",
            format!(
                "NumPy has no {} dtype: ask for torch tensors (tensor_type=\"torch\")",
                t.dtype()
            ),
            vec![field("dtype", t.dtype().name())],
        )
    })?;
    let descr = PyArrayDescr::new(py, typestr)?;
    let item = t.dtype().size() as isize;
    let mut dims: Vec<npyffi::npy_intp> = t.shape().iter().map(|&d| d as isize).collect();
    let mut strides: Vec<npyffi::npy_intp> =
        strides_i64(t).iter().map(|&s| s as isize * item).collect();
    let rank = std::ffi::c_int::try_from(dims.len())
        .map_err(|_| errors::usage("rank too high for NumPy".into()))?;
    let data = t.data().as_ptr() as *mut c_void;
    // SAFETY: `PyArray_NewFromDescr` makes an array over `data` with these dims and byte
    // strides, which address only bytes of the tensor (checked when it was built); it steals
    // the descriptor reference `into_dtype_ptr` hands it; a null return sets a Python error.
    // `PyArray_SetBaseObject` steals the reference to `owner` given to it, so the array keeps
    // the tensor, and so its memory, alive for as long as it (or any view of it) lives.
    unsafe {
        let arr = PY_ARRAY_API.PyArray_NewFromDescr(
            py,
            npyffi::get_type_object(py, NpyTypes::PyArray_Type),
            descr.into_dtype_ptr(),
            rank,
            dims.as_mut_ptr(),
            strides.as_mut_ptr(),
            data,
            NPY_ARRAY_WRITEABLE,
            std::ptr::null_mut(),
        );
        let arr = Bound::from_owned_ptr_or_err(py, arr)?;
        let base = owner.clone().into_any().into_ptr();
        if PY_ARRAY_API.PyArray_SetBaseObject(py, arr.as_ptr().cast(), base) < 0 {
            return Err(PyErr::fetch(py));
        }
        Ok(arr)
    }
}

/// A torch tensor (its type carries torch's DLPack C exchange API) and `torch.from_dlpack`,
/// once torch is imported.
struct Torch {
    probe: Py<PyAny>,
    from_dlpack: Py<PyAny>,
}

static TORCH: PyOnceLock<Torch> = PyOnceLock::new();

fn torch(py: Python<'_>) -> PyResult<&Torch> {
    TORCH.get_or_try_init(py, || {
        let torch = py.import("torch").map_err(|e| {
            errors::usage(format!(
                "tensor_type=\"torch\" needs torch, which does not import here ({e}): install \
                 torch or ask for tensor_type=\"numpy\""
            ))
        })?;
        Ok::<_, PyErr>(Torch {
            probe: torch.getattr("empty")?.call1((0,))?.unbind(),
            from_dlpack: torch.getattr("from_dlpack")?.unbind(),
        })
    })
}

/// A torch tensor over `t`'s memory that keeps it alive: handed to torch through its DLPack C
/// exchange API when it has one (no Python call, no capsule), else `torch.from_dlpack`.
pub(crate) fn torch_tensor(py: Python<'_>, t: Tensor) -> PyResult<Bound<'_, PyAny>> {
    let torch = torch(py)?;
    // The API is an attribute of the tensor type: looked up through an instance of it.
    if let Some(api) = ExchangeApi::from_object(torch.probe.bind(py).as_borrowed())? {
        return api.managed_tensor_to_py_object_no_sync(managed(&t)?, py);
    }
    let owner = Bound::new(py, PyTensor { tensor: t })?;
    torch.from_dlpack.bind(py).call1((owner,))
}

/// A torch tensor over `owner`'s memory (see [`torch_tensor`]).
pub(crate) fn torch_view<'py>(owner: &Bound<'py, PyTensor>) -> PyResult<Bound<'py, PyAny>> {
    torch_tensor(owner.py(), owner.get().tensor.clone())
}
