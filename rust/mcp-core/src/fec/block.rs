//! One Reed-Solomon block: `k` data shards cut from up to `k × shard_bytes` payload bytes
//! (zero-padded), and `m` parity shards. Any `k` distinct shards rebuild the block.

use crate::error::{Error, Result};
use reed_solomon_simd::{ReedSolomonDecoder, ReedSolomonEncoder};

/// Largest number of data or parity shards per block that we accept (the wire allows 65535;
/// Reed-Solomon decoding time grows with it, and nobody needs more per datagram-sized block).
pub const MAX_SHARDS: usize = 4096;

/// Checks a block shape: `1 ≤ k ≤ MAX_SHARDS`, `m ≤ MAX_SHARDS`, `shard_bytes` even and
/// non-zero, `k × shard_bytes` within a u32, and the pair supported by the RS library.
pub fn check_shape(k: usize, m: usize, shard_bytes: usize) -> Result<()> {
    if k == 0 || k > MAX_SHARDS || m > MAX_SHARDS {
        return Err(Error::InvalidArgument(format!(
            "block of k = {k} data and m = {m} parity shards (need 1 ≤ k ≤ {MAX_SHARDS}, m ≤ {MAX_SHARDS})"
        )));
    }
    if shard_bytes == 0 || !shard_bytes.is_multiple_of(2) {
        return Err(Error::InvalidArgument(format!(
            "shard size {shard_bytes} must be even and non-zero"
        )));
    }
    if (k as u64) * (shard_bytes as u64) > u64::from(u32::MAX) {
        return Err(Error::InvalidArgument(format!(
            "block of {k} × {shard_bytes} bytes exceeds 4 GiB"
        )));
    }
    if m > 0 && !ReedSolomonEncoder::supports(k, m) {
        return Err(Error::InvalidArgument(format!(
            "Reed-Solomon does not support k = {k}, m = {m}"
        )));
    }
    Ok(())
}

fn rs_err(e: reed_solomon_simd::Error) -> Error {
    Error::InvalidArgument(format!("Reed-Solomon: {e}"))
}

/// Makes the `k + m` shards of a block. Reuse one encoder for many blocks: `encode` keeps its
/// buffers, and `reset` keeps them when the shape changes.
pub struct BlockEncoder {
    k: usize,
    m: usize,
    shard_bytes: usize,
    rs: Option<ReedSolomonEncoder>,
    rs_shape: (usize, usize, usize),
    data: Vec<u8>,
    parity: Vec<u8>,
    block_len: usize,
}

impl std::fmt::Debug for BlockEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockEncoder")
            .field("k", &self.k)
            .field("m", &self.m)
            .field("shard_bytes", &self.shard_bytes)
            .field("block_len", &self.block_len)
            .finish_non_exhaustive()
    }
}

impl BlockEncoder {
    /// An encoder for blocks of `k` data and `m` parity shards of `shard_bytes` each.
    pub fn new(k: usize, m: usize, shard_bytes: usize) -> Result<BlockEncoder> {
        let mut e = BlockEncoder {
            k: 0,
            m: 0,
            shard_bytes: 0,
            rs: None,
            rs_shape: (0, 0, 0),
            data: Vec::new(),
            parity: Vec::new(),
            block_len: 0,
        };
        e.reset(k, m, shard_bytes)?;
        Ok(e)
    }

    /// Changes the shape, keeping the allocations; forgets the current block.
    pub fn reset(&mut self, k: usize, m: usize, shard_bytes: usize) -> Result<()> {
        check_shape(k, m, shard_bytes)?;
        self.k = k;
        self.m = m;
        self.shard_bytes = shard_bytes;
        self.data.resize(k * shard_bytes, 0);
        self.parity.resize(m * shard_bytes, 0);
        self.block_len = 0;
        Ok(())
    }

    /// Data shards per block.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Parity shards per block.
    pub fn m(&self) -> usize {
        self.m
    }

    /// Bytes per shard.
    pub fn shard_bytes(&self) -> usize {
        self.shard_bytes
    }

    /// Payload bytes of the block last encoded.
    pub fn block_len(&self) -> usize {
        self.block_len
    }

