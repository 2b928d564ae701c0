//! What a path allows without mcp_fast on it: raw UDP with segmentation offload (GSO/GRO), a
//! plain quinn bulk transfer, a UDP ping-pong, and a plain quinn ping-pong on one stream. `benches/bench_hosts.py --limits` runs
//! each pair across the two namespace hosts, so the collective figures can be read against
//! the path's own limits.
//!
//! ```text
//! link_limits udp-sink  BIND BYTES        link_limits udp-blast TO BYTES
//! link_limits quic-sink BIND BYTES CERT   link_limits quic-send TO BYTES CERT
//! link_limits pong BIND SIZE COUNT        link_limits ping TO SIZE COUNT
//! link_limits quic-pong BIND SIZE COUNT CERT   link_limits quic-ping TO SIZE COUNT CERT
//! ```
//!
//! Each sink or pong prints one line of JSON when done.

use bytes::Bytes;
use quinn::udp::{RecvMeta, Transmit, UdpSocketState};
use std::io::IoSliceMut;
use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// UDP payload of one segment on a 1,500-byte path (IPv4 and UDP headers off).
const SEGMENT: usize = 1472;
/// How long a sink waits for more after the last datagram before it reports.
const IDLE: Duration = Duration::from_millis(500);

fn arg(args: &[String], i: usize, what: &str) -> Res<String> {
    args.get(i)
        .cloned()
        .ok_or_else(|| format!("missing argument {i}: {what} (see the file's header)").into())
}

fn big_socket(bind: SocketAddr) -> Res<UdpSocket> {
    let s = socket2::Socket::new(
        socket2::Domain::for_address(bind),
        socket2::Type::DGRAM,
        None,
    )?;
    let _ = s.set_recv_buffer_size(32 << 20);
    let _ = s.set_send_buffer_size(32 << 20);
    s.bind(&bind.into())?;
    Ok(s.into())
}

/// Counts datagrams (GRO on) until `bytes` arrived or the sender fell silent.
fn udp_sink(bind: SocketAddr, bytes: u64) -> Res<()> {
    let sock = big_socket(bind)?;
    let state = UdpSocketState::new((&sock).into())?;
    sock.set_read_timeout(Some(IDLE))?;
    let mut buf = vec![0u8; 64 << 10];
    let (mut got, mut first, mut last) = (0u64, None, Instant::now());
    let give_up = Instant::now() + Duration::from_secs(30);
    while got < bytes && Instant::now() < give_up {
        let mut meta = [RecvMeta::default()];
        let mut bufs = [IoSliceMut::new(&mut buf)];
        match state.recv((&sock).into(), &mut bufs, &mut meta) {
            Ok(_) => {
                first.get_or_insert_with(Instant::now);
                last = Instant::now();
                got += meta[0].len as u64;
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                if first.is_some() {
                    break;
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    let secs = first.map_or(0.0, |f| last.duration_since(f).as_secs_f64());
    println!(
        "{{\"udp_received_bytes\": {got}, \"udp_seconds\": {secs:.6}, \"udp_gbit_s\": {:.3}, \"gro_segments\": {}}}",
        got as f64 * 8.0 / secs.max(1e-9) / 1e9,
        state.gro_segments()
    );
    Ok(())
}

/// Sends `bytes` in GSO batches of as many segments as the kernel takes.
fn udp_blast(to: SocketAddr, bytes: u64) -> Res<()> {
    let bind: SocketAddr = if to.is_ipv4() {
        "0.0.0.0:0".parse()?
    } else {
        "[::]:0".parse()?
    };
    let sock = big_socket(bind)?;
    let state = UdpSocketState::new((&sock).into())?;
    // One GSO call carries at most one UDP datagram's worth (64 KiB) of segments.
    let segs = state.max_gso_segments().clamp(1, 65_000 / SEGMENT);
    let batch = vec![7u8; SEGMENT * segs];
    let start = Instant::now();
    let mut sent = 0u64;
    while sent < bytes {
        let t = Transmit {
            destination: to,
            ecn: None,
            contents: &batch,
            segment_size: (segs > 1).then_some(SEGMENT),
            src_ip: None,
        };
        match state.send((&sock).into(), &t) {
            Ok(()) => sent += batch.len() as u64,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::yield_now(),
            Err(e) => return Err(e.into()),
        }
    }
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "udp-blast: {sent} bytes in {secs:.3} s ({:.2} Gbit/s offered, {segs} segments per call)",
        sent as f64 * 8.0 / secs / 1e9
    );
    Ok(())
}

/// The settings mcp_fast gives quinn that matter for bulk transfer (windows, prompt ACKs).
fn transport() -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    let w = 16u32 << 20;
    t.stream_receive_window(quinn::VarInt::from_u32(w));
    t.receive_window(quinn::VarInt::from_u32(w));
    t.send_window(u64::from(w) * 4);
    let mut ack = quinn::AckFrequencyConfig::default();
    ack.max_ack_delay(Some(Duration::from_millis(1)));
    ack.ack_eliciting_threshold(quinn::VarInt::from_u32(7));
    t.ack_frequency_config(Some(ack));
    t
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites = vec![rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256];
    Arc::new(p)
}

/// A server endpoint on `bind` with a fresh self-signed certificate, written to `cert_out`.
fn server_endpoint(bind: SocketAddr, cert_out: &str) -> Res<quinn::Endpoint> {
    let key = rcgen::generate_simple_self_signed(vec!["limits.invalid".into()])?;
    std::fs::write(cert_out, key.cert.der())?;
    let der = rustls::pki_types::PrivateKeyDer::Pkcs8(key.signing_key.serialize_der().into());
    let tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_no_client_auth()
        .with_single_cert(vec![key.cert.der().clone()], der)?;
    let mut tls = tls;
    tls.alpn_protocols = vec![b"limits".to_vec()];
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls)?;
    let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    cfg.transport_config(Arc::new(transport()));
    Ok(quinn::Endpoint::new(
        quinn::EndpointConfig::default(),
        Some(cfg),
        big_socket(bind)?,
        Arc::new(quinn::TokioRuntime),
    )?)
}

/// A connection to the server at `to` whose certificate is in `cert`.
async fn connect(to: SocketAddr, cert: &str) -> Res<quinn::Connection> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(rustls::pki_types::CertificateDer::from(std::fs::read(
        cert,
    )?))?;
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = vec![b"limits".to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls)?;
    let mut cfg = quinn::ClientConfig::new(Arc::new(crypto));
    cfg.transport_config(Arc::new(transport()));
    let bind: SocketAddr = if to.is_ipv4() {
        "0.0.0.0:0".parse()?
    } else {
        "[::]:0".parse()?
    };
    let mut ep = quinn::Endpoint::new(
        quinn::EndpointConfig::default(),
        None,
        big_socket(bind)?,
        Arc::new(quinn::TokioRuntime),
    )?;
    ep.set_default_client_config(cfg);
    Ok(ep.connect(to, "limits.invalid")?.await?)
}

