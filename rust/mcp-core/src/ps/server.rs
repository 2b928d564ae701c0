//! A parameter server: a QUIC endpoint that holds its pieces in a [`Store`] and answers
//! the requests of [`super::proto`], one per bidirectional stream.
//!
//! A worker is live from its `Register` until it leaves, or until its connection closes:
//! QUIC pings it every quarter of `dead_after` and closes the connection after `dead_after`
//! of silence (killed, frozen, cut off), and the worker is then dropped from the staleness
//! minimum. `Advance` requests wait (asynchronously, bounded by the request's `wait`) until
//! the SSP condition holds.

use super::net::{self, Head};
use super::optim::Optimizer;
use super::proto::{ErrorCode, Reply, Request};
use super::store::{Aggregate, Piece, PieceId, Store};
use crate::config::TransportSettings;
use crate::error::{Error, Result};
use crate::transport::quic::chaos::{ChaosConfig, ChaosStats};
use crate::transport::quic::{close_code, endpoint};
use crate::wire::{Codec, FrameKind};
use bytes::Bytes;
use quinn::{Connection, Endpoint, RecvStream, SendStream, VarInt};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How to start a server.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address to listen on (UDP).
    pub bind: SocketAddr,
    /// The job secret: only processes that hold it are accepted.
    pub secret: Vec<u8>,
    /// The update rule.
    pub optimizer: Optimizer,
    /// How the gradients of one clock are combined.
    pub aggregate: Aggregate,
    /// Staleness bound `s`.
    pub staleness: u64,
    /// Workers expected at start: `Register` answers once this many have registered.
    pub num_workers: usize,
    /// A connection silent this long is closed and its worker dropped.
    pub dead_after: Duration,
    /// How long a `Register` may wait for the other workers.
    pub register_timeout: Duration,
    /// Faults to inject under QUIC.
    pub chaos: Option<ChaosConfig>,
    /// The transport config (stream limit, MTU, ping interval; its `compression` is
    /// installed by whoever parsed it).
    pub transport: TransportSettings,
}

impl ServerConfig {
    /// Defaults: SGD (lr 0.01, momentum 0.9), mean of the gradients, s = 3, one worker,
    /// dead after 5 s, 300 s to register.
    pub fn new(bind: SocketAddr, secret: Vec<u8>) -> ServerConfig {
        ServerConfig {
            bind,
            secret,
            optimizer: Optimizer::default(),
            aggregate: Aggregate::Mean,
            staleness: 3,
            num_workers: 1,
            dead_after: Duration::from_secs(5),
            register_timeout: Duration::from_secs(300),
            chaos: None,
            transport: TransportSettings::default(),
        }
    }
}

struct Inner {
    cfg: ServerConfig,
    store: Mutex<Store>,
    /// Bumped at every change of the clock table; `Advance` and `Register` wait on it.
    changed: watch::Sender<u64>,
    /// Workers a `Register` waits for (`num_workers`, lower after a restore).
    expect: AtomicUsize,
    /// Which connection each worker registered on (a newer one replaces an older one).
    owner: Mutex<HashMap<u32, u64>>,
    next_conn: AtomicU64,
    /// Taken (and so dropped, releasing the socket) by `close`.
    endpoint: Mutex<Option<Endpoint>>,
    kill: Arc<AtomicBool>,
    /// Damage to inject into replies (chaos `corrupt=`).
    damage: Option<net::Damage>,
    chaos: Option<Arc<ChaosStats>>,
    closing: AtomicBool,
    refused: AtomicU64,
    corrupt: AtomicU64,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
}

impl Inner {
    fn store(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bump(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }
}

/// A running parameter server.
#[derive(Clone)]
pub struct PsServer {
    inner: Arc<Inner>,
}

impl PsServer {
    /// Binds and starts serving. Must run inside a tokio runtime.
    pub async fn start(cfg: ServerConfig) -> Result<PsServer> {
        Self::start_with(cfg, None).await
    }

