//! Byte buffers reused for the frames a rank copies: the copies of sent frames it keeps until
//! their receiver's verdict, and the pieces a shared-memory reader copies out of its ring.
//!
//! A fresh allocation of a frame's size is fresh pages: the copy into it then pays a page
//! fault, the kernel's zeroing and the memory cgroup's accounting for every 4 KiB, which
//! measured as much CPU as the copy itself (a 64 MiB all-reduce between two processes: 7 %
//! of one rank's samples over QUIC, 14 % over shared memory, in page faults under those
//! copies). A buffer returned to the pool keeps its pages; the next copy writes into them.

use bytes::Bytes;
use std::sync::{Arc, Mutex, PoisonError, Weak};

/// Frees buffers kept for reuse, up to a count and a size each.
#[derive(Debug, Clone)]
pub struct BufferPool {
    inner: Arc<Shelf>,
}

#[derive(Debug)]
struct Shelf {
    free: Mutex<Vec<Vec<u8>>>,
    max_buffers: usize,
    max_bytes: usize,
}

impl BufferPool {
    /// A pool that keeps at most `max_buffers` buffers of at most `max_bytes` each.
    pub fn new(max_buffers: usize, max_bytes: usize) -> BufferPool {
        BufferPool {
            inner: Arc::new(Shelf {
                free: Mutex::new(Vec::with_capacity(max_buffers)),
                max_buffers,
                max_bytes,
            }),
        }
    }

    /// A copy of `data`, in a buffer from the pool when one large enough is free. The
    /// buffer goes back to the pool when the last clone of the returned `Bytes` is dropped.
    /// Data larger than the pool's buffers is copied into an allocation of its own.
    pub fn copy(&self, data: &[u8]) -> Bytes {
        if data.len() > self.inner.max_bytes {
            return Bytes::copy_from_slice(data);
        }
        let mut buf = self.buffer(data.len());
        buf.extend_from_slice(data);
        self.wrap(buf)
    }

    /// An empty buffer with room for at least `capacity` bytes: a free one from the pool
    /// when one is large enough, else a new one.
    pub fn buffer(&self, capacity: usize) -> Vec<u8> {
        let reused = if capacity <= self.inner.max_bytes {
            let mut free = self.inner.lock();
            free.iter()
                .rposition(|b| b.capacity() >= capacity)
                .map(|i| free.swap_remove(i))
        } else {
            None
        };
        match reused {
            Some(mut b) => {
                b.clear();
                b
            }
            None => Vec::with_capacity(capacity),
        }
    }

    /// `buf` as `Bytes` that give it back to the pool (if it has room) when the last clone
    /// is dropped.
    pub fn wrap(&self, buf: Vec<u8>) -> Bytes {
        Bytes::from_owner(Loan {
            buf,
            home: Arc::downgrade(&self.inner),
        })
    }

    /// Buffers waiting in the pool.
    pub fn idle(&self) -> usize {
        self.inner.lock().len()
    }
}

impl Shelf {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Vec<u8>>> {
        // A buffer list cannot be left half-changed by a panic: keep using it.
        self.free.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A buffer lent out inside a `Bytes`; it returns to its pool when dropped, if the pool
/// still exists and has room.
struct Loan {
    buf: Vec<u8>,
    home: Weak<Shelf>,
}

impl AsRef<[u8]> for Loan {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Loan {
    fn drop(&mut self) {
        let Some(shelf) = self.home.upgrade() else {
            return;
        };
        if self.buf.capacity() > shelf.max_bytes {
            return;
        }
        let mut free = shelf.lock();
        if free.len() < shelf.max_buffers {
            free.push(std::mem::take(&mut self.buf));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_returned_buffer_is_reused_and_holds_the_new_bytes() {
        let pool = BufferPool::new(2, 1 << 20);
        let a = pool.copy(&[7u8; 1000]);
        assert_eq!(&a[..], &[7u8; 1000][..]);
        let first = a.as_ptr();
        let clone = a.clone();
        drop(a);
        assert_eq!(pool.idle(), 0, "a clone still holds it");
        drop(clone);
        assert_eq!(pool.idle(), 1);
        let b = pool.copy(&[9u8; 600]);
        assert_eq!(b.as_ptr(), first, "the same memory, reused");
        assert_eq!(&b[..], &[9u8; 600][..]);
        assert_eq!(pool.idle(), 0);
    }

    #[test]
    fn the_pool_keeps_no_more_than_its_count_and_size() {
        let pool = BufferPool::new(2, 4096);
        let held: Vec<Bytes> = (0..4u8).map(|i| pool.copy(&[i; 100])).collect();
        drop(held);
        assert_eq!(pool.idle(), 2);
        // Larger than the pool's buffers: copied, never kept.
        let big = pool.copy(&[1u8; 8192]);
        assert_eq!(big.len(), 8192);
        drop(big);
        assert_eq!(pool.idle(), 2);
        // A small buffer is not handed out for data it cannot hold without growing.
        let small = BufferPool::new(1, 4096);
        drop(small.copy(&[1u8; 10]));
        let grown = small.copy(&[2u8; 4000]);
        assert_eq!(&grown[..], &[2u8; 4000][..]);
    }

    #[test]
    fn a_filled_buffer_goes_back_when_its_bytes_are_dropped() {
        let pool = BufferPool::new(4, 1 << 16);
        let mut b = pool.buffer(1000);
        assert!(b.is_empty() && b.capacity() >= 1000);
        b.extend_from_slice(&[3u8; 1000]);
        let bytes = pool.wrap(b);
        assert_eq!(&bytes[..], &[3u8; 1000][..]);
        let at = bytes.as_ptr();
        drop(bytes);
        let again = pool.buffer(500);
        assert!(again.is_empty(), "a reused buffer comes back empty");
        assert_eq!(again.as_ptr(), at);
        // Larger than the pool keeps: a new buffer, never shelved.
        let huge = pool.buffer(1 << 20);
        assert!(huge.capacity() >= 1 << 20);
        drop(pool.wrap(huge));
        assert_eq!(pool.idle(), 0);
    }

    #[test]
    fn a_buffer_outliving_its_pool_is_simply_freed() {
        let pool = BufferPool::new(1, 1024);
        let b = pool.copy(b"kept");
        drop(pool);
        assert_eq!(&b[..], b"kept");
        drop(b);
    }
}
