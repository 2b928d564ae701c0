//! What sealing and opening one QUIC packet with AES-128-GCM costs with each of rustls's two
//! crypto providers, `ring` (the one mcp_fast ships) and `aws-lc-rs`, on this processor.
//!
//! `cargo run --release --manifest-path benches/aead_providers/Cargo.toml [-- SECONDS]`
//!
//! Every QUIC packet is sealed once by its sender and opened once by its receiver, and its
//! header is masked with one AES block each way (header protection). The sizes are the
//! payloads of a 1,280-byte minimum path, a 1,500-byte Ethernet path and a 65,000-byte
//! loopback path. Prints a Markdown table of nanoseconds per packet (median of 5 rounds).

use std::hint::black_box;
use std::time::{Duration, Instant};

/// Packet payloads, in bytes, on the three paths named above.
const SIZES: [usize; 3] = [1_200, 1_452, 65_000];
/// The bytes a QUIC short header and its frame headers add to the associated data.
const AD_LEN: usize = 20;
/// Rounds per figure; the median is printed.
const ROUNDS: usize = 5;

/// One provider's AES-128-GCM: seal, open and header-protection mask of one packet.
trait Provider {
    fn name(&self) -> &'static str;
    fn seal(&self, counter: u64, ad: &[u8], buf: &mut [u8]) -> [u8; 16];
    fn open(&self, counter: u64, ad: &[u8], buf: &mut [u8]) -> usize;
    fn mask(&self, sample: &[u8; 16]) -> [u8; 5];
}

fn nonce_bytes(counter: u64) -> [u8; 12] {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&counter.to_be_bytes());
    n
}

macro_rules! provider {
    ($ty:ident, $krate:ident, $label:literal) => {
        struct $ty {
            key: $krate::aead::LessSafeKey,
            hp: $krate::aead::quic::HeaderProtectionKey,
        }

        impl $ty {
            fn new(key: &[u8; 16]) -> Self {
                use $krate::aead::{quic, LessSafeKey, UnboundKey, AES_128_GCM};
                let unbound = UnboundKey::new(&AES_128_GCM, key).expect("a 16-byte AES key");
                let hp =
                    quic::HeaderProtectionKey::new(&quic::AES_128, key).expect("a 16-byte AES key");
                Self {
                    key: LessSafeKey::new(unbound),
                    hp,
                }
            }
        }

        impl Provider for $ty {
            fn name(&self) -> &'static str {
                $label
            }
            fn seal(&self, counter: u64, ad: &[u8], buf: &mut [u8]) -> [u8; 16] {
                use $krate::aead::{Aad, Nonce};
                let nonce = Nonce::assume_unique_for_key(nonce_bytes(counter));
                let tag = self
                    .key
                    .seal_in_place_separate_tag(nonce, Aad::from(ad), buf)
                    .expect("seal");
                let mut out = [0u8; 16];
                out.copy_from_slice(tag.as_ref());
                out
            }
            fn open(&self, counter: u64, ad: &[u8], buf: &mut [u8]) -> usize {
                use $krate::aead::{Aad, Nonce};
                let nonce = Nonce::assume_unique_for_key(nonce_bytes(counter));
                self.key
                    .open_in_place(nonce, Aad::from(ad), buf)
                    .expect("a packet sealed with the same key opens")
                    .len()
            }
            fn mask(&self, sample: &[u8; 16]) -> [u8; 5] {
                self.hp.new_mask(sample).expect("a 16-byte sample")
            }
        }
    };
}

provider!(Ring, ring, "ring 0.17.14");
provider!(AwsLc, aws_lc_rs, "aws-lc-rs 1.19.0");

/// Median nanoseconds per call of `f` over `ROUNDS` rounds of `per_round` each.
fn median_ns(per_round: Duration, mut f: impl FnMut(u64)) -> f64 {
    let mut figures = Vec::with_capacity(ROUNDS);
    let mut counter = 0u64;
    for _ in 0..ROUNDS {
        let (start, mut calls) = (Instant::now(), 0u64);
        while start.elapsed() < per_round {
            for _ in 0..64 {
                f(counter);
                counter += 1;
            }
            calls += 64;
        }
        figures.push(start.elapsed().as_nanos() as f64 / calls as f64);
    }
    figures.sort_by(f64::total_cmp);
    figures[ROUNDS / 2]
}

/// Seal, open (of a copy of a sealed packet, as a receive buffer is) and mask, per packet.
fn measure(p: &dyn Provider, size: usize, per_round: Duration) -> [f64; 3] {
    let ad = [0x5au8; AD_LEN];
    let mut buf = vec![0xa5u8; size];
    let seal = median_ns(per_round, |i| {
        black_box(p.seal(i, &ad, &mut buf));
    });
    let mut sealed = vec![0xa5u8; size];
    let tag = p.seal(0, &ad, &mut sealed);
    sealed.extend_from_slice(&tag);
    let mut rx = sealed.clone();
    let open = median_ns(per_round, |_| {
        rx.copy_from_slice(&sealed);
        black_box(p.open(0, &ad, &mut rx));
    });
    let sample = [0x3cu8; 16];
    let mask = median_ns(per_round, |i| {
        let mut s = sample;
        s[..8].copy_from_slice(&i.to_le_bytes());
        black_box(p.mask(&s));
    });
    [seal, open, mask]
}

fn main() {
    let seconds: f64 = std::env::args()
        .nth(1)
        .map(|s| s.parse().expect("SECONDS is a number"))
        .unwrap_or(5.0);
    let per_figure = Duration::from_secs_f64(seconds / (ROUNDS * 3) as f64);
    let key = [7u8; 16];
    let providers: [&dyn Provider; 2] = [&Ring::new(&key), &AwsLc::new(&key)];
    println!("| provider | payload | seal | open (with a copy) | header mask | seal+open GB/s |");
    println!("|---|---|---|---|---|---|");
    for size in SIZES {
        for p in providers {
            let [seal, open, mask] = measure(p, size, per_figure);
            let gbs = size as f64 / (seal + open);
            println!(
                "| {} | {size} B | {seal:.0} ns | {open:.0} ns | {mask:.1} ns | {gbs:.2} |",
                p.name()
            );
        }
    }
}
