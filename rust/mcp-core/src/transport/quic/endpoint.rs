//! Sockets and QUIC settings.
//!
//! Measured on loopback (see the README): the kernel drops datagrams once the receive buffer
//! is full, and QUIC reads each drop as congestion. So the flow-control window is sized from
//! the socket buffer the kernel actually granted, which keeps what is in flight below what the
//! socket can hold; on loopback we also use 64 KiB datagrams (MTU discovery climbs to them)
//! without segmentation offload, whose 64 KiB-per-call limit they would break.

use super::congestion::{CongestionKind, LossTolerantConfig};
use super::tls::Identity;
use super::QuicConfig;
use crate::error::{Error, Result};
use quinn::crypto::rustls::{HandshakeData, QuicClientConfig, QuicServerConfig};
use quinn::{Connection, Endpoint, EndpointConfig, IdleTimeout, TransportConfig, VarInt};
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

/// Socket buffer we ask the kernel for (root may exceed `net.core.rmem_max`).
const SOCKET_BUFFER: usize = 32 << 20;
/// Flow-control window bounds.
const MIN_WINDOW: u32 = 256 << 10;
const MAX_WINDOW: u32 = 64 << 20;
/// Datagrams (FEC shards) quinn holds for us before we read them.
const DATAGRAM_RECV_BUFFER: usize = 64 << 20;
/// Datagrams quinn queues before `send_datagram_wait` waits.
pub(super) const DATAGRAM_SEND_BUFFER: usize = 4 << 20;
/// Datagram payload on loopback.
const LOOPBACK_MTU: u16 = 65_000;
/// Smallest datagram payload on loopback: room for a 15 KiB FEC shard and its headers, and
/// no larger than [`LONG_HEADER_MTU`].
const LOOPBACK_MIN_MTU: u16 = 16_000;
/// Largest datagram to start a connection with. Until the handshake completes, packets carry
/// a long header, whose length field holds less than 16 KiB (quinn-proto 0.11 asserts it,
/// and the assertion kills the connection's driver): a resumed connection's 0-RTT data fills
/// whole packets of the current MTU. MTU discovery raises it once the handshake is done.
const LONG_HEADER_MTU: u16 = 16_000;

/// Ack-eliciting packets a peer may receive before it must ACK (QUIC's default is 1: an ACK
/// for every second packet).
const ACK_ELICITING_THRESHOLD: u32 = 7;

/// The smallest congestion window, in packets: room for twice the packets that make the peer
/// ACK at once. quinn sends while `in flight + packet < window`, so a floor of
/// `ACK_ELICITING_THRESHOLD + 1` packets never has that many in flight: each round then waits
/// out the peer's ACK delay, the delivery rate reads low, the window sized from it stays at
/// the floor, and so on (on loopback 16 MiB all-reduces took 100 ms instead of 25).
const MIN_WINDOW_PACKETS: u64 = 2 * (ACK_ELICITING_THRESHOLD as u64 + 1);

/// A bound UDP socket and what the kernel granted it.
pub(crate) struct BoundSocket {
    socket: UdpSocket,
    /// Receive buffer in bytes as the kernel reports it (it counts its own overhead).
    recv_buffer: usize,
    loopback: bool,
    /// How far MTU discovery may climb on the bound interface, when it has jumbo frames.
    jumbo: Option<u16>,
}

impl BoundSocket {
    /// The flow-control window this socket can absorb without drops.
    fn window(&self) -> u32 {
        let w = (self.recv_buffer / 2).min(MAX_WINDOW as usize) as u32;
        w.max(MIN_WINDOW)
    }

    /// What the transport configuration needs to know of this socket.
    pub(crate) fn figures(&self) -> SocketFigures {
        SocketFigures {
            window: self.window(),
            loopback: self.loopback,
            jumbo: self.jumbo,
        }
    }
}

/// QUIC's own floor for a path's UDP payload (quinn's default `min_mtu`).
const QUIC_MIN_MTU: u16 = 1200;
/// The largest UDP payload quinn's MTU discovery probes for unless told otherwise (its
/// default `upper_bound`).
const QUIC_DEFAULT_MAX_MTU: u16 = 1452;

