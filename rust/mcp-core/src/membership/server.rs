//! The coordinator's QUIC endpoint: the job's mutual TLS (a process with another secret is
//! refused at the handshake), one request per bidirectional stream, the sans-IO
//! [`Service`] behind one lock (a held request waits on a oneshot under its ticket), a
//! timer task that runs its timeouts, and tethers.

use super::coordinator::{Coordinator, CoordinatorConfig};
use super::service::{Answer, Service, Ticket};
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
use tokio::sync::{oneshot, watch, Notify};

/// ALPN of the membership protocol.
pub(crate) fn alpn() -> Vec<u8> {
    format!(
        "mcp-coord/{}.{}",
        crate::wire::PROTOCOL_MAJOR,
        crate::wire::PROTOCOL_MINOR
    )
    .into_bytes()
}

/// The timer task's longest sleep.
const TICK: Duration = Duration::from_millis(50);
/// QUIC's own idle limit on a member's connection (liveness is judged by heartbeats).
const CONN_IDLE: Duration = Duration::from_secs(10);
/// Longest `close` waits for each step of releasing the sockets.
const CLOSE_STEP: Duration = Duration::from_secs(2);
/// How long a new tether has to name its registration.
const TETHER_HELLO: Duration = Duration::from_secs(5);

struct Inner {
    svc: Mutex<Service>,
    /// The streams whose requests the service holds, by ticket.
    waiting: Mutex<HashMap<Ticket, oneshot::Sender<Reply>>>,
    next_ticket: AtomicU64,
    /// Wakes the timer when a request is held (its wait may end before the timer's sleep).
    timer_wake: Notify,
    /// Each member's current registration token (its tether names it).
    tokens: Mutex<HashMap<MemberId, [u8; 16]>>,
    tether: bool,
    /// Bumped when closing, to wake the tether listener.
    version: watch::Sender<u64>,
    closing: AtomicBool,
    refused: AtomicU64,
    requests: AtomicU64,
}

impl Inner {
    fn svc(&self) -> std::sync::MutexGuard<'_, Service> {
        self.svc.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn waiting(&self) -> std::sync::MutexGuard<'_, HashMap<Ticket, oneshot::Sender<Reply>>> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sends the answers of held requests to their streams.
    fn deliver(&self, answers: Vec<(Ticket, Reply)>) {
        if answers.is_empty() {
            return;
        }
        let mut waiting = self.waiting();
        for (ticket, reply) in answers {
            if let Some(tx) = waiting.remove(&ticket) {
                // The stream may be gone (its member died): nothing to tell.
                let _ = tx.send(reply);
            }
        }
    }

    /// Answers the held requests that can be answered now.
    fn answer_held(&self) {
        let answers = self.svc().poll_answers(Instant::now());
        self.deliver(answers);
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
            svc: Mutex::new(Service::new(Coordinator::new(cfg, rand::random()))),
            waiting: Mutex::new(HashMap::new()),
            next_ticket: AtomicU64::new(0),
            timer_wake: Notify::new(),
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
        self.inner.svc().coordinator().current().cloned()
    }

    /// Members believed alive.
    pub fn live_members(&self) -> usize {
        self.inner.svc().coordinator().live_members()
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
        let held = self.inner.svc().release_all();
        self.inner.deliver(held);
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
        let held = self.inner.svc().release_all();
        self.inner.deliver(held);
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
            let (answers, next) = {
                let mut svc = inner.svc();
                svc.handle_timeout(now);
                (svc.poll_answers(now), svc.poll_timeout())
            };
            inner.deliver(answers);
            next.map_or(TICK, |t| t.saturating_duration_since(now).min(TICK))
        };
        let Some(held) = inner.upgrade() else { return };
        // A request held meanwhile may end sooner than `wait`: it wakes the timer. (The
        // strong handle lives for one sleep of at most TICK.)
        tokio::select! {
            _ = tokio::time::sleep(wait.max(Duration::from_millis(1))) => {}
            _ = held.timer_wake.notified() => {}
        }
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
                i.svc().coordinator_mut().died(Instant::now(), id);
                i.answer_held();
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

/// The reply to `req`: at once, or once the service answers it under its ticket.
async fn answer(inner: &Arc<Inner>, req: Request) -> Reply {
    let ticket = inner.next_ticket.fetch_add(1, Ordering::Relaxed);
    let leaving = match req {
        Request::Leave { id } => Some(id),
        _ => None,
    };
    // Filed before the service sees the request, so that an answer is never missed.
    let (tx, rx) = oneshot::channel();
    inner.waiting().insert(ticket, tx);
    let answer = {
        let mut svc = inner.svc();
        let now = Instant::now();
        if let Some(id) = leaving {
            inner
                .tokens
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&id);
        }
        let a = svc.on_request(now, ticket, req);
        if inner.closing.load(Ordering::Acquire) {
            let held = svc.release_all();
            drop(svc);
            inner.deliver(held);
        }
        a
    };
    let reply = match answer {
        Answer::Reply(r) => Some(r),
        Answer::Registered(id) => {
            let token: [u8; 16] = rand::random();
            inner
                .tokens
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(id, token);
            Some(Reply::Welcome {
                token,
                tether: inner.tether,
            })
        }
        Answer::Held => None,
    };
    // Anything the request changed may answer held requests, this one's included.
    inner.answer_held();
    match reply {
        Some(r) => {
            inner.waiting().remove(&ticket);
            r
        }
        None => {
            inner.timer_wake.notify_one();
            // The service answers every held request within MAX_WAIT (or at close).
            rx.await.unwrap_or(Reply::Waiting)
        }
    }
}
