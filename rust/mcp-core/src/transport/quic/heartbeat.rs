//! Heartbeats and the failure detector.
//!
//! Every connection sends a QUIC PING every `interval` (quinn's keep-alive), which the peer's
//! QUIC stack answers with an ACK from its own threads: a compute stall or a held GIL on the
//! peer does not silence it, a killed, frozen (SIGSTOP) or cut-off peer does. The decisions
//! are the sans-IO [`PeerMonitor`]'s (silence limit, progress reports, stalls); this task per
//! connection only feeds it QUIC's received-datagram counter and RTT, sends the reports it
//! asks for, and fails every wait on a peer it declares lost (`PeerLost`) or stalled
//! (`PeerStalled`); the collectives then abort on the others.

use super::{close_code, rendezvous, QuicTransport};
use crate::error::Error;
use crate::health::{Action, PeerMonitor};
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

/// Watches one connection until it closes or its peer falls silent: drives the connection's
/// [`PeerMonitor`] with QUIC's received-datagram counter and a timer.
pub(super) async fn monitor(
    me: Weak<QuicTransport>,
    peer: usize,
    conn: Connection,
    interval: Duration,
) {
    let mut mon = PeerMonitor::new(peer, interval, Instant::now());
    let mut last_rx = conn.stats().udp_rx.datagrams;
    // A report on its way, in a task of its own: cancelling a write half-way would leave the
    // peer a truncated frame.
    let mut sending: Option<tokio::task::JoinHandle<bool>> = None;
    while let Some(at) = mon.poll_timeout() {
        tokio::time::sleep_until(at.into()).await;
        if conn.close_reason().is_some() {
            return;
        }
        let Some(t) = me.upgrade() else { return };
        if t.closing.load(Ordering::Acquire) {
            return;
        }
        // A newer connection to the peer replaced this one (a dial abandoned half-way and
        // made again, both sides dialing at once): its own monitor watches the peer, and
        // this one's silence says nothing about it.
        if !t.is_current(peer, &conn) {
            return;
        }
        let now = Instant::now();
        if sending.as_ref().is_some_and(|h| h.is_finished()) {
            if let Some(h) = sending.take() {
                mon.report_sent(matches!(h.await, Ok(true)));
            }
        }
        let rx = conn.stats().udp_rx.datagrams;
        if rx != last_rx {
            last_rx = rx;
            mon.on_heard(conn.rtt(), now);
        }
        let actions = mon.handle_timeout(now, &t.progress_watch());
        for action in actions {
            match action {
                Action::Report(mine) => {
                    let payload = mine.to_bytes();
                    let header = rendezvous::progress_header(&t, &payload);
                    let (me, conn) = (me.clone(), conn.clone());
                    sending = Some(tokio::spawn(async move {
                        let Some(t) = me.upgrade() else { return false };
                        t.write_frame(peer, &conn, &header, &payload).await.is_ok()
                    }));
                }
                Action::Stalled(s) => {
                    let (op, reason) = PeerMonitor::stall_reason(&s);
                    t.mailbox.fail_peer(
                        peer,
                        Error::PeerStalled {
                            rank: peer,
                            op,
                            reason,
                        },
                    );
                    return;
                }
                Action::Silent { silent, limit } => {
                    let reason = mon.silence_reason(silent, limit);
                    t.note_health(peer, conn.rtt(), silent, limit);
                    t.mailbox.fail_peer(
                        peer,
                        Error::PeerLost {
                            rank: peer,
                            op: "any operation".into(),
                            reason,
                        },
                    );
                    conn.close(
                        VarInt::from_u32(close_code::PEER_SILENT),
                        b"you fell silent",
                    );
                    return;
                }
            }
        }
        t.note_health(peer, conn.rtt(), mon.silent_for(now), mon.silence_limit());
    }
}
