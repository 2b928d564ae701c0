//! A single-producer, single-consumer byte ring in a shared segment.
//!
//! Layout: a 4 KiB control page, then `capacity` data bytes. The control page holds, each on
//! its own cache line, `head` (bytes ever written, advanced by the writer), `tail` (bytes ever
//! read, advanced by the reader) and each side's "asleep" flag. The writer never writes more
//! than `capacity - (head - tail)` bytes, so a full ring makes it wait, never overwrite. Both
//! positions only grow (u64: no wrap in practice); the data offset is `pos % capacity`.
//!
//! Each side keeps its own position locally and reads only the other's from shared memory,
//! and checks it: a peer that writes garbage there yields an error, never an out-of-bounds
//! access.
//!
//! Wake-ups: a side about to sleep sets its flag, reads the other position again, and only
//! then sleeps on its eventfd; the other side publishes its position, then reads the flag and
//! signals the eventfd when set. Both use sequentially consistent operations, so either the
//! sleeper sees the new position or the publisher sees the flag (no lost wake-up).

use super::sys::{self, Mapping};
use crate::error::{Error, Result};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Bytes of the control page before the data.
pub(super) const CONTROL: usize = 4096;
const HEAD: usize = 0;
const READER_ASLEEP: usize = 64;
const TAIL: usize = 128;
const WRITER_ASLEEP: usize = 192;
/// Set by the writer once its last frame (a goodbye) is in the ring.
const CLOSED: usize = 256;

/// One direction's segment and its two eventfds.
pub(super) struct Ring {
    map: Mapping,
    capacity: usize,
    /// Signalled by the writer: data is available.
    data: OwnedFd,
    /// Signalled by the reader: room is available.
    room: OwnedFd,
}

impl Ring {
    /// A ring over a mapped segment of `CONTROL + capacity` bytes.
    pub(super) fn new(map: Mapping, data: OwnedFd, room: OwnedFd) -> Result<Ring> {
        let capacity = map.len().saturating_sub(CONTROL);
        if capacity == 0 {
            return Err(Error::InvalidArgument(format!(
                "a ring segment of {} bytes has no room for data",
                map.len()
            )));
        }
        Ok(Ring {
            map,
            capacity,
            data,
            room,
        })
    }

    fn word64(&self, at: usize) -> &AtomicU64 {
        // SAFETY: `at` is one of the 8-aligned offsets inside the control page, which the
        // page-aligned mapping covers; AtomicU64 has the size and alignment of u64, and the
        // memory is only ever accessed atomically.
        unsafe { &*self.map.ptr().add(at).cast::<AtomicU64>() }
    }

    fn word32(&self, at: usize) -> &AtomicU32 {
        // SAFETY: as in `word64`, for a 4-aligned offset in the control page.
        unsafe { &*self.map.ptr().add(at).cast::<AtomicU32>() }
    }

    /// The eventfd the reader sleeps on.
    pub(super) fn data_fd(&self) -> &OwnedFd {
        &self.data
    }

    /// The eventfd the writer sleeps on.
    pub(super) fn room_fd(&self) -> &OwnedFd {
        &self.room
    }

    /// Copies `src` into the data area at position `pos` (wrapping).
    fn copy_in(&self, pos: u64, src: &[u8]) {
        let off = (pos % self.capacity as u64) as usize;
        let first = src.len().min(self.capacity - off);
        // SAFETY: `off + first <= capacity` and `src.len() - first <= capacity - first`, so both
        // copies stay inside the data area; the writer protocol guarantees the reader is not
        // reading these bytes (they lie between head and tail + capacity).
        unsafe {
            let data = self.map.ptr().add(CONTROL);
            std::ptr::copy_nonoverlapping(src.as_ptr(), data.add(off), first);
            std::ptr::copy_nonoverlapping(src.as_ptr().add(first), data, src.len() - first);
        }
    }

    /// Copies bytes at position `pos` (wrapping) out into `dst`.
    fn copy_out(&self, pos: u64, dst: &mut [u8]) {
        let off = (pos % self.capacity as u64) as usize;
        let first = dst.len().min(self.capacity - off);
        // SAFETY: bounds as in `copy_in`; the bytes lie between tail and head, which the writer
        // does not touch until the reader publishes a tail beyond them.
        unsafe {
            let data = self.map.ptr().add(CONTROL);
            std::ptr::copy_nonoverlapping(data.add(off), dst.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(data, dst.as_mut_ptr().add(first), dst.len() - first);
        }
    }
}

/// The writing end of a ring: owns `head`.
pub(super) struct Writer {
    ring: Ring,
    head: u64,
}

impl Writer {
    /// The writer of a fresh ring (both positions zero).
    pub(super) fn new(ring: Ring) -> Writer {
        Writer { ring, head: 0 }
    }

