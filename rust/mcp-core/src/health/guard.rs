//! The gradient-norm guard: the global L2 norm of many gradient tensors, non-finite
//! detection, clipping, and a breaker that trips after consecutive bad steps.
//!
//! The norm is `sqrt(Σ x²)` over every element of every slice, accumulated in `f64` whatever
//! the element type (f32, f64, f16, bf16), with eight independent accumulators so that the
//! compiler vectorises the loop. Half-precision slices are widened to f32 a block at a time.
//! An f64 slice whose sum of squares overflows (elements above ~1e154) is summed again scaled
//! by its largest magnitude, so its norm stays exact; squares below ~1e-308 count as 0.
//!
//! [`GradientGuard::check`] turns a norm into a [`Verdict`]: `Ok` at or under `max_norm`,
//! `Clipped` above it (scale by `factor = max_norm / (norm + 1e-6)`, as
//! `torch.nn.utils.clip_grad_norm_`), `NonFinite` for NaN/Inf, and `Tripped` once
//! `trip_after` steps in a row were clipped or non-finite. A good step resets the count.
//! What a trip means is the [`GuardPolicy`]: skip the update (and warn) or raise.

use crate::dtype::DType;
use crate::error::{Error, Result};
use bytemuck::Pod;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

const LANES: usize = 8;
/// Elements widened (or copied, when unaligned) at a time.
const BLOCK: usize = 1024;
/// The `eps` of `torch.nn.utils.clip_grad_norm_`.
const CLIP_EPS: f64 = 1e-6;

fn ssq_f32(x: &[f32]) -> f64 {
    let mut acc = [0f64; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            let v = f64::from(v);
            *a += v * v;
        }
    }
    let tail: f64 = chunks
        .remainder()
        .iter()
        .map(|&v| f64::from(v).powi(2))
        .sum();
    acc.iter().sum::<f64>() + tail
}

fn ssq_f64(x: &[f64]) -> f64 {
    let mut acc = [0f64; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v * v;
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|&v| v * v).sum();
    acc.iter().sum::<f64>() + tail
}

/// Runs `f` over `bytes` as `&[T]`, in place when aligned, else a copied block at a time.
fn for_each_block<T: Pod>(bytes: &[u8], mut f: impl FnMut(&[T])) {
    match bytemuck::try_cast_slice::<u8, T>(bytes) {
        Ok(s) => f(s),
        Err(_) => {
            let size = std::mem::size_of::<T>();
            let mut tmp = [T::zeroed(); BLOCK];
            for chunk in bytes.chunks(BLOCK * size) {
                let n = chunk.len() / size;
                bytemuck::cast_slice_mut::<T, u8>(&mut tmp[..n]).copy_from_slice(chunk);
                f(&tmp[..n]);
            }
        }
    }
}

/// Runs `f` over `bytes` as `&mut [T]`, in place when aligned, else on a copy written back.
fn for_each_block_mut<T: Pod>(bytes: &mut [u8], mut f: impl FnMut(&mut [T])) {
    match bytemuck::try_cast_slice_mut::<u8, T>(bytes) {
        Ok(s) => f(s),
        Err(_) => {
            let size = std::mem::size_of::<T>();
            let mut tmp = [T::zeroed(); BLOCK];
            for chunk in bytes.chunks_mut(BLOCK * size) {
                let n = chunk.len() / size;
                bytemuck::cast_slice_mut::<T, u8>(&mut tmp[..n]).copy_from_slice(chunk);
                f(&mut tmp[..n]);
                chunk.copy_from_slice(bytemuck::cast_slice::<T, u8>(&tmp[..n]));
            }
        }
    }
}

fn float_dtype(dtype: DType, len: usize) -> Result<()> {
    if !dtype.is_float() {
        return Err(Error::InvalidArgument(format!(
            "gradient norms need a floating-point dtype, got {}",
            dtype.name()
        )));
    }
    if !len.is_multiple_of(dtype.size()) {
        return Err(Error::InvalidArgument(format!(
            "{len} bytes is not a whole number of {} elements",
            dtype.name()
        )));
    }
    Ok(())
}

