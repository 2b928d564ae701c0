//! Throughput of the checkpoint delta codec on one and two threads, for float32 and bfloat16 tensors
//! shaped like consecutive checkpoints: weights decayed by AdamW's factor plus a small
//! update. `cargo bench -p mcp-delta --bench delta`; the Python comparison with ZipNN on a real training
//! run is `benches/delta_vs_zipnn.py`.

#[path = "../../bench-common/mod.rs"]
mod common;

use mcp_delta::{decode_into, encode, DType, EncodeOptions};
use std::time::Duration;

fn main() {
    let n = 4 << 20;
    let w = common::gradients(n);
    let mut upd = common::gradients(n);
    upd.rotate_left(n / 3 + 12_345); // an update unrelated to the weight it moves
    let next: Vec<f32> = w
        .iter()
        .zip(&upd)
        .map(|(&x, &u)| x * (1.0 - 1e-5) + u * 3e-3)
        .collect();
    let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let bf16_bytes = |v: &[f32]| {
        v.iter()
            .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
            .collect::<Vec<u8>>()
    };
    for (name, dtype, prev, cur) in [
        ("float32", DType::F32, f32_bytes(&w), f32_bytes(&next)),
        ("bfloat16", DType::BF16, bf16_bytes(&w), bf16_bytes(&next)),
    ] {
        let shape = [(cur.len() / dtype.size()) as u64];
        for threads in [1, 2] {
            let opts = EncodeOptions {
                threads,
                ..EncodeOptions::default()
            };
            let mut blob = Vec::new();
            let te = common::best(3, Duration::from_secs(2), || {
                blob = encode(dtype, &shape, Some(&prev), &cur, &opts)
                    .expect("encode")
                    .into_vec();
            });
            let mut out = vec![0u8; cur.len()];
            let td = common::best(3, Duration::from_secs(2), || {
                decode_into(&blob, Some(&prev), &mut out, threads).expect("decode");
            });
            assert_eq!(out, cur);
            let mbs = |t: Duration| cur.len() as f64 / t.as_secs_f64() / 1e6;
            println!(
                "{name:>9}: ratio {:.2}x  encode {:.0} MB/s  decode {:.0} MB/s ({threads} thread{})",
                cur.len() as f64 / blob.len() as f64,
                mbs(te),
                mbs(td),
                if threads == 1 { "" } else { "s" }
            );
        }
    }
}
