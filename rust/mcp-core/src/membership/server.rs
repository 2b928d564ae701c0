//! The coordinator's QUIC endpoint: the job's mutual TLS (a process with another secret is
//! refused at the handshake), one request per bidirectional stream, the state machine of
//! [`super::coordinator`] behind one lock, and a timer task that runs its timeouts.

use super::coordinator::{Coordinator, CoordinatorConfig, Master, Readiness};
use super::wire::{Reply, Request, MAX_BODY};
use super::{Epoch, MemberId};
use crate::error::{Error, Result};
use crate::transport::quic::close_code;
use crate::transport::quic::endpoint;
use quinn::{Connection, Endpoint, RecvStream, SendStream, VarInt};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// ALPN of the membership protocol.
pub(crate) fn alpn() -> Vec<u8> {
    format!(
        "mcp-coord/{}.{}",
        crate::wire::PROTOCOL_MAJOR,
        crate::wire::PROTOCOL_MINOR
    )
    .into_bytes()
}

/// Longest a long-poll request may be held.
const MAX_WAIT: Duration = Duration::from_secs(5);
/// The timer task's longest sleep.
const TICK: Duration = Duration::from_millis(50);
/// QUIC's own idle limit on a member's connection (liveness is judged by heartbeats).
const CONN_IDLE: Duration = Duration::from_secs(10);
/// Longest `close` waits for each step of releasing the sockets.
const CLOSE_STEP: Duration = Duration::from_secs(2);
/// How long a new tether has to name its registration.
const TETHER_HELLO: Duration = Duration::from_secs(5);

struct Inner {
    sm: Mutex<Coordinator>,
    /// Each member's current registration token (its tether names it).
    tokens: Mutex<HashMap<MemberId, [u8; 16]>>,
    tether: bool,
    /// Bumped on every change, to wake long polls.
    version: watch::Sender<u64>,
    closing: AtomicBool,
    refused: AtomicU64,
    requests: AtomicU64,
}

impl Inner {
    fn sm(&self) -> std::sync::MutexGuard<'_, Coordinator> {
        self.sm.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bump(&self) {
        self.version.send_modify(|v| *v += 1);
    }
}

/// A running coordinator.
pub struct CoordinatorServer {
    inner: Arc<Inner>,
    /// Taken by `close`: the last handle dropped frees the UDP port.
    endpoint: Mutex<Option<Endpoint>>,
    /// The accept loop (it holds an endpoint handle) and the tether listener, joined by
    /// `close` so that both ports are free when it returns.
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    addr: SocketAddr,
}

impl CoordinatorServer {
    /// Binds `bind` (port 0 picks one) and serves members that hold `secret`.
    pub fn start(
        bind: SocketAddr,
        secret: &[u8],
        cfg: CoordinatorConfig,
    ) -> Result<CoordinatorServer> {
        if secret.is_empty() {
            return Err(Error::InvalidArgument(
                "the coordinator needs the job secret (MCP_SECRET or --secret): members authenticate with it".into(),
            ));
        }
        if cfg.dead_after < Duration::from_millis(10) {
            return Err(Error::InvalidArgument(format!(
                "dead_after {:?} is too short (at least 10 ms)",
                cfg.dead_after
            )));
        }
        let b = endpoint::control_endpoint(
            bind,
            secret,
            true,
            CONN_IDLE,
            None,
            alpn(),
            1 << 16,
            &Default::default(),
        )?;
        let addr = b.endpoint.local_addr()?;
        // Tethers: TCP on the same port number. Without it (the TCP port is taken) a dead
        // process is found by heartbeat silence only.
        let tethers = std::net::TcpListener::bind(addr)
            .and_then(|l| {
                l.set_nonblocking(true)?;
                tokio::net::TcpListener::from_std(l)
            })
            .ok();
        let inner = Arc::new(Inner {
            tokens: Mutex::new(HashMap::new()),
            tether: tethers.is_some(),
            sm: Mutex::new(Coordinator::new(cfg, rand::random())),
            version: watch::channel(0).0,
            closing: AtomicBool::new(false),
            refused: AtomicU64::new(0),
            requests: AtomicU64::new(0),
        });
        let mut tasks = vec![tokio::spawn(endpoint::accept_authenticated(
            b.endpoint.clone(),
            inner.clone(),
            |i: &Inner| {
                i.refused.fetch_add(1, Ordering::Relaxed);
            },
            serve_conn,
        ))];
        tokio::spawn(timer(Arc::downgrade(&inner)));
        if let Some(l) = tethers {
            tasks.push(tokio::spawn(tether_loop(
                Arc::downgrade(&inner),
                l,
                inner.version.subscribe(),
            )));
        }
        Ok(CoordinatorServer {
            inner,
            endpoint: Mutex::new(Some(b.endpoint)),
            tasks: Mutex::new(tasks),
            addr,
        })
    }

