//! The shared-memory path of the QUIC transport, all ranks in one process: ranks of one host
//! send through rings in memory, ranks of other hosts (here: another `host_id`) over QUIC,
//! and collectives are bit-exact either way.

use mcp_core::transport::quic::{QuicConfig, QuicTransport};
use mcp_core::wire::Codec;
use mcp_core::{Algorithm, DType, Group, GroupConfig, RawBuf, ReduceOp, Tensor};
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

fn free_port() -> SocketAddr {
    let s = UdpSocket::bind("127.0.0.1:0").expect("bind");
    s.local_addr().expect("addr")
}

type G = Group<QuicTransport>;

async fn mesh(hosts: &[&str], shm: &[bool], ring: usize) -> Vec<G> {
    let master = free_port();
    let world = hosts.len();
    let tasks: Vec<_> = (0..world)
        .map(|r| {
            let mut c = QuicConfig::new(r, world, master);
            c.secret = Some(b"shm test secret".to_vec());
            c.connect_timeout = Duration::from_secs(20);
            c.host_id = Some(hosts[r].to_string());
            c.shm = shm[r];
            c.shm_ring_bytes = ring;
            tokio::spawn(QuicTransport::connect(c))
        })
        .collect();
    let mut out = Vec::new();
    let cfg = GroupConfig {
        timeout: Duration::from_secs(30),
        ..GroupConfig::default()
    };
    for t in tasks {
        out.push(Group::new(
            t.await.expect("join").expect("connect"),
            cfg.clone(),
        ));
    }
    out
}

fn as_bytes(v: &mut [f32]) -> &mut [u8] {
    let len = std::mem::size_of_val(v);
    // SAFETY: f32 has no padding and any byte pattern is a valid u8.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), len) }
}

/// All-reduces `n` floats (sum) on every transport; checks every element exactly.
async fn all_reduce_checked(ts: &[G], n: usize, algorithm: Algorithm) {
    let w = ts.len();
    let tasks: Vec<_> = ts
        .iter()
        .cloned()
        .enumerate()
        .map(|(r, t)| {
            tokio::spawn(async move {
                let g = t;
                let mut data: Vec<f32> = (0..n).map(|i| ((i * 7 + r) % 13) as f32).collect();
                let shape = [n as u64];
                let bytes = as_bytes(&mut data);
                // SAFETY: `data` outlives the awaited operation and nothing else touches it.
                let buf = unsafe { RawBuf::new(bytes.as_mut_ptr(), bytes.len()) };
                let tensor = Tensor {
                    buf,
                    dtype: DType::F32,
                    shape: &shape,
                    codec: Codec::None,
                };
                let res = g
                    .all_reduce(tensor, ReduceOp::Sum, algorithm)
                    .expect("valid")
                    .await;
                let st = g.transport().stats();
                if let Err(e) = res {
                    panic!(
                        "rank {r}: {e}; shm frames sent {} received {}, bytes sent {} received {}",
                        st.shm_frames_sent.load(Relaxed),
                        st.shm_frames_received.load(Relaxed),
                        st.shm_bytes_sent.load(Relaxed),
                        st.shm_bytes_received.load(Relaxed)
                    );
                }
                data
            })
        })
        .collect();
    for t in tasks {
        let got = t.await.expect("join");
        for (i, v) in got.iter().enumerate() {
            let want: f32 = (0..w).map(|r| ((i * 7 + r) % 13) as f32).sum();
            assert_eq!(*v, want, "element {i}");
        }
    }
}

async fn close(ts: Vec<G>) {
    let tasks: Vec<_> = ts
        .into_iter()
        .map(|g| tokio::spawn(async move { g.close().await }))
        .collect();
    for t in tasks {
        t.await.expect("join");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_of_one_host_all_reduce_through_shared_memory_wrapping_the_ring() {
    let ts = mesh(&["h", "h", "h"], &[true; 3], 64 << 10).await;
    for (r, t) in ts.iter().enumerate() {
        assert_eq!(t.transport().host_of_rank(), vec![0, 0, 0]);
        let others: Vec<usize> = (0..3).filter(|&p| p != r).collect();
        assert_eq!(t.transport().shm_peers(), others, "rank {r}");
        assert!(
            t.transport().shm_fallbacks().is_empty(),
            "{:?}",
            t.transport().shm_fallbacks()
        );
    }
    let before: Vec<u64> = ts
        .iter()
        .map(|t| t.transport().stats().bytes_sent.load(Relaxed))
        .collect();
    // 1 Mi floats (4 MiB) through 64 KiB rings: each ring wraps dozens of times.
    all_reduce_checked(&ts, (1 << 20) + 3, Algorithm::Ring).await;
    all_reduce_checked(&ts, 1001, Algorithm::Tree).await;
    for (t, b) in ts.iter().zip(before) {
        // QUIC carries the connections' hellos and heartbeats only, no data.
        let quic = t.transport().stats().bytes_sent.load(Relaxed) - b;
        assert!(quic < 64 << 10, "{quic} bytes went over QUIC");
        assert!(t.transport().stats().shm_bytes_sent.load(Relaxed) > 4 << 20);
        assert!(t.transport().stats().shm_frames_received.load(Relaxed) > 0);
    }
    close(ts).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hosts_use_quic_between_them_and_shared_memory_inside() {
    let ts = mesh(&["a", "a", "b", "b"], &[true; 4], 64 << 10).await;
    assert_eq!(ts[3].transport().host_of_rank(), vec![0, 0, 1, 1]);
    assert_eq!(ts[0].transport().shm_peers(), vec![1]);
    assert_eq!(ts[1].transport().shm_peers(), vec![0]);
    assert_eq!(ts[2].transport().shm_peers(), vec![3]);
    assert_eq!(ts[3].transport().shm_peers(), vec![2]);
    all_reduce_checked(&ts, 300_007, Algorithm::Ring).await;
    // The ring runs 0 -> 1 (shared memory), 1 -> 2 (QUIC), 2 -> 3 (shared memory), 3 -> 0.
    for (r, t) in ts.iter().enumerate() {
        let shm = t.transport().stats().shm_bytes_sent.load(Relaxed);
        assert_eq!(
            shm > 0,
            r % 2 == 0,
            "rank {r} sent {shm} bytes through shared memory"
        );
        assert!(t.transport().stats().shm_bytes_received.load(Relaxed) > 0 || r % 2 == 0);
    }
    close(ts).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_with_shared_memory_off_is_reached_over_quic() {
    let ts = mesh(&["h", "h", "h"], &[true, false, true], 64 << 10).await;
    assert_eq!(ts[0].transport().shm_peers(), vec![2]);
    assert!(ts[1].transport().shm_peers().is_empty());
    assert_eq!(ts[2].transport().shm_peers(), vec![0]);
    // Turned off by choice: not a failure to report.
    assert!(ts[0].transport().shm_fallbacks().is_empty());
    all_reduce_checked(&ts, 70_001, Algorithm::Ring).await;
    close(ts).await;
}