impl SocketFigures {
    /// The smallest UDP payload the connections of this socket may fall back to: the
    /// `min_mtu` that [`transport_config`] gives them. quinn's MTU black-hole detector can
    /// take a connection down to it at any time (random loss looks like a black hole), and
    /// then drops every queued datagram larger than the new limit, so FEC shards are sized to
    /// fit it.
    pub(crate) fn floor_mtu(&self, cfg: &QuicConfig) -> u16 {
        match cfg.mtu {
            Some(m) => m.min(LONG_HEADER_MTU),
            None if self.loopback => LOOPBACK_MIN_MTU,
            None => QUIC_MIN_MTU,
        }
    }

    /// The largest UDP payload the connections of this socket may send: the upper bound of
    /// the MTU discovery that [`transport_config`] gives them.
    pub(crate) fn max_datagram(&self, cfg: &QuicConfig) -> u16 {
        match cfg.mtu {
            Some(m) => m,
            None if self.loopback => LOOPBACK_MTU,
            None => self.jumbo.unwrap_or(QUIC_DEFAULT_MAX_MTU),
        }
    }
}

/// What a transport configuration needs to know of its socket (kept after the socket went
/// to the endpoint, to build configurations for later connections).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SocketFigures {
    /// The flow-control window the socket absorbs.
    window: u32,
    /// Whether it is on a loopback interface.
    loopback: bool,
    /// How far MTU discovery may climb on its interface, when that has jumbo frames.
    jumbo: Option<u16>,
}

/// The transport configuration of a connection made once the path's round trip is known
/// (measured at the rendezvous): before its first RTT sample a new connection times its
/// handshake's loss recovery by this estimate instead of QUIC's 333 ms default, so that a
/// lost handshake packet costs milliseconds rather than a second and more on a fast path.
/// Twice the measured RTT, within 1 ms and 333 ms.
pub(crate) fn transport_config_after(
    cfg: &QuicConfig,
    sock: SocketFigures,
    rtt: Duration,
) -> Result<Arc<TransportConfig>> {
    let mut t = transport_config(cfg, sock)?;
    t.initial_rtt((rtt * 2).clamp(Duration::from_millis(1), Duration::from_millis(333)));
    Ok(Arc::new(t))
}

