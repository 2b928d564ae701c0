//! A caller-owned byte region that an operation reads and writes in place.

use std::ops::Range;

/// A pointer and a length to memory the caller owns: a numpy array, a torch tensor, a `Vec`.
///
/// The collectives read and write it in place, from tasks on the runtime, so it carries no
/// lifetime: whoever makes one promises (in [`RawBuf::new`]) that the memory stays valid and
/// untouched by anything else until the operation using it has finished.
#[derive(Debug, Clone, Copy)]
pub struct RawBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a RawBuf is only a handle; `new`'s contract makes the memory exclusively the
// operation's while it runs, and the algorithms touch disjoint ranges from their tasks.
unsafe impl Send for RawBuf {}
// SAFETY: as above.
unsafe impl Sync for RawBuf {}

impl RawBuf {
    /// Wraps `len` bytes at `ptr`.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes (or `len == 0`) until every
    /// operation given this buffer has completed, and nothing else may access the memory
    /// meanwhile, except other operations that only read it.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> RawBuf {
        RawBuf { ptr, len }
    }

    /// Wraps a mutable slice. The caller must keep the slice alive and untouched while the
    /// operation runs, which the borrow checker cannot see through the runtime.
    ///
    /// # Safety
    /// As for [`RawBuf::new`].
    pub unsafe fn from_slice(s: &mut [u8]) -> RawBuf {
        RawBuf {
            ptr: s.as_mut_ptr(),
            len: s.len(),
        }
    }

    /// Where the memory starts in this process's address space (what a peer on this host
    /// reads it at, with [`peer_memory`](crate::transport::peer_memory)).
    pub fn address(&self) -> u64 {
        self.ptr as usize as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A shared view of `range`.
    ///
    /// # Safety
    /// No mutable view of an overlapping range may be alive at the same time.
    pub(crate) unsafe fn slice(&self, range: Range<usize>) -> &[u8] {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "range out of bounds"
        );
        if range.is_empty() {
            return &[];
        }
        // SAFETY: in bounds (checked above); validity by `new`'s contract; aliasing by ours.
        unsafe { std::slice::from_raw_parts(self.ptr.add(range.start), range.len()) }
    }

    /// A mutable view of `range`.
    ///
    /// # Safety
    /// No other view of an overlapping range may be alive at the same time.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice_mut(&self, range: Range<usize>) -> &mut [u8] {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "range out of bounds"
        );
        if range.is_empty() {
            return &mut [];
        }
        // SAFETY: in bounds (checked above); validity by `new`'s contract; aliasing by ours.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.len()) }
    }
}
