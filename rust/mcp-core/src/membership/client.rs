//! A member's side of the membership protocol over QUIC: it registers with the coordinator
//! (again on every new connection, with the epoch it runs in, from which a restarted
//! coordinator rebuilds its state), heartbeats from a task of its own, and waits for epochs.
//! The decisions and the heartbeat timer are [`MemberSession`]'s; this is its driver.
//!
//! When a heartbeat's answer says the epoch this member runs in is over (a member died or
//! left, or this one was expelled), the abort hook installed with [`MemberClient::watch`]
//! runs at once, so that a collective blocked on a dead peer fails now rather than at the
//! data plane's own failure detector.

use super::coordinator::Beat;
use super::server::alpn;
use super::session::{MemberSession, SessionEvent};
use super::wire::{Reply, Request, MAX_BODY};
use super::{Epoch, MemberId, Step};
use crate::backoff::Backoff;
use crate::error::{Error, Result};
use crate::transport::quic::{endpoint, map_conn_error, tls};
use quinn::{Connection, Endpoint};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A member's settings.
#[derive(Debug, Clone)]
pub struct MemberConfig {
    /// The coordinator's address.
    pub coordinator: SocketAddr,
    /// The job secret.
    pub secret: Vec<u8>,
    /// This process's id (random; see [`MemberId`]).
    pub id: MemberId,
    /// Names, dtypes and shapes of its training state, `;`-separated.
    pub spec: String,
    /// Interval between heartbeats (the coordinator's `dead_after` should be 3 of them).
    pub heartbeat: Duration,
    /// How long [`MemberClient::connect`] tries to reach the coordinator.
    pub connect_timeout: Duration,
}

/// Runs once when the watched epoch ends.
pub type AbortHook = Box<dyn FnOnce() + Send>;

struct Inner {
    cfg: MemberConfig,
    endpoint: Endpoint,
    client_cfg: quinn::ClientConfig,
    conn: tokio::sync::Mutex<Option<Connection>>,
    /// The tether of the current registration (see [`Reply::Welcome`]).
    tether: Mutex<Option<tokio::net::TcpStream>>,
    session: Mutex<MemberSession>,
    /// The coordinator's last word, for [`MemberClient::ended`].
    beat: tokio::sync::watch::Sender<Option<Beat>>,
    /// The abort hook of the watched epoch.
    hook: Mutex<Option<(u64, AbortHook)>>,
    closed: AtomicBool,
    reconnects: AtomicU64,
}

