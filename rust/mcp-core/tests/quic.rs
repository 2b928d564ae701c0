//! The QUIC transport end to end, all ranks in one process on 127.0.0.1: rendezvous, mutual
//! TLS, version negotiation and a collective over real sockets.

use mcp_core::transport::quic::{QuicConfig, QuicTransport};
use mcp_core::transport::Transport;
use mcp_core::wire::Codec;
use mcp_core::{Algorithm, DType, Error, Group, GroupConfig, RawBuf, ReduceOp, Tensor};
use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

fn free_port() -> SocketAddr {
    let s = UdpSocket::bind("127.0.0.1:0").expect("bind");
    s.local_addr().expect("addr")
}

fn config(rank: usize, world: usize, master: SocketAddr, secret: Option<&[u8]>) -> QuicConfig {
    let mut c = QuicConfig::new(rank, world, master);
    c.secret = secret.map(|s| s.to_vec());
    c.connect_timeout = Duration::from_secs(10);
    c.idle_timeout = Duration::from_secs(5);
    // These tests are about QUIC itself (dialling, breakers, lanes): no shared memory.
    c.shm = false;
    c
}

async fn mesh(world: usize, secret: Option<&'static [u8]>) -> Vec<Arc<QuicTransport>> {
    let master = free_port();
    let tasks: Vec<_> = (0..world)
        .map(|r| tokio::spawn(QuicTransport::connect(config(r, world, master, secret))))
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("join").expect("connect"));
    }
    out
}

async fn all_reduce_over(ts: Vec<Arc<QuicTransport>>, n: usize) {
    let w = ts.len();
    let tasks: Vec<_> = ts
        .into_iter()
        .enumerate()
        .map(|(r, t)| {
            tokio::spawn(async move {
                let g = Group::new(t, GroupConfig::default());
                let mut data: Vec<f32> = (0..n).map(|i| ((i + r) % 5) as f32).collect();
                let shape = [n as u64];
                let bytes = bytemuck_bytes(&mut data);
                // SAFETY: `data` outlives the awaited operation and nothing else touches it.
                let buf = unsafe { RawBuf::new(bytes.as_mut_ptr(), bytes.len()) };
                g.all_reduce(
                    Tensor {
                        buf,
                        dtype: DType::F32,
                        shape: &shape,
                        codec: Codec::None,
                    },
                    ReduceOp::Sum,
                    Algorithm::Auto,
                )
                .expect("valid")
                .await
                .expect("all_reduce");
                g.close().await;
                data
            })
        })
        .collect();
    for t in tasks {
        let got = t.await.expect("join");
        for (i, v) in got.iter().enumerate() {
            let want: f32 = (0..w).map(|r| ((i + r) % 5) as f32).sum();
            assert_eq!(*v, want, "element {i}");
        }
    }
}

