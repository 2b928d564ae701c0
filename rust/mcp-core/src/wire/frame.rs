//! The frame header that precedes every MCP message on a stream.
//!
//! Layout (little endian), `HEADER_FIXED` bytes then 8 bytes per dimension:
//! ```text
//!  0 magic "MCPF"   4 major  5 minor  6 kind  7 ndim
//!  8 seq (u64)     16 step (u32)     20 chunk (u32)   24 chunk_count (u32)
//! 28 src rank (u32) 32 aux (u32: root, tag)            36 dtype 37 op 38 codec 39 log2(block)
//! 40 payload_len (u64)               48 payload CRC32C (u32)  52 header CRC32C (u32)
//! 56 shape: ndim x u64
//! ```
//! The header CRC covers bytes 0..52 and the shape, so a damaged header is never trusted.

use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::wire::spec::{Codec, ModelSpec, MAX_DIMS};

/// The four bytes every frame starts with.
pub const MAGIC: [u8; 4] = *b"MCPF";
/// Bytes of the header before the shape.
pub const HEADER_FIXED: usize = 56;
/// Largest header on the wire.
pub const HEADER_MAX: usize = HEADER_FIXED + 8 * MAX_DIMS;
/// The protocol's major version: peers must agree on it.
pub const PROTOCOL_MAJOR: u8 = 1;
/// The protocol's minor version: peers must agree on it too (it is pinned at the handshake,
/// as the design advises, since a minor version may frame data differently). 1: stream-lane
/// frames with the receiver's verdict, and progress reports. 2: the rendezvous table carries
/// each rank's host identity, pid and shared-memory flag. 3: and its declared model
/// ([`model_decl`](crate::model_decl)). 4: the bitwise reduce ops (codes 6-8).
pub const PROTOCOL_MINOR: u8 = 4;

/// What a frame is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// First frame on a new connection: who the dialer is (payload: rank table entry).
    Hello = 1,
    /// Rendezvous answer from rank 0: every rank's endpoint.
    Table = 2,
    /// All-reduce data.
    AllReduce = 3,
    /// Broadcast data.
    Broadcast = 4,
    /// All-gather data.
    AllGather = 5,
    /// Reduce-scatter data.
    ReduceScatter = 6,
    /// Barrier token.
    Barrier = 7,
    /// Point-to-point data.
    Send = 8,
    /// The sender failed operation `seq`; the payload says why.
    Abort = 9,
    /// The sender is closing its group cleanly.
    Goodbye = 10,
    /// A request to a parameter server (`crate::ps`).
    PsRequest = 11,
    /// A parameter server's reply.
    PsReply = 12,
    /// The sender's progress: collective operations started and finished (the watchdog's
    /// report, see `health::progress`).
    Progress = 13,
}

impl FrameKind {
    /// Decodes a wire code.
    pub fn from_code(code: u8) -> Option<FrameKind> {
        use FrameKind::*;
        [
            Hello,
            Table,
            AllReduce,
            Broadcast,
            AllGather,
            ReduceScatter,
            Barrier,
            Send,
            Abort,
            Goodbye,
            PsRequest,
            PsReply,
            Progress,
        ]
        .into_iter()
        .find(|k| *k as u8 == code)
    }

    /// The user-facing name of the operation.
    pub fn op_name(self) -> &'static str {
        match self {
            FrameKind::Hello => "hello",
            FrameKind::Table => "rendezvous",
            FrameKind::AllReduce => "all_reduce",
            FrameKind::Broadcast => "broadcast",
            FrameKind::AllGather => "all_gather",
            FrameKind::ReduceScatter => "reduce_scatter",
            FrameKind::Barrier => "barrier",
            FrameKind::Send => "send/recv",
            FrameKind::Abort => "abort",
            FrameKind::Goodbye => "goodbye",
            FrameKind::PsRequest => "ps request",
            FrameKind::PsReply => "ps reply",
            FrameKind::Progress => "progress",
        }
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// What the frame is for.
    pub kind: FrameKind,
    /// Protocol minor version of the sender.
    pub minor: u8,
    /// Operation sequence number (per group for collectives, per pair for send/recv).
    pub seq: u64,
    /// Algorithm step (hop) within the operation.
    pub step: u32,
    /// Chunk index within the step.
    pub chunk: u32,
    /// Number of chunks in the step.
    pub chunk_count: u32,
    /// The sender's rank.
    pub src: u32,
    /// Operation-specific: the root of a broadcast, the tag of a send.
    pub aux: u32,
    /// The tensor the operation moves.
    pub spec: ModelSpec,
    /// Bytes of payload that follow the header.
    pub payload_len: u64,
    /// CRC32C of the payload.
    pub payload_crc: u32,
}