    /// Encodes `block` (at most `k × shard_bytes` bytes; shorter is zero-padded): afterwards
    /// `shard(i)` gives every shard.
    pub fn encode(&mut self, block: &[u8]) -> Result<()> {
        let cap = self.k * self.shard_bytes;
        if block.len() > cap {
            return Err(Error::InvalidArgument(format!(
                "block of {} bytes exceeds {} × {} bytes",
                block.len(),
                self.k,
                self.shard_bytes
            )));
        }
        self.data[..block.len()].copy_from_slice(block);
        self.data[block.len()..].fill(0);
        self.block_len = block.len();
        if self.m == 0 {
            return Ok(());
        }
        let shape = (self.k, self.m, self.shard_bytes);
        let rs = match &mut self.rs {
            Some(rs) => {
                if self.rs_shape != shape {
                    rs.reset(shape.0, shape.1, shape.2).map_err(rs_err)?;
                }
                rs
            }
            None => self
                .rs
                .insert(ReedSolomonEncoder::new(shape.0, shape.1, shape.2).map_err(rs_err)?),
        };
        self.rs_shape = shape;
        for chunk in self.data.chunks_exact(self.shard_bytes) {
            rs.add_original_shard(chunk).map_err(rs_err)?;
        }
        let out = rs.encode().map_err(rs_err)?;
        for (dst, src) in self
            .parity
            .chunks_exact_mut(self.shard_bytes)
            .zip(out.recovery_iter())
        {
            dst.copy_from_slice(src);
        }
        Ok(())
    }

    /// Shard `i` of the block last encoded: `0..k` data, `k..k+m` parity.
    pub fn shard(&self, i: usize) -> Option<&[u8]> {
        let sb = self.shard_bytes;
        if i < self.k {
            self.data.get(i * sb..(i + 1) * sb)
        } else {
            let j = i - self.k;
            self.parity.get(j * sb..(j + 1) * sb)
        }
    }
}

/// What adding a shard to a [`BlockDecoder`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Added {
    /// A shard we did not have.
    New,
    /// We already had this shard (or the block is already rebuilt).
    Duplicate,
}

/// Collects the shards of one block in any order and rebuilds it once any `k` distinct ones
/// are in. Reuse it for many blocks with `reset`.
pub struct BlockDecoder {
    k: usize,
    m: usize,
    shard_bytes: usize,
    block_len: usize,
    rs: Option<ReedSolomonDecoder>,
    rs_shape: (usize, usize, usize),
    data: Vec<u8>,
    parity: Vec<u8>,
    have: Vec<bool>,
    n_data: usize,
    n_parity: usize,
    rebuilt: bool,
    used_rs: bool,
}

impl std::fmt::Debug for BlockDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockDecoder")
            .field("k", &self.k)
            .field("m", &self.m)
            .field("shard_bytes", &self.shard_bytes)
            .field("n_data", &self.n_data)
            .field("n_parity", &self.n_parity)
            .field("rebuilt", &self.rebuilt)
            .finish_non_exhaustive()
    }
}

impl BlockDecoder {
    /// A decoder for one block of `k` + `m` shards of `shard_bytes`, holding `block_len`
    /// payload bytes.
    pub fn new(k: usize, m: usize, shard_bytes: usize, block_len: usize) -> Result<BlockDecoder> {
        let mut d = BlockDecoder {
            k: 0,
            m: 0,
            shard_bytes: 0,
            block_len: 0,
            rs: None,
            rs_shape: (0, 0, 0),
            data: Vec::new(),
            parity: Vec::new(),
            have: Vec::new(),
            n_data: 0,
            n_parity: 0,
            rebuilt: false,
            used_rs: false,
        };
        d.reset(k, m, shard_bytes, block_len)?;
        Ok(d)
    }

    /// Starts over on a new block, keeping the allocations.
    pub fn reset(
        &mut self,
        k: usize,
        m: usize,
        shard_bytes: usize,
        block_len: usize,
    ) -> Result<()> {
        check_shape(k, m, shard_bytes)?;
        if block_len > k * shard_bytes {
            return Err(Error::InvalidArgument(format!(
                "block of {block_len} bytes exceeds {k} × {shard_bytes} bytes"
            )));
        }
        self.k = k;
        self.m = m;
        self.shard_bytes = shard_bytes;
        self.block_len = block_len;
        self.data.resize(k * shard_bytes, 0);
        self.parity.resize(m * shard_bytes, 0);
        self.have.clear();
        self.have.resize(k + m, false);
        self.n_data = 0;
        self.n_parity = 0;
        self.rebuilt = false;
        self.used_rs = false;
        Ok(())
    }

