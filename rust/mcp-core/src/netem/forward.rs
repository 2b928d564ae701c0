//! The I/O loop: packets read from one TUN file descriptor go through a [`Link`] and are
//! written to the other, both ways, until the stop descriptor becomes readable.
//!
//! One thread, `ppoll` with the links' next deadline as its timeout (microsecond precision),
//! non-blocking reads and writes. A write the kernel refuses (its queue full) drops the
//! packet and counts it, as a router with a full output queue would.

use super::link::{Link, LinkParams, LinkStats};
use crate::error::Error;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

/// Largest packet read from a TUN (its MTU may be up to 64 KiB).
const MAX_PACKET: usize = 65_536;
/// Packets read from one descriptor per wake-up, so the other direction is not starved.
const READ_BATCH: usize = 64;

/// What the forwarder did, per direction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ForwardStats {
    /// From `fd_a` to `fd_b`.
    pub a_to_b: LinkStats,
    /// From `fd_b` to `fd_a`.
    pub b_to_a: LinkStats,
    /// Packets the kernel refused when they were written (counted in `delivered` too).
    pub write_drops: u64,
}

fn os_err(what: &str) -> Error {
    Error::Io(format!("{what}: {}", std::io::Error::last_os_error()))
}

fn set_nonblocking(fd: RawFd) -> Result<(), Error> {
    // SAFETY: fcntl on a caller-given descriptor reads and sets its flags only; a bad
    // descriptor makes it fail with EBADF, which we report.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(os_err(&format!("fcntl(F_GETFL) on fd {fd}")));
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(os_err(&format!("fcntl(F_SETFL) on fd {fd}")));
    }
    Ok(())
}

/// Reads up to [`READ_BATCH`] packets from `fd` into `link`; `Ok(false)` at end of file.
fn read_into(fd: RawFd, link: &mut Link, buf: &mut [u8]) -> Result<bool, Error> {
    for _ in 0..READ_BATCH {
        // SAFETY: `buf` is a valid writable buffer of `buf.len()` bytes for the call.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(true),
                _ => Err(Error::Io(format!("read from fd {fd}: {e}"))),
            };
        }
        if n == 0 {
            return Ok(false);
        }
        link.push(Instant::now(), buf[..n as usize].to_vec());
    }
    Ok(true)
}

/// Writes every packet due in `link` to `fd`; returns how many the kernel refused.
fn write_due(fd: RawFd, link: &mut Link) -> Result<u64, Error> {
    let now = Instant::now();
    let mut drops = 0;
    while let Some(p) = link.pop_due(now) {
        // SAFETY: `p` is a valid readable buffer of `p.len()` bytes for the call.
        let n = unsafe { libc::write(fd, p.as_ptr().cast(), p.len()) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                // A full queue, or an address the kernel will not take: the packet is lost.
                Some(libc::EAGAIN) | Some(libc::ENOBUFS) | Some(libc::EINVAL) => drops += 1,
                Some(libc::EINTR) => drops += 1,
                _ => return Err(Error::Io(format!("write to fd {fd}: {e}"))),
            }
        }
    }
    Ok(drops)
}