impl Header {
    /// The header of a one-chunk frame whose payload is plain bytes (a control message, an
    /// abort, a membership message): `kind` from `src`, numbered `seq`, with `aux`, its
    /// length and checksum those of `payload`.
    pub fn bytes(kind: FrameKind, src: usize, seq: u64, aux: u32, payload: &[u8]) -> Header {
        Header {
            kind,
            minor: super::PROTOCOL_MINOR,
            seq,
            step: 0,
            chunk: 0,
            chunk_count: 1,
            src: src as u32,
            aux,
            spec: ModelSpec::flat(DType::U8, ReduceOp::None, payload.len()),
            payload_len: payload.len() as u64,
            payload_crc: crc32c::crc32c(payload),
        }
    }

    /// Bytes this header takes on the wire.
    pub fn encoded_len(&self) -> usize {
        HEADER_FIXED + 8 * self.spec.shape.len()
    }

    /// Appends the encoded header to `out`.
    ///
    /// Fails when the shape has more than [`MAX_DIMS`] dimensions.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<()> {
        let ndim = self.spec.shape.len();
        if ndim > MAX_DIMS {
            return Err(Error::InvalidArgument(format!(
                "tensors of at most {MAX_DIMS} dimensions are supported, got {ndim}"
            )));
        }
        let start = out.len();
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&[PROTOCOL_MAJOR, self.minor, self.kind as u8, ndim as u8]);
        out.extend_from_slice(&self.seq.to_le_bytes());
        out.extend_from_slice(&self.step.to_le_bytes());
        out.extend_from_slice(&self.chunk.to_le_bytes());
        out.extend_from_slice(&self.chunk_count.to_le_bytes());
        out.extend_from_slice(&self.src.to_le_bytes());
        out.extend_from_slice(&self.aux.to_le_bytes());
        out.extend_from_slice(&[
            self.spec.dtype as u8,
            self.spec.op as u8,
            self.spec.codec.to_code(),
            self.spec.codec.block().checked_ilog2().unwrap_or(0) as u8,
        ]);
        out.extend_from_slice(&self.payload_len.to_le_bytes());
        out.extend_from_slice(&self.payload_crc.to_le_bytes());
        let crc_at = out.len();
        out.extend_from_slice(&[0; 4]);
        for d in &self.spec.shape {
            out.extend_from_slice(&d.to_le_bytes());
        }
        let crc = header_crc(&out[start..]);
        out[crc_at..crc_at + 4].copy_from_slice(&crc.to_le_bytes());
        Ok(())
    }

    /// How many shape bytes follow a fixed header part, or an error when the fixed part is
    /// not an MCP header of our major version.
    pub fn shape_len(fixed: &[u8]) -> Result<usize> {
        if fixed.len() < HEADER_FIXED {
            return Err(Error::Protocol(format!(
                "frame header truncated: {} of {HEADER_FIXED} bytes",
                fixed.len()
            )));
        }
        if fixed[0..4] != MAGIC {
            return Err(Error::Protocol(format!(
                "bad frame magic {:02x?}: the peer is not speaking MCP",
                &fixed[0..4]
            )));
        }
        if fixed[4] != PROTOCOL_MAJOR {
            return Err(Error::VersionMismatch {
                ours: format!("{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}"),
                theirs: format!("{}.{}", fixed[4], fixed[5]),
                peer: "frame sender".into(),
            });
        }
        let ndim = fixed[7] as usize;
        if ndim > MAX_DIMS {
            return Err(Error::Protocol(format!(
                "frame has {ndim} dimensions, at most {MAX_DIMS} allowed"
            )));
        }
        Ok(8 * ndim)
    }

    /// Decodes a header from exactly `HEADER_FIXED + shape_len` bytes. Never panics.
    pub fn decode(bytes: &[u8]) -> Result<Header> {
        let shape_bytes = Header::shape_len(bytes)?;
        if bytes.len() != HEADER_FIXED + shape_bytes {
            return Err(Error::Protocol(format!(
                "frame header is {} bytes, expected {}",
                bytes.len(),
                HEADER_FIXED + shape_bytes
            )));
        }
        let stored_crc = u32_at(bytes, 52);
        if header_crc(bytes) != stored_crc {
            return Err(Error::Protocol(
                "frame header checksum mismatch (corrupted header)".into(),
            ));
        }
        let kind = FrameKind::from_code(bytes[6])
            .ok_or_else(|| Error::Protocol(format!("unknown frame kind {}", bytes[6])))?;
        let dtype = DType::from_code(bytes[36])
            .ok_or_else(|| Error::Protocol(format!("unknown dtype code {}", bytes[36])))?;
        let op = ReduceOp::from_code(bytes[37])
            .ok_or_else(|| Error::Protocol(format!("unknown reduce op code {}", bytes[37])))?;
        let block = if bytes[38] == (Codec::Int8 { block: 1 }).to_code() {
            1u32.checked_shl(u32::from(bytes[39])).unwrap_or(0)
        } else {
            0
        };
        let codec = Codec::from_code(bytes[38], block).ok_or_else(|| {
            Error::Protocol(format!("unknown codec code {} (block {block})", bytes[38]))
        })?;
        let shape = bytes[HEADER_FIXED..]
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect();
        Ok(Header {
            kind,
            minor: bytes[5],
            seq: u64_at(bytes, 8),
            step: u32_at(bytes, 16),
            chunk: u32_at(bytes, 20),
            chunk_count: u32_at(bytes, 24),
            src: u32_at(bytes, 28),
            aux: u32_at(bytes, 32),
            spec: ModelSpec {
                dtype,
                op,
                codec,
                shape,
            },
            payload_len: u64_at(bytes, 40),
            payload_crc: u32_at(bytes, 48),
        })
    }
}

