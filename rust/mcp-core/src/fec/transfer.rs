//! A whole payload as a sequence of FEC blocks, each shard one datagram.
//!
//! Both sides agree on a [`TransferPlan`] first (sent over the reliable stream: see
//! [`TransferPlan::to_bytes`]). The sender emits every block's `k` data and `m` parity shards;
//! the receiver rebuilds each block as soon as any `k` distinct shards are in, writes it into
//! the payload, and afterwards lists the blocks still short as [`Nack`]s, which the sender
//! answers with [`TransferSender::repair`]. `m` may change from block to block (see
//! [`super::adaptive`]); each shard carries its block's `m`.

use super::adaptive::parity_for;
use super::block::{check_shape, Added, BlockDecoder, BlockEncoder, MAX_SHARDS};
use super::shard::{self, ShardHeader, HEADER_LEN};
use crate::error::{Error, Result};
use bytes::Bytes;
use std::collections::HashMap;

/// What both sides of a transfer agree on before the first shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferPlan {
    /// Names the transfer in every shard.
    pub transfer_id: u64,
    /// Payload bytes.
    pub total_len: u64,
    /// Data shards per block (the last block may have fewer).
    pub k: u16,
    /// Bytes per shard (even).
    pub shard_bytes: u32,
}

/// Bytes of [`TransferPlan::to_bytes`].
pub const PLAN_LEN: usize = 22;

impl TransferPlan {
    /// The largest shard size, a multiple of 64 where possible, such that header plus shard
    /// fit in `max_datagram` bytes (e.g. `Connection::max_datagram_size()`).
    pub fn shard_bytes_for(max_datagram: usize) -> Result<usize> {
        let room = max_datagram.saturating_sub(HEADER_LEN);
        let sb = if room >= 64 {
            room / 64 * 64
        } else {
            room / 2 * 2
        };
        if sb == 0 {
            return Err(Error::InvalidArgument(format!(
                "datagrams of {max_datagram} bytes leave no room for a shard"
            )));
        }
        Ok(sb)
    }

    /// A plan for `total_len` bytes in blocks of `k` data shards, each shard sized to fit a
    /// datagram of `max_datagram` bytes.
    pub fn new(
        transfer_id: u64,
        total_len: u64,
        k: u16,
        max_datagram: usize,
    ) -> Result<TransferPlan> {
        let sb = Self::shard_bytes_for(max_datagram)?;
        let plan = TransferPlan {
            transfer_id,
            total_len,
            k,
            shard_bytes: u32::try_from(sb).map_err(|_| {
                Error::InvalidArgument(format!("shard size {sb} does not fit in 32 bits"))
            })?,
        };
        plan.validate()?;
        Ok(plan)
    }

    /// Checks the plan (useful on one received from a peer).
    pub fn validate(&self) -> Result<()> {
        check_shape(usize::from(self.k), 0, self.shard_bytes as usize)?;
        let blocks = self.total_len.div_ceil(self.block_bytes());
        if blocks > u64::from(u32::MAX) || usize::try_from(self.total_len).is_err() {
            return Err(Error::InvalidArgument(format!(
                "a transfer of {} bytes in blocks of {} bytes is too large",
                self.total_len,
                self.block_bytes()
            )));
        }
        Ok(())
    }

    /// Payload bytes per full block.
    pub fn block_bytes(&self) -> u64 {
        u64::from(self.k) * u64::from(self.shard_bytes)
    }

    /// Number of blocks.
    pub fn n_blocks(&self) -> u32 {
        u32::try_from(self.total_len.div_ceil(self.block_bytes().max(1))).unwrap_or(u32::MAX)
    }

    /// Where block `b` lies in the payload: (offset, length, data shards).
    pub fn block_span(&self, b: u32) -> Option<(usize, usize, usize)> {
        if b >= self.n_blocks() {
            return None;
        }
        let start = u64::from(b) * self.block_bytes();
        let len = (self.total_len - start).min(self.block_bytes());
        let sb = u64::from(self.shard_bytes);
        let k = len.div_ceil(sb);
        Some((
            usize::try_from(start).ok()?,
            usize::try_from(len).ok()?,
            usize::try_from(k).ok()?,
        ))
    }

