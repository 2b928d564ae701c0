//! One shared-memory channel between two processes of one host: two rings (one per
//! direction), a Unix stream that set them up and whose hang-up says the peer is gone, a
//! reader thread that files what arrives, and an async writer.
//!
//! Copies per byte: the sender copies the payload into its ring (one), the reader thread
//! copies it out into the pieces of the mailbox's `Payload` (two), computing the CRC32C of
//! each piece while it is still in cache. Nothing else touches the bytes: the collective then
//! reduces or copies straight from those pieces into the caller's tensor, as it does for QUIC.

use super::ring::{Reader, Ring, Writer, CONTROL};
use super::sys::{self, Mapping};
use crate::error::{Error, Result};
use crate::transport::buffer_pool::BufferPool;
use crate::transport::Payload;
use crate::wire::{Header, HEADER_FIXED};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the reader thread reports to the transport.
pub(crate) enum Event {
    /// A frame whose header and payload passed their checksums.
    Frame(Header, Payload),
    /// A frame whose payload failed its checksum (the header is intact, the ring in step).
    Damaged(Header, Error),
    /// The channel cannot be read any more (a damaged header, a bad position): the peer
    /// cannot be trusted.
    Broken(Error),
    /// The peer's end hung up without saying goodbye: its process is gone.
    HungUp,
}

/// Where the reader thread sends its events (the transport's handler; it holds only a weak
/// reference to the transport).
pub(crate) type Sink = Box<dyn Fn(Event) + Send + 'static>;

/// The pieces a finished setup hands over.
pub(crate) struct Parts {
    pub(super) writer: Writer,
    pub(super) reader: Reader,
    pub(super) sock: UnixStream,
}

const SETUP_MAGIC: [u8; 4] = *b"MCPS";
const SETUP_VERSION: u8 = 1;
/// Bytes of the setup message before an optional reason.
const SETUP_LEN: usize = 4 + 1 + 4 + 8 + 1;
/// How long one setup exchange may take on the socket.
pub(crate) const SETUP_TIMEOUT: Duration = Duration::from_secs(5);

/// Largest piece the writer publishes at once and the reader copies into one buffer: the
/// reader starts on a frame while the writer is still copying it in.
const PIECE: usize = 256 << 10;
/// Pieces' buffers a reader keeps for reuse once the collective is done with them (at most
/// 16 MiB per peer, idle).
const PIECE_BUFFERS: usize = 64;
/// How long a reader spins on an empty ring before it sleeps on its eventfd.
const READER_SPIN: Duration = Duration::from_micros(20);
/// How long a sleeping side waits before it looks at its stop flag or the peer again.
const NAP_MS: i32 = 50;

fn make_ring(len: usize) -> Result<(Ring, [OwnedFd; 3])> {
    let mem = sys::memfd_segment(len)?;
    let (data, room) = (sys::eventfd()?, sys::eventfd()?);
    let ring = Ring::new(
        Mapping::new(&mem, len)?,
        data.try_clone()?,
        room.try_clone()?,
    )?;
    Ok((ring, [mem, data, room]))
}

fn receive_ring(fds: &mut std::vec::IntoIter<OwnedFd>, len: usize) -> Result<Ring> {
    let (Some(mem), Some(data), Some(room)) = (fds.next(), fds.next(), fds.next()) else {
        return Err(Error::Protocol(
            "a shared-memory setup message without its descriptors".into(),
        ));
    };
    sys::check_segment(&mem, len)?;
    Ring::new(Mapping::new(&mem, len)?, data, room)
}

fn setup_message(rank: usize, ring_len: usize, refusal: Option<&str>) -> Vec<u8> {
    let mut m = Vec::with_capacity(SETUP_LEN + 200);
    m.extend_from_slice(&SETUP_MAGIC);
    m.push(SETUP_VERSION);
    m.extend_from_slice(&(rank as u32).to_le_bytes());
    m.extend_from_slice(&(ring_len as u64).to_le_bytes());
    m.push(u8::from(refusal.is_some()));
    if let Some(r) = refusal {
        let mut end = r.len().min(400);
        while !r.is_char_boundary(end) {
            end -= 1;
        }
        m.extend_from_slice(&r.as_bytes()[..end]);
    }
    m
}

