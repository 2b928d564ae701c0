//! Element types and reduction operators, with their one-byte wire codes.

use crate::error::{Error, Result};
use std::fmt;

/// The element type of a tensor: every dtype torch moves. All of them travel bit for bit in
/// the data-moving collectives (broadcast, all-gather, send/recv); reductions take the ones
/// Gloo reduces ([`ReduceOp::check`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    /// IEEE 754 binary32.
    F32 = 1,
    /// IEEE 754 binary64.
    F64 = 2,
    /// IEEE 754 binary16.
    F16 = 3,
    /// bfloat16 (the top half of a binary32).
    BF16 = 4,
    /// Signed 32-bit integer.
    I32 = 5,
    /// Signed 64-bit integer.
    I64 = 6,
    /// Unsigned 8-bit integer.
    U8 = 7,
    /// Signed 8-bit integer.
    I8 = 8,
    /// Signed 16-bit integer.
    I16 = 9,
    /// Unsigned 16-bit integer.
    U16 = 10,
    /// Unsigned 32-bit integer.
    U32 = 11,
    /// Unsigned 64-bit integer.
    U64 = 12,
    /// Boolean, one byte (0 or 1); sum and max are "or", prod and min are "and".
    Bool = 13,
    /// Complex of two binary32 (real, imaginary); sum and avg only.
    C64 = 14,
    /// Complex of two binary64; sum and avg only.
    C128 = 15,
    /// 8-bit float, 4 exponent bits, finite (torch.float8_e4m3fn); moved, not reduced.
    F8E4M3 = 16,
    /// 8-bit float, 5 exponent bits (torch.float8_e5m2); moved, not reduced.
    F8E5M2 = 17,
    /// 8-bit float e4m3, finite, unsigned zero (torch.float8_e4m3fnuz); moved, not reduced.
    F8E4M3Uz = 18,
    /// 8-bit float e5m2, finite, unsigned zero (torch.float8_e5m2fnuz); moved, not reduced.
    F8E5M2Uz = 19,
}

impl DType {
    /// Every dtype, for tests and lookups.
    pub const ALL: [DType; 19] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::I8,
        DType::I16,
        DType::U16,
        DType::U32,
        DType::U64,
        DType::Bool,
        DType::C64,
        DType::C128,
        DType::F8E4M3,
        DType::F8E5M2,
        DType::F8E4M3Uz,
        DType::F8E5M2Uz,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::U8
            | DType::I8
            | DType::Bool
            | DType::F8E4M3
            | DType::F8E5M2
            | DType::F8E4M3Uz
            | DType::F8E5M2Uz => 1,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 | DType::C64 => 8,
            DType::C128 => 16,
        }
    }

    /// True for the real floating-point types that arithmetic (and the codecs) work on.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// True for the complex types.
    pub fn is_complex(self) -> bool {
        matches!(self, DType::C64 | DType::C128)
    }

    /// The canonical lower-case name (`"float32"`, ...), as numpy and torch spell it.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::U16 => "uint16",
            DType::U32 => "uint32",
            DType::U64 => "uint64",
            DType::Bool => "bool",
            DType::C64 => "complex64",
            DType::C128 => "complex128",
            DType::F8E4M3 => "float8_e4m3fn",
            DType::F8E5M2 => "float8_e5m2",
            DType::F8E4M3Uz => "float8_e4m3fnuz",
            DType::F8E5M2Uz => "float8_e5m2fnuz",
        }
    }

    /// Parses a canonical name.
    pub fn from_name(name: &str) -> Result<DType> {
        DType::ALL
            .into_iter()
            .find(|d| d.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = DType::ALL.iter().map(|d| d.name()).collect();
                Error::InvalidArgument(format!(
                    "unsupported dtype {name:?}; supported: {}",
                    names.join(", ")
                ))
            })
    }

    /// Decodes a wire code.
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.into_iter().find(|d| *d as u8 == code)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How a reduction combines the contributions of the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    /// No reduction (data movement only: broadcast, gather, send).
    None = 0,
    /// Element-wise sum (wrapping for integers).
    Sum = 1,
    /// Sum divided by the number of ranks (floating types only).
    Avg = 2,
    /// Element-wise minimum (NaN wins for floats).
    Min = 3,
    /// Element-wise maximum (NaN wins for floats).
    Max = 4,
    /// Element-wise product (wrapping for integers).
    Prod = 5,
    /// Bitwise and (integers; logical and for bool).
    BAnd = 6,
    /// Bitwise or (integers; logical or for bool).
    BOr = 7,
    /// Bitwise exclusive or (integers; logical xor for bool).
    BXor = 8,
}

