//! Every collective × algorithm × world size × dtype × op × size, on the in-memory transport,
//! with and without seeded faults, against a sequential reference. Inputs are small integers
//! (and powers of two for products) so that every summation order gives the same bits, which
//! makes bit-exact comparison meaningful for the floating types too.

use crate::buffer::RawBuf;
use crate::dtype::{DType, ReduceOp};
use crate::error::Error;
use crate::group::{Algorithm, Group, GroupConfig, Tensor};
use crate::reduce::{finish_avg, reduce_into};
use crate::transport::mem::{network, MemChaos, MemTransport};
use crate::transport::Transport;
use crate::wire::Codec;
use half::{bf16, f16};
use std::borrow::Borrow;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

mod direct;
mod hierarchical;

fn encode(dtype: DType, vals: &[f64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(vals.len() * dtype.size());
    for &v in vals {
        match dtype {
            DType::F32 => out.extend_from_slice(&(v as f32).to_ne_bytes()),
            DType::F64 => out.extend_from_slice(&v.to_ne_bytes()),
            DType::F16 => out.extend_from_slice(&f16::from_f64(v).to_bits().to_ne_bytes()),
            DType::BF16 => out.extend_from_slice(&bf16::from_f64(v).to_bits().to_ne_bytes()),
            DType::I32 => out.extend_from_slice(&(v as i32).to_ne_bytes()),
            DType::I64 => out.extend_from_slice(&(v as i64).to_ne_bytes()),
            DType::U8 => out.push(v as u8),
            DType::I8 => out.extend_from_slice(&(v as i8).to_ne_bytes()),
            DType::I16 => out.extend_from_slice(&(v as i16).to_ne_bytes()),
            DType::U16 => out.extend_from_slice(&(v as u16).to_ne_bytes()),
            DType::U32 => out.extend_from_slice(&(v as u32).to_ne_bytes()),
            DType::U64 => out.extend_from_slice(&(v as u64).to_ne_bytes()),
            DType::Bool => out.push(u8::from(v != 0.0)),
            DType::C64 => {
                out.extend_from_slice(&(v as f32).to_ne_bytes());
                out.extend_from_slice(&(-v as f32).to_ne_bytes());
            }
            DType::C128 => {
                out.extend_from_slice(&v.to_ne_bytes());
                out.extend_from_slice(&(-2.0 * v).to_ne_bytes());
            }
            // Moved only: any bit pattern will do.
            DType::F8E4M3 | DType::F8E5M2 | DType::F8E4M3Uz | DType::F8E5M2Uz => {
                out.push((v as i8) as u8)
            }
        }
    }
    out
}

fn unsigned(d: DType) -> bool {
    matches!(
        d,
        DType::U8 | DType::U16 | DType::U32 | DType::U64 | DType::Bool
    )
}

/// Deterministic inputs whose reduction is exact in every order.
fn input(dtype: DType, op: ReduceOp, rank: usize, n: usize, salt: usize) -> Vec<u8> {
    let vals: Vec<f64> = (0..n)
        .map(|i| {
            let h = (i * 31 + rank * 17 + salt * 7) % 9;
            match (op, dtype) {
                (ReduceOp::Prod, d) if unsigned(d) => 1.0 + (h % 2) as f64,
                (ReduceOp::Prod, d) if !d.is_float() => [1.0, 2.0, -1.0][h % 3],
                (ReduceOp::Prod, _) => [1.0, 2.0, -1.0, 0.5][h % 4],
                (_, d) if unsigned(d) => h as f64,
                _ => h as f64 - 4.0,
            }
        })
        .collect();
    encode(dtype, &vals)
}

fn reference(dtype: DType, op: ReduceOp, inputs: &[Vec<u8>]) -> Vec<u8> {
    let mut acc = inputs[0].clone();
    for x in &inputs[1..] {
        reduce_into(dtype, op, &mut acc, x).expect("reference reduce");
    }
    if op == ReduceOp::Avg {
        finish_avg(dtype, &mut acc, inputs.len()).expect("reference avg");
    }
    acc
}

fn cfg() -> GroupConfig {
    GroupConfig {
        timeout: Duration::from_secs(20),
        chunk_bytes: 4096,
        small_bytes: 1024,
    }
}

/// Runs `f(group, rank)` on every rank of a `w`-rank in-memory world and returns the results.
async fn run_world<F, Fut, R>(w: usize, chaos: Option<MemChaos>, cfg: GroupConfig, f: F) -> Vec<R>
where
    F: Fn(Group<MemTransport>, usize) -> Fut,
    Fut: Future<Output = R> + Send + 'static,
    R: Send + 'static,
{
    let ts = network(w, chaos);
    let handles: Vec<_> = ts
        .into_iter()
        .enumerate()
        .map(|(r, t)| tokio::spawn(f(Group::new(t, cfg.clone()), r)))
        .collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.expect("rank task panicked"));
    }
    out
}

