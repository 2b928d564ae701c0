//! The transport config: a Python dict (as `mcp_fast.settings` read it from the caller or
//! from `MCP_CONFIG`) converted to the core's values; the core checks every key.

use mcp_core::config::{ConfigValue, TransportSettings};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyInt, PyString};

fn value(v: &Bound<'_, PyAny>) -> ConfigValue {
    if v.is_instance_of::<PyBool>() {
        return ConfigValue::Other("bool".into());
    }
    if v.is_instance_of::<PyInt>() {
        if let Ok(n) = v.extract::<i64>() {
            return ConfigValue::Int(n);
        }
    }
    if v.is_instance_of::<PyString>() {
        if let Ok(s) = v.extract::<String>() {
            return ConfigValue::Str(s);
        }
    }
    let ty = v
        .get_type()
        .name()
        .map_or_else(|_| "unknown".to_string(), |n| n.to_string());
    ConfigValue::Other(ty)
}

/// The checked settings of `config` (none: the defaults). A key that is not a string, an
/// unknown key or a bad value is a `ValueError` naming it.
pub(crate) fn settings(config: Option<&Bound<'_, PyDict>>) -> PyResult<TransportSettings> {
    let Some(d) = config else {
        return Ok(TransportSettings::default());
    };
    let mut pairs = Vec::with_capacity(d.len());
    for (k, v) in d.iter() {
        let key: String = k.extract().map_err(|_| {
            PyValueError::new_err(format!("transport config keys must be strings, got {k}"))
        })?;
        pairs.push((key, value(&v)));
    }
    TransportSettings::parse(pairs.iter().map(|(k, v)| (k.as_str(), v)))
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// Checks a transport config and a model spec (either may be `None`) as a group, a parameter
/// server or a worker would on starting, without starting anything: every rank can refuse
/// a bad file itself before it waits for the others (the torch backend's rank 0 hosts the
/// store the other ranks wait on, and would take it down with it).
#[pyfunction]
#[pyo3(signature = (config=None, model_spec=None))]
pub(crate) fn check_settings(
    config: Option<&Bound<'_, PyDict>>,
    model_spec: Option<&Bound<'_, PyDict>>,
) -> PyResult<()> {
    settings(config)?;
    crate::model_decl::canonical(model_spec)?;
    Ok(())
}