/// The connecting side (the higher rank): checks that the listener is the process that
/// rendezvoused as `peer_pid` under our user, makes both rings (`ring_len` bytes each,
/// control page included) and hands them over. A failure to make the rings is told to the
/// listener (so that it falls back at once) and returned.
pub(crate) fn dial(
    sock: UnixStream,
    my_rank: usize,
    peer_pid: u32,
    ring_len: usize,
) -> Result<Parts> {
    sock.set_read_timeout(Some(SETUP_TIMEOUT))?;
    sock.set_write_timeout(Some(SETUP_TIMEOUT))?;
    let (pid, uid) = sys::peer_cred(&sock)?;
    if uid != sys::euid() || pid != peer_pid {
        return Err(Error::Authentication {
            peer: format!("the shared-memory socket of pid {pid}"),
            detail: format!(
                "it belongs to uid {uid} and pid {pid}; expected uid {} and the pid {peer_pid} that rendezvoused",
                sys::euid()
            ),
        });
    }
    let rings = make_ring(ring_len).and_then(|a| Ok((a, make_ring(ring_len)?)));
    let ((out, out_fds), (inn, in_fds)) = match rings {
        Ok(r) => r,
        Err(e) => {
            let _ = sys::send_with_fds(
                &sock,
                &setup_message(my_rank, ring_len, Some(&e.to_string())),
                &[],
            );
            return Err(e);
        }
    };
    let fds: Vec<RawFd> = out_fds
        .iter()
        .chain(in_fds.iter())
        .map(|f| f.as_raw_fd())
        .collect();
    sys::send_with_fds(&sock, &setup_message(my_rank, ring_len, None), &fds)?;
    let mut answer = [0u8; 512];
    let (n, _) = sys::recv_with_fds(&sock, &mut answer)?;
    match n {
        0 => Err(Error::Io(
            "the peer closed the shared-memory socket during setup".into(),
        )),
        _ if answer[0] == 1 => Ok(Parts {
            writer: Writer::new(out),
            reader: Reader::new(inn),
            sock,
        }),
        _ => Err(Error::Io(format!(
            "the peer refused shared memory: {}",
            String::from_utf8_lossy(&answer[1..n])
        ))),
    }
}

/// The listening side: reads the setup message of a connected process, asks `check` whether
/// that rank may connect with the credentials it has (pid, uid), maps its rings and says yes.
/// Returns the connecting rank and, when its rings work, the parts (the rank with an error
/// when it could not make them or they fail here; `None` as rank when it is not to be trusted
/// at all).
pub(crate) fn answer(
    sock: UnixStream,
    check: impl FnOnce(usize, u32, u32) -> Result<()>,
) -> std::result::Result<(usize, Parts), (Option<usize>, Error)> {
    let fail = |rank: Option<usize>| move |e: Error| (rank, e);
    sock.set_read_timeout(Some(SETUP_TIMEOUT))
        .map_err(|e| (None, e.into()))?;
    sock.set_write_timeout(Some(SETUP_TIMEOUT))
        .map_err(|e| (None, e.into()))?;
    let (pid, uid) = sys::peer_cred(&sock).map_err(fail(None))?;
    let mut buf = [0u8; SETUP_LEN + 512];
    let (n, fds) = sys::recv_with_fds(&sock, &mut buf).map_err(fail(None))?;
    if n < SETUP_LEN || buf[..4] != SETUP_MAGIC || buf[4] != SETUP_VERSION {
        return Err((
            None,
            Error::Protocol(format!(
                "a bad shared-memory setup message ({n} bytes) from pid {pid}"
            )),
        ));
    }
    let rank = u32::from_le_bytes([buf[5], buf[6], buf[7], buf[8]]) as usize;
    let mut len8 = [0u8; 8];
    len8.copy_from_slice(&buf[9..17]);
    let ring_len = usize::try_from(u64::from_le_bytes(len8)).unwrap_or(usize::MAX);
    check(rank, pid, uid).map_err(fail(None))?;
    if buf[17] != 0 {
        return Err((
            Some(rank),
            Error::Io(format!(
                "rank {rank} could not set up shared memory: {}",
                String::from_utf8_lossy(&buf[SETUP_LEN..n])
            )),
        ));
    }
    if ring_len > super::MAX_RING_BYTES + CONTROL {
        return Err((
            Some(rank),
            Error::Protocol(format!("rank {rank} announced rings of {ring_len} bytes")),
        ));
    }
    let mut fds = fds.into_iter();
    // The connector's outgoing ring is our incoming one.
    let rings = receive_ring(&mut fds, ring_len)
        .and_then(|inn| Ok((inn, receive_ring(&mut fds, ring_len)?)));
    match rings {
        Ok((inn, out)) => {
            sys::send_with_fds(&sock, &[1], &[]).map_err(fail(Some(rank)))?;
            Ok((
                rank,
                Parts {
                    writer: Writer::new(out),
                    reader: Reader::new(inn),
                    sock,
                },
            ))
        }
        Err(e) => {
            let mut no = vec![0u8];
            no.extend_from_slice(e.to_string().as_bytes());
            no.truncate(400);
            let _ = sys::send_with_fds(&sock, &no, &[]);
            Err((Some(rank), e))
        }
    }
}

