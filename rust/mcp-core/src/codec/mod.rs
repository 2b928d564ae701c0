//! Wire compression for collective payloads: fp16/bf16 narrowing, blockwise int8
//! quantisation, and lossless byte-plane + Huffman/zstd coding, with error feedback for the lossy
//! ones.
//!
//! Every codec turns `n` elements of a [`DType`] into bytes ([`encode`]) and back
//! ([`decode`]); the element count is never on the wire, the receiver knows it from the
//! collective's spec, and every length the bytes imply is checked against it (a mismatch is
//! [`Error::Protocol`], never a panic). [`decode_reduce`] is what an all-reduce hop runs:
//! it decodes a block of [`REDUCE_CHUNK`] elements at a time into scratch and folds it into
//! the destination with [`reduce_into`], so no full-size temporary is made.
//!
//! | kind       | dtypes accepted                     | bytes per element           |
//! |------------|-------------------------------------|-----------------------------|
//! | `None`     | all                                 | `size`                      |
//! | `Fp16`     | F32, F64 (narrowed); F16 (copied)   | 2                           |
//! | `Bf16`     | F32, F64 (narrowed); BF16 (copied)  | 2                           |
//! | `Int8`     | F32                                 | 1 + 4/block (+4 per non-finite) |
//! | `Lossless` | all                                 | data-dependent, ≤ size + 4·size per 65536 |
//!
//! Byte order on the wire is little-endian (all scales, escapes and headers); element
//! payloads of `None`/`Lossless` are the tensor's native bytes, as elsewhere in the core.

mod bf16;
mod feedback;
mod fp16;
mod int8;
mod lossless;

pub use feedback::ErrorFeedback;
pub use lossless::Compression;

use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::reduce::reduce_into;
use bytemuck::Pod;
use std::borrow::Cow;

/// Elements decoded per step by [`decode_reduce`] (its scratch holds this many).
pub const REDUCE_CHUNK: usize = 4096;

/// A sensible default block size for [`CodecKind::Int8`]: 4 bytes of scale per 256 elements.
pub const DEFAULT_INT8_BLOCK: u32 = 256;

/// Which wire codec a payload is coded with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CodecKind {
    /// The tensor's bytes as they are.
    None,
    /// IEEE binary16, rounded to nearest even (overflow becomes ±inf).
    Fp16,
    /// bfloat16, rounded to nearest even.
    Bf16,
    /// Blockwise symmetric int8: one f32 scale per `block` elements.
    Int8 {
        /// Elements per scale (at least 1).
        block: u32,
    },
    /// Byte-plane split then Huffman, zstd level 1 or raw per plane (by sampled entropy);
    /// bit-exact for every dtype.
    Lossless,
}

impl CodecKind {
    /// The one-byte wire code (None=0, Fp16=1, Bf16=2, Int8=3, Lossless=4). The int8 block
    /// size is not in it: send [`CodecKind::block`] beside it.
    pub fn to_code(self) -> u8 {
        match self {
            CodecKind::None => 0,
            CodecKind::Fp16 => 1,
            CodecKind::Bf16 => 2,
            CodecKind::Int8 { .. } => 3,
            CodecKind::Lossless => 4,
        }
    }

    /// Decodes a wire code and the block size sent beside it (ignored except for int8).
    /// `None` for an unknown code or an int8 block of 0.
    pub fn from_code(code: u8, block: u32) -> Option<CodecKind> {
        match code {
            0 => Some(CodecKind::None),
            1 => Some(CodecKind::Fp16),
            2 => Some(CodecKind::Bf16),
            3 if block > 0 => Some(CodecKind::Int8 { block }),
            4 => Some(CodecKind::Lossless),
            _ => None,
        }
    }

    /// The int8 block size, 0 for the other kinds.
    pub fn block(self) -> u32 {
        match self {
            CodecKind::Int8 { block } => block,
            _ => 0,
        }
    }