/// A member's connection to the coordinator.
#[derive(Clone)]
pub struct MemberClient {
    inner: Arc<Inner>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl MemberClient {
    /// Reaches the coordinator and registers; starts the heartbeats. Fails with
    /// `Authentication` for another job secret, `SpecMismatch` for a training state that is
    /// not the job's, `Timeout` when the coordinator cannot be reached.
    pub async fn connect(cfg: MemberConfig) -> Result<MemberClient> {
        let session = MemberSession::new(cfg.id, cfg.spec.clone(), cfg.heartbeat, Instant::now())?;
        let ip = endpoint::local_ip_towards(cfg.coordinator)?;
        let b = endpoint::control_endpoint(
            SocketAddr::new(ip, 0),
            &cfg.secret,
            false,
            Duration::from_secs(10),
            None,
            alpn(),
            16,
            &Default::default(),
        )?;
        let c = MemberClient {
            inner: Arc::new(Inner {
                endpoint: b.endpoint,
                client_cfg: b.client,
                conn: tokio::sync::Mutex::new(None),
                tether: Mutex::new(None),
                session: Mutex::new(session),
                beat: tokio::sync::watch::channel(None).0,
                hook: Mutex::new(None),
                closed: AtomicBool::new(false),
                reconnects: AtomicU64::new(0),
                cfg,
            }),
        };
        let deadline = Instant::now() + c.inner.cfg.connect_timeout;
        c.connection(deadline).await?;
        tokio::spawn(heartbeats(Arc::downgrade(&c.inner)));
        Ok(c)
    }

    /// This member's id.
    pub fn id(&self) -> MemberId {
        self.inner.cfg.id
    }

    /// Records the steps committed (sent with every heartbeat).
    pub fn set_step(&self, step: Step) {
        lock(&self.inner.session).set_step(step);
    }

    /// The last heartbeat answer.
    pub fn beat(&self) -> Option<Beat> {
        *self.inner.beat.borrow()
    }

    /// Resolves once the coordinator says `epoch` is over: joining that epoch's group (its
    /// rendezvous, the heal) is raced against it, so that a member dying during a change
    /// sends the others to the next epoch at once.
    pub async fn ended(&self, epoch: u64) {
        let mut rx = self.inner.beat.subscribe();
        let _ = rx.wait_for(|b| b.is_some_and(|b| b.ends(epoch))).await;
    }

    /// Heartbeats answered, and connections made again after one broke.
    pub fn counters(&self) -> (u64, u64) {
        (
            lock(&self.inner.session).answered(),
            self.inner.reconnects.load(Ordering::Relaxed),
        )
    }

    /// Runs `hook` once the coordinator says `epoch` is over (at once if it already said
    /// so). Besides the heartbeats, a request held by the coordinator until the epoch ends
    /// brings the news as soon as there is any.
    pub fn watch(&self, epoch: u64, hook: AbortHook) {
        // The hook's lock is held while the session decides, so that an answer arriving
        // meanwhile finds the hook once it is stored (see `fire`).
        let mut hooked = lock(&self.inner.hook);
        if lock(&self.inner.session).watch(epoch).is_some() {
            drop(hooked);
            hook();
            return;
        }
        *hooked = Some((epoch, hook));
        drop(hooked);
        tokio::spawn(watch_epoch(Arc::downgrade(&self.inner), epoch));
    }

    /// Removes the abort hook.
    pub fn unwatch(&self) {
        lock(&self.inner.session).unwatch();
        lock(&self.inner.hook).take();
    }

    /// Forgets the epoch this member ran in (it was expelled: it will rejoin as new).
    pub fn forget_view(&self) {
        lock(&self.inner.session).forget_view();
    }

    /// Waits until the coordinator forms an epoch newer than `seen` with this member in it;
    /// `step` is what this member has ([`NO_STATE`] for nothing). Retries through a
    /// coordinator that is down or restarting, until `timeout`.
    pub async fn report(&self, seen: u64, step: Step, timeout: Duration) -> Result<Epoch> {
        let deadline = Instant::now() + timeout;
        self.set_step(step);
        let mut backoff = Backoff::new(Duration::from_millis(20), Duration::from_millis(500));
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout {
                    what: format!(
                        "waiting for the coordinator at {} to admit this member to a new epoch (are there enough members? is the coordinator up?)",
                        self.inner.cfg.coordinator
                    ),
                    after: timeout,
                });
            }
            let req = lock(&self.inner.session).report(seen, left.min(Duration::from_secs(2)));
            match self.request(&req, deadline).await {
                Ok(reply) => {
                    if let Some(e) = lock(&self.inner.session).on_report_answer(reply)? {
                        return Ok(e);
                    }
                }
                Err(e @ (Error::Authentication { .. } | Error::SpecMismatch(_))) => return Err(e),
                Err(_) => tokio::time::sleep(backoff.next_delay()).await,
            }
        }
    }

    /// Rank 0 of `epoch` tells where it listens. `false`: the epoch was superseded.
    pub async fn publish_master(
        &self,
        epoch: u64,
        addr: SocketAddr,
        timeout: Duration,
    ) -> Result<bool> {
        let deadline = Instant::now() + timeout;
        let req = Request::PublishMaster {
            id: self.id(),
            epoch,
            addr: addr.to_string(),
        };
        let mut backoff = Backoff::new(Duration::from_millis(20), Duration::from_millis(500));
        loop {
            match self.request(&req, deadline).await {
                Ok(Reply::Ok) => return Ok(true),
                Ok(Reply::Superseded) => return Ok(false),
                Ok(other) => return Err(unexpected("publish", &other)),
                Err(e) if Instant::now() >= deadline => return Err(e),
                Err(_) => tokio::time::sleep(backoff.next_delay()).await,
            }
        }
    }

    /// Where rank 0 of `epoch` listens; `None` once the epoch is over (superseded, or ending
    /// before rank 0 published).
    pub async fn master(&self, epoch: u64, timeout: Duration) -> Result<Option<String>> {
        let deadline = Instant::now() + timeout;
        let mut backoff = Backoff::new(Duration::from_millis(20), Duration::from_millis(500));
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout {
                    what: format!("waiting for rank 0 of epoch {epoch} to publish its address"),
                    after: timeout,
                });
            }
            let req = Request::Master {
                epoch,
                wait_ms: left.min(Duration::from_secs(2)).as_millis() as u32,
            };
            let answer = tokio::select! {
                r = self.request(&req, deadline) => r,
                () = self.ended(epoch) => return Ok(None),
            };
            match answer {
                Ok(Reply::MasterAt(a)) => return Ok(Some(a)),
                Ok(Reply::Superseded) => return Ok(None),
                Ok(Reply::Waiting) => {}
                Ok(other) => return Err(unexpected("master", &other)),
                Err(_) => tokio::time::sleep(backoff.next_delay()).await,
            }
        }
    }

    /// Leaves the job (best effort) and stops the heartbeats.
    pub async fn leave(&self) {
        if self.inner.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        let deadline = Instant::now() + Duration::from_secs(1);
        let _ = self
            .request(&Request::Leave { id: self.id() }, deadline)
            .await;
        lock(&self.inner.tether).take();
        self.inner
            .endpoint
            .close(quinn::VarInt::from_u32(0), b"member left");
    }

    async fn connection(&self, deadline: Instant) -> Result<Connection> {
        let mut g = self.inner.conn.lock().await;
        if let Some(c) = g.as_ref() {
            if c.close_reason().is_none() {
                return Ok(c.clone());
            }
            self.inner.reconnects.fetch_add(1, Ordering::Relaxed);
        }
        *g = None;
        let addr = self.inner.cfg.coordinator;
        let who = format!("coordinator at {addr}");
        let mut backoff = Backoff::new(Duration::from_millis(20), Duration::from_millis(500));
        loop {
            let attempt = async {
                let conn = self
                    .inner
                    .endpoint
                    .connect_with(self.inner.client_cfg.clone(), addr, tls::SERVER_NAME)
                    .map_err(|e| Error::Io(format!("cannot connect to {who}: {e}")))?
                    .await
                    .map_err(|e| map_conn_error(&e, usize::MAX, &who, "connect"))?;
                let reg = lock(&self.inner.session).register();
                let reply = exchange(&conn, &reg, &who).await?;
                lock(&self.inner.session).on_registered(&reply)?;
                if let Reply::Welcome {
                    token,
                    tether: true,
                } = reply
                {
                    self.tie(token).await;
                }
                Ok(conn)
            };
            let left = deadline.saturating_duration_since(Instant::now());
            let res = match tokio::time::timeout(left.max(Duration::from_millis(1)), attempt).await
            {
                Ok(r) => r,
                Err(_) => Err(Error::Timeout {
                    what: format!("reaching the {who}"),
                    after: self.inner.cfg.connect_timeout,
                }),
            };
            match res {
                Ok(conn) => {
                    *g = Some(conn.clone());
                    return Ok(conn);
                }
                Err(e @ (Error::Authentication { .. } | Error::SpecMismatch(_))) => return Err(e),
                Err(e) => {
                    let wait = backoff.next_delay();
                    if Instant::now() + wait >= deadline {
                        return Err(match e {
                            Error::Timeout { .. } => e,
                            other => Error::Timeout {
                                what: format!("reaching the {who}: {other}"),
                                after: self.inner.cfg.connect_timeout,
                            },
                        });
                    }
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }

    /// Opens the tether of a registration: a TCP connection to the coordinator's port that
    /// names `token` and then stays open while this process lives. Best effort: without
    /// it, the coordinator finds a dead process by heartbeat silence.
    async fn tie(&self, token: [u8; 16]) {
        let addr = self.inner.cfg.coordinator;
        let stream = tokio::time::timeout(Duration::from_secs(2), async {
            let s = tokio::net::TcpStream::connect(addr).await.ok()?;
            let mut sent = 0;
            while sent < token.len() {
                s.writable().await.ok()?;
                match s.try_write(&token[sent..]) {
                    Ok(n) => sent += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                    Err(_) => return None,
                }
            }
            Some(s)
        })
        .await
        .ok()
        .flatten();
        *lock(&self.inner.tether) = stream;
    }

    async fn request(&self, req: &Request, deadline: Instant) -> Result<Reply> {
        if self.inner.closed.load(Ordering::Acquire) && !matches!(req, Request::Leave { .. }) {
            return Err(Error::Closed("the member left the job".into()));
        }
        let conn = self.connection(deadline).await?;
        let who = format!("coordinator at {}", self.inner.cfg.coordinator);
        let hold = match req {
            Request::Report { wait_ms, .. } | Request::Master { wait_ms, .. } => {
                Duration::from_millis(u64::from(*wait_ms))
            }
            _ => Duration::ZERO,
        };
        let limit = (deadline.saturating_duration_since(Instant::now()) + hold)
            .max(Duration::from_millis(10));
        match tokio::time::timeout(limit, exchange(&conn, req, &who)).await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(e)) => {
                conn.close(quinn::VarInt::from_u32(0), b"request failed");
                Err(e)
            }
            Err(_) => Err(Error::Timeout {
                what: format!("an answer from the {who}"),
                after: limit,
            }),
        }
    }
}

