//! A worker's end: connections to every server slot, the shard map, the worker's clock, and
//! push / pull / advance over them. Thread-safe: any number of tasks (or Python threads) may
//! push and pull at once; each request is its own stream.
//!
//! A request that fails because its server is unreachable (killed, restarting, cut off) is
//! retried with exponential backoff and jitter (0.5 s base, 5 s cap) on a fresh connection
//! until the operation's timeout; each fresh connection registers the worker again at its
//! current clock, so a server restored from a checkpoint learns the live workers back.
//!
//! A replacement for a dead worker starts without an id: it claims one from server slot 0
//! (the lowest vacant id, waiting until one falls vacant), takes that worker's place at the
//! slowest live clock, and registers with every other server under the claim's generation.

use super::net::{self, Head};
use super::proto::{ErrorCode, Reply, Request};
use super::shard::{ServerList, ShardMap};
use crate::backoff::Backoff;
use crate::buffer::RawBuf;
use crate::config::TransportSettings;
use crate::error::{Error, Result};
use crate::transport::quic::chaos::{ChaosConfig, ChaosStats};
use crate::transport::quic::{endpoint, map_conn_error, tls};
use crate::wire::{Codec, FrameKind};
use crate::DType;
use bytes::Bytes;
use quinn::{Connection, Endpoint, VarInt};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

/// Resends of a request whose request or reply failed a checksum, before the call fails.
const RESEND_LIMIT: u32 = crate::transport::DEFAULT_RESEND_LIMIT;

/// How a worker connects.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Server addresses by slot.
    pub servers: Vec<SocketAddr>,
    /// This worker's id (0-based, unique in the job); `None` for a replacement, which takes
    /// over a vacant id (and its data shard) from the servers.
    pub worker: Option<u32>,
    /// The job secret.
    pub secret: Vec<u8>,
    /// Bound on every operation, retries included.
    pub timeout: Duration,
    /// A connection silent this long is closed.
    pub dead_after: Duration,
    /// Tensors above this many elements are split across the servers.
    pub split_above: u64,
    /// Faults to inject under QUIC.
    pub chaos: Option<ChaosConfig>,
    /// The transport config (stream limit, MTU, ping interval; its `compression` is
    /// installed by whoever parsed it).
    pub transport: TransportSettings,
}

/// What one server told us about the clocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClockInfo {
    /// Our clock.
    pub clock: u64,
    /// The slowest live worker's clock over all servers (`None`: none live).
    pub min: Option<u64>,
}

struct Slot {
    conn: tokio::sync::Mutex<Option<Connection>>,
}

/// A worker's connection to the parameter servers.
pub struct PsClient {
    cfg: ClientConfig,
    endpoint: Endpoint,
    client_cfg: quinn::ClientConfig,
    list: Mutex<ServerList>,
    slots: Vec<Slot>,
    map: RwLock<Option<Arc<ShardMap>>>,
    clock: AtomicU64,
    /// The worker id (claimed at connect for a replacement).
    worker: AtomicU32,
    /// The id's generation this worker holds (0 unless it claimed the id).
    generation: AtomicU64,
    next_id: AtomicU64,
    closed: AtomicBool,
    kill: Arc<AtomicBool>,
    chaos: Option<Arc<ChaosStats>>,
    retries: AtomicU64,
    reconnects: AtomicU64,
    /// Requests sent again because they or their reply failed a checksum.
    resends: AtomicU64,
    /// Damage to inject into requests (chaos `corrupt=`).
    damage: Option<net::Damage>,
}

/// Where a reply's data section goes.
enum Sink {
    None,
    Into(RawBuf),
    /// The data section, one part after another.
    Parts(Vec<RawBuf>),
}

fn lost_server(slot: usize, op: &str, reason: String) -> Error {
    Error::PeerLost {
        rank: slot,
        op: op.to_string(),
        reason,
    }
}