    /// As [`PsServer::start`], holding a checkpoint's pieces (see [`PsServer::restore`])
    /// before the first request is accepted.
    #[allow(clippy::type_complexity)]
    pub async fn start_with(
        cfg: ServerConfig,
        restore: Option<(u64, Vec<(PieceId, Piece)>, Vec<u32>)>,
    ) -> Result<PsServer> {
        if cfg.num_workers == 0 {
            return Err(Error::InvalidArgument(
                "num_workers must be at least 1".into(),
            ));
        }
        let b = net::bind(
            cfg.bind,
            &cfg.secret,
            true,
            cfg.dead_after,
            cfg.chaos,
            &cfg.transport,
        )?;
        let inner = Arc::new(Inner {
            store: Mutex::new(Store::new(cfg.optimizer, cfg.aggregate, cfg.staleness)),
            changed: watch::channel(0).0,
            expect: AtomicUsize::new(cfg.num_workers),
            owner: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
            endpoint: Mutex::new(Some(b.endpoint)),
            kill: b.kill,
            chaos: b.chaos,
            damage: net::Damage::of(cfg.chaos, u64::MAX),
            closing: AtomicBool::new(false),
            refused: AtomicU64::new(0),
            corrupt: AtomicU64::new(0),
            bytes_in: AtomicU64::new(0),
            bytes_out: AtomicU64::new(0),
            cfg,
        });
        let server = PsServer { inner };
        if let Some((applied, pieces, workers)) = restore {
            server.restore(applied, pieces, workers)?;
        }
        let ep = server
            .inner
            .endpoint
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(ep) = ep {
            tokio::spawn(endpoint::accept_authenticated(
                ep,
                server.inner.clone(),
                |i: &Inner| {
                    i.refused.fetch_add(1, Ordering::Relaxed);
                },
                serve_conn,
            ));
        }
        Ok(server)
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        let ep = self
            .inner
            .endpoint
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match ep.as_ref() {
            Some(e) => Ok(e.local_addr()?),
            None => Err(Error::Closed("the parameter server is closed".into())),
        }
    }

    /// Every piece with its optimizer state, the clock below which every clock was applied
    /// and the live workers, when it was taken: one consistent cut, for a checkpoint.
    #[allow(clippy::type_complexity)]
    pub fn snapshot(&self) -> (u64, Vec<(PieceId, Piece)>, Vec<u32>) {
        let s = self.inner.store();
        let live = s
            .clocks()
            .entries()
            .into_iter()
            .filter(|e| e.2)
            .map(|e| e.0)
            .collect();
        (s.applied_through(), s.snapshot(), live)
    }

    /// Replaces the pieces by a checkpoint's (see [`Store::restore`]). The workers live at
    /// the checkpoint count in the staleness minimum (at the checkpoint's clock) until they
    /// register again; those that have not within `2 x dead_after + 6 s` (the backoff's cap
    /// and a handshake) are dropped. Must run inside a tokio runtime.
    pub fn restore(
        &self,
        applied: u64,
        pieces: Vec<(PieceId, Piece)>,
        workers: Vec<u32>,
    ) -> Result<()> {
        self.inner.store().restore(applied, pieces, &workers)?;
        self.inner.expect.store(0, Ordering::Release);
        self.inner.bump();
        let inner = self.inner.clone();
        let grace = self.inner.cfg.dead_after * 2 + Duration::from_secs(6);
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            let gone: Vec<u32> = {
                let owner = inner.owner.lock().unwrap_or_else(|p| p.into_inner());
                workers
                    .into_iter()
                    .filter(|w| !owner.contains_key(w))
                    .collect()
            };
            for w in gone {
                let _ = inner.store().drop_worker(w);
            }
            inner.bump();
        });
        Ok(())
    }

    /// Counters: pushes, pulls, clocks applied, live workers, the largest staleness gap
    /// granted, bytes in and out, refused handshakes, corrupt messages.
    pub fn stats(&self) -> Vec<(String, u64)> {
        stats(&self.inner)
    }

    /// (worker, clock, live) of every worker ever registered.
    pub fn clocks(&self) -> Vec<(u32, u64, bool)> {
        self.inner.store().clocks().entries()
    }

    /// Cuts the server off the network (needs `chaos`): every datagram is dropped.
    pub fn chaos_kill(&self) -> Result<()> {
        if self.inner.chaos.is_none() {
            return Err(Error::InvalidArgument(
                "the kill switch needs chaos=... at start".into(),
            ));
        }
        self.inner.kill.store(true, Ordering::Release);
        Ok(())
    }

    /// Whether [`PsServer::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.inner.closing.load(Ordering::Acquire)
    }

    /// Stops serving: closes every connection and the endpoint, and releases the socket.
    pub async fn close(&self) {
        if self.inner.closing.swap(true, Ordering::AcqRel) {
            return;
        }
        let ep = self
            .inner
            .endpoint
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        self.inner.bump();
        if let Some(ep) = ep {
            ep.close(
                VarInt::from_u32(close_code::GOODBYE),
                b"parameter server closed",
            );
            let _ = tokio::time::timeout(Duration::from_secs(2), ep.wait_idle()).await;
            // Dropping the last handle (the accept loop's ends with the endpoint) frees the
            // socket: the address can be served again.
        }
    }
}

