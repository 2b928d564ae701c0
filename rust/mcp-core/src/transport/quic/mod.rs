//! The QUIC transport: one endpoint per process, one mutually authenticated connection per
//! pair of ranks that talk (made when first needed, by the higher rank), one unidirectional
//! stream per frame, so that chunks travel side by side and never wait behind each other.

mod bulk;
pub mod chaos;
pub mod congestion;
#[cfg(test)]
mod congestion_two_way;
pub(crate) mod endpoint;
mod gso_limit;
mod heartbeat;
mod link_mtu;
mod local;
mod reconnect;
mod rendezvous;
mod stream_lane;
pub mod tls;

pub use bulk::{BulkConfig, LanePolicy, BULK_MAGIC};
pub use congestion::CongestionKind;
pub use heartbeat::{PathFigures, PeerHealth};
pub use stream_lane::{OK_VERDICT_DELAY, RETAIN_BYTES};

/// The local address the kernel would use to reach `target` (no packet is sent).
pub fn local_ip_towards(target: std::net::SocketAddr) -> Result<std::net::IpAddr> {
    endpoint::local_ip_towards(target)
}

use super::{Frame, Mailbox, MsgKey, SeqSpace, Transport, DEFAULT_RESEND_LIMIT, MAX_RESENDS};
use crate::backoff::Backoff;
use crate::error::{Error, Result};
use crate::wire::{FrameKind, Header, PROTOCOL_MAJOR, PROTOCOL_MINOR};
use quinn::{Connection, ConnectionError, Endpoint, VarInt};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Application close codes on our connections.
pub(crate) mod close_code {
    /// The peer speaks another protocol major version; the reason holds ours.
    pub const VERSION_MISMATCH: u32 = 0x4d01;
    /// A data connection came without a client certificate.
    pub const AUTH_REQUIRED: u32 = 0x4d02;
    /// The process closed its group.
    pub const GOODBYE: u32 = 0x4d03;
    /// The bootstrap exchange is over.
    pub const BOOTSTRAP_DONE: u32 = 0x4d04;
    /// The rendezvous refused this process (duplicate rank, other world size).
    pub const REFUSED: u32 = 0x4d05;
    /// Rank 0 gave up on the rendezvous (a rank never came); the reason says which.
    pub const RENDEZVOUS_FAILED: u32 = 0x4d06;
    /// The heartbeat monitor declared the peer lost.
    pub const PEER_SILENT: u32 = 0x4d07;
    /// The connection was dropped to be established again (a path reset): not a loss.
    pub const PATH_RESET: u32 = 0x4d08;
    /// The rendezvous found ranks that declare different models; the reason names both.
    pub const MODEL_MISMATCH: u32 = 0x4d09;
}

/// The progress watchdog's limit in intervals between operations (see `QuicConfig`).
const STALL_FACTOR: u32 = 10;

/// Largest payload a frame may announce; anything larger is a protocol error.
pub const MAX_FRAME_PAYLOAD: u64 = 1 << 30;

/// QUIC send priority of control frames and verdicts; data streams keep the default 0 and
/// are sent in the order they were opened (`send_fairness(false)`).
pub(crate) const CONTROL_PRIORITY: i32 = 1;

/// [`QuicConfig::max_streams`] by default.
pub const DEFAULT_MAX_STREAMS: u32 = 16_384;

/// How to set up the QUIC transport of one process.
#[derive(Debug, Clone)]
pub struct QuicConfig {
    /// This process's rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Where rank 0 listens (rank 0 binds it; the others connect to it).
    pub master: SocketAddr,
    /// The job secret; `None` lets rank 0 generate one and hand it out at the rendezvous,
    /// which is allowed on loopback only unless `allow_generated_secret` (see the README).
    pub secret: Option<Vec<u8>>,
    /// With no `secret` on an address other than loopback: rank 0 hands the secret it
    /// generates to whoever reaches its port during the rendezvous. Off by default there.
    pub allow_generated_secret: bool,
    /// How long the rendezvous may take.
    pub connect_timeout: Duration,
    /// A connection with no packets for this long is closed by QUIC (a backstop: the
    /// heartbeat monitor usually declares a silent peer lost much sooner).
    pub idle_timeout: Duration,
    /// Heartbeat interval: a PING every `heartbeat`; a peer silent for 3 of them plus
    /// max(1 s, 1.3 x mean RTT) is declared lost.
    pub heartbeat: Duration,
    /// The protocol major version to announce (tests set another to check refusal).
    pub protocol_major: u8,
    /// The protocol minor version to announce (tests set another to check refusal).
    pub protocol_minor: u8,
    /// Faults to inject under QUIC (loss, delay, rate cap, ...) and corruption of frame
    /// payloads above it; `None` for a clean socket.
    pub chaos: Option<chaos::ChaosConfig>,
    /// The bulk (FEC) lane: which frames take it, and its block shape.
    pub bulk: BulkConfig,
    /// The congestion controller of every connection (default: `MCP_CC`, else
    /// loss-tolerant).
    pub congestion: CongestionKind,
    /// How often a receiver asks for a frame again whose checksum failed before it fails
    /// the operation (at most [`MAX_RESENDS`]; default [`DEFAULT_RESEND_LIMIT`]).
    pub resend_limit: u32,
    /// The progress watchdog's floor: a reachable peer that keeps this rank waiting in an
    /// operation it has not started, for `max(stall_timeout, 10 x p99` of the intervals
    /// between this rank's operations`)`, is reported stalled (default 60 s).
    pub stall_timeout: Duration,
    /// Reconnections resume the TLS session and send their first frames as 0-RTT data
    /// (default on; off, a reconnection makes a full handshake first).
    pub zero_rtt: bool,
    /// Frames to peers on this host go through shared memory (default: on unless
    /// `MCP_SHM=0`; always off with `chaos`, whose faults sit under QUIC).
    pub shm: bool,
    /// Data bytes of each direction's shared-memory ring (default `MCP_SHM_RING_BYTES` or
    /// [`shm::DEFAULT_RING_BYTES`](crate::transport::shm::DEFAULT_RING_BYTES)).
    pub shm_ring_bytes: usize,
    /// The all-reduce among the ranks of one host reads the peers' tensors directly
    /// (cross-memory attach) instead of passing frames through the rings (default: on unless
    /// `MCP_SHM_DIRECT=0`; the kernel may refuse it, and then the rings are used).
    pub shm_direct: bool,
    /// This process's host identity; `None` computes it (`MCP_HOST_ID`, else host name,
    /// network namespace and boot id: see [`host`](crate::transport::host)).
    pub host_id: Option<String>,
    /// The model this rank declares, in its canonical text
    /// ([`ModelDecl::canonical`](crate::model_decl::ModelDecl::canonical)); the rendezvous
    /// refuses the job on every rank when two ranks' declarations differ (default none).
    pub model_decl: Option<String>,
    /// QUIC's concurrent stream limits per connection, each kind (default 16,384). Each
    /// stream-lane frame holds a bidirectional stream until its verdict and each FEC-lane
    /// transfer one until the receiver has it: at the limit, the next send waits for a
    /// stream to finish (it does not fail), so a low value slows sends down.
    pub max_streams: u32,
    /// A fixed datagram size for the path: quinn's initial and minimum MTU and the MTU
    /// discovery's upper bound (e.g. 1440 inside containers). `None` (the default) discovers
    /// the path MTU.
    pub mtu: Option<u16>,
}

/// `MCP_SHM`: anything but `0` (or unset) leaves shared memory on.
fn shm_from_env() -> bool {
    std::env::var("MCP_SHM").map_or(true, |v| v.trim() != "0")
}

/// `MCP_SHM_DIRECT`: anything but `0` (or unset) leaves direct reads on.
fn shm_direct_from_env() -> bool {
    std::env::var("MCP_SHM_DIRECT").map_or(true, |v| v.trim() != "0")
}

/// `MCP_SHM_RING_BYTES`, or the default; a value that is not a number reads as 0 (refused
/// at connect, naming the setting).
fn ring_bytes_from_env() -> usize {
    match std::env::var("MCP_SHM_RING_BYTES") {
        Ok(v) => v.trim().parse().unwrap_or(0),
        Err(_) => crate::transport::shm::DEFAULT_RING_BYTES,
    }
}

