//! The Linux system calls the shared-memory transport needs, each wrapped once: sealed memfd
//! segments, their mappings, eventfds, file descriptors over a Unix socket (SCM_RIGHTS), the
//! peer's credentials (SO_PEERCRED) and a poll of two descriptors.

use crate::error::{Error, Result};
use std::ffi::CStr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

fn os_err(what: &str) -> Error {
    Error::Io(format!("{what}: {}", std::io::Error::last_os_error()))
}

/// A sealed memfd of exactly `len` bytes, its pages allocated now (so that a full memory
/// limit fails here, not with SIGBUS on a later write). `MCP_SHM_FAIL=memfd` makes it fail,
/// for tests of the fallback.
pub(super) fn memfd_segment(len: usize) -> Result<OwnedFd> {
    if std::env::var("MCP_SHM_FAIL").is_ok_and(|v| v == "memfd") {
        return Err(Error::Io(
            "memfd_create: refused by MCP_SHM_FAIL=memfd".into(),
        ));
    }
    let name: &CStr = c"mcp-shm-ring";
    // SAFETY: `name` is a valid NUL-terminated string; the flags are valid.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(os_err("memfd_create"));
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let size = libc::off_t::try_from(len)
        .map_err(|_| Error::InvalidArgument(format!("a segment of {len} bytes")))?;
    // SAFETY: plain system calls on a descriptor we own.
    unsafe {
        if libc::ftruncate(fd.as_raw_fd(), size) != 0 {
            return Err(os_err(&format!("ftruncate of a {len}-byte memfd")));
        }
        let r = libc::fallocate(fd.as_raw_fd(), 0, 0, size);
        if r != 0 {
            return Err(os_err(&format!(
                "allocating {len} bytes of shared memory (fallocate)"
            )));
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        if libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) != 0 {
            return Err(os_err("sealing the memfd"));
        }
    }
    Ok(fd)
}

/// Checks that `fd` is a memfd of `len` bytes that can neither shrink nor grow (a segment a
/// peer could shrink would fault our reads).
pub(super) fn check_segment(fd: &OwnedFd, len: usize) -> Result<()> {
    // SAFETY: fstat writes into a zeroed stat struct of the right type.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is open; `st` is a valid out-pointer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(os_err("fstat of a received segment"));
    }
    if st.st_size as u64 != len as u64 {
        return Err(Error::Protocol(format!(
            "a received segment has {} bytes, {len} announced",
            st.st_size
        )));
    }
    // SAFETY: F_GET_SEALS takes no argument.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    let need = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
    if seals < 0 || seals & need != need {
        return Err(Error::Protocol(
            "a received segment is not sealed against resizing".into(),
        ));
    }
    Ok(())
}

/// A shared mapping of a segment, unmapped on drop.
pub(super) struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory; all access to it goes through atomics or through the
// ring's single-writer/single-reader protocol.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd` read-write, shared. `MCP_SHM_FAIL=mmap` makes it fail.
    pub(super) fn new(fd: &OwnedFd, len: usize) -> Result<Mapping> {
        if std::env::var("MCP_SHM_FAIL").is_ok_and(|v| v == "mmap") {
            return Err(Error::Io("mmap: refused by MCP_SHM_FAIL=mmap".into()));
        }
        // SAFETY: a fresh mapping chosen by the kernel; checked for MAP_FAILED below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(os_err(&format!("mmap of {len} bytes of shared memory")));
        }
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
        })
    }

    /// The first byte of the mapping.
    pub(super) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Its length in bytes.
    pub(super) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what mmap returned; nothing uses them after drop.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// A non-blocking eventfd (a wake-up counter).
pub(super) fn eventfd() -> Result<OwnedFd> {
    // SAFETY: plain system call.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(os_err("eventfd"));
    }
    // SAFETY: a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Adds one to an eventfd's counter, waking whoever polls it.
pub(super) fn signal(fd: RawFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a valid u64. A full counter (EAGAIN) still wakes.
    unsafe {
        libc::write(fd, (&one as *const u64).cast(), 8);
    }
}