fn stats(inner: &Inner) -> Vec<(String, u64)> {
    let s = inner.store();
    let st = s.stats();
    let c = s.clocks();
    let mut v = vec![
        ("pushes", st.pushes),
        ("duplicate_pushes", st.duplicate_pushes),
        ("pulls", st.pulls),
        ("clocks_applied", st.clocks_applied),
        ("applied_through", s.applied_through()),
        ("live_workers", c.live() as u64),
        ("known_workers", c.known() as u64),
        ("min_clock", c.min_live().unwrap_or(u64::MAX)),
        ("max_granted_gap", c.max_granted_gap()),
        ("staleness", s.staleness()),
        ("pieces", s.len() as u64),
        ("refused_handshakes", inner.refused.load(Ordering::Relaxed)),
        ("corrupt_messages", inner.corrupt.load(Ordering::Relaxed)),
        ("bytes_received", inner.bytes_in.load(Ordering::Relaxed)),
        ("bytes_sent", inner.bytes_out.load(Ordering::Relaxed)),
    ];
    drop(s);
    if let Some(ch) = &inner.chaos {
        v.push((
            "chaos_send_dropped",
            ch.send_dropped.load(Ordering::Relaxed),
        ));
        v.push((
            "chaos_recv_dropped",
            ch.recv_dropped.load(Ordering::Relaxed),
        ));
    }
    v.into_iter().map(|(k, n)| (k.to_string(), n)).collect()
}

async fn serve_conn(inner: Arc<Inner>, conn: Connection) {
    let id = inner.next_conn.fetch_add(1, Ordering::Relaxed);
    let worker: Arc<Mutex<Option<u32>>> = Arc::new(Mutex::new(None));
    loop {
        let (send, recv) = match conn.accept_bi().await {
            Ok(s) => s,
            Err(_) => break,
        };
        let inner = inner.clone();
        let worker = worker.clone();
        tokio::spawn(async move {
            handle_stream(&inner, id, &worker, send, recv).await;
        });
    }
    // The connection is gone: drop its worker unless it registered again elsewhere.
    let w = *worker.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(w) = w {
        let mine = {
            let mut owner = inner.owner.lock().unwrap_or_else(|p| p.into_inner());
            if owner.get(&w) == Some(&id) {
                owner.remove(&w);
                true
            } else {
                false
            }
        };
        if mine {
            let _ = inner.store().drop_worker(w);
            inner.bump();
        }
    }
}

async fn handle_stream(
    inner: &Arc<Inner>,
    conn_id: u64,
    worker: &Mutex<Option<u32>>,
    mut send: SendStream,
    mut recv: RecvStream,
) {
    let head = match net::read_head(&mut recv, FrameKind::PsRequest).await {
        Ok(h) => h,
        Err(e) => {
            if matches!(e, Error::Protocol(_)) {
                inner.corrupt.fetch_add(1, Ordering::Relaxed);
                let _ = reply(inner, &mut send, 0, error_reply(&e), Bytes::new()).await;
            }
            return;
        }
    };
    let id = head.header.seq;
    let (rep, data) = match answer(inner, conn_id, worker, &head, &mut recv).await {
        Ok(r) => r,
        Err(e) => {
            if matches!(e, Error::Protocol(_) | Error::Damaged(_)) {
                inner.corrupt.fetch_add(1, Ordering::Relaxed);
            }
            (error_reply(&e), Bytes::new())
        }
    };
    let _ = reply(inner, &mut send, id, rep, data).await;
}

