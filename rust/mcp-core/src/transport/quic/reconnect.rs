//! Re-establishing a connection that broke while its peer lives.
//!
//! A connection can end without its peer being lost: QUIC's idle timeout fires during a cut
//! when it is shorter than the failure detector's limit, a middlebox loses its state and the
//! peer answers with a stateless reset, or the connection is dropped on purpose
//! ([`QuicTransport::chaos_reset`]). Such an end is *transient*: instead of failing every
//! wait on the peer, the higher rank dials it again (resuming the TLS session, its first
//! frames in 0-RTT data) and the lower one waits for it, for at most the reconnection
//! budget; only then is the peer lost. Meanwhile the operations in flight wait, and resume
//! from what the receiver acknowledged: a stream-lane frame without an OK verdict is sent
//! again on the new connection ([`super::stream_lane`]), so is an FEC-lane transfer without
//! its DONE ([`QuicTransport::resend_after_break`]), so is an abort QUIC had not delivered
//! ([`QuicTransport::resend_control`]), a frame whose send failed is sent again
//! whole, and the receiver drops a copy of a frame it already filed ([`Mailbox`]). A frame
//! cut off on the receiving side files nothing: the connection's end decides, a lost peer
//! failing every wait on it, a transient end bringing the sender's copy again.
//!
//! An end that says something about the peer is not transient: a goodbye, our own close, a
//! refused handshake, the other side declaring us silent, a protocol error.
//!
//! [`Mailbox`]: crate::transport::Mailbox

use super::stream_lane::Sent;
use super::{close_code, QuicTransport, SEND_RETRIES};
use crate::error::Error;
use crate::wire::Header;
use quinn::{Connection, ConnectionError};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Weak;
use std::time::{Duration, Instant};

/// Why a connection's end is worth a reconnection, or `None` when it says the peer is gone
/// (or untrustworthy). `reset_here`: this process dropped the connection on purpose.
pub(super) fn transient(end: &ConnectionError, reset_here: bool) -> Option<&'static str> {
    match end {
        ConnectionError::TimedOut => Some("QUIC's idle timeout"),
        ConnectionError::Reset => Some("a stateless reset"),
        ConnectionError::ApplicationClosed(c)
            if u64::from(c.error_code) == u64::from(close_code::PATH_RESET) =>
        {
            Some("the peer dropped the connection to re-establish it")
        }
        ConnectionError::LocallyClosed if reset_here => Some("this process reset the path"),
        // A close sent before the handshake's 1-RTT keys exist loses its application code
        // and reason (QUIC carries it as a transport APPLICATION_ERROR): it cannot tell a
        // reset from a departure, and the reconnection, bounded by its budget, finds out.
        ConnectionError::ConnectionClosed(c)
            if c.error_code == quinn::TransportErrorCode::APPLICATION_ERROR =>
        {
            Some("the peer closed the connection during its handshake")
        }
        _ => None,
    }
}

/// How long a broken connection may take to come back before its peer is lost: about what
/// the failure detector allows a silent peer (two heartbeats and a second), at least 2 s.
pub(super) fn budget(heartbeat: Duration) -> Duration {
    (heartbeat * 2 + Duration::from_secs(1)).max(Duration::from_secs(2))
}

/// Re-establishes the connection to `peer` that `broken` was, within the budget; fails every
/// wait on the peer if it cannot. Does nothing when the slot already holds another one.
///
/// Boxed: the new connection's reader may come back here, and a boxed future's `Send` is
/// declared rather than inferred through that cycle.
pub(super) fn reconnect(
    me: Weak<QuicTransport>,
    peer: usize,
    broken: Connection,
    why: &'static str,
) -> Pin<Box<dyn Future<Output = ()> + Send>> {
    Box::pin(reconnect_now(me, peer, broken, why))
}

