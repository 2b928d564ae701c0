//! Python binding of the gradient-norm guard (`mcp_core::health::guard`).
//!
//! Tensors cross the boundary as `(address, nbytes, dtype)` triples made by
//! `mcp_fast._buffers.view`, which checks that each is a live, C-contiguous CPU array; the
//! GIL is released while the core reads or scales them. Bad arguments raise `ValueError`.

use mcp_core::health::guard::{self, GradientGuard, GuardConfig, NormAccumulator, Verdict};
use mcp_core::{DType, Error};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

fn value_error(e: Error) -> PyErr {
    PyValueError::new_err(e.to_string())
}

fn parse(ptr: usize, nbytes: usize, dtype: &str) -> PyResult<DType> {
    let dtype = DType::from_name(dtype).map_err(value_error)?;
    if nbytes > 0 && ptr == 0 {
        return Err(PyValueError::new_err("null buffer address"));
    }
    Ok(dtype)
}

/// The global L2 norm of every `(ptr, nbytes, dtype)` buffer, accumulated in float64, and
/// whether any element was NaN or ±Inf (the norm is then NaN).
#[pyfunction]
fn grad_norm(py: Python<'_>, buffers: Vec<(usize, usize, String)>) -> PyResult<(f64, bool)> {
    let mut slices = Vec::with_capacity(buffers.len());
    for (ptr, nbytes, dtype) in &buffers {
        let dtype = parse(*ptr, *nbytes, dtype)?;
        let bytes: &[u8] = if *nbytes == 0 {
            &[]
        } else {
            // SAFETY: the Python wrapper (mcp_fast.guards) passes live, C-contiguous arrays of
            // `nbytes` bytes from `_buffers.view` and keeps them referenced during this call.
            unsafe { std::slice::from_raw_parts(*ptr as *const u8, *nbytes) }
        };
        slices.push((dtype, bytes));
    }
    let norm = py.detach(|| {
        let mut acc = NormAccumulator::new();
        for (dtype, bytes) in slices {
            acc.add_bytes(dtype, bytes)?;
        }
        Ok::<_, Error>(acc.finish())
    });
    let norm = norm.map_err(value_error)?;
    Ok((norm.norm, norm.nonfinite))
}

/// Multiplies the `nbytes` bytes of `dtype` elements at `ptr` by `factor`, in place.
#[pyfunction]
#[pyo3(name = "scale_")]
fn scale(py: Python<'_>, ptr: usize, nbytes: usize, dtype: &str, factor: f64) -> PyResult<()> {
    let dtype = parse(ptr, nbytes, dtype)?;
    if nbytes == 0 {
        return guard::scale_in_place(dtype, &mut [], factor).map_err(value_error);
    }
    // SAFETY: the Python wrapper passes a live, writable, C-contiguous array of `nbytes`
    // bytes (checked by `_buffers.view(..., writable=True)`) and holds it during this call.
    let bytes = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, nbytes) };
    py.detach(|| guard::scale_in_place(dtype, bytes, factor))
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
