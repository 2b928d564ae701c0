//! Element types the codec understands and how each one is transformed.

use super::error::{DeltaError, Result};

/// Element type of a tensor, as torch and numpy name them.
///
/// The codec only needs the element width and whether the bits are an IEEE float, a
/// signed/unsigned integer or opaque; the dtype is stored in the blob so that a decoder
/// can give the tensor back with its type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    /// `bool` (one byte, 0 or 1 — any byte value round-trips).
    Bool = 0,
    /// `uint8`.
    U8 = 1,
    /// `int8`.
    I8 = 2,
    /// `int16`.
    I16 = 3,
    /// `uint16`.
    U16 = 4,
    /// `int32`.
    I32 = 5,
    /// `uint32`.
    U32 = 6,
    /// `int64`.
    I64 = 7,
    /// `uint64`.
    U64 = 8,
    /// IEEE binary16 (`float16`).
    F16 = 9,
    /// bfloat16.
    BF16 = 10,
    /// IEEE binary32 (`float32`).
    F32 = 11,
    /// IEEE binary64 (`float64`).
    F64 = 12,
    /// `complex64`: pairs of float32.
    C64 = 13,
    /// `complex128`: pairs of float64.
    C128 = 14,
}

const ALL: [DType; 15] = [
    DType::Bool,
    DType::U8,
    DType::I8,
    DType::I16,
    DType::U16,
    DType::I32,
    DType::U32,
    DType::I64,
    DType::U64,
    DType::F16,
    DType::BF16,
    DType::F32,
    DType::F64,
    DType::C64,
    DType::C128,
];

/// How the bits of one element are compared with the previous element's bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ElementDiff {
    /// Opaque bytes: XOR.
    Bits,
    /// Integers: wrapping difference, zigzag-coded.
    Int,
    /// IEEE floats: difference of the order-preserving integer keys, zigzag-coded
    /// (the distance in units in the last place).
    Float,
}

impl DType {
    /// Every dtype, in code order.
    pub fn all() -> &'static [DType] {
        &ALL
    }

    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 => 1,
            DType::I16 | DType::U16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 | DType::C64 => 8,
            DType::C128 => 16,
        }
    }

    /// Width of the lane the transforms work on (a complex number is two float lanes).
    pub(crate) fn lane_width(self) -> usize {
        match self {
            DType::C64 => 4,
            DType::C128 => 8,
            d => d.size(),
        }
    }

    pub(crate) fn element_diff(self) -> ElementDiff {
        match self {
            DType::Bool | DType::U8 => ElementDiff::Bits,
            DType::I8 | DType::I16 | DType::U16 | DType::I32 | DType::U32 => ElementDiff::Int,
            DType::I64 | DType::U64 => ElementDiff::Int,
            DType::F16 | DType::BF16 | DType::F32 | DType::F64 | DType::C64 | DType::C128 => {
                ElementDiff::Float
            }
        }
    }

    /// Whether the lossy (quantised) mode applies to this dtype.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }

    /// The numpy/torch name of the dtype (`"float32"`, `"bfloat16"`, `"bool"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::U16 => "uint16",
            DType::I32 => "int32",
            DType::U32 => "uint32",
            DType::I64 => "int64",
            DType::U64 => "uint64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::C64 => "complex64",
            DType::C128 => "complex128",
        }
    }

    /// Parses a numpy/torch dtype name; `torch.` prefixes and the aliases `half`, `float`,
    /// `double`, `long`, `int`, `short` are accepted.
    pub fn from_name(name: &str) -> Result<DType> {
        let n = name.strip_prefix("torch.").unwrap_or(name);
        let n = match n {
            "half" => "float16",
            "float" => "float32",
            "double" => "float64",
            "long" => "int64",
            "int" => "int32",
            "short" => "int16",
            "cfloat" => "complex64",
            "cdouble" => "complex128",
            other => other,
        };
        ALL.iter()
            .copied()
            .find(|d| d.name() == n)
            .ok_or_else(|| DeltaError::InvalidArgument(format!("unsupported dtype {name:?}")))
    }

    /// The dtype stored under `code` in a blob.
    pub fn from_code(code: u8) -> Option<DType> {
        ALL.get(usize::from(code)).copied()
    }

    /// The code stored in a blob.
    pub fn code(self) -> u8 {
        self as u8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_codes_round_trip() {
        for &d in DType::all() {
            assert_eq!(DType::from_name(d.name()), Ok(d));
            assert_eq!(DType::from_code(d.code()), Some(d));
        }
        assert_eq!(DType::from_name("torch.half"), Ok(DType::F16));
        assert!(DType::from_name("float8").is_err());
        assert_eq!(DType::from_code(15), None);
    }
}
