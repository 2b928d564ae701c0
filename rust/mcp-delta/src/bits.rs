//! Branch-free bit packing (least significant bit first) for the raw low bits of residuals.

use super::error::{DeltaError, Result};

/// Most bits one [`BitWriter::put`] or [`BitReader::get`] moves.
pub(crate) const MAX_PUT: u32 = 56;

/// Packs values of up to [`MAX_PUT`] bits into a buffer sized in advance.
pub(crate) struct BitWriter<'a> {
    buf: &'a mut [u8],
    at: usize,
    acc: u64,
    n: u32,
}

impl<'a> BitWriter<'a> {
    /// A writer into `buf`, which must hold every byte written plus 8 bytes of slack.
    pub(crate) fn new(buf: &'a mut [u8]) -> Self {
        BitWriter {
            buf,
            at: 0,
            acc: 0,
            n: 0,
        }
    }

    /// Appends the low `nb` bits of `v` (`v < 2^nb`, `nb <= MAX_PUT`).
    ///
    /// Panics if the buffer is too small: the caller sizes it from the lane count.
    #[inline(always)]
    pub(crate) fn put(&mut self, v: u64, nb: u32) {
        self.acc |= v << self.n;
        self.n += nb;
        // Always store 8 bytes and advance by the whole ones: no branch on the fill level.
        self.buf[self.at..self.at + 8].copy_from_slice(&self.acc.to_le_bytes());
        let bytes = self.n >> 3;
        self.at += bytes as usize;
        // n <= 7 + MAX_PUT = 63 bits, so at most 7 whole bytes leave: the shift stays < 64.
        self.acc >>= 8 * bytes;
        self.n &= 7;
    }

    /// Flushes the last partial byte and returns the number of bytes written.
    pub(crate) fn finish(mut self) -> usize {
        if self.n > 0 {
            self.buf[self.at] = self.acc as u8;
            self.at += 1;
        }
        self.at
    }
}

/// Reads values packed by [`BitWriter`].
pub(crate) struct BitReader<'a> {
    buf: &'a [u8],
    bit: usize,
}

impl<'a> BitReader<'a> {
    /// A reader over `buf`.
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        BitReader { buf, bit: 0 }
    }

    /// The next `nb` bits (`nb <= MAX_PUT`); zeros past the end, which [`BitReader::finish`]
    /// reports.
    #[inline(always)]
    pub(crate) fn get(&mut self, nb: u32) -> u64 {
        let at = self.bit >> 3;
        let w = match self.buf.get(at..at + 8) {
            Some(b) => u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]),
            None => self.tail(at),
        };
        let v = (w >> (self.bit & 7)) & ((1u64 << nb) - 1);
        self.bit += nb as usize;
        v
    }

    #[cold]
    fn tail(&self, at: usize) -> u64 {
        let mut b = [0u8; 8];
        if let Some(rest) = self.buf.get(at..) {
            b[..rest.len().min(8)].copy_from_slice(&rest[..rest.len().min(8)]);
        }
        u64::from_le_bytes(b)
    }

    /// Reads `out.len()` values of `nbits[i] <= 32` bits each into `out`, the same as one
    /// [`BitReader::get`] per value; on CPUs with AVX-512 eight at a time, their offsets a
    /// prefix sum in registers and their bytes gathered, so that no read waits on the one
    /// before it.
    #[inline(always)]
    pub(crate) fn get_many(&mut self, nbits: &[u32], out: &mut [u64]) {
        let n = out.len().min(nbits.len());
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if gather::available() {
            // SAFETY: the CPU has AVX-512F (checked above).
            let (d, bit) = unsafe { gather::read(self.buf, self.bit, &nbits[..n], &mut out[..n]) };
            done = d;
            self.bit = bit;
        }
        for (o, &nb) in out[done..n].iter_mut().zip(&nbits[done..n]) {
            *o = self.get(nb);
        }
    }

    /// Checks that exactly the whole buffer was read (up to the padding of its last byte).
    pub(crate) fn finish(self) -> Result<()> {
        if self.bit.div_ceil(8) != self.buf.len() {
            return Err(DeltaError::Corrupt(format!(
                "raw bits: {} bytes stored, {} read",
                self.buf.len(),
                self.bit.div_ceil(8)
            )));
        }
        Ok(())
    }
}

/// Gathered reads of bit fields with AVX-512.
#[cfg(target_arch = "x86_64")]
mod gather {
    use std::arch::x86_64::*;

