//! Exponential backoff with jitter, for connecting to peers that are not up yet.

use rand::Rng;
use std::time::Duration;

/// Delays of `base * 2^k`, capped, each scaled by a random factor in [0.5, 1] so that many
/// ranks retrying at once spread out.
#[derive(Debug, Clone)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    attempt: u32,
}

impl Default for Backoff {
    /// 0.5 s base, 5 s cap, as the design asks.
    fn default() -> Self {
        Backoff::new(Duration::from_millis(500), Duration::from_secs(5))
    }
}

impl Backoff {
    /// A backoff from `base` doubling up to `cap`.
    pub fn new(base: Duration, cap: Duration) -> Backoff {
        Backoff {
            base,
            cap,
            attempt: 0,
        }
    }

    /// The un-jittered delay before the next retry.
    pub fn ceiling(&self) -> Duration {
        let factor = 1u32.checked_shl(self.attempt.min(20)).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.cap)
    }

    /// The delay to wait before the next retry; advances the attempt counter.
    pub fn next_delay(&mut self) -> Duration {
        let ceiling = self.ceiling();
        self.attempt = self.attempt.saturating_add(1);
        ceiling.mul_f64(rand::rng().random_range(0.5..=1.0))
    }

    /// How many delays were handed out.
    pub fn attempts(&self) -> u32 {
        self.attempt
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_with_jitter_up_to_the_cap() {
        let mut b = Backoff::default();
        let mut ceilings = Vec::new();
        for _ in 0..8 {
            let c = b.ceiling();
            let d = b.next_delay();
            assert!(d <= c && d >= c / 2, "{d:?} not in [{:?}, {c:?}]", c / 2);
            ceilings.push(c.as_millis());
        }
        assert_eq!(
            ceilings,
            vec![500, 1000, 2000, 4000, 5000, 5000, 5000, 5000]
        );
        assert_eq!(b.attempts(), 8);
    }
}