/// A working channel to one local peer.
pub(crate) struct Link {
    writer: tokio::sync::Mutex<Writer>,
    /// The writer's wake-up, registered with the runtime.
    room: tokio::io::unix::AsyncFd<OwnedFd>,
    /// Set when a frame could not be written whole: later sends go over QUIC.
    poisoned: AtomicBool,
    stop: Arc<AtomicBool>,
    reader: Option<std::thread::JoinHandle<()>>,
    reader_id: std::thread::ThreadId,
    /// Keeps our end of the socket open: the peer learns of our exit when it closes.
    _sock: UnixStream,
}

impl Link {
    /// Starts the reader thread (it files into `sink`) and returns the channel. Call inside
    /// the runtime.
    pub(crate) fn start(parts: Parts, peer: usize, sink: Sink) -> Result<Link> {
        let Parts {
            writer,
            reader,
            sock,
        } = parts;
        sock.set_nonblocking(true)?;
        // SAFETY: the OwnedFd is owned by the AsyncFd for its whole life and always returns
        // the same open descriptor.
        let room = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(
                writer.ring().room_fd().try_clone()?,
                tokio::io::Interest::READABLE,
            )
        }
        .map_err(|e| Error::Io(format!("registering the shared-memory wake-up: {}", e)))?;
        let stop = Arc::new(AtomicBool::new(false));
        let watch = sock.try_clone()?;
        let stop2 = stop.clone();
        let reader = std::thread::Builder::new()
            .name(format!("mcp-shm-rx-{peer}"))
            .spawn(move || read_loop(reader, watch, &stop2, &sink))?;
        let reader_id = reader.thread().id();
        Ok(Link {
            reader_id,
            writer: tokio::sync::Mutex::new(writer),
            room,
            poisoned: AtomicBool::new(false),
            stop,
            reader: Some(reader),
            _sock: sock,
        })
    }

    /// Hangs up now (the group was abandoned): the peer's reader sees it at once; nothing
    /// more is sent here.
    pub(crate) fn hang_up(&self) {
        self.poisoned.store(true, Ordering::Release);
        self.stop.store(true, Ordering::Release);
        let _ = self._sock.shutdown(std::net::Shutdown::Both);
    }

    /// Whether sends may still use this channel.
    pub(crate) fn usable(&self) -> bool {
        !self.poisoned.load(Ordering::Acquire)
    }

    /// Writes one frame into the ring, waiting for room while the ring is full; `lost` says
    /// whether the peer was lost meanwhile (then the send fails with that error). A send
    /// cancelled half-way pads the frame out (the peer files it as damaged), so the ring
    /// stays in step.
    pub(crate) async fn send(
        &self,
        header: &Header,
        payload: &[u8],
        lost: &(dyn Fn() -> Option<Error> + Sync),
    ) -> Result<usize> {
        let mut hbytes = Vec::with_capacity(HEADER_FIXED + 8 * header.spec.shape.len());
        header.encode(&mut hbytes)?;
        let total = hbytes.len() + payload.len();
        let mut w = self.writer.lock().await;
        if !self.usable() {
            return Err(Error::Io("the shared-memory channel is out of step".into()));
        }
        let mut frame = Pending {
            link: self,
            writer: &mut w,
            left: total,
        };
        frame.write(&hbytes, lost).await?;
        frame.write(payload, lost).await?;
        Ok(total)
    }

    /// Writes the last frame (a goodbye) and marks the ring closed; waits at most `limit`.
    pub(crate) async fn close_with(&self, header: &Header, payload: &[u8], limit: Duration) {
        let never = || None;
        if tokio::time::timeout(limit, self.send(header, payload, &never))
            .await
            .is_ok_and(|r| r.is_ok())
        {
            self.writer.lock().await.close();
        }
    }

    /// Waits until the reader freed some room (spins briefly first), or `lost` says the peer
    /// is gone.
    async fn wait_room(&self, w: &Writer, lost: &(dyn Fn() -> Option<Error> + Sync)) -> Result<()> {
        for _ in 0..64 {
            if w.room()? > 0 {
                return Ok(());
            }
            std::hint::spin_loop();
        }
        for _ in 0..4 {
            tokio::task::yield_now().await;
            if w.room()? > 0 {
                return Ok(());
            }
        }
        loop {
            w.set_asleep(true);
            if w.room()? > 0 {
                w.set_asleep(false);
                return Ok(());
            }
            let ready =
                tokio::time::timeout(Duration::from_millis(NAP_MS as u64), self.room.readable())
                    .await;
            if let Ok(Ok(mut guard)) = ready {
                sys::drain(self.room.get_ref().as_raw_fd());
                guard.clear_ready();
            }
            w.set_asleep(false);
            if w.room()? > 0 {
                return Ok(());
            }
            if let Some(e) = lost() {
                return Err(e);
            }
            if self.stop.load(Ordering::Acquire) {
                return Err(Error::Closed("the shared-memory channel closed".into()));
            }
        }
    }
}