impl ReduceOp {
    /// The canonical name (`"sum"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::None => "none",
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Prod => "prod",
            ReduceOp::BAnd => "band",
            ReduceOp::BOr => "bor",
            ReduceOp::BXor => "bxor",
        }
    }

    /// Parses a canonical name (case-insensitive, `"mean"` accepted for `avg`).
    pub fn from_name(name: &str) -> Result<ReduceOp> {
        match name.to_ascii_lowercase().as_str() {
            "sum" => Ok(ReduceOp::Sum),
            "avg" | "mean" => Ok(ReduceOp::Avg),
            "min" => Ok(ReduceOp::Min),
            "max" => Ok(ReduceOp::Max),
            "prod" | "product" => Ok(ReduceOp::Prod),
            "band" => Ok(ReduceOp::BAnd),
            "bor" => Ok(ReduceOp::BOr),
            "bxor" => Ok(ReduceOp::BXor),
            _ => Err(Error::InvalidArgument(format!(
                "unsupported op {name:?}; supported: sum, avg, min, max, prod, band, bor, bxor"
            ))),
        }
    }

    /// Decodes a wire code.
    pub fn from_code(code: u8) -> Option<ReduceOp> {
        [
            ReduceOp::None,
            ReduceOp::Sum,
            ReduceOp::Avg,
            ReduceOp::Min,
            ReduceOp::Max,
            ReduceOp::Prod,
            ReduceOp::BAnd,
            ReduceOp::BOr,
            ReduceOp::BXor,
        ]
        .into_iter()
        .find(|o| *o as u8 == code)
    }

    /// Whether this is a bitwise op (integers and bool only).
    pub fn is_bitwise(self) -> bool {
        matches!(self, ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor)
    }

    /// Checks that this op can reduce `dtype`: sum, min, max and prod the real numbers,
    /// integers and bool, avg the floats, the bitwise ops the integers and bool (as Gloo
    /// reduces them); complex sum and avg; no 8-bit float (cast up first).
    pub fn check(self, dtype: DType) -> Result<()> {
        if self == ReduceOp::None {
            return Ok(());
        }
        if self.is_bitwise() && (dtype.is_float() || dtype.is_complex()) {
            return Err(Error::InvalidArgument(format!(
                "op '{self}' is bitwise: it needs an integer or bool dtype, got {dtype}"
            )));
        }
        if matches!(
            dtype,
            DType::F8E4M3 | DType::F8E5M2 | DType::F8E4M3Uz | DType::F8E5M2Uz
        ) {
            return Err(Error::InvalidArgument(format!(
                "{dtype} is moved but not reduced; reduce it in a wider float (bfloat16, float32)"
            )));
        }
        if dtype.is_complex() && !matches!(self, ReduceOp::Sum | ReduceOp::Avg) {
            return Err(Error::InvalidArgument(format!(
                "op '{self}' is not defined on {dtype}: complex tensors take 'sum' or 'avg'"
            )));
        }
        if self == ReduceOp::Avg && !(dtype.is_float() || dtype.is_complex()) {
            return Err(Error::InvalidArgument(format!(
                "op 'avg' needs a floating dtype, got {dtype}; use 'sum' and divide yourself"
            )));
        }
        Ok(())
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
