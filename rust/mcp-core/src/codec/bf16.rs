//! f32/f64 ⇄ bfloat16 (little-endian, 2 bytes per element).
//!
//! f32 → bf16 rounds to nearest even by integer arithmetic on the bits (overflow gives ±inf
//! through the carry into the exponent); a NaN keeps its top payload bits and gets the quiet
//! bit, so it never turns into an inf. The loops are branch-free, compiled a second time with
//! AVX2 and chosen at run time. f64 is first rounded to odd in f32, so the second rounding to
//! bf16 is the correctly rounded result.

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
                "bf16 payload of {} bytes for {n} elements",
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
            *o = f64::from(f32::from_bits(
                u32::from(u16::from_le_bytes([b[0], b[1]])) << 16,
            ));
        }
        self.rest = rest;
    }
}

#[inline(always)]
fn narrow_one(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16;
    let nan = (b >> 16) | 0x0040;
    (if b & 0x7FFF_FFFF > 0x7F80_0000 {
        nan
    } else {
        rounded
    }) as u16
}

#[inline(always)]
fn narrow_portable(src: &[f32], dst: &mut [u8]) {
    for (x, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
        d.copy_from_slice(&narrow_one(*x).to_le_bytes());
    }
}

#[inline(always)]
fn widen_portable(src: &[u8], dst: &mut [f32]) {
    for (b, o) in src.chunks_exact(2).zip(dst.iter_mut()) {
        *o = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn narrow_avx2(src: &[f32], dst: &mut [u8]) {
    narrow_portable(src, dst)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn widen_avx2(src: &[u8], dst: &mut [f32]) {
    widen_portable(src, dst)
}

/// `dst` (2 bytes per element, little-endian) = bf16(src).
pub(super) fn narrow(src: &[f32], dst: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked on the line above.
        return unsafe { narrow_avx2(src, dst) };
    }
    narrow_portable(src, dst)
}

/// `dst` = f32(src (2 bytes per element, little-endian)).
pub(super) fn widen(src: &[u8], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked on the line above.
        return unsafe { widen_avx2(src, dst) };
    }
    widen_portable(src, dst)
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn narrowing_matches_half_reference_on_a_sweep_of_all_bit_patterns() {
        let mut p: Vec<f32> = (0..(1u64 << 32))
            .step_by(4099)
            .map(|b| f32::from_bits(b as u32))
            .collect();
        // Ties (low half exactly 0x8000) with even and odd kept bits, and their neighbours.
        for hi in [0x3F80u32, 0x3F81, 0x7F7F, 0xFF7F, 0x0000, 0x0001, 0x8001] {
            for lo in [0x7FFFu32, 0x8000, 0x8001] {
                p.push(f32::from_bits((hi << 16) | lo));
            }
        }
        p.extend([
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            f32::from_bits(0x7F80_0001),
            f32::from_bits(0xFF80_0001),
            f32::from_bits(0x7FFF_FFFF),
            -0.0,
        ]);
        let mut d = vec![0u8; 2 * p.len()];
        narrow(&p, &mut d);
        let mut d2 = vec![0u8; 2 * p.len()];
        narrow_portable(&p, &mut d2);
        assert_eq!(d, d2, "dispatched and portable paths differ");
        for (x, b) in p.iter().zip(d.chunks_exact(2)) {
            let got = u16::from_le_bytes([b[0], b[1]]);
            assert_eq!(
                got,
                bf16::from_f32_const(*x).to_bits(),
                "bits {:#010x}",
                x.to_bits()
            );
            if x.is_nan() {
                assert!(bf16::from_bits(got).is_nan());
            }
        }
    }

    #[test]
    fn widening_is_exact() {
        let all: Vec<u8> = (0..=u16::MAX).flat_map(|h| h.to_le_bytes()).collect();
        let mut out = vec![0f32; 65536];
        widen(&all, &mut out);
        for (h, o) in (0..=u16::MAX).zip(&out) {
            assert_eq!(o.to_bits(), u32::from(h) << 16);
        }
    }

    #[test]
    fn f64_rounds_correctly_without_double_rounding() {
        // Just above the bf16 midpoint between 1 and 1 + 2^-7.
        let x = [
            1.0 + 2f64.powi(-8) + 2f64.powi(-40),
            1.0 + 2f64.powi(-8),
            f64::MAX,
            -0.0,
        ];
        let mut out = Vec::new();
        encode_f64(&x, &mut out);
        let mut back = [0f64; 4];
        Decoder::new(&out, 4).expect("length").next_f64(&mut back);
        assert_eq!(back[0], 1.0 + 2f64.powi(-7));
        assert_eq!(back[1], 1.0, "a tie rounds to even");
        assert_eq!(back[2], f64::INFINITY);
        assert!(back[3] == 0.0 && back[3].is_sign_negative());
    }

    #[test]
    fn decoder_rejects_wrong_lengths() {
        assert!(Decoder::new(&[0u8; 7], 4).is_err());
        assert!(Decoder::new(&[0u8; 8], 4).is_ok());
    }
}