/// Receives one stream of `bytes` and reports the rate from its first byte to its end.
async fn quic_sink(bind: SocketAddr, bytes: u64, cert_out: &str) -> Res<()> {
    let ep = server_endpoint(bind, cert_out)?;
    let conn = ep.accept().await.ok_or("endpoint closed")?.await?;
    let mut s = conn.accept_uni().await?;
    let (mut got, mut first) = (0u64, None);
    while let Some(chunk) = s.read_chunk(usize::MAX, false).await? {
        first.get_or_insert_with(Instant::now);
        got += chunk.bytes.len() as u64;
    }
    let secs = first.map_or(0.0, |f: Instant| f.elapsed().as_secs_f64());
    let stats = conn.stats();
    println!(
        "{{\"quic_received_bytes\": {got}, \"quic_seconds\": {secs:.6}, \"quic_gbit_s\": {:.3}, \"quic_lost_packets\": {}}}",
        got as f64 * 8.0 / secs.max(1e-9) / 1e9,
        stats.path.lost_packets
    );
    conn.close(0u32.into(), b"done");
    ep.wait_idle().await;
    let _ = bytes;
    Ok(())
}

/// Sends `bytes` on one stream from shared buffers (no copy on our side).
async fn quic_send(to: SocketAddr, bytes: u64, cert: &str) -> Res<()> {
    let conn = connect(to, cert).await?;
    let mut s = conn.open_uni().await?;
    let block = Bytes::from(vec![7u8; 1 << 20]);
    let mut left = bytes;
    while left > 0 {
        let n = left.min(block.len() as u64) as usize;
        s.write_chunk(block.slice(..n)).await?;
        left -= n as u64;
    }
    s.finish()?;
    conn.closed().await;
    Ok(())
}

