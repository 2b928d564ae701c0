//! Choosing the parity count `m` from a measured loss rate.
//!
//! A block of `k` data and `m` parity shards is lost when more than `m` of its `n = k + m`
//! shards are lost. With each shard lost independently with probability `p`,
//!
//! ```text
//! P(block unrecoverable) = P(X > m),  X ~ Binomial(n, p)
//!                        = Σ_{j = m+1}^{n} C(n, j) p^j (1 − p)^(n − j)
//! ```
//!
//! [`block_failure_probability`] sums that tail term by term (in log space, so that
//! `(1 − p)^n` cannot underflow for large `n`), and [`parity_for`] returns the smallest `m` in
//! a range whose tail is at or below a target. Real losses come in bursts, which this model
//! does not see: keep a margin in the target, and the NACK repair path for what slips
//! through.
//!
//! The loss rate comes from [`LossEstimator`], an exponentially weighted moving average of
//! `1 − received / expected` shard counts.

use crate::error::{Error, Result};

/// `P(X > m)` for `X ~ Binomial(k + m, p)`: the probability that a block of `k` data and `m`
/// parity shards cannot be rebuilt when each shard is lost independently with probability `p`.
pub fn block_failure_probability(k: usize, m: usize, p: f64) -> f64 {
    let n = k + m;
    if k == 0 || p <= 0.0 || p.is_nan() {
        return 0.0;
    }
    if p >= 1.0 {
        return 1.0;
    }
    let ln_q = (1.0 - p).ln();
    let ln_ratio = p.ln() - ln_q;
    // ln pmf(j) = ln C(n, j) + j ln p + (n − j) ln(1 − p), built up from pmf(0).
    let mut ln_pmf = n as f64 * ln_q;
    let mut tail = 0.0;
    for j in 0..n {
        // ln pmf(j + 1) = ln pmf(j) + ln((n − j) / (j + 1)) + ln(p / (1 − p))
        ln_pmf += ((n - j) as f64 / (j + 1) as f64).ln() + ln_ratio;
        if j + 1 > m {
            tail += ln_pmf.exp();
        }
    }
    tail.min(1.0)
}

/// The smallest `m` in `min_m..=max_m` with `block_failure_probability(k, m, p) ≤ target`, or
/// `max_m` if none reaches it.
pub fn parity_for(k: usize, p: f64, target: f64, min_m: usize, max_m: usize) -> usize {
    let p = if p.is_nan() { 1.0 } else { p.clamp(0.0, 1.0) };
    (min_m..=max_m)
        .find(|&m| block_failure_probability(k, m, p) <= target)
        .unwrap_or(max_m.max(min_m))
}

/// An exponentially weighted moving average of the shard loss rate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossEstimator {
    alpha: f64,
    p: f64,
}

impl Default for LossEstimator {
    /// Starts at 2 % loss, moving 30 % of the way to each observation.
    fn default() -> Self {
        LossEstimator {
            alpha: 0.3,
            p: 0.02,
        }
    }
}

impl LossEstimator {
    /// Starts at loss rate `initial`; each observation moves the estimate by `alpha` (0 < alpha ≤ 1)
    /// of the way to the observed rate.
    pub fn new(initial: f64, alpha: f64) -> Result<LossEstimator> {
        let ok = alpha > 0.0 && alpha <= 1.0 && (0.0..=1.0).contains(&initial);
        if !ok {
            return Err(Error::InvalidArgument(format!(
                "loss estimator needs 0 < alpha ≤ 1 and 0 ≤ initial ≤ 1 (got {alpha}, {initial})"
            )));
        }
        Ok(LossEstimator { alpha, p: initial })
    }

    /// Records that `received` of `expected` shards arrived (counts from the peer; a
    /// `received` above `expected`, from duplicates or late shards, counts as no loss).
    /// Nothing changes when `expected` is 0.
    pub fn observe(&mut self, received: u64, expected: u64) {
        if expected == 0 {
            return;
        }
        let sample = 1.0 - (received.min(expected) as f64 / expected as f64);
        self.p += self.alpha * (sample - self.p);
    }

    /// Records that `received` of `expected` packets arrived, weighting the sample by its
    /// size: it moves the estimate by `1 − exp(−expected / horizon)` of the way, so that the
    /// estimate averages over about `horizon` packets however they are split into samples.
    /// Nothing changes when `expected` is 0 or `horizon` is not positive.
    pub fn observe_over(&mut self, received: u64, expected: u64, horizon: f64) {
        if expected == 0 || horizon.is_nan() || horizon <= 0.0 {
            return;
        }
        let sample = 1.0 - (received.min(expected) as f64 / expected as f64);
        let weight = 1.0 - (-(expected as f64) / horizon).exp();
        self.p += weight * (sample - self.p);
    }

    /// The current loss estimate.
    pub fn loss(&self) -> f64 {
        self.p
    }
}

/// Picks `m` for blocks of `k` data shards from a [`LossEstimator`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdaptiveParity {
    /// Data shards per block.
    pub k: usize,
    /// Largest acceptable probability that a block cannot be rebuilt.
    pub target: f64,
    /// Fewest parity shards per block.
    pub min_m: usize,
    /// Most parity shards per block.
    pub max_m: usize,
    /// The loss estimate.
    pub estimator: LossEstimator,
}

