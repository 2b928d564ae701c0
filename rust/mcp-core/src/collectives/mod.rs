//! The collective algorithms, one per file, each a small async function over a [`Transport`].
//!
//! They share [`OpCtx`]: it stamps every frame with the operation's sequence number and
//! Model-Spec, checks the spec of every frame received against ours (a mismatch is an error,
//! not garbage), and bounds every wait by the operation's deadline. Large buffers are cut into
//! chunks (aligned to elements) that are forwarded as soon as each one is ready, so sending,
//! receiving and reducing overlap.

mod allgather_direct;
mod allgather_hierarchical;
mod allgather_ring;
mod allreduce_direct;
mod allreduce_hierarchical;
mod allreduce_recursive_doubling;
mod allreduce_ring;
mod allreduce_tree;
mod barrier;
mod broadcast;
mod broadcast_direct;
mod broadcast_hierarchical;
mod p2p;
mod peer_tensors;
mod reduce_scatter_direct;
mod reduce_scatter_hierarchical;
mod reduce_scatter_ring;
mod ring_parts;

pub use allgather_direct::allgather_direct;
pub use allgather_hierarchical::allgather_hierarchical;
pub use allgather_ring::allgather_ring;
pub use allreduce_direct::allreduce_direct;
pub use allreduce_hierarchical::allreduce_hierarchical;
pub use allreduce_recursive_doubling::allreduce_recursive_doubling;
pub use allreduce_ring::allreduce_ring;
pub use allreduce_tree::allreduce_tree;
pub use barrier::barrier_dissemination;
pub use broadcast::broadcast_binomial;
pub use broadcast_direct::broadcast_direct;
pub use broadcast_hierarchical::broadcast_hierarchical;
pub use p2p::{recv, send};
pub use reduce_scatter_direct::reduce_scatter_direct;
pub use reduce_scatter_hierarchical::reduce_scatter_hierarchical;
pub use reduce_scatter_ring::reduce_scatter_ring;

use crate::codec;
use crate::dtype::ReduceOp;
use crate::error::{Error, Result};
use crate::transport::{MsgKey, Payload, SeqSpace, Transport};
use crate::wire::{Codec, FrameKind, Header, ModelSpec, PROTOCOL_MINOR};
use std::ops::Range;
use tokio::time::Instant;

/// Everything an algorithm needs to talk about one operation.
pub struct OpCtx<'a, T: Transport> {
    /// The transport.
    pub t: &'a T,
    /// Which operation this is.
    pub kind: FrameKind,
    /// Its sequence number (per group in call order; per pair for send/recv).
    pub seq: u64,
    /// The tensor it moves, as every rank must agree.
    pub spec: ModelSpec,
    /// Operation-specific agreement: broadcast root, send tag.
    pub aux: u32,
    /// When waiting stops.
    pub deadline: Instant,
    /// The operation's whole timeout (for messages).
    pub timeout: std::time::Duration,
    /// Largest payload of one frame.
    pub chunk_bytes: usize,
    /// The sub-group this context runs among (`None`: every rank of the transport).
    pub sub: Option<SubGroup<'a>>,
}

/// A part of one operation that runs among some of the ranks: the hierarchical collectives
/// run an intra-host and an inter-host part over the same transport, under one sequence
/// number, each with steps of its own.
#[derive(Debug, Clone, Copy)]
pub struct SubGroup<'a> {
    /// The member ranks, in ring order.
    pub ranks: &'a [usize],
    /// This rank's position in `ranks`.
    pub me: usize,
    /// Added to every step number, so that the parts' frames never share a key.
    pub step_base: u32,
    /// Payloads travel as raw elements even when the operation names a codec (codecs apply
    /// to the inter-host parts only).
    pub raw: bool,
}

/// Steps of one part of a hierarchical operation: part `p` numbers its steps from `p` times
/// this (a ring of `W` ranks uses `2(W-1)` steps).
pub const PART_STEPS: u32 = 1 << 24;

impl<'a, T: Transport> OpCtx<'a, T> {
    /// This rank (its position in the sub-group, if this context is one).
    pub fn rank(&self) -> usize {
        self.sub.map_or_else(|| self.t.rank(), |s| s.me)
    }

    /// The world size (of the sub-group, if this context is one).
    pub fn world(&self) -> usize {
        self.sub
            .map_or_else(|| self.t.world_size(), |s| s.ranks.len())
    }