impl QuicConfig {
    /// A configuration with the default timeouts.
    pub fn new(rank: usize, world_size: usize, master: SocketAddr) -> QuicConfig {
        QuicConfig {
            rank,
            world_size,
            master,
            secret: None,
            allow_generated_secret: false,
            connect_timeout: Duration::from_secs(300),
            idle_timeout: Duration::from_secs(30),
            heartbeat: Duration::from_secs(5),
            protocol_major: PROTOCOL_MAJOR,
            protocol_minor: PROTOCOL_MINOR,
            chaos: None,
            bulk: BulkConfig::default(),
            congestion: CongestionKind::from_env(),
            resend_limit: DEFAULT_RESEND_LIMIT,
            stall_timeout: Duration::from_secs(60),
            zero_rtt: true,
            shm: shm_from_env(),
            shm_ring_bytes: ring_bytes_from_env(),
            shm_direct: shm_direct_from_env(),
            host_id: None,
            model_decl: None,
            max_streams: DEFAULT_MAX_STREAMS,
            mtu: None,
        }
    }
}

struct PeerSlot {
    conn: watch::Sender<Option<Connection>>,
    /// (RTT, silence, silence limit) as the heartbeat monitor last saw them.
    health: Mutex<Option<(Duration, Duration, Duration)>>,
    dial: tokio::sync::Mutex<()>,
    /// Frames written to this peer; the goodbye carries the count so that the peer reads
    /// every one of them before it lets go of us.
    sent: AtomicU64,
    /// Frames received from this peer on its connections that broke (the goodbye's count
    /// covers them too).
    carried: AtomicU64,
    /// Sends to this peer under way over QUIC. When the peer says goodbye, our side of the
    /// connection closes only once they are done: the peer may have its frame already (an
    /// FEC-lane frame decodes before its last parity shards are queued) and left because its
    /// last operation had what it needed, and closing under the send would fail it here.
    sending: AtomicUsize,
    /// Loss measured on the path to this peer, and datagrams queued to it.
    path: Mutex<bulk::PathLoss>,
}

impl PeerSlot {
    /// Counts a send to this peer as under way until the guard is dropped.
    fn sending_guard(&self) -> SendingGuard<'_> {
        self.sending.fetch_add(1, Ordering::SeqCst);
        SendingGuard(&self.sending)
    }
}

/// A send under way to one peer (see [`PeerSlot::sending`]).
struct SendingGuard<'a>(&'a AtomicUsize);

impl Drop for SendingGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Counters that tests and diagnostics read.
#[derive(Debug, Default)]
pub struct QuicStats {
    /// Handshakes refused (wrong secret, no certificate, other version).
    pub refused_handshakes: AtomicU64,
    /// Frames received.
    pub frames_received: AtomicU64,
    /// Frames received whose header or payload failed its checksum (each failed attempt).
    pub corrupt_frames: AtomicU64,
    /// Frames sent again because the receiver found them damaged (checksum).
    pub retransmits: AtomicU64,
    /// Payloads the fault injector damaged on purpose (`chaos` `corrupt=`), sent or, in
    /// memory-error windows, received: what the checksums must catch.
    pub chaos_damaged: AtomicU64,
    /// Frames sent.
    pub frames_sent: AtomicU64,
    /// Frame bytes (headers and payloads) handed to QUIC.
    pub bytes_sent: AtomicU64,
    /// Frame bytes received.
    pub bytes_received: AtomicU64,
    /// Frames sent over the FEC lane (datagrams), included in `frames_sent`.
    pub bulk_frames_sent: AtomicU64,
    /// FEC-lane transfers whose repairs could not finish them, carried on a stream instead.
    pub bulk_fallbacks: AtomicU64,
    /// Frames received over the FEC lane, included in `frames_received`.
    pub bulk_frames_received: AtomicU64,
    /// Shards sent again because a receiver asked (NACK).
    pub repair_shards: AtomicU64,
    /// Connections that broke while their peer lived and were dialled or awaited again.
    pub reconnects: AtomicU64,
    /// Frames sent again on a new connection because the one they went on broke before the
    /// receiver acknowledged them (a stream-lane verdict or an FEC-lane DONE).
    pub resumed_frames: AtomicU64,
    /// Reconnections whose 0-RTT data the peer accepted (resumed sessions).
    pub zero_rtt_accepted: AtomicU64,
    /// Reconnections whose 0-RTT data the peer refused (it had no session: a full handshake
    /// followed, and what was sent early went again).
    pub zero_rtt_rejected: AtomicU64,
    /// Frames sent through shared memory (not in `frames_sent`).
    pub shm_frames_sent: AtomicU64,
    /// Frame bytes (headers and payloads) written into shared memory.
    pub shm_bytes_sent: AtomicU64,
    /// Frames received through shared memory (not in `frames_received`).
    pub shm_frames_received: AtomicU64,
    /// Frame bytes read out of shared memory.
    pub shm_bytes_received: AtomicU64,
    /// Operations (or hierarchical phases) whose data this rank read straight from its
    /// local peers' tensors.
    pub direct_ops: AtomicU64,
    /// Operations that would have read directly but ran through the rings, because some
    /// rank could not read a peer (the kernel refused, `MCP_SHM_DIRECT=0`, no channel).
    pub direct_fallbacks: AtomicU64,
}

/// Where every rank runs, as the rendezvous told.
#[derive(Debug, Clone)]
struct Topology {
    host_ids: Vec<String>,
    host_of_rank: Vec<usize>,
    pids: Vec<u32>,
    shm: Vec<bool>,
}

/// One process's end of the QUIC mesh.
pub struct QuicTransport {
    rank: usize,
    world: usize,
    cfg: QuicConfig,
    me: Weak<QuicTransport>,
    endpoint: Endpoint,
    client_cfg: quinn::ClientConfig,
    server_cfg: quinn::ServerConfig,
    /// What the transport configurations need to know of the endpoint's socket.
    sock: endpoint::SocketFigures,
    /// The largest round trip measured to a peer at the rendezvous: later handshakes time
    /// their loss recovery by it (see [`endpoint::transport_config_after`]).
    path_rtt: Mutex<Option<Duration>>,
    secret: Vec<u8>,
    bootstrap_open: AtomicBool,
    addrs: Mutex<Vec<Option<SocketAddr>>>,
    peers: Vec<PeerSlot>,
    mailbox: Mailbox,
    closing: AtomicBool,
    unacked_streams: AtomicUsize,
    stats: QuicStats,
    chaos_kill: Arc<AtomicBool>,
    chaos_killed_for_good: AtomicBool,
    chaos_stats: Option<Arc<chaos::ChaosStats>>,
    breakers: Mutex<crate::health::PeerBreakers>,
    corrupter: Option<Mutex<rand::rngs::StdRng>>,
    /// When this transport started: `chaos` memory-error windows count from here.
    started: Instant,
    next_transfer: AtomicU64,
    /// Room for frames kept until their receiver's verdict (see `stream_lane`).
    retained: Arc<tokio::sync::Semaphore>,
    /// Buffers for the copies of those frames (see `stream_lane::SEND_BUFFERS`).
    send_bufs: crate::transport::buffer_pool::BufferPool,
    /// This rank's progress and its peers' reports.
    progress: Mutex<crate::health::ProgressWatch>,
    /// Connections this process dropped to have them re-established (`chaos_reset`).
    reset_here: Mutex<std::collections::HashSet<usize>>,
    /// How long the last reconnection took.
    last_reconnect: Mutex<Option<Duration>>,
    /// This process's host identity.
    host_id: String,
    /// Every rank's host, once the rendezvous is over.
    topology: watch::Sender<Option<Arc<Topology>>>,
    /// The shared-memory channel to each peer on this host that has one.
    shm_links: Vec<std::sync::OnceLock<crate::transport::shm::Link>>,
    /// The local peers whose tensors this rank agreed to read directly.
    known_reads: crate::transport::peer_memory::KnownReads,
    /// Peers of this host reached over QUIC instead, and why.
    shm_fallbacks: Mutex<Vec<(usize, String)>>,
}

impl QuicTransport {
    /// Binds, meets the other ranks at the rendezvous and returns once every rank's endpoint
    /// is known. Fails with `Timeout` if they do not all arrive within `connect_timeout`.
    pub async fn connect(cfg: QuicConfig) -> Result<Arc<QuicTransport>> {
        Self::connect_with(cfg, |_| Ok(())).await
    }

