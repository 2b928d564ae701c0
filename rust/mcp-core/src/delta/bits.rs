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
    fn reading_past_the_end_is_reported() {
        let mut r = BitReader::new(&[0xff, 0x01]);
        assert_eq!(r.get(9), 0x1ff);
        assert_eq!(r.get(20), 0);
        assert!(r.finish().is_err());
        let r = BitReader::new(&[1, 2, 3]);
        assert!(r.finish().is_err());
    }
}
