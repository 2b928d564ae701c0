//! Fault injection under QUIC: a UDP socket wrapper that loses, duplicates, reorders, delays
//! and rate-limits datagrams, deterministically from a seed.
//!
//! [`bind_with_chaos`] wraps the socket quinn would use; pass the result to
//! `Endpoint::new_with_abstract_socket`. Decisions are taken per datagram: a GSO transmit
//! (`Transmit::segment_size`) is split into its segments and the survivors re-issued as
//! smaller transmits; a GRO receive (`RecvMeta::stride`) is filtered segment by segment.
//! Held datagrams (delay, jitter, reordering, rate shaping, duplicates) wait in a timer queue
//! that a tokio task sends from.
//!
//! On send: rate shaping (a virtual-clock token bucket with a [`RATE_QUEUE`] backlog; beyond
//! it datagrams are tail-dropped like at a router), then loss (with bursts), duplication,
//! reordering, delay and jitter. On receive: loss only. The kill switch drops everything in
//! both directions while set.
//!
//! Payload corruption is parsed here ([`ChaosConfig::corrupt`]) but not applied: a corrupted
//! QUIC packet fails its AEAD check and looks exactly like a lost one. Corrupt payloads above
//! QUIC (e.g. FEC shards) to test the checks there. With `corrupt_every` and `corrupt_for`
//! the corruption comes in windows, as memory errors do, and damages received payloads too
//! ([`ChaosConfig::corrupting_at`]).

use crate::error::{Error, Result};
use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::BinaryHeap;
use std::fmt;
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// Most backlog the rate shaper holds before it drops (as a router's queue would).
pub const RATE_QUEUE: Duration = Duration::from_millis(50);

/// Shortest hold of a reordered datagram (it is held for `max(delay, REORDER_HOLD)` extra).
pub const REORDER_HOLD: Duration = Duration::from_millis(1);

/// Receive polls that may find only dropped datagrams before yielding to the runtime.
const RECV_SPINS: usize = 64;

const DEFAULT_BURST_LEN: u32 = 4;

/// What to do to datagrams. Parse it from `key=value` pairs with [`ChaosConfig::parse`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChaosConfig {
    /// Seeds every random decision.
    pub seed: u64,
    /// Probability that a datagram is lost (`loss`).
    pub loss: f64,
    /// Probability that a loss starts a burst (`burst`): the next `burst_len − 1` datagrams
    /// are lost too, so the effective loss rate exceeds `loss`.
    pub burst: f64,
    /// Datagrams lost in a burst, the first included (`burst_len`, default 4).
    pub burst_len: u32,
    /// Probability that a sent datagram is sent twice (`dup`).
    pub duplicate: f64,
    /// Probability that a sent datagram is held back `max(delay, 1 ms)` so later ones pass
    /// it (`reorder`).
    pub reorder: f64,
    /// Fixed delay added to every sent datagram (`delay`).
    pub delay: Duration,
    /// Uniform random extra delay in `0..jitter` (`jitter`; it reorders too).
    pub jitter: Duration,
    /// Bits per second sent at most (`rate`, e.g. `1gbit`); `None`: unlimited.
    pub rate_bps: Option<u64>,
    /// Probability of payload corruption (`corrupt`): parsed here, applied above QUIC.
    pub corrupt: f64,
    /// Corruption only in windows (`corrupt_every`): one begins every this long, counted
    /// from the group's start, the first at the start; `None`: all the time, sent frames only.
    pub corrupt_every: Option<Duration>,
    /// How long each window lasts (`corrupt_for`); in a window both sent and received
    /// payloads are damaged with probability `corrupt`, as a memory error would damage the
    /// process's buffers.
    pub corrupt_for: Duration,
}

impl Default for ChaosConfig {
    fn default() -> Self {
        ChaosConfig {
            seed: 0,
            loss: 0.0,
            burst: 0.0,
            burst_len: DEFAULT_BURST_LEN,
            duplicate: 0.0,
            reorder: 0.0,
            delay: Duration::ZERO,
            jitter: Duration::ZERO,
            rate_bps: None,
            corrupt: 0.0,
            corrupt_every: None,
            corrupt_for: Duration::ZERO,
        }
    }
}

const KEYS: &str = "seed, loss, burst, burst_len, dup, reorder, delay, jitter, rate, corrupt, corrupt_every, corrupt_for";

fn bad(key: &str, value: &str, why: &str) -> Error {
    Error::InvalidArgument(format!("chaos spec: bad value {value:?} for {key}: {why}"))
}

fn parse_prob(key: &str, v: &str) -> Result<f64> {
    let p: f64 = v
        .parse()
        .map_err(|_| bad(key, v, "expected a probability like 0.05"))?;
    if !(0.0..=1.0).contains(&p) {
        return Err(bad(key, v, "a probability must lie in [0, 1]"));
    }
    Ok(p)
}

fn split_unit(v: &str) -> (&str, &str) {
    let at = v
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(v.len());
    v.split_at(at)
}

fn parse_duration(key: &str, v: &str) -> Result<Duration> {
    let (num, unit) = split_unit(v);
    let scale = match unit {
        "ns" => 1e0,
        "us" | "µs" => 1e3,
        "ms" => 1e6,
        "s" => 1e9,
        "" if num == "0" => 1.0,
        _ => return Err(bad(key, v, "expected a duration like 5ms (ns, us, ms, s)")),
    };
    let x: f64 = num
        .parse()
        .map_err(|_| bad(key, v, "expected a duration like 5ms (ns, us, ms, s)"))?;
    let nanos = (x * scale).round();
    if !(0.0..=1e15).contains(&nanos) {
        return Err(bad(key, v, "duration out of range"));
    }
    Ok(Duration::from_nanos(nanos as u64))
}

