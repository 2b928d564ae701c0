//! The simulated network: a [`Transport`] per rank over one event queue in virtual time.
//!
//! Every send computes its arrival time from the link model at once (queue, serialisation,
//! latency, loss recovery, jitter) and files a delivery event; the driver
//! ([`drive`]) delivers events in time order, and only when every rank has done all it can at
//! the current instant. Virtual time is kept in nanoseconds here; tokio's paused clock, which
//! the operations' deadlines run on, follows it to the millisecond (it never runs ahead of
//! an event), and jumps straight to the next timer when nothing else can happen, so that idle
//! waits cost nothing.

use super::link::{Bucket, LinkRng, LinkSpec};
use super::{Cpus, Fault, SimConfig, TraceEvent};
use crate::error::{Error, Result};
use crate::health::{Action, PeerMonitor, ProgressWatch};
use crate::transport::peer_memory;
use crate::transport::{Frame, Mailbox, Payload, SeqSpace, Transport};
use crate::wire::{FrameKind, Header};
use bytes::Bytes;
use std::cmp::{Ordering as CmpOrdering, Reverse};
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
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
        payload: Bytes,
    },
    /// A rank dies: it stops sending and receiving.
    Kill(usize),
    /// The link between two ranks stops carrying anything.
    Cut(usize, usize),
    /// The failure detector of rank `me`'s connection to `peer` checks it.
    Check { me: usize, peer: usize },
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
    /// When the control frames queued on each pair's link inside a host have left.
    ctl_pair_free: PairMap<u64>,
    /// When the control frames queued on each host's card have left.
    ctl_nic_free: Vec<u64>,
    /// The shaper's tokens of each pair's link inside a host (a shaped intra-host link).
    pair_bucket: PairMap<Bucket>,
    /// The shaper's tokens of each host's card (a shaped inter-host link).
    nic_bucket: Vec<Bucket>,
    /// What each core of each machine is booked for (empty without a CPU model).
    cores: Vec<Vec<Busy>>,
    /// The last control payload sent: the same one sent again (a rendezvous table to every
    /// rank) shares its bytes instead of holding a copy per frame in flight.
    last_control: Bytes,
    rngs: PairMap<LinkRng>,
    dead: Vec<Option<u64>>,
    /// Links cut, and when.
    cut: HashMap<(usize, usize), u64>,
    /// When each connection (by its lower rank first) was established.
    conns: PairMap<u64>,
    /// Each rank's connected peers.
    peers_of: Vec<Vec<usize>>,
    /// When packets of the latest flow from a peer reach a rank, first and last, by (the
    /// rank, the peer): a frame's packets while it flows (not only at its end), and the
    /// acknowledgements of what the rank sends.
    flows: PairMap<(u64, u64)>,
    /// The failure detectors that run: those of connections to a dead rank or across a cut
    /// link, by (this rank, its peer). Elsewhere nothing could fire: a live peer's
    /// keep-alives arrive every interval, and the simulator has no stalled ranks.
    monitors: PairMap<PeerMonitor>,
    /// Each rank's own progress, which its monitors report.
    progress: Vec<ProgressWatch>,
    frames: u64,
    wire_bytes: Vec<f64>,
    inter_host_bytes: f64,
    finished: Vec<Option<u64>>,
    /// Until when each rank is busy copying from its local peers (direct reads): its next
    /// frame leaves, and its operation ends, no earlier.
    reading_until: Vec<u64>,
    trace: Vec<TraceEvent>,
}

impl State {
    fn schedule(&mut self, at: u64, event: Event) {
        let id = self.next_id;
        self.next_id += 1;
        self.events.push(Reverse(Scheduled { at, id, event }));
    }
}

/// Files that packets reach a rank from a peer (`key`: the rank, the peer) from `first` to
/// `last`; a flow back to back with the one before extends it.
fn note_flow(flows: &mut PairMap<(u64, u64)>, key: (usize, usize), first: u64, last: u64) {
    let flow = flows.entry(key).or_insert((first, last));
    if last > flow.1 {
        let start = if first <= flow.1 { flow.0 } else { first };
        *flow = (start, last);
    }
}