    /// Whether this CPU runs [`read`].
    pub(super) fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx512f")
    }

    /// Reads fields of `nbits[i] <= 32` bits from bit `start` of `buf` into `out`, in groups
    /// of eight while a whole group lies in `buf` with 8 bytes to spare; returns how many it
    /// read and the bit offset after them.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn read(
        buf: &[u8],
        start: usize,
        nbits: &[u32],
        out: &mut [u64],
    ) -> (usize, usize) {
        let n = out.len().min(nbits.len()) / 8 * 8;
        let (one, seven, zero) = (
            _mm512_set1_epi64(1),
            _mm512_set1_epi64(7),
            _mm512_setzero_si512(),
        );
        let mut base = start;
        let mut i = 0;
        // Eight fields of at most 32 bits span at most 32 bytes, each read takes 8.
        while i < n && (base >> 3) + 40 <= buf.len() {
            // SAFETY: `i + 8 <= n` bounds the loads and the store; every gathered 8-byte
            // read starts before byte `base / 8 + 32` and so ends inside `buf` (the loop
            // condition).
            unsafe {
                let nb = _mm512_cvtepu32_epi64(_mm256_loadu_si256(nbits.as_ptr().add(i).cast()));
                // Inclusive prefix sum of the eight bit counts, in three shifted adds.
                let mut s = _mm512_add_epi64(nb, _mm512_alignr_epi64::<7>(nb, zero));
                s = _mm512_add_epi64(s, _mm512_alignr_epi64::<6>(s, zero));
                s = _mm512_add_epi64(s, _mm512_alignr_epi64::<4>(s, zero));
                let p = _mm512_add_epi64(_mm512_sub_epi64(s, nb), _mm512_set1_epi64(base as i64));
                let w = _mm512_i64gather_epi64::<1>(_mm512_srli_epi64::<3>(p), buf.as_ptr().cast());
                let v = _mm512_srlv_epi64(w, _mm512_and_si512(p, seven));
                let mask = _mm512_sub_epi64(_mm512_sllv_epi64(one, nb), one);
                _mm512_storeu_si512(out.as_mut_ptr().add(i).cast(), _mm512_and_si512(v, mask));
                base += _mm512_reduce_add_epi64(nb) as usize;
            }
            i += 8;
        }
        (i, base)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_width() {
        let mut s = 5u64;
        let vals: Vec<(u64, u32)> = (0..10_000)
            .map(|i| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let nb = (i * 7 % 57) as u32;
                (if nb == 0 { 0 } else { s >> (64 - nb) }, nb)
            })
            .collect();
        let total: usize = vals.iter().map(|&(_, nb)| nb as usize).sum();
        let mut buf = vec![0u8; total / 8 + 9];
        let mut w = BitWriter::new(&mut buf);
        for &(v, nb) in &vals {
            w.put(v, nb);
        }
        let len = w.finish();
        assert_eq!(len, total.div_ceil(8));
        let mut r = BitReader::new(&buf[..len]);
        for &(v, nb) in &vals {
            assert_eq!(r.get(nb), v, "{nb} bits");
        }
        r.finish().expect("consumed exactly");
    }

    #[test]
    fn batched_reads_equal_single_reads() {
        let mut s = 7u64;
        let nbits: Vec<u32> = (0..5000)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1);
                ((s >> 40) % 33) as u32
            })
            .collect();
        let total: usize = nbits.iter().map(|&b| b as usize).sum();
        let buf: Vec<u8> = (0..total.div_ceil(8))
            .map(|i| (i * 131 % 251) as u8)
            .collect();
        let mut one = BitReader::new(&buf);
        let want: Vec<u64> = nbits.iter().map(|&nb| one.get(nb)).collect();
        let mut many = BitReader::new(&buf);
        let mut got = vec![0u64; nbits.len()];
        // In uneven batches, as the decoder's blocks and the buffer's tail cut them.
        let mut at = 0;
        for len in [1usize, 7, 8, 9, 100, 2048].into_iter().cycle() {
            let end = (at + len).min(nbits.len());
            many.get_many(&nbits[at..end], &mut got[at..end]);
            at = end;
            if at == nbits.len() {
                break;
            }
        }
        assert_eq!(got, want);
        many.finish().expect("consumed exactly");
    }

    #[test]
    fn reading_past_the_end_is_reported() {
        let mut r = BitReader::new(&[0xff, 0x01]);
        assert_eq!(r.get(9), 0x1ff);
        assert_eq!(r.get(20), 0);
        assert!(r.finish().is_err());
        let r = BitReader::new(&[1, 2, 3]);
        assert!(r.finish().is_err());
    }
}
