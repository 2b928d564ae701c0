//! The progress watchdog: the second channel of liveness.
//!
//! Heartbeats prove that a peer's process and network answer; they are answered by the QUIC
//! stack's own threads, so a peer whose training loop hangs (a stuck kernel, a deadlock, an
//! endless data-loader wait) keeps answering them and looks alive. Every rank therefore also
//! reports its *progress*, the number of collective operations it has started and finished,
//! and this watchdog compares them:
//!
//! A peer is **stalled** when this rank has waited in operation `s` longer than the limit,
//! the peer's reports keep coming (it is reachable: a silent one is the failure detector's
//! case) but say it has not started `s`, and they have not changed for longer than the limit.
//! A peer inside `s` is waiting like us, never the culprit; one that is merely slow starts
//! `s` eventually and moves its report.
//!
//! The limit is `max(floor, factor × p99)` of the intervals between this rank's own
//! successive operation starts: the job's step time as this rank lives it, a slow peer's
//! slowness included, so a peer that is consistently slow raises the limit instead of being
//! failed. Sans-IO: every call takes `now`.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

/// Intervals between operation starts kept for the p99.
const WINDOW: usize = 64;

/// What a rank reports of itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Progress {
    /// Collective operations started (the next one's sequence number).
    pub started: u64,
    /// Collective operations finished, successfully or not.
    pub finished: u64,
}

impl Progress {
    /// Bytes of [`Progress::to_bytes`].
    pub const LEN: usize = 16;

    /// The report's wire form (little endian).
    pub fn to_bytes(self) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        out[..8].copy_from_slice(&self.started.to_le_bytes());
        out[8..].copy_from_slice(&self.finished.to_le_bytes());
        out
    }

    /// Reads a report; `None` unless `b` is exactly [`Progress::LEN`] bytes.
    pub fn from_bytes(b: &[u8]) -> Option<Progress> {
        let b: &[u8; Self::LEN] = b.try_into().ok()?;
        let mut s = [0u8; 8];
        let mut f = [0u8; 8];
        s.copy_from_slice(&b[..8]);
        f.copy_from_slice(&b[8..]);
        Some(Progress {
            started: u64::from_le_bytes(s),
            finished: u64::from_le_bytes(f),
        })
    }
}

/// A peer found stalled.
#[derive(Debug, Clone, PartialEq)]
pub struct Stall {
    /// The stalled peer.
    pub peer: usize,
    /// The operation this rank waits in, which the peer has not started.
    pub waiting_in: u64,
    /// The peer's last report.
    pub report: Progress,
    /// How long the peer's report has not changed.
    pub unchanged_for: Duration,
    /// The limit it passed.
    pub limit: Duration,
}

#[derive(Debug, Clone, Copy)]
struct Seen {
    report: Progress,
    changed: Instant,
    heard: Instant,
}

/// This rank's progress and what it heard of its peers'.
#[derive(Debug)]
pub struct ProgressWatch {
    floor: Duration,
    factor: u32,
    started: u64,
    finished: u64,
    in_flight: BTreeMap<u64, Instant>,
    last_start: Option<Instant>,
    intervals: VecDeque<Duration>,
    peers: Vec<Option<Seen>>,
}

impl ProgressWatch {
    /// A watch over `world` ranks whose limit is at least `floor` and `factor` times the p99
    /// of this rank's intervals between operations.
    pub fn new(world: usize, floor: Duration, factor: u32) -> ProgressWatch {
        ProgressWatch {
            floor,
            factor: factor.max(1),
            started: 0,
            finished: 0,
            in_flight: BTreeMap::new(),
            last_start: None,
            intervals: VecDeque::with_capacity(WINDOW),
            peers: vec![None; world],
        }
    }

    /// This rank started collective operation `seq`.
    pub fn op_started(&mut self, seq: u64, now: Instant) {
        self.started = self.started.max(seq + 1);
        self.in_flight.insert(seq, now);
        if let Some(prev) = self.last_start.replace(now) {
            if self.intervals.len() == WINDOW {
                self.intervals.pop_front();
            }
            self.intervals
                .push_back(now.saturating_duration_since(prev));
        }
    }

    /// This rank finished collective operation `seq` (successfully or not).
    pub fn op_finished(&mut self, seq: u64) {
        if self.in_flight.remove(&seq).is_some() {
            self.finished += 1;
        }
    }

    /// What this rank reports of itself.
    pub fn local(&self) -> Progress {
        Progress {
            started: self.started,
            finished: self.finished,
        }
    }

    /// A report from `peer` arrived.
    pub fn on_report(&mut self, peer: usize, report: Progress, now: Instant) {
        let Some(slot) = self.peers.get_mut(peer) else {
            return;
        };
        *slot = Some(match *slot {
            Some(s) if s.report == report => Seen { heard: now, ..s },
            _ => Seen {
                report,
                changed: now,
                heard: now,
            },
        });
    }

    /// How long a peer may keep this rank waiting without moving: `max(floor, factor × p99)`
    /// of the intervals between this rank's operation starts.
    pub fn limit(&self) -> Duration {
        let mut v: Vec<Duration> = self.intervals.iter().copied().collect();
        v.sort_unstable();
        let p99 = v
            .get(((v.len() as f64 * 0.99).ceil() as usize).saturating_sub(1))
            .copied()
            .unwrap_or_default();
        self.floor.max(p99 * self.factor)
    }