/// What moving one frame takes, in nanoseconds: its time on the link, the link's latency,
/// and the processor time of its sending and receiving ends.
#[derive(Debug, Clone, Copy)]
struct Work {
    wire: u64,
    latency: u64,
    tx: u64,
    rx: u64,
}

/// The intervals a core is busy, `[start, end)` in virtual nanoseconds, in time order.
type Busy = Vec<(u64, u64)>;

/// Whether a core is idle for `len` from `s`.
fn idle(busy: &Busy, s: u64, len: u64) -> bool {
    len == 0
        || busy
            .iter()
            .all(|&(a, b)| b <= s || a >= s.saturating_add(len))
}

/// How long a core stays idle from `s` (`u64::MAX`: for good), or `None` if it is busy at `s`.
fn idle_for(busy: &Busy, s: u64) -> Option<u64> {
    if busy.iter().any(|&(a, b)| a <= s && s < b) {
        return None;
    }
    Some(
        busy.iter()
            .map(|&(a, _)| a)
            .filter(|&a| a > s)
            .min()
            .map_or(u64::MAX, |a| a - s),
    )
}

/// Marks a core busy for `len` from `s`.
fn occupy(busy: &mut Busy, s: u64, len: u64) {
    if len > 0 {
        let i = busy.partition_point(|&(a, _)| a < s);
        busy.insert(i, (s, s.saturating_add(len)));
    }
}

/// Books a frame whose link is free at `at` on a core of its sender's machine (from when it
/// starts to leave) and one of its receiver's (from when its first byte arrives): the
/// earliest start at which both are idle long enough, in the gaps between what is booked
/// already (a rank queues its frames ahead, and they must not hold the cores in between).
/// Returns when the frame starts and when its last byte has left: its packets are processed
/// as they go, so it takes as long as the slowest of the link and its two ends. One core
/// serving both ends (a one-core machine sending to itself) does both ends' work.
fn book_cores(
    cores: &mut [Vec<Busy>],
    cpu: Cpus,
    (src, dst): (usize, usize),
    now: u64,
    at: u64,
    w: Work,
) -> (u64, u64) {
    let (ms, md) = (src / cpu.ranks_per_machine, dst / cpu.ranks_per_machine);
    for machine in [ms, md] {
        for busy in &mut cores[machine] {
            busy.retain(|&(_, end)| end > now);
        }
    }
    let one_core = ms == md && cores[ms].len() == 1;
    let (tx, rx) = if one_core {
        (w.tx + w.rx, 0)
    } else {
        (w.tx, w.rx)
    };
    // Candidate starts: `at`, and every moment a booking ends (for the receiver, one latency
    // before): after the last of them every core is idle, so the search ends.
    let mut starts: Vec<u64> = std::iter::once(at)
        .chain(cores[ms].iter().flatten().map(|&(_, end)| end))
        .chain(
            cores[md]
                .iter()
                .flatten()
                .map(|&(_, end)| end.saturating_sub(w.latency)),
        )
        .filter(|&t| t >= at)
        .collect();
    starts.sort_unstable();
    starts.dedup();
    for s in starts {
        let r = s.saturating_add(w.latency);
        let Some(tc) = (0..cores[ms].len()).find(|&c| idle(&cores[ms][c], s, tx)) else {
            continue;
        };
        let rc = (0..cores[md].len())
            .find(|&c| (ms != md || c != tc || one_core) && idle(&cores[md][c], r, rx));
        if let Some(rc) = rc {
            occupy(&mut cores[ms][tc], s, tx);
            occupy(&mut cores[md][rc], r, rx);
            return (s, s.saturating_add(w.wire.max(tx).max(rx)));
        }
    }
    // Unreachable (every core is idle after the last candidate); kept total.
    (at, at.saturating_add(w.wire.max(tx).max(rx)))
}

