//! The model a rank declares (`model_spec=` of `mcp.init`): a Python dict converted to the
//! core's values; the core checks every key and value.

use mcp_core::model_decl::{DeclValue, ModelDecl};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

fn type_name(v: &Bound<'_, PyAny>) -> String {
    v.get_type()
        .name()
        .map_or_else(|_| "unknown".to_string(), |n| n.to_string())
}

/// The strings of a list or tuple; `None` when it is not one or holds something else.
fn strings(v: &Bound<'_, PyAny>) -> Option<Vec<String>> {
    if !(v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>()) {
        return None;
    }
    v.try_iter()
        .ok()?
        .map(|x| x.ok()?.extract::<String>().ok())
        .collect()
}

fn value(v: &Bound<'_, PyAny>) -> DeclValue {
    if v.is_instance_of::<PyString>() {
        if let Ok(s) = v.extract::<String>() {
            return DeclValue::Text(s);
        }
    }
    if let Some(list) = strings(v) {
        return DeclValue::List(list);
    }
    if let Ok(d) = v.cast::<PyDict>() {
        let mut groups = Vec::with_capacity(d.len());
        for (k, x) in d.iter() {
            match (k.extract::<String>(), strings(&x)) {
                (Ok(k), Some(list)) => groups.push((k, list)),
                _ => {
                    return DeclValue::Other("a table whose values are not lists of strings".into())
                }
            }
        }
        return DeclValue::Groups(groups);
    }
    DeclValue::Other(type_name(v))
}

/// The canonical text of the declaration `spec` (none: `None`). A key that is not a string,
/// an unknown key or a bad value is a `ValueError` naming it.
pub(crate) fn canonical(spec: Option<&Bound<'_, PyDict>>) -> PyResult<Option<String>> {
    let Some(d) = spec else {
        return Ok(None);
    };
    let mut pairs = Vec::with_capacity(d.len());
    for (k, v) in d.iter() {
        let key: String = k.extract().map_err(|_| {
            PyValueError::new_err(format!("model_spec keys must be strings, got {k}"))
        })?;
        pairs.push((key, value(&v)));
    }
    ModelDecl::from_table(pairs)
        .map(|m| Some(m.canonical()))
        .map_err(|e| PyValueError::new_err(e.to_string()))
}