    /// The same operation among `ranks` (which must hold this rank), with steps from part
    /// `part` on, raw (no codec) if `raw`.
    pub fn part<'b>(&self, ranks: &'b [usize], part: u32, raw: bool) -> Result<OpCtx<'b, T>>
    where
        'a: 'b,
    {
        let me = self.t.rank();
        let Some(at) = ranks.iter().position(|&r| r == me) else {
            return Err(Error::InvalidArgument(format!(
                "rank {me} is not a member of the sub-group {ranks:?}"
            )));
        };
        Ok(OpCtx {
            t: self.t,
            kind: self.kind,
            seq: self.seq,
            spec: self.spec.clone(),
            aux: self.aux,
            deadline: self.deadline,
            timeout: self.timeout,
            chunk_bytes: self.chunk_bytes,
            sub: Some(SubGroup {
                ranks,
                me: at,
                step_base: part * PART_STEPS,
                raw,
            }),
        })
    }

    /// The transport rank of member `peer`, and the wire step of `step`.
    fn address(&self, peer: usize, step: u32) -> (usize, u32) {
        match self.sub {
            None => (peer, step),
            Some(s) => (s.ranks[peer], s.step_base + step),
        }
    }

    /// The codec payloads travel with in this context.
    pub fn codec(&self) -> Codec {
        match self.sub {
            Some(s) if s.raw => Codec::None,
            _ => self.spec.codec,
        }
    }

    fn space(&self) -> SeqSpace {
        SeqSpace::of(self.kind)
    }

    /// Sends one chunk of step `step` to `peer`.
    pub async fn send(
        &self,
        peer: usize,
        step: u32,
        chunk: usize,
        chunk_count: usize,
        payload: &[u8],
    ) -> Result<()> {
        let (peer, step) = self.address(peer, step);
        let header = Header {
            kind: self.kind,
            minor: PROTOCOL_MINOR,
            seq: self.seq,
            step,
            chunk: chunk as u32,
            chunk_count: chunk_count as u32,
            src: self.t.rank() as u32,
            aux: self.aux,
            spec: self.spec.clone(),
            payload_len: payload.len() as u64,
            payload_crc: crc32c::crc32c(payload),
        };
        match tokio::time::timeout_at(self.deadline, self.t.send_frame(peer, &header, payload))
            .await
        {
            Ok(r) => r,
            Err(_) => Err(self.timeout(peer, step, chunk, "sending to")),
        }
    }

    /// Receives chunk `chunk` of step `step` from `peer`, checking its spec and length.
    pub async fn recv(
        &self,
        peer: usize,
        step: u32,
        chunk: usize,
        expect_len: usize,
    ) -> Result<Payload> {
        let (peer, step) = self.address(peer, step);
        let key = MsgKey {
            src: peer,
            space: self.space(),
            seq: self.seq,
            step,
            chunk: chunk as u32,
        };
        self.t.expect_from(peer);
        let frame = match tokio::time::timeout_at(self.deadline, self.t.mailbox().recv(key)).await {
            Ok(r) => r?,
            Err(_) => {
                // A frame under this number that we never asked for means the peer ran a
                // different operation (or the same one with another algorithm or size).
                if let Some(h) = self.t.mailbox().peek_header(self.space(), self.seq) {
                    self.check(&h)?;
                }
                return Err(self.timeout(peer, step, chunk, "waiting for"));
            }
        };
        self.check(&frame.header)?;
        // Encoded payloads vary in length; their decoder checks them instead.
        if !self.coded() && frame.payload.len() != expect_len {
            return Err(Error::Protocol(format!(
                "{} (seq {}): rank {peer} sent {} bytes for step {step} chunk {chunk}, expected {expect_len}",
                self.kind.op_name(),
                self.seq,
                frame.payload.len()
            )));
        }
        Ok(frame.payload)
    }

    /// True when payloads travel encoded.
    pub fn coded(&self) -> bool {
        self.codec() != Codec::None
    }

    /// The wire form of raw elements: encoded with the operation's codec.
    pub fn encode(&self, raw: &[u8]) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity(codec::max_encoded_len(
            self.codec(),
            self.spec.dtype,
            raw.len() / self.spec.dtype.size(),
        ));
        codec::encode(self.codec(), self.spec.dtype, raw, &mut out)?;
        Ok(out)
    }

    /// Sends raw elements, encoded with the operation's codec.
    pub async fn send_data(
        &self,
        peer: usize,
        step: u32,
        chunk: usize,
        chunk_count: usize,
        raw: &[u8],
    ) -> Result<()> {
        if self.coded() {
            let enc = self.encode(raw)?;
            self.send(peer, step, chunk, chunk_count, &enc).await
        } else {
            self.send(peer, step, chunk, chunk_count, raw).await
        }
    }

    /// Encodes `buf` and replaces it by what the peers will decode, so that this rank ends
    /// with the same bits as they do; returns the encoding (to send).
    pub fn settle(&self, buf: &mut [u8]) -> Result<Vec<u8>> {
        let enc = self.encode(buf)?;
        if self.coded() {
            codec::decode(self.codec(), self.spec.dtype, &enc, buf)?;
        }
        Ok(enc)
    }

    /// Stores a received payload into `dst` (decoding it).
    pub fn store(&self, p: &Payload, dst: &mut [u8]) -> Result<()> {
        if self.coded() {
            codec::decode(self.codec(), self.spec.dtype, &p.to_vec(), dst)
        } else {
            p.copy_to(dst)
        }
    }

    /// `dst = op(dst, payload)` (decoding the payload; accumulating in `dst`'s precision).
    pub fn accumulate(&self, p: &Payload, op: ReduceOp, dst: &mut [u8]) -> Result<()> {
        if self.coded() {
            codec::decode_reduce(self.codec(), self.spec.dtype, op, &p.to_vec(), dst)
        } else {
            p.reduce_into(self.spec.dtype, op, dst)
        }
    }

    /// Forwards a received chunk unchanged: its encoded bytes when coded (never re-encoded,
    /// so every rank decodes the same bits), else the stored raw bytes.
    pub async fn forward(
        &self,
        peer: usize,
        step: u32,
        chunk: usize,
        chunk_count: usize,
        p: &Payload,
        stored: &[u8],
    ) -> Result<()> {
        if self.coded() {
            self.send(peer, step, chunk, chunk_count, &p.to_vec()).await
        } else {
            self.send(peer, step, chunk, chunk_count, stored).await
        }
    }

    /// Checks that a peer's frame describes the same operation as ours.
    fn check(&self, h: &Header) -> Result<()> {
        if h.kind == self.kind && h.spec == self.spec && h.aux == self.aux {
            return Ok(());
        }
        Err(Error::SpecMismatch(format!(
            "{} differs between ranks: rank {} called {} but rank {} called {}",
            op_label(self.kind, self.seq),
            h.src,
            describe(h.kind, &h.spec, h.aux),
            self.t.rank(),
            describe(self.kind, &self.spec, self.aux)
        )))
    }

    fn timeout(&self, peer: usize, step: u32, chunk: usize, doing: &str) -> Error {
        Error::Timeout {
            what: format!(
                "{} {} on rank {}: {doing} rank {peer} (step {step}, chunk {chunk}); is that rank alive and calling the same operation?",
                self.kind.op_name(),
                op_label(self.kind, self.seq),
                self.t.rank()
            ),
            after: self.timeout,
        }
    }
}

