//! Error feedback for lossy codecs: what one step's coding lost is added to the next step's
//! input, so the sum of what was sent tracks the sum of the true values instead of drifting.

use super::{decode, encode, CodecKind};
use crate::dtype::DType;
use crate::error::Result;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// Per-tensor residuals of lossy coding, keyed by a caller-chosen name (a bucket or parameter
/// name). Shareable between threads: the map lock is held only to find a key's entry, and
/// each key has its own lock, so different keys encode in parallel.
#[derive(Debug, Default)]
pub struct ErrorFeedback {
    residuals: Mutex<HashMap<String, Arc<Mutex<Vec<f32>>>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere cannot leave a residual half-meaningful in a way that matters more
    // than losing training: carry on with what is there.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ErrorFeedback {
    /// An empty set of residuals.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends the coding of `src + residual[key]` to `out` and keeps what that coding lost as
    /// the key's new residual: `x' = x + r; send enc(x'); r = x' - dec(enc(x'))`.
    ///
    /// A key seen with another length starts again from a zero residual. Where `x'` or its
    /// decoding is not finite the residual is reset to 0 (one inf must not poison the key
    /// forever). For a lossless `kind` the residual stays zero.
    pub fn encode_with_feedback(
        &self,
        kind: CodecKind,
        key: &str,
        src: &[f32],
        out: &mut Vec<u8>,
    ) -> Result<()> {
        kind.check(DType::F32)?;
        let entry = {
            let mut map = lock(&self.residuals);
            match map.get(key) {
                Some(e) => Arc::clone(e),
                None => {
                    let e = Arc::new(Mutex::new(Vec::new()));
                    map.insert(key.to_owned(), Arc::clone(&e));
                    e
                }
            }
        };
        let mut residual = lock(&entry);
        if residual.len() != src.len() {
            residual.clear();
            residual.resize(src.len(), 0.0);
        }
        let adjusted: Vec<f32> = src
            .iter()
            .zip(residual.iter())
            .map(|(x, r)| x + r)
            .collect();
        let start = out.len();
        encode(kind, DType::F32, bytemuck::cast_slice(&adjusted), out)?;
        // Decode into the residual's storage, then turn it into the difference.
        let decoded: &mut [f32] = &mut residual;
        if let Err(e) = decode(
            kind,
            DType::F32,
            &out[start..],
            bytemuck::cast_slice_mut(decoded),
        ) {
            out.truncate(start);
            residual.fill(0.0);
            return Err(e);
        }
        for (r, a) in residual.iter_mut().zip(&adjusted) {
            let d = a - *r;
            *r = if d.is_finite() { d } else { 0.0 };
        }
        Ok(())
    }

    /// The residual currently kept for `key`, if any (for tests and diagnostics).
    pub fn residual(&self, key: &str) -> Option<Vec<f32>> {
        let entry = lock(&self.residuals).get(key).map(Arc::clone)?;
        let r = lock(&entry).clone();
        Some(r)
    }

    /// Forgets the residual of `key` (for example when its parameter is re-initialised).
    pub fn reset(&self, key: &str) {
        lock(&self.residuals).remove(key);
    }

