//! Round-trip statistics of one peer and the timeouts derived from them.
//!
//! The tracker is fed RTT samples (a heartbeat's ping → pong, a request → its reply) and keeps
//! two figures:
//!
//! - **mean**: an exponentially weighted moving average, `mean ← mean + α·(sample − mean)`,
//!   started at the first sample (α = 1/8 by default, as TCP's SRTT).
//! - **p99**: the 99th percentile of the last `window` samples (512 by default), read off a
//!   histogram of logarithmic buckets, 4 per power of two from 1 µs up to 2²⁷ µs (≈ 134 s),
//!   so each bucket is about 19 % wide. The reported value is the *upper edge* of the bucket
//!   holding the sample of rank ⌈0.99·n⌉, so it over-estimates the true p99 by less than 19 %
//!   and never under-estimates it (samples above 134 s count as 134 s).
//!
//! From them, with the design's factors as defaults:
//!
//! - [`heartbeat_timeout`](LatencyTracker::heartbeat_timeout) is
//!   `max(heartbeat_floor, 1.3 × mean)`: how long to wait for one heartbeat's reply before
//!   counting it missed.
//! - [`io_timeout`](LatencyTracker::io_timeout) is `max(io_floor, 2.5 × p99)`: how long a
//!   read or write may make no progress.
//! - [`silence_limit`](LatencyTracker::silence_limit) of `interval` is
//!   `misses_allowed × interval + heartbeat_timeout`: how long a peer may stay silent,
//!   heartbeats sent every `interval`, before it is declared lost.
//!
//! Before the first sample every timeout is `cold_timeout`, since nothing is known yet.

use std::time::Duration;

const SUB_BUCKETS: u32 = 4;
const OCTAVES: u32 = 27;
const BUCKETS: usize = (SUB_BUCKETS * OCTAVES) as usize;

/// Parameters of a [`LatencyTracker`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencyConfig {
    /// Samples the p99 is computed over (the most recent ones). At least 1.
    pub window: usize,
    /// EWMA weight of a new sample, in (0, 1].
    pub ewma_alpha: f64,
    /// Heartbeat reply timeout as a multiple of the mean RTT (design: 1.3).
    pub heartbeat_factor: f64,
    /// The smallest heartbeat reply timeout.
    pub heartbeat_floor: Duration,
    /// Read/write timeout as a multiple of the p99 RTT (design: 2.5).
    pub io_factor: f64,
    /// The smallest read/write timeout.
    pub io_floor: Duration,
    /// Heartbeats a peer may miss in a row before it is declared lost.
    pub misses_allowed: u32,
    /// Every timeout before the first sample.
    pub cold_timeout: Duration,
}

impl Default for LatencyConfig {
    /// Window 512, α = 1/8, heartbeat 1.3 × mean (floor 1 s), read/write 2.5 × p99 (floor
    /// 2 s), 2 misses allowed (a peer is lost when the reply to its third heartbeat is late,
    /// within 3 intervals), 30 s before the first sample.
    fn default() -> Self {
        LatencyConfig {
            window: 512,
            ewma_alpha: 0.125,
            heartbeat_factor: 1.3,
            heartbeat_floor: Duration::from_secs(1),
            io_factor: 2.5,
            io_floor: Duration::from_secs(2),
            misses_allowed: 2,
            cold_timeout: Duration::from_secs(30),
        }
    }
}

/// RTT statistics of one peer. See the module documentation for what is computed.
#[derive(Debug, Clone)]
pub struct LatencyTracker {
    cfg: LatencyConfig,
    mean_s: Option<f64>,
    counts: [u32; BUCKETS],
    /// The bucket of each sample in the window, oldest first once full (a ring).
    ring: Vec<u8>,
    next: usize,
    total: u64,
}

impl Default for LatencyTracker {
    fn default() -> Self {
        LatencyTracker::new(LatencyConfig::default())
    }
}

fn bucket_of(d: Duration) -> usize {
    let us = d.as_secs_f64() * 1e6;
    if us.is_nan() || us <= 1.0 {
        return 0;
    }
    let b = (us.log2() * SUB_BUCKETS as f64).floor();
    (b as usize).min(BUCKETS - 1)
}

fn upper_edge(bucket: usize) -> Duration {
    let exp = (bucket as f64 + 1.0) / SUB_BUCKETS as f64;
    Duration::from_secs_f64(exp.exp2() * 1e-6)
}