fn parse_rate(key: &str, v: &str) -> Result<u64> {
    let (num, unit) = split_unit(v);
    let scale = match unit.to_ascii_lowercase().as_str() {
        "" | "bit" | "bps" => 1e0,
        "kbit" | "kbps" => 1e3,
        "mbit" | "mbps" => 1e6,
        "gbit" | "gbps" => 1e9,
        _ => {
            return Err(bad(
                key,
                v,
                "expected a rate like 100mbit (bit, kbit, mbit, gbit)",
            ))
        }
    };
    let x: f64 = num
        .parse()
        .map_err(|_| bad(key, v, "expected a rate like 100mbit"))?;
    let bps = (x * scale).round();
    if !(1.0..=1e15).contains(&bps) {
        return Err(bad(key, v, "a rate must be at least 1 bit/s"));
    }
    Ok(bps as u64)
}

impl ChaosConfig {
    /// Parses `key=value` pairs separated by commas, e.g.
    /// `loss=0.2,corrupt=0.01,seed=1,delay=5ms,rate=1gbit,burst=0.1,dup=0.01,reorder=0.05`.
    /// Keys left out keep their defaults (no faults); an empty string is the default.
    pub fn parse(spec: &str) -> Result<ChaosConfig> {
        let mut c = ChaosConfig::default();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (key, value) = item.split_once('=').ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "chaos spec: {item:?} is not key=value (keys: {KEYS})"
                ))
            })?;
            let (key, v) = (key.trim(), value.trim());
            match key {
                "seed" => {
                    c.seed = v
                        .parse()
                        .map_err(|_| bad(key, v, "expected an unsigned integer"))?
                }
                "loss" => c.loss = parse_prob(key, v)?,
                "burst" => c.burst = parse_prob(key, v)?,
                "burst_len" => {
                    c.burst_len = v
                        .parse()
                        .ok()
                        .filter(|&n| n >= 1)
                        .ok_or_else(|| bad(key, v, "expected an integer ≥ 1"))?
                }
                "dup" | "duplicate" => c.duplicate = parse_prob(key, v)?,
                "reorder" => c.reorder = parse_prob(key, v)?,
                "delay" => c.delay = parse_duration(key, v)?,
                "jitter" => c.jitter = parse_duration(key, v)?,
                "rate" => c.rate_bps = Some(parse_rate(key, v)?),
                "corrupt" => c.corrupt = parse_prob(key, v)?,
                "corrupt_every" => c.corrupt_every = Some(parse_duration(key, v)?),
                "corrupt_for" => c.corrupt_for = parse_duration(key, v)?,
                _ => {
                    return Err(Error::InvalidArgument(format!(
                        "chaos spec: unknown key {key:?} (keys: {KEYS})"
                    )))
                }
            }
        }
        c.validate()?;
        Ok(c)
    }

    /// Whether payloads are damaged `since` the group's start: always without windows, else
    /// inside the first `corrupt_for` of every `corrupt_every`.
    pub fn corrupting_at(&self, since: Duration) -> bool {
        match self.corrupt_every {
            None => true,
            Some(every) => {
                let (since, every) = (since.as_nanos(), every.as_nanos().max(1));
                since % every < self.corrupt_for.as_nanos()
            }
        }
    }

    /// Whether corruption comes in windows, damaging received payloads too.
    pub fn memory_windows(&self) -> bool {
        self.corrupt_every.is_some()
    }

    /// Checks the ranges that [`parse`](Self::parse) checks, for a config built by hand.
    pub fn validate(&self) -> Result<()> {
        for (key, p) in [
            ("loss", self.loss),
            ("burst", self.burst),
            ("dup", self.duplicate),
            ("reorder", self.reorder),
            ("corrupt", self.corrupt),
        ] {
            if !(0.0..=1.0).contains(&p) {
                return Err(bad(key, &p.to_string(), "a probability must lie in [0, 1]"));
            }
        }
        if self.burst_len == 0 {
            return Err(bad("burst_len", "0", "expected an integer ≥ 1"));
        }
        if self.rate_bps == Some(0) {
            return Err(bad("rate", "0", "a rate must be at least 1 bit/s"));
        }
        match self.corrupt_every {
            None if !self.corrupt_for.is_zero() => {
                return Err(bad(
                    "corrupt_for",
                    &fmt_duration(self.corrupt_for),
                    "a window needs corrupt_every too",
                ))
            }
            Some(every) if self.corrupt_for.is_zero() || self.corrupt_for >= every => {
                return Err(bad(
                    "corrupt_for",
                    &fmt_duration(self.corrupt_for),
                    "a window must last more than 0 and less than corrupt_every",
                ))
            }
            Some(_) if self.corrupt == 0.0 => {
                return Err(bad(
                    "corrupt_every",
                    &fmt_duration(self.corrupt_every.unwrap_or_default()),
                    "windows need corrupt=P (the probability of damage in them)",
                ))
            }
            _ => {}
        }
        Ok(())
    }
}

fn fmt_duration(d: Duration) -> String {
    let n = d.as_nanos();
    if n.is_multiple_of(1_000_000) {
        format!("{}ms", n / 1_000_000)
    } else if n.is_multiple_of(1_000) {
        format!("{}us", n / 1_000)
    } else {
        format!("{n}ns")
    }
}

fn fmt_rate(bps: u64) -> String {
    for (unit, scale) in [
        ("gbit", 1_000_000_000),
        ("mbit", 1_000_000),
        ("kbit", 1_000),
    ] {
        if bps.is_multiple_of(scale) {
            return format!("{}{unit}", bps / scale);
        }
    }
    format!("{bps}bit")
}

/// The `parse` form: the seed, then every key that differs from its default.
impl fmt::Display for ChaosConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = ChaosConfig::default();
        write!(f, "seed={}", self.seed)?;
        let probs = [
            ("loss", self.loss, d.loss),
            ("burst", self.burst, d.burst),
            ("dup", self.duplicate, d.duplicate),
            ("reorder", self.reorder, d.reorder),
            ("corrupt", self.corrupt, d.corrupt),
        ];
        for (k, v, def) in probs {
            if v != def {
                write!(f, ",{k}={v}")?;
            }
        }
        if self.burst_len != d.burst_len {
            write!(f, ",burst_len={}", self.burst_len)?;
        }
        if self.delay != d.delay {
            write!(f, ",delay={}", fmt_duration(self.delay))?;
        }
        if self.jitter != d.jitter {
            write!(f, ",jitter={}", fmt_duration(self.jitter))?;
        }
        if let Some(r) = self.rate_bps {
            write!(f, ",rate={}", fmt_rate(r))?;
        }
        if let Some(every) = self.corrupt_every {
            write!(
                f,
                ",corrupt_every={},corrupt_for={}",
                fmt_duration(every),
                fmt_duration(self.corrupt_for)
            )?;
        }
        Ok(())
    }
}

