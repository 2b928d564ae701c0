//! Quantised (lossy) deltas with a bounded absolute error, as Check-N-Run does.
//!
//! Each element's change is rounded to a multiple of `step = 1.875 · max_abs_error` (a
//! sixteenth of the bound is left for the rounding of the rebuilt value to the dtype):
//! `q = round((cur − prev) / step)`, rebuilt as `prev + q · step` computed in `f64` and
//! rounded to the dtype. The encoder rebuilds every element exactly as the decoder will and
//! checks `|rebuilt − cur| ≤ max_abs_error`; a chunk where any element fails (NaN, inf, an
//! overflowing bin, rounding of a low-precision dtype) is stored losslessly instead. The
//! previous tensor must be the *rebuilt* one (what a decoder holds), so errors never add up
//! along a chain.

use super::dtype::DType;
use super::error::{DeltaError, Result};

/// Bin width as a multiple of the error bound.
const STEP: f64 = 1.875;

/// Largest bin index stored (the zigzag code must fit a `u32`).
const MAX_BIN: f64 = (1u64 << 30) as f64;

fn load<const W: usize>(b: &[u8]) -> [u8; W] {
    let mut a = [0u8; W];
    a.copy_from_slice(b);
    a
}

/// Value of one element of a float dtype as `f64`.
fn to_f64(dtype: DType, b: &[u8]) -> f64 {
    match dtype {
        DType::F16 => half::f16::from_le_bytes(load(b)).to_f64(),
        DType::BF16 => half::bf16::from_le_bytes(load(b)).to_f64(),
        DType::F32 => f64::from(f32::from_le_bytes(load(b))),
        _ => f64::from_le_bytes(load(b)),
    }
}

/// Rounds `v` to the dtype and writes it; returns the stored value as `f64`.
fn from_f64(dtype: DType, v: f64, out: &mut [u8]) -> f64 {
    match dtype {
        DType::F16 => {
            let h = half::f16::from_f64(v);
            out.copy_from_slice(&h.to_le_bytes());
            h.to_f64()
        }
        DType::BF16 => {
            let h = half::bf16::from_f64(v);
            out.copy_from_slice(&h.to_le_bytes());
            h.to_f64()
        }
        DType::F32 => {
            let h = v as f32;
            out.copy_from_slice(&h.to_le_bytes());
            f64::from(h)
        }
        _ => {
            out.copy_from_slice(&v.to_le_bytes());
            v
        }
    }
}

/// Quantises one chunk: writes the zigzag-coded bin indices (`u32` little-endian, four
/// bytes per element) into `q` and the rebuilt elements into `recon`. Returns `false` when
/// some element cannot be represented within `max_abs_error` (the chunk must then be coded
/// losslessly; `q` and `recon` hold garbage).
pub(crate) fn quantize(
    dtype: DType,
    prev: &[u8],
    cur: &[u8],
    max_abs_error: f64,
    q: &mut [u8],
    recon: &mut [u8],
) -> bool {
    let w = dtype.size();
    let step = STEP * max_abs_error;
    for (((p, c), q), r) in prev
        .chunks_exact(w)
        .zip(cur.chunks_exact(w))
        .zip(q.chunks_exact_mut(4))
        .zip(recon.chunks_exact_mut(w))
    {
        let pv = to_f64(dtype, p);
        let cv = to_f64(dtype, c);
        let bin = ((cv - pv) / step).round();
        if bin.is_nan() || bin.abs() > MAX_BIN {
            return false; // NaN, inf or too far
        }
        let rv = from_f64(dtype, pv + bin * step, r);
        let err = (rv - cv).abs();
        if err.is_nan() || err > max_abs_error {
            return false;
        }
        let b = bin as i32;
        let zz = ((b << 1) ^ (b >> 31)) as u32;
        q.copy_from_slice(&zz.to_le_bytes());
    }
    true
}

/// Rebuilds one chunk from the bin indices written by [`quantize`].
pub(crate) fn dequantize(
    dtype: DType,
    prev: &[u8],
    q: &[u8],
    max_abs_error: f64,
    out: &mut [u8],
) -> Result<()> {
    let w = dtype.size();
    if prev.len() != out.len() || q.len() / 4 != out.len() / w {
        return Err(DeltaError::Corrupt(
            "quantised chunk of the wrong size".into(),
        ));
    }
    let step = STEP * max_abs_error;
    for ((p, q), o) in prev
        .chunks_exact(w)
        .zip(q.chunks_exact(4))
        .zip(out.chunks_exact_mut(w))
    {
        let zz = u32::from_le_bytes(load(q));
        let bin = ((zz >> 1) as i32) ^ -((zz & 1) as i32);
        from_f64(dtype, to_f64(dtype, p) + f64::from(bin) * step, o);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_stays_within_the_bound() {
        let prev: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin()).collect();
        let cur: Vec<f32> = prev
            .iter()
            .enumerate()
            .map(|(i, p)| p + (i as f32) * 1e-5)
            .collect();
        let pb: Vec<u8> = prev.iter().flat_map(|v| v.to_le_bytes()).collect();
        let cb: Vec<u8> = cur.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut q = vec![0u8; 4000];
        let mut r = vec![0u8; 4000];
        assert!(quantize(DType::F32, &pb, &cb, 1e-4, &mut q, &mut r));
        let mut out = vec![0u8; 4000];
        dequantize(DType::F32, &pb, &q, 1e-4, &mut out).expect("dequantize");
        assert_eq!(out, r, "decoder rebuilds exactly what the encoder checked");
        for (o, c) in out.chunks_exact(4).zip(cur.iter()) {
            let o = f32::from_le_bytes(load(o));
            assert!((f64::from(o) - f64::from(*c)).abs() <= 1e-4);
        }
    }

    #[test]
    fn nan_or_coarse_dtype_falls_back() {
        let pb = 1.0f32.to_le_bytes();
        let cb = f32::NAN.to_le_bytes();
        let (mut q, mut r) = ([0u8; 4], [0u8; 4]);
        assert!(!quantize(DType::F32, &pb, &cb, 0.1, &mut q, &mut r));
        // a change of 1e30 needs more bins than a u32 holds
        let p = half::bf16::from_f32(0.0).to_le_bytes();
        let c = half::bf16::from_f32(1e30).to_le_bytes();
        let (mut q, mut r) = ([0u8; 4], [0u8; 2]);
        assert!(!quantize(DType::BF16, &p, &c, 1e-6, &mut q, &mut r));
        let c = half::bf16::INFINITY.to_le_bytes();
        assert!(!quantize(DType::BF16, &p, &c, 1.0, &mut q, &mut r));
    }
}
