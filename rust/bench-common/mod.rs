//! What the benches of mcp-core and mcp-delta share (each includes this file with `#[path]`):
//! the gradient-shaped input and the best-of-runs timer.

use rand::{Rng, SeedableRng};
use std::time::{Duration, Instant};

/// `n` float32 values shaped like gradients: normal, with a standard deviation rising by layer
/// (64 layers) from 1e-4 to 1e-2, and 10 % exact zeros. Seeded: the same every run.
pub fn gradients(n: usize) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    let mut v = Vec::with_capacity(n);
    for layer in 0..64 {
        let std = 1e-4 * 100f32.powf(layer as f32 / 63.0);
        for _ in 0..n / 64 {
            if rng.random::<f32>() < 0.1 {
                v.push(0.0);
                continue;
            }
            // Box-Muller
            let (u1, u2): (f32, f32) = (rng.random::<f32>().max(1e-12), rng.random());
            v.push(std * (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos());
        }
    }
    v
}

/// Best wall time of `f` over at least `runs` runs and `min_time`, after one warm-up run
/// (caches, lazily built contexts).
pub fn best(runs: u32, min_time: Duration, mut f: impl FnMut()) -> Duration {
    f();
    let start = Instant::now();
    let mut best = Duration::MAX;
    let mut done = 0;
    while done < runs || start.elapsed() < min_time {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed());
        done += 1;
    }
    best
}
