//! Peers on this host: the topology the rendezvous told, and the shared-memory channels the
//! QUIC transport sends to them through (`transport::shm`) instead of QUIC. The mailbox is the
//! same; a peer whose channel could not be set up is reached over QUIC, with a warning
//! recorded in [`QuicTransport::shm_fallbacks`].

use super::{QuicTransport, Topology};
use crate::error::{Error, Result};
use crate::rendezvous::Entry;
use crate::transport::host;
use crate::transport::shm::{self, Event, Link, Parts};
use crate::transport::{Frame, MsgKey};
use crate::wire::{FrameKind, Header};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Instant;
use tokio::sync::mpsc;

/// What the accept task hands to the setup: a connecting rank and its channel, or why not.
type Accepted = (usize, Result<Parts>);

/// The accept task of our shared-memory socket and what it accepted.
pub(super) type Accepts = (
    tokio::task::JoinHandle<()>,
    mpsc::UnboundedReceiver<Accepted>,
);

impl QuicTransport {
    /// Whether this process offers shared memory to the ranks of its host.
    pub(super) fn shm_wanted(&self) -> bool {
        self.cfg.shm && self.cfg.chaos.is_none()
    }

    pub(super) fn set_topology(&self, entries: &[Entry]) {
        let host_ids: Vec<String> = entries.iter().map(|e| e.host.clone()).collect();
        let topo = Topology {
            host_of_rank: host::host_indices(&host_ids),
            host_ids,
            pids: entries.iter().map(|e| e.pid).collect(),
            shm: entries.iter().map(|e| e.shm).collect(),
        };
        self.topology.send_replace(Some(Arc::new(topo)));
    }

    fn topo(&self) -> Option<Arc<Topology>> {
        self.topology.borrow().clone()
    }

    /// Host index of every rank (hosts numbered in order of first appearance by rank; ranks
    /// on one host share an index). Known once the transport is connected.
    pub fn host_of_rank(&self) -> Vec<usize> {
        self.topo()
            .map_or_else(Vec::new, |t| t.host_of_rank.clone())
    }

    /// Every rank's host identity, as it announced it at the rendezvous.
    pub fn host_ids(&self) -> Vec<String> {
        self.topo().map_or_else(Vec::new, |t| t.host_ids.clone())
    }

    /// The peers this process sends to through shared memory.
    pub fn shm_peers(&self) -> Vec<usize> {
        (0..self.world)
            .filter(|&p| self.shm_link(p).is_some())
            .collect()
    }

