//! Static interleaved rANS: an order-0 entropy coder for alphabets of up to
//! [`MAX_ALPHABET`] symbols.
//!
//! Unlike a Huffman code, rANS spends fractional bits per symbol, so a symbol that fills 95 %
//! of a chunk costs 0.07 bits instead of 1; unlike arithmetic coding it is a few integer
//! operations per symbol. The construction follows Giesen's `rans_byte` (2014) with 16-bit
//! renormalisation: states live in `[L, 2^31)` with `L = 2^15`, probabilities are quantised
//! to [`PROB_BITS`] bits, encoding divides by a symbol's frequency through an exact
//! reciprocal (no division instruction), and [`STATES`] independent states take the symbols
//! in turn so that their dependency chains overlap in the CPU. The encoder runs backwards
//! over the symbols and the decoder forwards; the words the encoder emits are stored in the
//! reverse of their emission order so that the decoder reads them front to back.
//!
//! Stream layout: the [`STATES`] final encoder states (32 bits each, little-endian, state 0
//! first), then the renormalisation words. A decoder ends in the encoder's initial states;
//! [`decode`] checks that, and that the stream was consumed exactly.

use super::error::{DeltaError, Result};

/// Probabilities are multiples of `2^-PROB_BITS`.
pub(crate) const PROB_BITS: u32 = 12;
/// The sum of the quantised frequencies.
const PROB_SCALE: u32 = 1 << PROB_BITS;
/// Lower end of a normalised state.
const L: u32 = 1 << 15;
/// Interleaved states.
pub(crate) const STATES: usize = 16;
/// Largest alphabet a table may describe.
pub(crate) const MAX_ALPHABET: usize = 1024;

/// The symbol counts of a chunk quantised to frequencies that sum to `2^PROB_BITS`, every
/// symbol that occurs keeping a frequency of at least 1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Freqs(Vec<u32>);

impl Freqs {
    /// Quantises `counts` (one per symbol; at least one non-zero, at most
    /// [`MAX_ALPHABET`] entries).
    pub(crate) fn from_counts(counts: &[u32]) -> Freqs {
        let used = counts.iter().rposition(|&c| c > 0).map_or(0, |i| i + 1);
        let counts = &counts[..used];
        let total: u64 = counts.iter().map(|&c| u64::from(c)).sum();
        if total == 0 {
            return Freqs(vec![PROB_SCALE]);
        }
        let mut f: Vec<u32> = counts
            .iter()
            .map(|&c| {
                if c == 0 {
                    0
                } else {
                    // Round to nearest; never below 1 for a symbol that occurs.
                    let q = (u64::from(c) * u64::from(PROB_SCALE) + total / 2) / total;
                    (q as u32).max(1)
                }
            })
            .collect();
        let sum: u32 = f.iter().sum();
        if sum < PROB_SCALE {
            // The most frequent symbol absorbs the rounding: the relative change is smallest.
            if let Some(m) = (0..f.len()).max_by_key(|&i| f[i]) {
                f[m] += PROB_SCALE - sum;
            }
        } else {
            // Take the excess from the largest frequencies first, never below 1.
            let mut excess = sum - PROB_SCALE;
            while excess > 0 {
                let Some(m) = (0..f.len()).max_by_key(|&i| f[i]) else {
                    break;
                };
                let take = excess.min(f[m] - 1).min((f[m] / 16).max(1));
                if take == 0 {
                    break; // every frequency is 1: cannot happen below MAX_ALPHABET symbols
                }
                f[m] -= take;
                excess -= take;
            }
        }
        Freqs(f)
    }

    /// Frequency of each symbol (the alphabet ends at the last symbol that occurs).
    pub(crate) fn as_slice(&self) -> &[u32] {
        &self.0
    }

