//! The scaled predictor: `cur ≈ α · prev` for a whole chunk.
//!
//! Much of a training checkpoint moves by one common factor between two saves: AdamW's
//! decoupled weight decay multiplies every weight by `1 − lr·λ`, and Adam's moments decay by
//! `β1` and `β2` each step (the new gradient term is small next to the decayed second
//! moment). Coding `cur` against `α · prev` instead of `prev` takes that factor out of every
//! element's ulp distance: on the AdamW run of `benches/delta_vs_zipnn.py` it takes 10-18 %
//! off the stored bytes of a float32 checkpoint (checkpoints 100 to 1 steps apart).
//!
//! The prediction must come out bit-identical in the decoder, on any machine: it is a single
//! IEEE multiplication per element (no fused or reassociated arithmetic), and it is skipped —
//! the prediction is `prev` itself — wherever the input or the product is not a normal
//! number (zero, subnormal, infinite, NaN), so that flush-to-zero modes and NaN-payload rules,
//! which differ between CPUs and libraries, never enter.

use super::dtype::DType;

/// Lanes sampled to estimate `α`.
const SAMPLE: usize = 1024;
/// The estimate is kept only when it shrinks the sampled cost by at least this fraction.
const MIN_GAIN: f64 = 0.01;

/// The element formats the predictor scales.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    /// bfloat16 lanes, predicted through float32 and rounded to nearest even.
    Bf16,
    /// float32 lanes (also the parts of complex64).
    F32,
    /// float64 lanes (also the parts of complex128).
    F64,
}

impl Format {
    /// The format the predictor uses for `dtype`, if it scales it (not float16: its
    /// rounding from float32 would need a conversion every CPU agrees on, for little gain).
    /// The lane width alone picks the format in [`Scaled`]: 2 bytes are bfloat16.
    pub(crate) fn of(dtype: DType) -> Option<Format> {
        match dtype {
            DType::BF16 => Some(Format::Bf16),
            DType::F32 | DType::C64 => Some(Format::F32),
            DType::F64 | DType::C128 => Some(Format::F64),
            _ => None,
        }
    }

    fn width(self) -> usize {
        match self {
            Format::Bf16 => 2,
            Format::F32 => 4,
            Format::F64 => 8,
        }
    }

    /// The value of a lane's bits.
    fn value(self, bits: u64) -> f64 {
        match self {
            Format::Bf16 => f64::from(f32::from_bits((bits as u32) << 16)),
            Format::F32 => f64::from(f32::from_bits(bits as u32)),
            Format::F64 => f64::from_bits(bits),
        }
    }

    /// The predicted lane for the previous lane `p` (bits) and factor `alpha`, as bits.
    fn predict_bits(self, p: u64, alpha: f32) -> u64 {
        match self {
            Format::Bf16 => u64::from(predict_bf16(p as u16, alpha)),
            Format::F32 => u64::from(predict_f32(p as u32, alpha)),
            Format::F64 => predict_f64(p, alpha),
        }
    }
}

/// Order-preserving signed key of an IEEE float of `bits` bits (for the sampled cost only).
fn key(v: u64, bits: u32) -> i64 {
    let sign = 1u64 << (bits - 1);
    let k = if v & sign != 0 {
        !v & (sign | (sign - 1))
    } else {
        v | sign
    };
    k as i64
}

/// Whether an exponent field (of `bits` bits, all ones = inf/NaN) marks a normal number.
#[inline(always)]
fn normal_exp(e: u32, all_ones: u32) -> bool {
    e.wrapping_sub(1) < all_ones - 1
}

// Written without branches, on the bit patterns, so that LLVM vectorises the loops of
// `predict_into` (a select per lane instead of a jump).
#[inline(always)]
fn predict_f32(p: u32, alpha: f32) -> u32 {
    let y = (f32::from_bits(p) * alpha).to_bits();
    let ok = normal_exp((p >> 23) & 0xff, 0xff) & normal_exp((y >> 23) & 0xff, 0xff);
    if ok {
        y
    } else {
        p
    }
}

#[inline(always)]
fn predict_f64(p: u64, alpha: f32) -> u64 {
    let y = (f64::from_bits(p) * f64::from(alpha)).to_bits();
    let ok = normal_exp(((p >> 52) & 0x7ff) as u32, 0x7ff)
        & normal_exp(((y >> 52) & 0x7ff) as u32, 0x7ff);
    if ok {
        y
    } else {
        p
    }
}

#[inline(always)]
fn predict_bf16(p: u16, alpha: f32) -> u16 {
    let x = u32::from(p) << 16;
    let y = (f32::from_bits(x) * alpha).to_bits();
    // Round to nearest, ties to even, in integers.
    let r = y.wrapping_add(0x7fff + ((y >> 16) & 1)) >> 16;
    let ok = normal_exp((x >> 23) & 0xff, 0xff)
        & normal_exp((y >> 23) & 0xff, 0xff)
        & normal_exp((r >> 7) & 0xff, 0xff);
    if ok {
        r as u16
    } else {
        p
    }
}

/// Whether `alpha` is a factor a blob may carry: finite, normal and within 2^±16 (anything
/// else is a corrupt chunk).
pub(crate) fn valid_alpha(alpha: f32) -> bool {
    alpha.is_normal() && alpha.abs() >= 1.0 / 65536.0 && alpha.abs() <= 65536.0
}

