//! The timing model of one simulated link: latency, bandwidth, loss and jitter.
//!
//! A frame of `b` wire bytes queued at `now` on a link that is free at `free_at` starts at
//! `max(now, free_at)`, occupies the link for `b / ((1 - p) * bandwidth)` (the retransmitted
//! share of its packets uses capacity too), and arrives one latency after its last byte left,
//! plus a fixed software overhead per frame, plus the recovery delay of its lost packets,
//! plus jitter.
//!
//! With a CPU model ([`super::Cpus`]) a frame also costs its ends processor time,
//! [`LinkSpec::cpu_tx`] and [`LinkSpec::cpu_rx`] per wire byte, on a core of each end's
//! machine: it moves no faster than the slower of the link and its ends' processing, and
//! frames that share a machine's cores wait for them (see `net.rs`).
//!
//! A link may be shaped by a token bucket, as `tc tbf` shapes one: `burst` bytes of tokens,
//! refilled at `bandwidth` while the link does not use them; the bytes a frame finds tokens
//! for leave at the `peak` rate of the line under the shaper, the rest at `bandwidth`. A
//! short transfer after a pause therefore beats the shaped rate, as it does on a real shaper.
//!
//! Loss is modelled as a reliable stream pays for it, not as a vanished frame: the frame is
//! `ceil(b / mtu)` packets, each lost independently with probability `p` on every try; a lost
//! packet is resent one recovery time (`rto`) later, in parallel with the others, so the frame
//! is late by `rto` times the largest number of tries any of its packets needed. That maximum
//! is drawn from its exact distribution, `P(max <= k) = (1 - p^(k+1))^n`, in `O(k)` work
//! whatever `n` is, so a frame that stands for gigabytes costs one draw.

use crate::error::{Error, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::time::Duration;

/// The figures of one kind of link.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkSpec {
    /// One-way propagation delay.
    pub latency: Duration,
    /// Bytes per second the link carries.
    pub bandwidth: f64,
    /// Probability that one packet is lost on one try, in `[0, 0.9]`.
    pub loss: f64,
    /// Largest extra delay of a frame, drawn uniformly per frame.
    pub jitter: Duration,
    /// Packet size the loss model cuts frames into.
    pub mtu: usize,
    /// How much later a lost packet arrives than it would have (loss detection plus resend).
    pub rto: Duration,
    /// Fixed software time per frame, whatever its size: the sending and receiving stacks'
    /// work (system calls, wake-ups, per-operation bookkeeping) that a real host adds to a
    /// frame's latency. It delays the frame's arrival and does not occupy the link, so
    /// pipelined frames pay it in parallel. Zero unless calibrated (`mcp-sim validate`).
    pub overhead: Duration,
    /// Processor nanoseconds the sending end spends per wire byte (building, encrypting and
    /// sending packets, the checksum, copies), each resend of a lost packet included: a frame
    /// of `b` bytes costs `b x cpu_tx / (1 - loss)`. Charged only when the simulation has a
    /// CPU model ([`super::SimConfig::cpu`]); zero unless calibrated (`mcp-sim validate`).
    pub cpu_tx: f64,
    /// Processor nanoseconds the receiving end spends per wire byte (receiving and decrypting
    /// packets, the checksum, copies, the reduction), as [`LinkSpec::cpu_tx`].
    pub cpu_rx: f64,
    /// Bytes of tokens a shaper's bucket holds (0: no shaper, every byte at `bandwidth`).
    pub burst: f64,
    /// Bytes per second at which bytes covered by tokens leave: the line under the shaper.
    pub peak: f64,
}

/// The tokens of one shaped link direction: how many it held at `at` (virtual nanoseconds).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Bucket {
    tokens: f64,
    at: u64,
}

impl Bucket {
    /// A bucket that has been idle long enough to be full.
    pub(crate) fn full(spec: &LinkSpec) -> Bucket {
        Bucket {
            tokens: spec.burst,
            at: 0,
        }
    }
}