    /// The plan as 22 little-endian bytes (id, total length, k, shard size).
    pub fn to_bytes(&self) -> [u8; PLAN_LEN] {
        let mut out = [0u8; PLAN_LEN];
        out[0..8].copy_from_slice(&self.transfer_id.to_le_bytes());
        out[8..16].copy_from_slice(&self.total_len.to_le_bytes());
        out[16..18].copy_from_slice(&self.k.to_le_bytes());
        out[18..22].copy_from_slice(&self.shard_bytes.to_le_bytes());
        out
    }

    /// Reads and validates a plan written by [`TransferPlan::to_bytes`].
    pub fn from_bytes(b: &[u8]) -> Result<TransferPlan> {
        let b: &[u8; PLAN_LEN] = b.try_into().map_err(|_| {
            Error::Protocol(format!(
                "transfer plan of {} bytes (want {PLAN_LEN})",
                b.len()
            ))
        })?;
        let mut u64b = [0u8; 8];
        u64b.copy_from_slice(&b[0..8]);
        let transfer_id = u64::from_le_bytes(u64b);
        u64b.copy_from_slice(&b[8..16]);
        let plan = TransferPlan {
            transfer_id,
            total_len: u64::from_le_bytes(u64b),
            k: u16::from_le_bytes([b[16], b[17]]),
            shard_bytes: u32::from_le_bytes([b[18], b[19], b[20], b[21]]),
        };
        plan.validate()
            .map_err(|e| Error::Protocol(format!("bad transfer plan: {e}")))?;
        Ok(plan)
    }
}

/// Cuts a payload into blocks and emits their shards as datagrams.
#[derive(Debug)]
pub struct TransferSender {
    plan: TransferPlan,
    payload: Bytes,
    enc: BlockEncoder,
    next: u32,
    m: u16,
    block_m: Vec<u16>,
    sent: u64,
}

impl TransferSender {
    /// The payload being sent (to carry it another way when the repairs cannot).
    pub fn payload(&self) -> &Bytes {
        &self.payload
    }

    /// A sender of `payload` (exactly `plan.total_len` bytes) with `m` parity shards per block
    /// until [`set_parity`](Self::set_parity) changes it.
    pub fn new(plan: TransferPlan, payload: Bytes, m: u16) -> Result<TransferSender> {
        plan.validate()?;
        if payload.len() as u64 != plan.total_len {
            return Err(Error::InvalidArgument(format!(
                "payload of {} bytes for a plan of {}",
                payload.len(),
                plan.total_len
            )));
        }
        check_shape(
            usize::from(plan.k),
            usize::from(m),
            plan.shard_bytes as usize,
        )?;
        let enc = BlockEncoder::new(
            usize::from(plan.k),
            usize::from(m),
            plan.shard_bytes as usize,
        )?;
        Ok(TransferSender {
            plan,
            payload,
            enc,
            next: 0,
            m,
            block_m: Vec::new(),
            sent: 0,
        })
    }

    /// The plan.
    pub fn plan(&self) -> &TransferPlan {
        &self.plan
    }

    /// Sets the parity shards of the blocks not yet emitted.
    pub fn set_parity(&mut self, m: u16) -> Result<()> {
        check_shape(
            usize::from(self.plan.k),
            usize::from(m),
            self.plan.shard_bytes as usize,
        )?;
        self.m = m;
        Ok(())
    }

    /// Parity shards per block from now on.
    pub fn parity(&self) -> u16 {
        self.m
    }

    /// Shards emitted so far (first sends and repairs), for the loss estimate.
    pub fn shards_sent(&self) -> u64 {
        self.sent
    }

    /// Whether every block has been emitted once.
    pub fn is_exhausted(&self) -> bool {
        self.next >= self.plan.n_blocks()
    }