/// The global L2 norm of a set of slices, and whether any element was NaN or ±Inf.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradNorm {
    /// `sqrt(Σ x²)`; NaN or +Inf when `nonfinite`.
    pub norm: f64,
    /// True when some element was NaN or ±Inf.
    pub nonfinite: bool,
}

/// Accumulates `Σ x²` over slices of any float dtype; [`finish`](Self::finish) gives the norm.
///
/// The running total is kept as `scale² × ssq` so that huge f64 gradients do not overflow.
#[derive(Debug, Clone, Copy)]
pub struct NormAccumulator {
    scale: f64,
    ssq: f64,
    nonfinite: bool,
}

impl Default for NormAccumulator {
    fn default() -> Self {
        NormAccumulator {
            scale: 1.0,
            ssq: 0.0,
            nonfinite: false,
        }
    }
}

impl NormAccumulator {
    /// An empty accumulator (norm 0).
    pub fn new() -> NormAccumulator {
        NormAccumulator::default()
    }

    /// Adds `scale² × ssq` to the total.
    fn merge(&mut self, scale: f64, ssq: f64) {
        if !ssq.is_finite() {
            self.nonfinite = true;
            return;
        }
        if scale > self.scale {
            self.ssq = self.ssq * (self.scale / scale).powi(2) + ssq;
            self.scale = scale;
        } else {
            self.ssq += ssq * (scale / self.scale).powi(2);
        }
    }

    /// Adds the squares of an f32 slice.
    pub fn add_f32(&mut self, x: &[f32]) {
        // Squares of f32 in f64 cannot overflow: a non-finite sum means a non-finite input.
        self.merge(1.0, ssq_f32(x));
    }

    /// Adds the squares of an f64 slice.
    pub fn add_f64(&mut self, x: &[f64]) {
        let s = ssq_f64(x);
        if s.is_finite() {
            return self.merge(1.0, s);
        }
        if x.iter().any(|v| !v.is_finite()) {
            self.nonfinite = true;
            return;
        }
        // Overflow of finite values: sum again scaled by the largest magnitude.
        let m = x.iter().fold(0f64, |m, v| m.max(v.abs()));
        let mut acc = 0f64;
        for c in x.chunks(BLOCK) {
            acc += c.iter().map(|v| (v / m) * (v / m)).sum::<f64>();
        }
        self.merge(m, acc);
    }

    /// Adds the squares of an f16 slice.
    pub fn add_f16(&mut self, x: &[f16]) {
        let mut buf = [0f32; BLOCK];
        for c in x.chunks(BLOCK) {
            let b = &mut buf[..c.len()];
            c.convert_to_f32_slice(b);
            self.add_f32(b);
        }
    }

    /// Adds the squares of a bf16 slice.
    pub fn add_bf16(&mut self, x: &[bf16]) {
        let mut buf = [0f32; BLOCK];
        for c in x.chunks(BLOCK) {
            let b = &mut buf[..c.len()];
            c.convert_to_f32_slice(b);
            self.add_f32(b);
        }
    }

    /// Adds the squares of `bytes` read as little-endian elements of `dtype` (any
    /// alignment). Errors on a non-float dtype or a length that is not whole elements.
    pub fn add_bytes(&mut self, dtype: DType, bytes: &[u8]) -> Result<()> {
        float_dtype(dtype, bytes.len())?;
        match dtype {
            DType::F32 => for_each_block::<f32>(bytes, |s| self.add_f32(s)),
            DType::F64 => for_each_block::<f64>(bytes, |s| self.add_f64(s)),
            DType::F16 => for_each_block::<f16>(bytes, |s| self.add_f16(s)),
            DType::BF16 => for_each_block::<bf16>(bytes, |s| self.add_bf16(s)),
            _ => {}
        }
        Ok(())
    }