    /// As [`QuicTransport::connect`], calling `bound` with this process's listening address
    /// before the rendezvous: rank 0 can bind port 0 and publish the port it got (through a
    /// torch Store, say) for the others to dial.
    pub async fn connect_with(
        cfg: QuicConfig,
        bound: impl FnOnce(SocketAddr) -> Result<()>,
    ) -> Result<Arc<QuicTransport>> {
        if cfg.world_size == 0 || cfg.rank >= cfg.world_size {
            return Err(Error::InvalidArgument(format!(
                "rank {} is not in a world of {} ranks",
                cfg.rank, cfg.world_size
            )));
        }
        if cfg.secret.is_none() && !cfg.master.ip().is_loopback() && !cfg.allow_generated_secret {
            return Err(Error::InvalidArgument(format!(
                "no job secret, and {} is not a loopback address: rank 0 would hand a generated secret to whoever reaches its port during the rendezvous. Set the same secret on every rank (MCP_SECRET=$(openssl rand -hex 32), or secret=...), or opt in to the generated one on a network you trust (MCP_ALLOW_GENERATED_SECRET=1 or allow_generated_secret=True)",
                cfg.master
            )));
        }
        if cfg.stall_timeout.is_zero() {
            return Err(Error::InvalidArgument(
                "stall_timeout must be positive".into(),
            ));
        }
        if cfg.shm {
            crate::transport::shm::check_ring_bytes(cfg.shm_ring_bytes)?;
        }
        let host_id = match &cfg.host_id {
            Some(h) => {
                crate::transport::host::check_host_id(h)?;
                h.clone()
            }
            None => crate::transport::host::local_host_id()?,
        };
        if cfg.resend_limit > MAX_RESENDS {
            return Err(Error::InvalidArgument(format!(
                "resend_limit {} is more than the {MAX_RESENDS} a receiver may ask for",
                cfg.resend_limit
            )));
        }
        let deadline = Instant::now() + cfg.connect_timeout;
        let (secret, generated) = match &cfg.secret {
            Some(s) => (s.clone(), false),
            None if cfg.rank == 0 => (rand::random::<[u8; 32]>().to_vec(), true),
            None => (rendezvous::fetch_secret(&cfg, deadline).await?, false),
        };
        let identity = tls::Identity::from_secret(&secret)?;
        let bind = if cfg.rank == 0 {
            cfg.master
        } else {
            SocketAddr::new(endpoint::local_ip_towards(cfg.master)?, 0)
        };
        let sock = endpoint::bind_socket(bind, cfg.rank == 0)?;
        let mut alpns = vec![
            tls::alpn_for(cfg.protocol_major, cfg.protocol_minor),
            tls::ALPN_FALLBACK.to_vec(),
        ];
        let client_cfg = endpoint::client_config(&identity, alpns.clone(), &cfg, &sock)?;
        if generated {
            alpns.push(tls::ALPN_BOOTSTRAP.to_vec());
        }
        let server_cfg = endpoint::server_config(&identity, alpns, &cfg, &sock)?;
        let sock_figures = sock.figures();
        let chaos_kill = Arc::new(AtomicBool::new(false));
        let (ep, chaos_stats) = endpoint::endpoint(
            sock,
            Some(server_cfg.clone()),
            cfg.chaos,
            chaos_kill.clone(),
            sock_figures.max_datagram(&cfg),
        )?;
        let corrupter = cfg.chaos.filter(|c| c.corrupt > 0.0).map(|c| {
            Mutex::new(<rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(
                c.seed ^ cfg.rank as u64,
            ))
        });
        let world = cfg.world_size;
        let t = Arc::new_cyclic(|me| QuicTransport {
            rank: cfg.rank,
            world,
            cfg: cfg.clone(),
            me: me.clone(),
            endpoint: ep,
            client_cfg,
            server_cfg,
            sock: sock_figures,
            path_rtt: Mutex::new(None),
            secret,
            bootstrap_open: AtomicBool::new(generated),
            addrs: Mutex::new(vec![None; world]),
            peers: (0..world)
                .map(|_| PeerSlot {
                    conn: watch::channel(None).0,
                    health: Mutex::new(None),
                    dial: tokio::sync::Mutex::new(()),
                    sent: AtomicU64::new(0),
                    carried: AtomicU64::new(0),
                    sending: AtomicUsize::new(0),
                    path: Mutex::new(bulk::PathLoss::default()),
                })
                .collect(),
            mailbox: Mailbox::new(),
            closing: AtomicBool::new(false),
            unacked_streams: AtomicUsize::new(0),
            stats: QuicStats::default(),
            chaos_kill,
            chaos_killed_for_good: AtomicBool::new(false),
            chaos_stats,
            breakers: Mutex::new(crate::health::PeerBreakers::new(world, Default::default())),
            corrupter,
            started: Instant::now(),
            next_transfer: AtomicU64::new(1),
            retained: Arc::new(tokio::sync::Semaphore::new(stream_lane::retain_budget())),
            send_bufs: stream_lane::send_buffers(),
            progress: Mutex::new(crate::health::ProgressWatch::new(
                world,
                cfg.stall_timeout,
                STALL_FACTOR,
            )),
            reset_here: Mutex::new(std::collections::HashSet::new()),
            last_reconnect: Mutex::new(None),
            host_id,
            topology: watch::channel(None).0,
            shm_links: (0..world).map(|_| std::sync::OnceLock::new()).collect(),
            known_reads: Default::default(),
            shm_fallbacks: Mutex::new(Vec::new()),
        });
        tokio::spawn(accept_loop(Arc::downgrade(&t)));
        let shm_accepts = local::listen(&t);
        let res = match t.local_addr().and_then(bound) {
            Ok(()) => rendezvous::run(&t, deadline).await,
            Err(e) => Err(e),
        };
        t.bootstrap_open.store(false, Ordering::Release);
        if let Err(e) = res {
            if let Some((task, _)) = shm_accepts {
                task.abort();
            }
            // The others learn why, also those that have not read the table yet.
            let (code, reason) = match &e {
                Error::SpecMismatch(m) => (close_code::MODEL_MISMATCH, m.clone()),
                other => (close_code::RENDEZVOUS_FAILED, other.to_string()),
            };
            t.endpoint.close(VarInt::from_u32(code), reason.as_bytes());
            return Err(e);
        }
        t.learn_path_rtt();
        local::setup(&t, shm_accepts).await;
        Ok(t)
    }

    /// After the rendezvous: the largest round trip to a peer so far becomes the estimate
    /// that new connections, dialed or accepted, start their handshake with.
    fn learn_path_rtt(&self) {
        let rtt = (0..self.world)
            .filter_map(|p| self.peers[p].conn.borrow().as_ref().map(Connection::rtt))
            .max();
        let Some(rtt) = rtt else { return };
        *self.path_rtt.lock().unwrap_or_else(|p| p.into_inner()) = Some(rtt);
        if let Ok(tc) = endpoint::transport_config_after(&self.cfg, self.sock, rtt) {
            let mut server = self.server_cfg.clone();
            server.transport_config(tc);
            self.endpoint.set_server_config(Some(server));
        }
    }

    /// The client configuration of a new connection: with the handshake's RTT estimate once
    /// the rendezvous has measured the path.
    fn dial_config(&self) -> quinn::ClientConfig {
        let rtt = *self.path_rtt.lock().unwrap_or_else(|p| p.into_inner());
        let mut c = self.client_cfg.clone();
        if let Some(tc) =
            rtt.and_then(|r| endpoint::transport_config_after(&self.cfg, self.sock, r).ok())
        {
            c.transport_config(tc);
        }
        c
    }

    fn progress_watch(&self) -> std::sync::MutexGuard<'_, crate::health::ProgressWatch> {
        self.progress.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// This rank's progress as its peers hear it: collective operations started, finished.
    pub fn progress(&self) -> crate::health::Progress {
        self.progress_watch().local()
    }

