//! A congestion controller that does not mistake random loss for congestion.
//!
//! Loss-based controllers (quinn's default, Cubic) shrink the window by 30 % at every loss
//! event; at 20 % random loss there is one every round trip, and the window sits at its floor.
//! This one, like BBR, sizes the window from what the path delivers: `gain × delivery rate ×
//! round-trip time`, never below a floor, and grows it exponentially while no queue builds.
//! The window is also bounded by `delivery rate × (minimum RTT + target queue)`, so that what
//! it keeps in flight beyond the path's own capacity is a short queue at the bottleneck, not
//! the bottleneck's whole buffer: the smoothed RTT includes the queue the window itself built,
//! and a window sized from it alone grows with that queue until the buffer overflows (on a
//! 200 Mbit/s, 50 ms path with a 50 ms router queue it dropped 15 % of the packets of a clean
//! transfer). A loss counts as congestion only when the smoothed RTT has risen well above the
//! minimum RTT (a queue is building at a bottleneck, and a full queue is what drops): then the
//! window backs off multiplicatively, once per round trip. A rate-capped link therefore still
//! pushes it back, while random drops on an empty path leave it alone.
//!
//! The logic is [`LossTolerantState`], free of clocks and sockets (every input is an
//! argument), so that it is unit-tested as it is; [`LossTolerant`] adapts it to quinn's
//! [`quinn::congestion::Controller`], and [`LossTolerantConfig`] is the factory.

use quinn::congestion::{Controller, ControllerFactory, ControllerMetrics};
use quinn_proto::RttEstimator;
use std::any::Any;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Which congestion controller our connections use (`MCP_CC`: `cubic` or `loss-tolerant`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CongestionKind {
    /// quinn's default, Cubic: every loss event shrinks the window.
    Cubic,
    /// [`LossTolerant`]: delivery-rate based, backs off only when a queue builds.
    #[default]
    LossTolerant,
}

impl CongestionKind {
    /// Parses `cubic` or `loss-tolerant` (also `lt`, `bbr-like`).
    pub fn parse(s: &str) -> Option<CongestionKind> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cubic" => Some(CongestionKind::Cubic),
            "loss-tolerant" | "loss_tolerant" | "lt" | "bbr-like" => {
                Some(CongestionKind::LossTolerant)
            }
            _ => None,
        }
    }

    /// The kind `MCP_CC` names, or the default when unset or unknown.
    pub fn from_env() -> CongestionKind {
        std::env::var("MCP_CC")
            .ok()
            .and_then(|v| CongestionKind::parse(&v))
            .unwrap_or_default()
    }
}

/// Settings of the loss-tolerant controller; also its [`ControllerFactory`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossTolerantConfig {
    /// Window before anything is measured, in bytes.
    pub initial_window: u64,
    /// Smallest window, in packets of the current MTU.
    pub min_window_packets: u64,
    /// Largest window in bytes.
    pub max_window: u64,
    /// Window = `gain × delivery rate × RTT` once out of start-up.
    pub gain: f64,
    /// A queue is building when the smoothed RTT exceeds the minimum RTT by more than
    /// `max(queue_ratio × min RTT, queue_floor)`.
    pub queue_ratio: f64,
    /// See `queue_ratio`.
    pub queue_floor: Duration,
    /// The queue the window may keep at the bottleneck once out of start-up:
    /// `max(target_queue_ratio × min RTT, target_queue_floor)`. Below the queue that counts as
    /// building (`queue_ratio`, `queue_floor`), so that random losses at the target are still
    /// ignored.
    pub target_queue_ratio: f64,
    /// See `target_queue_ratio`.
    pub target_queue_floor: Duration,
    /// Factor applied to the window at a loss while a queue is building.
    pub backoff: f64,
    /// Round trips that the delivery-rate maximum is kept over.
    pub bw_rounds: usize,
}

impl Default for LossTolerantConfig {
    fn default() -> Self {
        LossTolerantConfig {
            initial_window: 64 * 1200,
            min_window_packets: 8,
            max_window: 256 << 20,
            gain: 2.0,
            queue_ratio: 0.5,
            queue_floor: Duration::from_millis(4),
            target_queue_ratio: 0.25,
            target_queue_floor: Duration::from_millis(2),
            backoff: 0.7,
            bw_rounds: 10,
        }
    }
}