/// Whether an encoded header (fixed part and shape) matches its own CRC: a header that does
/// not was damaged and names nothing that can be trusted.
pub fn header_intact(bytes: &[u8]) -> bool {
    bytes.len() >= HEADER_FIXED && header_crc(bytes) == u32_at(bytes, 52)
}

/// CRC32C of a header with its own CRC field (bytes 52..56) read as zero.
fn header_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(&bytes[..52.min(bytes.len())]);
    let crc = crc32c::crc32c_append(crc, &[0; 4]);
    if bytes.len() > HEADER_FIXED {
        crc32c::crc32c_append(crc, &bytes[HEADER_FIXED..])
    } else {
        crc
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Checks a payload against the CRC its header carries.
pub fn verify_payload(header: &Header, payload: &[u8]) -> Result<()> {
    if payload.len() as u64 != header.payload_len {
        return Err(Error::Protocol(format!(
            "payload of {} bytes, header announced {}",
            payload.len(),
            header.payload_len
        )));
    }
    let crc = crc32c::crc32c(payload);
    if crc != header.payload_crc {
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> Header {
        Header {
            kind: FrameKind::AllReduce,
            minor: PROTOCOL_MINOR,
            seq: 42,
            step: 3,
            chunk: 7,
            chunk_count: 9,
            src: 2,
            aux: 5,
            spec: ModelSpec {
                dtype: DType::BF16,
                op: ReduceOp::Max,
                codec: Codec::None,
                shape: vec![3, 1, 4096],
            },
            payload_len: 1 << 20,
            payload_crc: 0xdead_beef,
        }
    }

    #[test]
    fn round_trip() {
        let h = sample();
        let mut buf = Vec::new();
        h.encode(&mut buf).expect("encode");
        assert_eq!(buf.len(), h.encoded_len());
        assert_eq!(Header::shape_len(&buf[..HEADER_FIXED]).expect("len"), 24);
        assert_eq!(Header::decode(&buf).expect("decode"), h);
    }

    #[test]
    fn every_flipped_bit_is_caught() {
        let mut buf = Vec::new();
        sample().encode(&mut buf).expect("encode");
        for bit in 0..buf.len() * 8 {
            let mut b = buf.clone();
            b[bit / 8] ^= 1 << (bit % 8);
            assert!(
                Header::decode(&b).is_err(),
                "flip of bit {bit} went unnoticed"
            );
        }
    }

    #[test]
    fn other_major_version_is_a_version_mismatch() {
        let mut buf = Vec::new();
        sample().encode(&mut buf).expect("encode");
        buf[4] = PROTOCOL_MAJOR + 1;
        assert!(matches!(
            Header::decode(&buf),
            Err(Error::VersionMismatch { .. })
        ));
    }

    #[test]
    fn too_many_dims_refused() {
        let mut h = sample();
        h.spec.shape = vec![1; MAX_DIMS + 1];
        assert!(matches!(
            h.encode(&mut Vec::new()),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn payload_crc() {
        let payload = vec![7u8; 1000];
        let mut h = sample();
        h.payload_len = 1000;
        h.payload_crc = crc32c::crc32c(&payload);
        verify_payload(&h, &payload).expect("good payload");
        let mut bad = payload.clone();
        bad[500] ^= 0x10;
        assert!(matches!(verify_payload(&h, &bad), Err(Error::Protocol(_))));
        assert!(verify_payload(&h, &payload[..999]).is_err());
    }

    proptest! {
        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = Header::decode(&bytes);
            let _ = Header::shape_len(&bytes);
        }

        #[test]
        fn decoding_mutated_headers_never_panics(idx in 0usize..80, val in any::<u8>()) {
            let mut buf = Vec::new();
            sample().encode(&mut buf).expect("encode");
            if idx < buf.len() { buf[idx] = val; }
            let _ = Header::decode(&buf);
        }
    }
}
