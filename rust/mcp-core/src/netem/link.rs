//! One direction of an emulated path, as a sans-IO scheduler.
//!
//! A packet pushed at `now` is dropped with probability `loss`, otherwise it waits for the
//! rate cap (a link that serialises `rate` bytes per second: the packet leaves when the one
//! before it has left plus its own length / rate), then travels `delay ± jitter` (uniform).
//! Packets are delivered in the order they were pushed, always: a packet whose jitter would
//! put it before its predecessor is held until that one is delivered (so jitter never
//! reorders, as on a single FIFO path). A packet that would wait longer than `queue_limit`
//! for the rate cap is dropped on arrival (a full queue, as tbf's `latency`).

use crate::error::Error;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Most packets one direction holds in flight; beyond it a packet is dropped as overflow, so
/// memory stays bounded whatever the parameters.
const MAX_IN_FLIGHT: usize = 1 << 17;
/// Longest delay or queue limit taken: an hour is no network, and it keeps `Instant`
/// arithmetic far from overflow.
const MAX_WAIT: Duration = Duration::from_secs(3600);

/// The behaviour of one direction of the path.
#[derive(Debug, Clone, PartialEq)]
pub struct LinkParams {
    /// One-way delay added to every packet.
    pub delay: Duration,
    /// Each packet's delay is `delay` plus a uniform draw in `[-jitter, +jitter]` (never
    /// below zero).
    pub jitter: Duration,
    /// Probability that a packet is dropped, in `[0, 1]`.
    pub loss: f64,
    /// Rate cap in bytes per second; `None` for no cap.
    pub rate: Option<f64>,
    /// Longest a packet may wait for the rate cap before it is dropped instead.
    pub queue_limit: Duration,
    /// Seed of the loss and jitter draws: the same seed and inputs give the same outputs.
    pub seed: u64,
}

impl Default for LinkParams {
    fn default() -> Self {
        Self {
            delay: Duration::ZERO,
            jitter: Duration::ZERO,
            loss: 0.0,
            rate: None,
            queue_limit: Duration::from_millis(50),
            seed: 0,
        }
    }
}

impl LinkParams {
    /// Checks the parameters; the message says which one is wrong and why.
    pub fn validate(&self) -> Result<(), Error> {
        if !(0.0..=1.0).contains(&self.loss) {
            return Err(Error::InvalidArgument(format!(
                "loss must be between 0 and 1, got {}",
                self.loss
            )));
        }
        if self.delay > MAX_WAIT || self.queue_limit > MAX_WAIT {
            return Err(Error::InvalidArgument(format!(
                "delay ({:?}) and queue limit ({:?}) must be at most an hour",
                self.delay, self.queue_limit
            )));
        }
        if self.jitter > self.delay {
            return Err(Error::InvalidArgument(format!(
                "jitter ({:?}) must not exceed the delay ({:?})",
                self.jitter, self.delay
            )));
        }
        if let Some(r) = self.rate {
            if !(r.is_finite() && r >= 1.0) {
                return Err(Error::InvalidArgument(format!(
                    "rate must be at least 1 byte per second, got {r}"
                )));
            }
        }
        Ok(())
    }
}

/// What [`Link::push`] did with a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// It is queued and will come out of [`Link::pop_due`].
    Queued,
    /// It was dropped by the random loss.
    Lost,
    /// It was dropped because the queue before the rate cap was full.
    Overflow,
}

/// Counters of one direction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// Packets delivered by [`Link::pop_due`].
    pub delivered: u64,
    /// Bytes delivered.
    pub delivered_bytes: u64,
    /// Packets dropped by the random loss.
    pub lost: u64,
    /// Packets dropped because the queue was full.
    pub overflow: u64,
}

/// One direction of the path: push packets as they arrive, pop them when they are due.
#[derive(Debug)]
pub struct Link {
    params: LinkParams,
    rng: StdRng,
    queue: VecDeque<(Instant, Vec<u8>)>,
    /// When the rate cap has finished sending everything pushed so far.
    free_at: Option<Instant>,
    stats: LinkStats,
}

impl Link {
    /// A link with these parameters, after checking them.
    pub fn new(params: LinkParams) -> Result<Self, Error> {
        params.validate()?;
        Ok(Self {
            rng: StdRng::seed_from_u64(params.seed),
            params,
            queue: VecDeque::new(),
            free_at: None,
            stats: LinkStats::default(),
        })
    }

