//! The failure detector of one connection, sans IO: [`PeerMonitor`] is told when a packet
//! from the peer arrived ([`PeerMonitor::on_heard`]) and when its progress report went out
//! ([`PeerMonitor::report_sent`]); [`PeerMonitor::poll_timeout`] says when it next needs
//! [`PeerMonitor::handle_timeout`], which answers with what to do ([`Action`]). The QUIC
//! transport drives it with its connection's datagram counter and a tokio timer
//! (`transport/quic/heartbeat.rs`); the simulator drives the same code with simulated
//! keep-alives on its virtual clock, so its detection times are the real detector's.
//!
//! Two channels of liveness:
//! - **Silence.** Every side of a connection sends a keep-alive every `interval`, answered by
//!   the peer's network stack. A peer silent for longer than
//!   [`LatencyTracker::silence_limit`] (two intervals and the larger of a floor and 1.3 x the
//!   mean RTT) is lost: killed, frozen, or cut off. Checked every `interval / 4` (at least
//!   every 20 ms), so a dead peer is found within 3 intervals of its last packet.
//! - **Progress.** This side reports its own progress ([`Progress`]) when it changed, and at
//!   least every `interval`; the [`ProgressWatch`] decides whether a peer that keeps
//!   answering holds this rank in an operation it never starts (stalled).

use super::latency::{LatencyConfig, LatencyTracker};
use super::progress::{Progress, ProgressWatch, Stall};
use std::time::{Duration, Instant};

/// The fastest a monitor checks its peer.
const MIN_TICK: Duration = Duration::from_millis(20);
/// Progress reports a peer may miss before it no longer counts as reachable.
const REPORTS_MISSED: u32 = 3;

/// What the driver of a [`PeerMonitor`] must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Send this report of the rank's own progress to the peer, then call
    /// [`PeerMonitor::report_sent`] with whether it went out.
    Report(Progress),
    /// The peer answers but holds this rank in an operation it does not start: fail every
    /// wait on it (`PeerStalled`). The monitor has ended.
    Stalled(Stall),
    /// The peer fell silent: fail every wait on it (`PeerLost`) and close the connection.
    /// The monitor has ended.
    Silent {
        /// How long nothing came.
        silent: Duration,
        /// The limit it passed.
        limit: Duration,
    },
}

/// The failure detector of one connection (see the module documentation).
#[derive(Debug, Clone)]
pub struct PeerMonitor {
    peer: usize,
    interval: Duration,
    tick: Duration,
    tracker: LatencyTracker,
    last_seen: Instant,
    next_tick: Instant,
    /// The last report the peer has, and when it was sent.
    reported: Option<(Progress, Instant)>,
    /// The report on its way, and when it was sent.
    sending: Option<(Progress, Instant)>,
    ended: bool,
}

impl PeerMonitor {
    /// A monitor of `peer` with keep-alives every `interval`, started `now` (the connection
    /// counts as heard from at its start).
    pub fn new(peer: usize, interval: Duration, now: Instant) -> PeerMonitor {
        // A short interval asks for fast detection: the 1 s floor of the reply timeout
        // would otherwise dominate it.
        let cfg = LatencyConfig {
            heartbeat_floor: (interval / 4).min(Duration::from_secs(1)),
            ..LatencyConfig::default()
        };
        let tick = (interval / 4).max(MIN_TICK);
        PeerMonitor {
            peer,
            interval,
            tick,
            tracker: LatencyTracker::new(cfg),
            last_seen: now,
            next_tick: now + tick,
            reported: None,
            sending: None,
            ended: false,
        }
    }

    /// The peer this monitor watches.
    pub fn peer(&self) -> usize {
        self.peer
    }

    /// The keep-alive interval.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// How often the monitor checks.
    pub fn tick(&self) -> Duration {
        self.tick
    }

    /// The round-trip statistics the limit is derived from.
    pub fn tracker(&self) -> &LatencyTracker {
        &self.tracker
    }

    /// Packets from the peer arrived by `now` (of any kind: keep-alives, acknowledgements,
    /// data); `rtt` is the connection's round-trip estimate.
    pub fn on_heard(&mut self, rtt: Duration, now: Instant) {
        self.last_seen = self.last_seen.max(now);
        self.tracker.record(rtt);
    }