    /// Encodes block `b` with `m` parity shards; returns its data shard count.
    fn encode_block(&mut self, b: u32, m: usize) -> Result<usize> {
        let (start, len, k) = self
            .plan
            .block_span(b)
            .ok_or_else(|| Error::InvalidArgument(format!("no block {b} in this transfer")))?;
        let sb = self.plan.shard_bytes as usize;
        if self.enc.k() != k || self.enc.m() != m {
            self.enc.reset(k, m, sb)?;
        }
        let block = self
            .payload
            .get(start..start + len)
            .ok_or_else(|| Error::InvalidArgument(format!("block {b} lies outside the payload")))?;
        self.enc.encode(block)?;
        Ok(k)
    }

    fn datagram(&self, b: u32, i: usize) -> Result<Bytes> {
        let data = self
            .enc
            .shard(i)
            .ok_or_else(|| Error::InvalidArgument(format!("no shard {i} in block {b}")))?;
        let h = ShardHeader {
            transfer_id: self.plan.transfer_id,
            block: b,
            index: i as u16,
            k: self.enc.k() as u16,
            m: self.enc.m() as u16,
            block_len: self.enc.block_len() as u32,
        };
        let mut out = Vec::with_capacity(HEADER_LEN + data.len());
        shard::encode_into(&h, data, &mut out);
        Ok(Bytes::from(out))
    }

    /// The next block's number and shards (data first, then parity), or `None` once every
    /// block was emitted.
    pub fn next_block(&mut self) -> Result<Option<(u32, Vec<Bytes>)>> {
        if self.is_exhausted() {
            return Ok(None);
        }
        let b = self.next;
        let m = usize::from(self.m);
        let k = self.encode_block(b, m)?;
        let shards = (0..k + m)
            .map(|i| self.datagram(b, i))
            .collect::<Result<Vec<_>>>()?;
        self.block_m.push(self.m);
        self.next += 1;
        self.sent += shards.len() as u64;
        Ok(Some((b, shards)))
    }

    /// The shards a [`Nack`] asks for: block `nack.block` re-encoded with the parity count
    /// it was first sent with, the shards `nack.missing` names (data or parity), then up to
    /// `nack.more_parity` parity shards not named. Fails with `Error::Protocol` on a block not
    /// yet sent or an index out of range (the request comes from the peer).
    pub fn repair(&mut self, nack: &Nack) -> Result<Vec<Bytes>> {
        let block = nack.block;
        let m = *self.block_m.get(block as usize).ok_or_else(|| {
            Error::Protocol(format!("repair asked for block {block}, not sent yet"))
        })?;
        let (_, _, k) = self
            .plan
            .block_span(block)
            .ok_or_else(|| Error::Protocol(format!("repair asked for unknown block {block}")))?;
        let n = k + usize::from(m);
        if nack.missing.len() > n {
            return Err(Error::Protocol(format!(
                "repair asked for {} shards of a block of {n}",
                nack.missing.len()
            )));
        }
        let mut wanted = vec![false; n];
        for &i in &nack.missing {
            let slot = wanted.get_mut(usize::from(i)).ok_or_else(|| {
                Error::Protocol(format!(
                    "repair asked for shard {i} of block {block} (k = {k}, m = {m})"
                ))
            })?;
            *slot = true;
        }
        let mut indices: Vec<usize> = nack.missing.iter().map(|&i| usize::from(i)).collect();
        indices.extend(
            (k..n)
                .filter(|&i| !wanted[i])
                .take(usize::from(nack.more_parity)),
        );
        self.encode_block(block, usize::from(m))?;
        let shards = indices
            .into_iter()
            .map(|i| self.datagram(block, i))
            .collect::<Result<Vec<_>>>()?;
        self.sent += shards.len() as u64;
        Ok(shards)
    }
}

/// A request to resend some shards of one block (sent back over the reliable stream).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nack {
    /// The block.
    pub block: u32,
    /// The shards wanted: missing data shards first, then missing parity shards.
    pub missing: Vec<u16>,
    /// And this many parity shards besides, whichever (for a block of which nothing arrived,
    /// whose `m` the receiver does not know).
    pub more_parity: u16,
}

