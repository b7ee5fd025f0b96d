//! Python values to framecodec values and back.
//!
//! In: `None`, `bool`, `int`, `float`, `str`, `bytes`, lists, tuples, dicts with `str` keys,
//! and tensors: torch tensors and any other DLPack producer, NumPy arrays and any other
//! object with the buffer protocol, and this package's own [`PyTensor`]. A contiguous tensor
//! or `bytes` object is held in place (its memory travels, no copy); a non-contiguous one is
//! copied once into contiguous memory, counted in [`copies`].
//!
//! Out: the same kinds, tensors as the caller's `tensor_type` asks: `"numpy"` arrays,
//! `"torch"` tensors or `"tessera"` [`PyTensor`]s, each a view of the memory the value was
//! decoded in (for a GET, the client's receive pool) that keeps it alive.

use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use dlpark::ffi::DLDeviceType;
use dlpark::python::consumer::exchange::ExchangeApi;
use pyo3::buffer::PyUntypedBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use pyo3::{intern, IntoPyObjectExt};
use tessera_framecodec::{DType, Tensor, Value};

use crate::dtype;
use crate::errors::{self, field};
use crate::release::Deferred;
use crate::tensor::PyTensor;

/// Deepest nesting of lists and dicts accepted.
const MAX_DEPTH: usize = 64;

static COPIES: AtomicU64 = AtomicU64::new(0);
static COPIED_BYTES: AtomicU64 = AtomicU64::new(0);

/// Non-contiguous tensors copied on the way in by this process, and their bytes.
pub(crate) fn copies() -> (u64, u64) {
    (
        COPIES.load(Ordering::Relaxed),
        COPIED_BYTES.load(Ordering::Relaxed),
    )
}

fn count_copy(bytes: usize) {
    COPIES.fetch_add(1, Ordering::Relaxed);
    COPIED_BYTES.fetch_add(bytes as u64, Ordering::Relaxed);
}

/// A [`Bytes`] owner: `len` bytes at `ptr`, inside memory that `_hold` keeps alive (a Python
/// object, a buffer export or an imported DLPack tensor).
struct PyOwner {
    ptr: *const u8,
    len: usize,
    _hold: Deferred,
}

// SAFETY: `ptr` is only read through `as_ref`, from any thread: the memory belongs to the
// Python object, buffer export or DLPack capsule in `_hold`, which stays valid until `_hold`
// is released, and each of those may be released from any thread (`Deferred` moves a release
// that needs the GIL to a thread that holds it).
unsafe impl Send for PyOwner {}