async fn all_reduce_case(
    w: usize,
    dtype: DType,
    op: ReduceOp,
    n: usize,
    algo: Algorithm,
    chaos: Option<MemChaos>,
) {
    let inputs: Vec<Vec<u8>> = (0..w).map(|r| input(dtype, op, r, n, 0)).collect();
    let want = reference(dtype, op, &inputs);
    let shape = vec![n as u64];
    let results = run_world(w, chaos, cfg(), |g, r| {
        let mut buf = inputs[r].clone();
        let shape = shape.clone();
        async move {
            // SAFETY: `buf` lives, untouched, until the awaited operation has finished.
            let raw = unsafe { RawBuf::from_slice(&mut buf) };
            let t = Tensor {
                buf: raw,
                dtype,
                shape: &shape,
                codec: Codec::None,
            };
            g.all_reduce(t, op, algo)
                .expect("valid arguments")
                .await
                .map(|()| buf)
        }
    })
    .await;
    for (r, res) in results.into_iter().enumerate() {
        let got = res
            .unwrap_or_else(|e| panic!("w={w} {dtype} {op} n={n} {algo:?}: rank {r} failed: {e}"));
        assert_eq!(
            got, want,
            "w={w} {dtype} {op} n={n} {algo:?}: rank {r} differs"
        );
    }
}

