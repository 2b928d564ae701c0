//! Reed-Solomon throughput at the block shapes the FEC lane uses, one core.
//!
//! `cargo bench -p mcp-core --bench fec`. Prints, per (k, m, shard bytes): encode GB/s of
//! payload (data shards in, parity out), decode GB/s of payload with m data shards lost (the
//! worst case: Reed-Solomon must rebuild m shards; its cost barely depends on how many
//! are lost, and has a large fixed part per block, so small blocks decode slowly), and the whole receive path with no loss
//! (all data shards arrive, decoding skipped). GB = 1e9 bytes.

use mcp_core::fec::{BlockDecoder, BlockEncoder};
use std::hint::black_box;
use std::time::{Duration, Instant};

/// (k, m, shard bytes): 1408-byte shards fill a 1452-byte datagram (WAN path MTU); 16384-byte
/// shards stand for loopback-sized datagrams.
const SHAPES: [(usize, usize, usize); 13] = [
    (16, 8, 1408),
    (32, 8, 1408),
    (32, 16, 1408),
    (64, 32, 1408),
    (128, 32, 1408),
    (256, 64, 1408),
    (512, 128, 1408),
    (1024, 256, 1408),
    (32, 8, 16384),
    (32, 16, 16384),
    (64, 32, 16384),
    (128, 32, 16384),
    (256, 64, 16384),
];

/// Runs `f` repeatedly for about `budget` and returns payload GB/s.
fn rate(bytes_per_call: usize, budget: Duration, mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    let mut calls = 0u64;
    while start.elapsed() < budget && calls < 10_000_000 {
        f();
        calls += 1;
    }
    (calls as f64 * bytes_per_call as f64) / start.elapsed().as_secs_f64() / 1e9
}

fn main() -> Result<(), mcp_core::Error> {
    let budget = Duration::from_millis(
        std::env::var("FEC_BENCH_MS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(600),
    );
    println!(
        "{:>4} {:>4} {:>6} | {:>12} {:>20} {:>16} {:>18}",
        "k",
        "m",
        "shard",
        "encode GB/s",
        "decode GB/s (m lost)",
        "decode us/block",
        "no-loss path GB/s"
    );
    for (k, m, sb) in SHAPES {
        let len = k * sb;
        let block: Vec<u8> = (0..len)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        let mut enc = BlockEncoder::new(k, m, sb)?;
        let enc_rate = rate(len, budget, || {
            if enc.encode(black_box(&block)).is_err() {
                std::process::abort();
            }
        });
        enc.encode(&block)?;
        let shards: Vec<Vec<u8>> = (0..k + m)
            .map(|i| enc.shard(i).map(<[u8]>::to_vec).unwrap_or_default())
            .collect();
        let mut dec = BlockDecoder::new(k, m, sb, len)?;
        // Lose the first m data shards: keep data m..k and all m parity shards.
        let dec_rate = rate(len, budget, || {
            let ok = dec.reset(k, m, sb, len).is_ok()
                && (m..k + m).all(|i| dec.add(i, &shards[i]).is_ok())
                && dec
                    .reconstruct()
                    .map(|b| black_box(b).len() == len)
                    .unwrap_or(false);
            if !ok {
                std::process::abort();
            }
        });
        if dec.reset(k, m, sb, len).is_ok() {
            for (i, s) in shards.iter().enumerate().skip(m) {
                dec.add(i, s)?;
            }
            if dec.reconstruct()? != &block[..] {
                eprintln!("decode mismatch at k={k} m={m}");
                std::process::exit(1);
            }
        }
        let direct_rate = rate(len, budget, || {
            let ok = dec.reset(k, m, sb, len).is_ok()
                && (0..k).all(|i| dec.add(i, &shards[i]).is_ok())
                && dec
                    .reconstruct()
                    .map(|b| black_box(b).len() == len)
                    .unwrap_or(false);
            if !ok {
                std::process::abort();
            }
        });
        println!("{k:>4} {m:>4} {sb:>6} | {enc_rate:>12.2} {dec_rate:>20.2} {:>16.0} {direct_rate:>18.2}",
                len as f64 / (dec_rate * 1e3));
    }
    Ok(())
}