/// The shared network of one simulation.
pub(crate) struct SimNet {
    pub(super) cfg: SimConfig,
    mailboxes: Vec<Arc<Mailbox>>,
    state: Mutex<State>,
    wake: Notify,
    t0: Instant,
    /// The failure detectors' clock at virtual time 0 (they count virtual nanoseconds from it).
    clock0: std::time::Instant,
    /// The last address table decoded and its bytes: every simulated rank receives the same
    /// table, and parsing it once per rank would make a large rendezvous cost W² real time.
    pub(super) last_table: Mutex<Option<(Vec<u8>, Arc<crate::rendezvous::Table>)>>,
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
            ctl_pair_free: PairMap::default(),
            ctl_nic_free: vec![0; w.div_ceil(cfg.topology.ranks_per_host)],
            pair_bucket: PairMap::default(),
            nic_bucket: vec![
                Bucket::full(&cfg.topology.inter);
                w.div_ceil(cfg.topology.ranks_per_host)
            ],
            cores: cfg
                .cpu
                .map(|c| vec![vec![Busy::new(); c.cores]; w.div_ceil(c.ranks_per_machine)])
                .unwrap_or_default(),
            last_control: Bytes::new(),
            rngs: PairMap::default(),
            dead: vec![None; w],
            cut: HashMap::new(),
            conns: PairMap::default(),
            peers_of: vec![Vec::new(); w],
            flows: PairMap::default(),
            monitors: PairMap::default(),
            progress: (0..w)
                .map(|_| ProgressWatch::new(0, Duration::from_secs(30), 10))
                .collect(),
            frames: 0,
            wire_bytes: vec![0.0; w],
            inter_host_bytes: 0.0,
            finished: vec![None; w],
            reading_until: vec![0; w],
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
            clock0: std::time::Instant::now(),
            last_table: Mutex::new(None),
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

    pub(super) fn host(&self, rank: usize) -> usize {
        rank / self.cfg.topology.ranks_per_host
    }

    /// The link model between two ranks.
    fn spec_of(&self, a: usize, b: usize) -> &LinkSpec {
        if self.host(a) == self.host(b) {
            &self.cfg.topology.intra
        } else {
            &self.cfg.topology.inter
        }
    }

    /// The round trip a connection's keep-alives measure.
    fn rtt(&self, a: usize, b: usize) -> Duration {
        let s = self.spec_of(a, b);
        (s.latency + s.overhead) * 2
    }

    /// The failure detectors' clock at virtual time `t`.
    fn instant(&self, t: u64) -> std::time::Instant {
        self.clock0 + Duration::from_nanos(t)
    }

    /// Ranks `a` and `b` are connected from `now` on (a frame went between them, or one
    /// waits for the other), as QUIC connects on first use; from then on each end's failure
    /// detector watches the other.
    fn connect(&self, st: &mut State, a: usize, b: usize, now: u64) {
        let key = (a.min(b), a.max(b));
        if a == b || st.conns.contains_key(&key) {
            return;
        }
        st.conns.insert(key, now);
        st.peers_of[a].push(b);
        st.peers_of[b].push(a);
        // Connected to a rank already dead, or across a link already cut.
        for (me, peer) in [(a, b), (b, a)] {
            if st.dead[peer].is_some() || st.cut.contains_key(&key) {
                self.start_monitor(st, me, peer, now);
            }
        }
    }

    /// Runs the detector of `me`'s connection to `peer` (whose keep-alives stopped) as it has
    /// run since the connection began: its checks fall every tick from then, and the first
    /// one at or after `from` is filed.
    fn start_monitor(&self, st: &mut State, me: usize, peer: usize, from: u64) {
        if st.dead[me].is_some() || st.monitors.contains_key(&(me, peer)) {
            return;
        }
        let Some(&since) = st.conns.get(&(me.min(peer), me.max(peer))) else {
            return;
        };
        let mut m = PeerMonitor::new(peer, self.cfg.heartbeat, self.instant(since));
        // The handshake's round trip.
        m.on_heard(self.rtt(me, peer), self.instant(since));
        let tick = ns(m.tick()).max(1);
        let first = since + from.saturating_sub(since).div_ceil(tick).max(1) * tick;
        st.monitors.insert((me, peer), m);
        st.schedule(first, Event::Check { me, peer });
    }

