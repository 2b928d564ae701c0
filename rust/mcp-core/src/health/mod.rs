//! Health of peers and of training steps, sans-IO: nothing here sleeps, reads a clock or
//! touches a socket. Callers pass the current [`std::time::Instant`] or the measured
//! [`std::time::Duration`] in, so every state machine is tested with a fake clock.
//!
//! - [`breaker`]: a per-peer circuit breaker (closed → open → half-open).
//! - [`detector`]: the failure detector of one connection (silence and progress), driven by
//!   the QUIC transport and by the simulator alike.
//! - [`latency`]: round-trip statistics (EWMA mean, windowed p99) and the timeouts derived
//!   from them.
//! - [`progress`]: the progress watchdog (a peer that answers heartbeats but does not move).
//! - [`guard`]: the global L2 norm of gradients, non-finite detection, clipping, and a
//!   breaker over consecutive bad steps.

pub mod breaker;
pub mod detector;
pub mod guard;
pub mod latency;
pub mod progress;

pub use breaker::{BreakerConfig, BreakerState, CircuitBreaker, PeerBreakers};
pub use detector::{Action, PeerMonitor};
pub use guard::{GradNorm, GradientGuard, GuardConfig, GuardPolicy, NormAccumulator, Verdict};
pub use latency::{LatencyConfig, LatencyTracker};
pub use progress::{Progress, ProgressWatch, Stall};
