//! Reading a local peer's memory directly (Linux cross-memory attach, `process_vm_readv`):
//! one copy per byte, by the kernel, from the peer's tensor into ours, with no ring between.
//!
//! The kernel allows it when the reader could ptrace the peer: same user, the peer dumpable,
//! and (where Yama is on) `ptrace_scope` 0. Containers may forbid the call outright (seccomp).
//! Whoever uses it must therefore cope with [`PeerReadError::Refused`] by taking another path.

use std::collections::HashSet;
use std::io;
use std::sync::Mutex;

/// Why a read of a peer's memory failed.
#[derive(Debug, thiserror::Error)]
pub enum PeerReadError {
    /// The kernel does not let this process read the peer's memory (EPERM, EACCES, ENOSYS:
    /// another user, ptrace restrictions, a seccomp filter): use the shared-memory rings.
    #[error("reading pid {pid}'s memory is not allowed here: {source}")]
    Refused {
        /// The peer's process id.
        pid: u32,
        /// What the kernel said.
        source: io::Error,
    },
    /// The peer's process is gone (ESRCH).
    #[error("pid {pid} is gone")]
    Gone {
        /// The peer's process id.
        pid: u32,
    },
    /// The range is not mapped in the peer (EFAULT): it announced a wrong address.
    #[error("pid {pid} has no {len} bytes mapped at {addr:#x}")]
    BadAddress {
        /// The peer's process id.
        pid: u32,
        /// The address it announced.
        addr: u64,
        /// Bytes asked for.
        len: usize,
    },
    /// Any other failure of the call.
    #[error("reading pid {pid}'s memory failed: {source}")]
    Other {
        /// The peer's process id.
        pid: u32,
        /// What the kernel said.
        source: io::Error,
    },
}

/// Copies `dst.len()` bytes at address `addr` of process `pid` into `dst`.
pub fn read(pid: u32, addr: u64, dst: &mut [u8]) -> Result<(), PeerReadError> {
    let mut done = 0usize;
    // The kernel may copy less than asked (a partial read stops at a page it cannot reach,
    // or after a signal); go on from where it stopped, and call a read that makes no
    // progress a bad address.
    while done < dst.len() {
        let at = addr
            .checked_add(done as u64)
            .ok_or(PeerReadError::BadAddress {
                pid,
                addr,
                len: dst.len(),
            })?;
        let local = libc::iovec {
            iov_base: dst[done..].as_mut_ptr().cast(),
            iov_len: dst.len() - done,
        };
        let remote = libc::iovec {
            iov_base: at as usize as *mut libc::c_void,
            iov_len: dst.len() - done,
        };
        // SAFETY: `local` describes memory we own exclusively (`dst`), valid for its length;
        // `remote` is only read by the kernel, in the other process, which checks it.
        let n = unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote, 1, 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EPERM | libc::EACCES | libc::ENOSYS) => {
                    PeerReadError::Refused { pid, source: e }
                }
                Some(libc::ESRCH) => PeerReadError::Gone { pid },
                Some(libc::EFAULT) => PeerReadError::BadAddress {
                    pid,
                    addr,
                    len: dst.len(),
                },
                _ => PeerReadError::Other { pid, source: e },
            });
        }
        if n == 0 {
            return Err(PeerReadError::BadAddress {
                pid,
                addr,
                len: dst.len(),
            });
        }
        done += n as usize;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process_exactly_at_any_offset_and_length() {
        let src: Vec<u8> = (0..100_003u32).map(|i| (i * 7 + 3) as u8).collect();
        let me = std::process::id();
        for (off, len) in [
            (0, 0),
            (0, 1),
            (5, 4096),
            (17, 100_003 - 17),
            (99_000, 1003),
        ] {
            let mut dst = vec![0u8; len];
            read(me, src.as_ptr() as u64 + off as u64, &mut dst).expect("own memory");
            assert_eq!(dst, src[off..off + len]);
        }
    }

    #[test]
    fn an_unmapped_address_is_a_bad_address_not_a_crash() {
        let mut dst = vec![0u8; 64];
        // The first page is never mapped in a Linux process.
        match read(std::process::id(), 8, &mut dst) {
            Err(PeerReadError::BadAddress {
                addr: 8, len: 64, ..
            }) => {}
            other => panic!("expected BadAddress, got {other:?}"),
        }
        match read(std::process::id(), u64::MAX - 8, &mut dst) {
            Err(PeerReadError::BadAddress { .. }) => {}
            other => panic!("expected BadAddress, got {other:?}"),
        }
    }

    #[test]
    fn a_process_that_is_gone_is_reported_gone() {
        let mut child = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        let pid = child.id();
        child.wait().expect("reap");
        let mut dst = vec![0u8; 8];
        match read(pid, 4096, &mut dst) {
            Err(PeerReadError::Gone { pid: p }) => assert_eq!(p, pid),
            other => panic!("expected Gone, got {other:?}"),
        }
    }
}

/// The sets of local peers, `(rank, pid)` in member order, whose tensors this process has
/// agreed with them to read directly. What the agreement's probe tests (the kernel's
/// permission to read a process) does not change while those processes live, so a later
/// operation among the same processes may skip it when every member remembers the same.
#[derive(Debug, Default)]
pub struct KnownReads {
    sets: Mutex<HashSet<Vec<(usize, u32)>>>,
}

/// Sets remembered at most; past it, the memory starts again (the sets are re-agreed).
const KNOWN_SETS: usize = 256;

impl KnownReads {
    /// Whether reads of exactly these peers were agreed before.
    pub fn knows(&self, peers: &[(usize, u32)]) -> bool {
        let sets = self.sets.lock().unwrap_or_else(|p| p.into_inner());
        sets.contains(peers)
    }

    /// Remembers that reads of these peers were agreed.
    pub fn remember(&self, peers: &[(usize, u32)]) {
        let mut sets = self.sets.lock().unwrap_or_else(|p| p.into_inner());
        if sets.len() >= KNOWN_SETS {
            sets.clear();
        }
        sets.insert(peers.to_vec());
    }

    /// Forgets every set (a peer's policy changed).
    pub fn forget(&self) {
        self.sets.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}
