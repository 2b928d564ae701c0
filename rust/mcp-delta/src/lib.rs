//! mcp-delta: the checkpoint delta encoder of mcp_fast — lossless (and optionally lossy)
//! coding of a tensor against the same tensor at the previous checkpoint — and the order-0
//! byte-plane entropy coders ([`entropy`]) that mcp-core's lossless wire codec shares. It has
//! its own [`DType`] (other codes than the wire's) and its own [`DeltaError`]; nothing here
//! does I/O or knows of the network.
//!
//! The pipeline, per independently coded chunk of [`DEFAULT_CHUNK_BYTES`]:
//! 1. transform every element against the previous one — XOR for opaque bytes, wrapping
//!    difference for integers, ulp distance for floats (`byteplane`), for floats against
//!    `α · prev` when one factor `α` explains much of the chunk's change (`predict`: weight
//!    decay, Adam's moment decay);
//! 2. floats (16, 32 and 64-bit lanes): code each lane's residual as one rANS symbol — its
//!    magnitude class and sign relative to the prediction — and the low bits of its
//!    magnitude raw (`magnitude`, `rans`, `bits`);
//! 3. other lanes, full snapshots, and small chunks where it is smaller: split the
//!    transformed elements into byte planes and store each plane as a constant, zstd, or
//!    raw, whichever is smallest (`entropy`).
//!
//! Chunks are coded on all cores; each blob carries its dtype, shape, per-chunk CRC32C and
//! the xxh3-64 content hash of the tensor a decoder rebuilds, which [`decode_into`] checks.
//! A lossy mode ([`EncodeOptions::max_abs_error`]) quantises float deltas with a bounded
//! absolute error (`lossy`); it is never the default.
//!
//! ```
//! use mcp_delta::{decode, encode, DType, EncodeOptions, Mode};
//! let prev: Vec<u8> = (0..64u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
//! let cur: Vec<u8> = (0..64u32).flat_map(|i| (i as f32 + 0.5).to_le_bytes()).collect();
//! let blob = encode(DType::F32, &[8, 8], Some(&prev), &cur, &EncodeOptions::default())?;
//! assert_eq!(blob.mode(), Mode::Delta);
//! let (info, back) = decode(&blob.into_vec(), Some(&prev), 0)?;
//! assert_eq!((back, info.shape), (cur, vec![8, 8]));
//! # Ok::<(), mcp_delta::DeltaError>(())
//! ```

mod bits;
mod byteplane;
mod container;
mod dtype;
pub mod entropy;
mod error;
mod lossy;
mod magnitude;
mod planes;
mod predict;
mod rans;

pub use byteplane::Transform;
pub use container::{
    content_hash, decode, decode_into, encode, read_info, BlobInfo, EncodeOptions, Encoded, Mode,
    DEFAULT_CHUNK_BYTES,
};
pub use dtype::DType;
pub use error::{DeltaError, Result};
pub use planes::Method;

#[cfg(test)]
mod tests;
