//! QUIC plumbing of the parameter server: endpoints with the job's mutual TLS, and one
//! framed message per direction on a bidirectional stream.
//!
//! A message that fails its checksum (damaged above QUIC: in memory, by a bad copy) is
//! [`Error::Damaged`]: the server answers a damaged request with `Damaged`, and the client
//! sends a request again, under the same id, when either its request or the reply was
//! damaged (every request is idempotent under its id), up to the resend limit.

use crate::error::{Error, Result};
use crate::transport::quic::chaos::ChaosConfig;
use crate::transport::quic::endpoint;
use crate::wire::{Codec, FrameKind, Header, ModelSpec, HEADER_FIXED, PROTOCOL_MINOR};
use crate::{DType, ReduceOp};
use bytes::Bytes;
use quinn::{RecvStream, SendStream};
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::Duration;

/// Damage to inject into sent messages (chaos `corrupt=p`): one bit of a message's
/// metadata or data flipped with probability `p`, after its checksum was computed, as a
/// flipped bit in memory would be.
pub(crate) struct Damage {
    p: f64,
    rng: Mutex<rand::rngs::StdRng>,
}

impl Damage {
    /// The damage `chaos` asks for, seeded with its seed and `salt`; `None` when none.
    pub(crate) fn of(chaos: Option<ChaosConfig>, salt: u64) -> Option<Damage> {
        let c = chaos.filter(|c| c.corrupt > 0.0)?;
        Some(Damage {
            p: c.corrupt.clamp(0.0, 1.0),
            rng: Mutex::new(<rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(
                c.seed ^ salt.rotate_left(17),
            )),
        })
    }

    /// The bit of a `len`-byte section to flip, or `None` to send it intact.
    fn bit(&self, len: usize) -> Option<usize> {
        if len == 0 {
            return None;
        }
        let mut rng = self.rng.lock().unwrap_or_else(|p| p.into_inner());
        rand::Rng::random_bool(&mut *rng, self.p)
            .then(|| rand::Rng::random_range(&mut *rng, 0..len * 8))
    }
}

fn damaged(header: &Header) -> Error {
    Error::Damaged(format!(
        "parameter-server message {} from {} failed its checksum (corrupted in transit or in memory)",
        header.seq, header.src
    ))
}

/// ALPN of the parameter-server protocol.
pub(crate) fn alpn() -> Vec<u8> {
    format!(
        "mcp-ps/{}.{}",
        crate::wire::PROTOCOL_MAJOR,
        crate::wire::PROTOCOL_MINOR
    )
    .into_bytes()
}

/// Largest data section a message may announce.
pub(crate) const MAX_DATA: u64 = 1 << 30;

/// Requests in flight per connection.
const MAX_STREAMS: u32 = 4096;

use crate::config::TransportSettings;
pub(crate) use crate::transport::quic::endpoint::ControlEndpoint as Bound;

/// Binds `addr` and makes an endpoint that accepts connections when `serve`. A connection
/// silent for `dead_after` is closed (QUIC pings every quarter of it keep live ones open).
pub(crate) fn bind(
    addr: SocketAddr,
    secret: &[u8],
    serve: bool,
    dead_after: Duration,
    chaos: Option<ChaosConfig>,
    tune: &TransportSettings,
) -> Result<Bound> {
    endpoint::control_endpoint(
        addr,
        secret,
        serve,
        dead_after,
        chaos,
        alpn(),
        MAX_STREAMS,
        tune,
    )
}

/// The header and metadata of a message; the data section is still on the stream.
pub(crate) struct Head {
    pub header: Header,
    pub meta: Vec<u8>,
}

impl Head {
    /// Bytes in the data section.
    pub fn data_len(&self) -> u64 {
        self.header.payload_len - self.meta.len() as u64
    }

    /// Elements the data section decodes to.
    pub fn numel(&self) -> u64 {
        self.header.spec.shape.first().copied().unwrap_or(0)
    }

    /// The CRC of the metadata: where a running CRC of the data section starts.
    pub fn crc_start(&self) -> u32 {
        crc32c::crc32c(&self.meta)
    }

