//! Per-plane coders on one core: `cargo bench -p mcp-delta --bench entropy`.
//!
//! The four byte planes of 16 MiB of float32 gradients (as in the `codec` bench), each coded
//! as the lossless codec and the delta encoder would see it, in 64 Ki-byte planes: sampled
//! entropy, then ratio and MB/s (of plane bytes) of canonical Huffman and of zstd level 1.

use mcp_delta::entropy::{huffman, sampled_entropy};
use std::hint::black_box;
use std::time::Duration;

#[path = "../../bench-common/mod.rs"]
mod common;

const N: usize = 4 << 20;
const PLANE: usize = 65_536;

/// Best wall time of `f` over at least 3 runs and 0.3 s.
fn best(f: impl FnMut()) -> Duration {
    common::best(3, Duration::from_millis(300), f)
}

fn main() {
    let x = common::gradients(N);
    let mbs = |d: Duration| N as f64 / d.as_secs_f64() / 1e6;
    println!("byte planes of {} MiB of f32 gradients, in {PLANE}-byte planes, one core (MB/s of plane bytes)", (N * 4) >> 20);
    println!(
        "{:<6} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "plane", "entropy", "huf ratio", "huf enc", "huf dec", "zstd rat", "zstd enc", "zstd dec"
    );
    let mut zc = zstd::bulk::Compressor::new(1).expect("zstd");
    let mut zd = zstd::bulk::Decompressor::new().expect("zstd");
    for p in (0..4).rev() {
        let plane: Vec<u8> = x.iter().map(|f| f.to_le_bytes()[p]).collect();
        // Output buffers are reused, as the codecs do: fresh allocations would time page
        // faults.
        let mut coded: Vec<Vec<u8>> = (0..N / PLANE)
            .map(|_| Vec::with_capacity(2 * PLANE))
            .collect();
        let t_he = best(|| {
            for (c, o) in plane.chunks(PLANE).zip(&mut coded) {
                o.clear();
                huffman::encode(black_box(c), o);
            }
        });
        let mut back = vec![0u8; PLANE];
        let t_hd = best(|| {
            for (c, o) in plane.chunks(PLANE).zip(&coded) {
                huffman::decode(black_box(o), &mut back[..c.len()]).expect("decode");
            }
        });
        let hlen: usize = coded.iter().map(Vec::len).sum();
        let mut zcoded: Vec<Vec<u8>> = vec![vec![0u8; 2 * PLANE]; N / PLANE];
        let mut zlens = vec![0usize; N / PLANE];
        let t_ze = best(|| {
            for ((c, o), l) in plane.chunks(PLANE).zip(&mut zcoded).zip(&mut zlens) {
                *l = zc
                    .compress_to_buffer(black_box(c), o.as_mut_slice())
                    .expect("zstd");
            }
        });
        let t_zd = best(|| {
            for ((c, o), &l) in plane.chunks(PLANE).zip(&zcoded).zip(&zlens) {
                zd.decompress_to_buffer(black_box(&o[..l]), &mut back[..c.len()])
                    .expect("zstd");
            }
        });
        let zlen: usize = zlens.iter().sum();
        println!(
            "{:<6} {:>8.2} {:>8.2}x {:>9.0} {:>9.0} {:>8.2}x {:>9.0} {:>9.0}",
            p,
            sampled_entropy(&plane),
            N as f64 / hlen as f64,
            mbs(t_he),
            mbs(t_hd),
            N as f64 / zlen as f64,
            mbs(t_ze),
            mbs(t_zd)
        );
    }
}