    /// Appends the table: the alphabet size (u16), then each frequency as a LEB128 varint,
    /// a zero followed by one byte counting the further zeros of its run.
    pub(crate) fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&(self.0.len() as u16).to_le_bytes());
        let mut i = 0;
        while i < self.0.len() {
            let f = self.0[i];
            if f == 0 {
                let run = self.0[i + 1..]
                    .iter()
                    .take(255)
                    .take_while(|&&g| g == 0)
                    .count();
                out.extend_from_slice(&[0, run as u8]);
                i += 1 + run;
            } else {
                let mut v = f;
                while v >= 0x80 {
                    out.push((v as u8) | 0x80);
                    v >>= 7;
                }
                out.push(v as u8);
                i += 1;
            }
        }
    }

    /// Reads a table written by [`Freqs::write`] from the front of `buf`, at most
    /// `max_alphabet` symbols; returns it and the bytes it took.
    pub(crate) fn read(buf: &[u8], max_alphabet: usize) -> Result<(Freqs, usize)> {
        let corrupt = |what: &str| DeltaError::Corrupt(format!("frequency table: {what}"));
        let n = match buf {
            [a, b, ..] => usize::from(u16::from_le_bytes([*a, *b])),
            _ => return Err(DeltaError::Truncated("frequency table".into())),
        };
        if n == 0 || n > max_alphabet.min(MAX_ALPHABET) {
            return Err(corrupt(&format!("{n} symbols")));
        }
        let mut at = 2;
        let mut byte = || {
            let b = buf.get(at).copied();
            at += 1;
            b.ok_or_else(|| DeltaError::Truncated("frequency table".into()))
        };
        let mut f = Vec::with_capacity(n);
        while f.len() < n {
            let mut v = 0u32;
            let mut shift = 0;
            loop {
                let b = byte()?;
                v |= u32::from(b & 0x7f) << shift;
                if b & 0x80 == 0 {
                    break;
                }
                shift += 7;
                if shift > 14 {
                    return Err(corrupt("frequency over 21 bits"));
                }
            }
            if v == 0 {
                let run = usize::from(byte()?);
                f.resize(f.len() + 1 + run, 0);
            } else {
                f.push(v);
            }
        }
        if f.len() != n || f.iter().sum::<u32>() != PROB_SCALE {
            return Err(corrupt("frequencies do not sum to the probability scale"));
        }
        Ok((Freqs(f), at))
    }
}

/// What the encoder needs of one symbol.
#[derive(Debug, Clone, Copy, Default)]
struct EncSym {
    /// States at or above this are renormalised before coding the symbol.
    x_max: u32,
    /// Fixed-point reciprocal of the frequency.
    rcp: u32,
    /// Shift applied after the reciprocal multiplication.
    rcp_shift: u32,
    /// Start of the symbol's slot range (adjusted for frequency 1).
    bias: u32,
    /// `2^PROB_BITS - freq`.
    cmpl: u32,
}

/// Encoder tables for one [`Freqs`].
pub(crate) struct EncTable(Vec<EncSym>, Vec<u64>);

impl EncTable {
    /// Builds the tables.
    pub(crate) fn new(freqs: &Freqs) -> EncTable {
        let mut start = 0u32;
        let syms = freqs
            .as_slice()
            .iter()
            .map(|&f| {
                let s = if f == 0 {
                    EncSym::default()
                } else if f == 1 {
                    // q = x - 1 from the all-ones reciprocal; the bias restores x·M + start.
                    EncSym {
                        x_max: ((L >> PROB_BITS) << 16) * f,
                        rcp: u32::MAX,
                        rcp_shift: 0,
                        bias: start + PROB_SCALE - 1,
                        cmpl: PROB_SCALE - f,
                    }
                } else {
                    let shift = 32 - (f - 1).leading_zeros(); // ceil(log2 f)
                    EncSym {
                        x_max: ((L >> PROB_BITS) << 16) * f,
                        rcp: ((1u64 << (shift + 31)).div_ceil(u64::from(f))) as u32,
                        rcp_shift: shift - 1,
                        bias: start,
                        cmpl: PROB_SCALE - f,
                    }
                };
                start += f;
                s
            })
            .collect::<Vec<EncSym>>();
        // The vector encoder's table: the reciprocal (bits 0-31), bias (32-44), complement
        // of the frequency (45-56) and shift (57-60) in one word, padded to the largest
        // alphabet so that any index it gathers is inside.
        let mut packed = vec![0u64; MAX_ALPHABET];
        for (p, e) in packed.iter_mut().zip(&syms) {
            *p = u64::from(e.rcp)
                | u64::from(e.bias) << 32
                | u64::from(e.cmpl) << 45
                | u64::from(e.rcp_shift) << 57;
        }
        EncTable(syms, packed)
    }
}

