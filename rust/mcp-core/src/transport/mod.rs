//! How frames move between ranks: the [`Transport`] trait and its implementations.
//!
//! The collectives are written against this trait only, so they run unchanged on real QUIC
//! connections ([`quic`]) and on the in-memory transport ([`mem`]) that `cargo test` uses,
//! with or without seeded faults.

pub mod buffer_pool;
pub mod host;
mod mailbox;
pub mod meeting;
pub mod mem;
mod payload;
pub mod peer_memory;
pub mod quic;
pub mod shm;

pub use mailbox::{decode_abort, encode_abort, Frame, Mailbox, MsgKey, SeqSpace};
pub use payload::Payload;

use crate::error::Result;
use crate::wire::Header;
use std::future::Future;

/// Most resends of one damaged frame a receiver may ask for (a configured limit is at most
/// this).
pub const MAX_RESENDS: u32 = 64;
/// Resends of one damaged frame a receiver asks for by default; one more failure fails the
/// operation with a `ProtocolError` that names the peer, the operation and the count.
pub const DEFAULT_RESEND_LIMIT: u32 = 8;

/// Moves frames between the ranks of one job.
pub trait Transport: Send + Sync + 'static {
    /// This process's rank.
    fn rank(&self) -> usize;

    /// Number of ranks in the job.
    fn world_size(&self) -> usize;

    /// Where frames received from peers are filed.
    fn mailbox(&self) -> &Mailbox;

    /// Sends one frame to `peer`. Resolves once the bytes are handed to the network (or to the
    /// peer's mailbox), after which `payload` may be changed.
    fn send_frame<'a>(
        &'a self,
        peer: usize,
        header: &'a Header,
        payload: &'a [u8],
    ) -> impl Future<Output = Result<()>> + Send + 'a;

    /// Called before waiting for a frame from `peer`: lets a transport that connects on
    /// demand start connecting to a peer that will only send to us.
    fn expect_from(&self, peer: usize) {
        let _ = peer;
    }

    /// This rank started collective operation `seq` (for the progress watchdog; a transport
    /// without one ignores it).
    fn op_started(&self, seq: u64) {
        let _ = seq;
    }

    /// This rank finished collective operation `seq`, successfully or not.
    fn op_finished(&self, seq: u64) {
        let _ = seq;
    }

    /// The process id of `peer` when it runs on this host and offered shared memory at the
    /// rendezvous: the same answer on every rank, so that ranks choosing an algorithm by it
    /// agree. `None` for a peer elsewhere (and on transports without processes).
    fn local_pid(&self, peer: usize) -> Option<u32> {
        let _ = peer;
        None
    }

    /// Whether this rank will read `peer`'s memory directly (its own policy and state: the
    /// shared-memory channel to it works and direct reads are not turned off). The kernel may
    /// still refuse; the algorithms find out with a probe and fall back.
    fn reads_peer_memory(&self, peer: usize) -> bool {
        let _ = peer;
        false
    }

    /// The ranks of an operation agreed to read each other's tensors directly (`read`) or to
    /// use the rings instead (for the transport's counters).
    fn direct_reads_agreed(&self, read: bool) {
        let _ = read;
    }

    /// Whether this rank agreed before, with every member of an operation, to read these
    /// local peers' tensors directly (`(rank, pid)` in member order; see
    /// [`peer_memory::KnownReads`]). A later operation among the same processes skips its
    /// probes and verdicts when every member says so.
    fn direct_reads_known(&self, peers: &[(usize, u32)]) -> bool {
        let _ = peers;
        false
    }

    /// Remembers that every member of an operation agreed to read these local peers'
    /// tensors directly.
    fn remember_direct_reads(&self, peers: &[(usize, u32)]) {
        let _ = peers;
    }

    /// This rank read (and reduced) `bytes` of a local peer's tensor directly. A simulated
    /// network books the processor time of the copy on its machine's cores; real transports,
    /// whose copies take real time, ignore it.
    fn read_from_peer(&self, bytes: usize) {
        let _ = bytes;
    }

    /// Drops every connection now, telling the peers this process left (for a group
    /// abandoned after a failure: nothing in flight is worth delivering any more).
    fn leave_now(&self) {}

    /// Best-effort: tells every connected peer that this process is closing.
    fn goodbye(&self) -> impl Future<Output = ()> + Send + '_;
}
