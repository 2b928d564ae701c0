//! The Model-Spec: what a tensor on the wire is (dtype, shape, reduce op, codec).

use crate::dtype::{DType, ReduceOp};
use std::fmt;

/// Most dimensions a Model-Spec carries.
pub const MAX_DIMS: usize = 8;

/// How a payload is encoded on the wire (the codecs live in [`crate::codec`]).
pub use crate::codec::CodecKind as Codec;

/// Describes the tensor an operation moves; every rank of a collective must agree on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSpec {
    /// Element type.
    pub dtype: DType,
    /// Reduction, or [`ReduceOp::None`].
    pub op: ReduceOp,
    /// Wire encoding.
    pub codec: Codec,
    /// Dimensions (at most [`MAX_DIMS`]); the element count is their product.
    pub shape: Vec<u64>,
}

impl ModelSpec {
    /// A spec for a flat tensor of `numel` elements.
    pub fn flat(dtype: DType, op: ReduceOp, numel: usize) -> Self {
        ModelSpec {
            dtype,
            op,
            codec: Codec::None,
            shape: vec![numel as u64],
        }
    }

    /// The number of elements (saturating on absurd shapes from the wire).
    pub fn numel(&self) -> u64 {
        self.shape.iter().fold(1u64, |a, &d| a.saturating_mul(d))
    }
}

impl fmt::Display for ModelSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{:?}", self.dtype, self.shape)?;
        if self.codec != Codec::None {
            write!(f, " codec={}", self.codec.name())?;
            if self.codec.block() != 0 {
                write!(f, "/{}", self.codec.block())?;
            }
        }
        if self.op != ReduceOp::None {
            write!(f, " op={}", self.op)?;
        }
        Ok(())
    }
}