    /// Takes a packet that arrived at `now`.
    pub fn push(&mut self, now: Instant, packet: Vec<u8>) -> Verdict {
        // Draw the loss first so the draws do not depend on the queue's state.
        let lost = self.params.loss > 0.0 && self.rng.random::<f64>() < self.params.loss;
        let jitter = self.jitter();
        if lost {
            self.stats.lost += 1;
            return Verdict::Lost;
        }
        let start = self.free_at.map_or(now, |f| f.max(now));
        if start - now > self.params.queue_limit || self.queue.len() >= MAX_IN_FLIGHT {
            self.stats.overflow += 1;
            return Verdict::Overflow;
        }
        let sent = match self.params.rate {
            Some(rate) => start + Duration::from_secs_f64(packet.len() as f64 / rate),
            None => start,
        };
        self.free_at = Some(sent);
        let mut due = match jitter {
            Jitter::Add(j) => sent + self.params.delay + j,
            Jitter::Sub(j) => sent + self.params.delay.saturating_sub(j),
        };
        if let Some(&(last, _)) = self.queue.back() {
            due = due.max(last); // FIFO: never before the packet ahead
        }
        self.queue.push_back((due, packet));
        Verdict::Queued
    }

    /// The next packet due at or before `now`, if any; call until `None`.
    pub fn pop_due(&mut self, now: Instant) -> Option<Vec<u8>> {
        if self.queue.front().is_some_and(|&(due, _)| due <= now) {
            let (_, p) = self.queue.pop_front()?;
            self.stats.delivered += 1;
            self.stats.delivered_bytes += p.len() as u64;
            return Some(p);
        }
        None
    }

    /// When the next packet is due; `None` when the link is empty.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.queue.front().map(|&(due, _)| due)
    }

    /// Packets waiting in the link.
    pub fn in_flight(&self) -> usize {
        self.queue.len()
    }

    /// The counters so far.
    pub fn stats(&self) -> LinkStats {
        self.stats
    }

    fn jitter(&mut self) -> Jitter {
        let j = self.params.jitter.as_nanos() as u64;
        if j == 0 {
            return Jitter::Add(Duration::ZERO);
        }
        let draw = self.rng.random_range(0..=2 * j);
        if draw >= j {
            Jitter::Add(Duration::from_nanos(draw - j))
        } else {
            Jitter::Sub(Duration::from_nanos(j - draw))
        }
    }
}

enum Jitter {
    Add(Duration),
    Sub(Duration),
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // a test's unwrap is its assertion
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn drain(link: &mut Link, now: Instant) -> Vec<Vec<u8>> {
        std::iter::from_fn(|| link.pop_due(now)).collect()
    }