    /// The ring written to.
    pub(super) fn ring(&self) -> &Ring {
        &self.ring
    }

    /// Bytes that can be written now.
    pub(super) fn room(&self) -> Result<usize> {
        let tail = self.ring.word64(TAIL).load(Ordering::Acquire);
        let used = self.head.wrapping_sub(tail);
        if used > self.ring.capacity as u64 {
            return Err(Error::Protocol(format!(
                "shared-memory ring: the reader's position {tail} is not within {} bytes behind ours ({})",
                self.ring.capacity, self.head
            )));
        }
        Ok(self.ring.capacity - used as usize)
    }

    /// Writes as much of `src` as fits now and publishes it; returns the count.
    pub(super) fn write_some(&mut self, src: &[u8]) -> Result<usize> {
        let n = self.room()?.min(src.len());
        if n == 0 {
            return Ok(0);
        }
        self.ring.copy_in(self.head, &src[..n]);
        self.head += n as u64;
        self.ring.word64(HEAD).store(self.head, Ordering::SeqCst);
        if self.ring.word32(READER_ASLEEP).load(Ordering::SeqCst) != 0 {
            sys::signal(self.ring.data.as_raw_fd());
        }
        Ok(n)
    }

    /// Marks this writer asleep (before its last look at the room, then the wait).
    pub(super) fn set_asleep(&self, asleep: bool) {
        self.ring
            .word32(WRITER_ASLEEP)
            .store(u32::from(asleep), Ordering::SeqCst);
    }

    /// Says that nothing more will be written (after a goodbye frame).
    pub(super) fn close(&self) {
        self.ring.word32(CLOSED).store(1, Ordering::SeqCst);
        sys::signal(self.ring.data.as_raw_fd());
    }
}

/// The reading end of a ring: owns `tail`.
pub(super) struct Reader {
    ring: Ring,
    tail: u64,
}

impl Reader {
    /// The reader of a fresh ring.
    pub(super) fn new(ring: Ring) -> Reader {
        Reader { ring, tail: 0 }
    }

    /// The ring read from.
    pub(super) fn ring(&self) -> &Ring {
        &self.ring
    }

    /// Bytes ready to be read now.
    pub(super) fn available(&self) -> Result<usize> {
        let head = self.ring.word64(HEAD).load(Ordering::SeqCst);
        let ready = head.wrapping_sub(self.tail);
        if ready > self.ring.capacity as u64 {
            return Err(Error::Protocol(format!(
                "shared-memory ring: the writer's position {head} is not within {} bytes ahead of ours ({})",
                self.ring.capacity, self.tail
            )));
        }
        Ok(ready as usize)
    }

    /// Reads as many bytes into `dst` as are ready (up to its length), frees their room and
    /// returns the count.
    pub(super) fn read_some(&mut self, dst: &mut [u8]) -> Result<usize> {
        let n = self.available()?.min(dst.len());
        if n == 0 {
            return Ok(0);
        }
        self.ring.copy_out(self.tail, &mut dst[..n]);
        self.tail += n as u64;
        self.ring.word64(TAIL).store(self.tail, Ordering::SeqCst);
        if self.ring.word32(WRITER_ASLEEP).load(Ordering::SeqCst) != 0 {
            sys::signal(self.ring.room.as_raw_fd());
        }
        Ok(n)
    }

    /// Appends ready bytes to `dst` until it holds `upto` (at most its capacity), without
    /// zeroing its spare capacity first; frees their room and returns the count.
    pub(super) fn read_into_spare(&mut self, dst: &mut Vec<u8>, upto: usize) -> Result<usize> {
        let upto = upto.min(dst.capacity());
        let n = self.available()?.min(upto.saturating_sub(dst.len()));
        if n == 0 {
            return Ok(0);
        }
        let off = (self.tail % self.ring.capacity as u64) as usize;
        let first = n.min(self.ring.capacity - off);
        // SAFETY: the source bytes lie between tail and head inside the data area (bounds as
        // in `copy_out`); the destination is the vector's spare capacity, at least `n` bytes,
        // fully written before `set_len` exposes it.
        unsafe {
            let data = self.ring.map.ptr().add(CONTROL);
            let out = dst.as_mut_ptr().add(dst.len());
            std::ptr::copy_nonoverlapping(data.add(off), out, first);
            std::ptr::copy_nonoverlapping(data, out.add(first), n - first);
            dst.set_len(dst.len() + n);
        }
        self.tail += n as u64;
        self.ring.word64(TAIL).store(self.tail, Ordering::SeqCst);
        if self.ring.word32(WRITER_ASLEEP).load(Ordering::SeqCst) != 0 {
            sys::signal(self.ring.room.as_raw_fd());
        }
        Ok(n)
    }

