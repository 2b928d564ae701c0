//! A per-peer circuit breaker: stop talking to a peer that keeps failing, probe it again
//! after a cool-down.
//!
//! ```text
//!            failure × threshold                 cool-down elapsed, allow()
//!  Closed ───────────────────────────▶ Open ───────────────────────────────▶ HalfOpen
//!    ▲                                  ▲                                      │ │
//!    │             probe failed (cool-down doubles, up to the cap)             │ │
//!    │                                  └──────────────────────────────────────┘ │
//!    └──────────────────────────── probe succeeded (cool-down resets) ───────────┘
//! ```
//!
//! Closed lets every call through and counts consecutive failures (a success resets the
//! count). Open refuses every call until its cool-down has passed. Half-open lets exactly one
//! probe through; its outcome closes or re-opens the breaker. A probe whose outcome is never
//! reported does not wedge the breaker: once another cool-down has passed, `allow` lets a new
//! probe through.

use std::time::{Duration, Instant};

/// When a breaker opens and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive failures that open a closed breaker (the design's default: 3).
    pub failure_threshold: u32,
    /// The first cool-down after opening.
    pub base_cooldown: Duration,
    /// The longest cool-down: each failed probe doubles the cool-down up to this.
    pub max_cooldown: Duration,
}

impl Default for BreakerConfig {
    /// 3 failures, 0.5 s first cool-down, 5 s cap (the backoff figures of the design).
    fn default() -> Self {
        BreakerConfig {
            failure_threshold: 3,
            base_cooldown: Duration::from_millis(500),
            max_cooldown: Duration::from_secs(5),
        }
    }
}

/// The state of a breaker, as [`CircuitBreaker::state`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Calls go through; `failures` consecutive failures so far.
    Closed {
        /// Consecutive failures since the last success.
        failures: u32,
    },
    /// Calls are refused until `until`.
    Open {
        /// When the cool-down ends and a probe may go through.
        until: Instant,
    },
    /// One probe is out (since `since`); every other call is refused until it reports.
    HalfOpen {
        /// When the probe was let through.
        since: Instant,
    },
}

/// A circuit breaker for one peer. See the module documentation for the transitions.
#[derive(Debug, Clone)]
pub struct CircuitBreaker {
    cfg: BreakerConfig,
    state: BreakerState,
    cooldown: Duration,
}

impl Default for CircuitBreaker {
    fn default() -> Self {
        CircuitBreaker::new(BreakerConfig::default())
    }
}

