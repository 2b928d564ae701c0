//! Order-0 entropy coding of byte planes, used by the lossless wire codec (mcp-core's
//! `codec::lossless`); the delta encoder uses only its entropy estimate.
//!
//! The exponent and high-mantissa planes of float tensors have few repeats: almost all that
//! zstd gains on them is the entropy coding of its literals, which a dedicated canonical
//! Huffman coder ([`huffman`]) does several times faster. Planes that are mostly one value
//! (runs of zeros) are still better served by zstd, and planes near 8 bits of entropy by the
//! raw bytes; [`choose`] picks among the three from a [`sampled_entropy`].
//!
//! The checkpoint delta encoder (the crate root) does not use the Huffman coder: on real checkpoint deltas
//! its mid-entropy planes have repeats that zstd finds, and Huffman either lost ratio (up to
//! 6 % on bfloat16) or, checked against zstd on a sample, lost the speed it was for
//! (`benches/delta_vs_zipnn.py`).

pub mod huffman;
mod sample;

pub use sample::{
    choose, sampled_entropy, sampled_entropy_with, Choice, RAW_ENTROPY, ZSTD_ENTROPY,
};