fn error_reply(e: &Error) -> Reply {
    Reply::Error {
        code: ErrorCode::of(e),
        message: e.to_string(),
    }
}

async fn reply(
    inner: &Inner,
    send: &mut SendStream,
    id: u64,
    rep: Reply,
    data: Bytes,
) -> Result<()> {
    let mut meta = Vec::new();
    rep.encode_meta(&mut meta)?;
    let numel = (data.len() / 4) as u64;
    inner
        .bytes_out
        .fetch_add((meta.len() + data.len()) as u64, Ordering::Relaxed);
    net::write_msg(
        send,
        FrameKind::PsReply,
        id,
        0,
        rep.op(),
        Codec::None,
        numel,
        &meta,
        data,
        inner.damage.as_ref(),
    )
    .await
}

fn not_live(w: u32) -> Reply {
    Reply::Error {
        code: ErrorCode::NotLive,
        message: format!(
            "worker {w} is not registered here (new server, or it was dropped as dead)"
        ),
    }
}

async fn answer(
    inner: &Arc<Inner>,
    conn_id: u64,
    worker_slot: &Mutex<Option<u32>>,
    head: &Head,
    recv: &mut RecvStream,
) -> Result<(Reply, Bytes)> {
    let req = match Request::decode(head.header.aux, &head.meta) {
        Ok(r) => r,
        Err(e) => {
            // Damaged metadata reads as nonsense: the checksum tells which it is.
            head.drain_checked(recv).await?;
            return Err(e);
        }
    };
    let w = head.header.src;
    inner
        .bytes_in
        .fetch_add(head.header.payload_len, Ordering::Relaxed);
    let needs_data = matches!(
        req,
        Request::Init { .. } | Request::Push { .. } | Request::Step { .. }
    );
    if !needs_data {
        if head.data_len() != 0 {
            return Err(Error::Protocol(format!("{} carries data", req.name())));
        }
        head.verify(&[])?;
    }
    // Only the connection that holds the id may move its clock: a process that was dropped
    // as dead and replaced must register again (and is then refused as superseded).
    let moves_clock = matches!(
        req,
        Request::Push { .. } | Request::Advance { .. } | Request::Step { .. }
    );
    if moves_clock {
        let owner = inner.owner.lock().unwrap_or_else(|p| p.into_inner());
        if owner.get(&w) != Some(&conn_id) {
            return Ok((not_live(w), Bytes::new()));
        }
    }
    match req {
        Request::Register { clock, generation } => {
            inner.store().register(w, clock, generation)?;
            take_id(inner, conn_id, worker_slot, w);
            // Wait for the expected workers (all of them at start, bounded after a restore).
            let restored = inner.expect.load(Ordering::Acquire) == 0;
            let limit = if restored {
                inner.cfg.dead_after * 2
            } else {
                inner.cfg.register_timeout
            };
            let deadline = Instant::now() + limit;
            let mut rx = inner.changed.subscribe();
            loop {
                rx.borrow_and_update();
                let known = inner.store().clocks().known();
                let want = if restored {
                    inner.cfg.num_workers
                } else {
                    inner.expect.load(Ordering::Acquire)
                };
                if known >= want {
                    break;
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() || inner.closing.load(Ordering::Acquire) {
                    if restored {
                        break;
                    }
                    return Err(Error::Timeout {
                        what: format!(
                            "only {known} of {want} workers registered with the parameter server"
                        ),
                        after: limit,
                    });
                }
                let _ = tokio::time::timeout(left, rx.changed()).await;
            }
            let s = inner.store();
            Ok((
                Reply::Clock {
                    clock: s.clocks().clock_of(w).unwrap_or(clock),
                    min: s.clocks().min_live(),
                    applied: s.applied_through(),
                },
                Bytes::new(),
            ))
        }
        Request::Init { key, offset } => {
            let values = net::read_f32(recv, head).await?;
            inner.store().init(&key, offset, values);
            Ok((Reply::Ok, Bytes::new()))
        }
        Request::Push { clock, key, offset } => {
            let grad = net::read_f32(recv, head).await?;
            if grad.iter().any(|x| !x.is_finite()) {
                return Err(Error::InvalidArgument(format!(
                    "the gradient pushed for {key:?}[{offset}..] holds NaN or Inf; refused"
                )));
            }
            let mut s = inner.store();
            if !s.clocks().is_live(w) {
                return Ok((not_live(w), Bytes::new()));
            }
            s.push(w, head.header.seq << 16, clock, &key, offset, grad)?;
            Ok((Reply::Ok, Bytes::new()))
        }
        Request::Pull { key, offset, len } => {
            let (applied, data) = {
                let mut s = inner.store();
                let applied = s.applied_through();
                let p = s.pull(&key, offset)?;
                if p.len() as u64 != len {
                    return Err(Error::SpecMismatch(format!(
                        "pull of {len} elements of {key:?}[{offset}..], which holds {}",
                        p.len()
                    )));
                }
                (
                    applied,
                    Bytes::from(bytemuck::cast_slice::<f32, u8>(p).to_vec()),
                )
            };
            Ok((Reply::Data { applied }, data))
        }
        Request::Advance {
            clock,
            staleness,
            wait,
        } => Ok((
            advance_and_wait(inner, w, clock, staleness, wait).await?,
            Bytes::new(),
        )),
        Request::Step {
            clock,
            staleness,
            wait,
            pushes,
            pulls,
        } => {
            if pushes.len() >= 1 << 16 {
                return Err(Error::InvalidArgument(
                    "at most 65535 pushes per step".into(),
                ));
            }
            let total: u64 = pushes.iter().map(|p| p.3).sum();
            if total != head.data_len() {
                return Err(Error::Protocol(format!(
                    "step announces {total} bytes of pushes and carries {}",
                    head.data_len()
                )));
            }
            // Each push straight into its own buffer, the CRC computed on the way.
            let codec = head.header.spec.codec;
            let mut crc = head.crc_start();
            let mut coded = Vec::with_capacity(pushes.len());
            let mut grads = Vec::with_capacity(pushes.len());
            for (key, offset, numel, nbytes) in pushes {
                if codec == Codec::None {
                    if nbytes != numel * 4 || numel > net::MAX_DATA / 4 {
                        return Err(Error::Protocol(format!(
                            "{nbytes} bytes for {numel} float32 elements"
                        )));
                    }
                    let mut g = vec![0f32; numel as usize];
                    net::read_data_crc(recv, bytemuck::cast_slice_mut(&mut g), &mut crc).await?;
                    grads.push((key, offset, g));
                } else {
                    if nbytes > net::MAX_DATA {
                        return Err(Error::Protocol(format!("a push announces {nbytes} bytes")));
                    }
                    let mut enc = vec![0u8; nbytes as usize];
                    net::read_data_crc(recv, &mut enc, &mut crc).await?;
                    coded.push((key, offset, numel, enc));
                }
            }
            // Checked before decoding: damaged codes are resent, not decoded into nonsense.
            head.check_crc(crc)?;
            for (key, offset, numel, enc) in coded {
                grads.push((key, offset, net::decode_f32(codec, &enc, numel)?));
            }
            if let Some((key, offset, _)) = grads
                .iter()
                .find(|(_, _, g)| g.iter().any(|x| !x.is_finite()))
            {
                return Err(Error::InvalidArgument(format!(
                    "the gradient pushed for {key:?}[{offset}..] holds NaN or Inf; refused"
                )));
            }
            {
                let mut s = inner.store();
                if !s.clocks().is_live(w) {
                    return Ok((not_live(w), Bytes::new()));
                }
                let base = head.header.seq << 16;
                for (i, (key, offset, g)) in grads.into_iter().enumerate() {
                    s.push(w, base | i as u64, clock.saturating_sub(1), &key, offset, g)?;
                }
            }
            let rep = advance_and_wait(inner, w, clock, staleness, wait).await?;
            if !matches!(rep, Reply::Clock { .. }) {
                return Ok((rep, Bytes::new()));
            }
            let mut out = Vec::with_capacity(pulls.iter().map(|p| p.2 as usize * 4).sum());
            {
                let mut s = inner.store();
                for (key, offset, len) in &pulls {
                    let p = s.pull(key, *offset)?;
                    if p.len() as u64 != *len {
                        return Err(Error::SpecMismatch(format!(
                            "pull of {len} elements of {key:?}[{offset}..], which holds {}",
                            p.len()
                        )));
                    }
                    out.extend_from_slice(bytemuck::cast_slice::<f32, u8>(p));
                }
            }
            Ok((rep, Bytes::from(out)))
        }
        Request::Claim { wait } => claim(inner, conn_id, worker_slot, wait).await,
        Request::Leave => {
            inner
                .owner
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&w);
            inner.store().leave(w)?;
            inner.bump();
            Ok((Reply::Ok, Bytes::new()))
        }
        Request::Stats => Ok((Reply::Stats(stats(inner)), Bytes::new())),
    }
}

