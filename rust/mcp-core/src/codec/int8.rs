//! Blockwise symmetric int8 quantisation of f32.
//!
//! Layout for `n` elements in blocks of `block` (`nb = ceil(n / block)`), all little-endian:
//!
//! ```text
//! [nb × f32 scale] [n × i8 q] [e × u32 escape: the raw f32 bits of each non-finite input]
//! ```
//!
//! Per block, `scale = max|x| / 127` over its *finite* elements (0 for a block without a
//! non-zero finite element) and `q = round_even(x / scale)`, which lies in [-127, 127];
//! decoding gives `q · scale`, within half a step (`scale / 2`, plus f32 rounding of about
//! 2⁻²² of `max|x|`) of `x`. Zero decodes as +0. A block whose max is below ~1.5e-36 has
//! a subnormal scale and so a coarser absolute error (at most `127 · 2⁻¹⁵⁰` more).
//!
//! Non-finite inputs (NaN, ±inf) do not abort training: each is sent as the reserved code
//! `q = -128` and its exact f32 bits are appended, in order, after the codes, so decoding
//! puts back the same NaN payload or infinity at the same position. The escape count is
//! implied by the number of `-128` codes, so the total length is checked before any
//! output is written.

use crate::error::{Error, Result};

const ESCAPE: u8 = 0x80; // -128 as a byte
/// 1.5 · 2²³: adding it rounds |y| < 2²² to an integer (nearest even) in the low mantissa
/// bits, whose low byte is then the two's-complement int8.
const MAGIC: f32 = 12_582_912.0;

pub(super) fn max_encoded_len(n: usize, block: usize) -> usize {
    let nb = n.div_ceil(block.max(1));
    nb.saturating_mul(4).saturating_add(n.saturating_mul(5))
}

pub(super) fn encode(src: &[f32], block: usize, out: &mut Vec<u8>) {
    let n = src.len();
    let nb = n.div_ceil(block);
    let base = out.len();
    out.resize(base + 4 * nb + n, 0);
    let (scales, codes) = out[base..].split_at_mut(4 * nb);
    let mut escapes: Vec<u8> = Vec::new();
    for ((x, q), s) in src
        .chunks(block)
        .zip(codes.chunks_mut(block))
        .zip(scales.chunks_exact_mut(4))
    {
        let (max_bits, non_finite) = finite_abs_max(x);
        let max = f32::from_bits(max_bits);
        s.copy_from_slice(&(max / 127.0).to_le_bytes());
        if non_finite {
            quantise_escaping(x, q, max, &mut escapes);
        } else {
            quantise(x, q, max);
        }
    }
    out.extend_from_slice(&escapes);
}

