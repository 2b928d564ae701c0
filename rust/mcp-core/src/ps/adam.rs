//! Adam and AdamW with bias correction, on f32, compiled twice (portable and AVX2) and chosen
//! at run time.
//!
//! Step `t` (1-based). Scalars are computed in f64 and rounded to f32 once; the element-wise
//! part runs in f32 in this order (the tests and `tests/test_ps.py` replay it in numpy and
//! compare bits):
//! ```text
//! AdamW (decoupled): p = p * (1 - lr*wd)        Adam (L2): g = g + wd * p
//! m = b1 * m + (1 - b1) * g
//! v = b2 * v + (1 - b2) * (g * g)
//! p = p - (lr / (1 - b1^t)) * (m / (sqrt(v) / sqrt(1 - b2^t) + eps))
//! ```
//! `b1^t` and `b2^t` are running products in f64 (`AdamState::b1_pow`).

/// Hyper-parameters of Adam.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamConfig {
    /// Learning rate.
    pub lr: f64,
    /// Decay of the first moment.
    pub beta1: f64,
    /// Decay of the second moment.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Weight decay: L2 added to the gradient (Adam), or decoupled (AdamW).
    pub weight_decay: f64,
    /// Decoupled weight decay (AdamW).
    pub decoupled: bool,
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: false,
        }
    }
}

/// The per-tensor step counter and running powers of the betas.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamState {
    /// Steps taken.
    pub t: u64,
    /// beta1^t.
    pub b1_pow: f64,
    /// beta2^t.
    pub b2_pow: f64,
}

impl Default for AdamState {
    fn default() -> Self {
        AdamState {
            t: 0,
            b1_pow: 1.0,
            b2_pow: 1.0,
        }
    }
}

/// The f32 scalars of one step.
#[derive(Clone, Copy)]
struct Scalars {
    b1: f32,
    omb1: f32,
    b2: f32,
    omb2: f32,
    step: f32,
    bc2_sqrt: f32,
    eps: f32,
    wd: f32,
    decay: f32,
    decoupled: bool,
}

#[inline(always)]
fn step_portable(s: Scalars, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    let n = p.len().min(g.len()).min(m.len()).min(v.len());
    let (p, g, m, v) = (&mut p[..n], &g[..n], &mut m[..n], &mut v[..n]);
    let l2 = s.wd != 0.0 && !s.decoupled;
    let decay = s.wd != 0.0 && s.decoupled;
    p.iter_mut()
        .zip(g)
        .zip(m.iter_mut().zip(v.iter_mut()))
        .for_each(|((p, &g), (m, v))| {
            if decay {
                *p *= s.decay;
            }
            let g = if l2 { g + s.wd * *p } else { g };
            *m = s.b1 * *m + s.omb1 * g;
            *v = s.b2 * *v + s.omb2 * (g * g);
            let denom = v.sqrt() / s.bc2_sqrt + s.eps;
            *p -= s.step * (*m / denom);
        });
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn step_avx2(s: Scalars, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    step_portable(s, p, g, m, v)
}

/// One Adam step on `params` with gradient `grad`; `m` and `v` (same length) are the
/// moments, `state` the step counter, advanced here. Only the common length is updated.
pub fn step(
    c: &AdamConfig,
    state: &mut AdamState,
    params: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
) {
    state.t += 1;
    state.b1_pow *= c.beta1;
    state.b2_pow *= c.beta2;
    let s = Scalars {
        b1: c.beta1 as f32,
        omb1: (1.0 - c.beta1) as f32,
        b2: c.beta2 as f32,
        omb2: (1.0 - c.beta2) as f32,
        step: (c.lr / (1.0 - state.b1_pow)) as f32,
        bc2_sqrt: (1.0 - state.b2_pow).sqrt() as f32,
        eps: c.eps as f32,
        wd: c.weight_decay as f32,
        decay: (1.0 - c.lr * c.weight_decay) as f32,
        decoupled: c.decoupled,
    };
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked on the line above.
        return unsafe { step_avx2(s, params, grad, m, v) };
    }
    step_portable(s, params, grad, m, v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ps::optim::test_data as data;

    /// The contract of the module doc, one element at a time.
    fn scalar(
        c: &AdamConfig,
        st: &mut AdamState,
        p: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
    ) {
        st.t += 1;
        st.b1_pow *= c.beta1;
        st.b2_pow *= c.beta2;
        let step = (c.lr / (1.0 - st.b1_pow)) as f32;
        let bc2 = (1.0 - st.b2_pow).sqrt() as f32;
        for i in 0..p.len() {
            if c.decoupled && c.weight_decay != 0.0 {
                p[i] *= (1.0 - c.lr * c.weight_decay) as f32;
            }
            let mut gi = g[i];
            if !c.decoupled && c.weight_decay != 0.0 {
                gi += c.weight_decay as f32 * p[i];
            }
            m[i] = c.beta1 as f32 * m[i] + (1.0 - c.beta1) as f32 * gi;
            v[i] = c.beta2 as f32 * v[i] + (1.0 - c.beta2) as f32 * (gi * gi);
            p[i] -= step * (m[i] / (v[i].sqrt() / bc2 + c.eps as f32));
        }
    }

    #[test]
    fn matches_the_scalar_reference_bit_for_bit() {
        for (wd, decoupled) in [(0.0, false), (1e-2, false), (1e-2, true)] {
            let c = AdamConfig {
                lr: 1e-2,
                weight_decay: wd,
                decoupled,
                ..Default::default()
            };
            for n in [0, 1, 9, 64, 1001] {
                let mut p1 = data(n, 3);
                let (mut m1, mut v1, mut s1) = (vec![0.0; n], vec![0.0; n], AdamState::default());
                let (mut p2, mut m2, mut v2, mut s2) = (p1.clone(), m1.clone(), v1.clone(), s1);
                for k in 0..6 {
                    let g = data(n, 50 + k);
                    step(&c, &mut s1, &mut p1, &g, &mut m1, &mut v1);
                    scalar(&c, &mut s2, &mut p2, &g, &mut m2, &mut v2);
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&p1), bits(&p2), "{c:?} n={n}");
                assert_eq!(bits(&v1), bits(&v2), "{c:?} n={n}");
                assert_eq!(s1, s2);
            }
        }
    }

    #[test]
    fn first_step_moves_each_weight_by_about_lr() {
        // With bias correction the first step is lr * g / (|g| + eps'): about lr in size.
        let c = AdamConfig {
            lr: 0.1,
            ..Default::default()
        };
        let mut st = AdamState::default();
        let mut p = vec![1.0f32, 1.0];
        let (mut m, mut v) = (vec![0.0; 2], vec![0.0; 2]);
        step(&c, &mut st, &mut p, &[3.0, -0.5], &mut m, &mut v);
        assert!((p[0] - 0.9).abs() < 1e-6, "{p:?}");
        assert!((p[1] - 1.1).abs() < 1e-6, "{p:?}");
        assert_eq!(st.t, 1);
    }
}
