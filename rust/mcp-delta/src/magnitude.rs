//! Residual coding by magnitude class: one entropy-coded symbol per float lane, the rest of
//! its bits stored raw.
//!
//! The residual of a lane is the signed distance `d = key(cur) − key(pred)` in units in the
//! last place (`pred` is the previous lane, or `α ·` it; see `predict`). Its magnitude `m`
//! is split like a tiny float: values below 16 are their own class; above, the class names
//! the bit length of `m` and the three bits after its leading one, and the `bitlen(m) − 4`
//! bits below those are stored raw (they are close to uniform). The symbol is the class and
//! one sign bit: the sign of `d` relative to the sign of `pred`, because weight decay and
//! moment decay move values towards zero, so that sign is skewed. Symbols are coded with
//! rANS (`rans`), one per lane, which is what makes this several times faster than coding
//! every byte plane, and it keeps the dependence between the high and the low bytes of a
//! lane that independent byte planes lose: on the AdamW run of `benches/delta_vs_zipnn.py`
//! it stores 5-9 % fewer bytes than byte planes with zstd for float32, and about the same
//! to 9 % fewer for bfloat16.
//!
//! Payload: the frequency table, the rANS stream's length (u32) and stream, then the raw bits.

use super::bits::{BitReader, BitWriter, MAX_PUT};
use super::byteplane::Word;
use super::error::{DeltaError, Result};
use super::predict::Scaled;
use super::rans::{self, DecTable, EncTable, Freqs, MAX_ALPHABET};

/// Symbols of the classes of `bits`-bit lanes: classes `0..8·(bits−4)+16`, times two signs.
fn alphabet(bits: u32) -> usize {
    16 * (bits as usize - 2)
}

/// Lanes per block of the passes below (the block's scratch stays in L1).
const BLOCK: usize = 2048;

/// Per-thread scratch of the coder.
#[derive(Default)]
pub(crate) struct Scratch {
    syms: Vec<u16>,
    bits: Vec<u8>,
    words: Vec<u16>,
    hist: Vec<u32>,
    mags: Vec<u64>,
    nbits: Vec<u32>,
}

impl Scratch {
    /// Bytes the buffers hold on to.
    pub(crate) fn capacity_bytes(&self) -> usize {
        2 * self.syms.capacity()
            + self.bits.capacity()
            + 2 * self.words.capacity()
            + 4 * self.hist.capacity()
            + 8 * self.mags.capacity()
            + 4 * self.nbits.capacity()
    }
}

/// The symbol and the magnitude of the residual of `c` against the prediction `pr`.
///
/// In 32-bit arithmetic for lanes of up to 32 bits, so that the pass vectorises over twice
/// as many lanes per instruction as in 64-bit arithmetic.
#[inline(always)]
fn symbol<T: Word>(c: T, pr: T) -> (u16, u64) {
    if T::BITS <= 32 {
        let sh = 32 - T::BITS;
        let kd = (c.key().to_u64() as u32).wrapping_sub(pr.key().to_u64() as u32);
        let d = ((kd << sh) as i32) >> sh;
        let m = d.unsigned_abs();
        let sign = (pr.to_u64() as u32) >> (T::BITS - 1);
        let rel_neg = ((d >> 31) as u32 ^ sign) & u32::from(m != 0) & 1;
        let nb = (32 - m.leading_zeros()).saturating_sub(4);
        let class = 8 * nb + (m >> nb);
        ((2 * class + rel_neg) as u16, u64::from(m))
    } else {
        let sh = 64 - T::BITS;
        let d = (c.key().to_u64().wrapping_sub(pr.key().to_u64()) << sh) as i64 >> sh;
        let m = d.unsigned_abs();
        let sign = pr.to_u64() >> (T::BITS - 1);
        let rel_neg = ((d >> 63) as u64 ^ sign) & u64::from(m != 0) & 1;
        let nb = (64 - m.leading_zeros()).saturating_sub(4);
        let class = 8 * u64::from(nb) + (m >> nb);
        ((2 * class + rel_neg) as u16, m)
    }
}

/// The raw bit count of a symbol's lanes.
#[inline(always)]
fn sym_nbits(sym: u16) -> u32 {
    (u32::from(sym) >> 4).saturating_sub(1)
}

/// The raw low bits of a magnitude `m` of symbol `sym`.
#[inline(always)]
fn low_bits(sym: u16, m: u64) -> u64 {
    m & ((1u64 << sym_nbits(sym)) - 1)
}