/// Bits of a point-to-point sequence number that count the sender's messages.
const P2P_COUNT_BITS: u32 = 40;

/// The sequence number of the `n`-th message from `sender` to one receiver: the sender is
/// part of it so that the receiver's mailbox never confuses two senders' messages.
pub(crate) fn p2p_seq(sender: usize, n: u64) -> u64 {
    ((sender as u64) << P2P_COUNT_BITS) | (n & ((1 << P2P_COUNT_BITS) - 1))
}

/// The sender and the message count of a [`p2p_seq`].
pub(crate) fn p2p_parts(seq: u64) -> (usize, u64) {
    (
        (seq >> P2P_COUNT_BITS) as usize,
        seq & ((1 << P2P_COUNT_BITS) - 1),
    )
}

/// How messages name an operation: a collective by its number in the group, a
/// point-to-point message by its number among those its sender sent the receiver.
fn op_label(kind: FrameKind, seq: u64) -> String {
    if kind == FrameKind::Send {
        let (sender, n) = p2p_parts(seq);
        format!("message #{n} from rank {sender}")
    } else {
        format!("operation #{seq}")
    }
}

fn describe(kind: FrameKind, spec: &ModelSpec, aux: u32) -> String {
    match kind {
        FrameKind::Broadcast => format!("{}({spec}, src={aux})", kind.op_name()),
        FrameKind::Send => format!("{}({spec}, tag={aux})", kind.op_name()),
        _ => format!("{}({spec})", kind.op_name()),
    }
}

/// Splits `n` elements into `parts` contiguous segments, the first `n % parts` one longer;
/// returns byte ranges.
pub fn segments(n: usize, parts: usize, elem: usize) -> Vec<Range<usize>> {
    let base = n / parts;
    let extra = n % parts;
    let mut out = Vec::with_capacity(parts);
    let mut at = 0;
    for i in 0..parts {
        let len = base + usize::from(i < extra);
        out.push(at * elem..(at + len) * elem);
        at += len;
    }
    out
}

/// Splits the byte range `range` (whole elements of `elem` bytes) like [`segments`].
pub fn segments_of(range: Range<usize>, parts: usize, elem: usize) -> Vec<Range<usize>> {
    segments(range.len() / elem, parts, elem)
        .into_iter()
        .map(|s| s.start + range.start..s.end + range.start)
        .collect()
}

/// Cuts a byte range into chunks of at most `chunk_bytes` (rounded down to whole elements,
/// at least one element). An empty range gives one empty chunk, so that every step still
/// exchanges a frame and a disagreement about sizes is caught.
pub fn chunks(range: Range<usize>, elem: usize, chunk_bytes: usize) -> Vec<Range<usize>> {
    let step = (chunk_bytes / elem).max(1) * elem;
    if range.is_empty() {
        return vec![range];
    }
    let mut out = Vec::with_capacity(range.len().div_ceil(step));
    let mut at = range.start;
    while at < range.end {
        let end = (at + step).min(range.end);
        out.push(at..end);
        at = end;
    }
    out
}

#[cfg(test)]
mod tests;