/// Records that connection `conn_id` holds worker id `w` (a newer registration replaces an
/// older one) and wakes the waiters.
fn take_id(inner: &Inner, conn_id: u64, worker_slot: &Mutex<Option<u32>>, w: u32) {
    *worker_slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(w);
    inner
        .owner
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(w, conn_id);
    inner.bump();
}

/// Gives a replacement the lowest vacant worker id (see [`Store::claim`]), waiting up to
/// `wait` for one to fall vacant; the id is registered live on this connection.
async fn claim(
    inner: &Arc<Inner>,
    conn_id: u64,
    worker_slot: &Mutex<Option<u32>>,
    wait: Duration,
) -> Result<(Reply, Bytes)> {
    let expected = u32::try_from(inner.cfg.num_workers).unwrap_or(u32::MAX);
    // A claim sent again (its reply was damaged) gets the id this connection took.
    let held = *worker_slot.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(w) = held {
        let mine = inner
            .owner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&w)
            == Some(&conn_id);
        let s = inner.store();
        if let (true, Some(clock), Some(generation)) =
            (mine, s.clocks().clock_of(w), s.clocks().generation_of(w))
        {
            return Ok((
                Reply::Claimed {
                    worker: w,
                    generation,
                    clock,
                },
                Bytes::new(),
            ));
        }
    }
    let deadline = Instant::now() + wait;
    let mut rx = inner.changed.subscribe();
    loop {
        rx.borrow_and_update();
        let got = inner.store().claim(expected)?;
        if let Some((worker, generation, clock)) = got {
            take_id(inner, conn_id, worker_slot, worker);
            return Ok((
                Reply::Claimed {
                    worker,
                    generation,
                    clock,
                },
                Bytes::new(),
            ));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || inner.closing.load(Ordering::Acquire) {
            return Err(Error::Timeout {
                what: format!(
                    "no vacant worker id: the {expected} workers are live or finished \
                     (an id falls vacant when its worker is dropped as dead)"
                ),
                after: wait,
            });
        }
        let _ = tokio::time::timeout(left, rx.changed()).await;
    }
}