impl ControllerFactory for LossTolerantConfig {
    fn build(self: Arc<Self>, now: Instant, current_mtu: u16) -> Box<dyn Controller> {
        Box::new(LossTolerant {
            state: LossTolerantState::new(*self, now, current_mtu),
            last_rtt: (Duration::ZERO, Duration::ZERO),
        })
    }
}

/// The controller's state and logic, driven with explicit times and RTTs.
#[derive(Debug, Clone)]
pub struct LossTolerantState {
    cfg: LossTolerantConfig,
    mtu: u64,
    window: u64,
    startup: bool,
    /// Best delivery rate (bytes/s) seen at the start-up check, and checks since it grew.
    full_bw: f64,
    full_bw_checks: u32,
    /// Delivery-rate samples (bytes/s) of the last rounds; the window uses their maximum.
    bw_samples: Vec<f64>,
    round_start: Instant,
    round_bytes: u64,
    round_app_limited: bool,
    /// Packets sent before this instant belong to a loss event already answered.
    recovery_start: Option<Instant>,
    backoffs: u64,
    ignored_losses: u64,
}

impl LossTolerantState {
    /// A fresh controller at `now` on a path of `mtu` bytes.
    pub fn new(cfg: LossTolerantConfig, now: Instant, mtu: u16) -> LossTolerantState {
        let mut s = LossTolerantState {
            cfg,
            mtu: u64::from(mtu).max(1),
            window: cfg.initial_window,
            startup: true,
            full_bw: 0.0,
            full_bw_checks: 0,
            bw_samples: Vec::with_capacity(cfg.bw_rounds.max(1)),
            round_start: now,
            round_bytes: 0,
            round_app_limited: false,
            recovery_start: None,
            backoffs: 0,
            ignored_losses: 0,
        };
        s.window = s.clamp(s.window);
        s
    }

    fn min_window(&self) -> u64 {
        self.cfg.min_window_packets.max(2) * self.mtu
    }

    fn clamp(&self, w: u64) -> u64 {
        w.clamp(
            self.min_window(),
            self.cfg.max_window.max(self.min_window()),
        )
    }

    /// The congestion window in bytes.
    pub fn window(&self) -> u64 {
        self.window
    }

    /// Whether the controller is still in start-up (growing exponentially).
    pub fn in_startup(&self) -> bool {
        self.startup
    }

    /// The windowed maximum delivery rate in bytes per second (0 before the first round).
    pub fn bandwidth(&self) -> f64 {
        self.bw_samples.iter().copied().fold(0.0, f64::max)
    }

    /// Loss events that backed the window off (a queue was building).
    pub fn backoffs(&self) -> u64 {
        self.backoffs
    }

    /// Loss events ignored as random loss (no queue).
    pub fn ignored_losses(&self) -> u64 {
        self.ignored_losses
    }

    /// Whether `srtt` says a queue is building over a path whose minimum RTT is `min_rtt`.
    pub fn queue_building(&self, srtt: Duration, min_rtt: Duration) -> bool {
        let slack = min_rtt
            .mul_f64(self.cfg.queue_ratio.max(0.0))
            .max(self.cfg.queue_floor);
        srtt > min_rtt + slack
    }

    /// The queue the window may keep at the bottleneck on a path of minimum RTT `min_rtt`.
    pub fn target_queue(&self, min_rtt: Duration) -> Duration {
        min_rtt
            .mul_f64(self.cfg.target_queue_ratio.max(0.0))
            .max(self.cfg.target_queue_floor)
    }