pub(crate) fn transport_config(cfg: &QuicConfig, sock: SocketFigures) -> Result<TransportConfig> {
    let mut t = TransportConfig::default();
    t.max_concurrent_uni_streams(VarInt::from_u32(cfg.max_streams));
    // Each stream-lane frame holds a bidirectional stream until its verdict, each FEC-lane
    // transfer until the receiver has it all: as many in flight as unidirectional ones.
    // At the limit `open_bi` waits for one to finish: a low limit slows sends, never fails.
    t.max_concurrent_bidi_streams(VarInt::from_u32(cfg.max_streams));
    // Streams in the order they were opened, not round-robin: a collective consumes its
    // chunks in order, so the first chunk done first starts its reduction and forwarding
    // while the rest arrive; round-robin would finish every chunk at once, at the end.
    // Control frames and verdicts go ahead of data by priority (see `CONTROL_PRIORITY`).
    t.send_fairness(false);
    t.datagram_receive_buffer_size(Some(DATAGRAM_RECV_BUFFER));
    t.datagram_send_buffer_size(DATAGRAM_SEND_BUFFER);
    let window = sock.window;
    t.stream_receive_window(VarInt::from_u32(window));
    t.receive_window(VarInt::from_u32(window));
    t.send_window(u64::from(window) * 4);
    if cfg.congestion == CongestionKind::LossTolerant {
        // Datagrams have no flow control: the window alone keeps FEC shards from overrunning
        // the receiver's socket buffer, so it never exceeds what that buffer absorbs.
        t.congestion_controller_factory(Arc::new(LossTolerantConfig {
            max_window: u64::from(window),
            min_window_packets: MIN_WINDOW_PACKETS,
            ..LossTolerantConfig::default()
        }));
    }
    let idle = IdleTimeout::try_from(cfg.idle_timeout).map_err(|_| {
        Error::InvalidArgument(format!("idle timeout {:?} is too large", cfg.idle_timeout))
    })?;
    t.max_idle_timeout(Some(idle));
    t.keep_alive_interval(Some(
        cfg.heartbeat
            .min(cfg.idle_timeout / 4)
            .max(Duration::from_millis(50)),
    ));
    // Collectives send a burst and then wait for the answer: a delayed ACK (25 ms by
    // default) stalls every burst that ends on an odd packet, so ask peers to ACK promptly.
    // And ACK every few packets, not every second one: on a 1,500-byte path a bulk transfer
    // is ~90,000 packets per second each way, and every ACK is a packet to build, send,
    // receive and process on both sides.
    let mut ack = quinn::AckFrequencyConfig::default();
    ack.max_ack_delay(Some(Duration::from_millis(1)));
    ack.ack_eliciting_threshold(VarInt::from_u32(ACK_ELICITING_THRESHOLD));
    t.ack_frequency_config(Some(ack));
    if sock.loopback {
        let mut mtu = quinn::MtuDiscoveryConfig::default();
        mtu.upper_bound(LOOPBACK_MTU);
        t.mtu_discovery_config(Some(mtu));
        // Start high (discovery climbs the rest within a few round trips), and never fall
        // far: under heavy random loss quinn's black-hole detector would otherwise take the
        // MTU down to 1200 bytes again and again (and FEC shards planned for the larger size
        // would no longer fit).
        t.initial_mtu(LOOPBACK_MIN_MTU.min(LONG_HEADER_MTU));
        t.min_mtu(LOOPBACK_MIN_MTU);
        t.enable_segmentation_offload(false);
    } else if let (Some(ceiling), None) = (sock.jumbo, cfg.mtu) {
        // Jumbo frames on our interface: discovery finds out whether the path carries them
        // (probes that do not arrive cost nothing but the probe).
        let mut mtu = quinn::MtuDiscoveryConfig::default();
        mtu.upper_bound(ceiling);
        t.mtu_discovery_config(Some(mtu));
    }
    if let Some(m) = cfg.mtu {
        // A fixed size the path is known to carry (1440 inside containers): start there,
        // never fall below it, and let discovery probe no higher.
        let mut d = quinn::MtuDiscoveryConfig::default();
        d.upper_bound(m);
        t.mtu_discovery_config(Some(d));
        t.initial_mtu(m.min(LONG_HEADER_MTU));
        t.min_mtu(m.min(LONG_HEADER_MTU));
    }
    Ok(t)
}

/// The client side of our data connections.
pub(super) fn client_config(
    id: &Identity,
    alpns: Vec<Vec<u8>>,
    cfg: &QuicConfig,
    sock: &BoundSocket,
) -> Result<quinn::ClientConfig> {
    let tls = id.client_config(alpns)?;
    let quic = QuicClientConfig::try_from(tls)
        .map_err(|e| Error::Io(format!("QUIC client config: {e}")))?;
    let mut c = quinn::ClientConfig::new(Arc::new(quic));
    c.transport_config(Arc::new(transport_config(cfg, sock.figures())?));
    Ok(c)
}

/// The server side.
pub(super) fn server_config(
    id: &Identity,
    alpns: Vec<Vec<u8>>,
    cfg: &QuicConfig,
    sock: &BoundSocket,
) -> Result<quinn::ServerConfig> {
    let tls = id.server_config(alpns)?;
    let quic = QuicServerConfig::try_from(tls)
        .map_err(|e| Error::Io(format!("QUIC server config: {e}")))?;
    let mut s = quinn::ServerConfig::with_crypto(Arc::new(quic));
    s.transport_config(Arc::new(transport_config(cfg, sock.figures())?));
    Ok(s)
}

/// Asks for a large buffer with SO_RCVBUFFORCE/SO_SNDBUFFORCE (allowed to root), falling
/// back to the ordinary options, which the kernel caps at `net.core.[rw]mem_max`.
fn grow_buffers(socket: &socket2::Socket) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let size = SOCKET_BUFFER as libc::c_int;
        for opt in [libc::SO_RCVBUFFORCE, libc::SO_SNDBUFFORCE] {
            // SAFETY: a valid socket descriptor, a pointer to a c_int and its size.
            unsafe {
                libc::setsockopt(
                    socket.as_raw_fd(),
                    libc::SOL_SOCKET,
                    opt,
                    (&size as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                );
            }
        }
    }
    if socket.recv_buffer_size().unwrap_or(0) < SOCKET_BUFFER {
        let _ = socket.set_recv_buffer_size(SOCKET_BUFFER);
    }
    if socket.send_buffer_size().unwrap_or(0) < SOCKET_BUFFER {
        let _ = socket.set_send_buffer_size(SOCKET_BUFFER);
    }
}