/// Moves worker `w` to `clock` and waits until the SSP condition lets it go on (or `wait`
/// passes: `Timeout`); the reply is `Clock`, or `NotLive` when the worker is not live here.
async fn advance_and_wait(
    inner: &Arc<Inner>,
    w: u32,
    clock: u64,
    staleness: Option<u64>,
    wait: Duration,
) -> Result<Reply> {
    if !inner.store().advance(w, clock)? {
        return Ok(not_live(w));
    }
    inner.bump();
    let deadline = Instant::now() + wait;
    let mut rx = inner.changed.subscribe();
    loop {
        rx.borrow_and_update();
        {
            let mut s = inner.store();
            if !s.clocks().is_live(w) {
                return Ok(not_live(w));
            }
            if s.may_proceed(clock, staleness) {
                return Ok(Reply::Clock {
                    clock: s.clocks().clock_of(w).unwrap_or(clock),
                    min: s.clocks().min_live(),
                    applied: s.applied_through(),
                });
            }
        }
        if inner.closing.load(Ordering::Acquire) {
            return Err(Error::Closed("the parameter server is closing".into()));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let s = inner.store();
            return Err(Error::Timeout {
                what: format!(
                    "worker {w} at clock {clock} waited for the slowest live worker (clock {:?}, staleness {})",
                    s.clocks().min_live(),
                    staleness.unwrap_or(s.staleness())
                ),
                after: wait,
            });
        }
        let _ = tokio::time::timeout(left, rx.changed()).await;
    }
}