/// A frame being written: on drop before its last byte (the send was cancelled), the rest is
/// written as zeros so that the peer's reader stays in step (the payload then fails its
/// checksum there); if that cannot finish in a few seconds the channel is given up.
struct Pending<'a> {
    link: &'a Link,
    writer: &'a mut Writer,
    left: usize,
}

impl Pending<'_> {
    async fn write(
        &mut self,
        mut src: &[u8],
        lost: &(dyn Fn() -> Option<Error> + Sync),
    ) -> Result<()> {
        while !src.is_empty() {
            let piece = &src[..src.len().min(PIECE)];
            let n = self.writer.write_some(piece)?;
            self.left -= n;
            src = &src[n..];
            if n == 0 {
                self.link.wait_room(self.writer, lost).await?;
            }
        }
        Ok(())
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if self.left == 0 {
            return;
        }
        let zeros = [0u8; 4096];
        let deadline = Instant::now() + Duration::from_secs(2);
        while self.left > 0 && Instant::now() < deadline {
            match self.writer.write_some(&zeros[..self.left.min(zeros.len())]) {
                Ok(0) => {
                    let room = self.writer.ring().room_fd().as_raw_fd();
                    self.writer.set_asleep(true);
                    if self.writer.room().unwrap_or(0) == 0 {
                        sys::poll2(room, room, 5);
                    }
                    self.writer.set_asleep(false);
                }
                Ok(n) => self.left -= n,
                Err(_) => break,
            }
        }
        if self.left > 0 {
            self.link.poisoned.store(true, Ordering::Release);
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.reader.take() {
            // The reader naps at most NAP_MS between looks at the flag. (When the reader
            // itself drops the last reference, it ends on its own after this.)
            if std::thread::current().id() != self.reader_id {
                let _ = h.join();
            }
        }
    }
}

/// The reader thread: frames out of the ring into `sink`, until the ring is closed after a
/// goodbye, the peer hangs up, the channel breaks or `stop` is set.
fn read_loop(mut reader: Reader, sock: UnixStream, stop: &AtomicBool, sink: &Sink) {
    let pieces = BufferPool::new(PIECE_BUFFERS, PIECE);
    loop {
        match read_frame(&mut reader, &sock, stop, &pieces) {
            Ok(ev) => sink(ev),
            Err(End::Quiet) => return,
            Err(End::HungUp) => {
                sink(Event::HungUp);
                return;
            }
            Err(End::Broken(e)) => {
                sink(Event::Broken(e));
                return;
            }
        }
    }
}