/// Inverse of [`symbol`]: the lane from its symbol, the raw low bits of its magnitude and
/// the prediction.
#[inline(always)]
fn lane<T: Word>(sym: u16, low: u64, pr: T) -> T {
    let nb = sym_nbits(sym);
    if T::BITS <= 32 {
        let top = u32::from(sym >> 1) - 8 * nb;
        let m = (top << nb) | low as u32;
        let sign = (pr.to_u64() as u32) >> (T::BITS - 1);
        let neg = (u32::from(sym) ^ sign) & 1;
        let d = if neg == 1 { m.wrapping_neg() } else { m };
        T::from_u64(u64::from((pr.key().to_u64() as u32).wrapping_add(d))).unkey()
    } else {
        let top = u64::from(sym >> 1) - 8 * u64::from(nb);
        let m = (top << nb) | low;
        let neg = (u64::from(sym) ^ (pr.to_u64() >> (T::BITS - 1))) & 1;
        let d = if neg == 1 { m.wrapping_neg() } else { m };
        T::from_u64(pr.key().to_u64().wrapping_add(d)).unkey()
    }
}

#[inline(always)]
fn put_bits<T: Word>(bw: &mut BitWriter<'_>, v: u64, nb: u32) {
    if T::BITS - 4 <= MAX_PUT {
        bw.put(v, nb);
    } else {
        let lo = nb.min(32);
        bw.put(v & ((1u64 << lo) - 1), lo);
        bw.put(v >> lo, nb - lo);
    }
}

#[inline(always)]
fn get_bits<T: Word>(br: &mut BitReader<'_>, nb: u32) -> u64 {
    if T::BITS - 4 <= MAX_PUT {
        br.get(nb)
    } else {
        let lo = nb.min(32);
        let v = br.get(lo);
        v | (br.get(nb - lo) << lo)
    }
}

#[inline(always)]
fn encode_t<T: Word>(
    predict: impl Fn(T) -> T,
    prev: &[u8],
    cur: &[u8],
    sc: &mut Scratch,
    out: &mut Vec<u8>,
) {
    let n = cur.len() / T::W;
    let a = alphabet(T::BITS);
    let bits_cap = n * (T::BITS as usize - 4) / 8 + 16;
    if sc.bits.len() < bits_cap {
        sc.bits.resize(bits_cap, 0);
    }
    sc.syms.resize(n, 0);
    sc.mags.resize(BLOCK, 0);
    // Four histograms, so that runs of one symbol do not wait on their own increments.
    sc.hist.clear();
    sc.hist.resize(4 * a, 0);
    let mags = &mut sc.mags[..];
    let (h0, rest) = sc.hist.split_at_mut(a);
    let (h1, rest) = rest.split_at_mut(a);
    let (h2, h3) = rest.split_at_mut(a);
    let mut bw = BitWriter::new(&mut sc.bits);
    for ((syms, c), p) in sc
        .syms
        .chunks_mut(BLOCK)
        .zip(cur.chunks(BLOCK * T::W))
        .zip(prev.chunks(BLOCK * T::W))
    {
        // A data-parallel pass (the compiler vectorises it), then the serial one.
        for (((s, m), c), p) in syms
            .iter_mut()
            .zip(mags.iter_mut())
            .zip(c.chunks_exact(T::W))
            .zip(p.chunks_exact(T::W))
        {
            (*s, *m) = symbol(T::load(c), predict(T::load(p)));
        }
        let mut quads = syms.chunks_exact(4).zip(mags.chunks_exact(4));
        for (q, m) in &mut quads {
            h0[usize::from(q[0])] += 1;
            h1[usize::from(q[1])] += 1;
            h2[usize::from(q[2])] += 1;
            h3[usize::from(q[3])] += 1;
            for j in 0..4 {
                put_bits::<T>(&mut bw, low_bits(q[j], m[j]), sym_nbits(q[j]));
            }
        }
        let tail = syms.len() / 4 * 4;
        for (&s, &m) in syms[tail..].iter().zip(&mags[tail..]) {
            h0[usize::from(s)] += 1;
            put_bits::<T>(&mut bw, low_bits(s, m), sym_nbits(s));
        }
    }
    let bits_len = bw.finish();
    for i in 0..a {
        h0[i] += h1[i] + h2[i] + h3[i];
    }
    let freqs = Freqs::from_counts(h0);
    freqs.write(out);
    let len_at = out.len();
    out.extend_from_slice(&[0; 4]);
    rans::encode(&sc.syms, &EncTable::new(&freqs), &mut sc.words, out);
    let rans_len = (out.len() - len_at - 4) as u32;
    out[len_at..len_at + 4].copy_from_slice(&rans_len.to_le_bytes());
    out.extend_from_slice(&sc.bits[..bits_len]);
}

