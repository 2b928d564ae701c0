//! Times all-reduces between two ranks over real QUIC sockets in one process, and prints the
//! path statistics (RTT, congestion window, MTU, losses): a quick look at the transport.
//!
//! `cargo run --release -p mcp-core --example quic_allreduce -- BYTES ITERS`

use mcp_core::transport::quic::{QuicConfig, QuicTransport};
use mcp_core::wire::Codec;
use mcp_core::{Algorithm, DType, Group, GroupConfig, RawBuf, ReduceOp, Tensor};
use std::net::UdpSocket;
use std::time::{Duration, Instant};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let bytes: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(1 << 26);
    let iters: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(10);
    let master = UdpSocket::bind("127.0.0.1:0")?.local_addr()?;
    let mk = |r| {
        let mut c = QuicConfig::new(r, 2, master);
        c.secret = Some(b"example".to_vec());
        c.connect_timeout = Duration::from_secs(10);
        c
    };
    let (a, b) = tokio::join!(QuicTransport::connect(mk(0)), QuicTransport::connect(mk(1)));
    let ts = [a?, b?];
    let tasks: Vec<_> = ts
        .iter()
        .cloned()
        .map(|t| {
            tokio::spawn(async move {
                let g = Group::new(t, GroupConfig::default());
                let mut data = vec![0u8; bytes];
                let shape = [(bytes / 4) as u64];
                let mut times = Vec::new();
                for i in 0..=iters {
                    // SAFETY: `data` outlives the awaited operation.
                    let buf = unsafe { RawBuf::from_slice(&mut data) };
                    let t0 = Instant::now();
                    g.all_reduce(
                        Tensor {
                            buf,
                            dtype: DType::F32,
                            shape: &shape,
                            codec: Codec::None,
                        },
                        ReduceOp::Sum,
                        Algorithm::Auto,
                    )?
                    .await?;
                    if i > 0 {
                        times.push(t0.elapsed());
                    }
                }
                Ok::<_, mcp_core::Error>(times)
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.push(t.await??);
    }
    let mut t0 = all[0].clone();
    t0.sort();
    let med = t0[t0.len() / 2];
    println!(
        "{bytes} B x {iters}: median {:.3} ms, {:.3} GB/s algbw",
        med.as_secs_f64() * 1e3,
        bytes as f64 / med.as_secs_f64() / 1e9
    );
    for (r, t) in ts.iter().enumerate() {
        if let Some(p) = t.path_stats(1 - r) {
            println!(
                "rank {r}: rtt {:?} cwnd {} mtu {} lost {} sent {} congestion events {}",
                p.rtt, p.cwnd, p.current_mtu, p.lost_packets, p.sent_packets, p.congestion_events
            );
        }
    }
    Ok(())
}
