//! Throughput of the wire codecs on one core: `cargo bench -p mcp-core --bench codec`.
//!
//! Input: 16 MiB of float32 shaped like gradients (normal, std varying by layer from 1e-4 to
//! 1e-2, 10 % exact zeros). GB/s are of the f32 tensor (10^9 bytes of input per second for
//! encode; of output for decode and decode_reduce), best of several runs.

use mcp_core::codec::{decode, decode_reduce, encode, CodecKind};
use mcp_core::{DType, ReduceOp};
use std::hint::black_box;
use std::time::Duration;

#[path = "../../bench-common/mod.rs"]
mod common;

const N: usize = 4 << 20; // 16 MiB of f32

/// Best wall time of `f` over at least 5 runs and 0.5 s.
fn best(f: impl FnMut()) -> Duration {
    common::best(5, Duration::from_millis(500), f)
}

fn gbps(d: Duration) -> f64 {
    (N * 4) as f64 / d.as_secs_f64() / 1e9
}

fn main() {
    let x = common::gradients(N);
    let src: &[u8] = bytemuck::cast_slice(&x);
    let mut dst = vec![0f32; N];
    let mut out = vec![0f32; N];
    println!(
        "codec throughput, one core, {} MiB of f32 gradients (GB/s of f32 data)",
        (N * 4) >> 20
    );
    println!(
        "{:<14} {:>8} {:>9} {:>9} {:>14}",
        "codec", "ratio", "encode", "decode", "decode_reduce"
    );
    for kind in [
        CodecKind::None,
        CodecKind::Fp16,
        CodecKind::Bf16,
        CodecKind::Int8 { block: 256 },
        CodecKind::Int8 { block: 4096 },
        CodecKind::Lossless,
    ] {
        let mut enc = Vec::with_capacity(mcp_core::codec::max_encoded_len(kind, DType::F32, N));
        let t_enc = best(|| {
            enc.clear();
            encode(kind, DType::F32, black_box(src), &mut enc).expect("encode");
        });
        let t_dec = best(|| {
            decode(
                kind,
                DType::F32,
                black_box(&enc),
                bytemuck::cast_slice_mut(&mut out),
            )
            .expect("decode");
        });
        let t_red = best(|| {
            decode_reduce(
                kind,
                DType::F32,
                ReduceOp::Sum,
                black_box(&enc),
                bytemuck::cast_slice_mut(&mut dst),
            )
            .expect("decode_reduce");
        });
        let label = match kind {
            CodecKind::Int8 { block } => format!("int8/{block}"),
            k => k.name().to_string(),
        };
        println!(
            "{:<14} {:>7.2}x {:>9.2} {:>9.2} {:>14.2}",
            label,
            src.len() as f64 / enc.len() as f64,
            gbps(t_enc),
            gbps(t_dec),
            gbps(t_red)
        );
    }
    black_box((&dst, &out));
}