/// Codes one symbol into state `x`, storing a renormalisation word at `words[*k]` and
/// advancing `k` when one is due (branch-free: the store always happens).
#[inline(always)]
fn put(x: &mut u32, s: &EncSym, words: &mut [u16], k: &mut usize) {
    let emit = *x >= s.x_max;
    words[*k] = *x as u16;
    *k += usize::from(emit);
    *x = if emit { *x >> 16 } else { *x };
    // Exact division: q = x / freq for every x < 2^31 (Giesen, rans_byte.h).
    let q = ((u64::from(*x) * u64::from(s.rcp)) >> 32) as u32 >> s.rcp_shift;
    *x = x.wrapping_add(s.bias).wrapping_add(q.wrapping_mul(s.cmpl));
}

/// Encodes `syms` (each below the table's alphabet size, with a non-zero frequency) and
/// appends the stream to `out`; `words` is scratch.
#[inline(always)]
pub(crate) fn encode(syms: &[u16], table: &EncTable, words: &mut Vec<u16>, out: &mut Vec<u8>) {
    #[cfg(target_arch = "x86_64")]
    let vector = avx512::available();
    #[cfg(not(target_arch = "x86_64"))]
    let vector = false;
    encode_using(syms, table, words, out, vector)
}

/// [`encode`], with the vector encoder for the whole groups if `vector` (and the CPU runs
/// it): the same bytes either way.
#[inline(always)]
fn encode_using(
    syms: &[u16],
    table: &EncTable,
    words: &mut Vec<u16>,
    out: &mut Vec<u8>,
    vector: bool,
) {
    let t = table.0.as_slice();
    let mut st = [L; STATES];
    // At most one word per symbol, plus the slot the last branch-free store may touch.
    words.resize(syms.len() + 1, 0);
    let mut k = 0;
    let full = syms.len() / STATES * STATES;
    // The tail first (the encoder runs backwards): lane i always goes to state i % STATES.
    for (j, &s) in syms[full..].iter().enumerate().rev() {
        put(&mut st[j], &t[usize::from(s)], words, &mut k);
    }
    let mut groups = full / STATES;
    #[cfg(target_arch = "x86_64")]
    if vector && avx512::available() {
        // SAFETY: the CPU has the features the function is compiled for (checked above).
        groups = unsafe { avx512::encode_groups(table, &syms[..full], &mut st, words, &mut k) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = vector;
    for group in syms[..groups * STATES].chunks_exact(STATES).rev() {
        for j in (0..STATES).rev() {
            put(&mut st[j], &t[usize::from(group[j])], words, &mut k);
        }
    }
    for x in st {
        out.extend_from_slice(&x.to_le_bytes());
    }
    let base = out.len();
    out.resize(base + 2 * k, 0);
    for (o, w) in out[base..].chunks_exact_mut(2).zip(words[..k].iter().rev()) {
        o.copy_from_slice(&w.to_le_bytes());
    }
}

/// Decoder table for one [`Freqs`]. For every slot: its symbol's frequency (bits 0-15), the
/// slot's offset from the symbol's start (bits 16-31) and the symbol (bits 32-47), in one
/// word so that a scalar step does one load; and the same as two 32-bit tables (frequency
/// and offset; symbol) for the vector decoder's gathers.
pub(crate) struct DecTable {
    slots: Vec<u64>,
    freq_offset: Vec<u32>,
    sym: Vec<u32>,
}

impl DecTable {
    /// Builds the table.
    pub(crate) fn new(freqs: &Freqs) -> DecTable {
        let n = PROB_SCALE as usize;
        let (mut slots, mut freq_offset, mut sym) = (vec![0u64; n], vec![0u32; n], vec![0u32; n]);
        let mut start = 0usize;
        for (s, &f) in freqs.as_slice().iter().enumerate() {
            let range = start..start + f as usize;
            for (o, ((slot, fo), sy)) in slots[range.clone()]
                .iter_mut()
                .zip(&mut freq_offset[range.clone()])
                .zip(&mut sym[range])
                .enumerate()
            {
                *fo = f | (o as u32) << 16;
                *sy = s as u32;
                *slot = u64::from(*fo) | (s as u64) << 32;
            }
            start += f as usize;
        }
        DecTable {
            slots,
            freq_offset,
            sym,
        }
    }
}

/// Decodes `syms.len()` symbols from `stream` into `syms`, and checks that the stream is
/// consumed exactly and ends in the encoder's initial states.
#[inline(always)]
pub(crate) fn decode(stream: &[u8], table: &DecTable, syms: &mut [u16]) -> Result<()> {
    #[cfg(target_arch = "x86_64")]
    let vector = avx512::available();
    #[cfg(not(target_arch = "x86_64"))]
    let vector = false;
    decode_using(stream, table, syms, vector)
}

/// [`decode`], with the vector decoder for the bulk of the stream if `vector` and the CPU
/// runs it: the same symbols either way.
#[inline(always)]
fn decode_using(stream: &[u8], table: &DecTable, syms: &mut [u16], vector: bool) -> Result<()> {
    let t: &[u64; PROB_SCALE as usize] = table
        .slots
        .as_slice()
        .try_into()
        .map_err(|_| DeltaError::Corrupt("rANS table".into()))?;
    let head = stream
        .get(..4 * STATES)
        .ok_or_else(|| DeltaError::Truncated("rANS states".into()))?;
    let mut st = [0u32; STATES];
    for (x, b) in st.iter_mut().zip(head.chunks_exact(4)) {
        *x = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    let words = &stream[4 * STATES..];
    let mut at = 0usize;
    let mut done = 0usize;
    #[cfg(target_arch = "x86_64")]
    if vector && avx512::available() {
        // SAFETY: the CPU has the features the function is compiled for (checked above).
        done = unsafe { avx512::decode_groups(table, words, &mut st, &mut at, syms) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = vector;
    #[inline(always)]
    fn step(x: &mut u32, t: &[u64; PROB_SCALE as usize], words: &[u8], at: &mut usize) -> u16 {
        let slot = t[(*x & (PROB_SCALE - 1)) as usize];
        *x = (slot as u32 & 0xffff) * (*x >> PROB_BITS) + (slot as u32 >> 16);
        // Branch-free refill: read the next word (zero past the end) and keep it if needed.
        let w = match words.get(*at..*at + 2) {
            Some(&[a, b]) => u32::from(u16::from_le_bytes([a, b])),
            _ => 0,
        };
        let need = *x < L;
        *x = if need { (*x << 16) | w } else { *x };
        *at += 2 * usize::from(need);
        (slot >> 32) as u16
    }
    let mut groups = syms[done..].chunks_exact_mut(STATES);
    for g in &mut groups {
        for (s, x) in g.iter_mut().zip(st.iter_mut()) {
            *s = step(x, t, words, &mut at);
        }
    }
    for (s, x) in groups.into_remainder().iter_mut().zip(st.iter_mut()) {
        *s = step(x, t, words, &mut at);
    }
    if at != words.len() {
        return Err(DeltaError::Corrupt(format!(
            "rANS stream of {} words, {} read",
            words.len() / 2,
            at / 2
        )));
    }
    if st.iter().any(|&x| x != L) {
        return Err(DeltaError::Corrupt(
            "rANS stream ends in a wrong state".into(),
        ));
    }
    Ok(())
}

/// The decoder with the [`STATES`] = 16 states in one AVX-512 vector: two gathers look up
/// the slots, and the refill words are expanded into exactly the lanes that need one, in
/// lane order, which is the order the scalar decoder reads them in. Same stream, same
/// symbols, about three times fewer instructions per symbol.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    const _: () = assert!(
        STATES == 16,
        "one state per 32-bit lane of a 512-bit vector"
    );

    /// Whether this CPU runs [`decode_groups`].
    pub(super) fn available() -> bool {
        use std::arch::is_x86_feature_detected as has;
        has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512vbmi2")
    }

    /// Decodes whole groups of 16 symbols into the front of `syms` while the stream has
    /// 32 bytes left at `at` (the most one group can read); updates the states and `at` and
    /// returns the symbols written.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,popcnt")]
    pub(super) fn decode_groups(
        table: &DecTable,
        words: &[u8],
        st: &mut [u32; STATES],
        at: &mut usize,
        syms: &mut [u16],
    ) -> usize {
        debug_assert_eq!(table.freq_offset.len(), PROB_SCALE as usize);
        debug_assert_eq!(table.sym.len(), PROB_SCALE as usize);
        let fo = table.freq_offset.as_ptr();
        let sy = table.sym.as_ptr();
        // SAFETY: `st` is 16 u32s, read unaligned.
        let mut x = unsafe { _mm512_loadu_si512(st.as_ptr().cast()) };
        let slot_mask = _mm512_set1_epi32((PROB_SCALE - 1) as i32);
        let low16 = _mm512_set1_epi32(0xffff);
        let l = _mm512_set1_epi32(L as i32);
        let mut done = 0;
        let mut pos = *at;
        for g in syms.chunks_exact_mut(STATES) {
            if pos + 32 > words.len() {
                break;
            }
            let slot = _mm512_and_si512(x, slot_mask);
            // SAFETY: every index is below PROB_SCALE, the length of both tables.
            let (f_o, s) = unsafe {
                (
                    _mm512_i32gather_epi32::<4>(slot, fo.cast()),
                    _mm512_i32gather_epi32::<4>(slot, sy.cast()),
                )
            };
            let freq = _mm512_and_si512(f_o, low16);
            let offset = _mm512_srli_epi32::<16>(f_o);
            x = _mm512_add_epi32(
                _mm512_mullo_epi32(freq, _mm512_srli_epi32::<PROB_BITS>(x)),
                offset,
            );
            let need = _mm512_cmplt_epu32_mask(x, l);
            // SAFETY: at most 16 words (32 bytes) are read, and `pos + 32 <= words.len()`.
            let w = unsafe { _mm256_maskz_expandloadu_epi16(need, words.as_ptr().add(pos).cast()) };
            let refilled = _mm512_or_si512(_mm512_slli_epi32::<16>(x), _mm512_cvtepu16_epi32(w));
            x = _mm512_mask_mov_epi32(x, need, refilled);
            pos += 2 * need.count_ones() as usize;
            // SAFETY: `g` is 16 u16s, written unaligned.
            unsafe { _mm256_storeu_si256(g.as_mut_ptr().cast(), _mm512_cvtepi32_epi16(s)) };
            done += STATES;
        }
        // SAFETY: as the load above.
        unsafe { _mm512_storeu_si512(st.as_mut_ptr().cast(), x) };
        *at = pos;
        done
    }

    /// Encodes the whole groups of `syms` backwards from the last, 16 states in one vector,
    /// and returns 0: the number of groups left to the scalar encoder, which must not run
    /// first (the encoder goes from the end to the start). Emits the words in the scalar
    /// encoder's order (lanes 15 to 0 of each group).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,popcnt")]
    pub(super) fn encode_groups(
        table: &EncTable,
        syms: &[u16],
        st: &mut [u32; STATES],
        words: &mut [u16],
        k: &mut usize,
    ) -> usize {
        let packed = &table.1;
        debug_assert_eq!(packed.len(), MAX_ALPHABET);
        // SAFETY: `st` is 16 u32s, read unaligned.
        let mut x = unsafe { _mm512_loadu_si512(st.as_ptr().cast()) };
        let reverse = _mm512_set_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let last = _mm512_set1_epi32(MAX_ALPHABET as i32 - 1);
        let (bias_mask, cmpl_mask) = (_mm512_set1_epi32(0x1fff), _mm512_set1_epi32(0xfff));
        let scale = _mm512_set1_epi32(PROB_SCALE as i32);
        let hi_dwords = _mm512_set1_epi64(0xffff_ffff_0000_0000u64 as i64);
        let mut at = *k;
        for g in syms.chunks_exact(STATES).rev() {
            // SAFETY: `g` is 16 u16s; every gathered index is clamped below MAX_ALPHABET,
            // the length of `packed`.
            let (lo, hi) = unsafe {
                let idx = _mm512_min_epu32(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256(g.as_ptr().cast())),
                    last,
                );
                (
                    _mm512_i32gather_epi64::<8>(
                        _mm512_castsi512_si256(idx),
                        packed.as_ptr().cast(),
                    ),
                    _mm512_i32gather_epi64::<8>(
                        _mm512_extracti64x4_epi64::<1>(idx),
                        packed.as_ptr().cast(),
                    ),
                )
            };
            let join =
                |a: __m256i, b: __m256i| _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b);
            let rcp = join(_mm512_cvtepi64_epi32(lo), _mm512_cvtepi64_epi32(hi));
            let meta = join(
                _mm512_cvtepi64_epi32(_mm512_srli_epi64::<32>(lo)),
                _mm512_cvtepi64_epi32(_mm512_srli_epi64::<32>(hi)),
            );
            let bias = _mm512_and_si512(meta, bias_mask);
            let cmpl = _mm512_and_si512(_mm512_srli_epi32::<13>(meta), cmpl_mask);
            let shift = _mm512_srli_epi32::<25>(meta);
            let x_max = _mm512_slli_epi32::<19>(_mm512_sub_epi32(scale, cmpl));
            let emit = _mm512_cmpge_epu32_mask(x, x_max);
            // The words of lanes 15..0, packed: the scalar encoder's order.
            let words16 = _mm512_cvtepi32_epi16(_mm512_permutexvar_epi32(reverse, x));
            let n = emit.count_ones() as usize;
            let dst = &mut words[at..at + n];
            // SAFETY: exactly `n` words are stored, into `dst`, which holds `n`.
            unsafe {
                _mm256_mask_compressstoreu_epi16(
                    dst.as_mut_ptr().cast(),
                    emit.reverse_bits(),
                    words16,
                )
            };
            at += n;
            x = _mm512_mask_srli_epi32::<16>(x, emit, x);
            // q = (x · rcp) >> 32 >> shift, from the even and the odd lanes' 64-bit products.
            let even = _mm512_srli_epi64::<32>(_mm512_mul_epu32(x, rcp));
            let odd = _mm512_and_si512(
                _mm512_mul_epu32(_mm512_srli_epi64::<32>(x), _mm512_srli_epi64::<32>(rcp)),
                hi_dwords,
            );
            let q = _mm512_srlv_epi32(_mm512_or_si512(even, odd), shift);
            x = _mm512_add_epi32(_mm512_add_epi32(x, bias), _mm512_mullo_epi32(q, cmpl));
        }
        // SAFETY: as the load above.
        unsafe { _mm512_storeu_si512(st.as_mut_ptr().cast(), x) };
        *k = at;
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(s: &mut u64) -> u64 {
        *s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *s >> 33
    }

    fn round_trip(syms: &[u16], alphabet: usize) -> usize {
        let mut counts = vec![0u32; alphabet];
        for &s in syms {
            counts[usize::from(s)] += 1;
        }
        let freqs = Freqs::from_counts(&counts);
        let mut table = Vec::new();
        freqs.write(&mut table);
        let (back, used) = Freqs::read(&table, MAX_ALPHABET).expect("table");
        assert_eq!((back.clone(), used), (freqs.clone(), table.len()));
        let mut out = Vec::new();
        encode_using(
            syms,
            &EncTable::new(&freqs),
            &mut Vec::new(),
            &mut out,
            false,
        );
        let mut vout = Vec::new();
        encode_using(
            syms,
            &EncTable::new(&freqs),
            &mut Vec::new(),
            &mut vout,
            true,
        );
        assert_eq!(
            vout, out,
            "the vector encoder writes the scalar encoder's bytes"
        );
        for vector in [false, true] {
            let mut got = vec![u16::MAX; syms.len()];
            decode_using(&out, &DecTable::new(&back), &mut got, vector).expect("decode");
            assert_eq!(got, syms, "vector decoder: {vector}");
        }
        out.len()
    }

    #[test]
    fn the_reciprocal_divides_exactly() {
        let mut s = 1;
        for f in 2..=PROB_SCALE {
            let e = EncTable::new(&Freqs(vec![f, PROB_SCALE - f])).0[0];
            for x in [L, (1 << 31) - 1, f * 8, f * (1 << 19) - 1]
                .into_iter()
                .chain((0..64).map(|_| (lcg(&mut s) as u32) >> 1))
            {
                let q = ((u64::from(x) * u64::from(e.rcp)) >> 32) as u32 >> e.rcp_shift;
                assert_eq!(q, x / f, "x {x} f {f}");
            }
        }
    }

    #[test]
    fn round_trips_skewed_uniform_and_tiny_inputs() {
        let mut s = 3;
        for n in [0usize, 1, 7, 8, 9, 1000, 65_537] {
            let skewed: Vec<u16> = (0..n)
                .map(|_| {
                    if lcg(&mut s).is_multiple_of(20) {
                        1 + (lcg(&mut s) % 400) as u16
                    } else {
                        0
                    }
                })
                .collect();
            round_trip(&skewed, 480);
            let uniform: Vec<u16> = (0..n).map(|_| (lcg(&mut s) % 1024) as u16).collect();
            round_trip(&uniform, 1024);
        }
        // One symbol only: the stream is just the states.
        assert_eq!(round_trip(&[5u16; 10_000], 6), 4 * STATES);
    }

    #[test]
    fn spends_close_to_the_entropy() {
        let mut s = 11;
        let n = 200_000;
        // p(0) = 0.9, else uniform over 1..=16: H = 0.469 + 0.1·4 = 0.869 bits.
        let syms: Vec<u16> = (0..n)
            .map(|_| {
                if !lcg(&mut s).is_multiple_of(10) {
                    0
                } else {
                    1 + (lcg(&mut s) % 16) as u16
                }
            })
            .collect();
        let bits = 8.0 * round_trip(&syms, 17) as f64 / n as f64;
        assert!(bits < 0.869 * 1.01 + 0.01, "{bits} bits per symbol");
    }

    #[test]
    fn quantisation_keeps_every_symbol_and_sums_to_scale() {
        let mut counts = vec![1u32; 1000];
        counts[0] = 1_000_000;
        let f = Freqs::from_counts(&counts);
        assert_eq!(f.as_slice().iter().sum::<u32>(), PROB_SCALE);
        assert!(f.as_slice().iter().all(|&x| x >= 1));
        let f = Freqs::from_counts(&[0, 0, 3, 0]);
        assert_eq!(f.as_slice(), &[0, 0, PROB_SCALE]);
    }

    #[test]
    fn bad_tables_and_streams_are_errors() {
        assert!(Freqs::read(&[], 16).is_err());
        assert!(Freqs::read(&[0, 0], 16).is_err()); // no symbols
        assert!(Freqs::read(&[17, 0], 16).is_err()); // too many
        assert!(Freqs::read(&[2, 0, 1, 1], 16).is_err()); // does not sum to the scale
        assert!(Freqs::read(&[2, 0, 0x80], 16).is_err()); // truncated varint
        let syms: Vec<u16> = (0..5000u32).map(|i| (i % 7) as u16).collect();
        let mut counts = vec![0u32; 7];
        syms.iter().for_each(|&s| counts[usize::from(s)] += 1);
        let freqs = Freqs::from_counts(&counts);
        let mut out = Vec::new();
        encode(&syms, &EncTable::new(&freqs), &mut Vec::new(), &mut out);
        let dt = DecTable::new(&freqs);
        let mut got = vec![0u16; syms.len()];
        for vector in [false, true] {
            assert!(decode_using(&out[..10], &dt, &mut got, vector).is_err());
            assert!(decode_using(&out[..out.len() - 2], &dt, &mut got, vector).is_err());
            let mut bad = out.clone();
            bad[80] ^= 0x10;
            assert!(decode_using(&bad, &dt, &mut got, vector).is_err());
        }
    }
}