    /// `bytes` sent at `sent` were acknowledged at `now`.
    pub fn on_ack(
        &mut self,
        now: Instant,
        sent: Instant,
        bytes: u64,
        app_limited: bool,
        srtt: Duration,
        min_rtt: Duration,
    ) {
        self.round_bytes += bytes;
        self.round_app_limited |= app_limited;
        let queue = self.queue_building(srtt, min_rtt);
        if self.startup && !app_limited && !queue {
            self.window = self.clamp(self.window.saturating_add(bytes));
        }
        // A round lasts one smoothed RTT (at least 100 µs, so that loopback's tiny RTTs still
        // give meaningful samples).
        let round = srtt.max(min_rtt).max(Duration::from_micros(100));
        let elapsed = now.saturating_duration_since(self.round_start);
        if elapsed >= round {
            let sample = self.round_bytes as f64 / elapsed.as_secs_f64();
            // An app-limited round under-reports the path: keep it only if it is a new best.
            if !self.round_app_limited || sample > self.bandwidth() {
                if self.bw_samples.len() >= self.cfg.bw_rounds.max(1) {
                    self.bw_samples.remove(0);
                }
                self.bw_samples.push(sample);
            }
            self.round_start = now;
            self.round_bytes = 0;
            self.round_app_limited = false;
            self.end_of_round(srtt, min_rtt, queue);
        }
        if let Some(r) = self.recovery_start {
            if sent > r {
                self.recovery_start = None;
            }
        }
    }

    fn end_of_round(&mut self, srtt: Duration, min_rtt: Duration, queue: bool) {
        let bw = self.bandwidth();
        if self.startup {
            // Out of start-up once the delivery rate stopped growing by 25 % for three
            // rounds, or a queue builds.
            if bw > self.full_bw * 1.25 {
                self.full_bw = bw;
                self.full_bw_checks = 0;
            } else {
                self.full_bw_checks += 1;
            }
            if self.full_bw_checks >= 3 || queue {
                self.startup = false;
            }
        }
        if !self.startup && bw > 0.0 {
            // quinn paces at window / smoothed RTT, so the window is sized from the smoothed
            // RTT. With a gain above 1 a window-limited path still shows a growing delivery
            // rate, so the window keeps probing upwards. It never holds more than the path's
            // capacity plus the target queue: beyond that the extra only lengthens the
            // bottleneck's queue (and the smoothed RTT, and so the first bound) until it
            // overflows. The target is at least a couple of milliseconds, so that on loopback,
            // where the "queue" is often the peer's scheduler, the pacer is not starved.
            let by_srtt = self.cfg.gain * bw * srtt.max(min_rtt).as_secs_f64();
            let by_queue = bw * (min_rtt + self.target_queue(min_rtt)).as_secs_f64();
            let target = if queue {
                // A queue stands: never grow (only a loss shrinks the window), but drain a
                // queue longer than the target.
                (self.window as f64).min(by_queue)
            } else {
                by_srtt.min(by_queue)
            };
            self.window = self.clamp(target as u64);
        }
    }

    /// Packets sent at `sent` were declared lost at `now` (`persistent`: everything sent for a
    /// long period was lost).
    pub fn on_congestion_event(
        &mut self,
        now: Instant,
        sent: Instant,
        persistent: bool,
        srtt: Duration,
        min_rtt: Duration,
    ) {
        if persistent {
            self.window = self.min_window();
            self.startup = false;
            self.recovery_start = Some(now);
            self.backoffs += 1;
            return;
        }
        if !self.queue_building(srtt, min_rtt) {
            self.ignored_losses += 1;
            return;
        }
        if self.recovery_start.is_some_and(|r| sent <= r) {
            return; // the same loss event: answered already
        }
        self.startup = false;
        self.recovery_start = Some(now);
        self.backoffs += 1;
        self.window = self.clamp((self.window as f64 * self.cfg.backoff) as u64);
    }

    /// The path's MTU changed.
    pub fn on_mtu_update(&mut self, mtu: u16) {
        self.mtu = u64::from(mtu).max(1);
        self.window = self.clamp(self.window);
    }
}

/// The loss-tolerant controller as quinn sees it.
#[derive(Debug, Clone)]
pub struct LossTolerant {
    state: LossTolerantState,
    /// (smoothed, minimum) RTT at the last ACK: quinn gives no RTT with a loss.
    last_rtt: (Duration, Duration),
}

impl LossTolerant {
    /// Its state (for diagnostics).
    pub fn state(&self) -> &LossTolerantState {
        &self.state
    }
}

impl Controller for LossTolerant {
    fn on_ack(
        &mut self,
        now: Instant,
        sent: Instant,
        bytes: u64,
        app_limited: bool,
        rtt: &RttEstimator,
    ) {
        self.last_rtt = (rtt.get(), rtt.min());
        self.state
            .on_ack(now, sent, bytes, app_limited, rtt.get(), rtt.min());
    }

