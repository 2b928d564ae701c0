//! The wire format of one shard: a fixed 26-byte little-endian header, then the shard bytes.
//!
//! ```text
//! offset  size  field
//!      0     8  transfer id
//!      8     4  block index
//!     12     2  shard index (0..k are data shards, k..k+m parity shards)
//!     14     2  k (data shards of this block)
//!     16     2  m (parity shards of this block)
//!     18     4  length of the block's payload before padding
//!     22     4  CRC32C over bytes 0..22 and the shard bytes
//!     26     -  shard bytes (shard_bytes, even)
//! ```
//!
//! Reed-Solomon does not detect corruption; the CRC does, and a shard that fails it is an
//! erasure like a lost one.

use crate::error::{Error, Result};

/// Bytes in a shard header.
pub const HEADER_LEN: usize = 26;

/// Offset of the CRC in the header.
const CRC_AT: usize = 22;

/// What a shard says about itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardHeader {
    /// The transfer this shard belongs to.
    pub transfer_id: u64,
    /// The block within the transfer.
    pub block: u32,
    /// The shard within the block: `0..k` data, `k..k+m` parity.
    pub index: u16,
    /// Data shards in the block.
    pub k: u16,
    /// Parity shards in the block.
    pub m: u16,
    /// Bytes of payload in the block (the last data shard is zero-padded past it).
    pub block_len: u32,
}

impl ShardHeader {
    /// Whether this is a data shard (as opposed to parity).
    pub fn is_data(&self) -> bool {
        self.index < self.k
    }
}

/// A shard read from the wire, borrowing its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard<'a> {
    /// Its header.
    pub header: ShardHeader,
    /// Its shard bytes (all of them, padding included).
    pub data: &'a [u8],
}

/// The header of a shard carrying `data`, CRC included. Send it followed by `data`.
pub fn encode_header(h: &ShardHeader, data: &[u8]) -> [u8; HEADER_LEN] {
    let mut out = [0u8; HEADER_LEN];
    out[0..8].copy_from_slice(&h.transfer_id.to_le_bytes());
    out[8..12].copy_from_slice(&h.block.to_le_bytes());
    out[12..14].copy_from_slice(&h.index.to_le_bytes());
    out[14..16].copy_from_slice(&h.k.to_le_bytes());
    out[16..18].copy_from_slice(&h.m.to_le_bytes());
    out[18..22].copy_from_slice(&h.block_len.to_le_bytes());
    let crc = crc32c::crc32c_append(crc32c::crc32c(&out[..CRC_AT]), data);
    out[CRC_AT..].copy_from_slice(&crc.to_le_bytes());
    out
}

/// Appends header and `data` to `out` (one datagram's worth).
pub fn encode_into(h: &ShardHeader, data: &[u8], out: &mut Vec<u8>) {
    out.reserve(HEADER_LEN + data.len());
    out.extend_from_slice(&encode_header(h, data));
    out.extend_from_slice(data);
}

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Parses one datagram into a shard. Never panics; fails with `Error::Protocol` if the bytes
/// are too short, the CRC does not match, or the header contradicts itself (index out of
/// range, odd or empty shard, block longer than its data shards).
pub fn decode(bytes: &[u8]) -> Result<Shard<'_>> {
    if bytes.len() < HEADER_LEN {
        return Err(Error::Protocol(format!(
            "shard of {} bytes is shorter than its {HEADER_LEN}-byte header",
            bytes.len()
        )));
    }
    let (head, data) = bytes.split_at(HEADER_LEN);
    let want = le32(head, CRC_AT);
    let got = crc32c::crc32c_append(crc32c::crc32c(&head[..CRC_AT]), data);
    if want != got {
        return Err(Error::Protocol(format!(
            "shard CRC32C mismatch (carried {want:#010x}, computed {got:#010x})"
        )));
    }
    let mut tid = [0u8; 8];
    tid.copy_from_slice(&head[0..8]);
    let h = ShardHeader {
        transfer_id: u64::from_le_bytes(tid),
        block: le32(head, 8),
        index: le16(head, 12),
        k: le16(head, 14),
        m: le16(head, 16),
        block_len: le32(head, 18),
    };
    if h.k == 0 {
        return Err(Error::Protocol("shard header says k = 0".into()));
    }
    if u32::from(h.index) >= u32::from(h.k) + u32::from(h.m) {
        return Err(Error::Protocol(format!(
            "shard index {} out of range for k = {}, m = {}",
            h.index, h.k, h.m
        )));
    }
    if data.is_empty() || data.len() % 2 != 0 {
        return Err(Error::Protocol(format!(
            "shard of {} data bytes (must be even and non-zero)",
            data.len()
        )));
    }
    if u64::from(h.block_len) > u64::from(h.k) * data.len() as u64 {
        return Err(Error::Protocol(format!(
            "block of {} bytes does not fit {} shards of {} bytes",
            h.block_len,
            h.k,
            data.len()
        )));
    }
    Ok(Shard { header: h, data })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn sample() -> (ShardHeader, Vec<u8>) {
        let h = ShardHeader {
            transfer_id: 0x0102_0304_0506_0708,
            block: 7,
            index: 33,
            k: 32,
            m: 8,
            block_len: 32 * 64 - 5,
        };
        (h, (0..64u8).collect())
    }

    #[test]
    fn round_trip() {
        let (h, data) = sample();
        let mut wire = Vec::new();
        encode_into(&h, &data, &mut wire);
        assert_eq!(wire.len(), HEADER_LEN + data.len());
        let s = decode(&wire).expect("valid shard");
        assert_eq!(s.header, h);
        assert_eq!(s.data, &data[..]);
        assert!(!s.header.is_data());
    }

    #[test]
    fn every_single_bit_flip_is_caught() {
        let (h, data) = sample();
        let mut wire = Vec::new();
        encode_into(&h, &data, &mut wire);
        for bit in 0..wire.len() * 8 {
            let mut w = wire.clone();
            w[bit / 8] ^= 1 << (bit % 8);
            assert!(decode(&w).is_err(), "bit {bit} flip went unnoticed");
        }
    }

    #[test]
    fn inconsistent_headers_are_refused() {
        let (h, data) = sample();
        let bad = [
            ShardHeader { k: 0, ..h },
            ShardHeader { index: 40, ..h },
            ShardHeader {
                block_len: 32 * 64 + 1,
                ..h
            },
        ];
        for b in bad {
            let mut wire = Vec::new();
            encode_into(&b, &data, &mut wire);
            assert!(decode(&wire).is_err(), "{b:?} accepted");
        }
        let mut odd = Vec::new();
        encode_into(&h, &data[..63], &mut odd);
        assert!(decode(&odd).is_err());
        let mut empty = Vec::new();
        encode_into(&ShardHeader { block_len: 0, ..h }, &[], &mut empty);
        assert!(decode(&empty).is_err());
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for len in 0..200usize {
            for _ in 0..20 {
                let v: Vec<u8> = (0..len).map(|_| rng.random()).collect();
                let _ = decode(&v);
            }
        }
    }
}
