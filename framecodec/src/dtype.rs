//! Element types of tensors and their wire codes.

use std::fmt;

/// The element type of a tensor.
///
/// Every dtype has a fixed size in bytes and is aligned to its own size on the wire (complex
/// numbers to their full width, as NumPy and Ray do). The fp8 kinds follow the OCP 8-bit formats
/// as PyTorch names them: [`DType::F8E4M3`] is `float8_e4m3fn` (finite, no infinities) and
/// [`DType::F8E5M2`] is `float8_e5m2`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// One byte, 0 or 1.
    Bool,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 8-bit integer.
    I8,
    /// Unsigned 16-bit integer.
    U16,
    /// Signed 16-bit integer.
    I16,
    /// Unsigned 32-bit integer.
    U32,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned 64-bit integer.
    U64,
    /// Signed 64-bit integer.
    I64,
    /// IEEE 754 half precision.
    F16,
    /// bfloat16: the upper half of an `f32`.
    BF16,
    /// IEEE 754 single precision.
    F32,
    /// IEEE 754 double precision.
    F64,
    /// Two `f32`: real, then imaginary.
    Complex64,
    /// Two `f64`: real, then imaginary.
    Complex128,
    /// 8-bit float, 4 exponent bits, 3 mantissa bits, finite only (`float8_e4m3fn`).
    F8E4M3,
    /// 8-bit float, 5 exponent bits, 2 mantissa bits (`float8_e5m2`).
    F8E5M2,
}

impl DType {
    /// Every dtype, in wire-code order.
    pub const ALL: [DType; 17] = [
        DType::Bool,
        DType::U8,
        DType::I8,
        DType::U16,
        DType::I16,
        DType::U32,
        DType::I32,
        DType::U64,
        DType::I64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
        DType::Complex64,
        DType::Complex128,
        DType::F8E4M3,
        DType::F8E5M2,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 | DType::F8E4M3 | DType::F8E5M2 => 1,
            DType::U16 | DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::U32 | DType::I32 | DType::F32 => 4,
            DType::U64 | DType::I64 | DType::F64 | DType::Complex64 => 8,
            DType::Complex128 => 16,
        }
    }

    /// Alignment of one element on the wire and in a receive buffer, in bytes (equal to its size).
    pub const fn align(self) -> usize {
        self.size()
    }

    /// The code that stands for this dtype in the meta frame (see `WIRE.md`).
    pub const fn code(self) -> u8 {
        match self {
            DType::Bool => 0,
            DType::U8 => 1,
            DType::I8 => 2,
            DType::U16 => 3,
            DType::I16 => 4,
            DType::U32 => 5,
            DType::I32 => 6,
            DType::U64 => 7,
            DType::I64 => 8,
            DType::F16 => 9,
            DType::BF16 => 10,
            DType::F32 => 11,
            DType::F64 => 12,
            DType::Complex64 => 13,
            DType::Complex128 => 14,
            DType::F8E4M3 => 15,
            DType::F8E5M2 => 16,
        }
    }

    /// The dtype with wire code `code`, if any.
    pub const fn from_code(code: u8) -> Option<DType> {
        if (code as usize) < Self::ALL.len() {
            Some(Self::ALL[code as usize])
        } else {
            None
        }
    }

    /// The PyTorch name of this dtype, without the `torch.` prefix.
    pub const fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::U16 => "uint16",
            DType::I16 => "int16",
            DType::U32 => "uint32",
            DType::I32 => "int32",
            DType::U64 => "uint64",
            DType::I64 => "int64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::Complex64 => "complex64",
            DType::Complex128 => "complex128",
            DType::F8E4M3 => "float8_e4m3fn",
            DType::F8E5M2 => "float8_e5m2",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_are_dense() {
        for (i, d) in DType::ALL.iter().enumerate() {
            assert_eq!(d.code() as usize, i);
            assert_eq!(DType::from_code(d.code()), Some(*d));
            assert!(d.size().is_power_of_two());
            assert_eq!(d.align(), d.size());
        }
        assert_eq!(DType::from_code(17), None);
        assert_eq!(DType::from_code(255), None);
    }

    #[test]
    fn sizes_match_their_names() {
        assert_eq!(DType::BF16.size(), 2);
        assert_eq!(DType::Complex64.size(), 8);
        assert_eq!(DType::Complex128.size(), 16);
        assert_eq!(DType::F8E5M2.size(), 1);
        assert_eq!(DType::F8E4M3.to_string(), "float8_e4m3fn");
    }
}