    /// The norm of everything added so far.
    pub fn finish(&self) -> GradNorm {
        if self.nonfinite {
            return GradNorm {
                norm: f64::NAN,
                nonfinite: true,
            };
        }
        GradNorm {
            norm: self.scale * self.ssq.sqrt(),
            nonfinite: false,
        }
    }
}

/// The global L2 norm of `(dtype, bytes)` slices; see [`NormAccumulator::add_bytes`].
pub fn global_norm<'a>(slices: impl IntoIterator<Item = (DType, &'a [u8])>) -> Result<GradNorm> {
    let mut acc = NormAccumulator::new();
    for (dtype, bytes) in slices {
        acc.add_bytes(dtype, bytes)?;
    }
    Ok(acc.finish())
}

/// Multiplies every element of `bytes` (little-endian `dtype`, any alignment) by `factor` in
/// place. Half types are scaled in f32 and rounded to nearest-even. Errors on a non-float
/// dtype, a length that is not whole elements, or a non-finite factor.
pub fn scale_in_place(dtype: DType, bytes: &mut [u8], factor: f64) -> Result<()> {
    float_dtype(dtype, bytes.len())?;
    if !factor.is_finite() {
        return Err(Error::InvalidArgument(format!(
            "scale factor must be finite, got {factor}"
        )));
    }
    let f32_factor = factor as f32;
    match dtype {
        DType::F32 => {
            for_each_block_mut::<f32>(bytes, |s| s.iter_mut().for_each(|v| *v *= f32_factor))
        }
        DType::F64 => for_each_block_mut::<f64>(bytes, |s| s.iter_mut().for_each(|v| *v *= factor)),
        DType::F16 => for_each_block_mut::<f16>(bytes, |s| {
            let mut buf = [0f32; BLOCK];
            for c in s.chunks_mut(BLOCK) {
                let b = &mut buf[..c.len()];
                c.convert_to_f32_slice(b);
                b.iter_mut().for_each(|v| *v *= f32_factor);
                c.convert_from_f32_slice(b);
            }
        }),
        DType::BF16 => for_each_block_mut::<bf16>(bytes, |s| {
            let mut buf = [0f32; BLOCK];
            for c in s.chunks_mut(BLOCK) {
                let b = &mut buf[..c.len()];
                c.convert_to_f32_slice(b);
                b.iter_mut().for_each(|v| *v *= f32_factor);
                c.convert_from_f32_slice(b);
            }
        }),
        _ => {}
    }
    Ok(())
}

/// What a guard does when it trips.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuardPolicy {
    /// Skip the optimiser update and warn; training goes on.
    Skip,
    /// Fail the step with an error.
    Raise,
}

impl GuardPolicy {
    /// Parses `"skip"` or `"raise"`.
    pub fn from_name(name: &str) -> Result<GuardPolicy> {
        match name {
            "skip" => Ok(GuardPolicy::Skip),
            "raise" => Ok(GuardPolicy::Raise),
            other => Err(Error::InvalidArgument(format!(
                "guard policy must be \"skip\" or \"raise\", got {other:?}"
            ))),
        }
    }
}

/// Parameters of a [`GradientGuard`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GuardConfig {
    /// Norms above this are clipped down to it; positive and finite.
    pub max_norm: f64,
    /// Consecutive clipped or non-finite steps that trip the guard (at least 1; design: 3).
    pub trip_after: u32,
    /// What a trip means.
    pub policy: GuardPolicy,
}

impl GuardConfig {
    /// A configuration with `trip_after = 3` and policy `Skip`; errors unless `max_norm` is
    /// positive and finite.
    pub fn new(max_norm: f64) -> Result<GuardConfig> {
        if !(max_norm.is_finite() && max_norm > 0.0) {
            return Err(Error::InvalidArgument(format!(
                "max_norm must be positive and finite, got {max_norm}"
            )));
        }
        Ok(GuardConfig {
            max_norm,
            trip_after: 3,
            policy: GuardPolicy::Skip,
        })
    }
}

