//! The Python module `mcp_fast._core`: a thin PyO3 binding of `mcp-core`.

use pyo3::prelude::*;

mod delta;

/// The native module `mcp_fast._core`.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    delta::register(m)
}
