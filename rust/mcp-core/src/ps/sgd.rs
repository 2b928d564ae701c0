//! SGD with momentum, weight decay and Nesterov, on f32, compiled twice (portable and AVX2)
//! and chosen at run time.
//!
//! One step, for every element (the order of operations is part of the contract: the tests
//! and `tests/test_ps.py` replay it in numpy and compare bits):
//! ```text
//! g = g + wd * p                  (when wd != 0)
//! b = mu * b + g                  (when mu != 0; b starts at 0)
//! d = nesterov ? g + mu * b : b   (d = g when mu == 0)
//! p = p - lr * d
//! ```

/// Hyper-parameters of SGD.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdConfig {
    /// Learning rate.
    pub lr: f32,
    /// Momentum factor (0 turns momentum off).
    pub momentum: f32,
    /// L2 weight decay added to the gradient.
    pub weight_decay: f32,
    /// Nesterov momentum.
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig {
            lr: 0.01,
            momentum: 0.9,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

#[inline(always)]
fn step_portable(c: &SgdConfig, p: &mut [f32], g: &[f32], b: &mut [f32]) {
    let n = p.len().min(g.len());
    let (p, g) = (&mut p[..n], &g[..n]);
    let (lr, mu, wd) = (c.lr, c.momentum, c.weight_decay);
    // One loop per variant so that each is straight-line code the compiler vectorises.
    match (mu != 0.0, wd != 0.0, c.nesterov) {
        (false, false, _) => p.iter_mut().zip(g).for_each(|(p, &g)| *p -= lr * g),
        (false, true, _) => p.iter_mut().zip(g).for_each(|(p, &g)| {
            let g = g + wd * *p;
            *p -= lr * g;
        }),
        (true, wd_on, nesterov) => {
            let m = n.min(b.len());
            let (p, g, b) = (&mut p[..m], &g[..m], &mut b[..m]);
            p.iter_mut()
                .zip(g)
                .zip(b.iter_mut())
                .for_each(|((p, &g), b)| {
                    let g = if wd_on { g + wd * *p } else { g };
                    *b = mu * *b + g;
                    let d = if nesterov { g + mu * *b } else { *b };
                    *p -= lr * d;
                })
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn step_avx2(c: &SgdConfig, p: &mut [f32], g: &[f32], b: &mut [f32]) {
    step_portable(c, p, g, b)
}

/// One SGD step on `params` with gradient `grad`; `momentum_buf` (same length) carries the
/// momentum between steps (unused, and may be empty, when momentum is 0). Only the common
/// length of the slices is updated.
pub fn step(c: &SgdConfig, params: &mut [f32], grad: &[f32], momentum_buf: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked on the line above.
        return unsafe { step_avx2(c, params, grad, momentum_buf) };
    }
    step_portable(c, params, grad, momentum_buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ps::optim::test_data as data;

    /// The contract above, one element at a time.
    fn scalar(c: &SgdConfig, p: &mut [f32], g: &[f32], b: &mut [f32]) {
        for i in 0..p.len() {
            let mut gi = g[i];
            if c.weight_decay != 0.0 {
                gi += c.weight_decay * p[i];
            }
            let d = if c.momentum != 0.0 {
                b[i] = c.momentum * b[i] + gi;
                if c.nesterov {
                    gi + c.momentum * b[i]
                } else {
                    b[i]
                }
            } else {
                gi
            };
            p[i] -= c.lr * d;
        }
    }

    #[test]
    fn matches_the_scalar_reference_bit_for_bit() {
        for (mu, wd, nesterov) in [
            (0.0, 0.0, false),
            (0.0, 1e-2, false),
            (0.9, 0.0, false),
            (0.9, 1e-4, false),
            (0.9, 1e-4, true),
        ] {
            let c = SgdConfig {
                lr: 0.05,
                momentum: mu,
                weight_decay: wd,
                nesterov,
            };
            for n in [0, 1, 7, 8, 33, 1000] {
                let (mut p1, mut b1) = (data(n, 1), vec![0.0; n]);
                let (mut p2, mut b2) = (p1.clone(), b1.clone());
                for s in 0..5 {
                    let g = data(n, 100 + s);
                    step(&c, &mut p1, &g, &mut b1);
                    scalar(&c, &mut p2, &g, &mut b2);
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&p1), bits(&p2), "params {c:?} n={n}");
                assert_eq!(bits(&b1), bits(&b2), "momentum {c:?} n={n}");
            }
        }
    }

    #[test]
    fn plain_sgd_value() {
        let c = SgdConfig {
            lr: 0.5,
            momentum: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        };
        let mut p = vec![1.0f32, 2.0];
        step(&c, &mut p, &[2.0, -4.0], &mut []);
        assert_eq!(p, vec![0.0, 4.0]);
    }
}