/// Echoes `count` messages of `size` bytes on one bidirectional stream.
async fn quic_pong(bind: SocketAddr, size: usize, count: usize, cert_out: &str) -> Res<()> {
    let ep = server_endpoint(bind, cert_out)?;
    let conn = ep.accept().await.ok_or("endpoint closed")?.await?;
    let (mut send, mut recv) = conn.accept_bi().await?;
    let mut buf = vec![0u8; size.max(1)];
    for _ in 0..count {
        recv.read_exact(&mut buf).await?;
        send.write_all(&buf).await?;
    }
    send.finish()?;
    conn.closed().await;
    Ok(())
}

/// Sends `count` messages of `size` bytes on one stream, each after the last one's echo: the
/// round trip of a small message through quinn alone (one thread, no hand-overs).
async fn quic_ping(to: SocketAddr, size: usize, count: usize, cert: &str) -> Res<()> {
    let conn = connect(to, cert).await?;
    let (mut send, mut recv) = conn.open_bi().await?;
    let buf = vec![1u8; size.max(1)];
    let mut back = vec![0u8; size.max(1)];
    let mut rtts = Vec::with_capacity(count);
    for _ in 0..count {
        let t0 = Instant::now();
        send.write_all(&buf).await?;
        recv.read_exact(&mut back).await?;
        rtts.push(t0.elapsed().as_secs_f64());
    }
    // The first exchanges open the stream and grow the window: not the steady state.
    let steady = &mut rtts[count / 10..];
    steady.sort_by(f64::total_cmp);
    let median = steady.get(steady.len() / 2).copied().unwrap_or(f64::NAN);
    println!("{{\"quic_ping_bytes\": {size}, \"quic_ping_median_s\": {median:.9}}}");
    conn.close(0u32.into(), b"done");
    Ok(())
}

/// Echoes `count` datagrams of `size` bytes.
fn pong(bind: SocketAddr, size: usize, count: usize) -> Res<()> {
    let sock = UdpSocket::bind(bind)?;
    sock.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut buf = vec![0u8; size.max(1)];
    for _ in 0..count {
        let (n, from) = sock.recv_from(&mut buf)?;
        sock.send_to(&buf[..n], from)?;
    }
    Ok(())
}

/// Sends `count` datagrams of `size` bytes one at a time, each after the last one's echo.
fn ping(to: SocketAddr, size: usize, count: usize) -> Res<()> {
    let bind: SocketAddr = if to.is_ipv4() {
        "0.0.0.0:0".parse()?
    } else {
        "[::]:0".parse()?
    };
    let sock = UdpSocket::bind(bind)?;
    sock.set_read_timeout(Some(Duration::from_secs(2)))?;
    let buf = vec![1u8; size.max(1)];
    let mut back = vec![0u8; size.max(1)];
    let mut rtts = Vec::with_capacity(count);
    for _ in 0..count {
        let t0 = Instant::now();
        sock.send_to(&buf, to)?;
        sock.recv_from(&mut back)?;
        rtts.push(t0.elapsed().as_secs_f64());
    }
    rtts.sort_by(f64::total_cmp);
    let median = rtts.get(rtts.len() / 2).copied().unwrap_or(f64::NAN);
    println!("{{\"ping_bytes\": {size}, \"ping_median_s\": {median:.9}}}");
    Ok(())
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    let mode = arg(&args, 1, "mode")?;
    let addr: SocketAddr = arg(&args, 2, "address")?.parse()?;
    let n: u64 = arg(&args, 3, "bytes or size")?.parse()?;
    let rt = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    };
    match mode.as_str() {
        "udp-sink" => udp_sink(addr, n),
        "udp-blast" => udp_blast(addr, n),
        "quic-sink" => rt()?.block_on(quic_sink(addr, n, &arg(&args, 4, "cert path")?)),
        "quic-send" => rt()?.block_on(quic_send(addr, n, &arg(&args, 4, "cert path")?)),
        "pong" => pong(addr, n as usize, arg(&args, 4, "count")?.parse()?),
        "ping" => ping(addr, n as usize, arg(&args, 4, "count")?.parse()?),
        "quic-pong" => rt()?.block_on(quic_pong(
            addr,
            n as usize,
            arg(&args, 4, "count")?.parse()?,
            &arg(&args, 5, "cert path")?,
        )),
        "quic-ping" => rt()?.block_on(quic_ping(
            addr,
            n as usize,
            arg(&args, 4, "count")?.parse()?,
            &arg(&args, 5, "cert path")?,
        )),
        m => Err(format!(
            "unknown mode {m:?}: udp-sink, udp-blast, quic-sink, quic-send, pong, ping, \
             quic-pong, quic-ping"
        )
        .into()),
    }
}
