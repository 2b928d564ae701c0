//! Shared memory between the ranks of one host: the QUIC transport sends a frame to a peer on
//! the same host through a ring in memory both processes map, instead of over UDP and TLS.
//!
//! Setup and trust (see `docs/shared-memory.md`): the lower rank listens on a Unix socket in
//! the abstract namespace (per network namespace, nothing on disk), named after the job; the
//! higher rank connects, both check the other's credentials (SO_PEERCRED: our user, and the
//! pid that rendezvoused as that rank), and the connector passes both rings as sealed memfd
//! descriptors (SCM_RIGHTS). No segment has a name: the memory is freed when the last process
//! that maps it exits, however it exits. The socket stays open for the life of the channel;
//! its hang-up tells the survivor at once that the peer's process is gone.

mod link;
mod ring;
mod sys;

pub(crate) use link::{answer, dial, Event, Link, Parts, Sink, SETUP_TIMEOUT};
pub(crate) use sys::euid;

use crate::error::{Error, Result};

/// Data bytes of each direction's ring by default (`MCP_SHM_RING_BYTES`).
pub const DEFAULT_RING_BYTES: usize = 4 << 20;
/// Smallest ring allowed.
pub const MIN_RING_BYTES: usize = 64 << 10;
/// Largest ring allowed.
pub const MAX_RING_BYTES: usize = 1 << 30;

/// Bytes of a segment with `ring_bytes` of data (its control page included).
pub(crate) fn segment_len(ring_bytes: usize) -> usize {
    ring_bytes + ring::CONTROL
}

/// Checks a configured ring size.
pub fn check_ring_bytes(n: usize) -> Result<()> {
    if !(MIN_RING_BYTES..=MAX_RING_BYTES).contains(&n) {
        return Err(Error::InvalidArgument(format!(
            "shm_ring_bytes (MCP_SHM_RING_BYTES) must be between {MIN_RING_BYTES} and {MAX_RING_BYTES}, got {n}"
        )));
    }
    Ok(())
}

/// The abstract socket name rank `rank` listens on: derived from the job secret and the
/// address that rank's endpoint announced at the rendezvous (unique among the live groups of
/// a host), so that two jobs or two groups never meet (and the name tells nothing of the
/// secret).
pub(crate) fn socket_name(secret: &[u8], endpoint: &std::net::SocketAddr, rank: usize) -> String {
    let mut ctx = ::ring::digest::Context::new(&::ring::digest::SHA256);
    ctx.update(b"mcp_fast shared-memory socket\0");
    ctx.update(secret);
    ctx.update(endpoint.to_string().as_bytes());
    let d = ctx.finish();
    let hex: String = d.as_ref()[..12]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("mcp-shm-{hex}-{rank}")
}

fn abstract_addr(name: &str) -> Result<std::os::unix::net::SocketAddr> {
    use std::os::linux::net::SocketAddrExt;
    Ok(std::os::unix::net::SocketAddr::from_abstract_name(
        name.as_bytes(),
    )?)
}

/// Listens on the abstract socket `name` (call inside the runtime).
pub(crate) fn listen(name: &str) -> Result<tokio::net::UnixListener> {
    let l = std::os::unix::net::UnixListener::bind_addr(&abstract_addr(name)?)
        .map_err(|e| Error::Io(format!("binding the shared-memory socket @{name}: {e}")))?;
    l.set_nonblocking(true)?;
    Ok(tokio::net::UnixListener::from_std(l)?)
}

/// Connects to the abstract socket `name` (blocking).
pub(crate) fn connect(name: &str) -> Result<std::os::unix::net::UnixStream> {
    std::os::unix::net::UnixStream::connect_addr(&abstract_addr(name)?).map_err(|e| {
        Error::Io(format!(
            "connecting to the shared-memory socket @{name}: {e}"
        ))
    })
}