impl CircuitBreaker {
    /// A closed breaker. A `failure_threshold` of 0 is taken as 1.
    pub fn new(mut cfg: BreakerConfig) -> CircuitBreaker {
        cfg.failure_threshold = cfg.failure_threshold.max(1);
        cfg.max_cooldown = cfg.max_cooldown.max(cfg.base_cooldown);
        CircuitBreaker {
            cfg,
            state: BreakerState::Closed { failures: 0 },
            cooldown: cfg.base_cooldown,
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> &BreakerConfig {
        &self.cfg
    }

    /// The current state (without advancing it: an expired `Open` is still reported as such
    /// until [`allow`](Self::allow) is called).
    pub fn state(&self) -> BreakerState {
        self.state
    }

    /// The cool-down the breaker will use the next time it opens (or is using now).
    pub fn cooldown(&self) -> Duration {
        self.cooldown
    }

    /// May a call to the peer go out at `now`? In Open, this turns the breaker half-open
    /// once the cool-down has passed and lets that call through as the one probe.
    pub fn allow(&mut self, now: Instant) -> bool {
        match self.state {
            BreakerState::Closed { .. } => true,
            BreakerState::Open { until } => {
                if now >= until {
                    self.state = BreakerState::HalfOpen { since: now };
                    true
                } else {
                    false
                }
            }
            BreakerState::HalfOpen { since } => {
                // A probe that never reported is presumed lost after a cool-down.
                if now.saturating_duration_since(since) >= self.cooldown {
                    self.state = BreakerState::HalfOpen { since: now };
                    true
                } else {
                    false
                }
            }
        }
    }

    /// A call succeeded: closes a half-open breaker (resetting the cool-down) and clears the
    /// failure count of a closed one. A success reported while open (a late reply to a call
    /// made before it opened) changes nothing.
    pub fn record_success(&mut self, _now: Instant) {
        match self.state {
            BreakerState::Closed { .. } => self.state = BreakerState::Closed { failures: 0 },
            BreakerState::HalfOpen { .. } => {
                self.state = BreakerState::Closed { failures: 0 };
                self.cooldown = self.cfg.base_cooldown;
            }
            BreakerState::Open { .. } => {}
        }
    }

    /// A call failed at `now`: counts towards opening a closed breaker, and re-opens a
    /// half-open one with a doubled cool-down (up to the cap). Failures reported while open
    /// change nothing.
    pub fn record_failure(&mut self, now: Instant) {
        match self.state {
            BreakerState::Closed { failures } => {
                let failures = failures.saturating_add(1);
                if failures >= self.cfg.failure_threshold {
                    self.open(now);
                } else {
                    self.state = BreakerState::Closed { failures };
                }
            }
            BreakerState::HalfOpen { .. } => {
                self.cooldown = self.cooldown.saturating_mul(2).min(self.cfg.max_cooldown);
                self.open(now);
            }
            BreakerState::Open { .. } => {}
        }
    }

    /// True while calls are refused (open, or half-open with the probe out).
    pub fn is_open(&self) -> bool {
        !matches!(self.state, BreakerState::Closed { .. })
    }

    fn open(&mut self, now: Instant) {
        let until = now.checked_add(self.cooldown).unwrap_or(now);
        self.state = BreakerState::Open { until };
    }
}

/// One breaker per peer rank, all with the same configuration.
#[derive(Debug, Clone)]
pub struct PeerBreakers {
    breakers: Vec<CircuitBreaker>,
}

impl PeerBreakers {
    /// Closed breakers for ranks `0..world_size`.
    pub fn new(world_size: usize, cfg: BreakerConfig) -> PeerBreakers {
        PeerBreakers {
            breakers: vec![CircuitBreaker::new(cfg); world_size],
        }
    }

    /// The breaker of `rank`, or `None` for a rank outside the group.
    pub fn get_mut(&mut self, rank: usize) -> Option<&mut CircuitBreaker> {
        self.breakers.get_mut(rank)
    }

    /// The ranks whose breakers refuse calls right now.
    pub fn open_ranks(&self) -> Vec<usize> {
        (0..self.breakers.len())
            .filter(|&r| self.breakers[r].is_open())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn cfg() -> BreakerConfig {
        BreakerConfig {
            failure_threshold: 3,
            base_cooldown: 100 * MS,
            max_cooldown: 350 * MS,
        }
    }

    #[test]
    fn closed_stays_closed_below_the_threshold_and_success_resets_the_count() {
        let t = Instant::now();
        let mut b = CircuitBreaker::new(cfg());
        b.record_failure(t);
        b.record_failure(t);
        assert_eq!(b.state(), BreakerState::Closed { failures: 2 });
        assert!(b.allow(t));
        b.record_success(t);
        assert_eq!(b.state(), BreakerState::Closed { failures: 0 });
        b.record_failure(t);
        b.record_failure(t);
        assert!(b.allow(t), "two failures after a success must not open it");
    }

    #[test]
    fn opens_after_three_consecutive_failures_and_refuses_until_the_cooldown() {
        let t = Instant::now();
        let mut b = CircuitBreaker::new(cfg());
        for _ in 0..3 {
            assert!(b.allow(t));
            b.record_failure(t);
        }
        assert_eq!(
            b.state(),
            BreakerState::Open {
                until: t + 100 * MS
            }
        );
        assert!(b.is_open());
        assert!(!b.allow(t));
        assert!(!b.allow(t + 99 * MS));
        // Failures and successes reported while open change nothing.
        b.record_failure(t + 50 * MS);
        b.record_success(t + 50 * MS);
        assert_eq!(
            b.state(),
            BreakerState::Open {
                until: t + 100 * MS
            }
        );
    }

    #[test]
    fn half_open_lets_exactly_one_probe_through() {
        let t = Instant::now();
        let mut b = CircuitBreaker::new(cfg());
        (0..3).for_each(|_| b.record_failure(t));
        let t1 = t + 100 * MS;
        assert!(b.allow(t1), "the probe");
        assert_eq!(b.state(), BreakerState::HalfOpen { since: t1 });
        assert!(!b.allow(t1));
        assert!(!b.allow(t1 + 99 * MS));
    }

    #[test]
    fn successful_probe_closes_and_resets_the_cooldown() {
        let t = Instant::now();
        let mut b = CircuitBreaker::new(cfg());
        (0..3).for_each(|_| b.record_failure(t));
        let t1 = t + 100 * MS;
        assert!(b.allow(t1));
        b.record_failure(t1); // probe fails: cool-down 200 ms
        assert_eq!(b.cooldown(), 200 * MS);
        let t2 = t1 + 200 * MS;
        assert!(b.allow(t2));
        b.record_success(t2);
        assert_eq!(b.state(), BreakerState::Closed { failures: 0 });
        assert_eq!(b.cooldown(), 100 * MS);
        assert!(b.allow(t2));
    }

    #[test]
    fn failed_probe_reopens_with_a_doubled_cooldown_up_to_the_cap() {
        let t = Instant::now();
        let mut b = CircuitBreaker::new(cfg());
        (0..3).for_each(|_| b.record_failure(t));
        let mut now = t;
        let mut seen = Vec::new();
        for _ in 0..5 {
            let BreakerState::Open { until } = b.state() else {
                panic!("expected open, got {:?}", b.state());
            };
            seen.push((until - now).as_millis());
            assert!(!b.allow(until - MS));
            now = until;
            assert!(b.allow(now));
            b.record_failure(now);
        }
        assert_eq!(seen, vec![100, 200, 350, 350, 350]);
    }

    #[test]
    fn a_lost_probe_does_not_wedge_the_breaker() {
        let t = Instant::now();
        let mut b = CircuitBreaker::new(cfg());
        (0..3).for_each(|_| b.record_failure(t));
        let t1 = t + 100 * MS;
        assert!(b.allow(t1));
        assert!(!b.allow(t1 + 50 * MS));
        assert!(
            b.allow(t1 + 100 * MS),
            "a new probe after another cool-down"
        );
        assert!(!b.allow(t1 + 101 * MS));
    }

    #[test]
    fn zero_threshold_means_one_and_the_threshold_is_configurable() {
        let t = Instant::now();
        let mut b = CircuitBreaker::new(BreakerConfig {
            failure_threshold: 0,
            ..cfg()
        });
        b.record_failure(t);
        assert!(b.is_open());
        let mut b = CircuitBreaker::new(BreakerConfig {
            failure_threshold: 5,
            ..cfg()
        });
        (0..4).for_each(|_| b.record_failure(t));
        assert!(!b.is_open());
        b.record_failure(t);
        assert!(b.is_open());
    }

    #[test]
    fn peer_breakers_are_independent() {
        let t = Instant::now();
        let mut p = PeerBreakers::new(3, cfg());
        for _ in 0..3 {
            p.get_mut(1).expect("rank 1").record_failure(t);
        }
        assert_eq!(p.open_ranks(), vec![1]);
        assert!(p.get_mut(0).expect("rank 0").allow(t));
        assert!(p.get_mut(3).is_none());
    }
}