/// Forwards packets between TUN descriptors `fd_a` and `fd_b` (opened with `IFF_TUN |
/// IFF_NO_PI`; they are made non-blocking) through `a_to_b` and `b_to_a` until `stop_fd`
/// becomes readable or is closed at its other end. Packets still in flight then are dropped.
/// The descriptors stay open: they belong to the caller.
pub fn forward(
    fd_a: RawFd,
    fd_b: RawFd,
    stop_fd: RawFd,
    a_to_b: LinkParams,
    b_to_a: LinkParams,
) -> Result<ForwardStats, Error> {
    let mut ab = Link::new(a_to_b)?;
    let mut ba = Link::new(b_to_a)?;
    set_nonblocking(fd_a)?;
    set_nonblocking(fd_b)?;
    let mut buf = vec![0u8; MAX_PACKET];
    let mut write_drops = 0;
    loop {
        let deadline = [ab.next_deadline(), ba.next_deadline()]
            .into_iter()
            .flatten()
            .min();
        let timeout = deadline.map(|d| {
            let left = d.saturating_duration_since(Instant::now());
            libc::timespec {
                tv_sec: left.as_secs() as libc::time_t,
                tv_nsec: libc::c_long::from(left.subsec_nanos() as i32),
            }
        });
        let mut fds = [
            libc::pollfd {
                fd: fd_a,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: fd_b,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: stop_fd,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let tp = timeout
            .as_ref()
            .map_or(std::ptr::null(), |t| t as *const libc::timespec);
        // SAFETY: `fds` is a valid array of 3 pollfd for the call; `tp` is null or points to
        // `timeout`, alive until the call returns; no signal mask is passed.
        let r = unsafe { libc::ppoll(fds.as_mut_ptr(), 3, tp, std::ptr::null()) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINTR) {
                return Err(Error::Io(format!("ppoll: {e}")));
            }
        }
        if fds[2].revents != 0 {
            break;
        }
        for (i, bad) in fds[..2]
            .iter()
            .map(|p| p.revents & (libc::POLLERR | libc::POLLNVAL))
            .enumerate()
        {
            if bad != 0 {
                return Err(Error::Io(format!(
                    "fd {} failed (poll revents {bad:#x})",
                    fds[i].fd
                )));
            }
        }
        let mut open = true;
        if fds[0].revents & libc::POLLIN != 0 {
            open &= read_into(fd_a, &mut ab, &mut buf)?;
        }
        if fds[1].revents & libc::POLLIN != 0 {
            open &= read_into(fd_b, &mut ba, &mut buf)?;
        }
        write_drops += write_due(fd_b, &mut ab)?;
        write_drops += write_due(fd_a, &mut ba)?;
        if !open {
            break;
        }
    }
    Ok(ForwardStats {
        a_to_b: ab.stats(),
        b_to_a: ba.stats(),
        write_drops,
    })
}

/// Seconds as a [`Duration`], refusing negative, NaN and infinite values with a message
/// naming `what`.
pub fn seconds(what: &str, s: f64) -> Result<Duration, Error> {
    Duration::try_from_secs_f64(s).map_err(|_| {
        Error::InvalidArgument(format!(
            "{what} must be a non-negative number of seconds, got {s}"
        ))
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // a test's unwrap is its assertion
mod tests {
    use super::*;

    /// A pair of connected datagram sockets behaves as two TUNs would: one read returns one
    /// packet, one write sends one.
    fn pair() -> [RawFd; 2] {
        let mut fds = [0; 2];
        // SAFETY: `fds` is a valid array of two ints for the call.
        let r = unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_DGRAM, 0, fds.as_mut_ptr()) };
        assert_eq!(r, 0);
        fds
    }

    fn close(fd: RawFd) {
        // SAFETY: the test owns `fd` and closes it once.
        unsafe { libc::close(fd) };
    }

    fn send(fd: RawFd, p: &[u8]) {
        // SAFETY: `p` is valid for the call.
        assert_eq!(
            unsafe { libc::write(fd, p.as_ptr().cast(), p.len()) },
            p.len() as isize
        );
    }

    fn recv(fd: RawFd) -> Vec<u8> {
        let mut b = vec![0u8; 2048];
        // SAFETY: `b` is valid and writable for the call.
        let n = unsafe { libc::read(fd, b.as_mut_ptr().cast(), b.len()) };
        assert!(n >= 0);
        b.truncate(n as usize);
        b
    }

    #[test]
    fn forwards_both_ways_with_delay_and_stops() {
        let [a_host, a_fwd] = pair();
        let [b_host, b_fwd] = pair();
        let [stop_w, stop_r] = pair();
        let p = LinkParams {
            delay: Duration::from_millis(20),
            ..Default::default()
        };
        let (pa, pb) = (p.clone(), p);
        let t = std::thread::spawn(move || forward(a_fwd, b_fwd, stop_r, pa, pb));
        let t0 = Instant::now();
        send(a_host, b"ping");
        assert_eq!(recv(b_host), b"ping");
        send(b_host, b"pong");
        assert_eq!(recv(a_host), b"pong");
        // Two one-way delays at least; no upper bound (a loaded machine may be slow).
        assert!(t0.elapsed() >= Duration::from_millis(40));
        send(stop_w, b"x");
        let stats = t.join().unwrap().unwrap();
        assert_eq!(stats.a_to_b.delivered, 1);
        assert_eq!(stats.b_to_a.delivered, 1);
        for fd in [a_host, a_fwd, b_host, b_fwd, stop_w, stop_r] {
            close(fd);
        }
    }

    #[test]
    fn a_bad_descriptor_is_an_io_error() {
        let r = forward(-1, -1, -1, LinkParams::default(), LinkParams::default());
        assert!(matches!(r, Err(Error::Io(_))));
    }

    #[test]
    fn seconds_refuses_negative() {
        assert!(matches!(
            seconds("delay", -1.0),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!(seconds("delay", 0.025).unwrap(), Duration::from_millis(25));
    }
}