#[inline(always)]
fn decode_t<T: Word>(
    predict: impl Fn(T) -> T,
    prev: &[u8],
    payload: &[u8],
    sc: &mut Scratch,
    out: &mut [u8],
) -> Result<()> {
    let n = out.len() / T::W;
    if prev.len() != out.len() {
        return Err(DeltaError::PrevMismatch(
            "the previous chunk has another length".into(),
        ));
    }
    let (freqs, used) = Freqs::read(payload, alphabet(T::BITS))?;
    let rest = &payload[used..];
    let (len, rest) = rest
        .split_first_chunk::<4>()
        .ok_or_else(|| DeltaError::Truncated("rANS stream length".into()))?;
    let rans_len = u32::from_le_bytes(*len) as usize;
    if rans_len > rest.len() {
        return Err(DeltaError::Truncated(format!(
            "rANS stream of {rans_len} bytes, {} left",
            rest.len()
        )));
    }
    let (stream, bits) = rest.split_at(rans_len);
    sc.syms.resize(n, 0);
    rans::decode(stream, &DecTable::new(&freqs), &mut sc.syms)?;
    sc.mags.resize(BLOCK, 0);
    sc.nbits.resize(BLOCK, 0);
    let lows = &mut sc.mags[..];
    let nbits = &mut sc.nbits[..];
    let mut br = BitReader::new(bits);
    for ((syms, o), p) in sc
        .syms
        .chunks(BLOCK)
        .zip(out.chunks_mut(BLOCK * T::W))
        .zip(prev.chunks(BLOCK * T::W))
    {
        if T::BITS <= 32 {
            // The bit counts first, so that the reads need not wait on each other.
            for (nb, &s) in nbits.iter_mut().zip(syms) {
                *nb = sym_nbits(s);
            }
            br.get_many(&nbits[..syms.len()], &mut lows[..syms.len()]);
        } else {
            for (l, &s) in lows.iter_mut().zip(syms) {
                *l = get_bits::<T>(&mut br, sym_nbits(s));
            }
        }
        for (((o, p), &s), &l) in o
            .chunks_exact_mut(T::W)
            .zip(p.chunks_exact(T::W))
            .zip(syms)
            .zip(lows.iter())
        {
            lane(s, l, predict(T::load(p))).store(o);
        }
    }
    br.finish()
}

/// Whether lanes of `width` bytes are coded here.
pub(crate) fn supports(width: usize) -> bool {
    matches!(width, 2 | 4 | 8) && alphabet(8 * width as u32) <= MAX_ALPHABET
}

/// Calls `$f::<T>(predict, args...)` with the lane type of `$width` and the prediction of
/// `$alpha` (the previous lane, or `α ·` it): one monomorphised coder for each.
macro_rules! per_lane {
    ($f:ident, $width:expr, $alpha:expr, $($arg:expr),*) => {
        match ($width, $alpha) {
            (2, None) => $f::<u16>(|p| p, $($arg),*),
            (2, Some(a)) => $f::<u16>(|p| p.scaled(a), $($arg),*),
            (4, None) => $f::<u32>(|p| p, $($arg),*),
            (4, Some(a)) => $f::<u32>(|p| p.scaled(a), $($arg),*),
            (_, None) => $f::<u64>(|p| p, $($arg),*),
            (_, Some(a)) => $f::<u64>(|p| p.scaled(a), $($arg),*),
        }
    };
}

#[inline(always)]
fn encode_any(
    width: usize,
    alpha: Option<f32>,
    prev: &[u8],
    cur: &[u8],
    sc: &mut Scratch,
    out: &mut Vec<u8>,
) {
    per_lane!(encode_t, width, alpha, prev, cur, sc, out)
}

#[inline(always)]
fn decode_any(
    width: usize,
    alpha: Option<f32>,
    prev: &[u8],
    payload: &[u8],
    sc: &mut Scratch,
    out: &mut [u8],
) -> Result<()> {
    per_lane!(decode_t, width, alpha, prev, payload, sc, out)
}

/// The coder compiled for x86-64 CPUs with more than the baseline's SSE2, picked at run
/// time: the same source, so every build reads and writes the same bytes.
#[cfg(target_arch = "x86_64")]
mod fast {
    use super::*;