    /// Checks a running CRC ([`read_data_crc`]) of the whole data section.
    pub fn check_crc(&self, crc: u32) -> Result<()> {
        if crc != self.header.payload_crc {
            return Err(damaged(&self.header));
        }
        Ok(())
    }

    /// After the metadata did not decode: reads the rest of the message and tells whether it
    /// was damaged ([`Error::Damaged`]) or is intact (then the metadata is wrong, `Ok`).
    pub async fn drain_checked(&self, recv: &mut RecvStream) -> Result<()> {
        let mut crc = self.crc_start();
        let mut left = self.data_len();
        while left > 0 {
            match recv.read_chunk(left as usize, true).await {
                Ok(Some(c)) => {
                    crc = crc32c::crc32c_append(crc, &c.bytes);
                    left = left.saturating_sub(c.bytes.len() as u64);
                }
                Ok(None) => break,
                Err(e) => return Err(lost("receive", e)),
            }
        }
        self.check_crc(crc)
    }

    /// Checks the payload CRC once `data` (the data section) has been read.
    pub fn verify(&self, data: &[u8]) -> Result<()> {
        self.verify_parts(&[data])
    }

    /// Checks the payload CRC of a data section read into several parts, in order.
    pub fn verify_parts(&self, parts: &[&[u8]]) -> Result<()> {
        let crc = parts.iter().fold(crc32c::crc32c(&self.meta), |c, p| {
            crc32c::crc32c_append(c, p)
        });
        self.check_crc(crc)
    }
}

/// A stream or connection failure, which the client retries.
fn lost(what: &str, e: impl std::fmt::Display) -> Error {
    Error::PeerLost {
        rank: usize::MAX,
        op: what.to_string(),
        reason: e.to_string(),
    }
}

/// Writes one message and finishes the stream (with `damage`, maybe a bit flipped after
/// the checksum was computed).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn write_msg(
    send: &mut SendStream,
    kind: FrameKind,
    id: u64,
    worker: u32,
    op: u32,
    codec: Codec,
    numel: u64,
    meta: &[u8],
    data: Bytes,
    damage: Option<&Damage>,
) -> Result<()> {
    let header = Header {
        kind,
        minor: PROTOCOL_MINOR,
        seq: id,
        step: 0,
        chunk: meta.len() as u32,
        chunk_count: 0,
        src: worker,
        aux: op,
        spec: ModelSpec {
            dtype: DType::F32,
            op: ReduceOp::None,
            codec,
            shape: vec![numel],
        },
        payload_len: (meta.len() + data.len()) as u64,
        payload_crc: crc32c::crc32c_append(crc32c::crc32c(meta), &data),
    };
    let mut buf = Vec::with_capacity(header.encoded_len() + meta.len() + 64);
    header.encode(&mut buf)?;
    let head_len = buf.len();
    buf.extend_from_slice(meta);
    let mut data = data;
    if let Some(bit) = damage.and_then(|d| d.bit(meta.len() + data.len())) {
        let (byte, mask) = (bit / 8, 1u8 << (bit % 8));
        if byte < meta.len() {
            buf[head_len + byte] ^= mask;
        } else {
            let mut v = data.to_vec();
            v[byte - meta.len()] ^= mask;
            data = Bytes::from(v);
        }
    }
    if data.len() <= 16 << 10 {
        buf.extend_from_slice(&data);
        send.write_all(&buf).await.map_err(|e| lost("send", e))?;
    } else {
        send.write_all(&buf).await.map_err(|e| lost("send", e))?;
        send.write_chunk(data).await.map_err(|e| lost("send", e))?;
    }
    send.finish().map_err(|e| lost("send", e))?;
    Ok(())
}

fn read_err(e: quinn::ReadExactError) -> Error {
    match e {
        quinn::ReadExactError::ReadError(r) => lost("receive", r),
        quinn::ReadExactError::FinishedEarly(n) => Error::Protocol(format!(
            "parameter-server message ended early ({n} bytes read)"
        )),
    }
}