/// The bits of the largest finite |x| (positive floats order like their bits) and whether
/// any element is NaN or infinite.
fn finite_abs_max(x: &[f32]) -> (u32, bool) {
    #[inline(always)]
    fn portable(x: &[f32]) -> (u32, bool) {
        let (mut m, mut bad) = (0u32, 0u32);
        for v in x {
            let a = v.to_bits() & 0x7FFF_FFFF;
            let finite = a < 0x7F80_0000;
            m = m.max(if finite { a } else { 0 });
            bad |= u32::from(!finite);
        }
        (m, bad != 0)
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn avx2(x: &[f32]) -> (u32, bool) {
        portable(x)
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked on the line above.
        return unsafe { avx2(x) };
    }
    portable(x)
}

/// `1 / scale` where it is finite; `None` when `max` is so small (below ~4e-37) that
/// `127 / max` overflows, or zero.
fn inverse_step(max: f32) -> Option<f32> {
    let inv = 127.0 / max;
    (max > 0.0 && inv.is_finite()).then_some(inv)
}

#[inline(always)]
fn to_code(y: f32) -> u8 {
    // |y| <= 127 (times 1 + 2^-23), so the rounded value is in [-127, 127].
    (y + MAGIC).to_bits() as u8
}

/// Quantises a block of finite values with the given finite abs-max.
fn quantise(x: &[f32], q: &mut [u8], max: f32) {
    #[inline(always)]
    fn portable(x: &[f32], q: &mut [u8], max: f32) {
        match inverse_step(max) {
            Some(inv) => {
                for (v, c) in x.iter().zip(q.iter_mut()) {
                    *c = to_code(v * inv);
                }
            }
            None if max > 0.0 => {
                for (v, c) in x.iter().zip(q.iter_mut()) {
                    *c = to_code(v / max * 127.0);
                }
            }
            None => q.fill(0),
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn avx2(x: &[f32], q: &mut [u8], max: f32) {
        portable(x, q, max)
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked on the line above.
        return unsafe { avx2(x, q, max) };
    }
    portable(x, q, max)
}

/// The slow path for a block holding NaN or inf: finite values as usual, the others as
/// escapes.
fn quantise_escaping(x: &[f32], q: &mut [u8], max: f32, escapes: &mut Vec<u8>) {
    let inv = inverse_step(max);
    for (v, c) in x.iter().zip(q.iter_mut()) {
        *c = if !v.is_finite() {
            escapes.extend_from_slice(&v.to_bits().to_le_bytes());
            ESCAPE
        } else {
            match inv {
                Some(inv) => to_code(v * inv),
                None if max > 0.0 => to_code(v / max * 127.0),
                None => 0,
            }
        };
    }
}

/// Sequential decoder over a payload whose lengths have been checked.
pub(super) struct Decoder<'a> {
    scales: &'a [u8],
    codes: &'a [u8],
    escapes: &'a [u8],
    block: usize,
    pos: usize,
}

impl<'a> Decoder<'a> {
    pub(super) fn new(enc: &'a [u8], n: usize, block: usize) -> Result<Self> {
        let nb = n.div_ceil(block);
        let fixed = nb
            .checked_mul(4)
            .and_then(|s| s.checked_add(n))
            .filter(|&f| f <= enc.len())
            .ok_or_else(|| {
                Error::Protocol(format!(
                    "int8 payload of {} bytes is too short for {n} elements in blocks of {block}",
                    enc.len()
                ))
            })?;
        let (scales, rest) = enc.split_at(4 * nb);
        let (codes, escapes) = rest.split_at(n);
        let n_esc = count_escapes(codes);
        if Some(escapes.len()) != n_esc.checked_mul(4) {
            return Err(Error::Protocol(format!(
                "int8 payload of {} bytes: {fixed} bytes of scales and codes announce {n_esc} \
                 escaped values ({} bytes), but {} bytes follow",
                enc.len(),
                4 * n_esc,
                escapes.len()
            )));
        }
        Ok(Decoder {
            scales,
            codes,
            escapes,
            block,
            pos: 0,
        })
    }

    /// Decodes the next `out.len()` elements (the caller never asks past the end).
    pub(super) fn next(&mut self, out: &mut [f32]) {
        let mut done = 0;
        while done < out.len() {
            let b = self.pos / self.block;
            let end = ((b + 1) * self.block).min(self.pos + out.len() - done);
            let s = &self.scales[4 * b..4 * b + 4];
            let scale = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            let codes = &self.codes[self.pos..end];
            let o = &mut out[done..done + codes.len()];
            dequantise(codes, o, scale);
            if !self.escapes.is_empty() && count_escapes(codes) > 0 {
                for (c, v) in codes.iter().zip(o.iter_mut()) {
                    if *c == ESCAPE {
                        let (e, rest) = self.escapes.split_at(4);
                        *v = f32::from_bits(u32::from_le_bytes([e[0], e[1], e[2], e[3]]));
                        self.escapes = rest;
                    }
                }
            }
            done += codes.len();
            self.pos = end;
        }
    }
}

fn count_escapes(codes: &[u8]) -> usize {
    #[inline(always)]
    fn portable(codes: &[u8]) -> usize {
        // Sum per 255-byte run in a u8 so the loop stays in byte lanes.
        codes
            .chunks(255)
            .map(|c| usize::from(c.iter().map(|&b| u8::from(b == ESCAPE)).sum::<u8>()))
            .sum()
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn avx2(codes: &[u8]) -> usize {
        portable(codes)
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked on the line above.
        return unsafe { avx2(codes) };
    }
    portable(codes)
}

fn dequantise(codes: &[u8], out: &mut [f32], scale: f32) {
    #[inline(always)]
    fn portable(codes: &[u8], out: &mut [f32], scale: f32) {
        for (c, o) in codes.iter().zip(out.iter_mut()) {
            *o = f32::from(*c as i8) * scale;
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn avx2(codes: &[u8], out: &mut [f32], scale: f32) {
        portable(codes, out, scale)
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked on the line above.
        return unsafe { avx2(codes, out, scale) };
    }
    portable(codes, out, scale)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn roundtrip(x: &[f32], block: usize) -> (Vec<u8>, Vec<f32>) {
        let mut enc = Vec::new();
        encode(x, block, &mut enc);
        let mut out = vec![0f32; x.len()];
        Decoder::new(&enc, x.len(), block)
            .expect("valid")
            .next(&mut out);
        (enc, out)
    }

    fn scale_of(enc: &[u8], b: usize) -> f32 {
        f32::from_le_bytes([enc[4 * b], enc[4 * b + 1], enc[4 * b + 2], enc[4 * b + 3]])
    }

    #[test]
    fn error_is_within_half_a_step_per_block() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for (block, n) in [
            (1usize, 5usize),
            (7, 1000),
            (256, 4099),
            (4096, 10_000),
            (100_000, 300),
        ] {
            let x: Vec<f32> = (0..n)
                .map(|i| {
                    let mag = 10f32.powi(rng.random_range(-8..4));
                    if i % 13 == 0 {
                        0.0
                    } else {
                        rng.random_range(-1.0f32..1.0) * mag
                    }
                })
                .collect();
            let (enc, out) = roundtrip(&x, block);
            assert_eq!(enc.len(), 4 * n.div_ceil(block) + n);
            for (i, (a, b)) in x.iter().zip(&out).enumerate() {
                let blk = &x[i / block * block..((i / block + 1) * block).min(n)];
                let max = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
                let scale = scale_of(&enc, i / block);
                assert_eq!(scale, max / 127.0);
                let bound = scale * 0.5 + max * 2f32.powi(-21);
                assert!(
                    (a - b).abs() <= bound,
                    "block {block} i {i}: {a} -> {b}, bound {bound}"
                );
            }
        }
    }

    #[test]
    fn round_to_nearest_even_and_extremes() {
        // max 127 → scale 1: codes are the values rounded half to even.
        let x = [127.0f32, -127.0, 0.5, 1.5, 2.5, -2.5, -0.5, 126.49];
        let (enc, out) = roundtrip(&x, 8);
        assert_eq!(out, vec![127.0, -127.0, 0.0, 2.0, 2.0, -2.0, -0.0, 126.0]);
        assert_eq!(enc[4 + 1], (-127i8) as u8);
    }

    #[test]
    fn zero_and_tiny_blocks() {
        let (enc, out) = roundtrip(&[0.0, -0.0, 0.0], 2);
        assert_eq!(out, vec![0.0; 3]);
        assert_eq!(scale_of(&enc, 0), 0.0);
        // max 1e-37: 127 / max overflows, so the division path runs, and the scale is
        // subnormal: the error grows by at most the scale's own rounding (2^-150 per unit).
        let x = [1e-37f32, -1e-37, 3.3e-38, 0.0, -7e-39];
        let (enc, out) = roundtrip(&x, 5);
        let scale = scale_of(&enc, 0);
        assert!(scale > 0.0 && !scale.is_normal());
        for (a, b) in x.iter().zip(&out) {
            let bound = scale * 0.5 + 127.0 * f32::from_bits(1);
            assert!((a - b).abs() <= bound, "{a:e} -> {b:e}");
        }
        // Everything subnormal still decodes without NaN.
        let (_, out) = roundtrip(&[f32::from_bits(3), f32::from_bits(1)], 2);
        assert!(out.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn non_finite_values_come_back_exactly_and_others_stay_bounded() {
        let nan_payload = f32::from_bits(0x7FC1_2345);
        let x = [
            1.0f32,
            f32::INFINITY,
            -3.0,
            nan_payload,
            0.25,
            f32::NEG_INFINITY,
            2.0,
            f32::from_bits(0xFF80_0001),
            5.0,
        ];
        let (enc, out) = roundtrip(&x, 4);
        assert_eq!(enc.len(), 4 * 3 + 9 + 4 * 4);
        for (a, b) in x.iter().zip(&out) {
            if a.is_finite() {
                // block maxima: 3, 2, 5
                assert!((a - b).abs() <= 3.0 / 127.0 / 2.0 * 1.0001, "{a} {b}");
            } else {
                assert_eq!(a.to_bits(), b.to_bits());
            }
        }
        // A block of only non-finite values.
        let (_, out) = roundtrip(&[f32::NAN, f32::INFINITY], 2);
        assert!(out[0].is_nan() && out[1] == f32::INFINITY);
    }

    #[test]
    fn decoding_in_pieces_matches_decoding_at_once() {
        let x: Vec<f32> = (0..1000)
            .map(|i| {
                if i == 333 {
                    f32::NAN
                } else {
                    (i as f32 * 0.37).sin()
                }
            })
            .collect();
        let (enc, whole) = roundtrip(&x, 64);
        let mut d = Decoder::new(&enc, 1000, 64).expect("valid");
        let mut pieces = vec![0f32; 1000];
        for c in pieces.chunks_mut(97) {
            d.next(c);
        }
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&whole), bits(&pieces));
    }

    #[test]
    fn wrong_lengths_and_escape_counts_are_protocol_errors() {
        let (enc, _) = roundtrip(&[1.0, f32::NAN, 2.0], 2);
        assert!(Decoder::new(&enc, 3, 2).is_ok());
        assert!(Decoder::new(&enc[..enc.len() - 1], 3, 2).is_err());
        assert!(Decoder::new(&enc, 4, 2).is_err());
        let mut extra = enc.clone();
        extra.extend_from_slice(&[0; 4]);
        assert!(Decoder::new(&extra, 3, 2).is_err());
        assert!(Decoder::new(&[], 1, usize::MAX).is_err());
    }
}
