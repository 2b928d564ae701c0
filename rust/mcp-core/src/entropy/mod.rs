//! Order-0 entropy coding of byte planes, shared by the checkpoint delta encoder
//! ([`crate::delta`]) and the lossless wire codec ([`crate::codec`]).
//!
//! The exponent and high-mantissa planes of float tensors have few repeats: almost all that
//! zstd gains on them is the entropy coding of its literals, which a dedicated canonical
//! Huffman coder ([`huffman`]) does several times faster. Planes that are mostly one value
//! (runs of zeros) are still better served by zstd, and planes near 8 bits of entropy by the
//! raw bytes; [`choose`] picks among the three from a [`sampled_entropy`].

pub mod huffman;
mod sample;

pub use sample::{choose, sampled_entropy, Choice, RAW_ENTROPY, ZSTD_ENTROPY};