/// OK verdicts wait to share a packet (`OK_VERDICT_DELAY`): they still go when nothing else
/// is sent after the frames, so the senders let go of every frame without closing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ok_verdicts_arrive_without_further_traffic() {
    use mcp_core::transport::quic::OK_VERDICT_DELAY;
    let ts = mesh(2, Some(b"verdicts")).await;
    let groups: Vec<_> = ts
        .iter()
        .map(|t| Group::new(t.clone(), GroupConfig::default()))
        .collect();
    let tasks: Vec<_> = groups
        .iter()
        .cloned()
        .enumerate()
        .map(|(r, g)| {
            tokio::spawn(async move {
                for i in 0..20u32 {
                    let mut data: Vec<f32> = (0..1024).map(|k| (k % 7 + r) as f32).collect();
                    let shape = [1024u64];
                    let bytes = bytemuck_bytes(&mut data);
                    // SAFETY: `data` outlives the awaited operation and nothing else touches it.
                    let buf = unsafe { RawBuf::new(bytes.as_mut_ptr(), bytes.len()) };
                    let t = Tensor {
                        buf,
                        dtype: DType::F32,
                        shape: &shape,
                        codec: Codec::None,
                    };
                    g.all_reduce(t, ReduceOp::Sum, Algorithm::Auto)
                        .expect("valid")
                        .await
                        .expect("all_reduce");
                    let want: Vec<f32> = (0..1024).map(|k| (2 * (k % 7) + 1) as f32).collect();
                    assert_eq!(data, want, "operation {i}");
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("join");
    }
    // Bounded: a thousand times the delay, far beyond any scheduling hiccup.
    let until = std::time::Instant::now() + OK_VERDICT_DELAY * 1000;
    while ts.iter().any(|t| t.unacknowledged_streams() > 0) && std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let left: Vec<usize> = ts.iter().map(|t| t.unacknowledged_streams()).collect();
    assert_eq!(left, [0, 0], "frames still waiting for their verdicts");
    for g in &groups {
        g.close().await;
    }
}

fn bytemuck_bytes(v: &mut [f32]) -> &mut [u8] {
    let len = std::mem::size_of_val(v);
    // SAFETY: f32 has no padding and any byte pattern is a valid u8.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), len) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_reduce_over_quic_with_a_given_secret() {
    let ts = mesh(3, Some(b"job-secret")).await;
    all_reduce_over(ts, 300_001).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generated_secret_is_handed_out_at_rendezvous() {
    let ts = mesh(2, None).await;
    assert_eq!(ts[0].secret(), ts[1].secret());
    assert_eq!(ts[0].secret().len(), 32);
    all_reduce_over(ts, 1000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_secret_is_refused_at_the_handshake() {
    let master = free_port();
    let r0 = tokio::spawn(QuicTransport::connect(config(0, 2, master, Some(b"right"))));
    let mut bad = config(1, 2, master, Some(b"wrong"));
    bad.connect_timeout = Duration::from_secs(3);
    let err = QuicTransport::connect(bad).await.err();
    assert!(matches!(err, Some(Error::Authentication { .. })), "{err:?}");
    r0.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_protocol_version_is_refused_with_both_versions() {
    let master = free_port();
    let r0 = tokio::spawn(QuicTransport::connect(config(0, 2, master, Some(b"s"))));
    let mut newer = config(1, 2, master, Some(b"s"));
    newer.protocol_major = 2;
    match QuicTransport::connect(newer).await {
        Err(Error::VersionMismatch { ours, theirs, .. }) => {
            assert!(ours.starts_with("2."), "{ours}");
            assert!(theirs.starts_with("1."), "{theirs}");
        }
        other => panic!("expected VersionMismatch, got {:?}", other.err()),
    }
    r0.abort();
}

/// Minor versions are pinned too: a minor version may frame data differently, so a peer of
/// another minor is refused at the handshake with both versions named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_minor_version_is_refused_with_both_versions() {
    use mcp_core::wire::{PROTOCOL_MAJOR, PROTOCOL_MINOR};
    let master = free_port();
    let r0 = tokio::spawn(QuicTransport::connect(config(0, 2, master, Some(b"s"))));
    let mut older = config(1, 2, master, Some(b"s"));
    older.protocol_minor = PROTOCOL_MINOR.wrapping_sub(1);
    match QuicTransport::connect(older).await {
        Err(Error::VersionMismatch { ours, theirs, .. }) => {
            assert_eq!(
                ours,
                format!("{PROTOCOL_MAJOR}.{}", PROTOCOL_MINOR.wrapping_sub(1))
            );
            assert_eq!(theirs, format!("{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}"));
        }
        other => panic!("expected VersionMismatch, got {:?}", other.err()),
    }
    r0.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_rank_times_out_naming_it() {
    let master = free_port();
    let mut c = config(0, 3, master, Some(b"s"));
    c.connect_timeout = Duration::from_secs(2);
    let r1 = tokio::spawn(QuicTransport::connect({
        let mut c1 = config(1, 3, master, Some(b"s"));
        c1.connect_timeout = Duration::from_secs(2);
        c1
    }));
    match QuicTransport::connect(c).await {
        Err(Error::Timeout { what, .. }) => assert!(what.contains("[2]"), "{what}"),
        other => panic!("expected Timeout, got {:?}", other.err()),
    }
    let _ = r1.await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_peer_trips_the_breaker_and_later_dials_fail_fast() {
    let ts = mesh(3, Some(b"s")).await;
    // Rank 1 goes away before rank 2 ever dialled it (connections are made on demand, by the
    // higher rank).
    ts[1].shutdown().await;
    let g2 = Group::new(ts[2].clone(), GroupConfig::default());
    let mut data = vec![0f32; 4];
    let shape = [4u64];
    let send = |g: &Group<QuicTransport>, data: &mut Vec<f32>| {
        let bytes = bytemuck_bytes(data);
        // SAFETY: `data` outlives the awaited operation.
        let buf = unsafe { RawBuf::new(bytes.as_mut_ptr(), bytes.len()) };
        g.send(
            Tensor {
                buf,
                dtype: DType::F32,
                shape: &shape,
                codec: Codec::None,
            },
            1,
            0,
        )
    };
    let first = send(&g2, &mut data).expect("valid").await;
    assert!(first.is_err(), "sending to a dead rank must fail");
    let t0 = std::time::Instant::now();
    let second = send(&g2, &mut data).expect("valid").await;
    match second {
        Err(Error::PeerLost {
            rank: 1, reason, ..
        }) => assert!(reason.contains("circuit breaker"), "{reason}"),
        other => panic!("expected the open breaker, got {other:?}"),
    }
    assert!(
        t0.elapsed() < Duration::from_millis(500),
        "an open breaker must fail fast"
    );
}

async fn mesh_with(world: usize, tweak: impl Fn(&mut QuicConfig)) -> Vec<Arc<QuicTransport>> {
    let master = free_port();
    let tasks: Vec<_> = (0..world)
        .map(|r| {
            let mut c = config(r, world, master, Some(b"fec"));
            // A control message of the lane (END, NACKs) crosses the same 20 %-loss socket,
            // and QUIC's retransmissions back off exponentially: once in a few dozen runs of
            // a loaded CI machine one waited past a 20 s limit and the sender gave up. The
            // test is of exactness through loss, so it allows a minute.
            c.idle_timeout = Duration::from_secs(60);
            // The handshakes themselves cross the lossy socket: give them a real deadline.
            c.connect_timeout = Duration::from_secs(60);
            // What is tested here is the lane, not the failure detector: a loaded CI machine
            // and 20 % loss can silence a peer for more than the default 3 heartbeats.
            c.heartbeat = Duration::from_secs(10);
            tweak(&mut c);
            tokio::spawn(QuicTransport::connect(c))
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("join").expect("connect"));
    }
    out
}

/// Every frame as FEC-coded datagrams through a socket that loses 20 % of them, with 1 % of
/// the shards corrupted above QUIC: the all-reduce is still exact, shards were really sent,
/// and the corrupted ones were erasures (no frame failed its CRC).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fec_lane_is_exact_through_loss_and_corruption() {
    use mcp_core::transport::quic::{chaos::ChaosConfig, LanePolicy};
    use std::sync::atomic::Ordering::Relaxed;
    let ts = mesh_with(3, |c| {
        c.bulk.policy = LanePolicy::Fec;
        c.chaos = Some(ChaosConfig::parse("loss=0.2,corrupt=0.01,seed=5").expect("spec"));
    })
    .await;
    all_reduce_over(ts.clone(), 300_001).await;
    for t in &ts {
        let s = t.stats();
        assert!(s.bulk_frames_sent.load(Relaxed) >= 4, "rank {}", t.rank());
        assert!(
            s.bulk_frames_received.load(Relaxed) >= 4,
            "rank {}",
            t.rank()
        );
        assert_eq!(s.corrupt_frames.load(Relaxed), 0);
        let c = t.chaos_stats().expect("chaos");
        assert!(c.send_dropped.load(Relaxed) > 0);
    }
}

/// A transfer whose repairs cannot finish it is withdrawn and its frame carried on a stream:
/// with no repair round allowed, every FEC-lane frame through 20 % loss that a first pass
/// did not complete goes that way, and the all-reduce is still exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fec_transfers_the_repairs_cannot_finish_fall_back_to_a_stream() {
    use mcp_core::transport::quic::{chaos::ChaosConfig, LanePolicy};
    use std::sync::atomic::Ordering::Relaxed;
    let ts = mesh_with(2, |c| {
        c.bulk.policy = LanePolicy::Fec;
        c.bulk.repair_rounds = 0;
        c.chaos = Some(ChaosConfig::parse("loss=0.2,seed=5").expect("spec"));
    })
    .await;
    all_reduce_over(ts.clone(), 300_001).await;
    let fallbacks: u64 = ts
        .iter()
        .map(|t| t.stats().bulk_fallbacks.load(Relaxed))
        .sum();
    let sent: u64 = ts
        .iter()
        .map(|t| t.stats().bulk_frames_sent.load(Relaxed))
        .sum();
    assert!(sent >= 4, "FEC frames sent: {sent}");
    assert_eq!(
        fallbacks, sent,
        "with no repair round, every transfer falls back"
    );
}

/// The stream lane through a socket that loses 20 % of the datagrams, with 5 % of the frames
/// damaged above QUIC (where QUIC's AEAD cannot see it): every damaged frame fails its
/// checksum, is sent again, and the all-reduce is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_lane_resends_damaged_frames_and_stays_exact() {
    use mcp_core::transport::quic::{chaos::ChaosConfig, LanePolicy};
    use std::sync::atomic::Ordering::Relaxed;
    let ts = mesh_with(3, |c| {
        c.bulk.policy = LanePolicy::Stream;
        c.chaos = Some(ChaosConfig::parse("loss=0.2,corrupt=0.05,seed=5").expect("spec"));
    })
    .await;
    all_reduce_over(ts.clone(), 300_001).await;
    let resent: u64 = ts.iter().map(|t| t.stats().retransmits.load(Relaxed)).sum();
    let damaged: u64 = ts
        .iter()
        .map(|t| t.stats().corrupt_frames.load(Relaxed))
        .sum();
    assert!(resent > 0, "no frame was resent");
    assert_eq!(
        resent, damaged,
        "every damaged copy is asked for again, once"
    );
}

/// A frame damaged on every attempt fails the operation once the configured resend limit is
/// spent, with a `ProtocolError` that names the peer, the operation and the count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_lane_gives_up_after_the_resend_limit() {
    use mcp_core::transport::quic::{chaos::ChaosConfig, LanePolicy};
    use std::sync::atomic::Ordering::Relaxed;
    let ts = mesh_with(2, |c| {
        c.bulk.policy = LanePolicy::Stream;
        c.resend_limit = 2;
        c.chaos = Some(ChaosConfig::parse("corrupt=1.0,seed=3").expect("spec"));
    })
    .await;
    let tasks: Vec<_> = ts
        .iter()
        .map(|t| {
            let g = Group::new(t.clone(), GroupConfig::default());
            tokio::spawn(async move {
                let mut data = vec![1.0f32; 1000];
                let shape = [1000u64];
                let bytes = bytemuck_bytes(&mut data);
                // SAFETY: `data` outlives the awaited operation and nothing else touches it.
                let buf = unsafe { RawBuf::new(bytes.as_mut_ptr(), bytes.len()) };
                let t = Tensor {
                    buf,
                    dtype: DType::F32,
                    shape: &shape,
                    codec: Codec::None,
                };
                let res = g.all_reduce(t, ReduceOp::Sum, Algorithm::Ring)?.await;
                g.close().await;
                res
            })
        })
        .collect();
    let mut named = 0;
    for t in tasks {
        match t.await.expect("join") {
            Err(Error::Protocol(m)) => {
                if m.contains("2 resends") {
                    assert!(m.contains("from rank") && m.contains("all_reduce"), "{m}");
                    assert!(m.contains("failed 3 times"), "{m}");
                    named += 1;
                }
            }
            other => panic!("expected a ProtocolError, got {other:?}"),
        }
    }
    assert!(named >= 1, "no rank named the resend count");
    // The frame that failed 3 times was resent twice; the other rank's frame may have been
    // resent fewer times when the failing rank closed its connections first.
    let resent: Vec<u64> = ts
        .iter()
        .map(|t| t.stats().retransmits.load(Relaxed))
        .collect();
    assert!(resent.iter().all(|&r| r <= 2), "past the limit: {resent:?}");
    assert_eq!(resent.iter().max(), Some(&2), "{resent:?}");
}

/// A resend limit above what a receiver may ask for is refused before anything binds.
#[tokio::test]
async fn a_resend_limit_past_the_maximum_is_refused() {
    let mut c = config(0, 1, free_port(), Some(b"s"));
    c.resend_limit = mcp_core::transport::MAX_RESENDS + 1;
    match QuicTransport::connect(c).await {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("resend_limit"), "{m}"),
        Err(e) => panic!("expected InvalidArgument, got {e}"),
        Ok(_) => panic!("expected InvalidArgument, got a transport"),
    }
}

/// The stream lane never sends a shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_lane_sends_no_shards() {
    use mcp_core::transport::quic::LanePolicy;
    use std::sync::atomic::Ordering::Relaxed;
    let ts = mesh_with(2, |c| c.bulk.policy = LanePolicy::Stream).await;
    all_reduce_over(ts.clone(), 600_000).await;
    for t in &ts {
        assert_eq!(t.stats().bulk_frames_sent.load(Relaxed), 0);
        assert!(t.stats().frames_sent.load(Relaxed) > 2);
    }
}

/// The payload of point-to-point frame `seq` from rank `src`, as `rx` filed it; panics
/// naming the frame if it does not come within 60 s or fails.
async fn recv_p2p(rx: &QuicTransport, src: usize, seq: u64) -> Vec<u8> {
    use mcp_core::transport::{MsgKey, SeqSpace};
    let key = MsgKey {
        src,
        space: SeqSpace::P2p,
        seq,
        step: 0,
        chunk: 0,
    };
    tokio::time::timeout(Duration::from_secs(60), rx.mailbox().recv(key))
        .await
        .unwrap_or_else(|_| panic!("frame {seq} from rank {src} never came"))
        .unwrap_or_else(|e| panic!("frame {seq} from rank {src} failed: {e}"))
        .payload
        .to_vec()
}

/// Waits until `tx` is connected to `rx` again after its last reset, by a frame that goes
/// across: what arrived before it may have been delivered before the reset closed the
/// connection, and the reconnection it caused is counted only when `tx` notices the end.
async fn after_the_last_reset(tx: &QuicTransport, rx: &QuicTransport, seq: u64) {
    use mcp_core::wire::{FrameKind, Header};
    let last = vec![0xA5u8; 64];
    let header = Header::bytes(FrameKind::Send, 1, seq, 0, &last);
    tx.send_frame(0, &header, &last).await.expect("send");
    assert!(recv_p2p(rx, 1, seq).await == last);
}

/// A reset right after an FEC-lane frame was handed to QUIC cuts the transfer off before the
/// receiver rebuilt it, often before it even saw the announcement. The connection comes
/// back and every frame arrives, exact and once: the sender sends what lacked a DONE again,
/// and the receiver files nothing from a transfer cut off with its connection (no error for
/// a peer that is still there).
/// An abort written just before a reset (the connection closes before QUIC could deliver
/// it): it is kept until the peer's verdict and sent again on the next connection, so the
/// peer stops waiting for the operation instead of waiting for its timeout; every round's
/// abort arrives with its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborts_cut_off_by_a_reset_arrive_after_the_reconnection() {
    use mcp_core::transport::{encode_abort, SeqSpace};
    use mcp_core::wire::{FrameKind, Header, ModelSpec};
    const ROUNDS: u64 = 8;
    let ts = mesh_with(2, |_| {}).await;
    let (rx, tx) = (ts[0].clone(), ts[1].clone());
    for seq in 0..ROUNDS {
        // The connection exists before the abort: the reset cuts a live one.
        let ping = vec![seq as u8; 64];
        let header = Header::bytes(FrameKind::Send, 1, seq, 0, &ping);
        tx.send_frame(0, &header, &ping).await.expect("send");
        let why = Error::Timeout {
            what: format!("round {seq}"),
            after: Duration::from_secs(1),
        };
        let payload = encode_abort(SeqSpace::Collective, &why);
        let abort = Header {
            kind: FrameKind::Abort,
            spec: ModelSpec::flat(DType::U8, ReduceOp::None, payload.len()),
            payload_len: payload.len() as u64,
            payload_crc: crc32c::crc32c(&payload),
            ..header
        };
        tx.send_frame(0, &abort, &payload).await.expect("abort");
        tx.chaos_reset();
        let got = tokio::time::timeout(
            Duration::from_secs(30),
            rx.mailbox().aborted(SeqSpace::Collective, seq),
        )
        .await
        .unwrap_or_else(|_| panic!("the abort of round {seq} never came"));
        assert!(
            got.to_string().contains(&format!("round {seq}")),
            "round {seq}: {got}"
        );
    }
    after_the_last_reset(&tx, &rx, ROUNDS).await;
    assert!(
        tx.stats()
            .reconnects
            .load(std::sync::atomic::Ordering::Relaxed)
            >= ROUNDS
    );
    for t in ts {
        t.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fec_frames_cut_off_by_a_reset_arrive_after_the_reconnection() {
    use mcp_core::transport::quic::LanePolicy;
    use mcp_core::wire::{FrameKind, Header, ModelSpec, PROTOCOL_MINOR};
    use std::sync::atomic::Ordering::Relaxed;
    const ROUNDS: u64 = 8;
    let ts = mesh_with(2, |c| c.bulk.policy = LanePolicy::Fec).await;
    let (rx, tx) = (ts[0].clone(), ts[1].clone());
    for seq in 0..ROUNDS {
        let n = 4 * (250_001 + seq as usize);
        let payload: Vec<u8> = (0..n).map(|j| (j * 31 + seq as usize) as u8).collect();
        let header = Header {
            kind: FrameKind::Send,
            minor: PROTOCOL_MINOR,
            seq,
            step: 0,
            chunk: 0,
            chunk_count: 1,
            src: 1,
            aux: 0,
            spec: ModelSpec::flat(DType::I32, ReduceOp::None, n / 4),
            payload_len: n as u64,
            payload_crc: crc32c::crc32c(&payload),
        };
        tx.send_frame(0, &header, &payload).await.expect("send");
        tx.chaos_reset();
        assert!(
            recv_p2p(&rx, 1, seq).await == payload,
            "frame {seq} differs"
        );
    }
    after_the_last_reset(&tx, &rx, ROUNDS).await;
    assert!(tx.stats().reconnects.load(Relaxed) >= ROUNDS);
    assert!(tx.stats().bulk_frames_sent.load(Relaxed) >= ROUNDS);
    // The reset comes before the receiver's DONE can: the transfers went again.
    assert!(tx.stats().resumed_frames.load(Relaxed) >= 1);
    for t in ts {
        t.shutdown().await;
    }
}

/// The peer says goodbye while a frame to it is still being sent. On the FEC lane the peer
/// decodes a frame before its last parity shards are queued here, so a peer whose last
/// operation needed only that frame may finish and close meanwhile: the send finishes, not
/// cut off by our side's close, and a send begun after the goodbye fails naming the peer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_under_way_when_the_peer_says_goodbye_finishes() {
    use mcp_core::transport::quic::LanePolicy;
    use mcp_core::wire::{FrameKind, Header};
    let ts = mesh_with(2, |c| c.bulk.policy = LanePolicy::Fec).await;
    let header = |seq: u64, payload: &[u8]| Header::bytes(FrameKind::Send, 0, seq, 0, payload);
    let payload: Vec<u8> = (0..32usize << 20).map(|j| (j * 31) as u8).collect();
    let packets = || ts[0].path_stats(1).map_or(0, |p| p.sent_packets);
    // Catch a send under way: 256 of its thousands of datagrams handed to the socket. A
    // loaded machine may not look before the whole frame is out; then it goes again.
    let mut seq = 0;
    let send = loop {
        assert!(seq < 8, "no send was caught under way in {seq} tries");
        let before = packets();
        let (tx, h, p) = (ts[0].clone(), header(seq, &payload), payload.clone());
        let send = tokio::spawn(async move { tx.send_frame(1, &h, &p).await });
        seq += 1;
        let start = std::time::Instant::now();
        while packets() < before + 256 && !send.is_finished() {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the send never began"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        if !send.is_finished() {
            break send;
        }
        send.await
            .expect("join")
            .expect("a send before the goodbye");
    };
    ts[1].shutdown().await;
    let res = tokio::time::timeout(Duration::from_secs(120), send)
        .await
        .expect("the send finished")
        .expect("join");
    assert!(res.is_ok(), "cut off by the goodbye: {res:?}");
    let late = vec![7u8; 64];
    match ts[0].send_frame(1, &header(seq, &late), &late).await {
        Err(Error::PeerLost {
            rank: 1, reason, ..
        }) => {
            assert!(reason.contains("closed its group"), "{reason}")
        }
        other => panic!("a send after the goodbye: {other:?}"),
    }
    ts[0].shutdown().await;
}