/// Counters of a [`ChaosSocket`], one per datagram (GSO/GRO segments counted one by one).
#[derive(Debug, Default)]
pub struct ChaosStats {
    /// Datagrams quinn handed us to send.
    pub sent: AtomicU64,
    /// Of those, dropped by `loss` (bursts included).
    pub send_dropped: AtomicU64,
    /// Of those, dropped because the rate shaper's backlog was full.
    pub rate_dropped: AtomicU64,
    /// Extra copies sent.
    pub duplicated: AtomicU64,
    /// Datagrams held in the timer queue (delay, jitter, reorder or rate shaping).
    pub delayed: AtomicU64,
    /// Of those, held back to be reordered.
    pub reordered: AtomicU64,
    /// Datagrams the socket received.
    pub received: AtomicU64,
    /// Of those, dropped by `loss`.
    pub recv_dropped: AtomicU64,
    /// Datagrams dropped in either direction by the kill switch.
    pub killed: AtomicU64,
    /// Sends the underlying socket refused (other than "would block").
    pub send_errors: AtomicU64,
    /// Transmits of more than one GSO segment quinn handed us.
    pub gso_transmits: AtomicU64,
    /// Receives of more than one GRO segment.
    pub gro_receives: AtomicU64,
}

impl ChaosStats {
    fn add(c: &AtomicU64, n: u64) {
        if n > 0 {
            c.fetch_add(n, Ordering::Relaxed);
        }
    }
}

/// Loss with bursts; one per direction.
#[derive(Debug, Clone)]
struct LossModel {
    rng: StdRng,
    burst_left: u32,
}

impl LossModel {
    fn new(seed: u64) -> LossModel {
        LossModel {
            rng: StdRng::seed_from_u64(seed),
            burst_left: 0,
        }
    }

    fn lose(&mut self, cfg: &ChaosConfig) -> bool {
        if self.burst_left > 0 {
            self.burst_left -= 1;
            return true;
        }
        if self.rng.random::<f64>() < cfg.loss {
            if cfg.burst > 0.0 && self.rng.random::<f64>() < cfg.burst {
                self.burst_left = cfg.burst_len.saturating_sub(1);
            }
            return true;
        }
        false
    }
}

#[derive(Debug, Clone)]
struct SendState {
    loss: LossModel,
    /// When the rate shaper's link is free again.
    next_free: Option<Instant>,
}

/// What happens to one outgoing datagram.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fate {
    Lost,
    RateDropped,
    /// Send at this time (`None`: now), and again (a duplicate) if `dup`.
    Send {
        at: Option<Instant>,
        dup: bool,
        reordered: bool,
    },
}

impl SendState {
    fn decide(&mut self, cfg: &ChaosConfig, len: usize, now: Instant) -> Fate {
        let mut at = now;
        if let Some(bps) = cfg.rate_bps {
            let start = self.next_free.map_or(now, |t| t.max(now));
            if start.saturating_duration_since(now) > RATE_QUEUE {
                return Fate::RateDropped;
            }
            let wire = Duration::from_secs_f64(len as f64 * 8.0 / bps as f64);
            self.next_free = Some(start + wire);
            at = start;
        }
        if self.loss.lose(cfg) {
            return Fate::Lost;
        }
        let rng = &mut self.loss.rng;
        let dup = cfg.duplicate > 0.0 && rng.random::<f64>() < cfg.duplicate;
        let reordered = cfg.reorder > 0.0 && rng.random::<f64>() < cfg.reorder;
        at += cfg.delay;
        if !cfg.jitter.is_zero() {
            at += cfg.jitter.mul_f64(rng.random::<f64>());
        }
        if reordered {
            at += cfg.delay.max(REORDER_HOLD);
        }
        // Within a microsecond counts as now: no timer for a rate shaper with an idle link.
        let at = (at > now + Duration::from_micros(1)).then_some(at);
        Fate::Send { at, dup, reordered }
    }
}

/// A datagram waiting in the timer queue.
#[derive(Debug)]
struct Held {
    at: Instant,
    seq: u64,
    destination: SocketAddr,
    ecn: Option<quinn::udp::EcnCodepoint>,
    src_ip: Option<std::net::IpAddr>,
    data: Vec<u8>,
}

impl PartialEq for Held {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Held {}
impl PartialOrd for Held {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Held {
    /// Reversed, so that `BinaryHeap` pops the earliest first.
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (o.at, o.seq).cmp(&(self.at, self.seq))
    }
}

#[derive(Debug, Default)]
struct Queue {
    heap: Mutex<(BinaryHeap<Held>, u64)>,
    notify: Notify,
    closed: AtomicBool,
}

impl Queue {
    fn push(&self, items: Vec<Held>) {
        if items.is_empty() {
            return;
        }
        {
            let mut g = self.heap.lock().unwrap_or_else(|p| p.into_inner());
            for mut h in items {
                h.seq = g.1;
                g.1 += 1;
                g.0.push(h);
            }
        }
        self.notify.notify_one();
    }
}

/// A UDP socket for quinn that injects the faults of a [`ChaosConfig`].
#[derive(Debug)]
pub struct ChaosSocket {
    inner: Arc<dyn AsyncUdpSocket>,
    cfg: ChaosConfig,
    kill: Arc<AtomicBool>,
    send: Mutex<SendState>,
    recv: Mutex<LossModel>,
    queue: Arc<Queue>,
    stats: Arc<ChaosStats>,
}

/// Wraps `socket` (for `Endpoint::new_with_abstract_socket`). Must be called inside a tokio
/// runtime: it spawns the task that sends held datagrams.
pub fn bind_with_chaos(
    socket: std::net::UdpSocket,
    cfg: ChaosConfig,
    kill: Arc<AtomicBool>,
) -> Result<Arc<dyn AsyncUdpSocket>> {
    let s: Arc<dyn AsyncUdpSocket> = ChaosSocket::wrap(socket, cfg, kill)?;
    Ok(s)
}

impl ChaosSocket {
    /// Like [`bind_with_chaos`], keeping the concrete type so that [`stats`](Self::stats) can
    /// be read.
    pub fn wrap(
        socket: std::net::UdpSocket,
        cfg: ChaosConfig,
        kill: Arc<AtomicBool>,
    ) -> Result<Arc<ChaosSocket>> {
        let runtime = quinn::default_runtime()
            .ok_or_else(|| Error::Io("the chaos socket needs a tokio runtime".into()))?;
        ChaosSocket::over(runtime.wrap_udp_socket(socket)?, cfg, kill)
    }