    /// The address members dial.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The latest epoch, if one formed.
    pub fn current(&self) -> Option<Epoch> {
        self.inner.sm().current().cloned()
    }

    /// Members believed alive.
    pub fn live_members(&self) -> usize {
        self.inner.sm().live_members()
    }

    /// Handshakes refused (another secret, no certificate).
    pub fn refused_handshakes(&self) -> u64 {
        self.inner.refused.load(Ordering::Relaxed)
    }

    /// Requests answered.
    pub fn requests(&self) -> u64 {
        self.inner.requests.load(Ordering::Relaxed)
    }

    /// Stops serving and releases the sockets: once it returns (within a few seconds at
    /// most), a coordinator restarted on the same port can bind it.
    pub async fn close(&self) {
        if self.inner.closing.swap(true, Ordering::AcqRel) {
            return;
        }
        self.inner.bump();
        let ep = self
            .endpoint
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(ep) = ep {
            ep.close(VarInt::from_u32(close_code::GOODBYE), b"coordinator closed");
            let _ = tokio::time::timeout(CLOSE_STEP, ep.wait_idle()).await;
        }
        let tasks = std::mem::take(&mut *self.tasks.lock().unwrap_or_else(|p| p.into_inner()));
        for t in tasks {
            let _ = tokio::time::timeout(CLOSE_STEP, t).await;
        }
        // The last endpoint handle is gone; quinn's driver task drops the UDP socket on
        // its next poll, which no handle can await: look for the port being free.
        let until = Instant::now() + CLOSE_STEP;
        while std::net::UdpSocket::bind(self.addr).is_err() && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

impl Drop for CoordinatorServer {
    fn drop(&mut self) {
        self.inner.closing.store(true, Ordering::Release);
        self.inner.bump();
        let ep = self
            .endpoint
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(ep) = ep {
            ep.close(VarInt::from_u32(close_code::GOODBYE), b"coordinator closed");
        }
    }
}

async fn timer(inner: std::sync::Weak<Inner>) {
    loop {
        let wait = {
            let Some(inner) = inner.upgrade() else { return };
            if inner.closing.load(Ordering::Acquire) {
                return;
            }
            let now = Instant::now();
            let (changed, next) = {
                let mut sm = inner.sm();
                let before = sm.current().map(|e| e.number);
                sm.handle_timeout(now);
                (sm.current().map(|e| e.number) != before, sm.poll_timeout())
            };
            if changed {
                inner.bump();
            }
            next.map_or(TICK, |t| t.saturating_duration_since(now).min(TICK))
        };
        tokio::time::sleep(wait.max(Duration::from_millis(1))).await;
    }
}

/// Accepts tethers: a member's TCP connection that names its registration's token, and then
/// stays open, carrying nothing, until the member's process exits (the kernel closes it,
/// however the process ends). A tether that closes marks its member dead at once, unless
/// the member registered again since (a new connection, a new token).
/// `changes` (subscribed before the task starts, so that no change is missed) wakes it at
/// every change, closing included: a closed coordinator frees the port.
async fn tether_loop(
    inner: std::sync::Weak<Inner>,
    listener: tokio::net::TcpListener,
    mut changes: watch::Receiver<u64>,
) {
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => Some(a),
            _ = changes.changed() => None,
        };
        let Some(i) = inner.upgrade() else { return };
        if i.closing.load(Ordering::Acquire) {
            return;
        }
        drop(i);
        let stream = match accepted {
            None => continue,
            Some(Ok((stream, _))) => stream,
            Some(Err(_)) => {
                // Out of descriptors, say: do not spin.
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let inner = inner.clone();
        tokio::spawn(async move {
            let Ok(Some(token)) = tokio::time::timeout(TETHER_HELLO, read_token(&stream)).await
            else {
                return;
            };
            let id = {
                let Some(i) = inner.upgrade() else { return };
                let tokens = i.tokens.lock().unwrap_or_else(|p| p.into_inner());
                match tokens.iter().find(|(_, t)| **t == token) {
                    Some((&id, _)) => id,
                    None => return,
                }
            };
            wait_closed(&stream).await;
            let Some(i) = inner.upgrade() else { return };
            let current = {
                let mut tokens = i.tokens.lock().unwrap_or_else(|p| p.into_inner());
                let current = tokens.get(&id).is_some_and(|t| *t == token);
                if current {
                    tokens.remove(&id);
                }
                current
            };
            if current && !i.closing.load(Ordering::Acquire) {
                i.sm().died(Instant::now(), id);
                i.bump();
            }
        });
    }
}

async fn read_token(stream: &tokio::net::TcpStream) -> Option<[u8; 16]> {
    let mut token = [0u8; 16];
    let mut got = 0;
    while got < token.len() {
        stream.readable().await.ok()?;
        match stream.try_read(&mut token[got..]) {
            Ok(0) => return None,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(_) => return None,
        }
    }
    Some(token)
}

/// Returns once the peer closed (or reset) the connection; anything it sends is dropped.
async fn wait_closed(stream: &tokio::net::TcpStream) {
    let mut sink = [0u8; 64];
    loop {
        if stream.readable().await.is_err() {
            return;
        }
        match stream.try_read(&mut sink) {
            Ok(0) => return,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(_) => return,
        }
    }
}

async fn serve_conn(inner: Arc<Inner>, conn: Connection) {
    while let Ok((send, recv)) = conn.accept_bi().await {
        let inner = inner.clone();
        tokio::spawn(async move {
            let _ = handle_stream(&inner, send, recv).await;
        });
    }
}

async fn handle_stream(
    inner: &Arc<Inner>,
    mut send: SendStream,
    mut recv: RecvStream,
) -> Result<()> {
    let buf = recv
        .read_to_end(MAX_BODY + 12)
        .await
        .map_err(|e| Error::Protocol(format!("membership request: {e}")))?;
    let reply = match Request::decode(&buf) {
        Ok(req) => answer(inner, req).await,
        Err(e) => Reply::Refused(e.to_string()),
    };
    inner.requests.fetch_add(1, Ordering::Relaxed);
    send.write_all(&reply.encode())
        .await
        .map_err(|e| Error::Io(format!("membership reply: {e}")))?;
    let _ = send.finish();
    // Let the reply reach the member before the stream is dropped.
    let _ = tokio::time::timeout(Duration::from_secs(2), send.stopped()).await;
    Ok(())
}

async fn answer(inner: &Arc<Inner>, req: Request) -> Reply {
    let now = Instant::now();
    match req {
        Request::Register { id, spec, view } => {
            let r = inner.sm().register(now, id, &spec, view);
            inner.bump();
            match r {
                Ok(()) => {
                    let token: [u8; 16] = rand::random();
                    inner
                        .tokens
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(id, token);
                    Reply::Welcome {
                        token,
                        tether: inner.tether,
                    }
                }
                Err(e) => Reply::Refused(e.to_string()),
            }
        }
        Request::Heartbeat { id, step } => Reply::Beat(inner.sm().heartbeat(now, id, step)),
        Request::Report {
            id,
            seen,
            step,
            wait_ms,
        } => {
            inner.sm().report(now, id, seen, step);
            inner.bump();
            long_poll(inner, wait_ms, || match inner.sm().readiness(id, seen) {
                Readiness::Formed(e) => Some(Reply::Formed(e)),
                Readiness::Waiting => None,
                Readiness::Unknown => Some(Reply::Unknown),
            })
            .await
            .unwrap_or(Reply::Waiting)
        }
        Request::PublishMaster { id, epoch, addr } => {
            let ok = inner.sm().publish_master(id, epoch, addr);
            inner.bump();
            if ok {
                Reply::Ok
            } else {
                Reply::Superseded
            }
        }
        Request::Master { epoch, wait_ms } => {
            long_poll(inner, wait_ms, || match inner.sm().master(epoch) {
                Master::At(a) => Some(Reply::MasterAt(a)),
                Master::Superseded => Some(Reply::Superseded),
                Master::Pending => None,
            })
            .await
            .unwrap_or(Reply::Waiting)
        }
        Request::Watch { id, epoch, wait_ms } => long_poll(inner, wait_ms, || {
            let b = inner.sm().beat_of(id);
            b.ends(epoch).then_some(Reply::Beat(b))
        })
        .await
        .unwrap_or_else(|| Reply::Beat(inner.sm().beat_of(id))),
        Request::Leave { id } => {
            inner
                .tokens
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&id);
            inner.sm().leave(now, id);
            inner.bump();
            Reply::Ok
        }
    }
}

/// Calls `check` until it answers, the coordinator changes being no longer worth waiting
/// for (`wait_ms`, at most [`MAX_WAIT`]), or it closes.
async fn long_poll(
    inner: &Arc<Inner>,
    wait_ms: u32,
    check: impl Fn() -> Option<Reply>,
) -> Option<Reply> {
    let deadline =
        tokio::time::Instant::now() + Duration::from_millis(u64::from(wait_ms)).min(MAX_WAIT);
    let mut rx = inner.version.subscribe();
    loop {
        rx.mark_unchanged();
        if let Some(r) = check() {
            return Some(r);
        }
        if inner.closing.load(Ordering::Acquire) {
            return None;
        }
        match tokio::time::timeout_at(deadline, rx.changed()).await {
            Ok(Ok(())) => continue,
            _ => return None,
        }
    }
}