impl Nack {
    /// Appends the request as little-endian bytes: block (u32), more_parity (u16), count
    /// (u16), then `count` shard indices (u16 each).
    pub fn encode_into(&self, out: &mut Vec<u8>) -> Result<()> {
        let count = u16::try_from(self.missing.len()).map_err(|_| {
            Error::InvalidArgument(format!("NACK of {} shards", self.missing.len()))
        })?;
        out.extend_from_slice(&self.block.to_le_bytes());
        out.extend_from_slice(&self.more_parity.to_le_bytes());
        out.extend_from_slice(&count.to_le_bytes());
        for i in &self.missing {
            out.extend_from_slice(&i.to_le_bytes());
        }
        Ok(())
    }

    /// Reads one request from the front of `b`; returns it and the bytes it took.
    pub fn decode(b: &[u8]) -> Result<(Nack, usize)> {
        let short = || Error::Protocol(format!("NACK truncated at {} bytes", b.len()));
        let head = b.get(..8).ok_or_else(short)?;
        let block = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
        let more_parity = u16::from_le_bytes([head[4], head[5]]);
        let count = usize::from(u16::from_le_bytes([head[6], head[7]]));
        let end = 8 + 2 * count;
        let body = b.get(8..end).ok_or_else(short)?;
        let missing = body
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        Ok((
            Nack {
                block,
                missing,
                more_parity,
            },
            end,
        ))
    }
}

/// What one datagram did at the receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Received {
    /// A new shard; its block is not complete yet.
    Accepted,
    /// The shard completed block `.0`.
    BlockDone(u32),
    /// A shard already held, or of a block already rebuilt.
    Redundant,
    /// Failed its CRC or could not be parsed: an erasure.
    Corrupt,
}

/// Counters of a [`TransferReceiver`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReceiverStats {
    /// Shards that passed their CRC (new or not).
    pub valid: u64,
    /// Datagrams that failed the CRC or were malformed.
    pub corrupt: u64,
    /// Valid shards not needed (duplicates, late shards).
    pub redundant: u64,
    /// Blocks rebuilt with Reed-Solomon.
    pub decoded: u64,
    /// Blocks complete from their data shards alone.
    pub direct: u64,
}

/// Rebuilds a payload from the shards of a [`TransferPlan`].
#[derive(Debug)]
pub struct TransferReceiver {
    plan: TransferPlan,
    out: Vec<u8>,
    done: Vec<bool>,
    n_done: u32,
    active: HashMap<u32, BlockDecoder>,
    pool: Vec<BlockDecoder>,
    stats: ReceiverStats,
}

impl TransferReceiver {
    /// A receiver for `plan`; allocates the payload (`plan.total_len` bytes) at once.
    pub fn new(plan: TransferPlan) -> Result<TransferReceiver> {
        plan.validate()?;
        let n = plan.n_blocks() as usize;
        Ok(TransferReceiver {
            plan,
            out: vec![0u8; plan.total_len as usize],
            done: vec![false; n],
            n_done: 0,
            active: HashMap::new(),
            pool: Vec::new(),
            stats: ReceiverStats::default(),
        })
    }

    /// The plan.
    pub fn plan(&self) -> &TransferPlan {
        &self.plan
    }

    /// Counters so far.
    pub fn stats(&self) -> ReceiverStats {
        self.stats
    }

    /// Whether every block is rebuilt.
    pub fn is_complete(&self) -> bool {
        self.n_done == self.plan.n_blocks()
    }

