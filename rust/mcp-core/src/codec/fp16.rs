//! f32/f64 ⇄ IEEE binary16 (little-endian, 2 bytes per element).
//!
//! f32 → f16 rounds to nearest even; overflow gives ±inf, subnormals are rounded exactly,
//! a NaN stays a NaN (quiet bit set, top 10 payload bits kept, as F16C does). On x86-64 with
//! F16C the conversion is `vcvtps2ph`/`vcvtph2ps`, chosen at run time; elsewhere a
//! branch-free bit-arithmetic loop (Maratyszcza's FP16 algorithm) that vectorises, giving the
//! same bits (tested). f64 is first rounded to odd in f32, which makes the second rounding
//! to f16 the correctly rounded result (`half`'s f64 → f16 truncates the low mantissa bits and
//! so rounds ties wrongly).

use crate::error::{Error, Result};

pub(super) fn encode_f32(src: &[f32], out: &mut Vec<u8>) {
    let base = out.len();
    out.resize(base + 2 * src.len(), 0);
    narrow(src, &mut out[base..]);
}

pub(super) fn encode_f64(src: &[f64], out: &mut Vec<u8>) {
    out.reserve(2 * src.len());
    for x in src {
        out.extend_from_slice(&narrow_one(super::f64_to_f32_odd(*x)).to_le_bytes());
    }
}

/// Sequential decoder over a validated payload.
pub(super) struct Decoder<'a> {
    rest: &'a [u8],
}

impl<'a> Decoder<'a> {
    pub(super) fn new(enc: &'a [u8], n: usize) -> Result<Self> {
        if Some(enc.len()) != n.checked_mul(2) {
            return Err(Error::Protocol(format!(
                "fp16 payload of {} bytes for {n} elements",
                enc.len()
            )));
        }
        Ok(Decoder { rest: enc })
    }

    /// Decodes the next `out.len()` elements (the caller never asks past the end).
    pub(super) fn next_f32(&mut self, out: &mut [f32]) {
        let (now, rest) = self.rest.split_at(2 * out.len());
        widen(now, out);
        self.rest = rest;
    }

    pub(super) fn next_f64(&mut self, out: &mut [f64]) {
        let (now, rest) = self.rest.split_at(2 * out.len());
        for (o, b) in out.iter_mut().zip(now.chunks_exact(2)) {
            *o = f64::from(widen_one(u16::from_le_bytes([b[0], b[1]])));
        }
        self.rest = rest;
    }
}

#[cfg(target_arch = "x86_64")]
fn has_f16c() -> bool {
    std::arch::is_x86_feature_detected!("avx") && std::arch::is_x86_feature_detected!("f16c")
}

/// `dst` (2 bytes per element, little-endian) = f16(src).
pub(super) fn narrow(src: &[f32], dst: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if has_f16c() {
        // SAFETY: the CPU has AVX and F16C, checked on the line above.
        return unsafe { narrow_f16c(src, dst) };
    }
    narrow_portable(src, dst)
}

/// `dst` = f32(src (2 bytes per element, little-endian)).
pub(super) fn widen(src: &[u8], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_f16c() {
        // SAFETY: the CPU has AVX and F16C, checked on the line above.
        return unsafe { widen_f16c(src, dst) };
    }
    widen_portable(src, dst)
}

#[inline(always)]
fn narrow_one(f: f32) -> u16 {
    let w = f.to_bits();
    let shl1_w = w.wrapping_add(w);
    let sign = w & 0x8000_0000;
    // Scale so that the FPU's own round-to-nearest-even does the mantissa rounding.
    let mut base = (f.abs() * f32::from_bits(0x7780_0000)) * f32::from_bits(0x0880_0000);
    let bias = (shl1_w & 0xFF00_0000).max(0x7100_0000);
    base += f32::from_bits((bias >> 1) + 0x0780_0000);
    let bits = base.to_bits();
    let nonsign = ((bits >> 13) & 0x7C00) + (bits & 0x0FFF);
    let nan = 0x7E00 | ((w >> 13) & 0x03FF);
    ((sign >> 16) | if shl1_w > 0xFF00_0000 { nan } else { nonsign }) as u16
}