    /// Whether `peer` is stalled now; `fresh` is how recent its last report must be for it to
    /// count as reachable.
    pub fn check(&self, peer: usize, now: Instant, fresh: Duration) -> Option<Stall> {
        let (&waiting_in, &since) = self.in_flight.iter().next()?;
        let seen = (*self.peers.get(peer)?)?;
        let limit = self.limit();
        let waited = now.saturating_duration_since(since);
        let unchanged_for = now.saturating_duration_since(seen.changed);
        let reachable = now.saturating_duration_since(seen.heard) <= fresh;
        (seen.report.started <= waiting_in && waited > limit && unchanged_for > limit && reachable)
            .then_some(Stall {
                peer,
                waiting_in,
                report: seen.report,
                unchanged_for,
                limit,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn p(started: u64, finished: u64) -> Progress {
        Progress { started, finished }
    }

    /// A watch that ran `n` operations `gap` apart, with peer 1 keeping up, ending at `t`.
    fn steady(n: u64, gap: Duration) -> (ProgressWatch, Instant) {
        let mut w = ProgressWatch::new(3, S, 10);
        let mut t = Instant::now();
        for s in 0..n {
            w.op_started(s, t);
            w.on_report(1, p(s + 1, s), t);
            w.op_finished(s);
            w.on_report(1, p(s + 1, s + 1), t);
            t += gap;
        }
        (w, t)
    }

    #[test]
    fn reports_round_trip_and_bad_lengths_are_refused() {
        let r = p(7, 5);
        assert_eq!(Progress::from_bytes(&r.to_bytes()), Some(r));
        assert_eq!(Progress::from_bytes(&[0; 15]), None);
        assert_eq!(Progress::from_bytes(&[0; 17]), None);
    }

    #[test]
    fn a_peer_that_never_starts_the_operation_is_stalled_once_the_limit_passes() {
        let (mut w, t0) = steady(20, ms(10));
        assert_eq!(w.limit(), S); // 10 x 10 ms is under the floor
        w.op_started(20, t0);
        for i in 0..30u64 {
            let now = t0 + ms(100) * i as u32;
            w.on_report(1, p(20, 20), now); // alive, between operations, not moving
            let stall = w.check(1, now, 3 * S);
            if now.duration_since(t0) <= S + ms(10) {
                assert_eq!(stall, None, "at {:?}", now.duration_since(t0));
            } else {
                let s = stall.expect("stalled");
                assert_eq!((s.peer, s.waiting_in, s.report), (1, 20, p(20, 20)));
                assert!(s.unchanged_for > S && s.limit == S);
                return;
            }
        }
        panic!("never found stalled");
    }

    #[test]
    fn a_peer_inside_the_operation_is_waiting_too_never_the_culprit() {
        let (mut w, t0) = steady(5, ms(10));
        w.op_started(5, t0);
        let later = t0 + 10 * S;
        w.on_report(1, p(6, 5), t0); // it started operation 5 and waits in it, like us
        w.on_report(1, p(6, 5), later);
        assert_eq!(w.check(1, later, 3 * S), None);
    }

    #[test]
    fn a_silent_peer_is_the_failure_detectors_case() {
        let (mut w, t0) = steady(5, ms(10));
        w.op_started(5, t0);
        w.on_report(1, p(5, 5), t0);
        let later = t0 + 10 * S;
        assert_eq!(w.check(1, later, 3 * S), None); // no report for 10 s: not "reachable"
        w.on_report(1, p(5, 5), later);
        assert!(w.check(1, later, 3 * S).is_some());
    }

    #[test]
    fn a_consistently_slow_job_raises_the_limit_and_a_slow_peer_is_never_failed() {
        // Operations 2 s apart (a slow peer holds everyone): the limit becomes 10 x 2 s.
        let (mut w, t0) = steady(20, 2 * S);
        let limit = w.limit();
        assert!(limit >= 20 * S && limit < 25 * S, "{limit:?}");
        w.op_started(20, t0);
        // The peer takes its usual 2 s, then starts the operation.
        w.on_report(1, p(20, 20), t0 + S);
        assert_eq!(w.check(1, t0 + 2 * S, 3 * S), None);
        w.on_report(1, p(21, 20), t0 + 2 * S);
        assert_eq!(w.check(1, t0 + 30 * S, 3 * S), None);
    }

    #[test]
    fn nothing_is_stalled_while_this_rank_waits_in_no_operation() {
        let (mut w, t0) = steady(5, ms(10));
        w.on_report(1, p(5, 5), t0 + 100 * S);
        assert_eq!(w.check(1, t0 + 100 * S, 3 * S), None);
        assert_eq!(w.check(2, t0 + 100 * S, 3 * S), None); // never heard of
        assert_eq!(w.check(9, t0 + 100 * S, 3 * S), None); // no such rank
    }

    #[test]
    fn operations_finishing_out_of_order_count_once() {
        let mut w = ProgressWatch::new(2, S, 10);
        let t = Instant::now();
        w.op_started(0, t);
        w.op_started(1, t);
        w.op_finished(1);
        w.op_finished(1);
        assert_eq!(w.local(), p(2, 1));
        w.op_finished(0);
        assert_eq!(w.local(), p(2, 2));
    }
}
