//! `mcp_fast._core`: the thin PyO3 binding of mcp-core. It converts arguments, releases the
//! GIL for every operation, and maps core errors to Python exceptions; nothing else.

mod config;
mod delta;
mod elastic;
mod errors;
mod group;
mod health;
mod model_decl;
mod netem;
mod ps;
mod runtime;
mod sim;
mod tensor_arg;
mod work;

use pyo3::prelude::*;

/// The extension module.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<group::ProcessGroup>()?;
    m.add_class::<work::Work>()?;
    m.add_function(wrap_pyfunction!(group::reduce_into, m)?)?;
    m.add_function(wrap_pyfunction!(group::codec_round_trip, m)?)?;
    m.add_function(wrap_pyfunction!(sim::sim_all_reduce, m)?)?;
    m.add_function(wrap_pyfunction!(sim::sim_rendezvous, m)?)?;
    m.add_function(wrap_pyfunction!(sim::sim_membership_change, m)?)?;
    m.add_function(wrap_pyfunction!(netem::netem_forward, m)?)?;
    m.add_function(wrap_pyfunction!(config::check_settings, m)?)?;
    delta::register(m)?;
    elastic::register(m)?;
    health::register(m)?;
    ps::register(m)?;
    m.add("PROTOCOL_MAJOR", mcp_core::wire::PROTOCOL_MAJOR)?;
    m.add("PROTOCOL_MINOR", mcp_core::wire::PROTOCOL_MINOR)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