impl PsClient {
    /// Binds an endpoint and registers with every server; returns once each has answered
    /// (servers answer a first `Register` when all expected workers have registered).
    pub async fn connect(cfg: ClientConfig) -> Result<Arc<PsClient>> {
        if cfg.servers.is_empty() {
            return Err(Error::InvalidArgument("no parameter server given".into()));
        }
        let ip = endpoint::local_ip_towards(cfg.servers[0])?;
        let b = net::bind(
            SocketAddr::new(ip, 0),
            &cfg.secret,
            false,
            cfg.dead_after,
            cfg.chaos,
            &cfg.transport,
        )?;
        let c = Arc::new(PsClient {
            list: Mutex::new(ServerList::new(cfg.servers.clone())),
            slots: cfg
                .servers
                .iter()
                .map(|_| Slot {
                    conn: tokio::sync::Mutex::new(None),
                })
                .collect(),
            endpoint: b.endpoint,
            client_cfg: b.client,
            map: RwLock::new(None),
            clock: AtomicU64::new(0),
            worker: AtomicU32::new(cfg.worker.unwrap_or(u32::MAX)),
            generation: AtomicU64::new(0),
            next_id: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            kill: b.kill,
            chaos: b.chaos,
            retries: AtomicU64::new(0),
            reconnects: AtomicU64::new(0),
            resends: AtomicU64::new(0),
            damage: net::Damage::of(cfg.chaos, u64::from(cfg.worker.unwrap_or(u32::MAX)) + 1),
            cfg,
        });
        let deadline = Instant::now() + c.cfg.timeout;
        if c.cfg.worker.is_none() {
            c.claim(deadline).await?;
        }
        let mut tasks = Vec::new();
        for slot in 0..c.slots.len() {
            let c2 = c.clone();
            tasks.push(tokio::spawn(
                async move { c2.connection(slot, deadline).await },
            ));
        }
        let mut first_err = None;
        for t in tasks {
            let r = t
                .await
                .unwrap_or_else(|e| Err(Error::Io(format!("connect task failed: {e}"))));
            if let (Err(e), None) = (r, &first_err) {
                first_err = Some(e);
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(c),
        }
    }

    /// This worker's id.
    pub fn worker(&self) -> u32 {
        self.worker.load(Ordering::Acquire)
    }

    /// The generation of the id this worker holds (0 unless it claimed a vacant one).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    fn register_request(&self) -> Request {
        Request::Register {
            clock: self.clock(),
            generation: self.generation(),
        }
    }

    /// Claims a vacant worker id from server slot 0 (which serialises claims), waiting
    /// until one falls vacant or `deadline`; the connection it claimed on becomes slot 0's.
    async fn claim(&self, deadline: Instant) -> Result<()> {
        let s = self
            .slots
            .first()
            .ok_or_else(|| Error::InvalidArgument("no parameter server given".into()))?;
        let mut g = s.conn.lock().await;
        let mut backoff = Backoff::default();
        loop {
            if self.closed.load(Ordering::Acquire) {
                return Err(Error::Closed("the worker was closed".into()));
            }
            let addr = self.servers().addrs[0];
            let left = deadline.saturating_duration_since(Instant::now());
            // Held by the server at most this long, so that a lost server is noticed.
            let wait = left.min(Duration::from_secs(5));
            let attempt = async {
                let conn = self.dial(0, addr).await?;
                let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                let rep = self
                    .exchange_small(&conn, 0, id, &Request::Claim { wait })
                    .await?;
                Ok::<_, Error>((conn, rep))
            };
            let res = tokio::time::timeout(wait + Duration::from_secs(5), attempt).await;
            let err = match res {
                Ok(Ok((
                    conn,
                    Reply::Claimed {
                        worker,
                        generation,
                        clock,
                    },
                ))) => {
                    self.worker.store(worker, Ordering::Release);
                    self.generation.store(generation, Ordering::Release);
                    self.clock.fetch_max(clock, Ordering::AcqRel);
                    *g = Some(conn);
                    return Ok(());
                }
                Ok(Ok((conn, Reply::Error { code, message }))) => {
                    conn.close(VarInt::from_u32(0), b"claim refused");
                    let e = Reply::into_error(code, message, &addr.to_string());
                    if code != ErrorCode::Timeout {
                        return Err(e);
                    }
                    // Nothing vacant yet: ask again at once, until the deadline.
                    backoff = Backoff::default();
                    e
                }
                Ok(Ok((conn, other))) => {
                    conn.close(VarInt::from_u32(0), b"bad reply");
                    return Err(Error::Protocol(format!(
                        "unexpected reply to claim: {other:?}"
                    )));
                }
                Ok(Err(
                    e @ (Error::Authentication { .. }
                    | Error::VersionMismatch { .. }
                    | Error::InvalidArgument(_)),
                )) => return Err(e),
                Ok(Err(e)) => {
                    tokio::time::sleep(backoff.next_delay()).await;
                    e
                }
                Err(_) => Error::Timeout {
                    what: format!("claim at parameter server 0 ({addr}): no answer"),
                    after: wait,
                },
            };
            if Instant::now() >= deadline {
                return Err(match err {
                    e @ Error::Timeout { .. } => e,
                    e => lost_server(0, "claim", e.to_string()),
                });
            }
        }
    }