    /// Marks this reader asleep (before its last look at the data, then the wait).
    pub(super) fn set_asleep(&self, asleep: bool) {
        self.ring
            .word32(READER_ASLEEP)
            .store(u32::from(asleep), Ordering::SeqCst);
    }

    /// Whether the writer said it will write nothing more.
    pub(super) fn closed(&self) -> bool {
        self.ring.word32(CLOSED).load(Ordering::SeqCst) != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(capacity: usize) -> (Writer, Reader) {
        let fd = sys::memfd_segment(CONTROL + capacity).expect("memfd");
        let (data, room) = (
            sys::eventfd().expect("eventfd"),
            sys::eventfd().expect("eventfd"),
        );
        let dup = |fd: &OwnedFd| fd.try_clone().expect("dup");
        let w = Ring::new(
            Mapping::new(&fd, CONTROL + capacity).expect("map"),
            dup(&data),
            dup(&room),
        )
        .expect("ring");
        let r = Ring::new(
            Mapping::new(&fd, CONTROL + capacity).expect("map"),
            data,
            room,
        )
        .expect("ring");
        (Writer::new(w), Reader::new(r))
    }

    #[test]
    fn bytes_come_out_in_order_across_many_wraps() {
        // 1000 writes of odd sizes through a 4097-byte ring: every byte, in order.
        let (mut w, mut r) = ring(4097);
        let mut expected = Vec::new();
        let mut got = Vec::new();
        let mut next = 0u8;
        for i in 0..1000usize {
            let piece: Vec<u8> = (0..(i * 37) % 3000 + 1)
                .map(|_| {
                    next = next.wrapping_mul(31).wrapping_add(7);
                    next
                })
                .collect();
            let mut off = 0;
            while off < piece.len() {
                off += w.write_some(&piece[off..]).expect("write");
                let mut buf = vec![0u8; 1500];
                let n = r.read_some(&mut buf).expect("read");
                got.extend_from_slice(&buf[..n]);
            }
            expected.extend_from_slice(&piece);
        }
        let mut buf = vec![0u8; 8192];
        loop {
            let n = r.read_some(&mut buf).expect("read");
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        assert_eq!(got, expected);
    }

    #[test]
    fn a_full_ring_refuses_more_and_never_overwrites() {
        let (mut w, mut r) = ring(100);
        assert_eq!(w.write_some(&[1u8; 150]).expect("write"), 100);
        assert_eq!(w.write_some(&[2u8; 10]).expect("write"), 0);
        let mut buf = [0u8; 30];
        assert_eq!(r.read_some(&mut buf).expect("read"), 30);
        assert_eq!(buf, [1u8; 30]);
        assert_eq!(w.write_some(&[2u8; 50]).expect("write"), 30);
        let mut all = [0u8; 200];
        assert_eq!(r.read_some(&mut all).expect("read"), 100);
        assert_eq!(&all[..70], &[1u8; 70][..]);
        assert_eq!(&all[70..100], &[2u8; 30][..]);
    }

    #[test]
    fn a_garbage_position_from_the_peer_is_an_error() {
        let (w, mut r) = ring(64);
        // The "writer" claims more bytes than the ring holds.
        w.ring.word64(HEAD).store(1000, Ordering::SeqCst);
        assert!(matches!(
            r.read_some(&mut [0u8; 8]),
            Err(Error::Protocol(_))
        ));
        r.ring.word64(TAIL).store(5000, Ordering::SeqCst);
        assert!(matches!(w.room(), Err(Error::Protocol(_))));
    }

    #[test]
    fn a_sleeping_reader_is_signalled_and_an_awake_one_is_not() {
        let (mut w, r) = ring(64);
        w.write_some(&[1; 4]).expect("write");
        let p = sys::poll2(r.ring.data.as_raw_fd(), r.ring.room.as_raw_fd(), 0);
        assert!(!p.first, "no signal while the reader is awake");
        r.set_asleep(true);
        w.write_some(&[1; 4]).expect("write");
        let p = sys::poll2(r.ring.data.as_raw_fd(), r.ring.room.as_raw_fd(), 0);
        assert!(p.first, "a sleeping reader is woken");
    }
}