impl LinkSpec {
    /// A clean link of round-trip time `rtt` and `bandwidth` bytes per second, MTU 1500, and
    /// QUIC's loss recovery time: a loss is declared 9/8 RTT after the packet was sent (its
    /// time threshold), plus the 1 ms timer granularity.
    pub fn new(rtt: Duration, bandwidth: f64) -> LinkSpec {
        LinkSpec {
            latency: rtt / 2,
            bandwidth,
            loss: 0.0,
            jitter: Duration::ZERO,
            mtu: 1500,
            rto: rtt * 9 / 8 + Duration::from_millis(1),
            overhead: Duration::ZERO,
            cpu_tx: 0.0,
            cpu_rx: 0.0,
            burst: 0.0,
            peak: 0.0,
        }
    }

    /// The same link behind a token-bucket shaper of `burst` bytes over a line of `peak`
    /// bytes per second (see the module's notes).
    pub fn with_bucket(mut self, burst: f64, peak: f64) -> LinkSpec {
        self.burst = burst;
        self.peak = peak;
        self
    }

    /// The same link costing its sending and receiving ends `tx` and `rx` processor
    /// nanoseconds per wire byte (see [`LinkSpec::cpu_tx`]).
    pub fn with_cpu(mut self, tx: f64, rx: f64) -> LinkSpec {
        self.cpu_tx = tx;
        self.cpu_rx = rx;
        self
    }

    /// The same link with a fixed software `overhead` per frame (see [`LinkSpec::overhead`]).
    pub fn with_overhead(mut self, overhead: Duration) -> LinkSpec {
        self.overhead = overhead;
        self
    }

    /// The same link losing `loss` of its packets.
    pub fn with_loss(mut self, loss: f64) -> LinkSpec {
        self.loss = loss;
        self
    }

    /// The same link with up to `jitter` extra delay per frame.
    pub fn with_jitter(mut self, jitter: Duration) -> LinkSpec {
        self.jitter = jitter;
        self
    }

    /// Checks that the figures make sense.
    pub fn validate(&self, what: &str) -> Result<()> {
        if !(self.bandwidth.is_finite() && self.bandwidth > 0.0) {
            return Err(Error::InvalidArgument(format!(
                "{what} link: bandwidth must be a positive number of bytes per second, got {}",
                self.bandwidth
            )));
        }
        if !(0.0..=0.9).contains(&self.loss) {
            return Err(Error::InvalidArgument(format!(
                "{what} link: loss must be between 0 and 0.9, got {}",
                self.loss
            )));
        }
        for (name, v) in [("cpu_tx", self.cpu_tx), ("cpu_rx", self.cpu_rx)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(Error::InvalidArgument(format!(
                    "{what} link: {name} must be a non-negative number of nanoseconds per byte, got {v}"
                )));
            }
        }
        if !(self.burst.is_finite() && self.burst >= 0.0) {
            return Err(Error::InvalidArgument(format!(
                "{what} link: burst must be a non-negative number of bytes, got {}",
                self.burst
            )));
        }
        if self.burst > 0.0 && !(self.peak.is_finite() && self.peak > self.bandwidth) {
            return Err(Error::InvalidArgument(format!(
                "{what} link: a shaper's burst needs the line's peak rate above its bandwidth \
                 ({} bytes/s), got {}",
                self.bandwidth, self.peak
            )));
        }
        if self.mtu < 64 {
            return Err(Error::InvalidArgument(format!(
                "{what} link: mtu must be at least 64 bytes, got {}",
                self.mtu
            )));
        }
        Ok(())
    }

    /// Nanoseconds `bytes` occupy the link, retransmissions included.
    pub fn serialise_ns(&self, bytes: f64) -> u64 {
        (bytes / ((1.0 - self.loss) * self.bandwidth) * 1e9).ceil() as u64
    }

    /// Nanoseconds `bytes` occupy the link when they start at `start` with `bucket`'s
    /// tokens, retransmissions included (they spend tokens too); leaves in `bucket` what is
    /// left when the last byte has gone. Without a shaper, [`LinkSpec::serialise_ns`].
    pub(crate) fn shaped_ns(&self, bytes: f64, bucket: &mut Bucket, start: u64) -> u64 {
        if self.burst <= 0.0 {
            return self.serialise_ns(bytes);
        }
        let idle_s = start.saturating_sub(bucket.at) as f64 * 1e-9;
        let tokens = (bucket.tokens + idle_s * self.bandwidth).min(self.burst);
        let wire = bytes / (1.0 - self.loss);
        let fast = wire.min(tokens);
        let secs = fast / self.peak + (wire - fast) / self.bandwidth;
        let ns = (secs * 1e9).ceil() as u64;
        // Tokens keep coming while the burst leaves; bytes beyond it use each as it comes.
        let left = if wire <= tokens {
            (tokens - wire + fast / self.peak * self.bandwidth).min(self.burst)
        } else {
            0.0
        };
        *bucket = Bucket {
            tokens: left,
            at: start.saturating_add(ns),
        };
        ns
    }
}

