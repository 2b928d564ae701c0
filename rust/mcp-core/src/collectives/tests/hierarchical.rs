//! The hierarchical collectives over every topology shape (one host, equal hosts, one rank
//! per host, uneven and interleaved hosts), every dtype and op, with and without seeded
//! faults, against the sequential reference; and the bytes they send across hosts, exactly.

use super::{as_f32, cfg, f32_bytes, input, noisy, reference, run_world, OPS};
use crate::buffer::RawBuf;
use crate::collectives::allreduce_hierarchical::{stages, MAX_STAGES};
use crate::collectives::broadcast_hierarchical::DIRECT_MIN;
use crate::collectives::{
    allgather_hierarchical, broadcast_hierarchical, reduce_scatter_hierarchical, OpCtx,
};
use crate::dtype::{DType, ReduceOp};
use crate::error::Error;
use crate::group::{Algorithm, Group, Tensor};
use crate::topology::Topology;
use crate::transport::mem::{MemChaos, MemTransport};
use crate::wire::{Codec, FrameKind, ModelSpec};
use std::time::Duration;

/// Host of each rank: 1 x 4, 2 x 2, 3 x 1, 3 + 2, 2 + 3 interleaved, 2 + 5, 2 + 3 + 2.
const TOPOS: [&[usize]; 7] = [
    &[0, 0, 0, 0],
    &[0, 0, 1, 1],
    &[0, 1, 2],
    &[0, 0, 0, 1, 1],
    &[0, 1, 0, 1, 1],
    &[0, 0, 1, 1, 1, 1, 1],
    &[0, 0, 1, 1, 1, 2, 2],
];

fn topo(hosts: &[usize]) -> Topology {
    Topology::from_host_of_rank(hosts.to_vec()).expect("valid topology")
}

fn reorder(seed: u64) -> Option<MemChaos> {
    Some(MemChaos {
        seed,
        max_delay: Duration::from_micros(300),
        corrupt: 0.0,
    })
}

fn damage(seed: u64) -> Option<MemChaos> {
    Some(MemChaos {
        seed,
        max_delay: Duration::from_micros(100),
        corrupt: 0.1,
    })
}

/// A context for calling an algorithm directly (what `Group` builds for operation 1).
fn direct<'a>(
    t: &'a MemTransport,
    kind: FrameKind,
    dtype: DType,
    op: ReduceOp,
    codec: Codec,
    shape: &[u64],
    aux: u32,
) -> OpCtx<'a, MemTransport> {
    let c = cfg();
    OpCtx {
        t,
        kind,
        seq: 1,
        spec: ModelSpec {
            dtype,
            op,
            codec,
            shape: shape.to_vec(),
        },
        aux,
        deadline: tokio::time::Instant::now() + c.timeout,
        timeout: c.timeout,
        chunk_bytes: c.chunk_bytes,
        sub: None,
    }
}

async fn all_reduce_case(
    hosts: &[usize],
    dtype: DType,
    op: ReduceOp,
    n: usize,
    chaos: Option<MemChaos>,
) {
    all_reduce_case_reading(hosts, dtype, op, n, chaos, false).await;
}