    /// When the last keep-alive from `peer` that reached `me` by `at` arrived: every side
    /// sends one each heartbeat interval from the connection's start, while it lives and the
    /// link carries them. Keep-alives are neither queued behind data nor lost (QUIC sends them
    /// ahead of data, and a lost one is covered by the detector's two missed intervals).
    fn last_keepalive(&self, st: &State, me: usize, peer: usize, at: u64) -> Option<u64> {
        let key = (me.min(peer), me.max(peer));
        let since = *st.conns.get(&key)?;
        let spec = self.spec_of(peer, me);
        let delay = ns(spec.latency).saturating_add(ns(spec.overhead));
        let interval = ns(self.cfg.heartbeat).max(1);
        let mut last_sent = at.checked_sub(delay)?;
        if let Some(d) = st.dead[peer] {
            last_sent = last_sent.min(d.checked_sub(1)?);
        }
        if let Some(&c) = st.cut.get(&key) {
            last_sent = last_sent.min(c.checked_sub(1)?);
        }
        if last_sent < since + interval {
            return None;
        }
        let k = (last_sent - since) / interval;
        Some(since + k * interval + delay)
    }

    /// When the last packet of `peer`'s frames reached `me` by `at`: a frame's packets arrive
    /// from its first byte's arrival to its last's, and stop when their sender dies.
    fn last_packet(&self, st: &State, me: usize, peer: usize, at: u64) -> Option<u64> {
        let &(first, last) = st.flows.get(&(me, peer))?;
        let mut t = last.min(at);
        if let Some(d) = st.dead[peer] {
            let spec = self.spec_of(peer, me);
            t = t.min(d.saturating_add(ns(spec.latency)));
        }
        (first <= t).then_some(t)
    }

    /// Rank `me` waits for a frame from `peer`: connect them (see [`SimNet::connect`]).
    pub(crate) fn expect(&self, me: usize, peer: usize) {
        if peer >= self.cfg.world {
            return;
        }
        let mut st = self.lock();
        if st.dead[me].is_some() {
            return;
        }
        let now = self.now_in(&st);
        self.connect(&mut st, me, peer, now);
    }

    /// Rank `me` started (`started`) or finished collective `seq`: what its progress
    /// reports say.
    pub(crate) fn progress(&self, me: usize, seq: u64, started: bool) {
        let mut st = self.lock();
        let now = self.instant(self.now_in(&st));
        if started {
            st.progress[me].op_started(seq, now);
        } else {
            st.progress[me].op_finished(seq);
        }
    }

