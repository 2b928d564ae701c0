//! The stream lane with healing: each data frame travels on a bidirectional QUIC stream and
//! the receiver answers with a verdict, so that a frame whose checksum fails is sent again
//! instead of failing the operation.
//!
//! QUIC's AEAD rejects a packet damaged on the wire, and QUIC resends it; what it cannot see
//! is damage above it: a bit flipped in host memory, a bad copy, a faulty offload. The frame's
//! CRC32Cs (header and payload) catch those, and this lane repairs them:
//!
//! 1. The sender opens a bidirectional stream, writes the frame (header, payload) and
//!    finishes its side. It keeps the frame until the verdict: the same reference-counted
//!    buffers QUIC sends from, so keeping them costs no copy.
//! 2. The receiver reads the frame, checks both CRCs and answers one byte: [`VERDICT_OK`]
//!    (the frame is filed), [`VERDICT_RESEND`] (it is dropped), or [`VERDICT_GIVE_UP`] once
//!    the same frame has failed more than `resend_limit` times; then, and only then, the
//!    operation fails with a `ProtocolError` that names the peer, the operation and the count.
//!    A failure is answered at once; an OK only lets the sender free the frame, so OKs wait
//!    [`OK_VERDICT_DELAY`] and leave together ([`OkVerdicts`]): one packet of verdicts per
//!    millisecond rather than one per frame, which on a small operation is a packet each way.
//! 3. On a resend request the sender writes the frame again on a fresh stream (a damaged
//!    header cannot be trusted to frame a second copy on the same stream).
//!
//! Memory: a frame is kept from its send until its verdict, about one round trip after QUIC
//! has delivered it, so the frames kept are QUIC's send window plus a round trip of data;
//! [`RETAIN_BYTES`] caps them per process (a send waits for room, as it waits for QUIC's
//! window). Every loop is bounded: [`MAX_RESENDS`] attempts per frame, the verdict ends with
//! the connection, or with the reconnection budget when the connection breaks.
//!
//! A connection that breaks while its peer lives is re-established ([`super::reconnect`]): a
//! frame still without its verdict is then sent again on the new connection — the operation
//! resumes from what the receiver acknowledged, not from its start — and a receiver that had
//! filed it already drops the copy.

use super::{QuicTransport, WriteFail, MAX_FRAME_PAYLOAD};
use crate::error::{Error, Result};
use crate::transport::{Frame, MsgKey, Payload, MAX_RESENDS};
use crate::wire::{header_intact, Header, HEADER_FIXED};
use bytes::Bytes;
use quinn::{Connection, ConnectionError, RecvStream, SendStream};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

/// The receiver has the frame intact.
pub const VERDICT_OK: u8 = 0;
/// The frame failed a checksum: send it again.
pub const VERDICT_RESEND: u8 = 1;
/// The frame failed more often than the resend limit allows: the operation fails.
pub const VERDICT_GIVE_UP: u8 = 2;

/// How long an OK verdict waits for others to share its packet. A sender holds its frames this
/// much longer (a millisecond of sending, well inside [`RETAIN_BYTES`]), and its shutdown,
/// which waits for every verdict, as much.
pub const OK_VERDICT_DELAY: Duration = Duration::from_millis(1);

/// Frame bytes kept for resending, per process.
pub const RETAIN_BYTES: usize = 1 << 30;
/// How many buffers of kept frames are reused rather than freed, and the largest kept: a
/// ring's frames in flight at the default 1 MiB chunk (so 32 MiB idle at that chunk size,
/// 64 MiB at most).
const SEND_BUFFERS: (usize, usize) = (32, 2 << 20);

/// The pool the copies of kept frames come from.
pub(super) fn send_buffers() -> crate::transport::buffer_pool::BufferPool {
    crate::transport::buffer_pool::BufferPool::new(SEND_BUFFERS.0, SEND_BUFFERS.1)
}

/// Frames that failed and wait for their resend, per connection; more is a broken peer.
const FAILING_FRAMES: usize = 4096;

/// The semaphore unit of [`RETAIN_BYTES`] (KiB, so that a permit count fits a `u32`).
const RETAIN_UNIT: usize = 1024;