/// Binds a UDP socket at `addr` with buffers as large as the kernel allows.
pub(crate) fn bind_socket(addr: SocketAddr, is_master: bool) -> Result<BoundSocket> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::DGRAM,
        Some(socket2::Protocol::UDP),
    )?;
    grow_buffers(&socket);
    socket.bind(&addr.into()).map_err(|e| {
        if is_master {
            Error::Io(format!(
                "rank 0 cannot listen on {addr} (UDP): {e}. MASTER_ADDR must be an address of rank 0's host, and MASTER_PORT free for UDP"
            ))
        } else {
            Error::Io(format!("cannot bind {addr}: {e}"))
        }
    })?;
    let recv_buffer = socket.recv_buffer_size().unwrap_or(MIN_WINDOW as usize * 2);
    let jumbo = super::link_mtu::interface_mtu(addr.ip())
        .and_then(|mtu| super::link_mtu::discovery_ceiling(addr.ip(), mtu));
    Ok(BoundSocket {
        socket: socket.into(),
        recv_buffer,
        loopback: addr.ip().is_loopback(),
        jumbo,
    })
}

/// Makes the QUIC endpoint of a bound socket (accepting connections when `server` is set),
/// through the fault injector when `chaos` is set. `max_datagram` is the largest UDP payload
/// its connections may send ([`SocketFigures::max_datagram`]): segmentation-offload batches
/// are sized to fit one `sendmsg` of such datagrams.
pub(crate) fn endpoint(
    sock: BoundSocket,
    server: Option<quinn::ServerConfig>,
    chaos: Option<super::chaos::ChaosConfig>,
    kill: Arc<std::sync::atomic::AtomicBool>,
    max_datagram: u16,
) -> Result<(Endpoint, Option<Arc<super::chaos::ChaosStats>>)> {
    let mut ep_cfg = EndpointConfig::default();
    ep_cfg
        .max_udp_payload_size(65_527)
        .map_err(|e| Error::Io(format!("endpoint config: {e}")))?;
    let runtime =
        quinn::default_runtime().ok_or_else(|| Error::Io("no async runtime for QUIC".into()))?;
    let socket = runtime.wrap_udp_socket(sock.socket)?;
    let (socket, stats): (Arc<dyn quinn::AsyncUdpSocket>, _) = match chaos {
        None => (socket, None),
        Some(cfg) => {
            let chaos = super::chaos::ChaosSocket::over(socket, cfg, kill)?;
            let stats = chaos.stats();
            (chaos, Some(stats))
        }
    };
    let socket = super::gso_limit::GsoLimit::over(socket, max_datagram);
    let ep = Endpoint::new_with_abstract_socket(ep_cfg, server, socket, runtime)?;
    Ok((ep, stats))
}

/// The local address the kernel would use to reach `target` (no packet is sent).
pub(crate) fn local_ip_towards(target: SocketAddr) -> Result<IpAddr> {
    if target.ip().is_loopback() {
        return Ok(target.ip());
    }
    let any: SocketAddr = if target.is_ipv4() {
        SocketAddr::from(([0, 0, 0, 0], 0))
    } else {
        SocketAddr::from(([0u16; 8], 0))
    };
    let probe = UdpSocket::bind(any)?;
    probe
        .connect(target)
        .map_err(|e| Error::Io(format!("no route to the master at {target}: {e}")))?;
    Ok(probe.local_addr()?.ip())
}

/// The ALPN protocol the handshake settled on.
pub(crate) fn negotiated_alpn(conn: &Connection) -> Option<Vec<u8>> {
    conn.handshake_data()?
        .downcast::<HandshakeData>()
        .ok()?
        .protocol
}

