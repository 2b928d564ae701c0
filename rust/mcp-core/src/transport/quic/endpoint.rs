//! Sockets and QUIC settings: large windows and buffers so that one connection can carry a
//! gradient at the speed of the link, and a large MTU on loopback.

use super::tls::Identity;
use super::QuicConfig;
use crate::error::{Error, Result};
use quinn::crypto::rustls::{HandshakeData, QuicClientConfig, QuicServerConfig};
use quinn::{Connection, Endpoint, EndpointConfig, IdleTimeout, TransportConfig, VarInt};
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

/// Socket buffer we ask the kernel for (it may grant less).
const SOCKET_BUFFER: usize = 16 << 20;

fn transport_config(cfg: &QuicConfig, loopback: bool) -> Result<TransportConfig> {
    let mut t = TransportConfig::default();
    t.max_concurrent_uni_streams(VarInt::from_u32(16_384));
    t.max_concurrent_bidi_streams(VarInt::from_u32(16));
    t.stream_receive_window(VarInt::from_u32(64 << 20));
    t.receive_window(VarInt::from_u32(1 << 30));
    t.send_window(1 << 30);
    let idle = IdleTimeout::try_from(cfg.idle_timeout).map_err(|_| {
        Error::InvalidArgument(format!("idle timeout {:?} is too large", cfg.idle_timeout))
    })?;
    t.max_idle_timeout(Some(idle));
    t.keep_alive_interval(Some((cfg.idle_timeout / 4).max(Duration::from_millis(100))));
    if loopback {
        // Loopback carries 64 KiB datagrams: fewer packets, far less per-packet work. The
        // handshake starts at the default MTU and discovery climbs within a few round trips.
        let mut mtu = quinn::MtuDiscoveryConfig::default();
        mtu.upper_bound(65_000);
        t.mtu_discovery_config(Some(mtu));
    }
    Ok(t)
}

/// The client side of our data connections.
pub(super) fn client_config(
    id: &Identity,
    alpns: Vec<Vec<u8>>,
    cfg: &QuicConfig,
) -> Result<quinn::ClientConfig> {
    let tls = id.client_config(alpns)?;
    let quic = QuicClientConfig::try_from(tls)
        .map_err(|e| Error::Io(format!("QUIC client config: {e}")))?;
    let mut c = quinn::ClientConfig::new(Arc::new(quic));
    c.transport_config(Arc::new(transport_config(
        cfg,
        cfg.master.ip().is_loopback(),
    )?));
    Ok(c)
}

/// The server side.
pub(super) fn server_config(
    id: &Identity,
    alpns: Vec<Vec<u8>>,
    cfg: &QuicConfig,
) -> Result<quinn::ServerConfig> {
    let tls = id.server_config(alpns)?;
    let quic = QuicServerConfig::try_from(tls)
        .map_err(|e| Error::Io(format!("QUIC server config: {e}")))?;
    let mut s = quinn::ServerConfig::with_crypto(Arc::new(quic));
    s.transport_config(Arc::new(transport_config(
        cfg,
        cfg.master.ip().is_loopback(),
    )?));
    Ok(s)
}

/// Binds a UDP socket at `addr` with large buffers and makes an endpoint of it.
pub(super) fn bind(
    addr: SocketAddr,
    server: quinn::ServerConfig,
    is_master: bool,
) -> Result<Endpoint> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::DGRAM,
        Some(socket2::Protocol::UDP),
    )?;
    let _ = socket.set_recv_buffer_size(SOCKET_BUFFER);
    let _ = socket.set_send_buffer_size(SOCKET_BUFFER);
    socket.bind(&addr.into()).map_err(|e| {
        if is_master {
            Error::Io(format!(
                "rank 0 cannot listen on {addr} (UDP): {e}. MASTER_ADDR must be an address of rank 0's host, and MASTER_PORT free for UDP"
            ))
        } else {
            Error::Io(format!("cannot bind {addr}: {e}"))
        }
    })?;
    let socket: UdpSocket = socket.into();
    let mut ep_cfg = EndpointConfig::default();
    ep_cfg
        .max_udp_payload_size(65_527)
        .map_err(|e| Error::Io(format!("endpoint config: {e}")))?;
    let runtime =
        quinn::default_runtime().ok_or_else(|| Error::Io("no async runtime for QUIC".into()))?;
    Ok(Endpoint::new(ep_cfg, Some(server), socket, runtime)?)
}

/// The local address the kernel would use to reach `target` (no packet is sent).
pub(super) fn local_ip_towards(target: SocketAddr) -> Result<IpAddr> {
    if target.ip().is_loopback() {
        return Ok(target.ip());
    }
    let any: SocketAddr = if target.is_ipv4() {
        "0.0.0.0:0"
            .parse()
            .map_err(|_| Error::Io("bad address".into()))?
    } else {
        "[::]:0"
            .parse()
            .map_err(|_| Error::Io("bad address".into()))?
    };
    let probe = UdpSocket::bind(any)?;
    probe
        .connect(target)
        .map_err(|e| Error::Io(format!("no route to the master at {target}: {e}")))?;
    Ok(probe.local_addr()?.ip())
}

/// The ALPN protocol the handshake settled on.
pub(super) fn negotiated_alpn(conn: &Connection) -> Option<Vec<u8>> {
    conn.handshake_data()?
        .downcast::<HandshakeData>()
        .ok()?
        .protocol
}