async fn reconnect_now(
    me: Weak<QuicTransport>,
    peer: usize,
    broken: Connection,
    why: &'static str,
) {
    let Some(t) = me.upgrade() else { return };
    let Some(slot) = t.peers.get(peer) else {
        return;
    };
    // Counted under the slot's lock: whoever sees the slot emptied (or the connection that
    // replaces it) sees the count.
    let cleared = slot.conn.send_if_modified(|c| {
        if c.as_ref().map(Connection::stable_id) == Some(broken.stable_id()) {
            *c = None;
            t.stats.reconnects.fetch_add(1, Ordering::Relaxed);
            true
        } else {
            false
        }
    });
    if !cleared {
        return;
    }
    let budget = budget(t.cfg.heartbeat);
    let started = Instant::now();
    let deadline = started + budget;
    let res = if t.rank > peer {
        t.redial(peer, deadline).await.map(|_| ())
    } else {
        let mut rx = slot.conn.subscribe();
        let wait = async {
            loop {
                if rx.borrow_and_update().is_some() {
                    return Ok(());
                }
                if rx.changed().await.is_err() {
                    return Err(Error::Closed("transport dropped".into()));
                }
            }
        };
        match tokio::time::timeout(budget, wait).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout {
                what: format!("rank {peer} to connect again"),
                after: budget,
            }),
        }
    };
    if t.closing.load(Ordering::Acquire) {
        return;
    }
    match res {
        Ok(()) => {
            let took = started.elapsed();
            *t.last_reconnect.lock().unwrap_or_else(|p| p.into_inner()) = Some(took);
        }
        Err(e) => {
            if t.mailbox.peer_error(peer).is_none() {
                t.mailbox.fail_peer(
                    peer,
                    Error::PeerLost {
                        rank: peer,
                        op: "reconnect".into(),
                        reason: format!(
                            "the connection broke ({why}) and was not re-established within {:.1} s: {e}",
                            budget.as_secs_f64()
                        ),
                    },
                );
            }
            // Wake the sends waiting for the new connection: they see the loss.
            slot.conn.send_modify(|_| {});
        }
    }
}

/// How one attempt of [`QuicTransport::on_next_connections`] ended.
enum Attempt {
    /// The frame went out.
    Sent,
    /// The connection broke under it: try the next one.
    Broke,
    /// Nothing more to do (the transport closes, or the frame cannot be sent).
    GiveUp,
}

impl QuicTransport {
    /// Runs `attempt` on the connection that replaces `broken`, and again on the next one
    /// while connections keep breaking under it, at most [`SEND_RETRIES`] times; counts a
    /// frame that went out in `resumed_frames`. Gives up when the peer is lost.
    async fn on_next_connections<F, Fut>(&self, peer: usize, broken: &Connection, mut attempt: F)
    where
        F: FnMut(Connection) -> Fut,
        Fut: Future<Output = Attempt>,
    {
        let mut failed = broken.clone();
        for _ in 0..SEND_RETRIES {
            let Ok(conn) = self.next_conn(peer, &failed).await else {
                return;
            };
            match attempt(conn.clone()).await {
                Attempt::Sent => {
                    self.stats.resumed_frames.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                Attempt::Broke if !self.closing.load(Ordering::Acquire) => failed = conn,
                Attempt::Broke | Attempt::GiveUp => return,
            }
        }
    }

    /// Sends a data frame again, on the stream lane of the connection that replaces `broken`,
    /// because `broken` ended before the receiver acknowledged it.
    pub(super) async fn resend_after_break(
        &self,
        peer: usize,
        broken: &Connection,
        header: &Header,
        payload: &[u8],
    ) {
        self.on_next_connections(peer, broken, |conn| async move {
            match self
                .write_checked(peer, &conn, header, payload, Sent::Again)
                .await
            {
                Ok(()) => Attempt::Sent,
                Err(e) if e.is_connection() => Attempt::Broke,
                Err(_) => Attempt::GiveUp,
            }
        })
        .await;
    }

    /// Sends a control frame (an abort) again on the connection that replaces `broken`,
    /// which ended (or refused the 0-RTT data it rode in) before the peer acknowledged it.
    pub(super) async fn resend_control(
        &self,
        peer: usize,
        broken: &Connection,
        header: &Header,
        payload: &[u8],
    ) {
        // A refused 0-RTT flight fails its stream, not the connection: `next_conn` then
        // hands the same connection back.
        self.on_next_connections(peer, broken, |conn| async move {
            match self.write_uni(&conn, header, payload).await {
                Ok(stream) if stream.stopped().await.is_ok() => Attempt::Sent,
                Ok(_) => Attempt::Broke,
                Err(e) if e.is_connection() => Attempt::Broke,
                Err(_) => Attempt::GiveUp,
            }
        })
        .await;
    }
}