/// Resets an eventfd's counter (non-blocking).
pub(super) fn drain(fd: RawFd) {
    let mut v: u64 = 0;
    // SAFETY: reads at most 8 bytes into a valid u64; EAGAIN when it was zero.
    unsafe {
        libc::read(fd, (&mut v as *mut u64).cast(), 8);
    }
}

/// What [`poll2`] saw.
pub(super) struct Polled {
    /// The first descriptor is readable.
    pub(super) first: bool,
    /// The second hung up, failed, or has bytes to read.
    pub(super) second: bool,
}

/// Waits up to `timeout_ms` for `a` to become readable or `b` to hang up (or be readable).
pub(super) fn poll2(a: RawFd, b: RawFd, timeout_ms: i32) -> Polled {
    let mut fds = [
        libc::pollfd {
            fd: a,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: b,
            events: libc::POLLIN | libc::POLLRDHUP,
            revents: 0,
        },
    ];
    // SAFETY: `fds` is a valid array of two pollfd.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
    if n <= 0 {
        return Polled {
            first: false,
            second: false,
        };
    }
    Polled {
        first: fds[0].revents & libc::POLLIN != 0,
        second: fds[1].revents != 0,
    }
}

/// The process id and user id of the other end of a Unix stream (SO_PEERCRED: as they were
/// when it connected or listened).
pub(super) fn peer_cred(sock: &UnixStream) -> Result<(u32, u32)> {
    // SAFETY: zeroed ucred is a valid value of the out-parameter.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid out-pointers of the sizes given.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(os_err("SO_PEERCRED"));
    }
    Ok((cred.pid as u32, cred.uid))
}

/// This process's effective user id.
pub(crate) fn euid() -> u32 {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() }
}

/// Most descriptors one message carries.
pub(super) const MAX_FDS: usize = 8;

/// Sends `bytes` with `fds` attached (SCM_RIGHTS).
pub(super) fn send_with_fds(sock: &UnixStream, bytes: &[u8], fds: &[RawFd]) -> Result<()> {
    if fds.len() > MAX_FDS {
        return Err(Error::InvalidArgument(format!("{} descriptors", fds.len())));
    }
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    let mut cbuf = [0u64; 16]; // 128 bytes, aligned: room for the header and 8 descriptors
    let fd_bytes = std::mem::size_of_val(fds) as u32;
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes) } as usize;
    // SAFETY: msghdr is plain data; zeroed is a valid start.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space;
    // SAFETY: the control buffer holds `space` <= 128 bytes, so the first header and its data
    // fit; CMSG_FIRSTHDR/CMSG_DATA point inside it.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        if cmsg.is_null() {
            return Err(Error::Io("no room for SCM_RIGHTS".into()));
        }
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(fd_bytes) as usize;
        std::ptr::copy_nonoverlapping(
            fds.as_ptr().cast::<u8>(),
            libc::CMSG_DATA(cmsg),
            fd_bytes as usize,
        );
    }
    // SAFETY: `msg` points at live buffers for the duration of the call.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(os_err("sendmsg with descriptors"));
    }
    if n as usize != bytes.len() {
        return Err(Error::Io("a short sendmsg on a Unix socket".into()));
    }
    Ok(())
}

/// Receives one message of at most `buf.len()` bytes and the descriptors attached to it
/// (each owned by the caller from now on). Returns the byte count (0: the peer hung up).
pub(super) fn recv_with_fds(sock: &UnixStream, buf: &mut [u8]) -> Result<(usize, Vec<OwnedFd>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cbuf = [0u64; 16];
    // SAFETY: msghdr is plain data; zeroed is a valid start.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cbuf);
    // SAFETY: `msg` points at live buffers; MSG_CMSG_CLOEXEC marks received fds close-on-exec.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(os_err("recvmsg"));
    }
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote into `cbuf`, within
    // `msg_controllen`; every received descriptor is taken into an OwnedFd exactly once.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg);
                let bytes = (*cmsg).cmsg_len as usize - (data as usize - cmsg as usize);
                let count = bytes / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(Error::Protocol(
            "too many descriptors in a shared-memory setup message".into(),
        ));
    }
    Ok((n as usize, fds))
}
