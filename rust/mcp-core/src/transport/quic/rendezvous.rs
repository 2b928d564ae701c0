//! Meeting the other ranks over QUIC: every rank dials rank 0 and says Hello with its
//! entry; rank 0 answers each with the table of all entries (the state machine is
//! [`crate::rendezvous`], driven by [`crate::transport::meeting`]). Also the bootstrap exchange that hands a
//! generated secret to the other ranks when the job was started without one.

use super::{close_code, endpoint, tls, QuicConfig, QuicTransport};
use crate::backoff::Backoff;
use crate::error::{Error, Result};
use crate::rendezvous::Entry;
use crate::transport::meeting;
use crate::wire::{FrameKind, Header};
use quinn::crypto::rustls::QuicClientConfig;
use quinn::{Connection, Endpoint, VarInt};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

fn control_header(t: &QuicTransport, kind: FrameKind, payload: &[u8]) -> Header {
    meeting::control_header(t.rank, t.world, kind, payload)
}

/// The Goodbye a closing process sends to each connected peer.
pub(super) fn goodbye_header(t: &QuicTransport, payload: &[u8]) -> Header {
    control_header(t, FrameKind::Goodbye, payload)
}

/// A progress report's header.
pub(super) fn progress_header(t: &QuicTransport, payload: &[u8]) -> Header {
    control_header(t, FrameKind::Progress, payload)
}

/// This rank's line of the rendezvous table.
fn own_entry(t: &QuicTransport) -> Result<Entry> {
    Ok(Entry {
        addr: t.local_addr()?,
        host: t.host_id.clone(),
        pid: std::process::id(),
        shm: t.shm_wanted(),
        model: t.cfg.model_decl.clone(),
    })
}

/// The Hello a dialer sends first: its rank (as `src`), world size (as `aux`), and as payload
/// its rank-table entry (see [`Entry`]).
pub(super) fn hello_frame(t: &QuicTransport) -> Result<(Header, Vec<u8>)> {
    Ok(meeting::hello_frame(t.rank, t.world, &own_entry(t)?))
}

/// Runs the rendezvous; afterwards every rank's address is known.
pub(super) async fn run(t: &Arc<QuicTransport>, deadline: Instant) -> Result<()> {
    let master = t.cfg.master.to_string();
    let timeout = t.cfg.connect_timeout;
    let table = if t.rank == 0 {
        let refuse = |r: usize, e: &Error| {
            if let Some(c) = t.peers[r].conn.borrow().as_ref() {
                c.close(
                    VarInt::from_u32(close_code::REFUSED),
                    e.to_string().as_bytes(),
                );
            }
        };
        meeting::gather(&**t, own_entry(t)?, deadline, timeout, &master, refuse).await?
    } else {
        {
            let mut a = t.addrs.lock().unwrap_or_else(|p| p.into_inner());
            a[0] = Some(t.cfg.master);
        }
        t.dial_with_backoff(0, t.cfg.master, deadline, false)
            .await?;
        meeting::receive_table(&**t, deadline, timeout, &master).await?
    };
    *t.addrs.lock().unwrap_or_else(|p| p.into_inner()) =
        table.entries().iter().map(|e| Some(e.addr)).collect();
    t.set_topology(table.entries());
    Ok(())
}

/// Rank 0's side of the bootstrap: hands the generated secret to whoever asks while the
/// rendezvous is open.
pub(super) async fn serve_secret(me: Weak<QuicTransport>, conn: Connection) {
    let Some(t) = me.upgrade() else { return };
    if !t.bootstrap_open.load(Ordering::Acquire) {
        conn.close(
            VarInt::from_u32(close_code::REFUSED),
            b"the rendezvous is over",
        );
        return;
    }
    let secret = t.secret.clone();
    drop(t);
    if let Ok(mut s) = conn.open_uni().await {
        if s.write_all(&secret).await.is_ok() && s.finish().is_ok() {
            let _ = tokio::time::timeout(Duration::from_secs(5), s.stopped()).await;
        }
    }
    conn.close(VarInt::from_u32(close_code::BOOTSTRAP_DONE), b"done");
}

/// Asks rank 0 for the generated job secret, retrying until `deadline`.
pub(super) async fn fetch_secret(cfg: &QuicConfig, deadline: Instant) -> Result<Vec<u8>> {
    let local = SocketAddr::new(endpoint::local_ip_towards(cfg.master)?, 0);
    let ep = Endpoint::client(local)?;
    let tls = tls::bootstrap_client_config()?;
    let quic =
        QuicClientConfig::try_from(tls).map_err(|e| Error::Io(format!("bootstrap config: {e}")))?;
    let client = quinn::ClientConfig::new(Arc::new(quic));
    let mut backoff = Backoff::default();
    let res = loop {
        let attempt = async {
            let conn = ep
                .connect_with(client.clone(), cfg.master, tls::SERVER_NAME)
                .map_err(|e| Error::Io(e.to_string()))?
                .await
                .map_err(|e| Error::Io(e.to_string()))?;
            let mut s = conn
                .accept_uni()
                .await
                .map_err(|e| Error::Io(e.to_string()))?;
            let secret = s
                .read_to_end(1024)
                .await
                .map_err(|e| Error::Io(e.to_string()))?;
            conn.close(VarInt::from_u32(close_code::BOOTSTRAP_DONE), b"thanks");
            Ok::<Vec<u8>, Error>(secret)
        };
        match tokio::time::timeout(Duration::from_secs(2), attempt).await {
            Ok(Ok(secret)) if !secret.is_empty() => break Ok(secret),
            Ok(Ok(_)) | Ok(Err(_)) | Err(_) => {
                let wait = backoff.next_delay();
                if Instant::now() + wait >= deadline {
                    break Err(Error::Timeout {
                        what: format!(
                            "fetching the job secret from rank 0 at {}; start rank 0, or give every rank the same MCP_SECRET",
                            cfg.master
                        ),
                        after: cfg.connect_timeout,
                    });
                }
                tokio::time::sleep(wait).await;
            }
        }
    };
    ep.close(VarInt::from_u32(close_code::BOOTSTRAP_DONE), b"");
    res
}