const OPS: [ReduceOp; 8] = [
    ReduceOp::Sum,
    ReduceOp::Avg,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::Prod,
    ReduceOp::BAnd,
    ReduceOp::BOr,
    ReduceOp::BXor,
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_reduce_every_algorithm_world_dtype_op_and_size() {
    for algo in [
        Algorithm::Ring,
        Algorithm::Tree,
        Algorithm::RecursiveDoubling,
        Algorithm::Auto,
    ] {
        for w in 1..=8 {
            for dtype in DType::ALL {
                for op in OPS {
                    if op.check(dtype).is_err() {
                        continue;
                    }
                    for n in [0, 1, 7, 1000] {
                        all_reduce_case(w, dtype, op, n, algo, None).await;
                    }
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_reduce_large_buffers_are_chunked_and_exact() {
    let n = (1 << 20) / 4 + 3;
    for w in [2, 3, 5, 8] {
        for algo in [
            Algorithm::Ring,
            Algorithm::Tree,
            Algorithm::RecursiveDoubling,
        ] {
            all_reduce_case(w, DType::F32, ReduceOp::Sum, n, algo, None).await;
        }
        all_reduce_case(w, DType::BF16, ReduceOp::Max, n, Algorithm::Ring, None).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collectives_are_exact_under_reordering_chaos() {
    for seed in 0..4 {
        let chaos = Some(MemChaos {
            seed,
            max_delay: Duration::from_micros(300),
            corrupt: 0.0,
        });
        for w in [2, 3, 4, 7] {
            for algo in [
                Algorithm::Ring,
                Algorithm::Tree,
                Algorithm::RecursiveDoubling,
            ] {
                all_reduce_case(w, DType::F32, ReduceOp::Sum, 5000, algo, chaos).await;
            }
            broadcast_case(w, 1 % w, 3001, chaos).await;
            all_gather_case(w, 2999, chaos).await;
            reduce_scatter_case(w, DType::F64, ReduceOp::Sum, 1001, chaos).await;
        }
    }
}

async fn broadcast_case(w: usize, root: usize, n: usize, chaos: Option<MemChaos>) {
    let want = input(DType::I64, ReduceOp::Sum, root, n, 3);
    let shape = vec![n as u64];
    let results = run_world(w, chaos, cfg(), |g, r| {
        let mut buf = if r == root {
            want.clone()
        } else {
            vec![0u8; n * 8]
        };
        let shape = shape.clone();
        async move {
            // SAFETY: `buf` outlives the awaited operation.
            let t = Tensor {
                buf: unsafe { RawBuf::from_slice(&mut buf) },
                dtype: DType::I64,
                shape: &shape,
                codec: Codec::None,
            };
            g.broadcast(t, root).expect("valid").await.map(|()| buf)
        }
    })
    .await;
    for (r, res) in results.into_iter().enumerate() {
        assert_eq!(
            res.expect("broadcast"),
            want,
            "w={w} root={root} n={n}: rank {r}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broadcast_from_every_root() {
    for w in 1..=8 {
        for root in 0..w {
            for n in [0, 1, 7, 5000] {
                broadcast_case(w, root, n, None).await;
            }
        }
    }
}

async fn all_gather_case(w: usize, n: usize, chaos: Option<MemChaos>) {
    let inputs: Vec<Vec<u8>> = (0..w)
        .map(|r| input(DType::F16, ReduceOp::Sum, r, n, 5))
        .collect();
    let want: Vec<u8> = inputs.concat();
    let (ishape, oshape) = (vec![n as u64], vec![w as u64, n as u64]);
    let results = run_world(w, chaos, cfg(), |g, r| {
        let mut inp = inputs[r].clone();
        let mut out = vec![0u8; n * 2 * w];
        let (ishape, oshape) = (ishape.clone(), oshape.clone());
        async move {
            // SAFETY: both buffers outlive the awaited operation.
            let (i, o) = unsafe { (RawBuf::from_slice(&mut inp), RawBuf::from_slice(&mut out)) };
            let it = Tensor {
                buf: i,
                dtype: DType::F16,
                shape: &ishape,
                codec: Codec::None,
            };
            let ot = Tensor {
                buf: o,
                dtype: DType::F16,
                shape: &oshape,
                codec: Codec::None,
            };
            g.all_gather(ot, it).expect("valid").await.map(|()| out)
        }
    })
    .await;
    for (r, res) in results.into_iter().enumerate() {
        assert_eq!(res.expect("all_gather"), want, "w={w} n={n}: rank {r}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_gather_every_world_and_size() {
    for w in 1..=8 {
        for n in [0, 1, 7, 3001] {
            all_gather_case(w, n, None).await;
        }
    }
}

async fn reduce_scatter_case(
    w: usize,
    dtype: DType,
    op: ReduceOp,
    n: usize,
    chaos: Option<MemChaos>,
) {
    let inputs: Vec<Vec<u8>> = (0..w).map(|r| input(dtype, op, r, n * w, 9)).collect();
    let full = reference(dtype, op, &inputs);
    let block = n * dtype.size();
    let (ishape, oshape) = (vec![(w * n) as u64], vec![n as u64]);
    let results = run_world(w, chaos, cfg(), |g, r| {
        let mut inp = inputs[r].clone();
        let mut out = vec![0u8; block];
        let (ishape, oshape) = (ishape.clone(), oshape.clone());
        async move {
            let before = inp.clone();
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
            let res = g.reduce_scatter(ot, it, op).expect("valid").await;
            assert_eq!(inp, before, "reduce_scatter must not modify its input");
            res.map(|()| out)
        }
    })
    .await;
    for (r, res) in results.into_iter().enumerate() {
        let got = res.expect("reduce_scatter");
        assert_eq!(
            got,
            full[r * block..(r + 1) * block],
            "w={w} {dtype} {op} n={n}: rank {r}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reduce_scatter_every_world_dtype_and_op() {
    for w in 1..=8 {
        for dtype in DType::ALL {
            for op in OPS {
                if op.check(dtype).is_ok() {
                    for n in [0, 1, 7, 700] {
                        reduce_scatter_case(w, dtype, op, n, None).await;
                    }
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn barrier_lets_nobody_through_early() {
    for w in 1..=8 {
        let entered = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let results = run_world(w, None, cfg(), |g, r| {
            let entered = entered.clone();
            async move {
                tokio::time::sleep(Duration::from_millis((r * 3) as u64)).await;
                entered.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                g.barrier().expect("valid").await?;
                Ok::<usize, Error>(entered.load(std::sync::atomic::Ordering::SeqCst))
            }
        })
        .await;
        for res in results {
            assert_eq!(res.expect("barrier"), w);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_recv_around_a_ring_in_order() {
    let w = 4;
    let n = 10_000;
    let results = run_world(w, None, cfg(), |g, r| async move {
        let shape = vec![n as u64];
        let mut got = Vec::new();
        for round in 0..3u32 {
            let mut out = input(DType::I32, ReduceOp::Sum, r, n, round as usize);
            let mut inb = vec![0u8; n * 4];
            // SAFETY: both buffers outlive the awaited operations.
            let (o, i) = unsafe { (RawBuf::from_slice(&mut out), RawBuf::from_slice(&mut inb)) };
            let s = g.send(
                Tensor {
                    buf: o,
                    dtype: DType::I32,
                    shape: &shape,
                    codec: Codec::None,
                },
                (r + 1) % w,
                round,
            )?;
            let rv = g.recv(
                Tensor {
                    buf: i,
                    dtype: DType::I32,
                    shape: &shape,
                    codec: Codec::None,
                },
                (r + w - 1) % w,
                round,
            )?;
            let (a, b) = tokio::join!(s, rv);
            a?;
            b?;
            got.push(inb);
        }
        Ok::<_, Error>(got)
    })
    .await;
    for (r, res) in results.into_iter().enumerate() {
        let got = res.expect("p2p");
        for (round, buf) in got.into_iter().enumerate() {
            assert_eq!(
                buf,
                input(DType::I32, ReduceOp::Sum, (r + w - 1) % w, n, round),
                "rank {r} round {round}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_operations_in_flight_together_do_not_mix() {
    let w = 3;
    let results = run_world(w, None, cfg(), |g, r| async move {
        let shape = vec![3000u64];
        let mut a = input(DType::F32, ReduceOp::Sum, r, 3000, 1);
        let mut b = input(DType::F32, ReduceOp::Sum, r, 3000, 2);
        // SAFETY: both buffers outlive the awaited operations.
        let (ra, rb) = unsafe { (RawBuf::from_slice(&mut a), RawBuf::from_slice(&mut b)) };
        let fa = g.all_reduce(
            Tensor {
                buf: ra,
                dtype: DType::F32,
                shape: &shape,
                codec: Codec::None,
            },
            ReduceOp::Sum,
            Algorithm::Ring,
        )?;
        let fb = g.all_reduce(
            Tensor {
                buf: rb,
                dtype: DType::F32,
                shape: &shape,
                codec: Codec::None,
            },
            ReduceOp::Max,
            Algorithm::Tree,
        )?;
        let (x, y) = tokio::join!(fb, fa);
        x?;
        y?;
        Ok::<_, Error>((a, b))
    })
    .await;
    let ins_a: Vec<_> = (0..w)
        .map(|r| input(DType::F32, ReduceOp::Sum, r, 3000, 1))
        .collect();
    let ins_b: Vec<_> = (0..w)
        .map(|r| input(DType::F32, ReduceOp::Sum, r, 3000, 2))
        .collect();
    for res in results {
        let (a, b) = res.expect("both ops");
        assert_eq!(a, reference(DType::F32, ReduceOp::Sum, &ins_a));
        assert_eq!(b, reference(DType::F32, ReduceOp::Max, &ins_b));
    }
}

/// Every rank runs an all-reduce whose shape depends on the rank.
async fn mismatched_all_reduce(w: usize, odd_rank: usize) -> Vec<Result<Vec<u8>, Error>> {
    run_world(w, None, cfg(), move |g, r| async move {
        let n = if r == odd_rank { 12 } else { 10 };
        let shape = vec![n as u64];
        let mut buf = vec![0u8; n * 4];
        // SAFETY: `buf` outlives the awaited operation.
        let t = Tensor {
            buf: unsafe { RawBuf::from_slice(&mut buf) },
            dtype: DType::F32,
            shape: &shape,
            codec: Codec::None,
        };
        g.all_reduce(t, ReduceOp::Sum, Algorithm::Ring)?
            .await
            .map(|()| buf)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spec_mismatch_fails_every_rank_and_names_both_specs() {
    for w in [2, 3, 4] {
        for odd in 0..w {
            let started = std::time::Instant::now();
            for (r, res) in mismatched_all_reduce(w, odd).await.into_iter().enumerate() {
                match res {
                    Err(Error::SpecMismatch(m)) => {
                        assert!(
                            m.contains("float32[12]") && m.contains("float32[10]"),
                            "rank {r}: {m}"
                        )
                    }
                    other => panic!("w={w} odd={odd}: rank {r} got {other:?}"),
                }
            }
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "mismatch took {:?}",
                started.elapsed()
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_of_another_size_is_a_mismatch_naming_it_by_sender_and_number() {
    // Rank 0 sends two messages of 4 floats; rank 1 receives the first whole and the second
    // into 3: the receiver names the second message as its sender numbered it.
    let results = run_world(2, None, cfg(), |g, r| async move {
        for (i, len) in [4u64, if r == 0 { 4 } else { 3 }].into_iter().enumerate() {
            let shape = vec![len];
            let mut buf = vec![0u8; len as usize * 4];
            // SAFETY: `buf` outlives the awaited operation.
            let t = Tensor {
                buf: unsafe { RawBuf::from_slice(&mut buf) },
                dtype: DType::F32,
                shape: &shape,
                codec: Codec::None,
            };
            let res = if r == 0 {
                g.send(t, 1, 7)?.await
            } else {
                g.recv(t, 0, 7)?.await
            };
            if r == 1 && i == 1 {
                return res;
            }
            res?;
        }
        Ok(())
    })
    .await;
    assert!(results[0].is_ok(), "the sender is done: {:?}", results[0]);
    match &results[1] {
        Err(Error::SpecMismatch(m)) => assert!(
            m.starts_with("message #1 from rank 0 differs between ranks")
                && m.contains("float32[4]")
                && m.contains("float32[3]"),
            "{m}"
        ),
        other => panic!("rank 1 got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn different_collectives_on_different_ranks_are_a_mismatch() {
    let results = run_world(3, None, cfg(), |g, r| async move {
        let shape = vec![4u64];
        let mut buf = vec![0u8; 16];
        // SAFETY: `buf` outlives the awaited operation.
        let t = Tensor {
            buf: unsafe { RawBuf::from_slice(&mut buf) },
            dtype: DType::F32,
            shape: &shape,
            codec: Codec::None,
        };
        if r == 1 {
            g.broadcast(t, 0)?.await
        } else {
            g.all_reduce(t, ReduceOp::Sum, Algorithm::Ring)?.await
        }
    })
    .await;
    for (r, res) in results.into_iter().enumerate() {
        assert!(
            matches!(res, Err(Error::SpecMismatch(_))),
            "rank {r}: {res:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_cancels_an_operation_in_flight_at_once() {
    let ts = network(2, None);
    let g = Group::new(ts[0].clone(), cfg());
    let mut buf = vec![0u8; 4000];
    let shape = [1000u64];
    // SAFETY: `buf` outlives the awaited operation.
    let t = Tensor {
        buf: unsafe { RawBuf::from_slice(&mut buf) },
        dtype: DType::F32,
        shape: &shape,
        codec: Codec::None,
    };
    let op = tokio::spawn(
        g.all_reduce(t, ReduceOp::Sum, Algorithm::Ring)
            .expect("valid"),
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    let t0 = std::time::Instant::now();
    g.abort();
    let res = op.await.expect("join");
    assert!(matches!(res, Err(Error::Closed(_))), "{res:?}");
    assert!(t0.elapsed() < Duration::from_millis(500));
    assert!(matches!(g.barrier(), Err(Error::Closed(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn later_calls_on_an_aborted_group_say_why_it_was_aborted() {
    let ts = network(2, None);
    let g = Group::new(ts[0].clone(), cfg());
    g.abort_because("interrupted by Ctrl-C");
    match g.barrier() {
        Err(Error::Closed(m)) => assert!(m.starts_with("interrupted by Ctrl-C"), "{m}"),
        Err(e) => panic!("{e:?}"),
        Ok(_) => panic!("an aborted group started an operation"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_never_comes_is_a_timeout_for_everyone_else() {
    let mut c = cfg();
    c.timeout = Duration::from_millis(300);
    let results = run_world(3, None, c, |g, r| async move {
        if r == 2 {
            return Ok(());
        }
        let shape = vec![100u64];
        let mut buf = vec![0u8; 400];
        // SAFETY: `buf` outlives the awaited operation.
        let t = Tensor {
            buf: unsafe { RawBuf::from_slice(&mut buf) },
            dtype: DType::F32,
            shape: &shape,
            codec: Codec::None,
        };
        g.all_reduce(t, ReduceOp::Sum, Algorithm::Ring)?.await
    })
    .await;
    assert!(
        matches!(results[0], Err(Error::Timeout { .. })),
        "{:?}",
        results[0]
    );
    assert!(
        matches!(results[1], Err(Error::Timeout { .. })),
        "{:?}",
        results[1]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_rank_is_a_lost_peer_for_every_survivor() {
    for w in [3, 4] {
        let ts = network(w, None);
        let victim = ts[1].clone();
        let handles: Vec<_> = ts
            .into_iter()
            .enumerate()
            .filter(|(r, _)| *r != 1)
            .map(|(_, t)| {
                let g = Group::new(t, cfg());
                tokio::spawn(async move {
                    let shape = vec![50_000u64];
                    let mut buf = vec![0u8; 200_000];
                    // SAFETY: `buf` outlives the awaited operation.
                    let t = Tensor {
                        buf: unsafe { RawBuf::from_slice(&mut buf) },
                        dtype: DType::F32,
                        shape: &shape,
                        codec: Codec::None,
                    };
                    g.all_reduce(t, ReduceOp::Sum, Algorithm::Ring)?.await
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(50)).await;
        victim.kill();
        for h in handles {
            match h.await.expect("join") {
                Err(Error::PeerLost { rank, .. }) => assert_eq!(rank, 1),
                other => panic!("w={w}: expected PeerLost(1), got {other:?}"),
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_reported_a_loss_and_left_is_not_blamed_for_it() {
    // Rank 1 dies; rank 0 fails the all-reduce naming it, tells rank 2 and closes its group.
    // Rank 2 comes to the all-reduce only then: its first send, to rank 0, fails because
    // rank 0 has left, but what it reports is the cause rank 0 told it of.
    let ts = network(3, None);
    ts[1].kill();
    let g0 = Arc::new(Group::new(ts[0].clone(), cfg()));
    let first = ring_sum_f32(g0.clone(), 0, 5000).await;
    assert!(
        matches!(first, Err(Error::PeerLost { rank: 1, .. })),
        "rank 0: {first:?}"
    );
    g0.close().await;
    ts[0].leave();
    let g2 = Arc::new(Group::new(ts[2].clone(), cfg()));
    match ring_sum_f32(g2, 2, 5000).await {
        Err(Error::PeerLost { rank: 1, .. }) => {}
        other => panic!("rank 2: expected PeerLost naming rank 1, got {other:?}"),
    }
}

/// Sum-all-reduces rank `r`'s `n`-element float32 input with the ring algorithm.
async fn ring_sum_f32(
    g: impl Borrow<Group<MemTransport>>,
    r: usize,
    n: usize,
) -> Result<Vec<u8>, Error> {
    let shape = vec![n as u64];
    let mut buf = input(DType::F32, ReduceOp::Sum, r, n, 0);
    // SAFETY: `buf` outlives the awaited operation.
    let t = Tensor {
        buf: unsafe { RawBuf::from_slice(&mut buf) },
        dtype: DType::F32,
        shape: &shape,
        codec: Codec::None,
    };
    g.borrow()
        .all_reduce(t, ReduceOp::Sum, Algorithm::Ring)?
        .await?;
    Ok(buf)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_frames_are_resent_and_every_result_stays_exact() {
    // One frame in ten damaged: every damaged copy fails its checksum and is sent again.
    for seed in 0..3 {
        let chaos = Some(MemChaos {
            seed,
            max_delay: Duration::from_micros(100),
            corrupt: 0.1,
        });
        for w in [2, 3, 4] {
            for algo in [
                Algorithm::Ring,
                Algorithm::Tree,
                Algorithm::RecursiveDoubling,
            ] {
                all_reduce_case(w, DType::F32, ReduceOp::Sum, 5000, algo, chaos).await;
            }
            broadcast_case(w, w - 1, 3001, chaos).await;
            all_gather_case(w, 2999, chaos).await;
            reduce_scatter_case(w, DType::I64, ReduceOp::Sum, 1001, chaos).await;
        }
    }
    // And the resends really happen.
    let ts = network(
        3,
        Some(MemChaos {
            seed: 1,
            max_delay: Duration::ZERO,
            corrupt: 0.1,
        }),
    );
    let handles: Vec<_> = ts
        .iter()
        .enumerate()
        .map(|(r, t)| tokio::spawn(ring_sum_f32(Group::new(t.clone(), cfg()), r, 20_000)))
        .collect();
    for h in handles {
        h.await.expect("join").expect("all-reduce heals");
    }
    assert!(ts[0].retransmits() > 0, "no frame was resent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_damaged_past_the_resend_limit_fail_with_the_count_never_used() {
    let chaos = Some(MemChaos {
        seed: 7,
        max_delay: Duration::from_micros(10),
        corrupt: 1.0,
    });
    let mut c = cfg();
    c.timeout = Duration::from_secs(5);
    let results = run_world(3, chaos, c, |g, r| ring_sum_f32(g, r, 1000)).await;
    let limit = crate::transport::DEFAULT_RESEND_LIMIT;
    let mut named = 0;
    for (r, res) in results.into_iter().enumerate() {
        match res {
            Err(Error::Protocol(m)) => {
                // The rank that received the frame names it; the others learn of the abort.
                if m.contains("checksum") && m.contains(&format!("{limit} resends")) {
                    assert!(m.contains("all_reduce") && m.contains("from rank"), "{m}");
                    named += 1;
                }
            }
            other => panic!("rank {r}: expected ProtocolError, got {other:?}"),
        }
    }
    assert!(named >= 1, "no rank named the resend count");
}

#[tokio::test]
async fn bad_arguments_are_refused_before_anything_is_sent() {
    let ts = network(2, None);
    let g = Group::new(ts[0].clone(), cfg());
    let mut buf = vec![0u8; 16];
    // SAFETY: `buf` outlives every call below; none of them runs an operation.
    let raw = unsafe { RawBuf::from_slice(&mut buf) };
    let shape5 = [5u64];
    let shape4 = [4u64];
    let wrong_len = Tensor {
        buf: raw,
        dtype: DType::F32,
        shape: &shape5,
        codec: Codec::None,
    };
    assert!(matches!(
        g.all_reduce(wrong_len, ReduceOp::Sum, Algorithm::Auto),
        Err(Error::InvalidArgument(_))
    ));
    let ints = Tensor {
        buf: raw,
        dtype: DType::I32,
        shape: &shape4,
        codec: Codec::None,
    };
    assert!(matches!(
        g.all_reduce(ints, ReduceOp::Avg, Algorithm::Auto),
        Err(Error::InvalidArgument(_))
    ));
    let ok = Tensor {
        buf: raw,
        dtype: DType::F32,
        shape: &shape4,
        codec: Codec::None,
    };
    assert!(matches!(g.broadcast(ok, 2), Err(Error::InvalidArgument(_))));
    assert!(matches!(g.send(ok, 0, 0), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        g.all_gather(ok, ok),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        g.reduce_scatter(ok, ok, ReduceOp::Sum),
        Err(Error::InvalidArgument(_))
    ));
    let nine = [1u64; 9];
    let deep = Tensor {
        buf: raw,
        dtype: DType::U8,
        shape: &nine,
        codec: Codec::None,
    };
    assert!(g.all_reduce(deep, ReduceOp::Sum, Algorithm::Auto).is_err());
    assert_eq!(ts[0].mailbox().pending(), 0);
    assert_eq!(ts[1].mailbox().pending(), 0, "nothing reached the peer");
    g.close().await;
    assert!(matches!(g.barrier(), Err(Error::Closed(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broadcast_root_learns_of_a_mismatch_at_its_next_operation() {
    let results = run_world(2, None, cfg(), |g, r| async move {
        let shape = vec![4u64];
        let mut buf = vec![0u8; 16];
        // SAFETY: `buf` outlives the awaited operations.
        let raw = unsafe { RawBuf::from_slice(&mut buf) };
        let t = Tensor {
            buf: raw,
            dtype: DType::F32,
            shape: &shape,
            codec: Codec::None,
        };
        let first = if r == 0 {
            g.broadcast(t, 0)?.await
        } else {
            g.all_reduce(t, ReduceOp::Sum, Algorithm::Ring)?.await
        };
        if r == 0 {
            assert!(first.is_ok(), "the root sends and is done: {first:?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
            return g.barrier()?.await;
        }
        first
    })
    .await;
    for (r, res) in results.into_iter().enumerate() {
        assert!(
            matches!(res, Err(Error::SpecMismatch(_))),
            "rank {r}: {res:?}"
        );
    }
}

/// Floats in [-1, 1] that no codec but `lossless` carries exactly.
fn noisy(rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 7919 + rank * 104_729) % 10_007) as f32 / 5003.5 - 1.0) * 0.999)
        .collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn as_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coded_all_reduce_is_identical_on_every_rank_and_within_the_stated_bound() {
    let n = 5000;
    let codecs = [
        (Codec::Fp16, 1.0f32 / 2048.0),
        (Codec::Bf16, 1.0 / 256.0),
        (Codec::Int8 { block: 256 }, 1.0 / 127.0),
        (Codec::Lossless, 0.0),
    ];
    for (codec, rel) in codecs {
        for w in [2usize, 3, 5] {
            for algo in [
                Algorithm::Ring,
                Algorithm::Tree,
                Algorithm::RecursiveDoubling,
            ] {
                let exact: Vec<f64> = (0..n)
                    .map(|i| (0..w).map(|r| f64::from(noisy(r, n)[i])).sum())
                    .collect();
                let shape = vec![n as u64];
                let mut c = cfg();
                c.chunk_bytes = 4096;
                let results = run_world(w, None, c, |g, r| {
                    let mut buf = f32_bytes(&noisy(r, n));
                    let shape = shape.clone();
                    async move {
                        // SAFETY: `buf` outlives the awaited operation.
                        let raw = unsafe { RawBuf::from_slice(&mut buf) };
                        let t = Tensor {
                            buf: raw,
                            dtype: DType::F32,
                            shape: &shape,
                            codec,
                        };
                        g.all_reduce(t, ReduceOp::Sum, algo)?.await.map(|()| buf)
                    }
                })
                .await;
                let first = results[0].as_ref().expect("rank 0").clone();
                for (r, res) in results.iter().enumerate() {
                    let got = res
                        .as_ref()
                        .unwrap_or_else(|e| panic!("{codec:?} w={w} {algo:?} r={r}: {e}"));
                    assert_eq!(
                        got, &first,
                        "{codec:?} w={w} {algo:?}: rank {r} differs from rank 0"
                    );
                }
                let got = as_f32(&first);
                // Every hop re-encodes a partial sum of at most w values in [-1, 1]: at most
                // w quantisations, each off by at most rel x w (int8: half a step of a block
                // whose maximum is at most w).
                let bound = (w * w) as f64 * f64::from(rel);
                let mut worst = 0f64;
                for i in 0..n {
                    worst = worst.max((f64::from(got[i]) - exact[i]).abs());
                }
                assert!(
                    worst <= bound + 1e-6,
                    "{codec:?} w={w} {algo:?}: error {worst} > {bound}"
                );
                if codec == Codec::Lossless {
                    // Only f32 rounding of the additions remains.
                    assert!(worst < 1e-5, "lossless must not lose precision: {worst}");
                } else {
                    assert!(
                        worst > 0.0,
                        "{codec:?} w={w} {algo:?}: no quantisation error at all?"
                    );
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coded_broadcast_and_all_gather_give_every_rank_the_same_bits() {
    let (w, n) = (3usize, 3001usize);
    let codec = Codec::Int8 { block: 64 };
    let results = run_world(w, None, cfg(), |g, r| async move {
        let shape = vec![n as u64];
        let oshape = vec![w as u64, n as u64];
        let mut b = if r == 1 {
            f32_bytes(&noisy(9, n))
        } else {
            vec![0u8; n * 4]
        };
        let mut inp = f32_bytes(&noisy(r, n));
        let mut out = vec![0u8; w * n * 4];
        // SAFETY: the buffers outlive the awaited operations.
        let (rb, ri, ro) = unsafe {
            (
                RawBuf::from_slice(&mut b),
                RawBuf::from_slice(&mut inp),
                RawBuf::from_slice(&mut out),
            )
        };
        g.broadcast(
            Tensor {
                buf: rb,
                dtype: DType::F32,
                shape: &shape,
                codec,
            },
            1,
        )?
        .await?;
        let it = Tensor {
            buf: ri,
            dtype: DType::F32,
            shape: &shape,
            codec,
        };
        let ot = Tensor {
            buf: ro,
            dtype: DType::F32,
            shape: &oshape,
            codec,
        };
        g.all_gather(ot, it)?.await?;
        Ok::<_, Error>((b, out))
    })
    .await;
    let (b0, o0) = results[0].as_ref().expect("rank 0").clone();
    for (r, res) in results.iter().enumerate() {
        let (b, o) = res.as_ref().expect("rank");
        assert_eq!(b, &b0, "broadcast: rank {r} (the root is rank 1) differs");
        assert_eq!(o, &o0, "all_gather: rank {r} differs");
    }
    let got = as_f32(&b0);
    let want = noisy(9, n);
    let worst = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        worst > 0.0 && worst <= 1.0 / 127.0,
        "broadcast error {worst}"
    );
}

#[tokio::test]
async fn lossy_codecs_refuse_integer_tensors() {
    let ts = network(2, None);
    let g = Group::new(ts[0].clone(), cfg());
    let mut buf = vec![0u8; 16];
    // SAFETY: `buf` outlives the call, which runs nothing.
    let raw = unsafe { RawBuf::from_slice(&mut buf) };
    let shape = [4u64];
    let t = Tensor {
        buf: raw,
        dtype: DType::I32,
        shape: &shape,
        codec: Codec::Int8 { block: 256 },
    };
    assert!(matches!(
        g.all_reduce(t, ReduceOp::Sum, Algorithm::Auto),
        Err(Error::InvalidArgument(_))
    ));
    let t = Tensor {
        buf: raw,
        dtype: DType::F32,
        shape: &shape,
        codec: Codec::Int8 { block: 100 },
    };
    assert!(matches!(
        g.all_reduce(t, ReduceOp::Sum, Algorithm::Auto),
        Err(Error::InvalidArgument(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recv_from_any_source_takes_whoever_comes_first() {
    let results = run_world(3, None, cfg(), |g, r| async move {
        let shape = vec![100u64];
        if r == 0 {
            let mut got = Vec::new();
            for _ in 0..2 {
                let mut buf = vec![0u8; 400];
                let source = Arc::new(std::sync::atomic::AtomicUsize::new(usize::MAX));
                // SAFETY: `buf` outlives the awaited operation.
                let t = Tensor {
                    buf: unsafe { RawBuf::from_slice(&mut buf) },
                    dtype: DType::I32,
                    shape: &shape,
                    codec: Codec::None,
                };
                g.recv_any(t, 5, source.clone())?.await?;
                got.push((source.load(std::sync::atomic::Ordering::Acquire), buf));
            }
            return Ok::<_, Error>(got);
        }
        // Rank 2 sends at once, rank 1 later: rank 0 must take rank 2's message first.
        if r == 1 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut buf = input(DType::I32, ReduceOp::Sum, r, 100, 0);
        // SAFETY: `buf` outlives the awaited operation.
        let t = Tensor {
            buf: unsafe { RawBuf::from_slice(&mut buf) },
            dtype: DType::I32,
            shape: &shape,
            codec: Codec::None,
        };
        g.send(t, 0, 5)?.await?;
        Ok(Vec::new())
    })
    .await;
    let got = results[0].as_ref().expect("rank 0");
    assert_eq!(got[0].0, 2);
    assert_eq!(got[1].0, 1);
    for (src, buf) in got {
        assert_eq!(buf, &input(DType::I32, ReduceOp::Sum, *src, 100, 0));
    }
}