/// Most tries counted for one packet: beyond it the probability is below any float's reach.
const MAX_TRIES: u32 = 256;

/// The random draws of one direction of one link, from its own generator.
#[derive(Debug)]
pub(crate) struct LinkRng {
    rng: StdRng,
}

/// Mixes the run's seed with the link's ends (splitmix64), so that every link has its own
/// stream and one seed replays every link.
fn link_seed(seed: u64, src: usize, dst: usize) -> u64 {
    let mut z = seed
        ^ (src as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (dst as u64)
            .wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
            .rotate_left(17);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl LinkRng {
    /// The generator of the link from `src` to `dst` in a run seeded with `seed`.
    pub(crate) fn new(seed: u64, src: usize, dst: usize) -> LinkRng {
        LinkRng {
            rng: StdRng::seed_from_u64(link_seed(seed, src, dst)),
        }
    }

    /// Extra nanoseconds a frame of `bytes` pays on `spec`: loss recovery plus jitter.
    pub(crate) fn extra_ns(&mut self, spec: &LinkSpec, bytes: f64) -> u64 {
        let mut extra = 0u64;
        if spec.loss > 0.0 {
            let packets = (bytes / spec.mtu as f64).ceil().max(1.0);
            let tries = max_losses(spec.loss, packets, self.rng.random::<f64>());
            extra += spec.rto.as_nanos() as u64 * u64::from(tries);
        }
        if !spec.jitter.is_zero() {
            extra += self.rng.random_range(0..=spec.jitter.as_nanos() as u64);
        }
        extra
    }
}

/// The largest number of losses among `packets` packets each lost with probability `p` per
/// try: the smallest `k` with `P(max <= k) = (1 - p^(k+1))^packets >= u`.
pub(crate) fn max_losses(p: f64, packets: f64, u: f64) -> u32 {
    let ln_u = u.max(f64::MIN_POSITIVE).ln();
    let mut pk = p; // p^(k+1)
    for k in 0..MAX_TRIES {
        if packets * (-pk).ln_1p() >= ln_u {
            return k;
        }
        pk *= p;
    }
    MAX_TRIES
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_loss_costs_nothing_and_certain_draws_are_bounded() {
        assert_eq!(max_losses(0.0, 1e9, 0.999), 0);
        // One packet at 50 %: P(max <= k) = 1 - 0.5^(k+1).
        assert_eq!(max_losses(0.5, 1.0, 0.4), 0);
        assert_eq!(max_losses(0.5, 1.0, 0.6), 1);
        assert_eq!(max_losses(0.5, 1.0, 0.8), 2);
        assert!(max_losses(0.9, 1e12, 1.0 - 1e-12) <= MAX_TRIES);
    }

    #[test]
    fn the_mean_recovery_matches_the_distribution() {
        // 100 packets at 5 %: E[max] = sum_k P(max > k) = sum_k 1 - (1 - 0.05^(k+1))^100.
        let expected: f64 = (0..50)
            .map(|k| 1.0 - (1.0 - 0.05f64.powi(k + 1)).powf(100.0))
            .sum();
        let mut rng = StdRng::seed_from_u64(7);
        let n = 20_000;
        let mean = (0..n)
            .map(|_| f64::from(max_losses(0.05, 100.0, rng.random::<f64>())))
            .sum::<f64>()
            / f64::from(n);
        assert!(
            (mean - expected).abs() < 0.03,
            "mean {mean}, expected {expected}"
        );
    }

    #[test]
    fn each_link_has_its_own_stream_and_a_seed_replays_it() {
        let spec = LinkSpec::new(Duration::from_millis(1), 1e9)
            .with_loss(0.2)
            .with_jitter(Duration::from_micros(100));
        let draws = |seed, s, d| {
            let mut r = LinkRng::new(seed, s, d);
            (0..64)
                .map(|_| r.extra_ns(&spec, 15_000.0))
                .collect::<Vec<_>>()
        };
        assert_eq!(draws(1, 2, 3), draws(1, 2, 3));
        assert_ne!(draws(1, 2, 3), draws(1, 3, 2));
        assert_ne!(draws(1, 2, 3), draws(2, 2, 3));
    }

    #[test]
    fn a_shaper_passes_its_burst_at_the_peak_rate_and_refills_at_its_rate() {
        // 1 Gbit/s shaped, 256 KiB of tokens, over a 100 Gbit/s line.
        let spec = LinkSpec::new(Duration::from_micros(50), 125e6).with_bucket(262_144.0, 12.5e9);
        let mut b = Bucket::full(&spec);
        // 1 MiB from a full bucket: 256 KiB at the peak, 768 KiB at the rate.
        let first = spec.shaped_ns(1_048_576.0, &mut b, 1_000);
        let want = ((262_144.0 / 12.5e9 + 786_432.0 / 125e6) * 1e9f64).ceil() as u64;
        assert_eq!(first, want);
        assert_eq!(b.tokens, 0.0);
        // Straight after it: no tokens, every byte at the rate.
        let second = spec.shaped_ns(1_048_576.0, &mut b, 1_000 + first);
        assert_eq!(second, spec.serialise_ns(1_048_576.0));
        // 1 ms idle refills 125 kB; a frame that fits leaves at the peak and keeps the rest.
        let third = spec.shaped_ns(100_000.0, &mut b, 1_000 + first + second + 1_000_000);
        assert_eq!(third, (100_000.0 / 12.5e9 * 1e9f64).ceil() as u64);
        assert!(
            (b.tokens - (125_000.0 - 100_000.0 + 1_000.0)).abs() < 1.0,
            "{b:?}"
        );
        // The bucket never holds more than its burst.
        let late = 1_000 + first + second + third + 10_000_000_000;
        let fourth = spec.shaped_ns(1_048_576.0, &mut b, late);
        assert_eq!(fourth, first);
        // No shaper: the plain rate whatever the bucket says.
        let plain = LinkSpec::new(Duration::from_micros(50), 125e6);
        let mut none = Bucket::full(&plain);
        assert_eq!(
            plain.shaped_ns(1_048_576.0, &mut none, 0),
            plain.serialise_ns(1_048_576.0)
        );
    }

    #[test]
    fn bad_figures_are_refused() {
        let ok = LinkSpec::new(Duration::from_micros(50), 1e9);
        assert!(ok.validate("inter").is_ok());
        assert!(LinkSpec {
            bandwidth: 0.0,
            ..ok
        }
        .validate("x")
        .is_err());
        assert!(ok.with_loss(0.95).validate("x").is_err());
        assert!(LinkSpec { mtu: 10, ..ok }.validate("x").is_err());
        assert!(ok.with_cpu(-1.0, 0.0).validate("x").is_err());
        assert!(ok.with_cpu(0.5, f64::NAN).validate("x").is_err());
        assert!(ok.with_cpu(0.5, 0.5).validate("x").is_ok());
        assert_eq!(ok.serialise_ns(1e9), 1_000_000_000);
        assert!(ok.with_bucket(-1.0, 1e10).validate("x").is_err());
        assert!(ok.with_bucket(1e5, 1e9).validate("x").is_err());
        assert!(ok.with_bucket(1e5, f64::INFINITY).validate("x").is_err());
        assert!(ok.with_bucket(1e5, 1e10).validate("x").is_ok());
    }
}
