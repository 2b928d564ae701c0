//! The direct all-reduce (ranks of one host reading each other's tensors with
//! `process_vm_readv`; here the ranks are tasks of this process, so the reads are real
//! system calls on our own pid): exact for every dtype, op and size; no data frames when it
//! reads, the ring's frames when a rank declines; a peer that dies is named.

use super::{cfg, input, reference, run_world, OPS};
use crate::buffer::RawBuf;
use crate::dtype::{DType, ReduceOp};
use crate::error::Error;
use crate::group::{Algorithm, Group, Tensor};
use crate::transport::mem::MemTransport;
use crate::transport::Transport;
use crate::wire::Codec;

/// Runs one all-reduce of `n` elements on `w` ranks of one host; `declines` says which
/// ranks refuse direct reads. Returns each rank's result and the payload bytes it sent.
async fn case(
    w: usize,
    dtype: DType,
    op: ReduceOp,
    n: usize,
    algo: Algorithm,
    declines: &[usize],
) -> Vec<(Vec<u8>, u64)> {
    let inputs: Vec<Vec<u8>> = (0..w).map(|r| input(dtype, op, r, n, 3)).collect();
    let want = reference(dtype, op, &inputs);
    let shape = vec![n as u64];
    let declines = declines.to_vec();
    let results = run_world(w, None, cfg(), |g: Group<MemTransport>, r| {
        let mut buf = inputs[r].clone();
        let shape = shape.clone();
        let decline = declines.contains(&r);
        async move {
            let t = g.transport().clone();
            t.enable_direct_reads();
            if decline {
                t.decline_direct_reads();
            }
            // SAFETY: `buf` lives, untouched, until the awaited operation has finished.
            let raw = unsafe { RawBuf::from_slice(&mut buf) };
            let tensor = Tensor {
                buf: raw,
                dtype,
                shape: &shape,
                codec: Codec::None,
            };
            let res = g.all_reduce(tensor, op, algo)?.await;
            let sent = (0..w).map(|p| t.payload_bytes_to(p)).sum::<u64>();
            res.map(|()| (buf, sent))
        }
    })
    .await;
    results
        .into_iter()
        .enumerate()
        .map(|(r, res)| {
            let (got, sent) = res.unwrap_or_else(|e| {
                panic!("w={w} {dtype} {op} n={n} {algo:?}: rank {r} failed: {e}")
            });
            assert!(
                got == want,
                "w={w} {dtype} {op} n={n} {algo:?} declines={declines:?}: rank {r} differs"
            );
            (got, sent)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_all_reduce_is_exact_for_every_world_dtype_op_and_size() {
    for w in 2..=5 {
        for dtype in DType::ALL {
            for op in OPS {
                if op.check(dtype).is_err() {
                    continue;
                }
                for n in [0, 1, 7, 1000] {
                    case(w, dtype, op, n, Algorithm::Direct, &[]).await;
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_reads_directly_on_one_host_and_sends_only_control_frames() {
    // 300,001 f32 span several scratch pieces per segment and leave uneven segments.
    let n = 300_001;
    for w in [2, 3, 4] {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
            let out = case(w, DType::F32, op, n, Algorithm::Auto, &[]).await;
            for (r, (_, sent)) in out.iter().enumerate() {
                // Per peer: an 8-byte address with its 1-byte "agreed before" flag, and three
                // 1-byte signals (verdict, final, read); no tensor bytes.
                assert_eq!(*sent, 12 * (w as u64 - 1), "w={w} rank {r}");
            }
        }
    }
    let out = case(2, DType::F64, ReduceOp::Sum, n, Algorithm::Auto, &[]).await;
    assert_eq!(out[0].1, 12);
}

/// What one rank does before one of the operations of
/// [`a_second_operation_among_the_same_processes_skips_the_verdicts`].
#[derive(Clone, Copy, PartialEq)]
enum Before {
    Forget,
    Decline,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_operation_among_the_same_processes_skips_the_verdicts() {
    // Three all-reduces in a row on one world; `change` says what one rank does before the
    // second or third. Returns, per rank, the payload bytes each operation sent.
    async fn three(w: usize, change: Option<(usize, usize, Before)>) -> Vec<Vec<u64>> {
        let n = 50_001;
        let inputs: Vec<Vec<u8>> = (0..w)
            .map(|r| input(DType::F32, ReduceOp::Sum, r, n, 7))
            .collect();
        let want = reference(DType::F32, ReduceOp::Sum, &inputs);
        let shape = vec![n as u64];
        let out = run_world(w, None, cfg(), |g: Group<MemTransport>, r| {
            let input = inputs[r].clone();
            let shape = shape.clone();
            let want = want.clone();
            async move {
                let t = g.transport().clone();
                t.enable_direct_reads();
                let mut per_op = Vec::new();
                for i in 0..3 {
                    match change {
                        Some((rank, op, Before::Forget)) if rank == r && op == i => {
                            t.forget_direct_reads()
                        }
                        Some((rank, op, Before::Decline)) if rank == r && op == i => {
                            t.decline_direct_reads()
                        }
                        _ => {}
                    }
                    let mut buf = input.clone();
                    let before = sent(&g);
                    // SAFETY: `buf` lives, untouched, until the awaited operation has finished.
                    let tensor = Tensor {
                        buf: unsafe { RawBuf::from_slice(&mut buf) },
                        dtype: DType::F32,
                        shape: &shape,
                        codec: Codec::None,
                    };
                    g.all_reduce(tensor, ReduceOp::Sum, Algorithm::Auto)?
                        .await?;
                    assert!(buf == want, "w={w} rank {r} operation {i} differs");
                    per_op.push(sent(&g) - before);
                }
                Ok::<_, Error>(per_op)
            }
        })
        .await;
        out.into_iter().map(|r| r.expect("all-reduces")).collect()
    }
    for w in [2, 3, 4] {
        let peers = w as u64 - 1;
        // The first agrees (address and flag, verdict, final, read); the next two only
        // exchange addresses and their flags, then final and read.
        for per_op in three(w, None).await {
            assert_eq!(per_op, vec![12 * peers, 11 * peers, 11 * peers], "w={w}");
        }
        // One rank forgets before the second (a restarted process): its flag says so, every
        // rank agrees again, and the third skips again.
        for per_op in three(w, Some((w - 1, 1, Before::Forget))).await {
            assert_eq!(per_op, vec![12 * peers, 12 * peers, 11 * peers], "w={w}");
        }
        // One rank declines before the third: every rank takes the ring in that operation.
        for per_op in three(w, Some((0, 2, Before::Decline))).await {
            assert_eq!(&per_op[..2], &[12 * peers, 11 * peers], "w={w}");
            assert!(per_op[2] > 50_001 * 4 / w as u64, "w={w}: {per_op:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_rank_that_declines_makes_every_rank_take_the_ring_in_the_same_operation() {
    let n = 100_003;
    for (w, declines) in [(2, vec![0]), (2, vec![1]), (4, vec![2]), (3, vec![0, 2])] {
        let out = case(w, DType::F32, ReduceOp::Sum, n, Algorithm::Auto, &declines).await;
        for (r, (_, sent)) in out.iter().enumerate() {
            // The ring sends 2(W-1)/W of the tensor; the verdicts said no.
            let ring = (2 * (w - 1) * n * 4 / w) as u64;
            assert!(
                *sent >= ring,
                "w={w} declines={declines:?}: rank {r} sent {sent} < {ring}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_shared_memory_auto_takes_the_ring_and_direct_falls_back() {
    let n = 10_000;
    let shape = vec![n as u64];
    for algo in [Algorithm::Auto, Algorithm::Direct] {
        let out = run_world(2, None, cfg(), |g: Group<MemTransport>, r| {
            let mut buf = input(DType::I32, ReduceOp::Sum, r, n, 0);
            let shape = shape.clone();
            async move {
                assert_eq!(g.transport().local_pid(1 - r), None);
                // SAFETY: `buf` lives, untouched, until the awaited operation has finished.
                let raw = unsafe { RawBuf::from_slice(&mut buf) };
                let t = Tensor {
                    buf: raw,
                    dtype: DType::I32,
                    shape: &shape,
                    codec: Codec::None,
                };
                g.all_reduce(t, ReduceOp::Sum, algo)?.await?;
                Ok::<_, Error>((buf, g.transport().payload_bytes_to(1 - r)))
            }
        })
        .await;
        let want = reference(
            DType::I32,
            ReduceOp::Sum,
            &[
                input(DType::I32, ReduceOp::Sum, 0, n, 0),
                input(DType::I32, ReduceOp::Sum, 1, n, 0),
            ],
        );
        for res in out {
            let (got, sent) = res.expect("all-reduce");
            assert_eq!(got, want, "{algo:?}");
            assert!(sent >= (n * 4 / 2) as u64, "{algo:?}: sent {sent}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_dies_is_named_by_the_survivor() {
    let n = 1 << 16;
    let shape = vec![n as u64];
    let out = run_world(2, None, cfg(), |g: Group<MemTransport>, r| {
        let mut buf = input(DType::F32, ReduceOp::Sum, r, n, 0);
        let shape = shape.clone();
        async move {
            let t = g.transport().clone();
            t.enable_direct_reads();
            if r == 1 {
                t.kill();
                return Ok(Vec::new());
            }
            // SAFETY: `buf` lives, untouched, until the awaited operation has finished.
            let raw = unsafe { RawBuf::from_slice(&mut buf) };
            let tensor = Tensor {
                buf: raw,
                dtype: DType::F32,
                shape: &shape,
                codec: Codec::None,
            };
            g.all_reduce(tensor, ReduceOp::Sum, Algorithm::Direct)?
                .await
                .map(|()| buf)
        }
    })
    .await;
    match &out[0] {
        Err(Error::PeerLost { rank: 1, .. }) => {}
        other => panic!("rank 0: expected PeerLost naming rank 1, got {other:?}"),
    }
}

/// Sets up rank `r` of a one-host world for direct reads (declining if it is in `declines`).
fn reads(g: &Group<MemTransport>, r: usize, declines: &[usize]) {
    g.transport().enable_direct_reads();
    if declines.contains(&r) {
        g.transport().decline_direct_reads();
    }
}

fn sent(g: &Group<MemTransport>) -> u64 {
    (0..g.world_size())
        .map(|p| g.transport().payload_bytes_to(p))
        .sum()
}

/// All-gather of `n` elements per rank; `in_place`: each input is its own block of the
/// output. Returns the payload bytes each rank sent.
async fn all_gather(
    w: usize,
    dtype: DType,
    n: usize,
    in_place: bool,
    declines: &[usize],
) -> Vec<u64> {
    let size = dtype.size();
    let inputs: Vec<Vec<u8>> = (0..w)
        .map(|r| input(dtype, ReduceOp::Sum, r, n, 5))
        .collect();
    let want = inputs.concat();
    let (ishape, oshape) = (vec![n as u64], vec![w as u64, n as u64]);
    let declines = declines.to_vec();
    let results = run_world(w, None, cfg(), |g: Group<MemTransport>, r| {
        let mut inp = inputs[r].clone();
        let mut out = vec![0u8; n * size * w];
        if in_place {
            out[r * n * size..(r + 1) * n * size].copy_from_slice(&inp);
        }
        let (ishape, oshape) = (ishape.clone(), oshape.clone());
        let declines = declines.clone();
        async move {
            reads(&g, r, &declines);
            // SAFETY: both buffers outlive the awaited operation; in place, the input is
            // exactly block r of the output, which the all-gather allows.
            let (i, o) = unsafe {
                let o = RawBuf::from_slice(&mut out);
                let i = if in_place {
                    RawBuf::new(out.as_mut_ptr().add(r * n * size), n * size)
                } else {
                    RawBuf::from_slice(&mut inp)
                };
                (i, o)
            };
            let it = Tensor {
                buf: i,
                dtype,
                shape: &ishape,
                codec: Codec::None,
            };
            let ot = Tensor {
                buf: o,
                dtype,
                shape: &oshape,
                codec: Codec::None,
            };
            g.all_gather(ot, it)?.await?;
            Ok::<_, Error>((out, sent(&g)))
        }
    })
    .await;
    results
        .into_iter()
        .enumerate()
        .map(|(r, res)| {
            let (got, sent) = res.unwrap_or_else(|e| panic!("w={w} {dtype} n={n}: rank {r}: {e}"));
            assert!(
                got == want,
                "w={w} {dtype} n={n} in_place={in_place}: rank {r} differs"
            );
            sent
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_all_gather_is_exact_in_and_out_of_place_and_sends_no_data() {
    for w in 2..=5 {
        for dtype in [DType::F32, DType::I8, DType::C128, DType::Bool, DType::BF16] {
            for n in [1, 7, 20_011] {
                for in_place in [false, true] {
                    let out = all_gather(w, dtype, n, in_place, &[]).await;
                    if n * dtype.size() * w > cfg().small_bytes {
                        // Per peer: an address (and its flag), a verdict and "read".
                        assert!(out.iter().all(|&s| s == 11 * (w as u64 - 1)), "{out:?}");
                    }
                }
            }
        }
        let out = all_gather(w, DType::F32, 20_011, false, &[w - 1]).await;
        assert!(
            out.iter().all(|&s| s >= (20_011 * 4 * (w - 1)) as u64),
            "{out:?}"
        );
    }
}

async fn broadcast(w: usize, root: usize, dtype: DType, n: usize, declines: &[usize]) -> Vec<u64> {
    let want = input(dtype, ReduceOp::Sum, root, n, 3);
    let shape = vec![n as u64];
    let declines = declines.to_vec();
    let results = run_world(w, None, cfg(), |g: Group<MemTransport>, r| {
        let mut buf = if r == root {
            want.clone()
        } else {
            vec![0u8; want.len()]
        };
        let shape = shape.clone();
        let declines = declines.clone();
        async move {
            reads(&g, r, &declines);
            // SAFETY: `buf` outlives the awaited operation.
            let t = Tensor {
                buf: unsafe { RawBuf::from_slice(&mut buf) },
                dtype,
                shape: &shape,
                codec: Codec::None,
            };
            g.broadcast(t, root)?.await?;
            Ok::<_, Error>((buf, sent(&g)))
        }
    })
    .await;
    results
        .into_iter()
        .enumerate()
        .map(|(r, res)| {
            let (got, sent) = res.unwrap_or_else(|e| panic!("w={w} root={root}: rank {r}: {e}"));
            assert!(
                got == want,
                "w={w} root={root} {dtype} n={n}: rank {r} differs"
            );
            sent
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_broadcast_from_every_root_is_exact_and_sends_no_data() {
    for w in 2..=5 {
        for root in 0..w {
            for (dtype, n) in [(DType::I64, 3), (DType::F16, 30_001), (DType::U8, 100_000)] {
                let out = broadcast(w, root, dtype, n, &[]).await;
                if n * dtype.size() > cfg().small_bytes {
                    assert!(out.iter().all(|&s| s <= 11 * (w as u64 - 1)), "{out:?}");
                }
            }
        }
        let out = broadcast(w, 0, DType::F32, 30_001, &[1]).await;
        assert!(out[0] >= 30_001 * 4, "the root sent {}", out[0]);
    }
}

async fn reduce_scatter(
    w: usize,
    dtype: DType,
    op: ReduceOp,
    n: usize,
    declines: &[usize],
) -> Vec<u64> {
    let size = dtype.size();
    let inputs: Vec<Vec<u8>> = (0..w).map(|r| input(dtype, op, r, n * w, 7)).collect();
    let full = reference(dtype, op, &inputs);
    let (ishape, oshape) = (vec![(n * w) as u64], vec![n as u64]);
    let declines = declines.to_vec();
    let results = run_world(w, None, cfg(), |g: Group<MemTransport>, r| {
        let mut inp = inputs[r].clone();
        let mut out = vec![0u8; n * size];
        let (ishape, oshape) = (ishape.clone(), oshape.clone());
        let declines = declines.clone();
        async move {
            reads(&g, r, &declines);
            // SAFETY: both buffers outlive the awaited operation.
            let (i, o) = unsafe { (RawBuf::from_slice(&mut inp), RawBuf::from_slice(&mut out)) };
            let it = Tensor {
                buf: i,
                dtype,
                shape: &ishape,
                codec: Codec::None,
            };
            let ot = Tensor {
                buf: o,
                dtype,
                shape: &oshape,
                codec: Codec::None,
            };
            g.reduce_scatter(ot, it, op)?.await?;
            assert!(
                inp == input(dtype, op, r, n * w, 7),
                "the input is left as it was"
            );
            Ok::<_, Error>((out, sent(&g)))
        }
    })
    .await;
    results
        .into_iter()
        .enumerate()
        .map(|(r, res)| {
            let (got, sent) = res.unwrap_or_else(|e| panic!("w={w} {dtype} {op}: rank {r}: {e}"));
            assert!(
                got[..] == full[r * n * size..(r + 1) * n * size],
                "w={w} {dtype} {op} n={n}: rank {r} differs"
            );
            sent
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_reduce_scatter_is_exact_for_every_dtype_and_op_and_sends_no_data() {
    for w in 2..=5 {
        for dtype in DType::ALL {
            for op in OPS {
                if op.check(dtype).is_err() {
                    continue;
                }
                for n in [1, 5000] {
                    let out = reduce_scatter(w, dtype, op, n, &[]).await;
                    if n * w * dtype.size() > cfg().small_bytes {
                        assert!(out.iter().all(|&s| s == 11 * (w as u64 - 1)), "{out:?}");
                    }
                }
            }
        }
        let out = reduce_scatter(w, DType::F32, ReduceOp::Sum, 5000, &[0]).await;
        assert!(
            out.iter().all(|&s| s >= (5000 * 4 * (w - 1)) as u64),
            "{out:?}"
        );
    }
}