/// Permits of the retain budget that a frame of `len` bytes takes.
pub(super) fn retain_permits(len: usize) -> u32 {
    len.div_ceil(RETAIN_UNIT)
        .clamp(1, RETAIN_BYTES / RETAIN_UNIT) as u32
}

/// Permits the whole retain budget holds.
pub(super) fn retain_budget() -> usize {
    RETAIN_BYTES / RETAIN_UNIT
}

/// Whether a stream-lane send is a new frame or one sent before on the FEC lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Sent {
    /// A frame not sent before: counted in the frames sent to the peer.
    New,
    /// A frame counted already, carried again.
    Again,
}

/// A sent frame, kept until the receiver's verdict.
struct Retained {
    head: Bytes,
    payload: Bytes,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl QuicTransport {
    /// Sends a data frame on the stream lane; returns once QUIC holds it. The frame is kept
    /// and sent again, in the background, as often as the receiver asks. `sent` says whether
    /// it counts as a new frame: one carried again (an FEC-lane transfer withdrawn or cut
    /// off) does not, so that the count a goodbye announces stays what the peer will file.
    pub(super) async fn write_checked(
        &self,
        peer: usize,
        conn: &Connection,
        header: &Header,
        payload: &[u8],
        sent: Sent,
    ) -> std::result::Result<(), WriteFail> {
        let mut head = Vec::with_capacity(header.encoded_len());
        header.encode(&mut head).map_err(WriteFail::Core)?;
        let len = head.len() + payload.len();
        let permit = self
            .retained
            .clone()
            .acquire_many_owned(retain_permits(len))
            .await
            .map_err(|_| WriteFail::Conn(ConnectionError::LocallyClosed))?;
        let frame = Retained {
            head: Bytes::from(head),
            payload: self.send_bufs.copy(payload),
            _permit: permit,
        };
        let recv = self.send_attempt(conn, &frame).await?;
        if sent == Sent::New {
            self.count_sent(peer, len);
        }
        // Until its verdict the frame counts as unacknowledged (shutdown waits for it).
        self.unacked_streams.fetch_add(1, Ordering::AcqRel);
        let me = self.me.clone();
        let conn = conn.clone();
        tokio::spawn(async move {
            await_verdicts(&me, peer, conn, frame, recv).await;
            if let Some(t) = me.upgrade() {
                t.unacked_streams.fetch_sub(1, Ordering::AcqRel);
            }
        });
        Ok(())
    }

    /// Writes one copy of `frame` on a new stream (corrupting the payload first when chaos
    /// says so: above QUIC, as a flipped bit in memory would be) and returns the stream's
    /// receiving side, where the verdict comes.
    async fn send_attempt(
        &self,
        conn: &Connection,
        frame: &Retained,
    ) -> std::result::Result<RecvStream, WriteFail> {
        let payload = match self.corruption_bit(frame.payload.len()) {
            Some(bit) => {
                let mut v = frame.payload.to_vec();
                v[bit / 8] ^= 1 << (bit % 8);
                Bytes::from(v)
            }
            None => frame.payload.clone(),
        };
        let (mut send, recv) = conn.open_bi().await.map_err(WriteFail::Conn)?;
        send.write_all_chunks(&mut [frame.head.clone(), payload])
            .await
            .map_err(WriteFail::Write)?;
        send.finish()
            .map_err(|_| WriteFail::Conn(ConnectionError::LocallyClosed))?;
        Ok(recv)
    }
}

/// Reads verdicts on a sent frame and sends it again while the receiver asks, at most
/// [`MAX_RESENDS`] times; and once more on the next connection when this one broke before
/// the verdict came. Ends with OK, GIVE_UP, or the loss of the peer.
async fn await_verdicts(
    me: &Weak<QuicTransport>,
    peer: usize,
    mut conn: Connection,
    frame: Retained,
    mut recv: RecvStream,
) {
    for _ in 0..=MAX_RESENDS {
        let mut v = [0u8; 1];
        let broke = match recv.read_exact(&mut v).await {
            Ok(()) if v[0] == VERDICT_RESEND => false,
            Ok(()) => return,
            Err(quinn::ReadExactError::ReadError(
                quinn::ReadError::ConnectionLost(_) | quinn::ReadError::ZeroRttRejected,
            )) => true,
            Err(_) => return,
        };
        let Some(t) = me.upgrade() else { return };
        if broke {
            match t.next_conn(peer, &conn).await {
                Ok(c) => conn = c,
                Err(_) => return,
            }
            t.stats.resumed_frames.fetch_add(1, Ordering::Relaxed);
        } else {
            t.stats.retransmits.fetch_add(1, Ordering::Relaxed);
        }
        // A write on a connection that broke meanwhile fails: wait for the next one.
        let mut sent = t.send_attempt(&conn, &frame).await;
        for _ in 0..4 {
            if sent.is_ok() {
                break;
            }
            match t.next_conn(peer, &conn).await {
                Ok(c) => conn = c,
                Err(_) => return,
            }
            sent = t.send_attempt(&conn, &frame).await;
        }
        match sent {
            Ok(r) => recv = r,
            Err(_) => return,
        }
    }
}

/// What the receiving side of one connection remembers between the attempts of a frame.
#[derive(Default)]
pub(super) struct Resends {
    /// Failed attempts of frames not yet received intact.
    failing: Mutex<HashMap<MsgKey, u32>>,
    /// Damaged headers in a row (their frame cannot be named).
    bad_headers: AtomicU32,
}

/// Why a frame could not be read.
pub(super) enum ReadFail {
    /// The header failed its CRC: the frame cannot be trusted, but the sender can resend it.
    Damaged(Error),
    /// The stream failed, or the bytes are not MCP.
    Bad(Error),
}

/// Reads one frame (header and payload) from `stream`, whose first `already` bytes were read
/// by the caller. The payload stays in the pieces QUIC delivered: no copy.
pub(super) async fn read_frame(
    stream: &mut RecvStream,
    already: &[u8],
) -> std::result::Result<(Header, usize, Payload), ReadFail> {
    let mut fixed = [0u8; HEADER_FIXED];
    fixed[..already.len()].copy_from_slice(already);
    stream
        .read_exact(&mut fixed[already.len()..])
        .await
        .map_err(|e| ReadFail::Bad(Error::Protocol(format!("reading a frame header: {e}"))))?;
    let shape_len = Header::shape_len(&fixed).map_err(ReadFail::Bad)?;
    let mut hbytes = fixed.to_vec();
    hbytes.resize(HEADER_FIXED + shape_len, 0);
    stream
        .read_exact(&mut hbytes[HEADER_FIXED..])
        .await
        .map_err(|e| ReadFail::Bad(Error::Protocol(format!("reading a frame shape: {e}"))))?;
    if !header_intact(&hbytes) {
        return Err(ReadFail::Damaged(Error::Protocol(
            "frame header checksum mismatch (corrupted header)".into(),
        )));
    }
    let header = Header::decode(&hbytes).map_err(ReadFail::Bad)?;
    if header.payload_len > MAX_FRAME_PAYLOAD {
        return Err(ReadFail::Bad(Error::Protocol(format!(
            "frame announces {} payload bytes",
            header.payload_len
        ))));
    }
    let mut payload = Payload::new();
    let mut left = header.payload_len as usize;
    while left > 0 {
        match stream.read_chunk(left, true).await {
            Ok(Some(chunk)) => {
                left = left.saturating_sub(chunk.bytes.len());
                payload.push(chunk.bytes);
            }
            Ok(None) => break,
            Err(e) => {
                return Err(ReadFail::Bad(Error::Protocol(format!(
                    "reading a {}-byte payload: {e}",
                    header.payload_len
                ))))
            }
        }
    }
    Ok((header, hbytes.len(), payload))
}

/// The OK verdicts of one connection that wait to be sent together.
#[derive(Default)]
pub(super) struct OkVerdicts {
    streams: Mutex<Vec<SendStream>>,
    ready: tokio::sync::Notify,
}

impl OkVerdicts {
    /// Queues the OK verdict of the frame that came on `send`'s stream.
    fn push(&self, send: SendStream) {
        self.streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(send);
        self.ready.notify_one();
    }
}

/// Sends the queued OK verdicts of `conn`, [`OK_VERDICT_DELAY`] after the first of each batch,
/// until the connection ends (a sender still waiting then sends the frame again on the next
/// connection, where it is answered as a copy).
pub(super) async fn send_ok_verdicts(conn: Connection, oks: Arc<OkVerdicts>) {
    loop {
        tokio::select! {
            () = oks.ready.notified() => {}
            _ = conn.closed() => return,
        }
        tokio::time::sleep(OK_VERDICT_DELAY).await;
        let due = std::mem::take(&mut *oks.streams.lock().unwrap_or_else(|p| p.into_inner()));
        for mut send in due {
            answer(&mut send, VERDICT_OK).await;
        }
    }
}

async fn answer(send: &mut SendStream, verdict: u8) {
    // Ahead of this side's own data: the sender holds the frame until the verdict.
    let _ = send.set_priority(super::CONTROL_PRIORITY);
    let _ = send.write_all(&[verdict]).await;
    let _ = send.finish();
}

/// Receives one stream-lane frame (its magic already read), answers the sender's copy with a
/// verdict (an OK through `oks`) and files the frame, or its final failure, in the mailbox.
/// Returns the sender's rank once the frame is filed (`None` while a resend is awaited). An
/// error means the peer cannot be trusted any more: the caller fails every wait on it.
pub(super) async fn receive_checked(
    me: &Weak<QuicTransport>,
    mut send: SendStream,
    mut recv: RecvStream,
    resends: &Resends,
    oks: &OkVerdicts,
    magic: &[u8],
) -> Result<Option<usize>> {
    let (header, hlen, payload) = match read_frame(&mut recv, magic).await {
        Ok(f) => f,
        Err(ReadFail::Bad(e)) => return Err(e),
        Err(ReadFail::Damaged(e)) => {
            let Some(t) = me.upgrade() else {
                return Ok(None);
            };
            t.stats.corrupt_frames.fetch_add(1, Ordering::Relaxed);
            let n = resends.bad_headers.fetch_add(1, Ordering::AcqRel) + 1;
            if n > t.cfg.resend_limit {
                answer(&mut send, VERDICT_GIVE_UP).await;
                return Err(Error::Protocol(format!(
                    "{n} frame headers in a row failed their checksum ({e}); resend limit {}",
                    t.cfg.resend_limit
                )));
            }
            let _ = recv.stop(quinn::VarInt::from_u32(0));
            answer(&mut send, VERDICT_RESEND).await;
            return Ok(None);
        }
    };
    resends.bad_headers.store(0, Ordering::Release);
    let Some(t) = me.upgrade() else {
        return Ok(None);
    };
    let src = header.src as usize;
    if src >= t.world {
        return Err(Error::Protocol(format!(
            "frame from rank {src} in a world of {}",
            t.world
        )));
    }
    let key = MsgKey::of(&header);
    let lock = || resends.failing.lock().unwrap_or_else(|p| p.into_inner());
    let mut payload = payload;
    if let Some(bit) = t.receive_corruption_bit(payload.len()) {
        payload.flip_bit(bit);
    }
    match payload.verify(&header) {
        Ok(()) => {
            lock().remove(&key);
            t.stats.frames_received.fetch_add(1, Ordering::Relaxed);
            t.stats
                .bytes_received
                .fetch_add((hlen + payload.len()) as u64, Ordering::Relaxed);
            // Filed before the verdict is written: the operation waiting for it goes first.
            // A copy of a frame filed before (its verdict was lost with a connection) is
            // dropped, and answered OK so that its sender lets go of it.
            let filed = t.mailbox.dispatch(Frame { header, payload });
            oks.push(send);
            if !filed {
                return Ok(None);
            }
        }
        Err(e) => {
            t.stats.corrupt_frames.fetch_add(1, Ordering::Relaxed);
            let failures = {
                let mut failing = lock();
                if failing.len() >= FAILING_FRAMES && !failing.contains_key(&key) {
                    return Err(Error::Protocol(format!(
                        "rank {src} has {FAILING_FRAMES} frames failing their checksum at once"
                    )));
                }
                let n = failing.entry(key).or_insert(0);
                *n += 1;
                *n
            };
            let limit = t.cfg.resend_limit;
            if failures <= limit {
                answer(&mut send, VERDICT_RESEND).await;
                return Ok(None);
            }
            lock().remove(&key);
            answer(&mut send, VERDICT_GIVE_UP).await;
            t.mailbox.deliver(
                key,
                Err(Error::Protocol(format!(
                    "{e}; it failed {failures} times and {limit} resends did not repair it (resend limit {limit})"
                ))),
            );
        }
    }
    Ok(Some(src))
}