    /// Data shards of the block.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Parity shards of the block.
    pub fn m(&self) -> usize {
        self.m
    }

    /// Adds shard `index` (`0..k` data, `k..k+m` parity). Fails if the index is out of range
    /// or the size is not `shard_bytes`; a shard already held is a `Duplicate`.
    pub fn add(&mut self, index: usize, shard: &[u8]) -> Result<Added> {
        if index >= self.k + self.m {
            return Err(Error::Protocol(format!(
                "shard index {index} out of range for k = {}, m = {}",
                self.k, self.m
            )));
        }
        if shard.len() != self.shard_bytes {
            return Err(Error::Protocol(format!(
                "shard of {} bytes in a block of {}-byte shards",
                shard.len(),
                self.shard_bytes
            )));
        }
        if self.rebuilt || self.have[index] {
            return Ok(Added::Duplicate);
        }
        let sb = self.shard_bytes;
        if index < self.k {
            self.data[index * sb..(index + 1) * sb].copy_from_slice(shard);
            self.n_data += 1;
        } else {
            let j = index - self.k;
            self.parity[j * sb..(j + 1) * sb].copy_from_slice(shard);
            self.n_parity += 1;
        }
        self.have[index] = true;
        Ok(Added::New)
    }

    /// Whether enough distinct shards are in to rebuild the block.
    pub fn ready(&self) -> bool {
        self.rebuilt || self.n_data + self.n_parity >= self.k
    }

    /// How many more distinct shards the block needs.
    pub fn needed(&self) -> usize {
        if self.rebuilt {
            0
        } else {
            self.k.saturating_sub(self.n_data + self.n_parity)
        }
    }

    /// Indices of the data shards not received (empty once rebuilt).
    pub fn missing_data(&self) -> Vec<u16> {
        if self.rebuilt {
            return Vec::new();
        }
        (0..self.k)
            .filter(|&i| !self.have[i])
            .map(|i| i as u16)
            .collect()
    }

    /// Indices of the parity shards not received.
    pub fn missing_parity(&self) -> Vec<u16> {
        (self.k..self.k + self.m)
            .filter(|&i| !self.have[i])
            .map(|i| i as u16)
            .collect()
    }

    /// Whether rebuilding needed Reed-Solomon (false when every data shard arrived).
    pub fn used_rs(&self) -> bool {
        self.used_rs
    }

    /// Rebuilds the block and returns its `block_len` payload bytes. Skips Reed-Solomon when
    /// every data shard arrived. Fails while fewer than `k` distinct shards are in.
    pub fn reconstruct(&mut self) -> Result<&[u8]> {
        if !self.rebuilt {
            if !self.ready() {
                return Err(Error::Protocol(format!(
                    "block needs {} more shards",
                    self.needed()
                )));
            }
            if self.n_data < self.k {
                self.rs_decode()?;
                self.used_rs = true;
            }
            self.rebuilt = true;
        }
        Ok(&self.data[..self.block_len])
    }

    fn rs_decode(&mut self) -> Result<()> {
        let (k, m, sb) = (self.k, self.m, self.shard_bytes);
        let shape = (k, m, sb);
        let rs = match &mut self.rs {
            Some(rs) => {
                if self.rs_shape != shape {
                    rs.reset(k, m, sb).map_err(rs_err)?;
                }
                rs
            }
            None => self
                .rs
                .insert(ReedSolomonDecoder::new(k, m, sb).map_err(rs_err)?),
        };
        self.rs_shape = shape;
        for i in (0..k).filter(|&i| self.have[i]) {
            rs.add_original_shard(i, &self.data[i * sb..(i + 1) * sb])
                .map_err(rs_err)?;
        }
        // Exactly as many parity shards as data shards are missing: more would only be copied.
        let want = k - self.n_data;
        for j in (0..m).filter(|&j| self.have[k + j]).take(want) {
            rs.add_recovery_shard(j, &self.parity[j * sb..(j + 1) * sb])
                .map_err(rs_err)?;
        }
        let out = rs.decode().map_err(rs_err)?;
        for (i, shard) in out.restored_original_iter() {
            if let Some(dst) = self.data.get_mut(i * sb..(i + 1) * sb) {
                dst.copy_from_slice(shard);
            }
        }
        drop(out);
        for h in &mut self.have[..k] {
            *h = true;
        }
        self.n_data = k;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};