    /// Parses `"none"`, `"fp16"`, `"bf16"`, `"int8"` or `"lossless"`; `block` is used by int8
    /// only and must then be at least 1.
    pub fn from_name(name: &str, block: u32) -> Result<CodecKind> {
        match name.to_ascii_lowercase().as_str() {
            "none" => Ok(CodecKind::None),
            "fp16" => Ok(CodecKind::Fp16),
            "bf16" => Ok(CodecKind::Bf16),
            "lossless" => Ok(CodecKind::Lossless),
            "int8" if block > 0 => Ok(CodecKind::Int8 { block }),
            "int8" => Err(Error::InvalidArgument(
                "codec int8 needs a block size of at least 1".into(),
            )),
            _ => Err(Error::InvalidArgument(format!(
                "unknown codec {name:?}; supported: none, fp16, bf16, int8, lossless"
            ))),
        }
    }

    /// The canonical name, as [`CodecKind::from_name`] reads it.
    pub fn name(self) -> &'static str {
        match self {
            CodecKind::None => "none",
            CodecKind::Fp16 => "fp16",
            CodecKind::Bf16 => "bf16",
            CodecKind::Int8 { .. } => "int8",
            CodecKind::Lossless => "lossless",
        }
    }

    /// True when decoding may not give back the bits that were encoded.
    pub fn is_lossy(self) -> bool {
        matches!(
            self,
            CodecKind::Fp16 | CodecKind::Bf16 | CodecKind::Int8 { .. }
        )
    }

    /// Checks that this codec can code tensors of `dtype`.
    pub fn check(self, dtype: DType) -> Result<()> {
        plan(self, dtype).map(|_| ())
    }
}

/// What encode/decode actually run for a (kind, dtype) pair.
#[derive(Debug, Clone, Copy)]
enum Plan {
    Raw,
    Fp16F32,
    Fp16F64,
    Bf16F32,
    Bf16F64,
    Int8F32(usize),
    Lossless,
}

fn plan(kind: CodecKind, dtype: DType) -> Result<Plan> {
    Ok(match (kind, dtype) {
        (CodecKind::None, _) | (CodecKind::Fp16, DType::F16) | (CodecKind::Bf16, DType::BF16) => {
            Plan::Raw
        }
        (CodecKind::Fp16, DType::F32) => Plan::Fp16F32,
        (CodecKind::Fp16, DType::F64) => Plan::Fp16F64,
        (CodecKind::Bf16, DType::F32) => Plan::Bf16F32,
        (CodecKind::Bf16, DType::F64) => Plan::Bf16F64,
        (CodecKind::Int8 { block: 0 }, _) => {
            return Err(Error::InvalidArgument(
                "codec int8 needs a block size of at least 1".into(),
            ))
        }
        (CodecKind::Int8 { block }, DType::F32) => Plan::Int8F32(block as usize),
        (CodecKind::Lossless, _) => Plan::Lossless,
        (CodecKind::Fp16 | CodecKind::Bf16, _) => {
            return Err(Error::InvalidArgument(format!(
                "codec {} codes float32, float64 or {} tensors, not {dtype}",
                kind.name(),
                if kind == CodecKind::Fp16 {
                    "float16"
                } else {
                    "bfloat16"
                }
            )))
        }
        (CodecKind::Int8 { .. }, _) => {
            return Err(Error::InvalidArgument(format!(
            "codec int8 codes float32 tensors, not {dtype}; cast first or use fp16/bf16/lossless"
        )))
        }
    })
}

/// The most bytes [`encode`] can append for `n_elems` elements of `dtype` (for a pair the
/// codec refuses, the raw size).
pub fn max_encoded_len(kind: CodecKind, dtype: DType, n_elems: usize) -> usize {
    let raw = n_elems.saturating_mul(dtype.size());
    match plan(kind, dtype) {
        Ok(Plan::Raw) | Err(_) => raw,
        Ok(Plan::Fp16F32 | Plan::Fp16F64 | Plan::Bf16F32 | Plan::Bf16F64) => {
            n_elems.saturating_mul(2)
        }
        Ok(Plan::Int8F32(block)) => int8::max_encoded_len(n_elems, block),
        Ok(Plan::Lossless) => lossless::max_encoded_len(dtype, n_elems),
    }
}

