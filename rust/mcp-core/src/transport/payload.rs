//! A received payload, kept as the pieces the network delivered them in.
//!
//! QUIC hands over stream data in pieces (one per packet, usually). Gluing them into one
//! buffer would cost a copy, a fresh allocation and its page faults for every chunk; instead
//! the reductions and copies read the pieces directly, handling the elements that straddle two
//! pieces through a small carry.

use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::reduce::reduce_into;
use crate::wire::Header;
use bytes::Bytes;

/// A payload as a list of byte pieces.
#[derive(Debug, Clone, Default)]
pub struct Payload {
    pieces: Vec<Bytes>,
    len: usize,
}

impl From<Vec<u8>> for Payload {
    fn from(v: Vec<u8>) -> Payload {
        let len = v.len();
        Payload {
            pieces: if len == 0 {
                Vec::new()
            } else {
                vec![Bytes::from(v)]
            },
            len,
        }
    }
}

impl Payload {
    /// An empty payload to append pieces to.
    pub fn new() -> Payload {
        Payload::default()
    }

    /// Flips bit `bit` (counted from the first byte's lowest bit); a bit past the end is
    /// ignored. Only the piece holding it is copied.
    pub fn flip_bit(&mut self, bit: usize) {
        let mut at = bit / 8;
        for piece in &mut self.pieces {
            if at < piece.len() {
                let mut v = piece.to_vec();
                v[at] ^= 1 << (bit % 8);
                *piece = Bytes::from(v);
                return;
            }
            at -= piece.len();
        }
    }

    /// Appends a piece.
    pub fn push(&mut self, piece: Bytes) {
        if !piece.is_empty() {
            self.len += piece.len();
            self.pieces.push(piece);
        }
    }

    /// Total bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// CRC32C over all pieces.
    pub fn crc32c(&self) -> u32 {
        self.pieces
            .iter()
            .fold(0, |crc, p| crc32c::crc32c_append(crc, p))
    }

    /// Checks the payload against the length and CRC its header announced.
    pub fn verify(&self, header: &Header) -> Result<()> {
        if self.len as u64 != header.payload_len {
            return Err(Error::Protocol(format!(
                "payload of {} bytes, header announced {}",
                self.len, header.payload_len
            )));
        }
        if self.crc32c() != header.payload_crc {
            return Err(Error::Protocol(format!(
                "payload checksum mismatch from rank {} in {} (seq {}, step {}, chunk {}): corrupted in transit or in memory",
                header.src,
                header.kind.op_name(),
                header.seq,
                header.step,
                header.chunk
            )));
        }
        Ok(())
    }

    /// Copies the payload into `dst` (which must be exactly as long).
    pub fn copy_to(&self, dst: &mut [u8]) -> Result<()> {
        self.check_len(dst.len())?;
        let mut at = 0;
        for p in &self.pieces {
            dst[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
        Ok(())
    }

    /// One contiguous copy of the payload.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.len);
        for p in &self.pieces {
            v.extend_from_slice(p);
        }
        v
    }

    /// `dst = op(dst, payload)` element-wise, reading the pieces in place.
    pub fn reduce_into(&self, dtype: DType, op: ReduceOp, dst: &mut [u8]) -> Result<()> {
        self.check_len(dst.len())?;
        let elem = dtype.size();
        let mut at = 0; // bytes of dst done
        let mut carry = [0u8; 8];
        let mut carried = 0; // bytes of a straddling element gathered so far
        for p in &self.pieces {
            let mut p: &[u8] = p;
            if carried > 0 {
                let take = (elem - carried).min(p.len());
                carry[carried..carried + take].copy_from_slice(&p[..take]);
                carried += take;
                p = &p[take..];
                if carried < elem {
                    continue;
                }
                reduce_into(dtype, op, &mut dst[at..at + elem], &carry[..elem])?;
                at += elem;
            }
            let whole = p.len() / elem * elem;
            reduce_into(dtype, op, &mut dst[at..at + whole], &p[..whole])?;
            at += whole;
            let rest = &p[whole..];
            carry[..rest.len()].copy_from_slice(rest);
            carried = rest.len();
        }
        debug_assert_eq!(carried, 0);
        Ok(())
    }

    fn check_len(&self, n: usize) -> Result<()> {
        if n != self.len {
            return Err(Error::Protocol(format!(
                "payload of {} bytes for a {n}-byte destination",
                self.len
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flip_bit_damages_exactly_one_bit_in_the_piece_holding_it() {
        let mut p = Payload::new();
        p.push(Bytes::from_static(&[0u8; 3]));
        p.push(Bytes::from_static(&[0u8; 5]));
        p.flip_bit(3 * 8 + 9); // second piece, byte 1, bit 1
        p.flip_bit(64); // past the end: nothing
        assert_eq!(p.to_vec(), vec![0, 0, 0, 0, 2, 0, 0, 0]);
    }

    #[test]
    fn reduction_across_arbitrary_piece_boundaries_is_exact() {
        let a: Vec<f64> = (0..100).map(|i| i as f64 * 1.5).collect();
        let b: Vec<f64> = (0..100).map(|i| 1000.0 - i as f64).collect();
        let bytes: Vec<u8> = b.iter().flat_map(|x| x.to_ne_bytes()).collect();
        for cut in [1usize, 3, 7, 8, 13, 64, 799] {
            let mut p = Payload::new();
            for piece in bytes.chunks(cut) {
                p.push(Bytes::copy_from_slice(piece));
            }
            let mut dst: Vec<u8> = a.iter().flat_map(|x| x.to_ne_bytes()).collect();
            p.reduce_into(DType::F64, ReduceOp::Sum, &mut dst)
                .expect("reduce");
            for (i, c) in dst.chunks_exact(8).enumerate() {
                let v = f64::from_ne_bytes(c.try_into().expect("8 bytes"));
                assert_eq!(v, a[i] + b[i], "cut {cut} element {i}");
            }
            let mut copy = vec![0u8; bytes.len()];
            p.copy_to(&mut copy).expect("copy");
            assert_eq!(copy, bytes);
            assert_eq!(p.crc32c(), crc32c::crc32c(&bytes));
        }
    }

    #[test]
    fn wrong_lengths_are_errors() {
        let p = Payload::from(vec![1u8, 2, 3, 4]);
        assert!(p.copy_to(&mut [0u8; 3]).is_err());
        assert!(p
            .reduce_into(DType::U8, ReduceOp::Sum, &mut [0u8; 5])
            .is_err());
    }
}
