//! An in-memory transport: every rank lives in one process and frames are handed straight to
//! the receiver's mailbox. With [`MemChaos`] it delays (and so reorders) and corrupts frames
//! from a seed, which is how `cargo test` runs every collective against a bad network.
//!
//! A damaged frame heals as on QUIC's stream lane: the receiver's checksum fails, the sender
//! delivers its kept copy again (damaged again with the same probability), and only after
//! [`DEFAULT_RESEND_LIMIT`] failed resends does the receive fail.

use super::{Frame, Mailbox, MsgKey, Payload, Transport, DEFAULT_RESEND_LIMIT};
use crate::error::{Error, Result};
use crate::wire::{FrameKind, Header};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

/// Faults the in-memory network injects, drawn from a seeded generator.
#[derive(Debug, Clone, Copy)]
pub struct MemChaos {
    /// Seed of the fault generator.
    pub seed: u64,
    /// Largest delay added to a frame; frames overtake each other within it.
    pub max_delay: Duration,
    /// Probability that a frame's payload has one bit flipped in transit.
    pub corrupt: f64,
}

struct Net {
    mailboxes: Vec<Arc<Mailbox>>,
    chaos: Option<(MemChaos, Mutex<StdRng>)>,
    retransmits: AtomicU64,
    /// Payload bytes of operation frames sent, `[src * world + dst]` (first sends only).
    sent: Vec<AtomicU64>,
    /// The ranks count as processes of one host that may read each other's memory (they
    /// are all this process): see [`MemTransport::enable_direct_reads`].
    direct: AtomicBool,
}

/// One rank's end of an in-memory network.
pub struct MemTransport {
    rank: usize,
    net: Arc<Net>,
    mailbox: Arc<Mailbox>,
    /// This rank reads its peers' memory directly (once the network allows it).
    reads: AtomicBool,
    /// The peers whose tensors this rank agreed to read directly.
    known_reads: super::peer_memory::KnownReads,
}

/// Creates `world` connected in-memory transports, one per rank.
pub fn network(world: usize, chaos: Option<MemChaos>) -> Vec<Arc<MemTransport>> {
    let mailboxes: Vec<Arc<Mailbox>> = (0..world).map(|_| Arc::new(Mailbox::new())).collect();
    let net = Arc::new(Net {
        mailboxes: mailboxes.clone(),
        chaos: chaos.map(|c| (c, Mutex::new(StdRng::seed_from_u64(c.seed)))),
        retransmits: AtomicU64::new(0),
        sent: (0..world * world).map(|_| AtomicU64::new(0)).collect(),
        direct: AtomicBool::new(false),
    });
    mailboxes
        .into_iter()
        .enumerate()
        .map(|(rank, mailbox)| {
            Arc::new(MemTransport {
                rank,
                net: net.clone(),
                mailbox,
                reads: AtomicBool::new(true),
                known_reads: Default::default(),
            })
        })
        .collect()
}

/// Delivers `payload` as damaged by each attempt's bit flip in turn (`None`: intact), until
/// one attempt passes the receiver's checksum or the resend limit is spent.
fn deliver(net: &Net, to: &Mailbox, header: Header, payload: Vec<u8>, flips: &[Option<usize>]) {
    let key = MsgKey::of(&header);
    let mut last = None;
    for (attempt, flip) in flips.iter().enumerate() {
        if attempt > 0 {
            net.retransmits.fetch_add(1, Ordering::Relaxed);
        }
        let mut copy = payload.clone();
        if let Some(bit) = *flip {
            copy[bit / 8] ^= 1 << (bit % 8);
        }
        let copy = Payload::from(copy);
        match copy.verify(&header) {
            Ok(()) => {
                to.dispatch(Frame {
                    header,
                    payload: copy,
                });
                return;
            }
            Err(e) => last = Some(e),
        }
    }
    if let Some(e) = last {
        let n = flips.len();
        let _ = to.deliver(
            key,
            Err(Error::Protocol(format!(
                "{e}; it failed {n} times and {} resends did not repair it (resend limit {})",
                n - 1,
                n - 1
            ))),
        );
    }
}

impl MemTransport {
    /// Lets the ranks of this network read each other's memory directly, as processes of
    /// one host do (they are threads of this process, so the reads are real
    /// `process_vm_readv` calls on our own pid): the direct all-reduce then runs on it.
    pub fn enable_direct_reads(&self) {
        self.net.direct.store(true, Ordering::Release);
    }