    fn on_congestion_event(
        &mut self,
        now: Instant,
        sent: Instant,
        is_persistent_congestion: bool,
        _lost_bytes: u64,
    ) {
        let (srtt, min_rtt) = self.last_rtt;
        self.state
            .on_congestion_event(now, sent, is_persistent_congestion, srtt, min_rtt);
    }

    fn on_mtu_update(&mut self, new_mtu: u16) {
        self.state.on_mtu_update(new_mtu);
    }

    fn window(&self) -> u64 {
        self.state.window()
    }

    fn metrics(&self) -> ControllerMetrics {
        let mut m = ControllerMetrics::default();
        m.congestion_window = self.state.window();
        m
    }

    fn clone_box(&self) -> Box<dyn Controller> {
        Box::new(self.clone())
    }

    fn initial_window(&self) -> u64 {
        self.state.cfg.initial_window
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MTU: u16 = 1200;
    const MS: Duration = Duration::from_millis(1);

    /// Feeds `rounds` rounds of 10 ms RTT in which `bytes_per_ms` are acknowledged each
    /// millisecond, calling `each` after every ACK with (state, now, packet sent time).
    fn drive(
        s: &mut LossTolerantState,
        t: &mut Instant,
        rounds: u32,
        bytes_per_ms: u64,
        srtt: Duration,
        mut each: impl FnMut(&mut LossTolerantState, Instant, Instant),
    ) {
        let min_rtt = 10 * MS;
        for _ in 0..rounds * 10 {
            *t += MS;
            let sent = *t - srtt;
            s.on_ack(*t, sent, bytes_per_ms, false, srtt, min_rtt);
            each(s, *t, sent);
        }
    }

    #[test]
    fn random_loss_on_an_empty_path_leaves_the_window_alone() {
        let t0 = Instant::now();
        let mut t = t0;
        let mut s = LossTolerantState::new(LossTolerantConfig::default(), t0, MTU);
        // 12.5 MB/s (100 Mbit/s) delivered, RTT at its minimum: no queue.
        drive(&mut s, &mut t, 30, 12_500, 10 * MS, |_, _, _| {});
        assert!(!s.in_startup(), "start-up must end on a flat delivery rate");
        let settled = s.window();
        // The path's capacity plus the target queue: 12.5 MB/s x (10 ms + 2.5 ms) = 156 kB
        // (below gain 2 x 12.5 MB/s x 10 ms = 250 kB).
        assert!((140_000..=170_000).contains(&settled), "window {settled}");
        // Now one in five ACK batches comes with a loss event: random loss.
        let mut i = 0u32;
        drive(&mut s, &mut t, 30, 12_500, 10 * MS, |s, now, sent| {
            i += 1;
            if i.is_multiple_of(5) {
                s.on_congestion_event(now, sent, false, 10 * MS, 10 * MS);
                assert!(s.window() >= settled * 9 / 10, "window {}", s.window());
            }
        });
        assert_eq!(s.backoffs(), 0);
        assert_eq!(s.ignored_losses(), 60);
        assert!(s.window() >= settled * 9 / 10);
    }

    #[test]
    fn the_window_does_not_grow_with_the_queue_it_builds() {
        // A 200 Mbit/s path of 50 ms whose bottleneck buffers 50 ms: the smoothed RTT rises
        // with the queue the window keeps there. Sized from the smoothed RTT alone, the
        // window would grow with it until the buffer overflowed.
        let t0 = Instant::now();
        let mut t = t0;
        let mut s = LossTolerantState::new(LossTolerantConfig::default(), t0, MTU);
        let min_rtt = 50 * MS;
        let bdp = 25_000_000.0 * 0.05;
        for _ in 0..3000 {
            t += MS;
            // What is in flight beyond the path's capacity waits in the queue, up to 50 ms.
            let queue = ((s.window() as f64 - bdp).max(0.0) / 25e6).min(0.05);
            let srtt = min_rtt + Duration::from_secs_f64(queue);
            s.on_ack(t, t - srtt, 25_000, false, srtt, min_rtt);
        }
        assert!(!s.in_startup());
        // 25 MB/s x (50 ms + 12.5 ms): a queue of a quarter of the round trip.
        let w = s.window() as f64;
        assert!(
            (0.95 * 25e6 * 0.0625..=1.05 * 25e6 * 0.0625).contains(&w),
            "window {w}"
        );
        assert_eq!(s.target_queue(min_rtt), Duration::from_micros(12_500));
        // On a path of microseconds the target is the floor, not a fraction of nothing.
        assert_eq!(s.target_queue(Duration::from_micros(30)), 2 * MS);
    }

    #[test]
    fn a_loss_while_a_queue_builds_backs_off_once_per_event() {
        let t0 = Instant::now();
        let mut t = t0;
        let mut s = LossTolerantState::new(LossTolerantConfig::default(), t0, MTU);
        drive(&mut s, &mut t, 30, 12_500, 10 * MS, |_, _, _| {});
        let before = s.window();
        // The queue: smoothed RTT 30 ms over a 10 ms minimum (slack is max(5 ms, 4 ms)).
        let queued = 30 * MS;
        assert!(s.queue_building(queued, 10 * MS));
        assert!(!s.queue_building(14 * MS, 10 * MS));
        t += MS;
        let sent = t - queued;
        s.on_congestion_event(t, sent, false, queued, 10 * MS);
        assert_eq!(s.window(), (before as f64 * 0.7) as u64);
        // More losses of packets sent before the back-off are the same event.
        s.on_congestion_event(t + MS, sent + MS, false, queued, 10 * MS);
        assert_eq!(s.backoffs(), 1);
        // A packet sent after the back-off and acknowledged ends the recovery; a later loss
        // while the queue still stands backs off again.
        s.on_ack(t + 40 * MS, t + 2 * MS, 1200, false, queued, 10 * MS);
        s.on_congestion_event(t + 41 * MS, t + 39 * MS, false, queued, 10 * MS);
        assert_eq!(s.backoffs(), 2);
        assert!(s.window() < before / 2 + 1);
        // Persistent congestion: the floor.
        s.on_congestion_event(t + 50 * MS, t + 45 * MS, true, queued, 10 * MS);
        assert_eq!(s.window(), 8 * u64::from(MTU));
    }

    #[test]
    fn start_up_grows_exponentially_and_stops_at_a_queue() {
        let t0 = Instant::now();
        let mut s = LossTolerantState::new(LossTolerantConfig::default(), t0, MTU);
        let w0 = s.window();
        s.on_ack(t0 + MS, t0, w0, false, 10 * MS, 10 * MS);
        assert_eq!(
            s.window(),
            2 * w0,
            "start-up doubles per window acknowledged"
        );
        // App-limited ACKs do not grow it; neither do ACKs while a queue stands.
        s.on_ack(t0 + 2 * MS, t0, w0, true, 10 * MS, 10 * MS);
        s.on_ack(t0 + 3 * MS, t0, w0, false, 40 * MS, 10 * MS);
        assert_eq!(s.window(), 2 * w0);
        assert!(s.in_startup());
        // The round (40 ms) ends with the queue: start-up is over.
        s.on_ack(t0 + 50 * MS, t0, w0, false, 40 * MS, 10 * MS);
        assert!(!s.in_startup());
        assert!(s.bandwidth() > 0.0);
    }

    #[test]
    fn window_bounds_follow_the_mtu() {
        let t0 = Instant::now();
        let cfg = LossTolerantConfig {
            max_window: 1 << 20,
            ..LossTolerantConfig::default()
        };
        let mut s = LossTolerantState::new(cfg, t0, MTU);
        for i in 0..100u32 {
            s.on_ack(t0 + MS * i, t0, 1 << 20, false, 10 * MS, 10 * MS);
        }
        assert_eq!(s.window(), 1 << 20);
        s.on_congestion_event(t0, t0, true, 10 * MS, 10 * MS);
        s.on_mtu_update(9000);
        assert_eq!(s.window(), 8 * 9000);
        assert_eq!(CongestionKind::parse("Cubic"), Some(CongestionKind::Cubic));
        assert_eq!(
            CongestionKind::parse("loss-tolerant"),
            Some(CongestionKind::LossTolerant)
        );
        assert_eq!(CongestionKind::parse("reno"), None);
    }
}