/// The hierarchical all-reduce, the ranks of each host reading each other's tensors
/// directly if `direct`; returns the payload bytes each rank sent to its own host.
async fn all_reduce_case_reading(
    hosts: &[usize],
    dtype: DType,
    op: ReduceOp,
    n: usize,
    chaos: Option<MemChaos>,
    direct: bool,
) -> Vec<u64> {
    let w = hosts.len();
    let inputs: Vec<Vec<u8>> = (0..w).map(|r| input(dtype, op, r, n, 1)).collect();
    let want = reference(dtype, op, &inputs);
    let shape = vec![n as u64];
    let results = run_world(w, chaos, cfg(), |g, r| {
        let mut buf = inputs[r].clone();
        let shape = shape.clone();
        let t = topo(hosts);
        let host_of = hosts.to_vec();
        async move {
            g.set_topology(t)?;
            if direct {
                g.transport().enable_direct_reads();
            }
            // SAFETY: `buf` lives, untouched, until the awaited operation has finished.
            let raw = unsafe { RawBuf::from_slice(&mut buf) };
            let t = Tensor {
                buf: raw,
                dtype,
                shape: &shape,
                codec: Codec::None,
            };
            g.all_reduce(t, op, Algorithm::Hierarchical)?.await?;
            let inside = (0..w)
                .filter(|&p| host_of[p] == host_of[r])
                .map(|p| g.transport().payload_bytes_to(p))
                .sum::<u64>();
            Ok::<_, Error>((buf, inside))
        }
    })
    .await;
    let mut inside = Vec::new();
    for (r, res) in results.into_iter().enumerate() {
        let (got, bytes) =
            res.unwrap_or_else(|e| panic!("{hosts:?} {dtype} {op} n={n}: rank {r}: {e}"));
        assert_eq!(got, want, "{hosts:?} {dtype} {op} n={n}: rank {r} differs");
        inside.push(bytes);
    }
    inside
}

async fn broadcast_case(
    hosts: &[usize],
    root: usize,
    dtype: DType,
    n: usize,
    chaos: Option<MemChaos>,
) {
    broadcast_case_reading(hosts, root, dtype, n, chaos, false).await;
}

/// The hierarchical broadcast, the ranks of each host reading their leader's tensor
/// directly if `direct`; returns the payload bytes each rank sent to its own host.
async fn broadcast_case_reading(
    hosts: &[usize],
    root: usize,
    dtype: DType,
    n: usize,
    chaos: Option<MemChaos>,
    direct: bool,
) -> Vec<u64> {
    let w = hosts.len();
    let want = input(dtype, ReduceOp::Sum, root, n, 3);
    let shape = vec![n as u64];
    let results = run_world(w, chaos, cfg(), |g, r| {
        let mut buf = if r == root {
            want.clone()
        } else {
            vec![0u8; want.len()]
        };
        let (shape, t) = (shape.clone(), topo(hosts));
        let host_of = hosts.to_vec();
        async move {
            let tr = g.transport().clone();
            if direct {
                tr.enable_direct_reads();
            }
            let ctx = self::direct(
                &tr,
                FrameKind::Broadcast,
                dtype,
                ReduceOp::None,
                Codec::None,
                &shape,
                root as u32,
            );
            // SAFETY: `buf` outlives the awaited operation.
            let raw = unsafe { RawBuf::from_slice(&mut buf) };
            broadcast_hierarchical(&ctx, &t, raw, dtype.size(), root).await?;
            let inside = (0..w)
                .filter(|&p| host_of[p] == host_of[r])
                .map(|p| tr.payload_bytes_to(p))
                .sum::<u64>();
            Ok::<_, Error>((buf, inside))
        }
    })
    .await;
    let mut inside = Vec::new();
    for (r, res) in results.into_iter().enumerate() {
        let (got, bytes) =
            res.unwrap_or_else(|e| panic!("{hosts:?} root={root} n={n}: rank {r}: {e}"));
        assert_eq!(got, want, "{hosts:?} root={root} {dtype} n={n}: rank {r}");
        inside.push(bytes);
    }
    inside
}

async fn all_gather_case(hosts: &[usize], dtype: DType, n: usize, chaos: Option<MemChaos>) {
    let w = hosts.len();
    let inputs: Vec<Vec<u8>> = (0..w)
        .map(|r| input(dtype, ReduceOp::Sum, r, n, 5))
        .collect();
    let want = inputs.concat();
    let shape = vec![n as u64];
    let results = run_world(w, chaos, cfg(), |g, r| {
        let mut inp = inputs[r].clone();
        let mut out = vec![0u8; want.len()];
        let (shape, t) = (shape.clone(), topo(hosts));
        async move {
            let tr = g.transport().clone();
            let ctx = direct(
                &tr,
                FrameKind::AllGather,
                dtype,
                ReduceOp::None,
                Codec::None,
                &shape,
                1,
            );
            // SAFETY: both buffers outlive the awaited operation.
            let (i, o) = unsafe { (RawBuf::from_slice(&mut inp), RawBuf::from_slice(&mut out)) };
            allgather_hierarchical(&ctx, &t, o, i, dtype.size())
                .await
                .map(|()| out)
        }
    })
    .await;
    for (r, res) in results.into_iter().enumerate() {
        let got = res.unwrap_or_else(|e| panic!("{hosts:?} {dtype} n={n}: rank {r}: {e}"));
        assert_eq!(got, want, "{hosts:?} {dtype} n={n}: rank {r}");
    }
}