/// Why the reader stops.
enum End {
    /// The stop flag, or the ring was closed after the writer's goodbye.
    Quiet,
    /// The peer hung up.
    HungUp,
    /// The channel cannot be read any more.
    Broken(Error),
}

/// Waits until the ring has bytes: spins for a moment, then sleeps on the eventfd, watching
/// the socket for the peer's hang-up.
fn wait_data(
    reader: &Reader,
    sock: &UnixStream,
    stop: &AtomicBool,
) -> std::result::Result<(), End> {
    let spin_until = Instant::now() + READER_SPIN;
    loop {
        if reader.available().map_err(End::Broken)? > 0 {
            return Ok(());
        }
        if Instant::now() >= spin_until {
            break;
        }
        std::hint::spin_loop();
    }
    loop {
        reader.set_asleep(true);
        if reader.available().map_err(End::Broken)? > 0 {
            reader.set_asleep(false);
            return Ok(());
        }
        let data = reader.ring().data_fd().as_raw_fd();
        let p = sys::poll2(data, sock.as_raw_fd(), NAP_MS);
        if p.first {
            sys::drain(data);
        }
        reader.set_asleep(false);
        if reader.available().map_err(End::Broken)? > 0 {
            return Ok(());
        }
        if reader.closed() || stop.load(Ordering::Acquire) {
            return Err(End::Quiet);
        }
        if p.second {
            return Err(End::HungUp);
        }
    }
}

fn read_exact(
    reader: &mut Reader,
    sock: &UnixStream,
    stop: &AtomicBool,
    dst: &mut [u8],
) -> std::result::Result<(), End> {
    let mut off = 0;
    while off < dst.len() {
        let n = reader.read_some(&mut dst[off..]).map_err(End::Broken)?;
        off += n;
        if n == 0 {
            wait_data(reader, sock, stop)?;
        }
    }
    Ok(())
}

/// Reads one frame (a damaged payload is an event too: the ring is still in step).
fn read_frame(
    reader: &mut Reader,
    sock: &UnixStream,
    stop: &AtomicBool,
    pieces: &BufferPool,
) -> std::result::Result<Event, End> {
    let mut fixed = [0u8; HEADER_FIXED];
    read_exact(reader, sock, stop, &mut fixed)?;
    let shape_len = Header::shape_len(&fixed).map_err(End::Broken)?;
    let mut hbytes = fixed.to_vec();
    hbytes.resize(HEADER_FIXED + shape_len, 0);
    read_exact(reader, sock, stop, &mut hbytes[HEADER_FIXED..])?;
    let header = Header::decode(&hbytes).map_err(End::Broken)?;
    if header.payload_len > crate::transport::quic::MAX_FRAME_PAYLOAD {
        return Err(End::Broken(Error::Protocol(format!(
            "a shared-memory frame announces {} payload bytes",
            header.payload_len
        ))));
    }
    let mut payload = Payload::new();
    let mut crc = 0u32;
    let mut left = header.payload_len as usize;
    while left > 0 {
        let want = left.min(PIECE);
        let mut piece = pieces.buffer(want);
        while piece.len() < want {
            let n = reader
                .read_into_spare(&mut piece, want)
                .map_err(End::Broken)?;
            if n == 0 {
                wait_data(reader, sock, stop)?;
            }
        }
        crc = crc32c::crc32c_append(crc, &piece);
        left -= piece.len();
        payload.push(pieces.wrap(piece));
    }
    if crc != header.payload_crc {
        let e = Error::Protocol(format!(
            "payload checksum mismatch from rank {} in {} (seq {}, step {}, chunk {}) on the shared-memory channel: corrupted in memory",
            header.src,
            header.kind.op_name(),
            header.seq,
            header.step,
            header.chunk
        ));
        return Ok(Event::Damaged(header, e));
    }
    Ok(Event::Frame(header, payload))
}