impl AsRef<[u8]> for PyOwner {
    fn as_ref(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `ptr..ptr + len` is the exported memory of the object `_hold` keeps alive
        // (an immutable `bytes` object, a buffer export, a DLPack tensor's contiguous bytes);
        // callers promise, as with any zero-copy send, not to resize or free it while a
        // request uses it, and the export itself prevents resizing (bytearray, NumPy).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

fn held(ptr: *const u8, len: usize, hold: Deferred) -> Bytes {
    Bytes::from_owner(PyOwner {
        ptr,
        len,
        _hold: hold,
    })
}

/// `obj` as a framecodec value.
pub(crate) fn value(obj: &Bound<'_, PyAny>) -> PyResult<Value> {
    value_at(obj, 0)
}

fn value_at(obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<Value> {
    if depth > MAX_DEPTH {
        return Err(errors::usage(format!(
            "values nest deeper than {MAX_DEPTH} lists and dicts"
        )));
    }
    if obj.is_none() {
        return Ok(Value::Null);
    }
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if let Ok(i) = obj.cast::<PyInt>() {
        if let Ok(v) = i.extract::<i64>() {
            return Ok(Value::I64(v));
        }
        if let Ok(v) = i.extract::<u64>() {
            return Ok(Value::U64(v));
        }
        return Err(errors::usage(format!(
            "the int {i} does not fit in 64 bits: store it as a str"
        )));
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        return Ok(Value::F64(f.value()));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Value::Str(s.to_str()?.to_owned()));
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        let data = b.as_bytes();
        let (ptr, len) = (data.as_ptr(), data.len());
        let hold = Deferred::new(b.clone().into_any().unbind());
        return Ok(Value::Bytes(held(ptr, len, hold)));
    }
    if let Ok(l) = obj.cast::<PyList>() {
        return l
            .iter()
            .map(|v| value_at(&v, depth + 1))
            .collect::<PyResult<_>>()
            .map(Value::List);
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        return t
            .iter()
            .map(|v| value_at(&v, depth + 1))
            .collect::<PyResult<_>>()
            .map(Value::List);
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        let mut out = Vec::with_capacity(d.len());
        for (k, v) in d.iter() {
            let Ok(key) = k.cast::<PyString>() else {
                return Err(errors::value_type(format!(
                    "dict keys must be str, not {}",
                    type_name(&k)
                )));
            };
            out.push((key.to_str()?.to_owned(), value_at(&v, depth + 1)?));
        }
        return Ok(Value::Map(out));
    }
    tensor(obj).map(Value::Tensor)
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .fully_qualified_name()
        .map_or_else(|_| "?".into(), |n| n.to_string())
}

/// `obj` as a tensor: its memory in place when contiguous, else copied once.
pub(crate) fn tensor(obj: &Bound<'_, PyAny>) -> PyResult<Tensor> {
    if let Ok(t) = obj.cast::<PyTensor>() {
        return Ok(t.get().tensor.clone());
    }
    let py = obj.py();
    let numpy = obj.cast::<numpy::PyUntypedArray>().is_ok();
    if !numpy && obj.hasattr(intern!(py, "__dlpack__"))? {
        return from_dlpack(obj);
    }
    match PyUntypedBuffer::get(obj) {
        Ok(buf) => from_buffer(buf),
        Err(e) => Err(errors::value_type(format!(
            "tessera cannot store a {}: it stores None, bool, int, float, str, bytes, lists, \
             dicts and tensors (torch, NumPy, any DLPack or buffer-protocol object); pickle \
             other objects to bytes ({})",
            type_name(obj),
            e.value(py)
        ))),
    }
}

fn from_buffer(buf: PyUntypedBuffer) -> PyResult<Tensor> {
    let format = buf
        .format()
        .to_str()
        .map_err(|_| errors::value_type("a buffer's format is not ASCII".into()))?;
    let dtype = dtype::from_format(format, buf.item_size()).map_err(errors::value_type)?;
    if buf.suboffsets().is_some() {
        return Err(errors::value_type(
            "indirect buffers (with suboffsets) cannot be stored: copy into a NumPy array".into(),
        ));
    }
    let shape: Vec<u64> = buf.shape().iter().map(|&d| d as u64).collect();
    if buf.is_c_contiguous() {
        let (ptr, len) = (buf.buf_ptr() as *const u8, buf.len_bytes());
        let data = held(ptr, len, Deferred::new(buf));
        return Tensor::new(dtype, &shape, data).map_err(codec);
    }
    // SAFETY: a buffer export guarantees that every item its shape and strides address is
    // readable while the export is held, and `buf` is held until this returns.
    let data = unsafe {
        gather(
            buf.buf_ptr() as *const u8,
            buf.shape(),
            buf.strides(),
            buf.item_size(),
        )
    };
    count_copy(data.len());
    Tensor::new(dtype, &shape, Bytes::from(data)).map_err(codec)
}

/// Memory this process reaches by address: the host's, or CUDA's pinned host memory.
fn host_memory(d: &dlpark::ffi::DLDevice) -> bool {
    d.device_type == DLDeviceType::CPU || d.device_type == DLDeviceType::CUDAHOST
}

/// The dtype of a DLPack tensor in host memory, or why it cannot be stored.
fn host_dtype(t: &dlpark::TensorRef<'_>) -> PyResult<DType> {
    if !host_memory(&t.device()) {
        return Err(device_error(t.device()));
    }
    let dl = t.dtype();
    dtype::from_dlpack(dl).ok_or_else(|| {
        errors::value_type(format!(
            "DLPack dtype (code {}, {} bits, {} lanes) has no tessera dtype",
            dl.code.0, dl.bits, dl.lanes
        ))
    })
}

fn device_error(device: dlpark::ffi::DLDevice) -> PyErr {
    let name = match device.device_type {
        DLDeviceType::CUDA => "cuda",
        _ => "a device",
    };
    errors::error(
        "DeviceError",
        format!(
            "a tensor on {name}:{} (DLPack device type {}): this build of tessera moves host \
             memory only; copy it to the host first (tensor.cpu())",
            device.device_id, device.device_type.0
        ),
        vec![field("device", (device.device_type.0, device.device_id))],
    )
}

/// `obj`'s DLPack tensor, imported without a copy, when it lives in host memory.
fn import_host(obj: &Bound<'_, PyAny>) -> PyResult<dlpark::python::ImportedDlpack> {
    let py = obj.py();
    // torch refuses to export a tensor that requires grad; what is stored is its data, which
    // `detach()` shares without a copy.
    let detached;
    let obj = match obj.getattr_opt(intern!(py, "requires_grad"))? {
        Some(flag) if flag.is_truthy()? => {
            detached = obj.call_method0(intern!(py, "detach"))?;
            &detached
        }
        _ => obj,
    };
    // One discovery: torch's C exchange API when it has one (no Python call per tensor),
    // else `__dlpack_device__` and `__dlpack__`.
    let request = dlpark::python::ImportRequest::new(obj.as_borrowed())?;
    // A legacy producer says its device only once imported.
    if let Some(device) = request.device().ok().filter(|d| !host_memory(d)) {
        return Err(device_error(device));
    }
    request.import(None, Some(false))
}

fn from_dlpack(obj: &Bound<'_, PyAny>) -> PyResult<Tensor> {
    let imported = import_host(obj)?;
    let (dtype, shape, strides, ptr, bytes) = {
        let t = imported
            .validate()
            .map_err(|e| errors::value_type(format!("a malformed DLPack tensor: {e}")))?;
        let dtype = host_dtype(&t)?;
        let compact = t.is_compact().unwrap_or(false);
        let shape: Vec<u64> = t.shape().iter().map(|&d| d.max(0) as u64).collect();
        let strides = (!compact)
            .then(|| t.strides().map(<[i64]>::to_vec))
            .flatten();
        let base = t.data_ptr() as *const u8;
        let ptr = base.wrapping_add(t.byte_offset() as usize);
        (dtype, shape, strides, ptr, t.num_bytes())
    };
    match strides {
        None => {
            let hold = Deferred::new(imported.into_deleter());
            Tensor::new(dtype, &shape, held(ptr, bytes, hold)).map_err(codec)
        }
        Some(strides) => {
            let item = dtype.size();
            let dims: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
            let strides: Vec<isize> = strides
                .iter()
                .map(|&s| s as isize * item as isize)
                .collect();
            // SAFETY: a DLPack producer guarantees that every element its shape and strides
            // address from the data pointer plus byte offset is readable until the managed
            // tensor's deleter runs, which is when `imported` drops, after this copy.
            let data = unsafe { gather(ptr, &dims, &strides, item) };
            drop(imported);
            count_copy(data.len());
            Tensor::new(dtype, &shape, Bytes::from(data)).map_err(codec)
        }
    }
}

/// A caller's tensor that a READ fills in place (Ray's `target_buffers`): contiguous,
/// writable host memory, kept alive by `hold`.
pub(crate) struct Target {
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<u64>,
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
    pub(crate) hold: Deferred,
}

/// `obj` as a [`Target`]: a torch tensor or other DLPack producer, or a writable buffer
/// (NumPy, `bytearray`), contiguous and in host memory; anything else is an error that says
/// why (a read-only or strided tensor cannot be received into in place).
pub(crate) fn target(obj: &Bound<'_, PyAny>) -> PyResult<Target> {
    let py = obj.py();
    if obj.cast::<PyTensor>().is_ok() {
        return Err(errors::usage(
            "a tessera.Tensor is a read-only view of a pool: receive into a torch tensor or a \
             NumPy array"
                .into(),
        ));
    }
    let numpy = obj.cast::<numpy::PyUntypedArray>().is_ok();
    if !numpy && obj.hasattr(intern!(py, "__dlpack__"))? {
        let imported = import_host(obj)?;
        if imported.flags().contains(dlpark::DlpackFlags::READ_ONLY) {
            return Err(errors::usage(
                "the target tensor is read-only: receive into a writable one".into(),
            ));
        }
        let (dtype, shape, ptr, len) = {
            let t = imported
                .validate()
                .map_err(|e| errors::value_type(format!("a malformed DLPack tensor: {e}")))?;
            let dtype = host_dtype(&t)?;
            if !t.is_compact().unwrap_or(false) {
                return Err(errors::usage(
                    "the target tensor is not contiguous: receive into a contiguous one \
                     (.contiguous()) and copy from it"
                        .into(),
                ));
            }
            let shape: Vec<u64> = t.shape().iter().map(|&d| d.max(0) as u64).collect();
            let ptr = (t.data_ptr() as *mut u8).wrapping_add(t.byte_offset() as usize);
            (dtype, shape, ptr, t.num_bytes())
        };
        return Ok(Target {
            dtype,
            shape,
            ptr,
            len,
            hold: Deferred::new(imported.into_deleter()),
        });
    }
    let buf = PyUntypedBuffer::get(obj).map_err(|e| {
        errors::value_type(format!(
            "cannot receive into a {}: give a torch tensor, a NumPy array or another \
             writable buffer ({})",
            type_name(obj),
            e.value(py)
        ))
    })?;
    if buf.readonly() {
        return Err(errors::usage(
            "the target buffer is read-only: receive into a writable one".into(),
        ));
    }
    if !buf.is_c_contiguous() || buf.suboffsets().is_some() {
        return Err(errors::usage(
            "the target buffer is not C-contiguous: receive into a contiguous one and copy \
             from it"
                .into(),
        ));
    }
    let format = buf
        .format()
        .to_str()
        .map_err(|_| errors::value_type("a buffer's format is not ASCII".into()))?;
    let dtype = dtype::from_format(format, buf.item_size()).map_err(errors::value_type)?;
    let shape: Vec<u64> = buf.shape().iter().map(|&d| d as u64).collect();
    let (ptr, len) = (buf.buf_ptr() as *mut u8, buf.len_bytes());
    Ok(Target {
        dtype,
        shape,
        ptr,
        len,
        hold: Deferred::new(buf),
    })
}

/// A tensor's memory seen through its producer's borrowed DLPack view: valid while the
/// producer's object is alive and nothing resizes it, so only while the GIL is held.
pub(crate) struct View {
    pub(crate) dtype: DType,
    pub(crate) shape: tessera_framecodec::Dims,
    /// In elements, when not row-major contiguous (never negative).
    pub(crate) strides: Option<Vec<u64>>,
    pub(crate) ptr: *const u8,
    /// Bytes from `ptr` to past the last element.
    pub(crate) span: usize,
}

/// `obj`'s memory through the C exchange API's borrowed view (torch has it), without making a
/// managed tensor: for callers that copy the bytes before they release the GIL. `None` for
/// producers without the API and for negative strides (left to [`tensor`], which copies).
///
/// `apis` caches each type's API (a put of many tensors asks once per type).
pub(crate) fn borrowed_view(
    obj: &Bound<'_, PyAny>,
    apis: &mut Vec<(usize, Option<ExchangeApi>)>,
) -> PyResult<Option<View>> {
    if obj.cast::<PyTensor>().is_ok() || obj.cast::<numpy::PyUntypedArray>().is_ok() {
        return Ok(None);
    }
    let ty = obj.get_type().as_ptr() as usize;
    let at = match apis.iter().position(|(t, _)| *t == ty) {
        Some(i) => i,
        None => {
            apis.push((ty, ExchangeApi::from_object(obj.as_borrowed())?));
            apis.len() - 1
        }
    };
    let Some(api) = &apis[at].1 else {
        return Ok(None);
    };
    api.with_tensor_view_no_sync(obj.as_borrowed(), |raw, _stream| {
        // SAFETY: the producer keeps the view, its shape and its strides readable and
        // unchanged for the duration of this callback, which is all this borrow lasts.
        let t = unsafe { dlpark::TensorRef::from_raw(raw) }
            .map_err(|e| errors::value_type(format!("a malformed DLPack tensor: {e}")))?;
        let dtype = host_dtype(&t)?;
        // Inline up to rank 4: no allocation per view.
        let shape: tessera_framecodec::Dims = t.shape().iter().map(|&d| d.max(0) as u64).collect();
        let strides = match t.strides() {
            Some(st) if !row_major(t.shape(), st) => {
                if st.iter().any(|&x| x < 0) {
                    return Ok(None);
                }
                Some(st.iter().map(|&x| x as u64).collect::<Vec<u64>>())
            }
            _ => None,
        };
        let item = dtype.size();
        let span = if shape.contains(&0) {
            0
        } else {
            match &strides {
                None => t.num_bytes(),
                Some(st) => {
                    let last: u64 = shape.iter().zip(st).map(|(&d, &s)| (d - 1) * s).sum();
                    (last as usize + 1) * item
                }
            }
        };
        let ptr = (t.data_ptr() as *const u8).wrapping_add(t.byte_offset() as usize);
        Ok(Some(View {
            dtype,
            shape,
            strides,
            ptr,
            span,
        }))
    })?
}

/// Whether `strides` (in elements) lay `shape` out row-major and contiguous. Dimensions of
/// extent 1 may have any stride, and an empty tensor is contiguous. Without allocating: a
/// put of 10,000 views asks once per view.
fn row_major(shape: &[i64], strides: &[i64]) -> bool {
    if shape.len() != strides.len() {
        return false;
    }
    if shape.contains(&0) {
        return true;
    }
    let mut expect = 1i64;
    for (&d, &st) in shape.iter().zip(strides).rev() {
        if d != 1 && st != expect {
            return false;
        }
        expect = expect.saturating_mul(d);
    }
    true
}

/// Copies the items of a strided array into a contiguous row-major vector (whole rows at a
/// time when the last dimension is contiguous).
///
/// # Safety
/// Every item `base + Σ idx[i] × strides[i]` (bytes) for `idx < shape` must be readable.
unsafe fn gather(base: *const u8, shape: &[usize], strides: &[isize], item: usize) -> Vec<u8> {
    let count: usize = shape.iter().product();
    let mut out = Vec::with_capacity(count * item);
    if count == 0 {
        return out;
    }
    let rank = shape.len();
    // A contiguous last dimension is copied as one run.
    let (outer, run) = match (shape.last(), strides.last()) {
        (Some(&n), Some(&s)) if s == item as isize => (rank - 1, n * item),
        _ => (rank, item),
    };
    let mut idx = vec![0usize; outer];
    loop {
        let offset: isize = idx.iter().zip(strides).map(|(&i, &s)| i as isize * s).sum();
        // SAFETY: the caller guarantees each addressed item (and so each contiguous run of
        // the last dimension) is readable.
        out.extend_from_slice(unsafe { std::slice::from_raw_parts(base.offset(offset), run) });
        let mut d = outer;
        loop {
            if d == 0 {
                return out;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

fn codec(e: tessera_framecodec::TensorError) -> PyErr {
    errors::error("CodecError", errors::chain(&e), Vec::new())
}

/// How tensors come out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TensorType {
    Numpy,
    Torch,
    Tessera,
}

impl TensorType {
    pub(crate) fn parse(name: &str) -> PyResult<Self> {
        match name {
            "numpy" => Ok(Self::Numpy),
            "torch" => Ok(Self::Torch),
            "tessera" => Ok(Self::Tessera),
            other => Err(errors::usage(format!(
                "tensor_type {other:?}: expected \"numpy\", \"torch\" or \"tessera\""
            ))),
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Numpy => "numpy",
            Self::Torch => "torch",
            Self::Tessera => "tessera",
        }
    }
}

/// `v` as a Python object, tensors as `tt` asks.
pub(crate) fn to_py(py: Python<'_>, v: Value, tt: TensorType) -> PyResult<Py<PyAny>> {
    Ok(match v {
        Value::Null => py.None(),
        Value::Bool(b) => b.into_py_any(py)?,
        Value::I64(i) => i.into_py_any(py)?,
        Value::U64(u) => u.into_py_any(py)?,
        Value::F64(f) => f.into_py_any(py)?,
        Value::Str(s) => s.into_py_any(py)?,
        Value::Bytes(b) => PyBytes::new(py, &b).into_any().unbind(),
        Value::List(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(to_py(py, item, tt)?)?;
            }
            list.into_any().unbind()
        }
        Value::Map(entries) => {
            let dict = PyDict::new(py);
            for (k, v) in entries {
                // Lookups see the first of duplicate keys, as `Value::Map` does.
                if !dict.contains(&k)? {
                    dict.set_item(k, to_py(py, v, tt)?)?;
                }
            }
            dict.into_any().unbind()
        }
        Value::Tensor(t) => tensor_to_py(py, t, tt)?,
    })
}

/// `t` as `tt` asks.
pub(crate) fn tensor_to_py(py: Python<'_>, t: Tensor, tt: TensorType) -> PyResult<Py<PyAny>> {
    Ok(match tt {
        TensorType::Tessera => Bound::new(py, PyTensor { tensor: t })?.into_any().unbind(),
        TensorType::Numpy => {
            crate::tensor::numpy_view(&Bound::new(py, PyTensor { tensor: t })?)?.unbind()
        }
        TensorType::Torch => crate::tensor::torch_tensor(py, t)?.unbind(),
    })
}