    /// Takes one datagram. A corrupt one is counted and reported as `Corrupt` (an erasure);
    /// a valid shard that contradicts the plan (other transfer, wrong k or block length,
    /// another m than earlier shards of its block) is an `Error::Protocol`.
    pub fn receive(&mut self, datagram: &[u8]) -> Result<Received> {
        let s = match shard::decode(datagram) {
            Ok(s) => s,
            Err(_) => {
                self.stats.corrupt += 1;
                return Ok(Received::Corrupt);
            }
        };
        let h = s.header;
        if h.transfer_id != self.plan.transfer_id {
            return Err(Error::Protocol(format!(
                "shard of transfer {} reached transfer {}",
                h.transfer_id, self.plan.transfer_id
            )));
        }
        let (start, len, k) = self.plan.block_span(h.block).ok_or_else(|| {
            Error::Protocol(format!(
                "shard of block {} in a transfer of {} blocks",
                h.block,
                self.plan.n_blocks()
            ))
        })?;
        if usize::from(h.k) != k
            || h.block_len as usize != len
            || s.data.len() != self.plan.shard_bytes as usize
            || usize::from(h.m) > MAX_SHARDS
        {
            return Err(Error::Protocol(format!(
                "shard header {h:?} with {} bytes contradicts the plan {:?}",
                s.data.len(),
                self.plan
            )));
        }
        self.stats.valid += 1;
        let b = h.block as usize;
        if self.done.get(b).copied().unwrap_or(true) {
            self.stats.redundant += 1;
            return Ok(Received::Redundant);
        }
        let sb = self.plan.shard_bytes as usize;
        let dec = match self.active.entry(h.block) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let d = match self.pool.pop() {
                    Some(mut d) => {
                        d.reset(k, usize::from(h.m), sb, len)?;
                        d
                    }
                    None => BlockDecoder::new(k, usize::from(h.m), sb, len)?,
                };
                e.insert(d)
            }
        };
        if dec.m() != usize::from(h.m) {
            return Err(Error::Protocol(format!(
                "block {} announced m = {} earlier and m = {} now",
                h.block,
                dec.m(),
                h.m
            )));
        }
        if dec.add(usize::from(h.index), s.data)? == Added::Duplicate {
            self.stats.redundant += 1;
            return Ok(Received::Redundant);
        }
        if !dec.ready() {
            return Ok(Received::Accepted);
        }
        let bytes = dec.reconstruct()?;
        let dst = self
            .out
            .get_mut(start..start + len)
            .ok_or_else(|| Error::Protocol(format!("block {} outside the payload", h.block)))?;
        dst.copy_from_slice(bytes);
        if dec.used_rs() {
            self.stats.decoded += 1;
        } else {
            self.stats.direct += 1;
        }
        if let Some(d) = self.active.remove(&h.block) {
            self.pool.push(d);
        }
        self.done[b] = true;
        self.n_done += 1;
        Ok(Received::BlockDone(h.block))
    }

    /// Blocks not rebuilt yet, in order.
    pub fn unrecoverable(&self) -> Vec<u32> {
        (0..self.plan.n_blocks())
            .filter(|&b| !self.done[b as usize])
            .collect()
    }

    /// A repair request for every block not rebuilt yet. Call it once the sender's shards
    /// should all have arrived. Each asks for the shards the block still needs plus enough
    /// extra that, with shard loss `loss`, the repair itself fails with probability at most
    /// `target` (see [`parity_for`]): missing data shards first, so that a repaired block
    /// often needs no decoding, then missing parity. A block of which nothing arrived asks
    /// for all its data shards and the extra as `more_parity`.
    pub fn nacks(&self, loss: f64, target: f64) -> Vec<Nack> {
        let mut out = Vec::new();
        for b in self.unrecoverable() {
            let Some((_, _, k)) = self.plan.block_span(b) else {
                continue;
            };
            let nack = match self.active.get(&b) {
                Some(d) => {
                    let needed = d.needed();
                    let want = needed + parity_for(needed, loss, target, 0, MAX_SHARDS);
                    let mut missing = d.missing_data();
                    let spare = want.saturating_sub(missing.len());
                    missing.extend(d.missing_parity().into_iter().take(spare));
                    Nack {
                        block: b,
                        missing,
                        more_parity: 0,
                    }
                }
                None => Nack {
                    block: b,
                    missing: (0..k as u16).collect(),
                    more_parity: parity_for(k, loss, target, 0, MAX_SHARDS) as u16,
                },
            };
            out.push(nack);
        }
        out
    }

    /// The payload, once complete.
    pub fn into_payload(self) -> Result<Vec<u8>> {
        if !self.is_complete() {
            return Err(Error::Protocol(format!(
                "transfer {} incomplete: {} of {} blocks rebuilt",
                self.plan.transfer_id,
                self.n_done,
                self.plan.n_blocks()
            )));
        }
        Ok(self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fec::adaptive::{AdaptiveParity, LossEstimator};
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};

    fn payload(seed: u64, n: usize) -> Vec<u8> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut v = vec![0u8; n];
        rng.fill(&mut v[..]);
        v
    }

    #[test]
    fn plan_shapes() {
        assert_eq!(TransferPlan::shard_bytes_for(1200).expect("sb"), 1152);
        assert_eq!(TransferPlan::shard_bytes_for(1452).expect("sb"), 1408);
        assert_eq!(
            TransferPlan::shard_bytes_for(HEADER_LEN + 10).expect("sb"),
            10
        );
        assert!(TransferPlan::shard_bytes_for(HEADER_LEN + 1).is_err());
        let p = TransferPlan::new(9, 100_000, 32, 1452).expect("plan");
        assert_eq!(p.n_blocks(), 3);
        assert_eq!(p.block_span(2), Some((90112, 9888, 8)));
        assert_eq!(p.block_span(3), None);
        assert_eq!(TransferPlan::from_bytes(&p.to_bytes()).expect("parse"), p);
        assert!(TransferPlan::from_bytes(&p.to_bytes()[..21]).is_err());
        let mut bad = p.to_bytes();
        bad[16] = 0;
        bad[17] = 0;
        assert!(TransferPlan::from_bytes(&bad).is_err());
        let empty = TransferPlan::new(1, 0, 32, 1452).expect("plan");
        assert_eq!(empty.n_blocks(), 0);
        let r = TransferReceiver::new(empty).expect("receiver");
        assert!(r.is_complete());
        assert_eq!(r.into_payload().expect("payload"), Vec::<u8>::new());
    }

    #[test]
    fn shuffled_duplicated_and_corrupted_shards() {
        let data = payload(3, 300_000);
        let plan = TransferPlan::new(5, data.len() as u64, 16, 1452).expect("plan");
        let mut tx = TransferSender::new(plan, Bytes::from(data.clone()), 8).expect("sender");
        let mut all = Vec::new();
        while let Some((_, shards)) = tx.next_block().expect("block") {
            all.extend(shards.into_iter().map(|b| b.to_vec()));
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        // Duplicate a quarter, flip one bit in a tenth (up to the parity count per block is
        // fine: a flipped data shard becomes an erasure that parity covers).
        let dups: Vec<Vec<u8>> = all.iter().step_by(4).cloned().collect();
        all.extend(dups);
        all.shuffle(&mut rng);
        let mut flipped = 0;
        for d in all.iter_mut().step_by(10) {
            let bit = rng.random_range(0..d.len() * 8);
            d[bit / 8] ^= 1 << (bit % 8);
            flipped += 1;
        }
        let mut rx = TransferReceiver::new(plan).expect("receiver");
        for d in &all {
            rx.receive(d).expect("receive");
        }
        let st = rx.stats();
        assert_eq!(st.corrupt, flipped);
        assert!(st.redundant > 0);
        // A block whose data shards were among the flipped ones must have been decoded.
        assert!(st.decoded > 0);
        if !rx.is_complete() {
            // Rare with these seeds, but repair is the answer.
            for n in rx.nacks(0.0, 1e-3) {
                for s in tx.repair(&n).expect("repair") {
                    rx.receive(&s).expect("receive");
                }
            }
        }
        assert_eq!(rx.into_payload().expect("complete"), data);
    }

    #[test]
    fn contradicting_shards_are_errors() {
        let data = payload(6, 10_000);
        let plan = TransferPlan::new(1, data.len() as u64, 4, 1452).expect("plan");
        let other = TransferPlan {
            transfer_id: 2,
            ..plan
        };
        let mut tx = TransferSender::new(other, Bytes::from(data.clone()), 2).expect("sender");
        let (_, shards) = tx.next_block().expect("block").expect("some");
        let mut rx = TransferReceiver::new(plan).expect("receiver");
        assert!(rx.receive(&shards[0]).is_err());
        assert_eq!(
            rx.receive(&shards[0][..10]).expect("short"),
            Received::Corrupt
        );
        let nack = |block, missing: Vec<u16>, more_parity| Nack {
            block,
            missing,
            more_parity,
        };
        assert!(tx.repair(&nack(99, vec![0], 0)).is_err());
        assert!(tx.repair(&nack(0, vec![500], 0)).is_err());
        assert!(tx.repair(&nack(0, vec![0; 7], 0)).is_err());
        // Named shards, then fresh parity; `more_parity` is capped at the block's m.
        let got = tx.repair(&nack(0, vec![1, 4], 5)).expect("repair");
        assert_eq!(got.len(), 3);
        let idx = |d: &Bytes| shard::decode(d).expect("valid").header.index;
        assert_eq!(got.iter().map(idx).collect::<Vec<_>>(), vec![1, 4, 5]);
        let n = nack(3, vec![0, 2, 5], 1);
        let mut wire = Vec::new();
        n.encode_into(&mut wire).expect("encode");
        wire.push(0xff);
        assert_eq!(Nack::decode(&wire).expect("decode"), (n, 14));
        assert!(Nack::decode(&wire[..13]).is_err());
        assert!(Nack::decode(&wire[..7]).is_err());
        assert!(TransferSender::new(plan, Bytes::from(vec![0u8; 5]), 2).is_err());
    }

    /// 10 MiB over a channel that drops 20 % of datagrams at random (and corrupts 1 %),
    /// with the parity count following the measured loss, then NACK repair rounds.
    #[test]
    fn ten_mib_through_twenty_percent_loss() {
        let data = payload(7, 10 << 20);
        let plan = TransferPlan::new(42, data.len() as u64, 32, 1452).expect("plan");
        let mut tx = TransferSender::new(plan, Bytes::from(data.clone()), 4).expect("sender");
        let mut rx = TransferReceiver::new(plan).expect("receiver");
        let mut chan = rand::rngs::StdRng::seed_from_u64(20);
        let mut adapt = AdaptiveParity {
            k: 32,
            target: 1e-3,
            min_m: 2,
            max_m: 64,
            estimator: LossEstimator::new(0.02, 0.3).expect("estimator"),
        };
        let mut deliver = |rx: &mut TransferReceiver, shards: Vec<Bytes>| -> u64 {
            let mut got = 0;
            for mut s in shards.into_iter().map(|b| b.to_vec()) {
                if chan.random_bool(0.2) {
                    continue;
                }
                if chan.random_bool(0.01) {
                    let at = chan.random_range(0..s.len());
                    s[at] ^= 0x10;
                }
                if rx.receive(&s).expect("receive") != Received::Corrupt {
                    got += 1;
                }
            }
            got
        };
        while let Some((_, shards)) = tx.next_block().expect("block") {
            let sent = shards.len() as u64;
            let got = deliver(&mut rx, shards);
            // Stands in for the receiver's feedback over the reliable stream.
            adapt.estimator.observe(got, sent);
            tx.set_parity(adapt.m() as u16).expect("parity");
        }
        let p = adapt.estimator.loss();
        assert!((0.1..0.35).contains(&p), "loss estimate {p}");
        let first_pass = rx.unrecoverable().len();
        let mut rounds = 0;
        while !rx.is_complete() {
            rounds += 1;
            assert!(
                rounds <= 3,
                "still {} blocks short",
                rx.unrecoverable().len()
            );
            for n in rx.nacks(p, 1e-3) {
                let shards = tx.repair(&n).expect("repair");
                deliver(&mut rx, shards);
            }
        }
        let st = rx.stats();
        eprintln!(
            "10 MiB, 20% loss: {} blocks, m settled at {}, {first_pass} short after the first pass, {rounds} repair round(s), {} decoded, {} direct",
            plan.n_blocks(),
            tx.parity(),
            st.decoded,
            st.direct
        );
        assert!(st.decoded > 0);
        assert_eq!(rx.into_payload().expect("complete"), data);
    }
}