/// Appends the coding of `src` (elements of `dtype`, native byte order, any alignment) to
/// `out`.
pub fn encode(kind: CodecKind, dtype: DType, src: &[u8], out: &mut Vec<u8>) -> Result<()> {
    let plan = plan(kind, dtype)?;
    if !src.len().is_multiple_of(dtype.size()) {
        return Err(Error::InvalidArgument(format!(
            "{} bytes is not a whole number of {dtype} elements",
            src.len()
        )));
    }
    match plan {
        Plan::Raw => out.extend_from_slice(src),
        Plan::Fp16F32 => fp16::encode_f32(&typed_in::<f32>(src), out),
        Plan::Fp16F64 => fp16::encode_f64(&typed_in::<f64>(src), out),
        Plan::Bf16F32 => bf16::encode_f32(&typed_in::<f32>(src), out),
        Plan::Bf16F64 => bf16::encode_f64(&typed_in::<f64>(src), out),
        Plan::Int8F32(block) => int8::encode(&typed_in::<f32>(src), block, out),
        Plan::Lossless => lossless::encode(dtype, src, out)?,
    }
    Ok(())
}

/// Decodes `enc` into `out`, which holds exactly the tensor's elements of `dtype`.
///
/// Any `enc` whose length does not fit `out` is [`Error::Protocol`]; on an error `out` is
/// left unspecified.
pub fn decode(kind: CodecKind, dtype: DType, enc: &[u8], out: &mut [u8]) -> Result<()> {
    let plan = plan(kind, dtype)?;
    let n = whole_elems(dtype, out.len())?;
    match plan {
        Plan::Raw => {
            check_len(enc.len(), out.len(), kind)?;
            out.copy_from_slice(enc);
        }
        Plan::Fp16F32 => {
            let mut d = fp16::Decoder::new(enc, n)?;
            with_typed_out::<f32>(out, |o| d.next_f32(o));
        }
        Plan::Fp16F64 => {
            let mut d = fp16::Decoder::new(enc, n)?;
            with_typed_out::<f64>(out, |o| d.next_f64(o));
        }
        Plan::Bf16F32 => {
            let mut d = bf16::Decoder::new(enc, n)?;
            with_typed_out::<f32>(out, |o| d.next_f32(o));
        }
        Plan::Bf16F64 => {
            let mut d = bf16::Decoder::new(enc, n)?;
            with_typed_out::<f64>(out, |o| d.next_f64(o));
        }
        Plan::Int8F32(block) => {
            let mut d = int8::Decoder::new(enc, n, block)?;
            with_typed_out::<f32>(out, |o| d.next(o));
        }
        Plan::Lossless => lossless::decode_chunks(dtype, enc, n, |start, bytes| {
            out[start..start + bytes.len()].copy_from_slice(bytes);
            Ok(())
        })?,
    }
    Ok(())
}

/// Decodes `enc` and folds it into `dst`: `dst[i] = op(dst[i], decoded[i])`, a block at a
/// time (no full-size temporary). `Avg` accumulates like `Sum`, as in [`reduce_into`].
///
/// The whole of `enc` is validated before `dst` is touched, except for lossless coding,
/// whose corruption can only show while decompressing: then `dst` may be partly reduced
/// when the error comes back.
pub fn decode_reduce(
    kind: CodecKind,
    dtype: DType,
    op: ReduceOp,
    enc: &[u8],
    dst: &mut [u8],
) -> Result<()> {
    let plan = plan(kind, dtype)?;
    op.check(dtype)?;
    let n = whole_elems(dtype, dst.len())?;
    match plan {
        Plan::Raw => {
            check_len(enc.len(), dst.len(), kind)?;
            reduce_into(dtype, op, dst, enc)
        }
        Plan::Fp16F32 => {
            let mut d = fp16::Decoder::new(enc, n)?;
            reduce_chunks::<f32>(dtype, op, dst, |o| d.next_f32(o))
        }
        Plan::Fp16F64 => {
            let mut d = fp16::Decoder::new(enc, n)?;
            reduce_chunks::<f64>(dtype, op, dst, |o| d.next_f64(o))
        }
        Plan::Bf16F32 => {
            let mut d = bf16::Decoder::new(enc, n)?;
            reduce_chunks::<f32>(dtype, op, dst, |o| d.next_f32(o))
        }
        Plan::Bf16F64 => {
            let mut d = bf16::Decoder::new(enc, n)?;
            reduce_chunks::<f64>(dtype, op, dst, |o| d.next_f64(o))
        }
        Plan::Int8F32(block) => {
            let mut d = int8::Decoder::new(enc, n, block)?;
            reduce_chunks::<f32>(dtype, op, dst, |o| d.next(o))
        }
        Plan::Lossless => lossless::decode_chunks(dtype, enc, n, |start, bytes| {
            reduce_into(dtype, op, &mut dst[start..start + bytes.len()], bytes)
        }),
    }
}