    /// The address this process listens on.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self.endpoint.local_addr()?)
    }

    /// The lane policy of this transport.
    pub fn lane(&self) -> LanePolicy {
        self.cfg.bulk.policy
    }

    /// Counters of refused handshakes, frames and corrupt payloads.
    pub fn stats(&self) -> &QuicStats {
        &self.stats
    }

    /// Streams sent that the peers have not acknowledged yet: stream-lane frames until their
    /// verdict, control frames until QUIC delivered them. Shutdown waits for none to be left.
    pub fn unacknowledged_streams(&self) -> usize {
        self.unacked_streams.load(Ordering::Acquire)
    }

    /// The job secret (generated by rank 0 when none was given).
    pub fn secret(&self) -> &[u8] {
        &self.secret
    }

    /// Smoothed round-trip time to `peer`, if connected.
    pub fn rtt(&self, peer: usize) -> Option<Duration> {
        self.peers
            .get(peer)?
            .conn
            .borrow()
            .as_ref()
            .map(|c| c.rtt())
    }

    /// Counts one frame of `wire_len` bytes as sent to `peer`, on either lane: the per-peer
    /// count is what the goodbye announces, so that the peer reads every frame before closing.
    pub(super) fn count_sent(&self, peer: usize, wire_len: usize) {
        if let Some(slot) = self.peers.get(peer) {
            slot.sent.fetch_add(1, Ordering::AcqRel);
        }
        self.count_wire(wire_len);
    }

    /// Counts one frame of `wire_len` bytes in the statistics only: one the peer need not
    /// read before it closes.
    fn count_wire(&self, wire_len: usize) {
        self.stats.frames_sent.fetch_add(1, Ordering::Relaxed);
        self.stats
            .bytes_sent
            .fetch_add(wire_len as u64, Ordering::Relaxed);
    }

    /// Cuts this process off the network (chaos kill switch): every datagram in and out is
    /// dropped from now on, as if the host had vanished. Only with a chaos configuration.
    pub fn chaos_kill(&self) -> Result<()> {
        if self.chaos_stats.is_none() {
            return Err(Error::InvalidArgument(
                "the kill switch needs chaos=... at init".into(),
            ));
        }
        self.chaos_killed_for_good.store(true, Ordering::Release);
        self.chaos_kill.store(true, Ordering::Release);
        Ok(())
    }

    /// Cuts this process off the network for `d` (chaos): every datagram in and out is
    /// dropped meanwhile, as in a link flap, then the path is back by itself. Returns at once
    /// (call it inside the runtime). Only with a chaos configuration; a
    /// [`chaos_kill`](Self::chaos_kill) meanwhile is not undone.
    pub fn chaos_cut(&self, d: Duration) -> Result<()> {
        if self.chaos_stats.is_none() {
            return Err(Error::InvalidArgument(
                "a cut needs chaos=... at init".into(),
            ));
        }
        let rt = tokio::runtime::Handle::try_current()
            .map_err(|_| Error::InvalidArgument("chaos_cut runs inside the runtime".into()))?;
        self.chaos_kill.store(true, Ordering::Release);
        let me = self.me.clone();
        rt.spawn(async move {
            tokio::time::sleep(d).await;
            if let Some(t) = me.upgrade() {
                if !t.chaos_killed_for_good.load(Ordering::Acquire) {
                    t.chaos_kill.store(false, Ordering::Release);
                }
            }
        });
        Ok(())
    }

    /// Drops every connection of this process at once, as a middlebox that lost its state
    /// (or a NAT that rebound) would: the connections are re-established (the TLS session
    /// resumed, 0-RTT) and the operations in flight resume from what was acknowledged. For
    /// tests and drills; needs no chaos configuration.
    pub fn chaos_reset(&self) {
        for slot in &self.peers {
            let conn = slot.conn.borrow().clone();
            if let Some(c) = conn {
                self.reset_here
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(c.stable_id());
                c.close(VarInt::from_u32(close_code::PATH_RESET), b"path reset");
            }
        }
    }

    /// Copies of frames already filed that were dropped (sent again across a reconnection).
    pub fn mailbox_duplicates(&self) -> u64 {
        self.mailbox.duplicates()
    }

    /// How long the last reconnection took (from the break to the new connection), if any.
    pub fn last_reconnect(&self) -> Option<Duration> {
        *self
            .last_reconnect
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// The fault injector's counters, when chaos is configured.
    pub fn chaos_stats(&self) -> Option<&chaos::ChaosStats> {
        self.chaos_stats.as_deref()
    }

    /// Path statistics of the connection to `peer` (RTT, congestion window, MTU, packets
    /// lost and sent), if connected.
    pub fn path_stats(&self, peer: usize) -> Option<quinn::PathStats> {
        self.peers
            .get(peer)?
            .conn
            .borrow()
            .as_ref()
            .map(|c| c.stats().path)
    }

    fn register(&self, peer: usize, conn: Connection) {
        if let Some(slot) = self.peers.get(peer) {
            slot.conn.send_replace(Some(conn.clone()));
            tokio::spawn(heartbeat::monitor(
                self.me.clone(),
                peer,
                conn,
                self.cfg.heartbeat,
            ));
        }
    }

    /// Whether `conn` is the connection registered for `peer` now.
    fn is_current(&self, peer: usize, conn: &Connection) -> bool {
        self.peers.get(peer).is_some_and(|slot| {
            slot.conn
                .borrow()
                .as_ref()
                .is_some_and(|c| c.stable_id() == conn.stable_id())
        })
    }

    fn note_health(&self, peer: usize, rtt: Duration, silent: Duration, limit: Duration) {
        if let Some(slot) = self.peers.get(peer) {
            *slot.health.lock().unwrap_or_else(|p| p.into_inner()) = Some((rtt, silent, limit));
        }
    }

    /// What this rank knows of every other rank: connected or not, lost (and why), RTT,
    /// time since last heard from.
    pub fn health(&self) -> Vec<PeerHealth> {
        (0..self.world)
            .filter(|&p| p != self.rank)
            .map(|p| {
                let slot = &self.peers[p];
                let path = slot.conn.borrow().as_ref().map(PathFigures::of);
                let connected = path.is_some() || self.shm_link(p).is_some();
                let seen = *slot.health.lock().unwrap_or_else(|e| e.into_inner());
                let lost = self.mailbox.peer_error(p);
                PeerHealth {
                    rank: p,
                    state: if lost.is_some() {
                        "lost"
                    } else if connected {
                        "connected"
                    } else {
                        "not connected"
                    },
                    rtt: seen.map(|s| s.0),
                    last_seen: seen.map(|s| s.1),
                    silence_limit: seen.map(|s| s.2),
                    reason: lost.map(|e| e.to_string()),
                    path,
                }
            })
            .collect()
    }

    fn addr_of(&self, peer: usize) -> Option<SocketAddr> {
        self.addrs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(peer)
            .copied()
            .flatten()
    }

    fn slot(&self, peer: usize) -> Result<&PeerSlot> {
        self.peers.get(peer).ok_or_else(|| {
            Error::InvalidArgument(format!("no rank {peer} in a world of {}", self.world))
        })
    }

    /// The live connection to `peer`: dialled by the higher rank, awaited by the lower one.
    async fn conn(&self, peer: usize) -> Result<Connection> {
        let slot = self.slot(peer)?;
        if let Some(e) = self.mailbox.gone_error(peer) {
            return Err(e);
        }
        if let Some(c) = slot.conn.borrow().clone() {
            return Ok(c);
        }
        if self.rank > peer {
            let _g = slot.dial.lock().await;
            if let Some(c) = slot.conn.borrow().clone() {
                return Ok(c);
            }
            let addr = self
                .addr_of(peer)
                .ok_or_else(|| Error::Io(format!("address of rank {peer} unknown")))?;
            let deadline = Instant::now() + self.cfg.connect_timeout.min(Duration::from_secs(60));
            let conn = self.dial_with_backoff(peer, addr, deadline, true).await?;
            Ok(conn)
        } else {
            let mut rx = slot.conn.subscribe();
            loop {
                if let Some(c) = rx.borrow_and_update().clone() {
                    return Ok(c);
                }
                if let Some(e) = self.mailbox.peer_error(peer) {
                    return Err(e);
                }
                if self.closing.load(Ordering::Acquire) {
                    return Err(Error::Closed(format!(
                        "this process closed its group while waiting for rank {peer} to connect"
                    )));
                }
                if rx.changed().await.is_err() {
                    return Err(Error::Closed("transport dropped".into()));
                }
            }
        }
    }

    /// Dials `peer` again after its connection broke (see [`reconnect`]), unless a send did
    /// meanwhile; until `deadline`.
    async fn redial(&self, peer: usize, deadline: Instant) -> Result<Connection> {
        let slot = self.slot(peer)?;
        let _g = slot.dial.lock().await;
        if let Some(c) = slot.conn.borrow().clone() {
            return Ok(c);
        }
        let addr = self
            .addr_of(peer)
            .ok_or_else(|| Error::Io(format!("address of rank {peer} unknown")))?;
        self.dial_with_backoff(peer, addr, deadline, false).await
    }

    /// The connection to use instead of `failed`, whose stream failed: the same one while it
    /// lives (a refused 0-RTT flight is sent again on it), else the one that replaces it,
    /// waited for up to the reconnection budget. Fails when the peer is lost meanwhile.
    pub(super) async fn next_conn(&self, peer: usize, failed: &Connection) -> Result<Connection> {
        let slot = self.slot(peer)?;
        let mut rx = slot.conn.subscribe();
        let wait = async {
            loop {
                if let Some(e) = self.mailbox.peer_error(peer) {
                    return Err(e);
                }
                if self.closing.load(Ordering::Acquire) {
                    return Err(Error::Closed("this process closed its group".into()));
                }
                let now = rx.borrow_and_update().clone();
                match now {
                    Some(c) if c.stable_id() != failed.stable_id() => return Ok(c),
                    Some(c) if c.close_reason().is_none() => return Ok(c),
                    _ => {}
                }
                if rx.changed().await.is_err() {
                    return Err(Error::Closed("transport dropped".into()));
                }
            }
        };
        // The broken connection's reader notices its end and starts the reconnection; a
        // little more than its budget covers both.
        let limit = reconnect::budget(self.cfg.heartbeat) + Duration::from_secs(1);
        match tokio::time::timeout(limit, wait).await {
            Ok(r) => r,
            Err(_) => Err(self.mailbox.peer_error(peer).unwrap_or(Error::PeerLost {
                rank: peer,
                op: "send".into(),
                reason: format!(
                    "the connection broke and no new one came within {:.1} s",
                    limit.as_secs_f64()
                ),
            })),
        }
    }

    /// Dials `peer` at `addr`, retrying with backoff until `deadline`; sends our Hello and
    /// starts reading the connection.
    /// With `breaker`, a peer's circuit breaker guards the attempts: after 3 consecutive
    /// failures it opens and dials fail at once until its cool-down ends, when one probe goes
    /// through (the rendezvous goes without: ranks may start minutes apart).
    async fn dial_with_backoff(
        &self,
        peer: usize,
        addr: SocketAddr,
        deadline: Instant,
        breaker: bool,
    ) -> Result<Connection> {
        let mut backoff = Backoff::default();
        loop {
            if let Some(e) = self.mailbox.gone_error(peer) {
                return Err(e);
            }
            if breaker {
                let mut b = self.breakers.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(cb) = b.get_mut(peer) {
                    if !cb.allow(Instant::now()) {
                        return Err(Error::PeerLost {
                            rank: peer,
                            op: "connect".into(),
                            reason: format!(
                                "circuit breaker open after {} failed connection attempts; next probe in at most {:.1} s",
                                cb.config().failure_threshold,
                                cb.cooldown().as_secs_f64()
                            ),
                        });
                    }
                }
            }
            // A handshake that loses packets waits out QUIC's probe timeouts (1 s, 2 s, ...
            // before the first RTT sample): later attempts get longer, so that a lossy path
            // still completes one instead of starting over every 2 s.
            let attempt = handshake_attempt_timeout(backoff.attempts())
                .min(deadline.saturating_duration_since(Instant::now()));
            let res = match tokio::time::timeout(attempt, self.dial_once(peer, addr)).await {
                Ok(r) => r,
                Err(_) => Err(Error::Timeout {
                    what: format!("handshake with rank {peer} at {addr}"),
                    after: attempt,
                }),
            };
            if breaker {
                let mut b = self.breakers.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(cb) = b.get_mut(peer) {
                    match &res {
                        Ok(_) => cb.record_success(Instant::now()),
                        Err(_) => cb.record_failure(Instant::now()),
                    }
                }
            }
            match res {
                Ok(c) => return Ok(c),
                Err(
                    e @ (Error::Authentication { .. }
                    | Error::VersionMismatch { .. }
                    | Error::InvalidArgument(_)),
                ) => return Err(e),
                Err(e) => {
                    let wait = backoff.next_delay();
                    if Instant::now() + wait >= deadline {
                        return Err(Error::Timeout {
                            what: format!(
                                "could not connect to rank {peer} at {addr} after {} attempts (last error: {e}); is it running and reachable?",
                                backoff.attempts()
                            ),
                            after: self.cfg.connect_timeout,
                        });
                    }
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }

    async fn dial_once(&self, peer: usize, addr: SocketAddr) -> Result<Connection> {
        let connecting = self
            .endpoint
            .connect_with(self.dial_config(), addr, &tls::server_name_of(peer))
            .map_err(|e| Error::Io(format!("cannot connect to {addr}: {e}")))?;
        // With a session ticket from an earlier connection to this address, the Hello and
        // the first frames go as 0-RTT data, before the handshake completes.
        let connecting = if self.cfg.zero_rtt {
            match connecting.into_0rtt() {
                Ok((conn, accepted)) => return self.early(peer, conn, accepted).await,
                Err(c) => c,
            }
        } else {
            connecting
        };
        let conn = connecting
            .await
            .map_err(|e| map_conn_error(&e, peer, &addr.to_string(), "connect"))?;
        if endpoint::negotiated_alpn(&conn).as_deref() == Some(tls::ALPN_FALLBACK) {
            // The versions differ: the acceptor closes with its version as the reason.
            let err = tokio::time::timeout(Duration::from_secs(5), conn.closed()).await;
            let theirs = match err {
                Ok(ConnectionError::ApplicationClosed(c)) => {
                    String::from_utf8_lossy(&c.reason).into_owned()
                }
                _ => "an unknown version".into(),
            };
            return Err(Error::VersionMismatch {
                ours: format!("{}.{}", self.cfg.protocol_major, self.cfg.protocol_minor),
                theirs,
                peer: format!("rank {peer} at {addr}"),
            });
        }
        let hello = rendezvous::hello_frame(self)?;
        self.write_frame(peer, &conn, &hello.0, &hello.1)
            .await
            .map_err(|e| map_write(e, peer))?;
        self.register(peer, conn.clone());
        tokio::spawn(read_loop(self.me.clone(), conn.clone(), Some(peer)));
        Ok(conn)
    }

    /// A resumed connection, usable before its handshake completes: says Hello in 0-RTT data
    /// and, should the peer refuse that data (it lost the session), says it again once the
    /// handshake is done; the frames sent meanwhile go again through their own retries.
    async fn early(
        &self,
        peer: usize,
        conn: Connection,
        accepted: quinn::ZeroRttAccepted,
    ) -> Result<Connection> {
        let hello = rendezvous::hello_frame(self)?;
        self.write_frame(peer, &conn, &hello.0, &hello.1)
            .await
            .map_err(|e| map_write(e, peer))?;
        self.register(peer, conn.clone());
        tokio::spawn(read_loop(self.me.clone(), conn.clone(), Some(peer)));
        let me = self.me.clone();
        let c = conn.clone();
        tokio::spawn(async move {
            let ok = accepted.await;
            let Some(t) = me.upgrade() else { return };
            if ok {
                t.stats.zero_rtt_accepted.fetch_add(1, Ordering::Relaxed);
                return;
            }
            t.stats.zero_rtt_rejected.fetch_add(1, Ordering::Relaxed);
            if c.close_reason().is_none() {
                if let Ok(h) = rendezvous::hello_frame(&t) {
                    let _ = t.write_frame(peer, &c, &h.0, &h.1).await;
                }
            }
        });
        Ok(conn)
    }

    /// With payload corruption on (`chaos` `corrupt=p`), the bit of a `len`-byte payload to
    /// flip, drawn with probability p; `None` to send it as it is.
    fn corruption_bit(&self, len: usize) -> Option<usize> {
        let rng = self.corrupter.as_ref()?;
        let chaos = self.cfg.chaos?;
        if len == 0 || !chaos.corrupting_at(self.started.elapsed()) {
            return None;
        }
        let mut rng = rng.lock().unwrap_or_else(|p| p.into_inner());
        let bit = rand::Rng::random_bool(&mut *rng, chaos.corrupt.clamp(0.0, 1.0))
            .then(|| rand::Rng::random_range(&mut *rng, 0..len * 8));
        if bit.is_some() {
            self.stats.chaos_damaged.fetch_add(1, Ordering::Relaxed);
        }
        bit
    }

    /// In `chaos` memory-error windows (`corrupt_every`), the bit of a received `len`-byte
    /// payload to flip before its checksum is checked, as a memory error in the receive
    /// buffer would; `None` outside them and without windows.
    fn receive_corruption_bit(&self, len: usize) -> Option<usize> {
        if !self.cfg.chaos?.memory_windows() {
            return None;
        }
        self.corruption_bit(len)
    }

    async fn write_frame(
        &self,
        peer: usize,
        conn: &Connection,
        header: &Header,
        payload: &[u8],
    ) -> std::result::Result<(), WriteFail> {
        if self.wants_bulk(peer, conn, header, payload.len()) {
            match self.write_bulk(peer, conn, header, payload).await {
                Err(WriteFail::TooLarge) => {} // the path shrank: a stream carries it
                res => return res,
            }
        }
        let data_frame =
            SeqSpace::of(header.kind) != SeqSpace::Control && header.kind != FrameKind::Abort;
        if data_frame {
            return self
                .write_checked(peer, conn, header, payload, stream_lane::Sent::New)
                .await;
        }
        let stream = self.write_uni(conn, header, payload).await?;
        // A progress report is superseded by the next one: one lost with its connection is
        // not a frame the peer must read before it closes (nor does the peer count it).
        if header.kind == FrameKind::Progress {
            self.count_wire(header.encoded_len() + payload.len());
        } else {
            self.count_sent(peer, header.encoded_len() + payload.len());
        }
        // An abort that QUIC did not deliver (a reset cut it off, or the server refused the
        // 0-RTT data it rode in) goes again: the peer would otherwise wait for the operation
        // until its timeout.
        let resend = (header.kind == FrameKind::Abort).then(|| (header.clone(), payload.to_vec()));
        // Track the stream until the peer has it, so that close() does not discard it.
        self.unacked_streams.fetch_add(1, Ordering::AcqRel);
        let (me, conn) = (self.me.clone(), conn.clone());
        tokio::spawn(async move {
            let end = stream.stopped().await;
            let Some(t) = me.upgrade() else { return };
            t.unacked_streams.fetch_sub(1, Ordering::AcqRel);
            // Lost with its connection, or sent in 0-RTT data the server refused.
            if let (Err(_), Some((h, p))) = (end, resend) {
                if !t.closing.load(Ordering::Acquire) {
                    t.resend_control(peer, &conn, &h, &p).await;
                }
            }
        });
        Ok(())
    }

    /// Writes a control frame (a heartbeat report, an abort, a goodbye) on a unidirectional
    /// stream of its own, ahead of data, and returns the stream once QUIC holds the bytes.
    async fn write_uni(
        &self,
        conn: &Connection,
        header: &Header,
        payload: &[u8],
    ) -> std::result::Result<quinn::SendStream, WriteFail> {
        let mut buf = Vec::with_capacity(
            header.encoded_len()
                + if payload.len() <= 16384 {
                    payload.len()
                } else {
                    0
                },
        );
        header.encode(&mut buf).map_err(WriteFail::Core)?;
        let mut stream = conn.open_uni().await.map_err(WriteFail::Conn)?;
        // Heartbeats, progress reports and aborts must not wait behind megabytes of data.
        let _ = stream.set_priority(CONTROL_PRIORITY);
        if payload.len() <= 16384 {
            buf.extend_from_slice(payload);
            stream.write_all(&buf).await.map_err(WriteFail::Write)?;
        } else {
            stream.write_all(&buf).await.map_err(WriteFail::Write)?;
            stream.write_all(payload).await.map_err(WriteFail::Write)?;
        }
        stream
            .finish()
            .map_err(|_| WriteFail::Conn(ConnectionError::LocallyClosed))?;
        Ok(stream)
    }

    /// Starts dialling `peer` in the background if this rank is the one that dials it; a
    /// receive calls this so that a peer that only sends to us is connected.
    fn ensure_dialled(&self, peer: usize) {
        if self.rank > peer && peer < self.world {
            let has = self.peers[peer].conn.borrow().is_some();
            if !has && self.mailbox.peer_error(peer).is_none() {
                let me = self.me.clone();
                tokio::spawn(async move {
                    if let Some(me) = me.upgrade() {
                        if let Err(e) = me.conn(peer).await {
                            me.mailbox.fail_peer(peer, e);
                        }
                    }
                });
            }
        }
    }

    /// How long shutdown waits for a peer that has stopped answering. A live peer acknowledges
    /// what we still have in flight within a few round trips, even at heavy loss; one that
    /// exited without closing answers nothing, and is not worth the idle timeout.
    fn shutdown_stall(&self) -> Duration {
        self.cfg
            .idle_timeout
            .clamp(Duration::from_secs(1), Duration::from_secs(5))
    }

    /// The longest shutdown waits for a peer that is still answering (a large frame over a
    /// slow link): four idle timeouts.
    fn shutdown_cap(&self) -> Duration {
        (self.cfg.idle_timeout * 4).max(4 * self.shutdown_stall())
    }

    /// Closes every connection and the endpoint, after the frames already sent are delivered:
    /// waits until the peers acknowledged every stream, tells each peer goodbye (local peers
    /// through the shared-memory ring too, behind its frames), and waits for it to finish
    /// reading and close its side. Each wait lasts while the peers still answer
    /// (at most 5 s without a datagram from them, four idle timeouts in all).
    pub async fn shutdown(&self) {
        if self.closing.swap(true, Ordering::AcqRel) {
            return;
        }
        let open: Vec<Connection> = self
            .peers
            .iter()
            .filter_map(|s| s.conn.borrow().clone())
            .collect();
        // Frames still on their way (a slow, lossy link can take many seconds): wait while
        // the peers still answer, not a fixed time.
        let (stall, cap) = (self.shutdown_stall(), self.shutdown_cap());
        wait_while_alive(
            || self.unacked_streams.load(Ordering::Acquire) > 0,
            &open,
            stall,
            cap,
        )
        .await;
        // Behind every frame in the ring: a goodbye, then the ring is closed. Only once the
        // peers confirmed what went over QUIC: a local peer takes the ring's goodbye as our
        // last word, and a frame that went to it over QUIC (while its ring was not usable)
        // must not arrive after it.
        let goodbye = rendezvous::goodbye_header(self, &[]);
        for link in self.shm_links.iter().filter_map(|l| l.get()) {
            link.close_with(&goodbye, &[], stall).await;
        }
        let conns: Vec<(usize, Connection)> = self
            .peers
            .iter()
            .enumerate()
            .filter_map(|(p, s)| s.conn.borrow().clone().map(|c| (p, c)))
            .filter(|(_, c)| c.close_reason().is_none())
            .collect();
        for (p, c) in &conns {
            let payload = self.peers[*p].sent.load(Ordering::Acquire).to_le_bytes();
            let header = rendezvous::goodbye_header(self, &payload);
            let _ = self.write_frame(*p, c, &header, &payload).await;
        }
        // Each peer closes the connection once it has read every frame we announced.
        for (_, c) in &conns {
            tokio::spawn(ask_for_close(c.clone(), stall));
            let c2 = c.clone();
            wait_while_alive(
                move || c2.close_reason().is_none(),
                std::slice::from_ref(c),
                stall,
                cap,
            )
            .await;
        }
        self.endpoint
            .close(VarInt::from_u32(close_code::GOODBYE), b"group closed");
        self.mailbox
            .close(Error::Closed("this process closed its group".into()));
        let _ = tokio::time::timeout(Duration::from_secs(2), self.endpoint.wait_idle()).await;
    }
}

enum WriteFail {
    Core(Error),
    /// A datagram no longer fits the path (its MTU fell): send the frame on a stream.
    TooLarge,
    Conn(ConnectionError),
    Write(quinn::WriteError),
}

/// Sends of one frame again after its connection broke, before the send fails.
const SEND_RETRIES: usize = 4;

impl WriteFail {
    /// Whether the connection failed under the write (rather than the frame or the path).
    fn is_connection(&self) -> bool {
        matches!(
            self,
            WriteFail::Conn(_)
                | WriteFail::Write(quinn::WriteError::ConnectionLost(_))
                | WriteFail::Write(quinn::WriteError::ZeroRttRejected)
        )
    }
}

fn map_write(e: WriteFail, peer: usize) -> Error {
    match e {
        WriteFail::Core(e) => e,
        WriteFail::TooLarge => Error::Io(format!(
            "a datagram to rank {peer} no longer fits the path MTU"
        )),
        WriteFail::Conn(c) => map_conn_error(&c, peer, &format!("rank {peer}"), "send"),
        WriteFail::Write(quinn::WriteError::ConnectionLost(c)) => {
            map_conn_error(&c, peer, &format!("rank {peer}"), "send")
        }
        WriteFail::Write(w) => Error::PeerLost {
            rank: peer,
            op: "send".into(),
            reason: format!("stream failed: {w}"),
        },
    }
}

fn is_crypto(code: u64) -> bool {
    (0x100..0x200).contains(&code)
}

/// Turns a QUIC connection error into the core error that says what it means for the job.
pub(crate) fn map_conn_error(e: &ConnectionError, peer: usize, who: &str, op: &str) -> Error {
    match e {
        ConnectionError::TransportError(t) if is_crypto(u64::from(t.code)) => Error::Authentication {
            peer: who.to_string(),
            detail: format!("{t}; both sides must use the same job secret (MCP_SECRET)"),
        },
        ConnectionError::ConnectionClosed(c) if is_crypto(u64::from(c.error_code)) => Error::Authentication {
            peer: who.to_string(),
            detail: format!("the peer refused our certificate ({c}); both sides must use the same job secret (MCP_SECRET)"),
        },
        ConnectionError::ApplicationClosed(c) => {
            let reason = String::from_utf8_lossy(&c.reason).into_owned();
            match u64::from(c.error_code) {
                x if x == close_code::AUTH_REQUIRED as u64 => Error::Authentication {
                    peer: who.to_string(),
                    detail: reason,
                },
                x if x == close_code::VERSION_MISMATCH as u64 => Error::VersionMismatch {
                    ours: format!("{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}"),
                    theirs: reason,
                    peer: who.to_string(),
                },
                x if x == close_code::REFUSED as u64 => Error::InvalidArgument(format!("rendezvous refused this process: {reason}")),
                x if x == close_code::MODEL_MISMATCH as u64 => Error::SpecMismatch(reason),
                x if x == close_code::RENDEZVOUS_FAILED as u64 => Error::Timeout {
                    what: format!("rank 0 gave up on the rendezvous: {reason}"),
                    after: Duration::ZERO,
                },
                _ => Error::PeerLost {
                    rank: peer,
                    op: op.to_string(),
                    reason: format!("it closed the connection ({reason})"),
                },
            }
        }
        ConnectionError::TimedOut => Error::PeerLost {
            rank: peer,
            op: op.to_string(),
            reason: "no packets within the idle timeout (killed, frozen or cut off)".into(),
        },
        ConnectionError::Reset => Error::PeerLost {
            rank: peer,
            op: op.to_string(),
            reason: "the peer reset the connection (restarted?)".into(),
        },
        ConnectionError::LocallyClosed => Error::Closed("this process closed its group".into()),
        other => Error::PeerLost {
            rank: peer,
            op: op.to_string(),
            reason: other.to_string(),
        },
    }
}

async fn accept_loop(me: Weak<QuicTransport>) {
    loop {
        let incoming = {
            let Some(t) = me.upgrade() else { return };
            let ep = t.endpoint.clone();
            drop(t);
            match ep.accept().await {
                Some(i) => i,
                None => return,
            }
        };
        let me = me.clone();
        tokio::spawn(async move {
            let Some(conn) = accept_one(incoming).await else {
                if let Some(t) = me.upgrade() {
                    t.stats.refused_handshakes.fetch_add(1, Ordering::Relaxed);
                }
                return;
            };
            let Some(t) = me.upgrade() else { return };
            let alpn = endpoint::negotiated_alpn(&conn);
            match alpn.as_deref() {
                Some(a) if a == tls::ALPN_BOOTSTRAP => {
                    drop(t);
                    rendezvous::serve_secret(me, conn).await;
                }
                Some(a) if a == tls::ALPN_FALLBACK => {
                    t.stats.refused_handshakes.fetch_add(1, Ordering::Relaxed);
                    let ours = format!("{}.{}", t.cfg.protocol_major, t.cfg.protocol_minor);
                    conn.close(
                        VarInt::from_u32(close_code::VERSION_MISMATCH),
                        ours.as_bytes(),
                    );
                }
                _ if conn.peer_identity().is_none() => {
                    t.stats.refused_handshakes.fetch_add(1, Ordering::Relaxed);
                    conn.close(
                        VarInt::from_u32(close_code::AUTH_REQUIRED),
                        b"a client certificate from the job CA is required",
                    );
                }
                _ => {
                    drop(t);
                    read_loop(me, conn, None).await;
                }
            }
        });
    }
}

/// Accepts one connection attempt. A resumed session (its client certificate known from the
/// session it resumes) is served at once, its 0-RTT frames read before the handshake ends;
/// any other is served once its handshake completed and the certificate was checked.
async fn accept_one(incoming: quinn::Incoming) -> Option<Connection> {
    let mut connecting = incoming.accept().ok()?;
    // The ClientHello has been read: a resumption has restored the peer's certificate.
    connecting.handshake_data().await.ok()?;
    let (conn, done) = match connecting.into_0rtt() {
        Ok(c) => c,
        Err(c) => return c.await.ok(),
    };
    if conn.peer_identity().is_none() {
        // Resolves when the handshake completes (to whether 0-RTT data was accepted, which
        // is no matter here) or fails.
        let _ = done.await;
    }
    if conn.close_reason().is_some() {
        return None;
    }
    Some(conn)
}

/// Reads every stream of `conn` into the mailbox; when the connection ends, fails the waits
/// on its peer, or has the connection re-established when the end was transient.
async fn read_loop(me: Weak<QuicTransport>, conn: Connection, mut peer: Option<usize>) {
    let known = Arc::new(Mutex::new(peer));
    let active = Arc::new(AtomicUsize::new(0));
    let received = Arc::new(AtomicU64::new(0));
    let bulk_rx = Arc::new(bulk::BulkRx::default());
    tokio::spawn(bulk::datagram_loop(conn.clone(), bulk_rx.clone()));
    tokio::spawn(accept_bi_loop(
        me.clone(),
        conn.clone(),
        bulk_rx,
        known.clone(),
        received.clone(),
    ));
    let end = loop {
        match conn.accept_uni().await {
            Ok(stream) => {
                let me = me.clone();
                let conn = conn.clone();
                let known = known.clone();
                let active = active.clone();
                let received = received.clone();
                active.fetch_add(1, Ordering::AcqRel);
                tokio::spawn(async move {
                    let res = read_stream(&me, &conn, stream, &known, &active, &received).await;
                    // A frame cut off with its connection says nothing about the peer: the
                    // connection's end decides (see `reconnect`).
                    let cut = conn.close_reason().is_some();
                    if let (Err(e), false) = (res, cut) {
                        if let Some(t) = me.upgrade() {
                            t.stats.corrupt_frames.fetch_add(1, Ordering::Relaxed);
                            // A frame we cannot trust: say so to whoever waits on that peer.
                            if let Some(p) = *known.lock().unwrap_or_else(|p| p.into_inner()) {
                                t.mailbox.fail_peer(p, e);
                            }
                        }
                    }
                    active.fetch_sub(1, Ordering::AcqRel);
                });
            }
            Err(e) => break e,
        }
    };
    peer = peer.or(*known.lock().unwrap_or_else(|p| p.into_inner()));
    let Some(t) = me.upgrade() else { return };
    if t.closing.load(Ordering::Acquire) {
        return;
    }
    if let Some(p) = peer {
        let reset_here = t
            .reset_here
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&conn.stable_id());
        if let Some(why) = reconnect::transient(&end, reset_here) {
            if t.mailbox.peer_error(p).is_none() {
                if let Some(slot) = t.peers.get(p) {
                    slot.carried
                        .fetch_add(received.load(Ordering::Acquire), Ordering::AcqRel);
                }
                drop(t);
                reconnect::reconnect(me, p, conn, why).await;
                return;
            }
        }
        let err = map_conn_error(&end, p, &format!("rank {p}"), "any operation");
        // A goodbye, or our own close after the peer's farewell: it left, it was not lost.
        let left = match &end {
            ConnectionError::ApplicationClosed(c) => {
                u64::from(c.error_code) == u64::from(close_code::GOODBYE)
            }
            ConnectionError::LocallyClosed => true,
            _ => false,
        };
        if left {
            t.mailbox.peer_left(p, err);
        } else {
            t.mailbox.fail_peer(p, err);
        }
    }
}

/// Accepts the bidirectional streams the peer opens on `conn`: stream-lane data frames
/// (answered with a verdict) and FEC-lane transfers, told apart by their magic.
async fn accept_bi_loop(
    me: Weak<QuicTransport>,
    conn: Connection,
    bulk: Arc<bulk::BulkRx>,
    known: Arc<Mutex<Option<usize>>>,
    received: Arc<AtomicU64>,
) {
    let resends = Arc::new(stream_lane::Resends::default());
    let oks = Arc::new(stream_lane::OkVerdicts::default());
    tokio::spawn(stream_lane::send_ok_verdicts(conn.clone(), oks.clone()));
    while let Ok((send, mut recv)) = conn.accept_bi().await {
        let (me, conn, bulk, known, received, resends, oks) = (
            me.clone(),
            conn.clone(),
            bulk.clone(),
            known.clone(),
            received.clone(),
            resends.clone(),
            oks.clone(),
        );
        tokio::spawn(async move {
            let mut magic = [0u8; 4];
            let res = match recv.read_exact(&mut magic).await {
                Err(e) if bulk::withdrawn(&e) => Ok(()),
                Err(e) => Err(Error::Protocol(format!(
                    "reading a stream's first bytes: {e}"
                ))),
                Ok(()) if magic == bulk::BULK_MAGIC => {
                    bulk::receive_transfer(&me, &conn, &bulk, send, recv, &known, &received).await
                }
                Ok(()) => {
                    stream_lane::receive_checked(&me, send, recv, &resends, &oks, &magic)
                        .await
                        .map(|filed| {
                            if let Some(src) = filed {
                                let mut k = known.lock().unwrap_or_else(|p| p.into_inner());
                                k.get_or_insert(src);
                                drop(k);
                                // Counted once filed, so that a goodbye never overtakes it.
                                received.fetch_add(1, Ordering::AcqRel);
                            }
                        })
                }
            };
            // A frame cut off with its connection says nothing about the peer: the
            // connection's end decides (see `reconnect`).
            let cut = conn.close_reason().is_some();
            if let (Err(e), false) = (res, cut) {
                if let Some(t) = me.upgrade() {
                    t.stats.corrupt_frames.fetch_add(1, Ordering::Relaxed);
                    // A peer we cannot trust: say so to whoever waits on it.
                    if let Some(p) = *known.lock().unwrap_or_else(|p| p.into_inner()) {
                        t.mailbox.fail_peer(p, e);
                    }
                }
            }
        });
    }
}

/// How long the `n`-th attempt (from 0) at a handshake may take: 2 s, doubling up to 16 s.
fn handshake_attempt_timeout(n: u32) -> Duration {
    Duration::from_secs(2u64 << n.min(3))
}

/// Polls `pending` until it is false, until no datagram has arrived on any of `conns` for
/// `stall` (the peers are gone or stuck), or until `cap`.
async fn wait_while_alive(
    pending: impl Fn() -> bool,
    conns: &[Connection],
    stall: Duration,
    cap: Duration,
) {
    let start = Instant::now();
    let rx = || -> u64 { conns.iter().map(|c| c.stats().udp_rx.bytes).sum() };
    let (mut seen, mut since) = (rx(), Instant::now());
    while pending() && start.elapsed() < cap && since.elapsed() < stall {
        tokio::time::sleep(Duration::from_millis(2)).await;
        let now = rx();
        if now != seen {
            (seen, since) = (now, Instant::now());
        }
    }
}

/// Asks the peer to repeat its close until it arrives: a close lost on the path (a flooded
/// receive buffer, a lossy link) is sent again by QUIC only in answer to a packet, and the
/// leaving side is otherwise silent. An empty datagram, which the FEC lane ignores, every
/// 100 ms, for at most `stall`: the probes (and the peer's ACKs of them) make each side
/// look alive to the other, so a peer that has not closed by then is left to the usual
/// silence limit rather than kept waiting up to the cap.
async fn ask_for_close(conn: Connection, stall: Duration) {
    let until = Instant::now() + stall;
    while conn.close_reason().is_none() && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if conn.send_datagram(bytes::Bytes::new()).is_err() {
            return;
        }
    }
}

/// The peer said goodbye after sending `expected` frames: wait until we have read them all
/// (while it still answers: see [`wait_while_alive`]), then fail later waits on it and close
/// our side.
async fn farewell(
    t: &QuicTransport,
    conn: &Connection,
    src: usize,
    expected: u64,
    received: &AtomicU64,
) {
    let (stall, cap) = (t.shutdown_stall(), t.shutdown_cap());
    let carried = t
        .peers
        .get(src)
        .map_or(0, |s| s.carried.load(Ordering::Acquire));
    wait_while_alive(
        || received.load(Ordering::Acquire) + carried < expected,
        std::slice::from_ref(conn),
        stall,
        cap,
    )
    .await;
    t.mailbox.said_goodbye(src);
    // Sends that began before the goodbye finish first (see `PeerSlot::sending`); new ones
    // fail now that the peer has left.
    if let Some(slot) = t.peers.get(src) {
        wait_while_alive(
            || slot.sending.load(Ordering::SeqCst) > 0,
            std::slice::from_ref(conn),
            stall,
            cap,
        )
        .await;
    }
    conn.close(VarInt::from_u32(close_code::GOODBYE), b"goodbye");
}

async fn read_stream(
    me: &Weak<QuicTransport>,
    conn: &Connection,
    mut stream: quinn::RecvStream,
    known: &Mutex<Option<usize>>,
    active: &AtomicUsize,
    received: &AtomicU64,
) -> Result<()> {
    let (header, hlen, payload) = stream_lane::read_frame(&mut stream, &[])
        .await
        .map_err(|e| match e {
            stream_lane::ReadFail::Damaged(e) | stream_lane::ReadFail::Bad(e) => e,
        })?;
    let Some(t) = me.upgrade() else { return Ok(()) };
    t.stats.frames_received.fetch_add(1, Ordering::Relaxed);
    t.stats
        .bytes_received
        .fetch_add((hlen + payload.len()) as u64, Ordering::Relaxed);
    let src = header.src as usize;
    if src >= t.world {
        return Err(Error::Protocol(format!(
            "frame from rank {src} in a world of {}",
            t.world
        )));
    }
    {
        let mut k = known.lock().unwrap_or_else(|p| p.into_inner());
        if k.is_none() {
            *k = Some(src);
        }
    }
    match header.kind {
        FrameKind::Hello => t.register(src, conn.clone()),
        FrameKind::Progress => {
            if payload.verify(&header).is_ok() {
                if let Some(p) = crate::health::Progress::from_bytes(&payload.to_vec()) {
                    t.progress_watch().on_report(src, p, Instant::now());
                }
            }
            return Ok(());
        }
        FrameKind::Goodbye => {
            // Our own reader is the only one left to count: everything else must be read.
            let _ = active;
            let mut n = [0u8; 8];
            if payload.len() == 8 {
                n.copy_from_slice(&payload.to_vec());
            }
            farewell(&t, conn, src, u64::from_le_bytes(n), received).await;
            return Ok(());
        }
        _ => {}
    }
    let key = MsgKey::of(&header);
    let filed = match payload.verify(&header) {
        Ok(()) => t.mailbox.dispatch(Frame { header, payload }),
        Err(e) => {
            t.stats.corrupt_frames.fetch_add(1, Ordering::Relaxed);
            t.mailbox.deliver(key, Err(e))
        }
    };
    // Counted once filed, so that a goodbye never overtakes a frame it announced (a copy of
    // a frame filed before was counted then).
    if filed {
        received.fetch_add(1, Ordering::AcqRel);
    }
    Ok(())
}

impl Transport for QuicTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn mailbox(&self) -> &Mailbox {
        &self.mailbox
    }

    fn local_pid(&self, peer: usize) -> Option<u32> {
        self.local_pid_of(peer)
    }

    fn reads_peer_memory(&self, peer: usize) -> bool {
        self.cfg.shm_direct && self.shm_link(peer).is_some() && self.local_pid_of(peer).is_some()
    }

    fn direct_reads_agreed(&self, read: bool) {
        let n = if read {
            &self.stats.direct_ops
        } else {
            &self.stats.direct_fallbacks
        };
        n.fetch_add(1, Ordering::Relaxed);
    }

    fn direct_reads_known(&self, peers: &[(usize, u32)]) -> bool {
        self.known_reads.knows(peers)
    }

    fn remember_direct_reads(&self, peers: &[(usize, u32)]) {
        self.known_reads.remember(peers);
    }

    async fn send_frame<'a>(
        &'a self,
        peer: usize,
        header: &'a Header,
        payload: &'a [u8],
    ) -> Result<()> {
        if let Some(link) = self.shm_link(peer) {
            // The QUIC connection stays, for heartbeats and progress reports only: a frozen
            // local peer is found by them, as a remote one is.
            self.ensure_dialled(peer);
            return self.send_shm(link, peer, header, payload).await;
        }
        // Counted before the connection is looked up, which fails once the peer has left:
        // a farewell either sees this send or makes it fail at once.
        let _sending = self.slot(peer)?.sending_guard();
        let mut conn = self.conn(peer).await?;
        // A connection that breaks under the send is replaced (see `reconnect`): the frame
        // goes again, whole, on the next one; the receiver drops a copy it already filed.
        let mut res = self.write_frame(peer, &conn, header, payload).await;
        for _ in 0..SEND_RETRIES {
            match &res {
                Err(e) if e.is_connection() && !self.closing.load(Ordering::Acquire) => {}
                _ => break,
            }
            conn = match self.next_conn(peer, &conn).await {
                Ok(c) => c,
                Err(e) => return Err(e),
            };
            res = self.write_frame(peer, &conn, header, payload).await;
        }
        match res {
            Ok(()) => Ok(()),
            Err(e) => match map_write(e, peer) {
                // We closed the connection because the peer left or fell silent, not because
                // this process is closing: say so.
                Error::Closed(_) if !self.closing.load(Ordering::Acquire) => Err(self
                    .mailbox
                    .peer_error(peer)
                    .unwrap_or_else(|| Error::PeerLost {
                        rank: peer,
                        op: "send".into(),
                        reason: "the connection was closed".into(),
                    })),
                e => Err(e),
            },
        }
    }

    fn expect_from(&self, peer: usize) {
        self.ensure_dialled(peer);
    }

    fn op_started(&self, seq: u64) {
        self.progress_watch().op_started(seq, Instant::now());
    }

    fn op_finished(&self, seq: u64) {
        self.progress_watch().op_finished(seq);
    }

    fn leave_now(&self) {
        if self.closing.swap(true, Ordering::AcqRel) {
            return;
        }
        self.endpoint
            .close(VarInt::from_u32(close_code::GOODBYE), b"group aborted");
        for link in self.shm_links.iter().filter_map(|l| l.get()) {
            link.hang_up();
        }
        self.mailbox
            .close(Error::Closed("this process aborted its group".into()));
        // Wakes sends waiting for a peer to connect: they see `closing` and fail.
        for slot in &self.peers {
            slot.conn.send_modify(|_| {});
        }
    }

    async fn goodbye(&self) {
        self.shutdown().await;
    }
}