    /// Which build this CPU runs: 2 for AVX-512 (16 lanes per vector and a vector
    /// leading-zero count), 1 for AVX2 with BMI2 and LZCNT (variable shifts in one
    /// instruction, a scalar leading-zero count), 0 for the baseline.
    pub(super) fn level() -> u8 {
        use std::arch::is_x86_feature_detected as has;
        if !(has!("avx2") && has!("bmi2") && has!("lzcnt")) {
            0
        } else if has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512cd") {
            2
        } else {
            1
        }
    }

    macro_rules! build {
        ($enc:ident, $dec:ident, $features:literal) => {
            #[target_feature(enable = $features)]
            pub(super) fn $enc(
                width: usize,
                alpha: Option<f32>,
                prev: &[u8],
                cur: &[u8],
                sc: &mut Scratch,
                out: &mut Vec<u8>,
            ) {
                encode_any(width, alpha, prev, cur, sc, out)
            }

            #[target_feature(enable = $features)]
            pub(super) fn $dec(
                width: usize,
                alpha: Option<f32>,
                prev: &[u8],
                payload: &[u8],
                sc: &mut Scratch,
                out: &mut [u8],
            ) -> Result<()> {
                decode_any(width, alpha, prev, payload, sc, out)
            }
        };
    }
    build!(encode_v3, decode_v3, "avx2,bmi1,bmi2,lzcnt");
    build!(
        encode_v4,
        decode_v4,
        "avx2,bmi1,bmi2,lzcnt,avx512f,avx512bw,avx512vl,avx512cd"
    );
}

/// Appends the payload coding `cur` against the predictions from `prev` (`α · prev` when
/// `alpha` is given). The caller guarantees [`supports`]`(width)`, equal lengths and a
/// multiple of `width`.
pub(crate) fn encode(
    width: usize,
    alpha: Option<f32>,
    prev: &[u8],
    cur: &[u8],
    sc: &mut Scratch,
    out: &mut Vec<u8>,
) {
    #[cfg(target_arch = "x86_64")]
    match fast::level() {
        // SAFETY: the CPU has every feature the function is compiled for (`fast::level`).
        2 => return unsafe { fast::encode_v4(width, alpha, prev, cur, sc, out) },
        // SAFETY: as above.
        1 => return unsafe { fast::encode_v3(width, alpha, prev, cur, sc, out) },
        _ => {}
    }
    encode_any(width, alpha, prev, cur, sc, out)
}