    /// Forgets every residual.
    pub fn clear(&self) {
        lock(&self.residuals).clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn decode_f32(kind: CodecKind, enc: &[u8], n: usize) -> Vec<f32> {
        let mut out = vec![0f32; n];
        decode(kind, DType::F32, enc, bytemuck::cast_slice_mut(&mut out)).expect("decode");
        out
    }

    /// Runs `steps` steps; returns max over elements of |Σ sent − Σ true| divided by the
    /// largest quantisation step that element's block had.
    fn drift(kind: CodecKind, feedback: bool, steps: usize) -> f64 {
        let n = 1000;
        let block = kind.block().max(1) as usize;
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let ef = ErrorFeedback::new();
        let mut sum_true = vec![0f64; n];
        let mut sum_sent = vec![0f64; n];
        let mut max_step = vec![0f64; n];
        for _ in 0..steps {
            let x: Vec<f32> = (0..n)
                .map(|_| rng.random_range(-1.0f32..1.0) * 1e-2)
                .collect();
            let mut enc = Vec::new();
            if feedback {
                ef.encode_with_feedback(kind, "w", &x, &mut enc)
                    .expect("encode");
            } else {
                encode(kind, DType::F32, bytemuck::cast_slice(&x), &mut enc).expect("encode");
            }
            let sent = decode_f32(kind, &enc, n);
            for i in 0..n {
                sum_true[i] += f64::from(x[i]);
                sum_sent[i] += f64::from(sent[i]);
                let step = match kind {
                    CodecKind::Int8 { .. } => {
                        let b = i / block;
                        let s = &enc[4 * b..4 * b + 4];
                        f64::from(f32::from_le_bytes([s[0], s[1], s[2], s[3]]))
                    }
                    // one f16 ulp at the magnitude of the input
                    _ => f64::from(x[i].abs().max(1e-2)) * 2f64.powi(-10),
                };
                max_step[i] = max_step[i].max(step);
            }
        }
        (0..n)
            .map(|i| (sum_sent[i] - sum_true[i]).abs() / max_step[i])
            .fold(0.0, f64::max)
    }

    #[test]
    fn feedback_keeps_the_sum_within_one_step() {
        for kind in [CodecKind::Int8 { block: 64 }, CodecKind::Fp16] {
            let with = drift(kind, true, 1000);
            assert!(with <= 1.0, "{kind:?}: drift {with} steps with feedback");
            // The test can fail: without feedback the same run drifts by many steps.
            let without = drift(kind, false, 1000);
            assert!(
                without > 2.0,
                "{kind:?}: drift {without} steps without feedback"
            );
        }
    }

    #[test]
    fn shape_change_resets_and_keys_are_independent() {
        let ef = ErrorFeedback::new();
        let kind = CodecKind::Int8 { block: 4 };
        let mut out = Vec::new();
        ef.encode_with_feedback(kind, "a", &[1.0, 0.003, 0.5, 0.25], &mut out)
            .expect("encode");
        let r = ef.residual("a").expect("kept");
        assert_eq!(r.len(), 4);
        assert!(r.iter().any(|v| *v != 0.0));
        assert!(ef.residual("b").is_none());
        ef.encode_with_feedback(kind, "a", &[1.0, 2.0], &mut out)
            .expect("encode");
        // New shape: the old residual was not added, so it matches a fresh instance.
        let fresh = ErrorFeedback::new();
        fresh
            .encode_with_feedback(kind, "a", &[1.0, 2.0], &mut out)
            .expect("encode");
        assert_eq!(ef.residual("a"), fresh.residual("a"));
        assert_ne!(ef.residual("a"), Some(vec![0.0, 0.0]));
        ef.reset("a");
        assert!(ef.residual("a").is_none());
    }

    #[test]
    fn non_finite_inputs_do_not_poison_the_residual() {
        let ef = ErrorFeedback::new();
        let kind = CodecKind::Int8 { block: 2 };
        let mut out = Vec::new();
        ef.encode_with_feedback(kind, "k", &[f32::INFINITY, 0.3, f32::NAN, 0.1], &mut out)
            .expect("encode");
        let r = ef.residual("k").expect("kept");
        assert!(r.iter().all(|v| v.is_finite()), "{r:?}");
        let sent = decode_f32(kind, &out, 4);
        assert!(sent[0] == f32::INFINITY && sent[2].is_nan());
    }

    #[test]
    fn threads_share_one_instance() {
        let ef = ErrorFeedback::new();
        std::thread::scope(|s| {
            for t in 0..4 {
                let ef = &ef;
                s.spawn(move || {
                    let x: Vec<f32> = (0..100).map(|i| (i * t) as f32 * 1e-3).collect();
                    for _ in 0..50 {
                        let mut out = Vec::new();
                        ef.encode_with_feedback(CodecKind::Bf16, &format!("k{t}"), &x, &mut out)
                            .expect("encode");
                    }
                });
            }
        });
        for t in 0..4 {
            assert_eq!(ef.residual(&format!("k{t}")).map(|r| r.len()), Some(100));
        }
    }

    #[test]
    fn unsupported_kind_is_refused() {
        let ef = ErrorFeedback::new();
        let mut out = Vec::new();
        assert!(ef
            .encode_with_feedback(CodecKind::Int8 { block: 0 }, "k", &[1.0], &mut out)
            .is_err());
    }
}