    /// Wraps any quinn socket (`wrap` wraps the runtime's UDP socket). Must be called inside
    /// a tokio runtime.
    pub fn over(
        inner: Arc<dyn AsyncUdpSocket>,
        cfg: ChaosConfig,
        kill: Arc<AtomicBool>,
    ) -> Result<Arc<ChaosSocket>> {
        cfg.validate()?;
        let handle = tokio::runtime::Handle::try_current()
            .map_err(|e| Error::Io(format!("the chaos socket needs a tokio runtime: {e}")))?;
        let queue = Arc::new(Queue::default());
        let stats = Arc::new(ChaosStats::default());
        handle.spawn(serve_queue(
            inner.clone(),
            queue.clone(),
            kill.clone(),
            stats.clone(),
        ));
        Ok(Arc::new(ChaosSocket {
            inner,
            cfg,
            kill,
            send: Mutex::new(SendState {
                loss: LossModel::new(cfg.seed),
                next_free: None,
            }),
            recv: Mutex::new(LossModel::new(cfg.seed ^ 0x9e37_79b9_7f4a_7c15)),
            queue,
            stats,
        }))
    }

    /// The counters.
    pub fn stats(&self) -> Arc<ChaosStats> {
        self.stats.clone()
    }

    /// The configuration.
    pub fn config(&self) -> &ChaosConfig {
        &self.cfg
    }

    fn held(t: &Transmit<'_>, at: Instant, data: &[u8]) -> Held {
        Held {
            at,
            seq: 0,
            destination: t.destination,
            ecn: t.ecn,
            src_ip: t.src_ip,
            data: data.to_vec(),
        }
    }

    /// Sends `t.contents[a..b]` (whole segments of size `seg`) as one transmit.
    fn send_run(&self, t: &Transmit<'_>, seg: usize, a: usize, b: usize) -> io::Result<()> {
        let contents = &t.contents[a..b];
        self.inner.try_send(&Transmit {
            destination: t.destination,
            ecn: t.ecn,
            contents,
            segment_size: (contents.len() > seg).then_some(seg),
            src_ip: t.src_ip,
        })
    }
}

impl Drop for ChaosSocket {
    fn drop(&mut self) {
        self.queue.closed.store(true, Ordering::Release);
        self.queue.notify.notify_one();
    }
}

#[derive(Default)]
struct SendTally {
    lost: u64,
    rate: u64,
    dup: u64,
    delayed: u64,
    reordered: u64,
}

impl AsyncUdpSocket for ChaosSocket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, t: &Transmit<'_>) -> io::Result<()> {
        let total = t.contents.len();
        if total == 0 {
            return self.inner.try_send(t);
        }
        let seg = match t.segment_size {
            Some(s) if s > 0 => s.min(total),
            _ => total,
        };
        let n = total.div_ceil(seg) as u64;
        if self.kill.load(Ordering::Acquire) {
            ChaosStats::add(&self.stats.sent, n);
            ChaosStats::add(&self.stats.killed, n);
            return Ok(());
        }
        let now = Instant::now();
        let mut st = self.send.lock().unwrap_or_else(|p| p.into_inner());
        let checkpoint = st.clone();
        let mut tally = SendTally::default();
        let mut held = Vec::new();
        let mut run: Option<(usize, usize)> = None;
        let mut flushed_any = false;
        // Sends the pending run; only the very first send may still refuse the whole transmit.
        let flush = |run: (usize, usize),
                     first: bool,
                     held: &mut Vec<Held>|
         -> std::result::Result<(), io::Error> {
            match self.send_run(t, seg, run.0, run.1) {
                Ok(()) => Ok(()),
                Err(e) if first => Err(e),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // Part of this transmit is out already: queue the rest instead.
                    for c in t.contents[run.0..run.1].chunks(seg) {
                        held.push(Self::held(t, now, c));
                    }
                    Ok(())
                }
                Err(_) => {
                    self.stats.send_errors.fetch_add(1, Ordering::Relaxed);
                    Ok(())
                }
            }
        };
        for (i, chunk) in t.contents.chunks(seg).enumerate() {
            let (a, b) = (i * seg, i * seg + chunk.len());
            match st.decide(&self.cfg, chunk.len(), now) {
                Fate::Lost => tally.lost += 1,
                Fate::RateDropped => tally.rate += 1,
                Fate::Send { at, dup, reordered } => {
                    tally.reordered += u64::from(reordered);
                    if dup {
                        tally.dup += 1;
                        held.push(Self::held(t, at.unwrap_or(now), chunk));
                    }
                    match at {
                        Some(at) => {
                            tally.delayed += 1;
                            held.push(Self::held(t, at, chunk));
                        }
                        None => match run {
                            Some((ra, rb)) if rb == a => run = Some((ra, b)),
                            Some(r) => {
                                if let Err(e) = flush(r, !flushed_any, &mut held) {
                                    *st = checkpoint;
                                    return Err(e);
                                }
                                flushed_any = true;
                                run = Some((a, b));
                            }
                            None => run = Some((a, b)),
                        },
                    }
                }
            }
        }
        if let Some(r) = run {
            if let Err(e) = flush(r, !flushed_any, &mut held) {
                *st = checkpoint;
                return Err(e);
            }
        }
        drop(st);
        let s = &self.stats;
        ChaosStats::add(&s.sent, n);
        ChaosStats::add(&s.gso_transmits, u64::from(n > 1));
        ChaosStats::add(&s.send_dropped, tally.lost);
        ChaosStats::add(&s.rate_dropped, tally.rate);
        ChaosStats::add(&s.duplicated, tally.dup);
        ChaosStats::add(&s.delayed, tally.delayed);
        ChaosStats::add(&s.reordered, tally.reordered);
        self.queue.push(held);
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        for _ in 0..RECV_SPINS {
            let n = match self.inner.poll_recv(cx, bufs, meta) {
                Poll::Ready(Ok(n)) => n,
                other => return other,
            };
            let kept = self.filter_recv(bufs, meta, n.min(bufs.len()).min(meta.len()));
            if kept > 0 {
                return Poll::Ready(Ok(kept));
            }
        }
        // Everything we read was dropped: let others run, then come back for more.
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.inner.max_transmit_segments()
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