/// The outcome of one step's check.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    /// The norm is at or under `max_norm`: apply the update as is.
    Ok,
    /// The norm is over `max_norm`: scale the gradients by `factor` (< 1), then apply.
    Clipped {
        /// `max_norm / (norm + 1e-6)`.
        factor: f64,
    },
    /// The norm is NaN or infinite: do not apply this update.
    NonFinite,
    /// `consecutive` bad steps in a row (≥ `trip_after`): act on the policy.
    Tripped {
        /// Clipped or non-finite steps in a row, this one included.
        consecutive: u32,
    },
}

impl Verdict {
    /// Whether the optimiser update should be applied (after clipping, for `Clipped`).
    pub fn apply_update(&self) -> bool {
        matches!(self, Verdict::Ok | Verdict::Clipped { .. })
    }
}

/// Checks each step's gradient norm; see the module documentation.
#[derive(Debug, Clone)]
pub struct GradientGuard {
    cfg: GuardConfig,
    bad: u32,
}

impl GradientGuard {
    /// A guard with no bad steps yet. A `trip_after` of 0 is taken as 1.
    pub fn new(mut cfg: GuardConfig) -> GradientGuard {
        cfg.trip_after = cfg.trip_after.max(1);
        GradientGuard { cfg, bad: 0 }
    }

    /// The configuration in force.
    pub fn config(&self) -> &GuardConfig {
        &self.cfg
    }

    /// Bad (clipped or non-finite) steps in a row so far.
    pub fn consecutive_bad(&self) -> u32 {
        self.bad
    }

    /// Judges one step's global norm and updates the count of bad steps.
    pub fn check(&mut self, norm: f64) -> Verdict {
        let verdict = if !norm.is_finite() {
            Verdict::NonFinite
        } else if norm > self.cfg.max_norm {
            Verdict::Clipped {
                factor: self.cfg.max_norm / (norm + CLIP_EPS),
            }
        } else {
            self.bad = 0;
            return Verdict::Ok;
        };
        self.bad = self.bad.saturating_add(1);
        if self.bad >= self.cfg.trip_after {
            Verdict::Tripped {
                consecutive: self.bad,
            }
        } else {
            verdict
        }
    }