/// A bound endpoint of a request/answer protocol (the parameter server, the membership
/// coordinator), and what goes with it.
pub(crate) struct ControlEndpoint {
    /// The endpoint.
    pub endpoint: Endpoint,
    /// Its client side.
    pub client: quinn::ClientConfig,
    /// Set to drop every datagram (fault injection).
    pub kill: Arc<std::sync::atomic::AtomicBool>,
    /// The fault injector's counters, when there is one.
    pub chaos: Option<Arc<super::chaos::ChaosStats>>,
}

/// Binds `addr` for a request/answer protocol with the job's mutual TLS and ALPN `alpn`,
/// accepting connections when `serve`, with up to `max_streams` requests in flight per
/// connection. A connection silent for `dead_after` is closed (QUIC pings every quarter of
/// it keep live ones open). `tune` (the transport config) may set the stream limit, the
/// MTU and a shorter ping interval.
#[allow(clippy::too_many_arguments)]
pub(crate) fn control_endpoint(
    addr: SocketAddr,
    secret: &[u8],
    serve: bool,
    dead_after: Duration,
    chaos: Option<super::chaos::ChaosConfig>,
    alpn: Vec<u8>,
    max_streams: u32,
    tune: &crate::config::TransportSettings,
) -> Result<ControlEndpoint> {
    let id = Identity::from_secret(secret)?;
    let sock = bind_socket(addr, false)?;
    let mut qc = QuicConfig::new(0, 1, addr);
    qc.idle_timeout = dead_after;
    qc.heartbeat = dead_after / 4;
    qc.mtu = tune.mtu;
    if let Some(h) = tune.heartbeat_interval {
        qc.heartbeat = h;
    }
    let max_streams = tune.max_streams.unwrap_or(max_streams);
    let transport = || -> Result<Arc<TransportConfig>> {
        let mut t = transport_config(&qc, sock.figures())?;
        t.max_concurrent_bidi_streams(VarInt::from_u32(max_streams));
        t.max_concurrent_uni_streams(VarInt::from_u32(0));
        Ok(Arc::new(t))
    };
    let tls = id.client_config(vec![alpn.clone()])?;
    let quic = QuicClientConfig::try_from(tls)
        .map_err(|e| Error::Io(format!("QUIC client config: {e}")))?;
    let mut client = quinn::ClientConfig::new(Arc::new(quic));
    client.transport_config(transport()?);
    let server = if serve {
        let tls = id.server_config(vec![alpn])?;
        let quic = QuicServerConfig::try_from(tls)
            .map_err(|e| Error::Io(format!("QUIC server config: {e}")))?;
        let mut s = quinn::ServerConfig::with_crypto(Arc::new(quic));
        s.transport_config(transport()?);
        Some(s)
    } else {
        None
    };
    let kill = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let max_datagram = sock.figures().max_datagram(&qc);
    let (endpoint, chaos) = endpoint(sock, server, chaos, kill.clone(), max_datagram)?;
    Ok(ControlEndpoint {
        endpoint,
        client,
        kill,
        chaos,
    })
}