fn scaled(d: Duration, factor: f64) -> Duration {
    let s = d.as_secs_f64() * factor;
    Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX)
}

impl LatencyTracker {
    /// An empty tracker. Out-of-range parameters are clamped: `window ≥ 1`, α into (0, 1]
    /// (a non-finite α becomes the default), negative or non-finite factors to 0.
    pub fn new(mut cfg: LatencyConfig) -> LatencyTracker {
        cfg.window = cfg.window.max(1);
        if !(cfg.ewma_alpha > 0.0 && cfg.ewma_alpha <= 1.0) {
            cfg.ewma_alpha = if cfg.ewma_alpha > 1.0 { 1.0 } else { 0.125 };
        }
        for f in [&mut cfg.heartbeat_factor, &mut cfg.io_factor] {
            if !f.is_finite() || *f < 0.0 {
                *f = 0.0;
            }
        }
        LatencyTracker {
            ring: Vec::with_capacity(cfg.window.min(1 << 16)),
            cfg,
            mean_s: None,
            counts: [0; BUCKETS],
            next: 0,
            total: 0,
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> &LatencyConfig {
        &self.cfg
    }

    /// Adds one RTT sample.
    pub fn record(&mut self, rtt: Duration) {
        let s = rtt.as_secs_f64();
        self.mean_s = Some(match self.mean_s {
            None => s,
            Some(m) => m + self.cfg.ewma_alpha * (s - m),
        });
        let b = bucket_of(rtt);
        if self.ring.len() < self.cfg.window {
            self.ring.push(b as u8);
        } else {
            let old = self.ring[self.next] as usize;
            self.counts[old] -= 1;
            self.ring[self.next] = b as u8;
            self.next = (self.next + 1) % self.cfg.window;
        }
        self.counts[b] += 1;
        self.total = self.total.saturating_add(1);
    }

    /// Samples recorded since creation.
    pub fn samples(&self) -> u64 {
        self.total
    }

    /// The EWMA of the RTT, or `None` before the first sample.
    pub fn mean(&self) -> Option<Duration> {
        self.mean_s
            .map(|s| Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX))
    }

    /// The `q`-quantile (`q` in [0, 1], clamped) of the window, as the upper edge of its
    /// bucket; `None` before the first sample.
    pub fn quantile(&self, q: f64) -> Option<Duration> {
        let n = self.ring.len() as u64;
        if n == 0 {
            return None;
        }
        let q = if q.is_nan() { 1.0 } else { q.clamp(0.0, 1.0) };
        let rank = ((q * n as f64).ceil() as u64).clamp(1, n);
        let mut seen = 0u64;
        for (b, &c) in self.counts.iter().enumerate() {
            seen += u64::from(c);
            if seen >= rank {
                return Some(upper_edge(b));
            }
        }
        Some(upper_edge(BUCKETS - 1))
    }

    /// The 99th percentile of the window (see [`quantile`](Self::quantile)).
    pub fn p99(&self) -> Option<Duration> {
        self.quantile(0.99)
    }

    /// `max(heartbeat_floor, heartbeat_factor × mean)`, or `cold_timeout` before any sample.
    pub fn heartbeat_timeout(&self) -> Duration {
        match self.mean() {
            None => self.cfg.cold_timeout,
            Some(m) => scaled(m, self.cfg.heartbeat_factor).max(self.cfg.heartbeat_floor),
        }
    }

    /// `max(io_floor, io_factor × p99)`, or `cold_timeout` before any sample.
    pub fn io_timeout(&self) -> Duration {
        match self.p99() {
            None => self.cfg.cold_timeout,
            Some(p) => scaled(p, self.cfg.io_factor).max(self.cfg.io_floor),
        }
    }

    /// `misses_allowed × interval + heartbeat_timeout()`: the silence after which a peer that
    /// is sent a heartbeat every `interval` is declared lost.
    pub fn silence_limit(&self, interval: Duration) -> Duration {
        interval
            .saturating_mul(self.cfg.misses_allowed)
            .saturating_add(self.heartbeat_timeout())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn no_floors() -> LatencyConfig {
        LatencyConfig {
            heartbeat_floor: Duration::ZERO,
            io_floor: Duration::ZERO,
            ..LatencyConfig::default()
        }
    }

    #[test]
    fn cold_tracker_reports_the_cold_timeout() {
        let t = LatencyTracker::default();
        assert_eq!(t.mean(), None);
        assert_eq!(t.p99(), None);
        assert_eq!(t.heartbeat_timeout(), Duration::from_secs(30));
        assert_eq!(t.io_timeout(), Duration::from_secs(30));
        assert_eq!(
            t.silence_limit(Duration::from_secs(5)),
            Duration::from_secs(40)
        );
    }

    #[test]
    fn ewma_starts_at_the_first_sample_and_moves_by_alpha() {
        let mut t = LatencyTracker::new(no_floors());
        t.record(100 * MS);
        assert_eq!(t.mean(), Some(100 * MS));
        t.record(180 * MS); // 100 + (180 - 100) / 8 = 110
        let m = t.mean().expect("mean").as_secs_f64();
        assert!((m - 0.110).abs() < 1e-9, "{m}");
        for _ in 0..200 {
            t.record(50 * MS);
        }
        let m = t.mean().expect("mean").as_secs_f64();
        assert!((m - 0.050).abs() < 1e-6, "{m}");
    }

    #[test]
    fn p99_is_within_one_bucket_above_the_true_value() {
        let mut t = LatencyTracker::new(LatencyConfig {
            window: 1000,
            ..no_floors()
        });
        // 1..=1000 ms: the true p99 (rank 990) is 990 ms.
        for i in 1..=1000u64 {
            t.record(Duration::from_millis(i));
        }
        let p = t.p99().expect("p99").as_secs_f64();
        assert!((0.990..0.990 * 1.19).contains(&p), "{p}");
        let med = t.quantile(0.5).expect("median").as_secs_f64();
        assert!((0.500..0.500 * 1.19).contains(&med), "{med}");
    }

    #[test]
    fn p99_forgets_samples_that_left_the_window() {
        let mut t = LatencyTracker::new(LatencyConfig {
            window: 100,
            ..no_floors()
        });
        for _ in 0..100 {
            t.record(Duration::from_secs(2));
        }
        assert!(t.p99().expect("p99") >= Duration::from_secs(2));
        for _ in 0..100 {
            t.record(10 * MS);
        }
        let p = t.p99().expect("p99");
        assert!(p >= 10 * MS && p < 12 * MS, "{p:?}");
        assert_eq!(t.samples(), 200);
    }

    #[test]
    fn timeouts_follow_the_design_factors_above_the_floors() {
        let mut t = LatencyTracker::new(no_floors());
        for _ in 0..50 {
            t.record(200 * MS);
        }
        let hb = t.heartbeat_timeout().as_secs_f64();
        assert!((hb - 0.26).abs() < 1e-6, "1.3 × 200 ms, got {hb}");
        // p99 of a constant 200 ms is the upper edge of its bucket: 2^(ceil-ish)/4.
        let p99 = t.p99().expect("p99").as_secs_f64();
        assert!((0.2..0.2 * 1.19).contains(&p99), "{p99}");
        let io = t.io_timeout().as_secs_f64();
        assert!((io - 2.5 * p99).abs() < 1e-9, "{io} vs 2.5 × {p99}");
        let limit = t.silence_limit(Duration::from_secs(5)).as_secs_f64();
        assert!((limit - (10.0 + 0.26)).abs() < 1e-6, "{limit}");
    }

    #[test]
    fn floors_hold_on_a_fast_link() {
        let mut t = LatencyTracker::default();
        t.record(Duration::from_micros(40));
        assert_eq!(t.heartbeat_timeout(), Duration::from_secs(1));
        assert_eq!(t.io_timeout(), Duration::from_secs(2));
    }

    #[test]
    fn extreme_samples_and_parameters_do_not_panic() {
        let mut t = LatencyTracker::new(LatencyConfig {
            window: 0,
            ewma_alpha: f64::NAN,
            heartbeat_factor: f64::INFINITY,
            io_factor: -1.0,
            ..LatencyConfig::default()
        });
        t.record(Duration::ZERO);
        t.record(Duration::MAX);
        assert_eq!(t.config().window, 1);
        assert!(t.p99().expect("p99") >= Duration::from_secs(134));
        assert_eq!(t.io_timeout(), Duration::from_secs(2));
        assert!(t.heartbeat_timeout() >= Duration::from_secs(1));
        let _ = t.silence_limit(Duration::MAX);
    }
}