    /// Rank `me` read `bytes` (real, scaled here) of a local peer's tensor: with a CPU model,
    /// the copy takes the intra-host links' receiving cost per byte of its machine's cores,
    /// from when the rank's earlier copies are done. One thread copies, so its pieces follow
    /// each other; they fill the cores' idle gaps, as a scheduler slices a long copy between
    /// the frames booked already. The rank's next frame leaves, and its operation ends, only
    /// after the copy (`reading_until`).
    fn read_locally(&self, me: usize, bytes: usize) {
        let Some(cpu) = self.cfg.cpu else {
            return;
        };
        let mut left =
            (bytes as f64 * self.cfg.scale * self.cfg.topology.intra.cpu_rx).ceil() as u64;
        let mut st = self.lock();
        let mut t = self.now_in(&st).max(st.reading_until[me]);
        let machine = &mut st.cores[me / cpu.ranks_per_machine];
        // Each piece ends the copy or fills a gap up to a booking: at most one piece per
        // booking, and the last one after every booking.
        for _ in 0..=machine.iter().map(Vec::len).sum::<usize>() {
            if left == 0 {
                break;
            }
            // The earliest moment from `t` at which a core is idle, and how long it stays so.
            let mut starts: Vec<u64> = std::iter::once(t)
                .chain(machine.iter().flatten().map(|&(_, end)| end))
                .filter(|&x| x >= t)
                .collect();
            starts.sort_unstable();
            let Some((s, core, gap)) = starts.into_iter().find_map(|s| {
                machine
                    .iter()
                    .enumerate()
                    .find_map(|(c, busy)| idle_for(busy, s).map(|gap| (s, c, gap)))
            }) else {
                break;
            };
            let piece = left.min(gap);
            occupy(&mut machine[core], s, piece);
            t = s.saturating_add(piece);
            left -= piece;
        }
        st.reading_until[me] = t.saturating_add(left);
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
        self.connect(&mut st, src, dst, now);
        // A rank copying from its local peers sends once the copy is done.
        let ready = now.max(st.reading_until[src]);
        // Aborts and control frames are real bytes (never scaled) and go ahead of the data
        // queued on the link, as the transport sends them; they queue behind each other and
        // push the data back by their own time on the wire (a rendezvous table sent to every
        // rank is not free).
        let urgent =
            header.kind == FrameKind::Abort || SeqSpace::of(header.kind) == SeqSpace::Control;
        let scale = if urgent { 1.0 } else { self.cfg.scale };
        let bytes = header.encoded_len() as f64 + payload.len() as f64 * scale;
        let (sh, dh) = (self.host(src), self.host(dst));
        let state = &mut *st;
        let intra = &self.cfg.topology.intra;
        let (spec, free, ctl_free, bucket): (&LinkSpec, &mut u64, &mut u64, &mut Bucket) =
            if sh == dh {
                (
                    intra,
                    state.pair_free.entry((src, dst)).or_insert(0),
                    state.ctl_pair_free.entry((src, dst)).or_insert(0),
                    state
                        .pair_bucket
                        .entry((src, dst))
                        .or_insert_with(|| Bucket::full(intra)),
                )
            } else {
                (
                    &self.cfg.topology.inter,
                    &mut state.nic_free[sh],
                    &mut state.ctl_nic_free[sh],
                    &mut state.nic_bucket[sh],
                )
            };
        let (start, end) = if urgent {
            // Control frames are a few hundred bytes: a shaper's tokens are not charged.
            let wire = spec.serialise_ns(bytes);
            let start = now.max(*ctl_free);
            let end = start.saturating_add(wire);
            *ctl_free = end;
            *free = (*free).max(start).saturating_add(wire);
            (start, end)
        } else {
            let at = ready.max(*free);
            // Tokens counted at `at`: a frame that then waits for a core finds no fewer.
            let wire = spec.shaped_ns(bytes, bucket, at);
            let (start, end) = match self.cfg.cpu {
                Some(cpu) if spec.cpu_tx > 0.0 || spec.cpu_rx > 0.0 => {
                    let work = Work {
                        wire,
                        latency: ns(spec.latency),
                        // Every try of a lost packet is built and sealed again; the
                        // receiver only works on the packets that reach it.
                        tx: (bytes * spec.cpu_tx / (1.0 - spec.loss)).ceil() as u64,
                        rx: (bytes * spec.cpu_rx).ceil() as u64,
                    };
                    book_cores(&mut state.cores, cpu, (src, dst), now, at, work)
                }
                _ => (at, at.saturating_add(wire)),
            };
            *free = end;
            (start, end)
        };
        let seed = self.cfg.seed;
        let extra = st
            .rngs
            .entry((src, dst))
            .or_insert_with(|| LinkRng::new(seed, src, dst))
            .extra_ns(spec, bytes);
        let first_byte = start.saturating_add(ns(spec.latency));
        let last_byte = end.saturating_add(ns(spec.latency));
        let arrive = end
            .saturating_add(ns(spec.latency))
            .saturating_add(ns(spec.overhead))
            .saturating_add(extra);
        st.frames += 1;
        // The receiver hears the frame's packets; the sender, one latency later, its
        // acknowledgements.
        let lat = ns(spec.latency);
        note_flow(&mut st.flows, (dst, src), first_byte, last_byte);
        note_flow(
            &mut st.flows,
            (src, dst),
            first_byte.saturating_add(lat),
            last_byte.saturating_add(lat),
        );
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
        let payload = if !urgent {
            Bytes::copy_from_slice(payload)
        } else if st.last_control.as_ref() == payload {
            st.last_control.clone()
        } else {
            st.last_control = Bytes::copy_from_slice(payload);
            st.last_control.clone()
        };
        st.schedule(
            arrive,
            Event::Deliver {
                src,
                dst,
                header: header.clone(),
                payload,
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
        st.finished[rank] = Some(now.max(st.reading_until[rank]));
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
                    if st.dead[dst].is_some() || st.cut.contains_key(&link) {
                        return;
                    }
                }
                let mut p = Payload::new();
                p.push(payload);
                self.mailboxes[dst].dispatch(Frame { header, payload: p });
            }
            Event::Kill(r) => {
                {
                    let mut st = self.lock();
                    if st.dead[r].is_some() {
                        return;
                    }
                    st.dead[r] = Some(at);
                    for q in st.peers_of[r].clone() {
                        self.start_monitor(&mut st, q, r, at);
                    }
                }
                self.mailboxes[r].close(Error::Closed(format!(
                    "rank {r} failed at virtual time {:.6} s (simulated fault)",
                    secs(at)
                )));
            }
            Event::Cut(a, b) => {
                let mut st = self.lock();
                let link = (a.min(b), a.max(b));
                if st.cut.contains_key(&link) {
                    return;
                }
                st.cut.insert(link, at);
                self.start_monitor(&mut st, a, b, at);
                self.start_monitor(&mut st, b, a, at);
            }
            Event::Check { me, peer } => {
                let failure = {
                    let mut st = self.lock();
                    if st.dead[me].is_some() {
                        return;
                    }
                    let Some(mut m) = st.monitors.remove(&(me, peer)) else {
                        return;
                    };
                    // What came from the peer by now: keep-alives, and frames.
                    let frame = self.last_packet(&st, me, peer, at);
                    if let Some(heard) = self.last_keepalive(&st, me, peer, at).max(frame) {
                        m.on_heard(self.rtt(me, peer), self.instant(heard));
                    }
                    let mut failure = None;
                    for action in m.handle_timeout(self.instant(at), &st.progress[me]) {
                        match action {
                            // Reports would only feed the peer's stall watch: no simulated
                            // rank stalls, so they are not sent.
                            Action::Report(_) => m.report_sent(true),
                            Action::Silent { silent, limit } => {
                                failure = Some(Error::PeerLost {
                                    rank: peer,
                                    op: "any operation".into(),
                                    reason: format!(
                                        "{} (virtual time {:.6} s)",
                                        m.silence_reason(silent, limit),
                                        secs(at)
                                    ),
                                });
                            }
                            Action::Stalled(s) => {
                                let (op, reason) = PeerMonitor::stall_reason(&s);
                                failure = Some(Error::PeerStalled {
                                    rank: peer,
                                    op,
                                    reason,
                                });
                            }
                        }
                    }
                    if failure.is_none() {
                        if let Some(next) = m.poll_timeout() {
                            let next = ns(next.saturating_duration_since(self.clock0));
                            st.monitors.insert((me, peer), m);
                            st.schedule(next, Event::Check { me, peer });
                        }
                    }
                    failure
                };
                if let Some(e) = failure {
                    self.mailboxes[me].fail_peer(peer, e);
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

/// Whether this process may read its own memory with `process_vm_readv` (a seccomp filter
/// may forbid the call), probed once.
fn own_memory_readable() -> bool {
    static READABLE: OnceLock<bool> = OnceLock::new();
    *READABLE.get_or_init(|| {
        let src = [0x5au8; 8];
        let mut dst = [0u8; 8];
        peer_memory::read(std::process::id(), src.as_ptr() as u64, &mut dst).is_ok() && dst == src
    })
}

/// One rank's end of a simulated network.
pub struct SimTransport {
    rank: usize,
    pub(super) net: Arc<SimNet>,
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

    fn expect_from(&self, peer: usize) {
        self.net.expect(self.rank, peer);
    }

    fn op_started(&self, seq: u64) {
        self.net.progress(self.rank, seq, true);
    }

    fn op_finished(&self, seq: u64) {
        self.net.progress(self.rank, seq, false);
    }

    fn local_pid(&self, peer: usize) -> Option<u32> {
        let cfg = &self.net.cfg;
        (cfg.direct_reads && peer < cfg.world && self.net.host(peer) == self.net.host(self.rank))
            .then(std::process::id)
    }

    fn reads_peer_memory(&self, peer: usize) -> bool {
        self.local_pid(peer).is_some()
    }

    fn read_from_peer(&self, bytes: usize) {
        self.net.read_locally(self.rank, bytes);
    }

    /// Whenever this process may read its own memory: a simulation stands for a group's
    /// steady state, in which the members of an operation remember from the one before that
    /// they read each other (no probe round). Where the kernel forbids the call, the members
    /// probe, are refused and take the rings, as real ones do.
    fn direct_reads_known(&self, peers: &[(usize, u32)]) -> bool {
        let _ = peers;
        own_memory_readable()
    }

    async fn goodbye(&self) {}
}