/// Accepts connections on a request/answer endpoint until it closes: each one that completes
/// the handshake with a client certificate of the job CA is handed to `serve` (in a task of
/// its own); `refused` counts those that do not.
pub(crate) async fn accept_authenticated<T, F, Fut>(
    endpoint: Endpoint,
    ctx: Arc<T>,
    refused: fn(&T),
    serve: F,
) where
    T: Send + Sync + 'static,
    F: Fn(Arc<T>, Connection) -> Fut + Copy + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    while let Some(incoming) = endpoint.accept().await {
        let ctx = ctx.clone();
        tokio::spawn(async move {
            let Ok(conn) = incoming.await else {
                refused(&ctx);
                return;
            };
            if conn.peer_identity().is_none() {
                refused(&ctx);
                conn.close(
                    VarInt::from_u32(super::close_code::AUTH_REQUIRED),
                    b"a client certificate from the job CA is required",
                );
                return;
            }
            serve(ctx, conn).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TransportSettings;
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Poll, Waker};

    /// One poll of `f`: whether it is ready now.
    fn ready_now<F: Future>(f: F) -> bool {
        let mut f = pin!(f);
        matches!(
            f.as_mut().poll(&mut Context::from_waker(Waker::noop())),
            Poll::Ready(_)
        )
    }

    /// An ordinary (not loopback, not jumbo) socket's figures.
    fn lan_figures() -> SocketFigures {
        SocketFigures {
            window: MIN_WINDOW,
            loopback: false,
            jumbo: None,
        }
    }

    #[test]
    fn the_floor_mtu_is_the_min_mtu_the_connections_get() {
        let addr: SocketAddr = "127.0.0.1:1".parse().expect("addr");
        let mut cfg = QuicConfig::new(0, 2, addr);
        let lan = lan_figures();
        let lo = SocketFigures {
            loopback: true,
            ..lan
        };
        assert_eq!(lan.floor_mtu(&cfg), 1200);
        assert_eq!(lo.floor_mtu(&cfg), LOOPBACK_MIN_MTU);
        cfg.mtu = Some(1440);
        assert_eq!(lan.floor_mtu(&cfg), 1440);
        assert_eq!(lo.floor_mtu(&cfg), 1440);
        cfg.mtu = Some(60_000);
        assert_eq!(lo.floor_mtu(&cfg), LONG_HEADER_MTU);
        // Every configuration builds with that floor.
        for sock in [lan, lo] {
            assert!(transport_config(&cfg, sock).is_ok());
        }
    }

    #[test]
    fn the_largest_datagram_is_the_discovery_ceiling() {
        let addr: SocketAddr = "127.0.0.1:1".parse().expect("addr");
        let mut cfg = QuicConfig::new(0, 2, addr);
        let lan = lan_figures();
        let jumbo = SocketFigures {
            jumbo: Some(8972),
            ..lan
        };
        let lo = SocketFigures {
            loopback: true,
            ..lan
        };
        assert_eq!(lan.max_datagram(&cfg), 1452);
        assert_eq!(jumbo.max_datagram(&cfg), 8972);
        assert_eq!(lo.max_datagram(&cfg), LOOPBACK_MTU);
        assert!(transport_config(&cfg, jumbo).is_ok());
        // A configured size wins everywhere.
        cfg.mtu = Some(1440);
        for sock in [lan, jumbo, lo] {
            assert_eq!(sock.max_datagram(&cfg), 1440);
        }
    }

    #[tokio::test]
    async fn max_streams_bounds_the_streams_open_at_once_and_a_send_waits_for_one() {
        let tune = TransportSettings {
            max_streams: Some(2),
            ..TransportSettings::default()
        };
        let (secret, alpn) = ([7u8; 32], b"mcp-test".to_vec());
        let any: SocketAddr = "127.0.0.1:0".parse().expect("addr");
        let dead = Duration::from_secs(10);
        let server = control_endpoint(any, &secret, true, dead, None, alpn.clone(), 99, &tune)
            .expect("server");
        let client =
            control_endpoint(any, &secret, false, dead, None, alpn, 99, &tune).expect("client");
        let addr = server.endpoint.local_addr().expect("bound");
        let connecting = client
            .endpoint
            .connect_with(client.client.clone(), addr, super::super::tls::SERVER_NAME)
            .expect("connect");
        // The server side must accept for the handshake to go on.
        let accepting = async {
            let incoming = server.endpoint.accept().await.expect("incoming");
            incoming.await.expect("accepted")
        };
        let (conn, peer) = tokio::join!(connecting, accepting);
        let conn = conn.expect("handshake");
        let mut open = Vec::new();
        for i in 0..2u8 {
            let (mut s, _r) = conn.open_bi().await.expect("within the limit");
            s.write_all(&[i]).await.expect("write");
            open.push(s);
        }
        // The limit is the peer's transport parameter: a third stream cannot open yet.
        assert!(
            !ready_now(conn.open_bi()),
            "a third stream opened past max_streams=2"
        );
        // The peer takes the first stream and both sides finish it: its credit comes back
        // and the waiting open goes through.
        let (mut ps, mut pr) = peer.accept_bi().await.expect("first stream");
        let mut b = [0u8; 1];
        pr.read_exact(&mut b).await.expect("read");
        assert_eq!(b, [0]);
        let mut first = open.remove(0);
        first.finish().expect("finish");
        ps.finish().expect("finish");
        pr.read_to_end(16).await.expect("end");
        drop((ps, pr));
        let third = tokio::time::timeout(Duration::from_secs(10), conn.open_bi()).await;
        assert!(matches!(third, Ok(Ok(_))), "the third stream never opened");
    }
}
