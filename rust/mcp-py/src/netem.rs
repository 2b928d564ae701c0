//! The WAN emulator's entry point for `mcp-chaos --hosts 2`: forward between two TUNs.

use crate::errors::to_py;
use mcp_core::netem::{forward, seconds, LinkParams, LinkStats};
use pyo3::prelude::*;
use pyo3::types::PyDict;

fn stats<'py>(py: Python<'py>, s: &LinkStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("delivered", s.delivered)?;
    d.set_item("delivered_bytes", s.delivered_bytes)?;
    d.set_item("lost", s.lost)?;
    d.set_item("overflow", s.overflow)?;
    Ok(d)
}

/// Forwards IP packets between TUN descriptors `fd_a` and `fd_b` (`IFF_TUN | IFF_NO_PI`)
/// with `delay_s` one way, `jitter_s`, drop probability `loss` and a rate cap of `rate_bit_s`
/// bits per second (None: no cap), each direction on its own, until `stop_fd` is readable.
/// Releases the GIL; returns per-direction counters.
#[pyfunction]
#[pyo3(signature = (
    fd_a, fd_b, stop_fd, *, delay_s=0.0, jitter_s=0.0, loss=0.0, rate_bit_s=None,
    queue_s=0.05, seed=0
))]
#[allow(clippy::too_many_arguments)]
pub fn netem_forward<'py>(
    py: Python<'py>,
    fd_a: i32,
    fd_b: i32,
    stop_fd: i32,
    delay_s: f64,
    jitter_s: f64,
    loss: f64,
    rate_bit_s: Option<f64>,
    queue_s: f64,
    seed: u64,
) -> PyResult<Bound<'py, PyDict>> {
    let params = (|| {
        Ok(LinkParams {
            delay: seconds("delay_s", delay_s)?,
            jitter: seconds("jitter_s", jitter_s)?,
            loss,
            rate: rate_bit_s.map(|r| r / 8.0),
            queue_limit: seconds("queue_s", queue_s)?,
            seed,
        })
    })()
    .map_err(|e| to_py(py, e))?;
    let back = LinkParams {
        seed: seed ^ 0x9e37_79b9_7f4a_7c15,
        ..params.clone()
    };
    let s = py
        .detach(move || forward(fd_a, fd_b, stop_fd, params, back))
        .map_err(|e| to_py(py, e))?;
    let d = PyDict::new(py);
    d.set_item("a_to_b", stats(py, &s.a_to_b)?)?;
    d.set_item("b_to_a", stats(py, &s.b_to_a)?)?;
    d.set_item("write_drops", s.write_drops)?;
    Ok(d)
}
