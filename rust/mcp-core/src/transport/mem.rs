//! An in-memory transport: every rank lives in one process and frames are handed straight to
//! the receiver's mailbox. With [`MemChaos`] it delays (and so reorders) and corrupts frames
//! from a seed, which is how `cargo test` runs every collective against a bad network.

use super::{Frame, Mailbox, MsgKey, Payload, Transport};
use crate::error::{Error, Result};
use crate::wire::Header;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
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
}

/// One rank's end of an in-memory network.
pub struct MemTransport {
    rank: usize,
    net: Arc<Net>,
    mailbox: Arc<Mailbox>,
}

/// Creates `world` connected in-memory transports, one per rank.
pub fn network(world: usize, chaos: Option<MemChaos>) -> Vec<Arc<MemTransport>> {
    let mailboxes: Vec<Arc<Mailbox>> = (0..world).map(|_| Arc::new(Mailbox::new())).collect();
    let net = Arc::new(Net {
        mailboxes: mailboxes.clone(),
        chaos: chaos.map(|c| (c, Mutex::new(StdRng::seed_from_u64(c.seed)))),
    });
    mailboxes
        .into_iter()
        .enumerate()
        .map(|(rank, mailbox)| {
            Arc::new(MemTransport {
                rank,
                net: net.clone(),
                mailbox,
            })
        })
        .collect()
}

fn deliver(to: &Mailbox, header: Header, payload: Vec<u8>) {
    let key = MsgKey::of(&header);
    let payload = Payload::from(payload);
    match payload.verify(&header) {
        Ok(()) => to.dispatch(Frame { header, payload }),
        Err(e) => to.deliver(key, Err(e)),
    }
}

impl MemTransport {
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
        let mut payload = payload.to_vec();
        let Some((chaos, rng)) = &self.net.chaos else {
            deliver(to, header.clone(), payload);
            return Ok(());
        };
        let (delay, flip) = {
            let mut rng = rng.lock().unwrap_or_else(|p| p.into_inner());
            let delay = rng.random_range(0..=chaos.max_delay.as_micros() as u64);
            let flip = if !payload.is_empty() && rng.random_bool(chaos.corrupt) {
                Some(rng.random_range(0..payload.len() * 8))
            } else {
                None
            };
            (delay, flip)
        };
        if let Some(bit) = flip {
            payload[bit / 8] ^= 1 << (bit % 8);
        }
        let to: Weak<Mailbox> = Arc::downgrade(to);
        let header = header.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_micros(delay)).await;
            if let Some(to) = to.upgrade() {
                deliver(&to, header, payload);
            }
        });
        Ok(())
    }

    async fn goodbye(&self) {}
}