async fn exchange(conn: &Connection, req: &Request, who: &str) -> Result<Reply> {
    let (mut send, mut recv) = conn
        .open_bi()
        .await
        .map_err(|e| map_conn_error(&e, usize::MAX, who, "request"))?;
    send.write_all(&req.encode())
        .await
        .map_err(|e| Error::Io(format!("request to the {who}: {e}")))?;
    let _ = send.finish();
    let buf = recv
        .read_to_end(MAX_BODY + 12)
        .await
        .map_err(|e| Error::Io(format!("answer from the {who}: {e}")))?;
    Reply::decode(&buf)
}

fn unexpected(what: &str, r: &Reply) -> Error {
    Error::Protocol(format!("the coordinator answered {what} with {r:?}"))
}

/// The coordinator's word from a watch: tells the waiters and the session.
fn deliver(inner: &Inner, b: Beat) {
    inner.beat.send_replace(Some(b));
    let event = lock(&inner.session).on_beat(b);
    if let Some(SessionEvent::EpochEnded(epoch)) = event {
        fire(inner, epoch);
    }
}

/// Runs the abort hook of `epoch`, if it is the one installed.
fn fire(inner: &Inner, epoch: u64) {
    let hook = {
        let mut h = lock(&inner.hook);
        match h.take() {
            Some((e, hook)) if e == epoch => Some(hook),
            other => {
                *h = other;
                None
            }
        }
    };
    if let Some(h) = hook {
        h();
    }
}