    const SHAPES: [(usize, usize); 4] = [(32, 8), (32, 16), (64, 32), (16, 8)];

    fn payload(rng: &mut impl Rng, n: usize) -> Vec<u8> {
        (0..n).map(|_| rng.random()).collect()
    }

    #[test]
    fn round_trips_with_random_erasures_up_to_m() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let sb = 128;
        let mut enc = BlockEncoder::new(1, 0, 2).expect("encoder");
        let mut dec = BlockDecoder::new(1, 0, 2, 0).expect("decoder");
        for (k, m) in SHAPES {
            enc.reset(k, m, sb).expect("reset");
            for trial in 0..20 {
                let len = if trial == 0 {
                    k * sb
                } else {
                    rng.random_range(1..=k * sb)
                };
                let block = payload(&mut rng, len);
                enc.encode(&block).expect("encode");
                let lost = rng.random_range(0..=m);
                let mut order: Vec<usize> = (0..k + m).collect();
                order.shuffle(&mut rng);
                dec.reset(k, m, sb, len).expect("reset");
                for &i in &order[lost..] {
                    let s = enc.shard(i).expect("shard");
                    assert_eq!(dec.add(i, s).expect("add"), Added::New);
                }
                assert!(dec.ready());
                assert_eq!(
                    dec.reconstruct().expect("rebuild"),
                    &block[..],
                    "k={k} m={m}"
                );
                let data_lost = order[..lost].iter().any(|&i| i < k);
                assert_eq!(dec.used_rs(), data_lost);
            }
        }
    }

    #[test]
    fn one_short_of_k_is_not_ready() {
        let (k, m, sb) = (16, 8, 64);
        let mut enc = BlockEncoder::new(k, m, sb).expect("encoder");
        enc.encode(&[7u8; 1000]).expect("encode");
        let mut dec = BlockDecoder::new(k, m, sb, 1000).expect("decoder");
        for i in m + 1..k + m {
            dec.add(i, enc.shard(i).expect("shard")).expect("add");
        }
        assert!(!dec.ready());
        assert_eq!(dec.needed(), 1);
        assert_eq!(dec.missing_data().len(), m + 1);
        assert!(dec.reconstruct().is_err());
        dec.add(0, enc.shard(0).expect("shard")).expect("add");
        assert_eq!(dec.reconstruct().expect("rebuild"), &[7u8; 1000][..]);
    }

    #[test]
    fn duplicates_and_bad_shards() {
        let (k, m, sb) = (32, 8, 64);
        let mut enc = BlockEncoder::new(k, m, sb).expect("encoder");
        let block: Vec<u8> = (0..k * sb).map(|i| (i * 31 % 251) as u8).collect();
        enc.encode(&block).expect("encode");
        let mut dec = BlockDecoder::new(k, m, sb, block.len()).expect("decoder");
        // Parity first, each twice, then the data shards from the top down, each twice.
        for i in (0..k + m).rev() {
            if dec.ready() {
                break;
            }
            let s = enc.shard(i).expect("shard");
            assert_eq!(dec.add(i, s).expect("add"), Added::New);
            assert_eq!(dec.add(i, s).expect("add"), Added::Duplicate);
        }
        assert!(dec.add(k + m, enc.shard(0).expect("shard")).is_err());
        assert!(dec.add(0, &[0u8; 62]).is_err());
        assert_eq!(dec.reconstruct().expect("rebuild"), &block[..]);
        assert!(dec.used_rs());
        assert!(dec.missing_data().is_empty());
    }

    #[test]
    fn no_parity_and_bad_shapes() {
        let mut enc = BlockEncoder::new(4, 0, 8).expect("encoder");
        enc.encode(b"hello").expect("encode");
        let mut dec = BlockDecoder::new(4, 0, 8, 5).expect("decoder");
        for i in 0..4 {
            dec.add(i, enc.shard(i).expect("shard")).expect("add");
        }
        assert_eq!(dec.reconstruct().expect("rebuild"), b"hello");
        assert!(enc.encode(&[0u8; 33]).is_err());
        assert!(BlockEncoder::new(0, 4, 8).is_err());
        assert!(BlockEncoder::new(4, 4, 7).is_err());
        assert!(BlockEncoder::new(4, 4, 0).is_err());
        assert!(BlockEncoder::new(MAX_SHARDS + 1, 4, 8).is_err());
        assert!(BlockDecoder::new(4, 4, 8, 33).is_err());
    }
}