    /// The report of the last [`Action::Report`] went out (`ok`) or failed to.
    pub fn report_sent(&mut self, ok: bool) {
        if let Some(r) = self.sending.take() {
            if ok {
                self.reported = Some(r);
            }
        }
    }

    /// The silence after which the peer is lost, as of now.
    pub fn silence_limit(&self) -> Duration {
        self.tracker.silence_limit(self.interval)
    }

    /// How long the peer has been silent at `now`.
    pub fn silent_for(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.last_seen)
    }

    /// Whether the monitor has ended (it declared the peer stalled or silent).
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// When [`PeerMonitor::handle_timeout`] is next due; `None` once the monitor ended.
    pub fn poll_timeout(&self) -> Option<Instant> {
        (!self.ended).then_some(self.next_tick)
    }

    /// Checks the peer at `now`: `watch` holds this rank's own progress and the peer's last
    /// report. Returns what to do, in order; an [`Action::Stalled`] or [`Action::Silent`]
    /// ends the monitor.
    pub fn handle_timeout(&mut self, now: Instant, watch: &ProgressWatch) -> Vec<Action> {
        let mut out = Vec::new();
        if self.ended {
            return out;
        }
        self.next_tick = now + self.tick;
        let mine = watch.local();
        let due = self.sending.is_none()
            && match self.reported {
                None => true,
                Some((r, at)) => r != mine || now.saturating_duration_since(at) >= self.interval,
            };
        if due {
            self.sending = Some((mine, now));
            out.push(Action::Report(mine));
        }
        // Reports come at least every interval: missing three is no longer "reachable".
        if let Some(s) = watch.check(self.peer, now, REPORTS_MISSED * self.interval) {
            self.ended = true;
            out.push(Action::Stalled(s));
            return out;
        }
        let limit = self.silence_limit();
        let silent = self.silent_for(now);
        if silent > limit {
            self.ended = true;
            out.push(Action::Silent { silent, limit });
        }
        out
    }

    /// Why a peer that passed `limit` after `silent` was declared lost, for its error.
    pub fn silence_reason(&self, silent: Duration, limit: Duration) -> String {
        let cfg = self.tracker.config();
        format!(
            "no packets for {:.2} s (heartbeat every {:.2} s; limit {:.2} s = {} missed + max({:.2} s, 1.3 x mean RTT))",
            silent.as_secs_f64(),
            self.interval.as_secs_f64(),
            limit.as_secs_f64(),
            cfg.misses_allowed,
            cfg.heartbeat_floor.as_secs_f64(),
        )
    }

    /// Why a peer was declared stalled, as `(operation, reason)` for its error.
    pub fn stall_reason(s: &Stall) -> (String, String) {
        let op = format!(
            "operation #{} of the group, which it has not started ({} started, {} finished)",
            s.waiting_in, s.report.started, s.report.finished
        );
        let reason = format!(
            "it answers heartbeats, but its progress has not moved for {:.1} s while this rank waits for it (limit {:.1} s = max(stall_timeout, 10 x p99 of the intervals between operations); raise stall_timeout / MCP_STALL_TIMEOUT if it may compute that long between collectives)",
            s.unchanged_for.as_secs_f64(),
            s.limit.as_secs_f64(),
        );
        (op, reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn watch() -> ProgressWatch {
        ProgressWatch::new(2, Duration::from_secs(30), 10)
    }

    /// Drives `m` tick by tick from `t0` until `until`, feeding a packet at every instant of
    /// `heard`, and returns every action with its time.
    fn run(
        m: &mut PeerMonitor,
        w: &ProgressWatch,
        t0: Instant,
        heard: &[Duration],
        until: Duration,
    ) -> Vec<(Duration, Action)> {
        let mut out = Vec::new();
        let mut heard = heard.iter().peekable();
        while let Some(at) = m.poll_timeout() {
            if at > t0 + until {
                break;
            }
            while let Some(&&h) = heard.peek() {
                if t0 + h > at {
                    break;
                }
                m.on_heard(2 * MS, t0 + h);
                heard.next();
            }
            for a in m.handle_timeout(at, w) {
                if matches!(a, Action::Report(_)) {
                    m.report_sent(true);
                }
                out.push((at - t0, a));
            }
        }
        out
    }

    #[test]
    fn a_peer_that_keeps_answering_is_never_lost() {
        let t0 = Instant::now();
        let interval = 100 * MS;
        let mut m = PeerMonitor::new(1, interval, t0);
        let beats: Vec<Duration> = (1..=100).map(|i| i * interval).collect();
        let acts = run(&mut m, &watch(), t0, &beats, Duration::from_secs(10));
        assert!(acts.iter().all(|(_, a)| matches!(a, Action::Report(_))));
        assert!(!m.ended());
        // One report per interval while nothing changes (the first at the first check).
        let reports = acts.len();
        assert!((99..=102).contains(&reports), "{reports} reports");
    }

    #[test]
    fn a_silent_peer_is_lost_at_the_first_check_past_the_limit() {
        let t0 = Instant::now();
        let interval = 100 * MS;
        let mut m = PeerMonitor::new(1, interval, t0);
        // Heard every interval until 1 s, then nothing.
        let beats: Vec<Duration> = (1..=10).map(|i| i * interval).collect();
        let acts = run(&mut m, &watch(), t0, &beats, Duration::from_secs(10));
        let (at, last) = acts.last().cloned().expect("an action");
        let Action::Silent { silent, limit } = last else {
            panic!("ended with {last:?}");
        };
        // Limit: 2 intervals + max(interval / 4, 1.3 x 2 ms) = 225 ms.
        assert_eq!(limit, 225 * MS);
        assert!(silent > limit && silent <= limit + m.tick(), "{silent:?}");
        assert_eq!(at, Duration::from_secs(1) + silent);
        assert!(m.ended() && m.poll_timeout().is_none());
        assert!(m.handle_timeout(t0 + 20 * interval, &watch()).is_empty());
        let why = m.silence_reason(silent, limit);
        assert!(why.contains("heartbeat every 0.10 s"), "{why}");
    }

    #[test]
    fn a_report_goes_when_progress_changes_and_not_twice_while_one_is_on_its_way() {
        let t0 = Instant::now();
        let mut w = watch();
        let mut m = PeerMonitor::new(1, Duration::from_secs(1), t0);
        let first = m.handle_timeout(t0 + 250 * MS, &w);
        assert_eq!(first, vec![Action::Report(Progress::default())]);
        w.op_started(0, t0 + 300 * MS);
        // The first report has not gone out yet: no second one.
        m.on_heard(MS, t0 + 400 * MS);
        assert!(m.handle_timeout(t0 + 500 * MS, &w).is_empty());
        m.report_sent(true);
        let next = m.handle_timeout(t0 + 750 * MS, &w);
        let want = Progress {
            started: 1,
            finished: 0,
        };
        assert_eq!(next, vec![Action::Report(want)]);
        // A failed send is tried again at the next check.
        m.report_sent(false);
        m.on_heard(MS, t0 + 900 * MS);
        assert_eq!(
            m.handle_timeout(t0 + 1000 * MS, &w),
            vec![Action::Report(want)]
        );
    }

    #[test]
    fn a_peer_that_answers_but_never_starts_the_operation_is_stalled() {
        let t0 = Instant::now();
        let interval = 100 * MS;
        let mut w = ProgressWatch::new(2, Duration::from_secs(1), 10);
        let mut m = PeerMonitor::new(1, interval, t0);
        w.op_started(0, t0);
        let mut t = Duration::ZERO;
        let stall = loop {
            t += m.tick();
            assert!(t < Duration::from_secs(5), "never stalled");
            // The peer keeps answering and reporting that it has started nothing.
            m.on_heard(2 * MS, t0 + t);
            w.on_report(1, Progress::default(), t0 + t);
            let acts = m.handle_timeout(t0 + t, &w);
            if matches!(acts.first(), Some(Action::Report(_))) {
                m.report_sent(true);
            }
            if let Some(Action::Stalled(s)) = acts.last() {
                break s.clone();
            }
        };
        assert_eq!((stall.peer, stall.waiting_in), (1, 0));
        assert!(t >= Duration::from_secs(1), "stalled after {t:?}");
        assert!(m.ended());
        let (op, why) = PeerMonitor::stall_reason(&stall);
        assert!(op.contains("operation #0"), "{op}");
        assert!(why.contains("stall_timeout"), "{why}");
    }
}
