//! Python binding of the gradient-norm guard (`mcp_core::health::guard`).
//!
//! Tensors cross the boundary as [`TensorArg`]s (the buffer protocol); the GIL is released
//! while the core reads or scales them. Bad arguments raise `ValueError` or `TypeError`.

use crate::tensor_arg::{Access, TensorArg};
use mcp_core::health::guard::{self, GradientGuard, GuardConfig, NormAccumulator, Verdict};
use mcp_core::Error;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

fn value_error(e: Error) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// The global L2 norm of every buffer, accumulated in float64, and whether any element was
/// NaN or ±Inf (the norm is then NaN).
#[pyfunction]
fn grad_norm(py: Python<'_>, buffers: Vec<Bound<'_, PyAny>>) -> PyResult<(f64, bool)> {
    let args = buffers
        .iter()
        .map(|b| TensorArg::extract(b, Access::Read))
        .collect::<PyResult<Vec<_>>>()?;
    let norm = py.detach(|| {
        let mut acc = NormAccumulator::new();
        for a in &args {
            acc.add_bytes(a.dtype, a.bytes())?;
        }
        Ok::<_, Error>(acc.finish())
    });
    let norm = norm.map_err(value_error)?;
    Ok((norm.norm, norm.nonfinite))
}

/// Multiplies every element of `x` by `factor`, in place.
#[pyfunction]
#[pyo3(name = "scale_")]
fn scale(py: Python<'_>, x: &Bound<'_, PyAny>, factor: f64) -> PyResult<()> {
    let mut x = TensorArg::extract(x, Access::Write)?;
    let dtype = x.dtype;
    py.detach(|| guard::scale_in_place(dtype, x.bytes_mut(), factor))
        .map_err(value_error)
}

/// The guard's state machine: counts consecutive clipped or non-finite steps and trips.
#[pyclass(module = "mcp_fast._core")]
pub struct GuardState {
    guard: GradientGuard,
}

#[pymethods]
impl GuardState {
    /// A guard clipping above `max_norm` (positive, finite) that trips after `trip_after`
    /// bad steps in a row.
    #[new]
    #[pyo3(signature = (max_norm, trip_after=3))]
    fn new(max_norm: f64, trip_after: u32) -> PyResult<Self> {
        if trip_after == 0 {
            return Err(PyValueError::new_err("trip_after must be at least 1"));
        }
        let cfg = GuardConfig {
            trip_after,
            ..GuardConfig::new(max_norm).map_err(value_error)?
        };
        Ok(GuardState {
            guard: GradientGuard::new(cfg),
        })
    }

    /// Judges one step's norm: `(verdict, factor, consecutive_bad)` where verdict is one of
    /// "ok", "clipped", "nonfinite", "tripped" and factor is the clip factor (1.0 unless
    /// clipped).
    fn check(&mut self, norm: f64) -> (&'static str, f64, u32) {
        let v = self.guard.check(norm);
        let bad = self.guard.consecutive_bad();
        match v {
            Verdict::Ok => ("ok", 1.0, bad),
            Verdict::Clipped { factor } => ("clipped", factor, bad),
            Verdict::NonFinite => ("nonfinite", 1.0, bad),
            Verdict::Tripped { consecutive } => ("tripped", 1.0, consecutive),
        }
    }

    /// Bad steps in a row so far.
    #[getter]
    fn consecutive_bad(&self) -> u32 {
        self.guard.consecutive_bad()
    }

    /// Forgets past bad steps.
    fn reset(&mut self) {
        self.guard.reset();
    }
}

/// Adds the guard's functions and class to the `_core` module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(grad_norm, m)?)?;
    m.add_function(wrap_pyfunction!(scale, m)?)?;
    m.add_class::<GuardState>()?;
    Ok(())
}