    /// Forgets past bad steps.
    pub fn reset(&mut self) {
        self.bad = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(values: &[f64]) -> f64 {
        values.iter().map(|v| v * v).sum::<f64>().sqrt()
    }

    fn bytes<T: Pod>(v: &[T]) -> Vec<u8> {
        bytemuck::cast_slice(v).to_vec()
    }

    fn close(a: f64, b: f64, rel: f64) -> bool {
        (a - b).abs() <= rel * b.abs().max(1e-300)
    }

    fn ramp(n: usize) -> Vec<f64> {
        (0..n)
            .map(|i| ((i * 37 % 101) as f64 - 50.0) / 7.0)
            .collect()
    }

    #[test]
    fn norm_of_many_slices_of_every_dtype_matches_the_reference() {
        let v = ramp(10_007);
        let f32s: Vec<f32> = v.iter().map(|&x| x as f32).collect();
        let f16s: Vec<f16> = v.iter().map(|&x| f16::from_f64(x)).collect();
        let bf16s: Vec<bf16> = v.iter().map(|&x| bf16::from_f64(x)).collect();
        // The reference sums exactly the values each dtype holds.
        let mut all: Vec<f64> = v.clone();
        all.extend(f32s.iter().map(|&x| f64::from(x)));
        all.extend(f16s.iter().map(|x| x.to_f64()));
        all.extend(bf16s.iter().map(|x| x.to_f64()));
        let (b64, b32, b16, bb16) = (bytes(&v), bytes(&f32s), bytes(&f16s), bytes(&bf16s));
        let n = global_norm([
            (DType::F64, &b64[..]),
            (DType::F32, &b32[..]),
            (DType::F16, &b16[..]),
            (DType::BF16, &bb16[..]),
        ])
        .expect("norm");
        assert!(!n.nonfinite);
        assert!(
            close(n.norm, reference(&all), 1e-12),
            "{} vs {}",
            n.norm,
            reference(&all)
        );
    }

    #[test]
    fn unaligned_bytes_give_the_same_norm() {
        let v: Vec<f32> = ramp(3000).iter().map(|&x| x as f32).collect();
        let b = bytes(&v);
        let mut shifted = vec![0u8; b.len() + 1];
        shifted[1..].copy_from_slice(&b);
        let a = global_norm([(DType::F32, &b[..])]).expect("aligned");
        let u = global_norm([(DType::F32, &shifted[1..])]).expect("unaligned");
        assert!(close(a.norm, u.norm, 1e-14), "{} vs {}", a.norm, u.norm);
    }

    #[test]
    fn nan_and_inf_are_detected_in_every_dtype() {
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
                let mut v = ramp(100);
                v[57] = bad;
                let b: Vec<u8> = match dtype {
                    DType::F32 => bytes(&v.iter().map(|&x| x as f32).collect::<Vec<_>>()),
                    DType::F64 => bytes(&v),
                    DType::F16 => bytes(&v.iter().map(|&x| f16::from_f64(x)).collect::<Vec<_>>()),
                    _ => bytes(&v.iter().map(|&x| bf16::from_f64(x)).collect::<Vec<_>>()),
                };
                let ok = bytes(&[1.0f32; 4]);
                let n = global_norm([(DType::F32, &ok[..]), (dtype, &b[..])]).expect("norm");
                assert!(n.nonfinite, "{dtype:?} {bad}");
                assert!(!n.norm.is_finite());
            }
        }
    }

    #[test]
    fn huge_finite_f64_does_not_overflow() {
        let v = [3e200, 4e200, 0.0, -1.0];
        let b = bytes(&v);
        let small = bytes(&[3.0f32, 4.0]);
        let n = global_norm([(DType::F32, &small[..]), (DType::F64, &b[..])]).expect("norm");
        assert!(!n.nonfinite);
        assert!(close(n.norm, 5e200, 1e-12), "{}", n.norm);
        // Scaled total first, then a small slice.
        let n = global_norm([(DType::F64, &b[..]), (DType::F32, &small[..])]).expect("norm");
        assert!(close(n.norm, 5e200, 1e-12), "{}", n.norm);
    }

    #[test]
    fn empty_and_invalid_inputs() {
        assert_eq!(global_norm([]).expect("empty").norm, 0.0);
        assert_eq!(
            global_norm([(DType::F16, &[][..])]).expect("empty").norm,
            0.0
        );
        assert!(global_norm([(DType::I32, &[0u8; 4][..])]).is_err());
        assert!(global_norm([(DType::F32, &[0u8; 5][..])]).is_err());
        assert!(scale_in_place(DType::F32, &mut [0u8; 4], f64::NAN).is_err());
        assert!(scale_in_place(DType::U8, &mut [0u8; 4], 0.5).is_err());
    }

    #[test]
    fn scaling_in_place_matches_the_reference_and_rounds_halves_to_nearest() {
        let v = ramp(2500);
        let mut b = bytes(&v.iter().map(|&x| x as f32).collect::<Vec<_>>());
        scale_in_place(DType::F32, &mut b, 0.25).expect("scale");
        for (got, want) in bytemuck::cast_slice::<u8, f32>(&b).iter().zip(&v) {
            assert_eq!(*got, (*want as f32) * 0.25);
        }
        let mut b = bytes(&v);
        scale_in_place(DType::F64, &mut b[..], 0.3).expect("scale");
        for (got, want) in bytemuck::cast_slice::<u8, f64>(&b).iter().zip(&v) {
            assert_eq!(*got, want * 0.3);
        }
        let h: Vec<bf16> = v.iter().map(|&x| bf16::from_f64(x)).collect();
        let mut b = bytes(&h);
        scale_in_place(DType::BF16, &mut b, 0.3).expect("scale");
        for (got, want) in bytemuck::cast_slice::<u8, bf16>(&b).iter().zip(&h) {
            assert_eq!(*got, bf16::from_f32(want.to_f32() * 0.3f32));
        }
        let h: Vec<f16> = v.iter().map(|&x| f16::from_f64(x)).collect();
        let mut b = vec![0u8; h.len() * 2 + 1];
        b[1..].copy_from_slice(bytemuck::cast_slice(&h));
        scale_in_place(DType::F16, &mut b[1..], 0.3).expect("scale unaligned");
        let got: Vec<f16> = b[1..]
            .chunks(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]))
            .collect();
        for (got, want) in got.iter().zip(&h) {
            assert_eq!(*got, f16::from_f32(want.to_f32() * 0.3f32));
        }
    }

    #[test]
    fn clipping_brings_the_norm_to_max_norm() {
        let v: Vec<f32> = ramp(1000).iter().map(|&x| x as f32).collect();
        let mut b = bytes(&v);
        let norm = global_norm([(DType::F32, &b[..])]).expect("norm").norm;
        let mut g = GradientGuard::new(GuardConfig::new(1.0).expect("cfg"));
        let Verdict::Clipped { factor } = g.check(norm) else {
            panic!("norm {norm} should be clipped");
        };
        scale_in_place(DType::F32, &mut b, factor).expect("scale");
        let after = global_norm([(DType::F32, &b[..])]).expect("norm").norm;
        assert!(close(after, 1.0, 1e-5), "{after}");
    }

    #[test]
    fn trips_after_three_consecutive_bad_steps_and_resets_after_a_good_one() {
        let mut g = GradientGuard::new(GuardConfig::new(1.0).expect("cfg"));
        assert_eq!(g.check(0.5), Verdict::Ok);
        assert!(matches!(g.check(2.0), Verdict::Clipped { .. }));
        assert_eq!(g.check(f64::NAN), Verdict::NonFinite);
        assert_eq!(g.check(3.0), Verdict::Tripped { consecutive: 3 });
        assert_eq!(g.check(f64::INFINITY), Verdict::Tripped { consecutive: 4 });
        assert_eq!(g.check(1.0), Verdict::Ok, "exactly max_norm is fine");
        assert_eq!(g.consecutive_bad(), 0);
        assert!(matches!(g.check(2.0), Verdict::Clipped { .. }));
        assert!(matches!(g.check(2.0), Verdict::Clipped { .. }));
        g.reset();
        assert!(matches!(g.check(2.0), Verdict::Clipped { .. }));
    }

    #[test]
    fn verdicts_say_whether_to_apply_the_update() {
        assert!(Verdict::Ok.apply_update());
        assert!(Verdict::Clipped { factor: 0.5 }.apply_update());
        assert!(!Verdict::NonFinite.apply_update());
        assert!(!Verdict::Tripped { consecutive: 3 }.apply_update());
    }

    #[test]
    fn config_validation_and_policy_names() {
        assert!(GuardConfig::new(0.0).is_err());
        assert!(GuardConfig::new(f64::NAN).is_err());
        assert!(GuardConfig::new(-1.0).is_err());
        assert_eq!(
            GuardPolicy::from_name("skip").expect("skip"),
            GuardPolicy::Skip
        );
        assert_eq!(
            GuardPolicy::from_name("raise").expect("raise"),
            GuardPolicy::Raise
        );
        assert!(GuardPolicy::from_name("ignore").is_err());
        let mut g = GradientGuard::new(GuardConfig {
            trip_after: 0,
            ..GuardConfig::new(1.0).expect("cfg")
        });
        assert_eq!(g.check(5.0), Verdict::Tripped { consecutive: 1 });
    }
}