    /// The peers of this host that are reached over QUIC because their shared-memory channel
    /// could not be set up, and why (not those that turned shared memory off).
    pub fn shm_fallbacks(&self) -> Vec<(usize, String)> {
        self.shm_fallbacks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn fallback(&self, peer: usize, why: String) {
        self.shm_fallbacks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((peer, why));
    }

    /// The pid of `peer` when the rendezvous says it shares our host and both of us offered
    /// shared memory (the same answer on every rank).
    pub(super) fn local_pid_of(&self, peer: usize) -> Option<u32> {
        let topo = self.topo()?;
        let me = self.rank;
        let local = peer != me
            && topo.host_of_rank.get(peer)? == topo.host_of_rank.get(me)?
            && *topo.shm.get(peer)?
            && *topo.shm.get(me)?;
        local.then(|| topo.pids.get(peer).copied()).flatten()
    }

    /// The usable shared-memory channel to `peer`, if any.
    pub(super) fn shm_link(&self, peer: usize) -> Option<&Link> {
        self.shm_links.get(peer)?.get().filter(|l| l.usable())
    }

    /// The peers of this host we set up shared memory with: (lower ranks, higher ranks).
    fn local_peers(&self, topo: &Topology) -> (Vec<usize>, Vec<usize>) {
        let me = self.rank;
        let mine = |p: usize| {
            p != me
                && topo.host_of_rank.get(p) == topo.host_of_rank.get(me)
                && topo.shm.get(p) == Some(&true)
        };
        let (lower, higher) = (0..self.world).filter(|&p| mine(p)).partition(|&p| p < me);
        (lower, higher)
    }

    /// Sends one frame through shared memory to `peer`.
    pub(super) async fn send_shm(
        &self,
        link: &Link,
        peer: usize,
        header: &Header,
        payload: &[u8],
    ) -> Result<()> {
        let lost = || self.mailbox.gone_error(peer);
        if let Some(e) = lost() {
            return Err(e);
        }
        if self.closing.load(Ordering::Acquire) && header.kind != FrameKind::Goodbye {
            return Err(Error::Closed("this process closed its group".into()));
        }
        let n = link.send(header, payload, &lost).await?;
        if let Some(slot) = self.peers.get(peer) {
            slot.sent.fetch_add(1, Ordering::AcqRel);
        }
        self.stats.shm_frames_sent.fetch_add(1, Ordering::Relaxed);
        self.stats
            .shm_bytes_sent
            .fetch_add(n as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Files what the reader thread of `peer`'s channel reports.
    fn on_shm_event(&self, peer: usize, ev: Event) {
        let count = |t: &QuicTransport| {
            if let Some(slot) = t.peers.get(peer) {
                // The peer's goodbye over QUIC announces frames of both paths.
                slot.carried.fetch_add(1, Ordering::AcqRel);
            }
        };
        match ev {
            Event::Frame(header, payload) => {
                if header.src as usize != peer {
                    self.mailbox.fail_peer(
                        peer,
                        Error::Protocol(format!(
                            "rank {peer} sent a frame as rank {} over shared memory",
                            header.src
                        )),
                    );
                    return;
                }
                self.stats
                    .shm_frames_received
                    .fetch_add(1, Ordering::Relaxed);
                self.stats.shm_bytes_received.fetch_add(
                    (header.encoded_len() + payload.len()) as u64,
                    Ordering::Relaxed,
                );
                match header.kind {
                    FrameKind::Hello | FrameKind::Table => count(self),
                    FrameKind::Progress => {
                        if let Some(p) = crate::health::Progress::from_bytes(&payload.to_vec()) {
                            self.progress_watch().on_report(peer, p, Instant::now());
                        }
                        count(self);
                    }
                    FrameKind::Goodbye => {
                        self.mailbox.dispatch(Frame { header, payload });
                    }
                    _ => {
                        if self.mailbox.dispatch(Frame { header, payload }) {
                            count(self);
                        }
                    }
                }
            }
            Event::Damaged(header, e) => {
                self.stats.corrupt_frames.fetch_add(1, Ordering::Relaxed);
                if self.mailbox.deliver(MsgKey::of(&header), Err(e)) {
                    count(self);
                }
            }
            Event::Broken(e) => self.mailbox.fail_peer(peer, e),
            Event::HungUp => {
                if !self.closing.load(Ordering::Acquire) && self.mailbox.peer_error(peer).is_none()
                {
                    self.mailbox.fail_peer(
                        peer,
                        Error::PeerLost {
                            rank: peer,
                            op: "any operation".into(),
                            reason: "the shared-memory channel to it hung up without a goodbye (its process was killed, crashed or abandoned its group)".into(),
                        },
                    );
                }
            }
        }
    }

    fn start_link(&self, peer: usize, parts: Parts) -> Result<()> {
        let me: Weak<QuicTransport> = self.me.clone();
        let sink: shm::Sink = Box::new(move |ev| {
            if let Some(t) = me.upgrade() {
                t.on_shm_event(peer, ev);
            }
        });
        let link = Link::start(parts, peer, sink)?;
        let slot = self
            .shm_links
            .get(peer)
            .ok_or_else(|| Error::InvalidArgument(format!("no rank {peer}")))?;
        slot.set(link)
            .map_err(|_| Error::Protocol(format!("a second shared-memory channel to rank {peer}")))
    }
}

/// Binds our shared-memory socket (before the rendezvous, so that it is there when a peer
/// learns of us) and accepts on it until the setup ends. `None` when shared memory is off.
pub(super) fn listen(t: &Arc<QuicTransport>) -> Option<Accepts> {
    if !t.shm_wanted() {
        return None;
    }
    let (tx, rx) = mpsc::unbounded_channel();
    // Named after the address this rank announces at the rendezvous, which its peers read
    // from the table.
    let listener = match t
        .local_addr()
        .and_then(|a| shm::listen(&shm::socket_name(&t.secret, &a, t.rank)))
    {
        Ok(l) => Some(l),
        Err(e) => {
            // The setup records it for each higher local peer: they find no one, or someone
            // that fails their credential check.
            let _ = tx.send((usize::MAX, Err(e)));
            None
        }
    };
    let me = Arc::downgrade(t);
    let task = tokio::spawn(async move {
        let Some(listener) = listener else {
            return;
        };
        while let Ok((stream, _)) = listener.accept().await {
            let (me, tx) = (me.clone(), tx.clone());
            tokio::spawn(async move {
                let Some(t) = me.upgrade() else { return };
                let mut topo_rx = t.topology.subscribe();
                drop(t);
                // The connecting rank may have the table before we do.
                let topo =
                    tokio::time::timeout(shm::SETUP_TIMEOUT, topo_rx.wait_for(Option::is_some))
                        .await;
                let Ok(Ok(topo)) = topo.map(|r| r.map(|g| g.clone())) else {
                    return;
                };
                let Some(topo) = topo else { return };
                let Some(t) = me.upgrade() else { return };
                let me_rank = t.rank;
                drop(t);
                let Ok(stream) = stream.into_std() else {
                    return;
                };
                let res = tokio::task::spawn_blocking(move || {
                    let _ = stream.set_nonblocking(false);
                    shm::answer(stream, |rank, pid, uid| {
                        check_peer(&topo, me_rank, rank, pid, uid)
                    })
                })
                .await;
                match res {
                    Ok(Ok((rank, parts))) => {
                        let _ = tx.send((rank, Ok(parts)));
                    }
                    Ok(Err((Some(rank), e))) => {
                        let _ = tx.send((rank, Err(e)));
                    }
                    // Someone who is not a rank of ours: ignored.
                    Ok(Err((None, _))) | Err(_) => {}
                }
            });
        }
    });
    Some((task, rx))
}

/// Whether the process that connected (pid, uid) may be rank `rank`, a higher rank of our host.
fn check_peer(topo: &Topology, me: usize, rank: usize, pid: u32, uid: u32) -> Result<()> {
    let ours = rank > me
        && topo.host_of_rank.get(rank).is_some()
        && topo.host_of_rank.get(rank) == topo.host_of_rank.get(me);
    let euid = shm::euid();
    if !ours || topo.pids.get(rank) != Some(&pid) || uid != euid {
        return Err(Error::Authentication {
            peer: format!("pid {pid} (uid {uid}) on the shared-memory socket"),
            detail: format!(
                "it claims to be rank {rank}, which is not that process of this user on this host"
            ),
        });
    }
    Ok(())
}

/// Sets up the shared-memory channels with the peers of this host once the rendezvous is
/// over: dials the lower ranks, takes the higher ones' connections, and records a fallback
/// to QUIC for each peer where that fails. Never fails the transport.
pub(super) async fn setup(t: &Arc<QuicTransport>, accepts: Option<Accepts>) {
    let Some((task, mut accepted)) = accepts else {
        return;
    };
    let Some(topo) = t.topo() else {
        task.abort();
        return;
    };
    let (lower, higher) = t.local_peers(&topo);
    // Peers of this host that turned shared memory off chose QUIC: no fallback to report.
    let seg = shm::segment_len(t.cfg.shm_ring_bytes);
    let dials: Vec<_> = lower
        .iter()
        .map(|&q| {
            let addr = t.addr_of(q);
            let (secret, me, pid) = (t.secret.clone(), t.rank, topo.pids[q]);
            let job = tokio::task::spawn_blocking(move || {
                let addr = addr.ok_or_else(|| Error::Io(format!("address of rank {q} unknown")))?;
                let name = shm::socket_name(&secret, &addr, q);
                shm::connect(&name).and_then(|s| shm::dial(s, me, pid, seg))
            });
            (q, job)
        })
        .collect();
    for (q, job) in dials {
        match job.await {
            Ok(Ok(parts)) => {
                if let Err(e) = t.start_link(q, parts) {
                    t.fallback(q, e.to_string());
                }
            }
            Ok(Err(e)) => t.fallback(q, e.to_string()),
            Err(e) => t.fallback(q, format!("the setup task failed: {e}")),
        }
    }
    let mut waiting: Vec<usize> = higher;
    let deadline = tokio::time::Instant::now() + 2 * shm::SETUP_TIMEOUT;
    while !waiting.is_empty() {
        match tokio::time::timeout_at(deadline, accepted.recv()).await {
            Ok(Some((usize::MAX, Err(e)))) => {
                for p in waiting.drain(..) {
                    t.fallback(p, e.to_string());
                }
            }
            Ok(Some((p, res))) if waiting.contains(&p) => {
                waiting.retain(|&w| w != p);
                match res.and_then(|parts| t.start_link(p, parts)) {
                    Ok(()) => {}
                    Err(e) => t.fallback(p, e.to_string()),
                }
            }
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => {
                for p in waiting.drain(..) {
                    t.fallback(
                        p,
                        format!(
                            "rank {p} did not connect to our shared-memory socket within {:.0} s (another network namespace?)",
                            (2 * shm::SETUP_TIMEOUT).as_secs_f64()
                        ),
                    );
                }
            }
        }
    }
    // Nobody else may connect: the name is free again once the listener is dropped.
    task.abort();
}