impl ChaosSocket {
    /// Drops received datagrams (per GRO segment), compacting buffers and metadata; returns
    /// how many entries are left.
    fn filter_recv(&self, bufs: &mut [IoSliceMut<'_>], meta: &mut [RecvMeta], n: usize) -> usize {
        let killed = self.kill.load(Ordering::Acquire);
        let mut loss = self.recv.lock().unwrap_or_else(|p| p.into_inner());
        let (mut got, mut dropped, mut gro) = (0u64, 0u64, 0u64);
        for (buf, m) in bufs.iter_mut().zip(meta.iter_mut()).take(n) {
            let len = m.len.min(buf.len());
            let stride = if m.stride == 0 { len.max(1) } else { m.stride };
            gro += u64::from(len > stride);
            let mut w = 0;
            let mut r = 0;
            while r < len {
                let end = (r + stride).min(len);
                got += 1;
                if killed || loss.lose(&self.cfg) {
                    dropped += 1;
                } else {
                    if w != r {
                        buf.copy_within(r..end, w);
                    }
                    w += end - r;
                }
                r = end;
            }
            m.len = w;
        }
        drop(loss);
        // Move the surviving entries to the front.
        let mut w = 0;
        for r in 0..n {
            let len = meta[r].len;
            if len == 0 {
                continue;
            }
            if w != r {
                let (front, back) = bufs.split_at_mut(r);
                if front[w].len() < len {
                    // Buffers of unequal size (quinn's are equal): cannot move it; lose it.
                    dropped += 1;
                    continue;
                }
                front[w][..len].copy_from_slice(&back[0][..len]);
                meta[w] = meta[r];
            }
            w += 1;
        }
        let s = &self.stats;
        ChaosStats::add(&s.received, got);
        ChaosStats::add(&s.gro_receives, gro);
        if killed {
            ChaosStats::add(&s.killed, dropped);
        } else {
            ChaosStats::add(&s.recv_dropped, dropped);
        }
        w
    }
}

/// Sends held datagrams when they are due. Runs until the socket is dropped.
async fn serve_queue(
    inner: Arc<dyn AsyncUdpSocket>,
    queue: Arc<Queue>,
    kill: Arc<AtomicBool>,
    stats: Arc<ChaosStats>,
) {
    let mut poller = inner.clone().create_io_poller();
    while !queue.closed.load(Ordering::Acquire) {
        let next = {
            let g = queue.heap.lock().unwrap_or_else(|p| p.into_inner());
            g.0.peek().map(|h| h.at)
        };
        let Some(at) = next else {
            queue.notify.notified().await;
            continue;
        };
        if at > Instant::now() {
            tokio::select! {
                _ = tokio::time::sleep_until(at) => {}
                _ = queue.notify.notified() => {}
            }
            continue;
        }
        let item = {
            let mut g = queue.heap.lock().unwrap_or_else(|p| p.into_inner());
            g.0.pop()
        };
        let Some(h) = item else { continue };
        if kill.load(Ordering::Acquire) {
            stats.killed.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let t = Transmit {
            destination: h.destination,
            ecn: h.ecn,
            contents: &h.data,
            segment_size: None,
            src_ip: h.src_ip,
        };
        match inner.try_send(&t) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                queue.push(vec![h]);
                let _ = std::future::poll_fn(|cx| poller.as_mut().poll_writable(cx)).await;
            }
            Err(_) => {
                stats.send_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::quic::tls;
    use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
    use quinn::{ConnectionError, Endpoint, EndpointConfig, TransportConfig};

    #[test]
    fn parse_display_round_trip() {
        let spec =
            "loss=0.2,corrupt=0.01,seed=1,delay=5ms,rate=1gbit,burst=0.1,dup=0.01,reorder=0.05";
        let c = ChaosConfig::parse(spec).expect("parse");
        assert_eq!(c.seed, 1);
        assert_eq!(c.loss, 0.2);
        assert_eq!(c.corrupt, 0.01);
        assert_eq!(c.delay, Duration::from_millis(5));
        assert_eq!(c.rate_bps, Some(1_000_000_000));
        assert_eq!(c.burst, 0.1);
        assert_eq!(c.duplicate, 0.01);
        assert_eq!(c.reorder, 0.05);
        let shown = c.to_string();
        assert_eq!(
            shown,
            "seed=1,loss=0.2,burst=0.1,dup=0.01,reorder=0.05,corrupt=0.01,delay=5ms,rate=1gbit"
        );
        assert_eq!(ChaosConfig::parse(&shown).expect("reparse"), c);
        let odd = ChaosConfig::parse(
            " seed=7 , jitter=1.5ms, delay=250us, rate=1500kbit, burst_len=9, loss=0.333",
        )
        .expect("parse");
        assert_eq!(odd.jitter, Duration::from_micros(1500));
        assert_eq!(odd.rate_bps, Some(1_500_000));
        assert_eq!(ChaosConfig::parse(&odd.to_string()).expect("reparse"), odd);
        assert_eq!(
            ChaosConfig::parse("").expect("empty"),
            ChaosConfig::default()
        );
        assert_eq!(ChaosConfig::default().to_string(), "seed=0");
        let w = ChaosConfig::parse("corrupt=0.3,corrupt_every=200ms,corrupt_for=50ms")
            .expect("windows");
        assert_eq!(w.corrupt_every, Some(Duration::from_millis(200)));
        assert_eq!(ChaosConfig::parse(&w.to_string()).expect("reparse"), w);
        let at = |ms: u64| w.corrupting_at(Duration::from_millis(ms));
        assert!(at(0) && at(49) && !at(50) && !at(199) && at(200) && at(249) && !at(250));
        assert!(ChaosConfig::default().corrupting_at(Duration::from_secs(9)));
        for bad in [
            "corrupt=0.3,corrupt_for=50ms",
            "corrupt=0.3,corrupt_every=50ms",
            "corrupt=0.3,corrupt_every=50ms,corrupt_for=50ms",
            "corrupt_every=200ms,corrupt_for=50ms",
        ] {
            assert!(ChaosConfig::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bad_specs_name_the_key_and_value() {
        for (spec, needle) in [
            ("loss=1.5", "\"1.5\" for loss"),
            ("loss=abc", "\"abc\" for loss"),
            ("lose=0.1", "unknown key \"lose\""),
            ("delay=5", "\"5\" for delay"),
            ("delay=5parsecs", "\"5parsecs\" for delay"),
            ("rate=0", "\"0\" for rate"),
            ("rate=10furlongs", "\"10furlongs\" for rate"),
            ("seed=-1", "\"-1\" for seed"),
            ("burst_len=0", "\"0\" for burst_len"),
            ("loss", "not key=value"),
        ] {
            let e = ChaosConfig::parse(spec).expect_err(spec).to_string();
            assert!(e.contains(needle), "{spec}: {e}");
        }
        let c = ChaosConfig {
            loss: -0.1,
            ..ChaosConfig::default()
        };
        assert!(c.validate().is_err());
    }

    #[test]
    fn loss_model_is_seeded_and_bursty() {
        let cfg = ChaosConfig {
            loss: 0.1,
            burst: 1.0,
            burst_len: 4,
            ..ChaosConfig::default()
        };
        let run = |seed| {
            let mut m = LossModel::new(seed);
            (0..10_000).map(|_| m.lose(&cfg)).collect::<Vec<bool>>()
        };
        let a = run(3);
        assert_eq!(a, run(3));
        assert_ne!(a, run(4));
        // Every loss starts a burst of 4.
        let mut i = 0;
        let mut bursts = 0;
        while i < a.len() {
            if a[i] {
                let len = a[i..].iter().take_while(|&&x| x).count();
                assert!(len >= 4 || i + len == a.len(), "run of {len} at {i}");
                bursts += 1;
                i += len;
            } else {
                i += 1;
            }
        }
        assert!(bursts > 500, "{bursts} bursts");
    }

    #[test]
    fn rate_shaper_spaces_and_drops() {
        let cfg = ChaosConfig {
            rate_bps: Some(8_000_000), // 1 MB/s: 1000 bytes per ms
            ..ChaosConfig::default()
        };
        let mut st = SendState {
            loss: LossModel::new(1),
            next_free: None,
        };
        let now = Instant::now();
        let fates: Vec<Fate> = (0..100).map(|_| st.decide(&cfg, 1000, now)).collect();
        assert!(matches!(fates[0], Fate::Send { at: None, .. }));
        match fates[10] {
            Fate::Send { at: Some(at), .. } => {
                let d = at - now;
                assert!(d >= Duration::from_micros(9_990) && d <= Duration::from_micros(10_010));
            }
            f => panic!("{f:?}"),
        }
        // 50 ms of backlog holds about 50 datagrams of 1000 bytes; the rest are dropped.
        let dropped = fates.iter().filter(|f| **f == Fate::RateDropped).count();
        assert!((45..=50).contains(&dropped), "{dropped}");
    }

    /// A socket that records what it is asked to send and hands out queued datagrams.
    #[derive(Debug, Default)]
    struct Mock {
        sent: Mutex<Vec<(Vec<u8>, Option<usize>)>>,
        block_next: AtomicBool,
        incoming: Mutex<Vec<(Vec<u8>, usize)>>,
    }

    #[derive(Debug)]
    struct Ready;

    impl UdpPoller for Ready {
        fn poll_writable(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    impl AsyncUdpSocket for Mock {
        fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
            Box::pin(Ready)
        }
        fn try_send(&self, t: &Transmit<'_>) -> io::Result<()> {
            if self.block_next.swap(false, Ordering::AcqRel) {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let mut g = self.sent.lock().expect("lock");
            g.push((t.contents.to_vec(), t.segment_size));
            Ok(())
        }
        fn poll_recv(
            &self,
            _: &mut Context<'_>,
            bufs: &mut [IoSliceMut<'_>],
            meta: &mut [RecvMeta],
        ) -> Poll<io::Result<usize>> {
            let mut q = self.incoming.lock().expect("lock");
            if q.is_empty() {
                return Poll::Pending;
            }
            let n = q.len().min(bufs.len());
            for (i, (data, stride)) in q.drain(..n).enumerate() {
                bufs[i][..data.len()].copy_from_slice(&data);
                meta[i] = RecvMeta {
                    addr: "127.0.0.1:9".parse().expect("addr"),
                    len: data.len(),
                    stride,
                    ecn: None,
                    dst_ip: None,
                };
            }
            Poll::Ready(Ok(n))
        }
        fn local_addr(&self) -> io::Result<SocketAddr> {
            Ok("127.0.0.1:8".parse().expect("addr"))
        }
        fn max_transmit_segments(&self) -> usize {
            10
        }
        fn may_fragment(&self) -> bool {
            false
        }
    }

    /// 10 segments of 100 bytes (the last 50), segment i filled with byte i.
    fn gso_contents() -> Vec<u8> {
        (0..10u8)
            .flat_map(|i| std::iter::repeat_n(i, if i == 9 { 50 } else { 100 }))
            .collect()
    }

    fn gso_transmit(contents: &[u8]) -> Transmit<'_> {
        Transmit {
            destination: "127.0.0.1:9".parse().expect("addr"),
            ecn: None,
            contents,
            segment_size: Some(100),
            src_ip: None,
        }
    }

    #[tokio::test]
    async fn gso_segments_are_decided_one_by_one() {
        let mock = Arc::new(Mock::default());
        let cfg = ChaosConfig::parse("seed=3,loss=0.4").expect("spec");
        let kill = Arc::new(AtomicBool::new(false));
        let chaos = ChaosSocket::over(mock.clone(), cfg, kill).expect("chaos");
        assert!(!chaos.may_fragment());
        assert_eq!(chaos.max_transmit_segments(), 10);
        let contents = gso_contents();
        // The first send would block: nothing may be decided or counted, and the retry must
        // make the same decisions as an unblocked send would.
        mock.block_next.store(true, Ordering::Release);
        let e = chaos
            .try_send(&gso_transmit(&contents))
            .expect_err("blocked");
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        assert_eq!(chaos.stats.sent.load(Ordering::Relaxed), 0);
        chaos.try_send(&gso_transmit(&contents)).expect("send");
        let sent = mock.sent.lock().expect("lock").clone();
        let mut expect = LossModel::new(3);
        let kept: Vec<u8> = (0..10u8).filter(|_| !expect.lose(&cfg)).collect();
        assert!(
            kept.len() < 10 && !kept.is_empty(),
            "seed gives a mix: {kept:?}"
        );
        let mut seen = Vec::new();
        for (data, seg) in &sent {
            assert_eq!(
                seg.is_some(),
                data.len() > 100,
                "segment size only for batches"
            );
            for chunk in data.chunks(100) {
                assert!(
                    chunk.iter().all(|&b| b == chunk[0]),
                    "segment boundaries kept"
                );
                seen.push(chunk[0]);
            }
        }
        assert_eq!(seen, kept);
        let st = chaos.stats();
        assert_eq!(st.sent.load(Ordering::Relaxed), 10);
        assert_eq!(st.gso_transmits.load(Ordering::Relaxed), 1);
        assert_eq!(
            st.send_dropped.load(Ordering::Relaxed),
            10 - kept.len() as u64
        );
    }

    #[tokio::test]
    async fn gro_strides_are_filtered_and_compacted() {
        let mock = Arc::new(Mock::default());
        let cfg = ChaosConfig::parse("seed=4,loss=0.5").expect("spec");
        let kill = Arc::new(AtomicBool::new(false));
        let chaos = ChaosSocket::over(mock.clone(), cfg, kill.clone()).expect("chaos");
        let mut expect = LossModel::new(4 ^ 0x9e37_79b9_7f4a_7c15);
        let mut want = Vec::new();
        for round in 0..20u8 {
            // One GRO buffer of 10 strides, then a single datagram.
            let mut batch = gso_contents();
            for b in &mut batch {
                *b += round * 11;
            }
            mock.incoming
                .lock()
                .expect("lock")
                .extend([(batch, 100), (vec![round * 11 + 10; 30], 30)]);
            for i in 0..11u8 {
                if !expect.lose(&cfg) {
                    want.push(round * 11 + i);
                }
            }
        }
        let mut got = Vec::new();
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        for _ in 0..100 {
            let mut storage = [[0u8; 1000]; 3];
            let mut meta = [RecvMeta::default(); 3];
            let n = {
                let [a, b, c] = &mut storage;
                let mut bufs = [IoSliceMut::new(a), IoSliceMut::new(b), IoSliceMut::new(c)];
                match chaos.poll_recv(&mut cx, &mut bufs, &mut meta) {
                    Poll::Ready(r) => r.expect("recv"),
                    Poll::Pending => break,
                }
            };
            for (buf, m) in storage.iter().zip(&meta).take(n) {
                assert!(m.len > 0);
                for d in buf[..m.len].chunks(m.stride) {
                    assert!(d.iter().all(|&b| b == d[0]));
                    got.push(d[0]);
                }
            }
        }
        assert_eq!(got, want);
        let st = chaos.stats();
        assert_eq!(st.received.load(Ordering::Relaxed), 220);
        assert_eq!(
            st.recv_dropped.load(Ordering::Relaxed),
            220 - want.len() as u64
        );
        // Killed: nothing gets through.
        kill.store(true, Ordering::Release);
        mock.incoming.lock().expect("lock").push((vec![1; 10], 10));
        let mut b = [0u8; 100];
        let mut bufs = [IoSliceMut::new(&mut b)];
        let mut meta = [RecvMeta::default()];
        assert!(chaos.poll_recv(&mut cx, &mut bufs, &mut meta).is_pending());
        assert_eq!(st.killed.load(Ordering::Relaxed), 1);
    }

    fn endpoint_configs(idle: Duration) -> (quinn::ServerConfig, quinn::ClientConfig) {
        let id = tls::Identity::from_secret(b"chaos test").expect("identity");
        let alpn = vec![b"chaos".to_vec()];
        let mut t = TransportConfig::default();
        t.max_idle_timeout(Some(idle.try_into().expect("idle timeout")));
        t.stream_receive_window(quinn::VarInt::from_u32(16 << 20));
        let t = Arc::new(t);
        let server_tls = id.server_config(alpn.clone()).expect("server tls");
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(
            QuicServerConfig::try_from(server_tls).expect("quic server"),
        ));
        server.transport_config(t.clone());
        let client_tls = id.client_config(alpn).expect("client tls");
        let mut client = quinn::ClientConfig::new(Arc::new(
            QuicClientConfig::try_from(client_tls).expect("quic client"),
        ));
        client.transport_config(t);
        (server, client)
    }

    struct Pair {
        server: Endpoint,
        client: Endpoint,
        stats: Arc<ChaosStats>,
        kill: Arc<AtomicBool>,
    }

    /// A plain server endpoint and a client endpoint behind a chaos socket, on 127.0.0.1.
    fn pair(cfg: ChaosConfig, idle: Duration) -> Pair {
        let (server_cfg, client_cfg) = endpoint_configs(idle);
        let runtime = quinn::default_runtime().expect("runtime");
        let s = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let server = Endpoint::new(
            EndpointConfig::default(),
            Some(server_cfg),
            s,
            runtime.clone(),
        )
        .expect("server endpoint");
        let c = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let kill = Arc::new(AtomicBool::new(false));
        let chaos = ChaosSocket::wrap(c, cfg, kill.clone()).expect("chaos socket");
        let stats = chaos.stats();
        let mut client =
            Endpoint::new_with_abstract_socket(EndpointConfig::default(), None, chaos, runtime)
                .expect("client endpoint");
        client.set_default_client_config(client_cfg);
        Pair {
            server,
            client,
            stats,
            kill,
        }
    }

    async fn connect(p: &Pair) -> (quinn::Connection, quinn::Connection) {
        let addr = p.server.local_addr().expect("addr");
        let accept = async {
            let inc = p.server.accept().await.expect("incoming");
            inc.await.expect("server handshake")
        };
        let dial = async {
            p.client
                .connect(addr, tls::SERVER_NAME)
                .expect("connect")
                .await
                .expect("client handshake")
        };
        let (s, c) = tokio::join!(accept, dial);
        (c, s)
    }

    /// Sends `len` seeded bytes client → server on one stream; checks them bit for bit.
    async fn transfer(p: &Pair, len: usize) -> Duration {
        let (client, server) = connect(p).await;
        let mut data = vec![0u8; len];
        StdRng::seed_from_u64(99).fill(&mut data[..]);
        let started = std::time::Instant::now();
        let send = async {
            let mut s = client.open_uni().await.expect("open");
            s.write_all(&data).await.expect("write");
            s.finish().expect("finish");
            s.stopped().await.expect("stopped");
        };
        let recv = async {
            let mut r = server.accept_uni().await.expect("accept stream");
            r.read_to_end(len + 1).await.expect("read")
        };
        let ((), got) =
            tokio::time::timeout(Duration::from_secs(60), async { tokio::join!(send, recv) })
                .await
                .expect("transfer finished in time");
        let took = started.elapsed();
        assert!(got == data, "payload differs");
        client.close(0u32.into(), b"done");
        took
    }

    fn ratio(a: &AtomicU64, b: &AtomicU64) -> f64 {
        a.load(Ordering::Relaxed) as f64 / b.load(Ordering::Relaxed).max(1) as f64
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn four_mib_through_twenty_percent_loss() {
        let cfg = ChaosConfig::parse("loss=0.2,seed=5").expect("spec");
        let p = pair(cfg, Duration::from_secs(10));
        let took = transfer(&p, 4 << 20).await;
        let s = &p.stats;
        let sent = s.sent.load(Ordering::Relaxed);
        let received = s.received.load(Ordering::Relaxed);
        let send_loss = ratio(&s.send_dropped, &s.sent);
        let recv_loss = ratio(&s.recv_dropped, &s.received);
        eprintln!(
            "4 MiB at loss=0.2 in {took:?}: sent {sent} ({} GSO transmits), send loss {send_loss:.3}; received {received} ({} GRO), receive loss {recv_loss:.3}",
            s.gso_transmits.load(Ordering::Relaxed),
            s.gro_receives.load(Ordering::Relaxed),
        );
        assert!(sent > 2000, "{sent} datagrams for 4 MiB?");
        assert!((send_loss - 0.2).abs() < 0.03, "send loss {send_loss}");
        assert!(received > 200, "{received}");
        assert!((recv_loss - 0.2).abs() < 0.08, "receive loss {recv_loss}");
        assert_eq!(s.killed.load(Ordering::Relaxed), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn four_mib_through_delay_jitter_reorder_and_duplicates() {
        let cfg =
            ChaosConfig::parse("seed=9,delay=20ms,reorder=0.02,dup=0.02,rate=2gbit").expect("spec");
        let p = pair(cfg, Duration::from_secs(10));
        let took = transfer(&p, 4 << 20).await;
        // Counters are read once the closed connection has drained, so no datagram is
        // between being counted sent and being counted delayed.
        tokio::time::timeout(Duration::from_secs(30), p.client.wait_idle())
            .await
            .expect("the closed connection drained");
        let s = &p.stats;
        let sent = s.sent.load(Ordering::Relaxed);
        eprintln!(
            "4 MiB at delay=20ms in {took:?}: sent {sent}, delayed {}, reordered {}, duplicated {}",
            s.delayed.load(Ordering::Relaxed),
            s.reordered.load(Ordering::Relaxed),
            s.duplicated.load(Ordering::Relaxed)
        );
        assert_eq!(
            s.delayed.load(Ordering::Relaxed),
            sent,
            "every datagram is delayed"
        );
        assert_eq!(s.send_dropped.load(Ordering::Relaxed), 0);
        assert!((ratio(&s.reordered, &s.sent) - 0.02).abs() < 0.015);
        assert!((ratio(&s.duplicated, &s.sent) - 0.02).abs() < 0.02);
        assert!(took >= Duration::from_millis(20));
        // A new connection's smoothed RTT includes the added delay.
        let (c, _s) = connect(&p).await;
        assert!(c.rtt() >= Duration::from_millis(19), "rtt {:?}", c.rtt());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn kill_switch_times_the_peer_out() {
        let p = pair(ChaosConfig::default(), Duration::from_millis(600));
        let (client, server) = connect(&p).await;
        // The connection works, then the link is cut in both directions.
        let mut s = client.open_uni().await.expect("open");
        s.write_all(b"hello").await.expect("write");
        s.finish().expect("finish");
        let mut r = server.accept_uni().await.expect("accept");
        assert_eq!(r.read_to_end(100).await.expect("read"), b"hello");
        p.kill.store(true, Ordering::Release);
        let started = std::time::Instant::now();
        // Both sides try to talk across the cut: the client's packets die on send, the
        // server's on receive.
        let mut s = client.open_uni().await.expect("open");
        s.write_all(b"lost").await.expect("write");
        let mut s2 = server.open_uni().await.expect("open");
        s2.write_all(b"lost too").await.expect("write");
        let why = tokio::time::timeout(Duration::from_secs(10), server.accept_uni())
            .await
            .expect("server noticed within 10 s")
            .expect_err("nothing crosses a killed link");
        assert_eq!(why, ConnectionError::TimedOut);
        assert_eq!(server.closed().await, ConnectionError::TimedOut);
        assert!(started.elapsed() >= Duration::from_millis(500));
        let why = tokio::time::timeout(Duration::from_secs(10), client.closed())
            .await
            .expect("client noticed within 10 s");
        assert_eq!(why, ConnectionError::TimedOut);
        assert!(p.stats.killed.load(Ordering::Relaxed) > 0);
    }
}
