//! Heartbeats and the failure detector.
//!
//! Every connection sends a QUIC PING every `interval` (quinn's keep-alive), which the peer's
//! QUIC stack answers with an ACK from its own threads: a compute stall or a held GIL on the
//! peer does not silence it, a killed, frozen (SIGSTOP) or cut-off peer does. A monitor task
//! per connection watches the received-datagram counter and the RTT; a peer silent for
//! longer than `2 × interval + max(min(1 s, interval / 4), 1.3 × mean RTT)` (see
//! [`crate::health::LatencyTracker::silence_limit`]) is declared lost: every wait on it fails
//! with `PeerLost` at once, on this rank; the collectives then abort on the others. Checked
//! every `interval / 4`, so a dead peer is found within 3 intervals of its last packet
//! (while the mean RTT stays below about a third of the interval).
//!
//! The same task carries the second channel of liveness: it sends this rank's progress
//! (collective operations started and finished) when it changed, at most every
//! `interval / 4`, and at least every `interval`, and asks the progress watchdog
//! ([`crate::health::ProgressWatch`]) whether the peer, reachable, keeps this rank waiting
//! in an operation it never starts: then every wait on it fails with `PeerStalled`.

use super::{close_code, rendezvous, QuicTransport};
use crate::error::Error;
use crate::health::{LatencyConfig, LatencyTracker};
use quinn::{Connection, VarInt};
use std::sync::atomic::Ordering;
use std::sync::Weak;
use std::time::{Duration, Instant};

/// What this rank knows of one peer's health.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerHealth {
    /// The peer's rank.
    pub rank: usize,
    /// `"connected"`, `"not connected"` (no operation needed it yet) or `"lost"`.
    pub state: &'static str,
    /// Smoothed round-trip time, when connected.
    pub rtt: Option<Duration>,
    /// Time since the last datagram from the peer, when connected.
    pub last_seen: Option<Duration>,
    /// The silence after which the peer will be declared lost.
    pub silence_limit: Option<Duration>,
    /// Why the peer was declared lost.
    pub reason: Option<String>,
    /// QUIC's own figures of the path, when connected: the loss a real link has (the fault
    /// injector's drops are counted apart).
    pub path: Option<PathFigures>,
}

/// QUIC's view of the path to one peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathFigures {
    /// Packets sent on the connection.
    pub sent_packets: u64,
    /// Packets QUIC declared lost (and so retransmitted what they carried).
    pub lost_packets: u64,
    /// Bytes in the packets declared lost.
    pub lost_bytes: u64,
    /// Congestion events (the controller backed off).
    pub congestion_events: u64,
    /// The congestion window, bytes.
    pub cwnd: u64,
    /// The path MTU in use, bytes.
    pub mtu: u16,
}

impl PathFigures {
    /// The figures of a connection's path now.
    pub fn of(conn: &Connection) -> PathFigures {
        let p = conn.stats().path;
        PathFigures {
            sent_packets: p.sent_packets,
            lost_packets: p.lost_packets,
            lost_bytes: p.lost_bytes,
            congestion_events: p.congestion_events,
            cwnd: p.cwnd,
            mtu: p.current_mtu,
        }
    }
}

/// Watches one connection until it closes or its peer falls silent.
pub(super) async fn monitor(
    me: Weak<QuicTransport>,
    peer: usize,
    conn: Connection,
    interval: Duration,
) {
    // A short interval asks for fast detection: the 1 s floor of the reply timeout would
    // otherwise dominate it.
    let cfg = LatencyConfig {
        heartbeat_floor: (interval / 4).min(Duration::from_secs(1)),
        ..LatencyConfig::default()
    };
    let mut tracker = LatencyTracker::new(cfg);
    let mut last_rx = conn.stats().udp_rx.datagrams;
    let mut last_seen = Instant::now();
    let tick = (interval / 4).max(Duration::from_millis(20));
    let mut reported: Option<(crate::health::Progress, Instant)> = None;
    // A report on its way, in a task of its own: cancelling a write half-way would leave the
    // peer a truncated frame.
    let mut sending: Option<(
        crate::health::Progress,
        Instant,
        tokio::task::JoinHandle<bool>,
    )> = None;
    loop {
        tokio::time::sleep(tick).await;
        if conn.close_reason().is_some() {
            return;
        }
        let Some(t) = me.upgrade() else { return };
        if t.closing.load(Ordering::Acquire) {
            return;
        }
        let now = Instant::now();
        if sending.as_ref().is_some_and(|(_, _, h)| h.is_finished()) {
            if let Some((r, at, h)) = sending.take() {
                if matches!(h.await, Ok(true)) {
                    reported = Some((r, at));
                }
            }
        }
        let mine = t.progress_watch().local();
        let due = sending.is_none()
            && match reported {
                None => true,
                Some((r, at)) => r != mine || now.duration_since(at) >= interval,
            };
        if due {
            let payload = mine.to_bytes();
            let header = rendezvous::progress_header(&t, &payload);
            let (me, conn) = (me.clone(), conn.clone());
            let h = tokio::spawn(async move {
                let Some(t) = me.upgrade() else { return false };
                t.write_frame(peer, &conn, &header, &payload).await.is_ok()
            });
            sending = Some((mine, now, h));
        }
        // Reports come at least every interval: three missed ones is no longer "reachable".
        let stall = t.progress_watch().check(peer, now, 3 * interval);
        if let Some(s) = stall {
            let op = format!(
                "operation #{} of the group, which it has not started ({} started, {} finished)",
                s.waiting_in, s.report.started, s.report.finished
            );
            let err = Error::PeerStalled {
                rank: peer,
                op,
                reason: format!(
                    "it answers heartbeats, but its progress has not moved for {:.1} s while this rank waits for it (limit {:.1} s = max(stall_timeout, 10 x p99 of the intervals between operations); raise stall_timeout / MCP_STALL_TIMEOUT if it may compute that long between collectives)",
                    s.unchanged_for.as_secs_f64(),
                    s.limit.as_secs_f64(),
                ),
            };
            t.mailbox.fail_peer(peer, err);
            return;
        }
        let rx = conn.stats().udp_rx.datagrams;
        if rx != last_rx {
            last_rx = rx;
            last_seen = Instant::now();
            tracker.record(conn.rtt());
        }
        let limit = tracker.silence_limit(interval);
        let silent = last_seen.elapsed();
        t.note_health(peer, conn.rtt(), silent, limit);
        if silent > limit {
            let err = Error::PeerLost {
                rank: peer,
                op: "any operation".into(),
                reason: format!(
                    "no packets for {:.2} s (heartbeat every {:.2} s; limit {:.2} s = {} missed + max({:.2} s, 1.3 x mean RTT))",
                    silent.as_secs_f64(),
                    interval.as_secs_f64(),
                    limit.as_secs_f64(),
                    tracker.config().misses_allowed,
                    tracker.config().heartbeat_floor.as_secs_f64(),
                ),
            };
            t.mailbox.fail_peer(peer, err);
            conn.close(
                VarInt::from_u32(close_code::PEER_SILENT),
                b"you fell silent",
            );
            return;
        }
    }
}