/// Reads a message's header and metadata, checking them.
pub(crate) async fn read_head(recv: &mut RecvStream, expect: FrameKind) -> Result<Head> {
    let mut fixed = [0u8; HEADER_FIXED];
    recv.read_exact(&mut fixed).await.map_err(read_err)?;
    let shape_len = Header::shape_len(&fixed)?;
    let mut hbytes = fixed.to_vec();
    hbytes.resize(HEADER_FIXED + shape_len, 0);
    recv.read_exact(&mut hbytes[HEADER_FIXED..])
        .await
        .map_err(read_err)?;
    let header = Header::decode(&hbytes)?;
    if header.kind != expect {
        return Err(Error::Protocol(format!(
            "expected a {} frame, got {}",
            expect.op_name(),
            header.kind.op_name()
        )));
    }
    let meta_len = header.chunk as usize;
    if meta_len > super::proto::MAX_META
        || meta_len as u64 > header.payload_len
        || header.payload_len - meta_len as u64 > MAX_DATA
    {
        return Err(Error::Protocol(format!(
            "parameter-server message announces {} bytes of metadata and {} of payload",
            meta_len, header.payload_len
        )));
    }
    let mut meta = vec![0u8; meta_len];
    recv.read_exact(&mut meta).await.map_err(read_err)?;
    Ok(Head { header, meta })
}

/// Reads exactly `dst.len()` bytes of data section into `dst`, extending the running CRC
/// `crc` with each piece while it is in cache.
pub(crate) async fn read_data_crc(
    recv: &mut RecvStream,
    dst: &mut [u8],
    crc: &mut u32,
) -> Result<()> {
    let mut at = 0;
    while at < dst.len() {
        match recv.read_chunk(dst.len() - at, true).await {
            Ok(Some(c)) => {
                *crc = crc32c::crc32c_append(*crc, &c.bytes);
                dst[at..at + c.bytes.len()].copy_from_slice(&c.bytes);
                at += c.bytes.len();
            }
            Ok(None) => {
                return Err(Error::Protocol(format!(
                    "parameter-server data ended after {at} of {} bytes",
                    dst.len()
                )))
            }
            Err(e) => return Err(lost("receive", e)),
        }
    }
    Ok(())
}

/// Reads the data section as f32 values decoded with the message's codec.
pub(crate) async fn read_f32(recv: &mut RecvStream, head: &Head) -> Result<Vec<f32>> {
    let n = head.numel();
    let bytes = head.data_len();
    if n > MAX_DATA / 4 {
        return Err(Error::Protocol(format!("{n} elements announced")));
    }
    let mut out = vec![0f32; n as usize];
    if head.header.spec.codec == Codec::None {
        if bytes != n * 4 {
            return Err(Error::Protocol(format!(
                "{bytes} bytes of data for {n} float32 elements"
            )));
        }
        let mut crc = head.crc_start();
        read_data_crc(recv, bytemuck::cast_slice_mut(&mut out), &mut crc).await?;
        head.check_crc(crc)?;
    } else {
        let mut enc = vec![0u8; bytes as usize];
        let mut crc = head.crc_start();
        read_data_crc(recv, &mut enc, &mut crc).await?;
        head.check_crc(crc)?;
        crate::codec::decode(
            head.header.spec.codec,
            DType::F32,
            &enc,
            bytemuck::cast_slice_mut(&mut out),
        )
        .map_err(|e| Error::Protocol(format!("undecodable gradient: {e}")))?;
    }
    Ok(out)
}

/// Decodes `numel` f32 values coded with `codec` from `enc`.
pub(crate) fn decode_f32(codec: Codec, enc: &[u8], numel: u64) -> Result<Vec<f32>> {
    if numel > MAX_DATA / 4 {
        return Err(Error::Protocol(format!("{numel} elements announced")));
    }
    let mut out = vec![0f32; numel as usize];
    if codec == Codec::None {
        if enc.len() as u64 != numel * 4 {
            return Err(Error::Protocol(format!(
                "{} bytes of data for {numel} float32 elements",
                enc.len()
            )));
        }
        bytemuck::cast_slice_mut::<f32, u8>(&mut out).copy_from_slice(enc);
    } else {
        crate::codec::decode(codec, DType::F32, enc, bytemuck::cast_slice_mut(&mut out))
            .map_err(|e| Error::Protocol(format!("undecodable gradient: {e}")))?;
    }
    Ok(out)
}