#[inline(always)]
fn widen_one(h: u16) -> f32 {
    let w = (h as u32) << 16;
    let sign = w & 0x8000_0000;
    let two_w = w.wrapping_add(w);
    let normalized = f32::from_bits((two_w >> 4) + (0xE0 << 23)) * f32::from_bits(0x0780_0000);
    let denormalized = f32::from_bits((two_w >> 17) | (126 << 23)) - 0.5;
    let mag = if two_w < (1 << 27) {
        denormalized.to_bits()
    } else {
        normalized.to_bits()
    };
    // Inf and NaN in plain bits (no payload left to the FPU): a NaN keeps its payload and
    // gets the quiet bit, as `vcvtph2ps` does.
    let man = (h as u32 & 0x03FF) << 13;
    let quiet = if man != 0 { 0x0040_0000 } else { 0 };
    let mag = if h & 0x7C00 == 0x7C00 {
        0x7F80_0000 | man | quiet
    } else {
        mag
    };
    f32::from_bits(sign | mag)
}

pub(super) fn narrow_portable(src: &[f32], dst: &mut [u8]) {
    for (x, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
        d.copy_from_slice(&narrow_one(*x).to_le_bytes());
    }
}

pub(super) fn widen_portable(src: &[u8], dst: &mut [f32]) {
    for (b, o) in src.chunks_exact(2).zip(dst.iter_mut()) {
        *o = widen_one(u16::from_le_bytes([b[0], b[1]]));
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
pub(super) unsafe fn narrow_f16c(src: &[f32], dst: &mut [u8]) {
    use std::arch::x86_64::{__m128i, _mm256_cvtps_ph, _mm256_loadu_ps, _mm_storeu_si128};
    let n = src.len().min(dst.len() / 2);
    let full = n / 8 * 8;
    let mut i = 0;
    while i < full {
        // SAFETY: i + 8 <= n, so 8 floats are readable at src[i] and 16 bytes writable at
        // dst[2i]; both intrinsics accept unaligned pointers.
        unsafe {
            let v = _mm256_loadu_ps(src.as_ptr().add(i));
            let h = _mm256_cvtps_ph::<0>(v); // imm 0: round to nearest even
            _mm_storeu_si128(dst.as_mut_ptr().add(2 * i).cast::<__m128i>(), h);
        }
        i += 8;
    }
    narrow_portable(&src[full..n], &mut dst[2 * full..2 * n]);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
pub(super) unsafe fn widen_f16c(src: &[u8], dst: &mut [f32]) {
    use std::arch::x86_64::{__m128i, _mm256_cvtph_ps, _mm256_storeu_ps, _mm_loadu_si128};
    let n = dst.len().min(src.len() / 2);
    let full = n / 8 * 8;
    let mut i = 0;
    while i < full {
        // SAFETY: i + 8 <= n, so 16 bytes are readable at src[2i] and 8 floats writable at
        // dst[i]; both intrinsics accept unaligned pointers.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(2 * i).cast::<__m128i>());
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
        i += 8;
    }
    widen_portable(&src[2 * full..2 * n], &mut dst[full..n]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    /// f32 values that probe every rounding case: each f16 value, the midpoints between
    /// neighbours and one ulp either side, the overflow edge, specials, and a stride through
    /// all 2^32 bit patterns.
    fn probes() -> Vec<f32> {
        let mut v = Vec::new();
        for h in 0..=u16::MAX {
            let a = f16::from_bits(h).to_f32();
            if !a.is_finite() {
                v.push(a);
                continue;
            }
            let b = f16::from_bits(h.wrapping_add(1)).to_f32();
            let bits = a.to_bits();
            v.extend([
                a,
                f32::from_bits(bits + 1),
                f32::from_bits(bits.saturating_sub(1)),
            ]);
            if b.is_finite() && b.abs() > a.abs() {
                let mid = ((a as f64 + b as f64) / 2.0) as f32; // exact: f16 mids fit f32
                let m = mid.to_bits();
                v.extend([mid, f32::from_bits(m + 1), f32::from_bits(m - 1)]);
            }
        }
        v.extend([
            65504.0,
            65519.996,
            65520.0,
            -65520.0,
            1e10,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-45,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::from_bits(0x7F80_0001), // signalling NaN
            f32::from_bits(0xFFC1_2345),
            f32::from_bits(0x7FBF_FFFF),
        ]);
        v.extend(
            (0..(1u64 << 32))
                .step_by(65_537)
                .map(|b| f32::from_bits(b as u32)),
        );
        v
    }

    fn bytes_portable(src: &[f32]) -> Vec<u8> {
        let mut d = vec![0u8; 2 * src.len()];
        narrow_portable(src, &mut d);
        d
    }

    #[test]
    fn portable_narrowing_matches_half_reference() {
        let p = probes();
        let got = bytes_portable(&p);
        for (x, b) in p.iter().zip(got.chunks_exact(2)) {
            let want = f16::from_f32_const(*x).to_bits();
            assert_eq!(
                u16::from_le_bytes([b[0], b[1]]),
                want,
                "f32 bits {:#010x}",
                x.to_bits()
            );
        }
    }

    #[test]
    fn portable_widening_is_exact_for_every_f16() {
        let all: Vec<u8> = (0..=u16::MAX).flat_map(|h| h.to_le_bytes()).collect();
        let mut out = vec![0f32; 65536];
        widen_portable(&all, &mut out);
        for (h, o) in (0..=u16::MAX).zip(&out) {
            let want = f16::from_bits(h).to_f32_const();
            assert_eq!(o.to_bits(), want.to_bits(), "f16 bits {h:#06x}");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn f16c_and_portable_give_identical_bits() {
        if !has_f16c() {
            eprintln!("no F16C on this CPU: only the portable path was tested");
            return;
        }
        // Odd lengths exercise the tails.
        let p = probes();
        for len in [p.len(), p.len() - 3, 7, 0] {
            let src = &p[..len];
            let mut hw = vec![0u8; 2 * len];
            // SAFETY: F16C and AVX are present (checked above).
            unsafe { narrow_f16c(src, &mut hw) };
            assert_eq!(hw, bytes_portable(src));
        }
        let all: Vec<u8> = (0..=u16::MAX).flat_map(|h| h.to_le_bytes()).collect();
        let (mut a, mut b) = (vec![0f32; 65536], vec![0f32; 65536]);
        // SAFETY: as above.
        unsafe { widen_f16c(&all, &mut a) };
        widen_portable(&all, &mut b);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&b));
    }

    #[test]
    fn decoder_rejects_wrong_lengths() {
        assert!(Decoder::new(&[0u8; 5], 2).is_err());
        assert!(Decoder::new(&[0u8; 3], 2).is_err());
        assert!(Decoder::new(&[0u8; 4], 2).is_ok());
    }

    fn encode_decode_f64(x: &[f64]) -> Vec<f64> {
        let mut out = Vec::new();
        encode_f64(x, &mut out);
        let mut back = vec![0f64; x.len()];
        Decoder::new(&out, x.len())
            .expect("length")
            .next_f64(&mut back);
        back
    }

    #[test]
    fn f64_rounds_correctly_without_double_rounding() {
        // 1 + 2^-11 + 2^-40 is just above the f16 midpoint: rounding through f32 by nearest
        // would land on the midpoint and round to even (1.0); correct rounding gives 1 + 2^-10.
        let x = 1.0 + 2f64.powi(-11) + 2f64.powi(-40);
        assert_eq!(
            encode_decode_f64(&[x, -x]),
            vec![1.0 + 2f64.powi(-10), -1.0 - 2f64.powi(-10)]
        );
        // Exact f32 inputs give the f32 path's bits.
        let p: Vec<f64> = probes().into_iter().map(f64::from).collect();
        let mut a = Vec::new();
        encode_f64(&p, &mut a);
        let p32: Vec<f32> = probes();
        assert_eq!(a, bytes_portable(&p32));
        // Random f64s land on a nearest f16 (ties aside, which random f64s do not hit).
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..20_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let x = (s >> 11) as f64 / (1u64 << 53) as f64 * 131_008.0 - 65_504.0; // finite f16 range
            let r = encode_decode_f64(&[x])[0];
            let h = f16::from_f64(r);
            for nb in [h.to_bits().wrapping_add(1), h.to_bits().wrapping_sub(1)] {
                let other = f16::from_bits(nb).to_f64();
                assert!(
                    (x - r).abs() <= (x - other).abs() || other.is_nan(),
                    "{x} -> {r}"
                );
            }
        }
        let nan = encode_decode_f64(&[f64::NAN, f64::INFINITY, -1e300, 1e-300])
            .into_iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>();
        assert!(f64::from_bits(nan[0]).is_nan());
        assert_eq!(
            &nan[1..],
            &[f64::INFINITY.to_bits(), f64::NEG_INFINITY.to_bits(), 0]
        );
    }
}