    /// This worker's clock (steps finished).
    pub fn clock(&self) -> u64 {
        self.clock.load(Ordering::Acquire)
    }

    /// The server list's version (bumped by [`PsClient::replace_server`]).
    pub fn servers(&self) -> ServerList {
        self.list.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Points slot `slot` at a new server (a standby restored from the old one's checkpoint).
    pub fn replace_server(&self, slot: usize, addr: SocketAddr) -> Result<()> {
        self.list
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .replace(slot, addr)?;
        if let Some(s) = self.slots.get(slot) {
            if let Ok(mut g) = s.conn.try_lock() {
                if let Some(c) = g.take() {
                    c.close(VarInt::from_u32(0), b"server replaced");
                }
            }
        }
        Ok(())
    }

    /// Builds the shard map of `tensors` (name, elements); every worker must give the same.
    pub fn set_tensors(&self, tensors: &[(String, u64)]) -> Result<Arc<ShardMap>> {
        let m = Arc::new(ShardMap::build(
            self.slots.len(),
            tensors,
            self.cfg.split_above,
        )?);
        *self.map.write().unwrap_or_else(|p| p.into_inner()) = Some(m.clone());
        Ok(m)
    }

    /// Checks one tensor argument of `what` ("push", "pull into", ...) against the
    /// registered tensors: `key` was registered, and `nbytes` of `dtype` hold it whole.
    pub fn check(&self, key: &str, dtype: DType, nbytes: usize, what: &str) -> Result<()> {
        check_in(&*self.shard_map()?, key, dtype, nbytes, what)
    }

    fn shard_map(&self) -> Result<Arc<ShardMap>> {
        self.map
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| {
                Error::InvalidArgument("no tensors registered yet: call init first".into())
            })
    }

    /// Retries and reconnections so far.
    pub fn counters(&self) -> (u64, u64) {
        (
            self.retries.load(Ordering::Relaxed),
            self.reconnects.load(Ordering::Relaxed),
        )
    }

    /// Requests sent again because they or their reply failed a checksum.
    pub fn resends(&self) -> u64 {
        self.resends.load(Ordering::Relaxed)
    }

    /// The fault injector's counters, with chaos.
    pub fn chaos_stats(&self) -> Option<&ChaosStats> {
        self.chaos.as_deref()
    }

    /// Cuts this worker off the network (needs chaos).
    pub fn chaos_kill(&self) -> Result<()> {
        if self.chaos.is_none() {
            return Err(Error::InvalidArgument(
                "the kill switch needs chaos=... at start".into(),
            ));
        }
        self.kill.store(true, Ordering::Release);
        Ok(())
    }

    /// The live connection to `slot`: dialled (with backoff until `deadline`) and registered
    /// when there is none.
    async fn connection(&self, slot: usize, deadline: Instant) -> Result<Connection> {
        let s = self
            .slots
            .get(slot)
            .ok_or_else(|| Error::InvalidArgument(format!("no server slot {slot}")))?;
        let mut g = s.conn.lock().await;
        if let Some(c) = g.as_ref() {
            if c.close_reason().is_none() {
                return Ok(c.clone());
            }
            self.reconnects.fetch_add(1, Ordering::Relaxed);
        }
        *g = None;
        let mut backoff = Backoff::default();
        loop {
            if self.closed.load(Ordering::Acquire) {
                return Err(Error::Closed("the worker was closed".into()));
            }
            let addr = self.servers().addrs[slot];
            let attempt = Duration::from_secs(2)
                .min(deadline.saturating_duration_since(Instant::now()))
                .max(Duration::from_millis(1));
            let res = match tokio::time::timeout(attempt, self.dial(slot, addr)).await {
                Ok(r) => r,
                Err(_) => Err(Error::Timeout {
                    what: format!("handshake with parameter server {slot} at {addr}"),
                    after: attempt,
                }),
            };
            let conn = match res {
                Ok(c) => c,
                Err(
                    e @ (Error::Authentication { .. }
                    | Error::VersionMismatch { .. }
                    | Error::InvalidArgument(_)),
                ) => return Err(e),
                Err(e) => {
                    let wait = backoff.next_delay();
                    if Instant::now() + wait >= deadline {
                        return Err(lost_server(
                            slot,
                            "connect",
                            format!(
                                "parameter server {slot} at {addr} unreachable after {} attempts (last error: {e})",
                                backoff.attempts()
                            ),
                        ));
                    }
                    tokio::time::sleep(wait).await;
                    continue;
                }
            };
            // Register at our clock before anything else goes over this connection.
            let reg = self.register_request();
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(
                left,
                self.exchange_small(
                    &conn,
                    slot,
                    self.next_id.fetch_add(1, Ordering::Relaxed),
                    &reg,
                ),
            )
            .await
            {
                Ok(Ok(Reply::Clock { clock, .. })) => {
                    self.clock.fetch_max(clock, Ordering::AcqRel);
                    *g = Some(conn.clone());
                    return Ok(conn);
                }
                Ok(Ok(Reply::Error { code, message })) => {
                    return Err(Reply::into_error(code, message, &addr.to_string()))
                }
                Ok(Ok(other)) => {
                    return Err(Error::Protocol(format!(
                        "unexpected reply to register: {other:?}"
                    )))
                }
                Ok(Err(e @ Error::PeerLost { .. })) => {
                    let wait = backoff.next_delay();
                    if Instant::now() + wait >= deadline {
                        return Err(lost_server(slot, "register", e.to_string()));
                    }
                    tokio::time::sleep(wait).await;
                }
                Ok(Err(e)) => return Err(e),
                Err(_) => {
                    return Err(Error::Timeout {
                        what: format!("registering with parameter server {slot} at {addr}"),
                        after: self.cfg.timeout,
                    })
                }
            }
        }
    }

    async fn dial(&self, slot: usize, addr: SocketAddr) -> Result<Connection> {
        let connecting = self
            .endpoint
            .connect_with(self.client_cfg.clone(), addr, tls::SERVER_NAME)
            .map_err(|e| Error::Io(format!("cannot connect to {addr}: {e}")))?;
        connecting.await.map_err(|e| {
            map_conn_error(
                &e,
                slot,
                &format!("parameter server {slot} at {addr}"),
                "connect",
            )
        })
    }

    /// One request and its reply on a new stream of `conn`.
    #[allow(clippy::too_many_arguments)]
    async fn exchange(
        &self,
        conn: &Connection,
        slot: usize,
        id: u64,
        req: &Request,
        codec: Codec,
        numel: u64,
        data: Bytes,
        sink: Sink,
    ) -> Result<Reply> {
        let conn_err = |e: quinn::ConnectionError| {
            map_conn_error(&e, slot, &format!("parameter server {slot}"), req.name())
        };
        let (mut send, mut recv) = conn.open_bi().await.map_err(conn_err)?;
        let mut meta = Vec::new();
        req.encode_meta(&mut meta)?;
        net::write_msg(
            &mut send,
            FrameKind::PsRequest,
            id,
            self.worker(),
            req.op(),
            codec,
            numel,
            &meta,
            data,
            self.damage.as_ref(),
        )
        .await?;
        let head: Head = net::read_head(&mut recv, FrameKind::PsReply).await?;
        let rep = match Reply::decode(head.header.aux, &head.meta) {
            Ok(r) => r,
            Err(e) => {
                // Damaged metadata reads as nonsense: the checksum tells which it is.
                head.drain_checked(&mut recv).await?;
                return Err(e);
            }
        };
        match (&rep, sink) {
            (Reply::Data { .. }, Sink::Into(buf)) => {
                if head.data_len() != buf.len() as u64 {
                    return Err(Error::Protocol(format!(
                        "server sent {} bytes for a {}-byte piece",
                        head.data_len(),
                        buf.len()
                    )));
                }
                // SAFETY: `buf` is the caller's piece of its destination, exclusively ours
                // for the duration of the operation (see `pull`).
                let dst = unsafe { buf.slice_mut(0..buf.len()) };
                let mut crc = head.crc_start();
                net::read_data_crc(&mut recv, dst, &mut crc).await?;
                head.check_crc(crc)?;
            }
            (Reply::Clock { .. }, Sink::Parts(parts)) => {
                let want: u64 = parts.iter().map(|p| p.len() as u64).sum();
                if head.data_len() != want {
                    return Err(Error::Protocol(format!(
                        "server sent {} bytes for {want} bytes of pieces",
                        head.data_len()
                    )));
                }
                let mut crc = head.crc_start();
                for p in &parts {
                    // SAFETY: each part is a disjoint range of the caller's destinations,
                    // exclusively ours for the duration of the operation (see `step_all`).
                    let dst = unsafe { p.slice_mut(0..p.len()) };
                    net::read_data_crc(&mut recv, dst, &mut crc).await?;
                }
                head.check_crc(crc)?;
            }
            _ => {
                if head.data_len() != 0 {
                    return Err(Error::Protocol("unexpected data in a reply".into()));
                }
                head.verify(&[])?;
            }
        }
        Ok(rep)
    }

    /// [`PsClient::exchange`] of a request without data, sent again (same id) while it or
    /// its reply fails a checksum, at most [`RESEND_LIMIT`] times.
    async fn exchange_small(
        &self,
        conn: &Connection,
        slot: usize,
        id: u64,
        req: &Request,
    ) -> Result<Reply> {
        let mut tries = 0;
        loop {
            let r = self
                .exchange(
                    conn,
                    slot,
                    id,
                    req,
                    Codec::None,
                    0,
                    Bytes::new(),
                    Sink::None,
                )
                .await;
            let damaged = matches!(
                &r,
                Err(Error::Damaged(_))
                    | Ok(Reply::Error {
                        code: ErrorCode::Damaged,
                        ..
                    })
            );
            if !damaged || tries >= RESEND_LIMIT {
                return r;
            }
            tries += 1;
            self.resends.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A request to `slot` with retries (fresh connection, backoff) until `deadline`. A
    /// `NotLive` answer registers again and retries at once.
    #[allow(clippy::too_many_arguments)]
    async fn call(
        &self,
        slot: usize,
        req: Request,
        codec: Codec,
        numel: u64,
        data: Bytes,
        sink: impl Fn() -> Sink,
        deadline: Instant,
    ) -> Result<Reply> {
        let mut backoff = Backoff::default();
        // One id for every attempt: a server that took the first one ignores a retry.
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut forgotten = 0;
        let mut damaged = 0;
        loop {
            let conn = self.connection(slot, deadline).await?;
            // Bounded even if a server stops answering on a live connection; a server holds
            // an `Advance` at most until the deadline, so allow it a little beyond.
            let left = deadline.saturating_duration_since(Instant::now()) + Duration::from_secs(5);
            let r = match tokio::time::timeout(
                left,
                self.exchange(&conn, slot, id, &req, codec, numel, data.clone(), sink()),
            )
            .await
            {
                Ok(r) => r,
                Err(_) => Err(Error::Timeout {
                    what: format!("{} on parameter server {slot}: no answer", req.name()),
                    after: left,
                }),
            };
            // The request or its reply failed a checksum: the same request again, at once.
            let damage = match &r {
                Ok(Reply::Error {
                    code: ErrorCode::Damaged,
                    message,
                }) => Some(message.clone()),
                Err(Error::Damaged(m)) => Some(m.clone()),
                _ => None,
            };
            if let Some(m) = damage {
                damaged += 1;
                if damaged > RESEND_LIMIT {
                    return Err(Error::Protocol(format!(
                        "{} with parameter server {slot}: {m}; it failed {damaged} times and {RESEND_LIMIT} resends did not repair it (resend limit {RESEND_LIMIT})",
                        req.name()
                    )));
                }
                self.resends.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let retry = match r {
                Ok(Reply::Error {
                    code: ErrorCode::NotLive,
                    ..
                }) if forgotten < 5 => {
                    // The server forgot us (restored, or dropped us as dead): register again
                    // on this connection (other requests may be using it) and retry.
                    forgotten += 1;
                    self.retries.fetch_add(1, Ordering::Relaxed);
                    let reg = self.register_request();
                    let rid = self.next_id.fetch_add(1, Ordering::Relaxed);
                    match self.exchange_small(&conn, slot, rid, &reg).await {
                        Ok(Reply::Clock { clock, .. }) => {
                            self.clock.fetch_max(clock, Ordering::AcqRel);
                        }
                        Ok(Reply::Error { code, message }) => {
                            return Err(Reply::into_error(code, message, &format!("{slot}")))
                        }
                        _ => {}
                    }
                    continue;
                }
                Ok(Reply::Error { code, message }) => {
                    return Err(Reply::into_error(
                        code,
                        message,
                        &format!("{slot} ({})", self.servers().addrs[slot]),
                    ))
                }
                Ok(rep) => return Ok(rep),
                Err(e @ Error::PeerLost { .. }) => e,
                // Our side closed the connection (the server was replaced): retry, unless
                // the worker itself is closing.
                Err(e @ Error::Closed(_)) if !self.closed.load(Ordering::Acquire) => e,
                Err(e) => return Err(e),
            };
            self.retries.fetch_add(1, Ordering::Relaxed);
            let wait = backoff.next_delay();
            if self.closed.load(Ordering::Acquire) {
                return Err(Error::Closed("the worker was closed".into()));
            }
            if Instant::now() + wait >= deadline {
                return Err(lost_server(
                    slot,
                    req.name(),
                    format!("gave up after {} attempts: {retry}", backoff.attempts()),
                ));
            }
            tokio::time::sleep(wait).await;
        }
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.cfg.timeout
    }

    /// Creates every piece of `key` on its server from `src` (f32), unless it exists.
    pub async fn init(self: &Arc<Self>, key: &str, src: RawBuf) -> Result<()> {
        self.scatter(key, src, true, Codec::None).await
    }

    /// Pushes `grad` (f32, the whole tensor `key`) for the current clock, encoded with
    /// `codec`. Returns once every server holding a piece has taken it.
    pub async fn push(self: &Arc<Self>, key: &str, grad: RawBuf, codec: Codec) -> Result<()> {
        self.scatter(key, grad, false, codec).await
    }

    async fn scatter(
        self: &Arc<Self>,
        key: &str,
        src: RawBuf,
        init: bool,
        codec: Codec,
    ) -> Result<()> {
        let map = self.shard_map()?;
        let what = if init { "init" } else { "push" };
        check_in(&map, key, DType::F32, src.len(), what)?;
        let deadline = self.deadline();
        let clock = self.clock();
        let mut tasks = Vec::new();
        for p in map.pieces(key)? {
            let range = (p.offset * 4) as usize..((p.offset + p.len) * 4) as usize;
            // SAFETY: `src` is valid for reads for the whole operation (its creator's
            // contract); every task reads its own range and is awaited before we return.
            let bytes = unsafe { src.slice(range) };
            let data = if codec == Codec::None || init {
                Bytes::copy_from_slice(bytes)
            } else {
                let mut enc = Vec::new();
                crate::codec::encode(codec, DType::F32, bytes, &mut enc)?;
                Bytes::from(enc)
            };
            let req = if init {
                Request::Init {
                    key: key.to_string(),
                    offset: p.offset,
                }
            } else {
                Request::Push {
                    clock,
                    key: key.to_string(),
                    offset: p.offset,
                }
            };
            let me = self.clone();
            let (slot, n) = (p.server, p.len);
            let codec = if init { Codec::None } else { codec };
            tasks.push(tokio::spawn(async move {
                me.call(slot, req, codec, n, data, || Sink::None, deadline)
                    .await
            }));
        }
        join(tasks).await.map(|_| ())
    }

    /// Pulls tensor `key` (f32) into `dst`; returns the oldest applied clock among its
    /// pieces' servers.
    pub async fn pull(self: &Arc<Self>, key: &str, dst: RawBuf) -> Result<u64> {
        let map = self.shard_map()?;
        check_in(&map, key, DType::F32, dst.len(), "pull into")?;
        let deadline = self.deadline();
        let mut tasks = Vec::new();
        for p in map.pieces(key)? {
            let range = (p.offset * 4) as usize..((p.offset + p.len) * 4) as usize;
            // SAFETY: `dst` is valid for writes for the whole operation (its creator's
            // contract); the pieces' ranges are disjoint and every task is awaited before
            // we return, error or not.
            let part = unsafe { RawBuf::from_slice(dst.slice_mut(range)) };
            let req = Request::Pull {
                key: key.to_string(),
                offset: p.offset,
                len: p.len,
            };
            let me = self.clone();
            let slot = p.server;
            tasks.push(tokio::spawn(async move {
                me.call(
                    slot,
                    req,
                    Codec::None,
                    0,
                    Bytes::new(),
                    || Sink::Into(part),
                    deadline,
                )
                .await
            }));
        }
        let reps = join(tasks).await?;
        Ok(reps
            .iter()
            .filter_map(|r| match r {
                Reply::Data { applied } => Some(*applied),
                _ => None,
            })
            .min()
            .unwrap_or(0))
    }

    /// [`PsClient::init`] of several tensors at once.
    pub async fn init_all(self: &Arc<Self>, items: Vec<(String, RawBuf)>) -> Result<()> {
        self.each(
            items,
            |me, k, b| async move { me.init(&k, b).await.map(|_| 0) },
        )
        .await
        .map(|_| ())
    }

    /// [`PsClient::push`] of several tensors at once.
    pub async fn push_all(
        self: &Arc<Self>,
        items: Vec<(String, RawBuf)>,
        codec: Codec,
    ) -> Result<()> {
        self.each(items, move |me, k, b| async move {
            me.push(&k, b, codec).await.map(|_| 0)
        })
        .await
        .map(|_| ())
    }

    /// [`PsClient::pull`] of several tensors at once; the oldest applied clock among them.
    pub async fn pull_all(self: &Arc<Self>, items: Vec<(String, RawBuf)>) -> Result<u64> {
        let v = self
            .each(items, |me, k, b| async move { me.pull(&k, b).await })
            .await?;
        Ok(v.into_iter().min().unwrap_or(0))
    }

    async fn each<F, Fut>(self: &Arc<Self>, items: Vec<(String, RawBuf)>, f: F) -> Result<Vec<u64>>
    where
        F: Fn(Arc<PsClient>, String, RawBuf) -> Fut,
        Fut: std::future::Future<Output = Result<u64>> + Send + 'static,
    {
        let tasks: Vec<_> = items
            .into_iter()
            .map(|(k, b)| tokio::spawn(f(self.clone(), k, b)))
            .collect();
        join(tasks).await
    }

    /// Finishes the current clock: moves to the next and waits until every server lets us
    /// go on under the staleness bound (the server's, or `staleness` for this wait: 0 makes
    /// it a barrier after which every worker reads the same parameters).
    pub async fn advance(self: &Arc<Self>, staleness: Option<u64>) -> Result<ClockInfo> {
        let clock = self.clock.fetch_add(1, Ordering::AcqRel) + 1;
        let deadline = self.deadline();
        let mut tasks = Vec::new();
        for slot in 0..self.slots.len() {
            let me = self.clone();
            let req = Request::Advance {
                clock,
                staleness,
                wait: self.cfg.timeout,
            };
            tasks.push(tokio::spawn(async move {
                me.call(
                    slot,
                    req,
                    Codec::None,
                    0,
                    Bytes::new(),
                    || Sink::None,
                    deadline,
                )
                .await
            }));
        }
        let reps = join(tasks).await?;
        Ok(ClockInfo {
            clock,
            min: slowest_clock(&reps),
        })
    }

    /// Push, advance and pull in one round trip per server: pushes `grads` (f32 tensors)
    /// for the current clock, moves to the next clock, waits under the staleness bound as
    /// [`PsClient::advance`] does, then reads the tensors `into`.
    pub async fn step_all(
        self: &Arc<Self>,
        grads: Vec<(String, RawBuf)>,
        into: Vec<(String, RawBuf)>,
        codec: Codec,
        staleness: Option<u64>,
    ) -> Result<ClockInfo> {
        let map = self.shard_map()?;
        let n = self.slots.len();
        let mut pushes: Vec<Vec<(String, u64, u64, u64)>> = vec![Vec::new(); n];
        let mut data: Vec<Vec<u8>> = vec![Vec::new(); n];
        let mut pulls: Vec<Vec<(String, u64, u64)>> = vec![Vec::new(); n];
        let mut parts: Vec<Vec<RawBuf>> = vec![Vec::new(); n];
        let check = |key: &str, buf: &RawBuf, what: &str| -> Result<()> {
            check_in(&map, key, DType::F32, buf.len(), what)
        };
        for (key, buf) in &grads {
            check(key, buf, "push")?;
            for p in map.pieces(key)? {
                let range = (p.offset * 4) as usize..((p.offset + p.len) * 4) as usize;
                // SAFETY: `buf` is valid for reads during the operation (its creator's
                // contract); we only read it here, before anything is sent.
                let bytes = unsafe { buf.slice(range) };
                let d = &mut data[p.server];
                let before = d.len();
                if codec == Codec::None {
                    d.extend_from_slice(bytes);
                } else {
                    let mut enc = Vec::new();
                    crate::codec::encode(codec, DType::F32, bytes, &mut enc)?;
                    d.extend_from_slice(&enc);
                }
                let nbytes = (d.len() - before) as u64;
                pushes[p.server].push((key.clone(), p.offset, p.len, nbytes));
            }
        }
        for (key, buf) in &into {
            check(key, buf, "pull into")?;
            for p in map.pieces(key)? {
                let range = (p.offset * 4) as usize..((p.offset + p.len) * 4) as usize;
                // SAFETY: `buf` is valid for writes during the operation (its creator's
                // contract); the pieces' ranges are disjoint and every task is awaited.
                let part = unsafe { RawBuf::from_slice(buf.slice_mut(range)) };
                pulls[p.server].push((key.clone(), p.offset, p.len));
                parts[p.server].push(part);
            }
        }
        let clock = self.clock.fetch_add(1, Ordering::AcqRel) + 1;
        let deadline = self.deadline();
        let mut tasks = Vec::new();
        for (slot, ((push, d), (pull, part))) in pushes
            .into_iter()
            .zip(data)
            .zip(pulls.into_iter().zip(parts))
            .enumerate()
        {
            let me = self.clone();
            let req = Request::Step {
                clock,
                staleness,
                wait: self.cfg.timeout,
                pushes: push,
                pulls: pull,
            };
            let d = Bytes::from(d);
            tasks.push(tokio::spawn(async move {
                me.call(
                    slot,
                    req,
                    codec,
                    0,
                    d,
                    || Sink::Parts(part.clone()),
                    deadline,
                )
                .await
            }));
        }
        let reps = join(tasks).await?;
        Ok(ClockInfo {
            clock,
            min: slowest_clock(&reps),
        })
    }

    /// Each server's counters, by slot.
    pub async fn stats(self: &Arc<Self>) -> Result<Vec<Vec<(String, u64)>>> {
        let deadline = self.deadline();
        let mut out = Vec::new();
        for slot in 0..self.slots.len() {
            match self
                .call(
                    slot,
                    Request::Stats,
                    Codec::None,
                    0,
                    Bytes::new(),
                    || Sink::None,
                    deadline,
                )
                .await?
            {
                Reply::Stats(kv) => out.push(kv),
                other => {
                    return Err(Error::Protocol(format!(
                        "unexpected reply to stats: {other:?}"
                    )))
                }
            }
        }
        Ok(out)
    }

    /// Leaves the job (servers drop us from the minimum at once) and closes the endpoint.
    pub async fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        for (slot, s) in self.slots.iter().enumerate() {
            let conn = s.conn.lock().await.clone();
            if let Some(c) = conn.filter(|c| c.close_reason().is_none()) {
                let _ = tokio::time::timeout(
                    Duration::from_millis(500),
                    self.exchange_small(
                        &c,
                        slot,
                        self.next_id.fetch_add(1, Ordering::Relaxed),
                        &Request::Leave,
                    ),
                )
                .await;
            }
        }
        self.endpoint.close(
            VarInt::from_u32(crate::transport::quic::close_code::GOODBYE),
            b"worker closed",
        );
        let _ = tokio::time::timeout(Duration::from_secs(1), self.endpoint.wait_idle()).await;
    }
}

/// The slowest worker clock over the servers' `Clock` replies (servers that know none are
/// left out).
fn slowest_clock(reps: &[Reply]) -> Option<u64> {
    reps.iter()
        .filter_map(|r| match r {
            Reply::Clock { min, .. } => *min,
            _ => None,
        })
        .min()
}

/// Awaits every task (all of them, even after a failure, since they may use the caller's
/// buffers) and returns their replies or the first error.
async fn join<T>(tasks: Vec<tokio::task::JoinHandle<Result<T>>>) -> Result<Vec<T>> {
    let mut out = Vec::with_capacity(tasks.len());
    let mut err = None;
    for t in tasks {
        match t.await {
            Ok(Ok(r)) => out.push(r),
            Ok(Err(e)) => {
                err.get_or_insert(e);
            }
            Err(e) => {
                err.get_or_insert(Error::Io(format!("a parameter-server task failed: {e}")));
            }
        }
    }
    match err {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

/// The servers hold float32 tensors of the sizes registered with [`PsClient::set_tensors`].
fn check_in(map: &ShardMap, key: &str, dtype: DType, nbytes: usize, what: &str) -> Result<()> {
    let numel = map.numel(key).ok_or_else(|| {
        Error::UnknownName(format!(
            "{what}: no tensor {key:?} was registered with init()"
        ))
    })?;
    if dtype != DType::F32 {
        return Err(Error::WrongDType(format!(
            "{what}[{key:?}]: the parameter server holds float32 tensors, got {dtype}"
        )));
    }
    if nbytes as u64 != numel * 4 {
        return Err(Error::InvalidArgument(format!(
            "{what}[{key:?}]: {} float32 elements, but it was registered with {numel}",
            nbytes / 4
        )));
    }
    Ok(())
}
