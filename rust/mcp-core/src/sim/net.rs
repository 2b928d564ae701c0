//! The simulated network: a [`Transport`] per rank over one event queue in virtual time.
//!
//! Every send computes its arrival time from the link model at once (queue, serialisation,
//! latency, loss recovery, jitter) and files a delivery event; the driver
//! ([`drive`]) delivers events in time order, and only when every rank has done all it can at
//! the current instant. Virtual time is kept in nanoseconds here; tokio's paused clock, which
//! the operations' deadlines run on, follows it to the millisecond (it never runs ahead of
//! an event), and jumps straight to the next timer when nothing else can happen, so that idle
//! waits cost nothing.

use super::link::{LinkRng, LinkSpec};
use super::{Fault, SimConfig, TraceEvent};
use crate::error::{Error, Result};
use crate::transport::{Frame, Mailbox, Payload, Transport};
use crate::wire::Header;
use std::cmp::{Ordering as CmpOrdering, Reverse};
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// What happens at an instant of virtual time.
enum Event {
    /// A frame reaches `dst`.
    Deliver {
        src: usize,
        dst: usize,
        header: Header,
        payload: Vec<u8>,
    },
    /// A rank dies: it stops sending and receiving.
    Kill(usize),
    /// The link between two ranks stops carrying anything.
    Cut(usize, usize),
    /// The survivors' failure detectors declare a dead rank lost.
    DetectRank(usize),
    /// Both ends of a cut link declare each other lost.
    DetectLink(usize, usize),
}

/// An event and when it happens; ordered by time, then by when it was filed, so that one
/// seed gives one order.
struct Scheduled {
    at: u64,
    id: u64,
    event: Event,
}

impl PartialEq for Scheduled {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.id) == (o.at, o.id)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, o: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(o))
    }
}
impl Ord for Scheduled {
    fn cmp(&self, o: &Self) -> CmpOrdering {
        (self.at, self.id).cmp(&(o.at, o.id))
    }
}

/// A multiply-xor hasher for the per-link tables: their keys are small integers of our
/// own, looked up on every frame, where SipHash's protection against chosen keys buys
/// nothing.
#[derive(Default)]
struct PairHasher(u64);

impl Hasher for PairHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x51_7C_C1_B7_27_22_0A_95);
    }

    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }
}

type PairMap<V> = HashMap<(usize, usize), V, BuildHasherDefault<PairHasher>>;

struct State {
    clock: u64,
    next_id: u64,
    events: BinaryHeap<Reverse<Scheduled>>,
    /// When each pair's link inside a host is free again.
    pair_free: PairMap<u64>,
    /// When each host's card is free again.
    nic_free: Vec<u64>,
    rngs: PairMap<LinkRng>,
    dead: Vec<Option<u64>>,
    cut: HashSet<(usize, usize)>,
    frames: u64,
    wire_bytes: Vec<f64>,
    inter_host_bytes: f64,
    finished: Vec<Option<u64>>,
    trace: Vec<TraceEvent>,
}

impl State {
    fn schedule(&mut self, at: u64, event: Event) {
        let id = self.next_id;
        self.next_id += 1;
        self.events.push(Reverse(Scheduled { at, id, event }));
    }
}

/// The shared network of one simulation.
pub(crate) struct SimNet {
    cfg: SimConfig,
    mailboxes: Vec<Arc<Mailbox>>,
    state: Mutex<State>,
    wake: Notify,
    t0: Instant,
}

fn ns(d: Duration) -> u64 {
    d.as_nanos().min(u128::from(u64::MAX)) as u64
}

fn secs(t: u64) -> f64 {
    t as f64 * 1e-9
}