fn whole_elems(dtype: DType, bytes: usize) -> Result<usize> {
    if !bytes.is_multiple_of(dtype.size()) {
        return Err(Error::InvalidArgument(format!(
            "an output of {bytes} bytes is not a whole number of {dtype} elements"
        )));
    }
    Ok(bytes / dtype.size())
}

fn check_len(got: usize, want: usize, kind: CodecKind) -> Result<()> {
    if got != want {
        return Err(Error::Protocol(format!(
            "{} payload of {got} bytes where {want} were expected",
            kind.name()
        )));
    }
    Ok(())
}

/// Views `src` as `T`, copying when it is not aligned for `T` (the rare slow path).
fn typed_in<T: Pod>(src: &[u8]) -> Cow<'_, [T]> {
    match bytemuck::try_cast_slice::<u8, T>(src) {
        Ok(s) => Cow::Borrowed(s),
        Err(_) => Cow::Owned(pod_vec(src)),
    }
}

/// f64 → f32 rounded to odd (truncate, then set the last bit if anything was lost), so that a
/// second round-to-nearest-even to a format of at most 22 significant bits (f16, bf16) gives
/// the correctly rounded f64 result, with no double-rounding error. Overflow gives `±f32::MAX`
/// (which the second rounding turns into ±inf); a NaN gives a quiet NaN with the top payload
/// bits.
#[inline]
fn f64_to_f32_odd(x: f64) -> f32 {
    if x.is_nan() {
        let b = x.to_bits();
        let sign = (b >> 32) as u32 & 0x8000_0000;
        return f32::from_bits(sign | 0x7FC0_0000 | ((b >> 29) as u32 & 0x003F_FFFF));
    }
    let r = x as f32;
    if f64::from(r) == x {
        return r;
    }
    let mut bits = r.to_bits();
    if f64::from(r).abs() > x.abs() {
        bits -= 1; // one step toward zero: r is not zero here since |r| > |x| > 0
    }
    f32::from_bits(bits | 1)
}

/// An aligned copy of `bytes` as `T`s (trailing bytes that do not fill a `T` are dropped).
fn pod_vec<T: Pod>(bytes: &[u8]) -> Vec<T> {
    let size = std::mem::size_of::<T>();
    let n = bytes.len() / size;
    let mut v = vec![T::zeroed(); n];
    bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(&bytes[..n * size]);
    v
}

/// Runs `f` on `out` viewed as `T`, through an aligned copy when it is not aligned.
fn with_typed_out<T: Pod>(out: &mut [u8], f: impl FnOnce(&mut [T])) {
    match bytemuck::try_cast_slice_mut::<u8, T>(out) {
        Ok(o) => f(o),
        Err(_) => {
            let mut tmp = vec![T::zeroed(); out.len() / std::mem::size_of::<T>()];
            f(&mut tmp);
            out.copy_from_slice(bytemuck::cast_slice(&tmp));
        }
    }
}

/// Decodes [`REDUCE_CHUNK`] elements at a time with `next` (a sequential decoder) into
/// aligned scratch and reduces each block into `dst`.
fn reduce_chunks<T: Pod>(
    dtype: DType,
    op: ReduceOp,
    dst: &mut [u8],
    mut next: impl FnMut(&mut [T]),
) -> Result<()> {
    let size = dtype.size();
    let n = dst.len() / size;
    let mut scratch = vec![T::zeroed(); REDUCE_CHUNK.min(n)];
    for d in dst.chunks_mut(REDUCE_CHUNK * size) {
        let s = &mut scratch[..d.len() / size];
        next(s);
        reduce_into(dtype, op, d, bytemuck::cast_slice(s))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