    /// This rank declines to read its peers' memory (as a rank with direct reads turned off
    /// does): operations that would read it directly fall back on every rank.
    pub fn decline_direct_reads(&self) {
        self.reads.store(false, Ordering::Release);
    }

    /// Forgets which peers this rank agreed to read directly (as a restarted process would):
    /// the next operation among them agrees again, on every rank.
    pub fn forget_direct_reads(&self) {
        self.known_reads.forget();
    }

    /// Frames sent again, on the whole network, because a receiver found them damaged.
    pub fn retransmits(&self) -> u64 {
        self.net.retransmits.load(Ordering::Relaxed)
    }

    /// Payload bytes of operation frames (not aborts, not resends) this rank has sent to
    /// `peer`: what the algorithms put on the wire, to check their traffic exactly.
    pub fn payload_bytes_to(&self, peer: usize) -> u64 {
        let w = self.world_size();
        self.net
            .sent
            .get(self.rank * w + peer)
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }

    /// Simulates this rank dying: every peer's waits on it fail as a lost peer would.
    pub fn kill(&self) {
        for (r, mb) in self.net.mailboxes.iter().enumerate() {
            if r != self.rank {
                mb.fail_peer(
                    self.rank,
                    Error::PeerLost {
                        rank: self.rank,
                        op: "any".into(),
                        reason: "killed by the test".into(),
                    },
                );
            }
        }
        self.mailbox
            .close(Error::Closed("this rank was killed".into()));
    }

    /// Simulates this rank closing its group: every peer takes it as the goodbye it is (its
    /// waits on this rank fail; frames this rank sent stay filed).
    pub fn leave(&self) {
        for (r, mb) in self.net.mailboxes.iter().enumerate() {
            if r != self.rank {
                mb.said_goodbye(self.rank);
            }
        }
        self.mailbox
            .close(Error::Closed("this rank closed its group".into()));
    }
}

impl Transport for MemTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.net.mailboxes.len()
    }

    fn mailbox(&self) -> &Mailbox {
        &self.mailbox
    }

    fn local_pid(&self, peer: usize) -> Option<u32> {
        (self.net.direct.load(Ordering::Acquire) && peer < self.world_size()).then(std::process::id)
    }

    fn reads_peer_memory(&self, peer: usize) -> bool {
        self.reads.load(Ordering::Acquire) && self.local_pid(peer).is_some()
    }

    fn direct_reads_known(&self, peers: &[(usize, u32)]) -> bool {
        self.known_reads.knows(peers)
    }

    fn remember_direct_reads(&self, peers: &[(usize, u32)]) {
        self.known_reads.remember(peers);
    }

    async fn send_frame<'a>(
        &'a self,
        peer: usize,
        header: &'a Header,
        payload: &'a [u8],
    ) -> Result<()> {
        let to = self.net.mailboxes.get(peer).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "no rank {peer} in a world of {}",
                self.world_size()
            ))
        })?;
        // As over QUIC and shared memory: a send to a peer known to be gone fails naming it
        // (a stalled peer is alive and still takes frames).
        if let Some(e) = self.mailbox.gone_error(peer) {
            return Err(e);
        }
        if header.kind != FrameKind::Abort {
            self.net.sent[self.rank * self.world_size() + peer]
                .fetch_add(payload.len() as u64, Ordering::Relaxed);
        }
        let payload = payload.to_vec();
        let Some((chaos, rng)) = &self.net.chaos else {
            deliver(&self.net, to, header.clone(), payload, &[None]);
            return Ok(());
        };
        let (delay, flips) = {
            let mut rng = rng.lock().unwrap_or_else(|p| p.into_inner());
            let delay = rng.random_range(0..=chaos.max_delay.as_micros() as u64);
            // One draw per attempt, until an intact one or the limit: the receiver asks again
            // for every damaged copy.
            let mut flips = Vec::new();
            while flips.len() <= DEFAULT_RESEND_LIMIT as usize {
                let flip = (!payload.is_empty() && rng.random_bool(chaos.corrupt))
                    .then(|| rng.random_range(0..payload.len() * 8));
                flips.push(flip);
                if flip.is_none() {
                    break;
                }
            }
            (delay, flips)
        };
        let to: Weak<Mailbox> = Arc::downgrade(to);
        let net = Arc::downgrade(&self.net);
        let header = header.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_micros(delay)).await;
            if let (Some(to), Some(net)) = (to.upgrade(), net.upgrade()) {
                deliver(&net, &to, header, payload, &flips);
            }
        });
        Ok(())
    }

    async fn goodbye(&self) {}
}
