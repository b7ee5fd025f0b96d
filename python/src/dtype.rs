//! Tessera's dtypes as DLPack, the buffer protocol, NumPy and torch name them.

use dlpark::ffi::{DLDataType, DLDataTypeCode};
use tessera_framecodec::DType;

/// The DLPack type of `d`.
pub(crate) fn to_dlpack(d: DType) -> DLDataType {
    match d {
        DType::Bool => DLDataType::BOOL,
        DType::U8 => DLDataType::U8,
        DType::I8 => DLDataType::I8,
        DType::U16 => DLDataType::U16,
        DType::I16 => DLDataType::I16,
        DType::U32 => DLDataType::U32,
        DType::I32 => DLDataType::I32,
        DType::U64 => DLDataType::U64,
        DType::I64 => DLDataType::I64,
        DType::F16 => DLDataType::scalar(DLDataTypeCode::FLOAT, 16),
        DType::BF16 => DLDataType::scalar(DLDataTypeCode::BFLOAT, 16),
        DType::F32 => DLDataType::F32,
        DType::F64 => DLDataType::F64,
        DType::Complex64 => DLDataType::C64,
        DType::Complex128 => DLDataType::C128,
        DType::F8E4M3 => DLDataType::F8E4M3FN,
        DType::F8E5M2 => DLDataType::F8E5M2,
    }
}

/// The dtype of a DLPack type, if tessera has it (scalar types only).
pub(crate) fn from_dlpack(t: DLDataType) -> Option<DType> {
    if t.lanes != 1 {
        return None;
    }
    DType::ALL.into_iter().find(|d| {
        let dl = to_dlpack(*d);
        dl.code == t.code && dl.bits == t.bits
    })
}

/// The dtype of a buffer-protocol format (`struct` module syntax, one item) whose items are
/// `itemsize` bytes: native or little-endian byte order only.
pub(crate) fn from_format(format: &str, itemsize: usize) -> Result<DType, String> {
    let code = match format.as_bytes().first() {
        Some(b'@' | b'=' | b'<') => &format[1..],
        Some(b'>' | b'!') => {
            return Err(format!(
                "big-endian buffers (format {format:?}) are not supported: convert to the \
                 native byte order first (numpy: a.astype(a.dtype.newbyteorder('='))"
            ))
        }
        _ => format,
    };
    let d = match (code, itemsize) {
        ("?", 1) => DType::Bool,
        ("b", 1) => DType::I8,
        ("B" | "c", 1) => DType::U8,
        ("h", 2) => DType::I16,
        ("H", 2) => DType::U16,
        ("i" | "l", 4) => DType::I32,
        ("I" | "L", 4) => DType::U32,
        ("l" | "q" | "n", 8) => DType::I64,
        ("L" | "Q" | "N", 8) => DType::U64,
        ("e", 2) => DType::F16,
        ("f", 4) => DType::F32,
        ("d", 8) => DType::F64,
        ("Zf", 8) => DType::Complex64,
        ("Zd", 16) => DType::Complex128,
        _ => {
            return Err(format!(
                "a buffer of format {format:?} ({itemsize}-byte items) has no tessera dtype: \
                 tessera stores bool, (u)int8..64, float16/32/64, bfloat16, complex64/128 and \
                 float8 (e4m3fn, e5m2)"
            ))
        }
    };
    Ok(d)
}

/// NumPy's type string of `d`, if NumPy has the type.
pub(crate) fn to_numpy(d: DType) -> Option<&'static str> {
    Some(match d {
        DType::Bool => "?",
        DType::U8 => "u1",
        DType::I8 => "i1",
        DType::U16 => "<u2",
        DType::I16 => "<i2",
        DType::U32 => "<u4",
        DType::I32 => "<i4",
        DType::U64 => "<u8",
        DType::I64 => "<i8",
        DType::F16 => "<f2",
        DType::F32 => "<f4",
        DType::F64 => "<f8",
        DType::Complex64 => "<c8",
        DType::Complex128 => "<c16",
        DType::BF16 | DType::F8E4M3 | DType::F8E5M2 => return None,
    })
}