impl SimNet {
    /// A network for `cfg` (already validated), its faults filed; call inside the runtime.
    pub(crate) fn new(cfg: SimConfig) -> Arc<SimNet> {
        let w = cfg.world;
        let mut state = State {
            clock: 0,
            next_id: 0,
            events: BinaryHeap::new(),
            pair_free: PairMap::default(),
            nic_free: vec![0; w.div_ceil(cfg.topology.ranks_per_host)],
            rngs: PairMap::default(),
            dead: vec![None; w],
            cut: HashSet::new(),
            frames: 0,
            wire_bytes: vec![0.0; w],
            inter_host_bytes: 0.0,
            finished: vec![None; w],
            trace: Vec::new(),
        };
        for f in &cfg.faults {
            match *f {
                Fault::Rank { rank, at } => state.schedule(ns(at), Event::Kill(rank)),
                Fault::Link { a, b, at } => state.schedule(ns(at), Event::Cut(a, b)),
            }
        }
        Arc::new(SimNet {
            mailboxes: (0..w).map(|_| Arc::new(Mailbox::new())).collect(),
            cfg,
            state: Mutex::new(state),
            wake: Notify::new(),
            t0: Instant::now(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Every update is complete before anything can panic: recover from poisoning.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn now_in(&self, st: &State) -> u64 {
        st.clock
            .max(ns(Instant::now().saturating_duration_since(self.t0)))
    }

    /// Virtual nanoseconds since the start of the run.
    pub(crate) fn now(&self) -> u64 {
        let st = self.lock();
        self.now_in(&st)
    }

    fn host(&self, rank: usize) -> usize {
        rank / self.cfg.topology.ranks_per_host
    }

    fn send(&self, src: usize, dst: usize, header: &Header, payload: &[u8]) -> Result<()> {
        if dst >= self.cfg.world {
            return Err(Error::InvalidArgument(format!(
                "no rank {dst} in a simulated world of {}",
                self.cfg.world
            )));
        }
        let mut st = self.lock();
        if let Some(t) = st.dead[src] {
            return Err(Error::Closed(format!(
                "rank {src} failed at virtual time {:.6} s",
                secs(t)
            )));
        }
        let now = self.now_in(&st);
        let bytes = header.encoded_len() as f64 + payload.len() as f64 * self.cfg.scale;
        let (sh, dh) = (self.host(src), self.host(dst));
        let (spec, free): (&LinkSpec, &mut u64) = if sh == dh {
            (
                &self.cfg.topology.intra,
                st.pair_free.entry((src, dst)).or_insert(0),
            )
        } else {
            (&self.cfg.topology.inter, &mut st.nic_free[sh])
        };
        let start = now.max(*free);
        let end = start.saturating_add(spec.serialise_ns(bytes));
        *free = end;
        let seed = self.cfg.seed;
        let extra = st
            .rngs
            .entry((src, dst))
            .or_insert_with(|| LinkRng::new(seed, src, dst))
            .extra_ns(spec, bytes);
        let arrive = end
            .saturating_add(ns(spec.latency))
            .saturating_add(ns(spec.overhead))
            .saturating_add(extra);
        st.frames += 1;
        st.wire_bytes[src] += bytes;
        if sh != dh {
            st.inter_host_bytes += bytes;
        }
        if self.cfg.trace {
            st.trace.push(TraceEvent {
                sent_ns: now,
                arrive_ns: arrive,
                src,
                dst,
                kind: header.kind,
                seq: header.seq,
                step: header.step,
                chunk: header.chunk,
                wire_bytes: bytes as u64,
            });
        }
        st.schedule(
            arrive,
            Event::Deliver {
                src,
                dst,
                header: header.clone(),
                payload: payload.to_vec(),
            },
        );
        drop(st);
        self.wake.notify_one();
        Ok(())
    }

    /// Records that `rank`'s work ended now.
    pub(crate) fn finish(&self, rank: usize) {
        let mut st = self.lock();
        let now = self.now_in(&st);
        st.finished[rank] = Some(now);
    }

    /// Applies one event (outside the state lock: mailboxes wake tasks).
    fn apply(&self, at: u64, event: Event) {
        match event {
            Event::Deliver {
                src,
                dst,
                header,
                payload,
            } => {
                {
                    let st = self.lock();
                    let link = (src.min(dst), src.max(dst));
                    if st.dead[dst].is_some() || (!st.cut.is_empty() && st.cut.contains(&link)) {
                        return;
                    }
                }
                self.mailboxes[dst].dispatch(Frame {
                    header,
                    payload: Payload::from(payload),
                });
            }
            Event::Kill(r) => {
                {
                    let mut st = self.lock();
                    if st.dead[r].is_some() {
                        return;
                    }
                    st.dead[r] = Some(at);
                    let detect = at.saturating_add(ns(self.cfg.detect_after));
                    st.schedule(detect, Event::DetectRank(r));
                }
                self.mailboxes[r].close(Error::Closed(format!(
                    "rank {r} failed at virtual time {:.6} s (simulated fault)",
                    secs(at)
                )));
            }
            Event::Cut(a, b) => {
                let mut st = self.lock();
                st.cut.insert((a.min(b), a.max(b)));
                let detect = at.saturating_add(ns(self.cfg.detect_after));
                st.schedule(detect, Event::DetectLink(a, b));
            }
            Event::DetectRank(r) => {
                let died = self.lock().dead[r].unwrap_or(at);
                let err = Error::PeerLost {
                    rank: r,
                    op: "any operation".into(),
                    reason: format!(
                        "it failed at virtual time {:.6} s and went silent; declared lost {:.3} s later",
                        secs(died),
                        self.cfg.detect_after.as_secs_f64()
                    ),
                };
                let alive: Vec<usize> = {
                    let st = self.lock();
                    (0..self.cfg.world)
                        .filter(|&q| q != r && st.dead[q].is_none())
                        .collect()
                };
                for q in alive {
                    self.mailboxes[q].fail_peer(r, err.clone());
                }
            }
            Event::DetectLink(a, b) => {
                for (me, peer) in [(a, b), (b, a)] {
                    self.mailboxes[me].fail_peer(
                        peer,
                        Error::PeerLost {
                            rank: peer,
                            op: "any operation".into(),
                            reason: format!(
                                "the link from rank {me} was cut at virtual time {:.6} s",
                                secs(at.saturating_sub(ns(self.cfg.detect_after)))
                            ),
                        },
                    );
                }
            }
        }
    }

    /// What the run did, once every rank is done.
    pub(crate) fn report(&self) -> super::SimReport {
        let mut st = self.lock();
        let end = self.now_in(&st);
        super::SimReport {
            elapsed: Duration::from_nanos(
                st.finished.iter().flatten().copied().max().unwrap_or(end),
            ),
            finished: st
                .finished
                .iter()
                .map(|f| Duration::from_nanos(f.unwrap_or(end)))
                .collect(),
            frames: st.frames,
            wire_bytes: std::mem::take(&mut st.wire_bytes),
            inter_host_bytes: st.inter_host_bytes,
            trace: std::mem::take(&mut st.trace),
        }
    }
}

/// Delivers events in time order, each once every tracked rank has done what it can before
/// it (`runnable` counts the ranks that are woken and not yet polled). Runs until aborted.
pub(crate) async fn drive(net: Arc<SimNet>, runnable: Arc<AtomicUsize>) {
    loop {
        while runnable.load(Ordering::Acquire) > 0 {
            tokio::task::yield_now().await;
        }
        let next = net.lock().events.peek().map(|Reverse(s)| s.at);
        let Some(at) = next else {
            // Nothing in flight: tokio's clock runs on to the next deadline, if any.
            net.wake.notified().await;
            continue;
        };
        let target = net.t0 + Duration::from_millis(at / 1_000_000);
        if target > Instant::now() {
            tokio::select! {
                biased;
                _ = net.wake.notified() => {}
                _ = tokio::time::sleep_until(target) => {}
            }
            // A deadline may have fired on the way: let its rank act first.
            continue;
        }
        let batch: Vec<Scheduled> = {
            let mut st = net.lock();
            st.clock = st.clock.max(at);
            let mut batch = Vec::new();
            while st.events.peek().is_some_and(|Reverse(s)| s.at == at) {
                if let Some(Reverse(s)) = st.events.pop() {
                    batch.push(s);
                }
            }
            batch
        };
        for s in batch {
            net.apply(s.at, s.event);
        }
    }
}

/// One rank's end of a simulated network.
pub struct SimTransport {
    rank: usize,
    net: Arc<SimNet>,
}

impl SimTransport {
    pub(crate) fn new(rank: usize, net: Arc<SimNet>) -> SimTransport {
        SimTransport { rank, net }
    }

    /// Virtual time since the start of the run.
    pub fn now(&self) -> Duration {
        Duration::from_nanos(self.net.now())
    }
}

impl Transport for SimTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.net.cfg.world
    }

    fn mailbox(&self) -> &Mailbox {
        &self.net.mailboxes[self.rank]
    }

    async fn send_frame<'a>(
        &'a self,
        peer: usize,
        header: &'a Header,
        payload: &'a [u8],
    ) -> Result<()> {
        self.net.send(self.rank, peer, header, payload)
    }

    async fn goodbye(&self) {}
}