/// Keeps a `Watch` request for `epoch` at the coordinator while this member runs in it.
async fn watch_epoch(inner: std::sync::Weak<Inner>, epoch: u64) {
    loop {
        let client = {
            let Some(i) = inner.upgrade() else { return };
            let watching = lock(&i.session).watched() == Some(epoch);
            if !watching || i.closed.load(Ordering::Acquire) {
                return;
            }
            MemberClient { inner: i }
        };
        let req = Request::Watch {
            id: client.id(),
            epoch,
            wait_ms: 2000,
        };
        match client
            .request(&req, Instant::now() + Duration::from_secs(1))
            .await
        {
            Ok(Reply::Beat(b)) => deliver(&client.inner, b),
            _ => tokio::time::sleep(client.inner.cfg.heartbeat).await,
        }
    }
}

/// Sends the session's heartbeats when they are due and acts on what their answers say.
async fn heartbeats(inner: std::sync::Weak<Inner>) {
    loop {
        let (due, client) = {
            let Some(i) = inner.upgrade() else { return };
            if i.closed.load(Ordering::Acquire) {
                return;
            }
            let mut s = lock(&i.session);
            let due = match s.poll_heartbeat(Instant::now()) {
                Some(req) => Ok((req, s.answer_limit())),
                None => Err(s.poll_timeout()),
            };
            drop(s);
            (due, MemberClient { inner: i })
        };
        let (req, limit) = match due {
            Ok(r) => r,
            Err(wake) => {
                drop(client);
                let at = wake.unwrap_or_else(|| Instant::now() + Duration::from_millis(1));
                tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await;
                continue;
            }
        };
        let answer = client.request(&req, Instant::now() + limit).await;
        if let Ok(Reply::Beat(b)) = &answer {
            client.inner.beat.send_replace(Some(*b));
        }
        let events = lock(&client.inner.session).on_heartbeat_answer(Instant::now(), answer);
        for event in events {
            match event {
                SessionEvent::EpochEnded(epoch) => fire(&client.inner, epoch),
                SessionEvent::Reconnect => {
                    if let Some(c) = client.inner.conn.lock().await.take() {
                        c.close(quinn::VarInt::from_u32(0), b"no answer");
                    }
                }
            }
        }
    }
}