impl AdaptiveParity {
    /// The parity count for the current estimate.
    pub fn m(&self) -> usize {
        parity_for(
            self.k,
            self.estimator.loss(),
            self.target,
            self.min_m,
            self.max_m,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// C(n, j) exactly, for small n.
    fn choose(n: u64, j: u64) -> f64 {
        let mut c: u128 = 1;
        for i in 0..j {
            c = c * u128::from(n - i) / u128::from(i + 1);
        }
        c as f64
    }

    #[test]
    fn a_weighted_estimate_does_not_depend_on_how_the_packets_are_split() {
        // 20,480 packets lost at random at 1 % (a fixed seed), fed as samples of 64 and of
        // 512 packets. Past its first 3,000 packets the weighted estimate stays within 0.6
        // points of 1 % either way, and swings less than half as far as the plain moving
        // average of the 64-packet samples.
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let lost: Vec<bool> = (0..20_480).map(|_| rng.random::<f64>() < 0.01).collect();
        let feed = |size: usize| {
            let mut e = LossEstimator::new(0.0, 0.3).expect("estimator");
            let mut plain = e;
            let (mut swing, mut plain_swing) = (0.0f64, 0.0f64);
            for (i, sample) in lost.chunks(size).enumerate() {
                let l = sample.iter().filter(|&&x| x).count() as u64;
                let n = sample.len() as u64;
                e.observe_over(n - l, n, 1500.0);
                plain.observe(n - l, n);
                if i * size >= 3000 {
                    swing = swing.max((e.loss() - 0.01).abs());
                    plain_swing = plain_swing.max((plain.loss() - 0.01).abs());
                }
            }
            (swing, plain_swing)
        };
        let (fine, plain_fine) = feed(64);
        let (coarse, _) = feed(512);
        assert!(fine < 6e-3, "{fine}");
        assert!(coarse < 6e-3, "{coarse}");
        assert!(fine < plain_fine / 2.0, "{fine} vs {plain_fine}");
        // A 64-packet sample moves it by 1 - exp(-64 / 1500) of the way; empty samples and a
        // horizon of 0 change nothing.
        let mut one = LossEstimator::new(0.01, 0.3).expect("estimator");
        one.observe_over(64, 64, 1500.0);
        let want = 0.01 * (-64.0f64 / 1500.0).exp();
        assert!((one.loss() - want).abs() < 1e-12);
        one.observe_over(0, 0, 1500.0);
        one.observe_over(1, 2, 0.0);
        assert!((one.loss() - want).abs() < 1e-12);
    }

    #[test]
    fn tail_matches_direct_sum() {
        for (k, m, p) in [
            (4usize, 2usize, 0.5f64),
            (10, 3, 0.1),
            (20, 0, 0.3),
            (8, 8, 0.25),
            (30, 10, 0.2),
        ] {
            let n = (k + m) as u64;
            let direct: f64 = ((m as u64 + 1)..=n)
                .map(|j| choose(n, j) * p.powi(j as i32) * (1.0 - p).powi((n - j) as i32))
                .sum();
            let ours = block_failure_probability(k, m, p);
            assert!(
                (ours - direct).abs() <= 1e-12 * direct.max(1e-300) + 1e-300,
                "k={k} m={m} p={p}: {ours} vs {direct}"
            );
        }
        assert_eq!(block_failure_probability(32, 8, 0.0), 0.0);
        assert_eq!(block_failure_probability(32, 8, 1.0), 1.0);
        // Large n does not underflow to 0: half of 4000 shards lost is not rare.
        let t = block_failure_probability(2000, 2000, 0.5);
        assert!((0.4..0.6).contains(&t), "{t}");
    }

    #[test]
    fn twenty_percent_loss_k32() {
        let target = 1e-3;
        let m = parity_for(32, 0.2, target, 1, 64);
        assert!(block_failure_probability(32, m, 0.2) <= target, "m = {m}");
        assert!(
            block_failure_probability(32, m - 1, 0.2) > target,
            "m = {m} is not the smallest"
        );
        assert!((15..=25).contains(&m), "m = {m}");
        // Clamps.
        assert_eq!(parity_for(32, 0.0, target, 2, 64), 2);
        assert_eq!(parity_for(32, 0.9, target, 1, 16), 16);
    }

    #[test]
    fn estimator_converges_and_drives_m() {
        let mut a = AdaptiveParity {
            k: 32,
            target: 1e-3,
            min_m: 1,
            max_m: 64,
            estimator: LossEstimator::new(0.0, 0.2).expect("estimator"),
        };
        let low = a.m();
        for _ in 0..60 {
            a.estimator.observe(80, 100);
        }
        assert!((a.estimator.loss() - 0.2).abs() < 1e-3);
        assert!(a.m() > low);
        a.estimator.observe(5, 0);
        assert!((a.estimator.loss() - 0.2).abs() < 1e-3);
        assert!(LossEstimator::new(0.1, 0.0).is_err());
        assert!(LossEstimator::new(1.5, 0.5).is_err());
    }
}