    #[test]
    fn delay_holds_a_packet_exactly_that_long() {
        let t0 = Instant::now();
        let mut l = Link::new(LinkParams {
            delay: ms(25),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(l.push(t0, vec![1, 2, 3]), Verdict::Queued);
        assert_eq!(l.next_deadline(), Some(t0 + ms(25)));
        assert!(l.pop_due(t0 + ms(25) - Duration::from_nanos(1)).is_none());
        assert_eq!(l.pop_due(t0 + ms(25)), Some(vec![1, 2, 3]));
        assert_eq!(l.next_deadline(), None);
        assert_eq!(l.stats().delivered, 1);
        assert_eq!(l.stats().delivered_bytes, 3);
    }

    #[test]
    fn no_delay_no_cap_passes_at_once() {
        let t0 = Instant::now();
        let mut l = Link::new(LinkParams::default()).unwrap();
        for i in 0..10u8 {
            l.push(t0, vec![i]);
        }
        let out = drain(&mut l, t0);
        assert_eq!(out, (0..10u8).map(|i| vec![i]).collect::<Vec<_>>());
    }

    #[test]
    fn rate_cap_spaces_packets_by_their_length() {
        let t0 = Instant::now();
        // 1000 bytes per second: a 100-byte packet takes 100 ms to send.
        let p = LinkParams {
            rate: Some(1000.0),
            queue_limit: ms(1000),
            ..Default::default()
        };
        let mut l = Link::new(p).unwrap();
        for _ in 0..3 {
            assert_eq!(l.push(t0, vec![0; 100]), Verdict::Queued);
        }
        assert_eq!(l.next_deadline(), Some(t0 + ms(100)));
        assert_eq!(drain(&mut l, t0 + ms(199)).len(), 1);
        assert_eq!(drain(&mut l, t0 + ms(300)).len(), 2);
    }

    #[test]
    fn a_full_queue_drops_on_arrival() {
        let t0 = Instant::now();
        let p = LinkParams {
            rate: Some(1000.0),
            queue_limit: ms(150),
            ..Default::default()
        };
        let mut l = Link::new(p).unwrap();
        // Waits: 0, 100, 200 ms: the third is beyond 150 ms.
        assert_eq!(l.push(t0, vec![0; 100]), Verdict::Queued);
        assert_eq!(l.push(t0, vec![0; 100]), Verdict::Queued);
        assert_eq!(l.push(t0, vec![0; 100]), Verdict::Overflow);
        assert_eq!(l.stats().overflow, 1);
        // Once the queue has drained, packets are taken again.
        assert_eq!(l.push(t0 + ms(200), vec![0; 100]), Verdict::Queued);
    }

    #[test]
    fn loss_rate_is_near_p_and_seeded() {
        let t0 = Instant::now();
        let run = |seed| {
            let mut l = Link::new(LinkParams {
                loss: 0.1,
                seed,
                ..Default::default()
            })
            .unwrap();
            (0..20_000).map(|_| l.push(t0, vec![0])).collect::<Vec<_>>()
        };
        let a = run(7);
        assert_eq!(a, run(7));
        assert_ne!(a, run(8));
        let lost = a.iter().filter(|v| **v == Verdict::Lost).count();
        // Binomial(20000, 0.1): sd = 42; ±300 is more than 7 sd.
        assert!((1700..=2300).contains(&lost), "lost {lost}");
    }

    #[test]
    fn loss_one_drops_everything_and_zero_nothing() {
        let t0 = Instant::now();
        let mut all = Link::new(LinkParams {
            loss: 1.0,
            ..Default::default()
        })
        .unwrap();
        let mut none = Link::new(LinkParams::default()).unwrap();
        for _ in 0..1000 {
            assert_eq!(all.push(t0, vec![0]), Verdict::Lost);
            assert_eq!(none.push(t0, vec![0]), Verdict::Queued);
        }
    }

    #[test]
    fn jitter_stays_in_bounds_and_keeps_order() {
        let t0 = Instant::now();
        let p = LinkParams {
            delay: ms(20),
            jitter: ms(5),
            seed: 3,
            ..Default::default()
        };
        let mut l = Link::new(p).unwrap();
        let mut dues = Vec::new();
        for i in 0..2000u32 {
            let at = t0 + Duration::from_micros(u64::from(i) * 100);
            l.push(at, i.to_le_bytes().to_vec());
            dues.push((at, l.queue.back().unwrap().0));
        }
        let mut spread = (ms(100), Duration::ZERO);
        for w in dues.windows(2) {
            assert!(w[1].1 >= w[0].1, "delivery order kept");
        }
        for &(at, due) in &dues {
            let d = due - at;
            assert!(
                d >= ms(15) && d <= ms(25) + Duration::from_micros(100),
                "{d:?}"
            );
            spread = (spread.0.min(d), spread.1.max(d));
        }
        assert!(
            spread.1 - spread.0 > ms(5),
            "jitter varies the delay: {spread:?}"
        );
        let out = drain(&mut l, t0 + ms(1000));
        let ids: Vec<u32> = out
            .iter()
            .map(|p| u32::from_le_bytes(p[..4].try_into().unwrap()))
            .collect();
        assert_eq!(ids, (0..2000).collect::<Vec<_>>());
    }

    #[test]
    fn bad_parameters_are_refused() {
        for p in [
            LinkParams {
                loss: 1.5,
                ..Default::default()
            },
            LinkParams {
                loss: f64::NAN,
                ..Default::default()
            },
            LinkParams {
                delay: ms(1),
                jitter: ms(2),
                ..Default::default()
            },
            LinkParams {
                rate: Some(0.0),
                ..Default::default()
            },
            LinkParams {
                rate: Some(f64::INFINITY),
                ..Default::default()
            },
        ] {
            assert!(matches!(Link::new(p), Err(Error::InvalidArgument(_))));
        }
    }
}