/// Decodes a payload of [`encode`] into `out` (the chunk's length).
pub(crate) fn decode(
    width: usize,
    alpha: Option<f32>,
    prev: &[u8],
    payload: &[u8],
    sc: &mut Scratch,
    out: &mut [u8],
) -> Result<()> {
    if !supports(width) || !out.len().is_multiple_of(width) {
        return Err(DeltaError::Corrupt(format!(
            "magnitude coding of {width}-byte lanes"
        )));
    }
    #[cfg(target_arch = "x86_64")]
    match fast::level() {
        // SAFETY: the CPU has every feature the function is compiled for (`fast::level`).
        2 => return unsafe { fast::decode_v4(width, alpha, prev, payload, sc, out) },
        // SAFETY: as above.
        1 => return unsafe { fast::decode_v3(width, alpha, prev, payload, sc, out) },
        _ => {}
    }
    decode_any(width, alpha, prev, payload, sc, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(s: &mut u64) -> u64 {
        *s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *s
    }

    fn round_trip(width: usize, alpha: Option<f32>, prev: &[u8], cur: &[u8]) -> usize {
        let mut out = Vec::new();
        encode(width, alpha, prev, cur, &mut Scratch::default(), &mut out);
        let mut back = vec![0u8; cur.len()];
        decode(width, alpha, prev, &out, &mut Scratch::default(), &mut back).expect("decode");
        assert_eq!(back, cur, "width {width} alpha {alpha:?}");
        out.len()
    }

    #[test]
    fn symbols_cover_every_residual_of_every_width() {
        // Extreme residuals: ±1 ulp, the full range, NaN payloads, ±0, infinities.
        let specials32 = [
            0u32,
            0x8000_0000,
            1,
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_0001,
            0xffff_ffff,
            0x3f80_0000,
        ];
        for &a in &specials32 {
            for &b in &specials32 {
                let (s, m) = symbol(b, a);
                assert!(usize::from(s) < alphabet(32));
                assert_eq!(lane(s, low_bits(s, m), a), b, "{a:#x} -> {b:#x}");
            }
        }
        let mut s = 9;
        for width in [2usize, 4, 8] {
            for n in [0usize, 1, 7, 9, 4097] {
                let prev: Vec<u8> = (0..n * width).map(|_| (lcg(&mut s) >> 56) as u8).collect();
                let cur: Vec<u8> = (0..n * width).map(|_| (lcg(&mut s) >> 56) as u8).collect();
                round_trip(width, None, &prev, &cur);
                round_trip(width, Some(0.999), &prev, &cur);
            }
        }
    }

    #[test]
    fn every_build_reads_and_writes_what_the_dispatched_one_does() {
        // The public functions run the fastest build this CPU has; the others must produce
        // and accept the same bytes (a blob moves between machines).
        let mut s = 4;
        for (width, alpha) in [
            (2usize, None),
            (2, Some(0.99f32)),
            (4, Some(0.999)),
            (8, None),
        ] {
            let prev: Vec<u8> = (0..40_000).map(|_| (lcg(&mut s) >> 56) as u8).collect();
            let mut cur = prev.clone();
            for b in cur.iter_mut().step_by(width) {
                *b ^= (lcg(&mut s) >> 60) as u8;
            }
            let mut a = Vec::new();
            encode(width, alpha, &prev, &cur, &mut Scratch::default(), &mut a);
            let mut b = Vec::new();
            encode_any(width, alpha, &prev, &cur, &mut Scratch::default(), &mut b);
            assert_eq!(a, b, "width {width}");
            #[cfg(target_arch = "x86_64")]
            if fast::level() >= 1 {
                // The AVX2 build, which a CPU with AVX-512 does not pick by itself.
                let mut c = Vec::new();
                // SAFETY: the CPU has AVX2, BMI2 and LZCNT (`fast::level`).
                unsafe {
                    fast::encode_v3(width, alpha, &prev, &cur, &mut Scratch::default(), &mut c)
                };
                assert_eq!(a, c, "width {width}");
                let mut back = vec![0u8; cur.len()];
                // SAFETY: as above.
                unsafe {
                    fast::decode_v3(width, alpha, &prev, &a, &mut Scratch::default(), &mut back)
                }
                .expect("decode");
                assert_eq!(back, cur);
            }
            let mut back = vec![0u8; cur.len()];
            decode_any(width, alpha, &prev, &a, &mut Scratch::default(), &mut back)
                .expect("decode");
            assert_eq!(back, cur);
        }
    }

    #[test]
    fn small_float_changes_cost_few_bits() {
        let mut s = 1;
        let n = 100_000;
        let prev: Vec<f32> = (0..n)
            .map(|_| (lcg(&mut s) >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
            .collect();
        let cur: Vec<f32> = prev
            .iter()
            .map(|&p| p + p * 1e-5 * ((lcg(&mut s) >> 60) as f32 - 7.5))
            .collect();
        let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let len = round_trip(4, None, &bytes(&prev), &bytes(&cur));
        // Changes of up to ~8e-5 relative are under 2^10 ulps: well under 2 bytes a lane.
        assert!(len < 2 * n, "{len} bytes for {n} lanes");
    }

    #[test]
    fn damaged_payloads_are_errors_not_panics() {
        let prev: Vec<u8> = (0..4000u32)
            .flat_map(|i| (i as f32).to_le_bytes())
            .collect();
        let cur: Vec<u8> = (0..4000u32)
            .flat_map(|i| (i as f32 * 1.001).to_le_bytes())
            .collect();
        let mut out = Vec::new();
        encode(4, None, &prev, &cur, &mut Scratch::default(), &mut out);
        let mut back = vec![0u8; cur.len()];
        for cut in [0, 1, 5, out.len() / 2, out.len() - 1] {
            assert!(
                decode(
                    4,
                    None,
                    &prev,
                    &out[..cut],
                    &mut Scratch::default(),
                    &mut back
                )
                .is_err(),
                "cut {cut}"
            );
        }
        let mut longer = out.clone();
        longer.push(0);
        assert!(decode(4, None, &prev, &longer, &mut Scratch::default(), &mut back).is_err());
        assert!(decode(
            3,
            None,
            &prev[..3999],
            &out,
            &mut Scratch::default(),
            &mut back[..3999]
        )
        .is_err());
        assert!(decode(
            4,
            None,
            &prev[..16],
            &out,
            &mut Scratch::default(),
            &mut back
        )
        .is_err());
    }
}
