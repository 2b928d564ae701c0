//! Element types and reduction operators, with their one-byte wire codes.

use crate::error::{Error, Result};
use std::fmt;

/// The element type of a tensor.
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
}

impl DType {
    /// Every dtype, for tests and lookups.
    pub const ALL: [DType; 7] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::U8,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }

    /// True for the floating-point types.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
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
        }
    }

    /// Parses a canonical name.
    pub fn from_name(name: &str) -> Result<DType> {
        DType::ALL
            .into_iter()
            .find(|d| d.name() == name)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "unsupported dtype {name:?}; supported: float32, float64, float16, bfloat16, int32, int64, uint8"
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
            _ => Err(Error::InvalidArgument(format!(
                "unsupported reduce op {name:?}; supported: sum, avg, min, max, prod"
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
        ]
        .into_iter()
        .find(|o| *o as u8 == code)
    }

    /// Checks that this op can reduce `dtype`.
    pub fn check(self, dtype: DType) -> Result<()> {
        if self == ReduceOp::Avg && !dtype.is_float() {
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