/// Estimates `α` for one chunk from an even sample of its lanes: the median ratio
/// `cur / prev`, kept only if coding against `α · prev` would be cheaper than against `prev`
/// on the sample (by the sum of the ulp distances' bit lengths).
pub(crate) fn estimate(format: Format, prev: &[u8], cur: &[u8]) -> Option<f32> {
    let w = format.width();
    let n = cur.len() / w;
    if n == 0 || prev.len() != cur.len() {
        return None;
    }
    let step = n.div_ceil(SAMPLE).max(1);
    let lanes: Vec<(u64, u64)> = (0..n)
        .step_by(step)
        .map(|i| (lane_bits(format, prev, i), lane_bits(format, cur, i)))
        .collect();
    let mut ratios: Vec<f64> = lanes
        .iter()
        .map(|&(p, c)| (format.value(p), format.value(c)))
        .filter(|(p, c)| p.is_normal() && c.is_finite())
        .map(|(p, c)| c / p)
        .collect();
    if ratios.len() < 16 {
        return None;
    }
    let mid = ratios.len() / 2;
    let (_, median, _) = ratios.select_nth_unstable_by(mid, |a, b| a.total_cmp(b));
    let alpha = *median as f32;
    if !valid_alpha(alpha) || alpha == 1.0 {
        return None;
    }
    let bits = (w * 8) as u32;
    let (mut plain, mut scaled) = (0u64, 0u64);
    for &(p, c) in &lanes {
        let kc = key(c, bits);
        plain += bit_len(kc.wrapping_sub(key(p, bits)));
        scaled += bit_len(kc.wrapping_sub(key(format.predict_bits(p, alpha), bits)));
    }
    (scaled as f64 <= plain as f64 * (1.0 - MIN_GAIN)).then_some(alpha)
}

fn lane_bits(format: Format, b: &[u8], i: usize) -> u64 {
    let w = format.width();
    let mut a = [0u8; 8];
    a[..w].copy_from_slice(&b[i * w..(i + 1) * w]);
    u64::from_le_bytes(a)
}

fn bit_len(d: i64) -> u64 {
    u64::from(64 - d.unsigned_abs().leading_zeros())
}

/// A lane the predictor scales: `α ·` the value its bits hold, or the lane itself where that
/// is not a normal number. Byte lanes (no float format) are never scaled.
pub(crate) trait Scaled: Sized {
    /// The predicted lane.
    fn scaled(self, alpha: f32) -> Self;
}

impl Scaled for u8 {
    #[inline(always)]
    fn scaled(self, _alpha: f32) -> u8 {
        self
    }
}

impl Scaled for u16 {
    #[inline(always)]
    fn scaled(self, alpha: f32) -> u16 {
        predict_bf16(self, alpha)
    }
}

impl Scaled for u32 {
    #[inline(always)]
    fn scaled(self, alpha: f32) -> u32 {
        predict_f32(self, alpha)
    }
}

impl Scaled for u64 {
    #[inline(always)]
    fn scaled(self, alpha: f32) -> u64 {
        predict_f64(self, alpha)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn finds_a_common_decay_factor() {
        let prev: Vec<f32> = (0..10_000)
            .map(|i| ((i * 37 % 1001) as f32 - 500.0) * 1e-3)
            .collect();
        let cur: Vec<f32> = prev
            .iter()
            .enumerate()
            .map(|(i, x)| x * 0.9 + ((i % 7) as f32 - 3.0) * 1e-7)
            .collect();
        let a = estimate(Format::F32, &f32s(&prev), &f32s(&cur)).expect("a factor");
        assert!((a - 0.9).abs() < 1e-3, "{a}");
        // Unchanged lanes: no factor.
        assert_eq!(estimate(Format::F32, &f32s(&prev), &f32s(&prev)), None);
        // Nothing normal to learn from.
        assert_eq!(
            estimate(Format::F32, &f32s(&[0.0; 100]), &f32s(&[1.0; 100])),
            None
        );
    }

    #[test]
    fn special_values_are_predicted_as_themselves() {
        for x in [
            0.0f32,
            -0.0,
            f32::MIN_POSITIVE / 4.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ] {
            assert_eq!(predict_f32(x.to_bits(), 0.5), x.to_bits(), "{x}");
        }
        let nan = 0x7fc0_1234u32;
        assert_eq!(predict_f32(nan, 0.5), nan);
        // A product that overflows or underflows is not used either.
        assert_eq!(predict_f32(f32::MAX.to_bits(), 4.0), f32::MAX.to_bits());
        assert_eq!(
            predict_f32(f32::MIN_POSITIVE.to_bits(), 0.25),
            f32::MIN_POSITIVE.to_bits()
        );
        assert_eq!(predict_f32(2.0f32.to_bits(), 0.5), 1.0f32.to_bits());
        assert_eq!(predict_f64(3.0f64.to_bits(), 0.5), 1.5f64.to_bits());
        // bfloat16: 1.0 × 0.75 = 0.75 exactly; the largest finite value × 2 is not used.
        assert_eq!(predict_bf16(0x3f80, 0.75), 0x3f40);
        assert_eq!(predict_bf16(0x7f7f, 2.0), 0x7f7f);
        assert_eq!(predict_bf16(0x0001, 0.5), 0x0001);
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        // 1 + 2^-8 lies halfway between two bfloat16 values: ties go to the even one (1.0);
        // 1 + 3·2^-8 goes up to 1 + 2^-6.
        let one = 0x3f80u16;
        assert_eq!(predict_bf16(one, 1.0 + 1.0 / 256.0), one);
        assert_eq!(predict_bf16(one, 1.0 + 3.0 / 256.0), 0x3f82);
    }

    #[test]
    fn alpha_bounds() {
        assert!(valid_alpha(0.999) && valid_alpha(-2.0));
        for a in [
            0.0f32,
            f32::NAN,
            f32::INFINITY,
            1e-30,
            1e30,
            f32::MIN_POSITIVE / 2.0,
        ] {
            assert!(!valid_alpha(a), "{a}");
        }
    }
}