async fn reduce_scatter_case(
    hosts: &[usize],
    dtype: DType,
    op: ReduceOp,
    n: usize,
    chaos: Option<MemChaos>,
) {
    let w = hosts.len();
    let inputs: Vec<Vec<u8>> = (0..w).map(|r| input(dtype, op, r, n * w, 9)).collect();
    let full = reference(dtype, op, &inputs);
    let block = n * dtype.size();
    let shape = vec![n as u64];
    let results = run_world(w, chaos, cfg(), |g, r| {
        let mut inp = inputs[r].clone();
        let mut out = vec![0u8; block];
        let (shape, t) = (shape.clone(), topo(hosts));
        async move {
            let before = inp.clone();
            let tr = g.transport().clone();
            let ctx = direct(
                &tr,
                FrameKind::ReduceScatter,
                dtype,
                op,
                Codec::None,
                &shape,
                1,
            );
            // SAFETY: both buffers outlive the awaited operation.
            let (i, o) = unsafe { (RawBuf::from_slice(&mut inp), RawBuf::from_slice(&mut out)) };
            let res = reduce_scatter_hierarchical(&ctx, &t, o, i, dtype, op).await;
            assert_eq!(inp, before, "reduce_scatter must not modify its input");
            res.map(|()| out)
        }
    })
    .await;
    for (r, res) in results.into_iter().enumerate() {
        let got = res.unwrap_or_else(|e| panic!("{hosts:?} {dtype} {op} n={n}: rank {r}: {e}"));
        assert_eq!(
            got,
            full[r * block..(r + 1) * block],
            "{hosts:?} {dtype} {op} n={n}: rank {r}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hierarchical_all_reduce_every_topology_dtype_op_and_size() {
    for hosts in TOPOS {
        for dtype in DType::ALL {
            for op in OPS {
                if op.check(dtype).is_err() {
                    continue;
                }
                for n in [0, 1, 7, 1000] {
                    all_reduce_case(hosts, dtype, op, n, None).await;
                }
            }
        }
    }
}

/// The topologies on which the hierarchical all-reduce runs in more than one stage.
const STAGED: [&[usize]; 4] = [
    &[0, 0, 1, 1],
    &[0, 0, 0, 1, 1],
    &[0, 1, 0, 1, 1],
    &[0, 0, 1, 1, 1, 2, 2],
];

#[test]
fn stages_cover_the_buffer_in_aligned_pieces_and_only_where_phases_can_overlap() {
    for hosts in STAGED {
        let t = topo(hosts);
        let unit = t.min_local() * t.hosts();
        for (len, elem, chunk) in [
            (80_000, 4, 4096),
            (1 << 26, 4, 1 << 20),
            (1 << 30, 2, 1 << 20),
        ] {
            let st = stages(&t, len, elem, chunk);
            assert!(
                st.len() > 1 && st.len() <= MAX_STAGES,
                "{hosts:?} {len}: {st:?}"
            );
            assert_eq!(st[0].start, 0);
            assert_eq!(st.last().map(|r| r.end), Some(len));
            for w in st.windows(2) {
                assert_eq!(w[0].end, w[1].start, "{hosts:?} {len}: contiguous");
            }
            for r in &st[..st.len() - 1] {
                assert_eq!(
                    r.len() % (unit * elem),
                    0,
                    "{hosts:?} {len}: {r:?} not aligned"
                );
            }
        }
        // A small buffer is one stage; so is any buffer under a huge frame size.
        assert_eq!(stages(&t, 4000, 4, 4096), vec![0..4000]);
        assert_eq!(stages(&t, 1 << 30, 4, usize::MAX), vec![0..1 << 30]);
        assert_eq!(stages(&t, 0, 4, 4096), vec![0..0]);
    }
    // Nothing to overlap: one host, or one rank per host.
    for hosts in [&[0, 0, 0, 0][..], &[0, 1, 2]] {
        assert_eq!(stages(&topo(hosts), 1 << 26, 4, 4096), vec![0..1 << 26]);
    }
    // 64 MiB over 2 hosts x 2 in 1 MiB frames: 8 stages of 8 MiB.
    let st = stages(&topo(&[0, 0, 1, 1]), 64 << 20, 4, 1 << 20);
    assert_eq!(st.len(), 8);
    assert!(st.iter().all(|r| r.len() == 8 << 20));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hierarchical_all_reduce_in_stages_is_exact_also_under_reordering_and_damage() {
    // 20,000 elements in 4 KiB frames: several stages whose phases overlap.
    let n = 20_000;
    for hosts in STAGED {
        let t = topo(hosts);
        for dtype in [DType::F32, DType::F64, DType::I32] {
            let len = n * dtype.size();
            assert!(
                stages(&t, len, dtype.size(), cfg().chunk_bytes).len() > 2,
                "{hosts:?}"
            );
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                if op.check(dtype).is_ok() {
                    all_reduce_case(hosts, dtype, op, n, None).await;
                }
            }
        }
        all_reduce_case(hosts, DType::F32, ReduceOp::Sum, n, reorder(21)).await;
        all_reduce_case(hosts, DType::I32, ReduceOp::Sum, n, damage(22)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hierarchical_all_reduce_reading_local_tensors_directly_is_exact_and_sends_no_data_inside_hosts(
) {
    let n = 20_011;
    for hosts in STAGED.iter().chain(TOPOS.iter()) {
        for dtype in [DType::F32, DType::F64, DType::I32, DType::BF16] {
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                if op.check(dtype).is_err() {
                    continue;
                }
                let inside = all_reduce_case_reading(hosts, dtype, op, n, None, true).await;
                let without = all_reduce_case_reading(hosts, dtype, op, n, None, false).await;
                for (r, (&d, &f)) in inside.iter().zip(&without).enumerate() {
                    let locals = hosts.iter().filter(|&&h| h == hosts[r]).count();
                    if locals == 1 {
                        assert_eq!((d, f), (0, 0), "{hosts:?}: rank {r} is alone");
                        continue;
                    }
                    // Addresses, verdicts and one signal per stage: under a kilobyte per
                    // peer, where the rings move the shards themselves.
                    assert!(
                        d < 1024 * locals as u64,
                        "{hosts:?} {dtype}: rank {r}: {d} B"
                    );
                    assert!(
                        f > (n * dtype.size() / 4) as u64,
                        "{hosts:?}: rank {r}: {f} B"
                    );
                }
            }
        }
        // Reordered and damaged frames between hosts, direct reads inside them.
        all_reduce_case_reading(hosts, DType::F32, ReduceOp::Sum, n, reorder(31), true).await;
        all_reduce_case_reading(hosts, DType::I32, ReduceOp::Sum, n, damage(32), true).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hierarchical_broadcast_reading_the_leader_directly_is_exact_and_sends_no_data_inside_hosts(
) {
    for hosts in TOPOS {
        for root in 0..hosts.len() {
            for (dtype, n) in [(DType::F32, 40_000), (DType::U8, 100), (DType::F64, 0)] {
                let read = broadcast_case_reading(hosts, root, dtype, n, None, true).await;
                let rings = broadcast_case_reading(hosts, root, dtype, n, None, false).await;
                if n * dtype.size() <= DIRECT_MIN {
                    assert_eq!(read, rings, "{hosts:?}: small tensors take the tree");
                    continue;
                }
                for (r, &d) in read.iter().enumerate() {
                    // Addresses, verdicts and one signal: tens of bytes per local peer.
                    let locals = hosts.iter().filter(|&&h| h == hosts[r]).count() as u64;
                    assert!(d <= 16 * locals, "{hosts:?} root={root}: rank {r}: {d} B");
                }
                let (d, f) = (read.iter().sum::<u64>(), rings.iter().sum::<u64>());
                if hosts
                    .iter()
                    .any(|&h| hosts.iter().filter(|&&x| x == h).count() > 1)
                {
                    // The tree moves the tensor to every other rank of each host.
                    assert!(d * 100 < f, "{hosts:?} root={root}: {d} B against {f}");
                }
            }
        }
        broadcast_case_reading(hosts, 0, DType::I32, 30_000, reorder(41), true).await;
        broadcast_case_reading(hosts, 1, DType::I32, 30_000, damage(42), true).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hierarchical_broadcast_every_topology_and_root() {
    for hosts in TOPOS {
        for root in 0..hosts.len() {
            for (dtype, n) in [(DType::I64, 0), (DType::F16, 1), (DType::F32, 5000)] {
                broadcast_case(hosts, root, dtype, n, None).await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hierarchical_all_gather_every_topology_and_size() {
    for hosts in TOPOS {
        for dtype in [DType::F16, DType::U8, DType::F64] {
            for n in [0, 1, 7, 3001] {
                all_gather_case(hosts, dtype, n, None).await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hierarchical_reduce_scatter_every_topology_dtype_and_op() {
    for hosts in TOPOS {
        for dtype in [DType::F32, DType::BF16, DType::I32, DType::U8, DType::F64] {
            for op in OPS {
                if op.check(dtype).is_ok() {
                    for n in [0, 1, 7, 700] {
                        reduce_scatter_case(hosts, dtype, op, n, None).await;
                    }
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hierarchical_collectives_are_exact_under_reordering_and_damage() {
    for seed in 0..2 {
        for chaos in [reorder(seed), damage(seed)] {
            for hosts in TOPOS {
                all_reduce_case(hosts, DType::F32, ReduceOp::Sum, 5000, chaos).await;
                all_reduce_case(hosts, DType::BF16, ReduceOp::Avg, 777, chaos).await;
                broadcast_case(hosts, hosts.len() - 1, DType::I64, 3001, chaos).await;
                all_gather_case(hosts, DType::F16, 2999, chaos).await;
                reduce_scatter_case(hosts, DType::F64, ReduceOp::Sum, 1001, chaos).await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coded_hierarchical_collectives_give_every_rank_the_same_bits() {
    // Large enough that the all-reduce runs in stages, each coded on its own.
    let n = 10_000;
    let codecs = [
        (Codec::Fp16, 1.0f32 / 2048.0),
        (Codec::Bf16, 1.0 / 256.0),
        (Codec::Int8 { block: 256 }, 1.0 / 127.0),
    ];
    for (codec, rel) in codecs {
        for hosts in [&[0, 0, 1, 1][..], &[0, 1, 0, 1, 1], &[0, 0, 1, 1, 1, 2, 2]] {
            assert!(stages(&topo(hosts), 4 * n, 4, cfg().chunk_bytes).len() > 1);
            let w = hosts.len();
            let exact: Vec<f64> = (0..n)
                .map(|i| (0..w).map(|r| f64::from(noisy(r, n)[i])).sum())
                .collect();
            let shape = vec![n as u64];
            let results = run_world(w, None, cfg(), |g, r| {
                let mut buf = f32_bytes(&noisy(r, n));
                let mut gathered = vec![0u8; 4 * n * w];
                let mut mine = f32_bytes(&noisy(r, n));
                let (shape, t) = (shape.clone(), topo(hosts));
                async move {
                    g.set_topology(t.clone())?;
                    // SAFETY: `buf` outlives the awaited operation.
                    let raw = unsafe { RawBuf::from_slice(&mut buf) };
                    let tensor = Tensor {
                        buf: raw,
                        dtype: DType::F32,
                        shape: &shape,
                        codec,
                    };
                    g.all_reduce(tensor, ReduceOp::Sum, Algorithm::Hierarchical)?
                        .await?;
                    let tr = g.transport().clone();
                    let ctx = direct(
                        &tr,
                        FrameKind::AllGather,
                        DType::F32,
                        ReduceOp::None,
                        codec,
                        &shape,
                        1,
                    );
                    // SAFETY: both buffers outlive the awaited operation.
                    let (i, o) = unsafe {
                        (
                            RawBuf::from_slice(&mut mine),
                            RawBuf::from_slice(&mut gathered),
                        )
                    };
                    let mut ctx = ctx;
                    ctx.seq = 1000;
                    allgather_hierarchical(&ctx, &t, o, i, 4).await?;
                    Ok::<_, Error>((buf, gathered))
                }
            })
            .await;
            let first = results[0].as_ref().expect("rank 0").clone();
            for (r, res) in results.iter().enumerate() {
                let got = res
                    .as_ref()
                    .unwrap_or_else(|e| panic!("{codec:?} {hosts:?} r={r}: {e}"));
                assert_eq!(
                    got, &first,
                    "{codec:?} {hosts:?}: rank {r} differs from rank 0"
                );
            }
            // The inter-host ring re-encodes partial sums of at most w values in [-1, 1].
            let got = as_f32(&first.0);
            let bound = (w * w) as f64 * f64::from(rel);
            let worst = (0..n)
                .map(|i| (f64::from(got[i]) - exact[i]).abs())
                .fold(0f64, f64::max);
            assert!(
                worst <= bound + 1e-6,
                "{codec:?} {hosts:?}: error {worst} > {bound}"
            );
            assert!(
                worst > 0.0,
                "{codec:?} {hosts:?}: the codec was never applied"
            );
            // The gathered blocks are the decodings of every input, within one quantisation.
            let gathered = as_f32(&first.1);
            for r in 0..w {
                let want = noisy(r, n);
                for i in 0..n {
                    let e = (gathered[r * n + i] - want[i]).abs();
                    assert!(e <= rel, "{codec:?} {hosts:?}: block {r}[{i}] off by {e}");
                }
            }
        }
    }
}

/// Payload bytes each host sends to ranks on other hosts during one all-reduce of `n` f32.
async fn crossing_bytes(hosts: &[usize], n: usize, algo: Algorithm) -> Vec<u64> {
    let w = hosts.len();
    let t = topo(hosts);
    let shape = vec![n as u64];
    let results = run_world(w, None, cfg(), |g, r| {
        let mut buf = input(DType::F32, ReduceOp::Sum, r, n, 0);
        let (shape, t) = (shape.clone(), t.clone());
        async move {
            g.set_topology(t.clone())?;
            // SAFETY: `buf` outlives the awaited operation.
            let raw = unsafe { RawBuf::from_slice(&mut buf) };
            let tensor = Tensor {
                buf: raw,
                dtype: DType::F32,
                shape: &shape,
                codec: Codec::None,
            };
            g.all_reduce(tensor, ReduceOp::Sum, algo)?.await?;
            let tr = g.transport();
            let out: u64 = (0..w)
                .filter(|&p| t.host_of(p) != t.host_of(r))
                .map(|p| tr.payload_bytes_to(p))
                .sum();
            Ok::<u64, Error>(out)
        }
    })
    .await;
    let mut per_host = vec![0u64; t.hosts()];
    for (r, res) in results.into_iter().enumerate() {
        per_host[t.host_of(r)] += res.expect("all-reduce");
    }
    per_host
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hierarchical_all_reduce_sends_two_h_minus_one_over_h_across_hosts() {
    // n divisible by (shards x hosts): the bound is met exactly, per host.
    let n = 12 * 1024;
    let bytes = (4 * n) as u64;
    // 2 hosts x 2: hierarchical 2(H-1)/H = 1 tensor per host; the flat ring crosses twice
    // (rank 1 -> 2, rank 3 -> 0), each hop carrying 2(W-1)/W = 1.5 tensors.
    assert_eq!(
        crossing_bytes(&[0, 0, 1, 1], n, Algorithm::Hierarchical).await,
        vec![bytes, bytes]
    );
    assert_eq!(
        crossing_bytes(&[0, 0, 1, 1], n, Algorithm::Ring).await,
        vec![bytes * 3 / 2, bytes * 3 / 2]
    );
    // Auto picks the hierarchical algorithm on this topology.
    assert_eq!(
        crossing_bytes(&[0, 0, 1, 1], n, Algorithm::Auto).await,
        vec![bytes, bytes]
    );
    // 3 hosts x 2: 4/3 of the tensor per host; the flat ring 3 crossings x 5/3.
    let h3 = [0, 0, 1, 1, 2, 2];
    assert_eq!(
        crossing_bytes(&h3, n, Algorithm::Hierarchical).await,
        vec![bytes * 4 / 3; 3]
    );
    assert_eq!(
        crossing_bytes(&h3, n, Algorithm::Ring).await,
        vec![bytes * 5 / 3; 3]
    );
    // Uneven 3 + 2 (2 shards): still exactly 1 tensor per host.
    assert_eq!(
        crossing_bytes(&[0, 0, 0, 1, 1], n, Algorithm::Hierarchical).await,
        vec![bytes, bytes]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topology_that_does_not_cover_the_group_is_refused() {
    let results = run_world(4, None, cfg(), |g, _| async move {
        let short = g.set_topology(topo(&[0, 0, 1]));
        let long = g.set_topology(topo(&[0, 0, 1, 1, 2]));
        (short, long, g.topology().hosts())
    })
    .await;
    for (short, long, hosts) in results {
        for e in [short, long] {
            let e = e.expect_err("refused");
            assert!(
                matches!(&e, Error::InvalidArgument(m) if m.contains("but the group has 4")),
                "{e}"
            );
        }
        assert_eq!(hosts, 1, "a refused topology must leave the old one");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_collectives_go_hierarchical_on_a_multi_host_topology() {
    // Through the Group's own selection (not the algorithms called directly).
    let hosts = [0, 1, 0, 1, 1];
    let w = hosts.len();
    let n = 1000;
    let inputs: Vec<Vec<u8>> = (0..w)
        .map(|r| input(DType::I32, ReduceOp::Sum, r, n, 2))
        .collect();
    let gathered = inputs.concat();
    let summed = reference(DType::I32, ReduceOp::Sum, &inputs);
    let block = n / w * 4;
    let results = run_world(w, None, cfg(), |g: Group<MemTransport>, r| {
        let mut bc = inputs[3].clone();
        if r != 3 {
            bc.fill(0);
        }
        let mut inp = inputs[r].clone();
        let mut out = vec![0u8; inp.len() * w];
        let mut rs_out = vec![0u8; block];
        let t = topo(&hosts);
        async move {
            g.set_topology(t)?;
            let (s1, sw, sb) = (
                vec![n as u64],
                vec![w as u64, n as u64],
                vec![(n / w) as u64],
            );
            let ten = |buf, shape| Tensor {
                buf,
                dtype: DType::I32,
                shape,
                codec: Codec::None,
            };
            // SAFETY: every buffer outlives the awaited operations.
            let (b, i, o, rs) = unsafe {
                (
                    RawBuf::from_slice(&mut bc),
                    RawBuf::from_slice(&mut inp),
                    RawBuf::from_slice(&mut out),
                    RawBuf::from_slice(&mut rs_out),
                )
            };
            g.broadcast(ten(b, &s1), 3)?.await?;
            g.all_gather(ten(o, &sw), ten(i, &s1))?.await?;
            g.reduce_scatter(ten(rs, &sb), ten(i, &s1), ReduceOp::Sum)?
                .await?;
            Ok::<_, Error>((bc, out, rs_out))
        }
    })
    .await;
    for (r, res) in results.into_iter().enumerate() {
        let (bc, out, rs) = res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(bc, inputs[3], "broadcast on rank {r}");
        assert_eq!(out, gathered, "all_gather on rank {r}");
        assert_eq!(
            rs,
            summed[r * block..(r + 1) * block],
            "reduce_scatter on rank {r}"
        );
    }
}
