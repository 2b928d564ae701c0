//! Maps each core error to one Python exception of `mcp_fast.errors` (or a built-in one for
//! bad arguments), so that Python code can catch what went wrong by type.

use mcp_core::Error;
use pyo3::exceptions::{PyKeyError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

fn exception(py: Python<'_>, name: &str, msg: String, kwargs: Option<Bound<'_, PyDict>>) -> PyErr {
    let made = (|| -> PyResult<PyErr> {
        let cls = py.import("mcp_fast.errors")?.getattr(name)?;
        let obj = cls.call((msg.clone(),), kwargs.as_ref())?;
        Ok(PyErr::from_value(obj))
    })();
    made.unwrap_or_else(|_| PyRuntimeError::new_err(msg))
}

/// A plain `mcp_fast.MCPError` with `msg`.
pub fn mcp_error(py: Python<'_>, msg: String) -> PyErr {
    exception(py, "MCPError", msg, None)
}

/// The Python exception for a core error.
pub fn to_py(py: Python<'_>, e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::SpecMismatch(_) => exception(py, "SpecMismatchError", msg, None),
        Error::PeerLost { rank, op, .. } => {
            let kw = PyDict::new(py);
            let _ = kw.set_item("rank", rank);
            let _ = kw.set_item("op", op);
            exception(py, "PeerLostError", msg, Some(kw))
        }
        Error::PeerStalled { rank, op, .. } => {
            let kw = PyDict::new(py);
            let _ = kw.set_item("rank", rank);
            let _ = kw.set_item("op", op);
            exception(py, "PeerStalledError", msg, Some(kw))
        }
        Error::Timeout { .. } => exception(py, "MCPTimeoutError", msg, None),
        Error::Authentication { .. } => exception(py, "AuthenticationError", msg, None),
        Error::VersionMismatch { .. } => exception(py, "VersionMismatchError", msg, None),
        Error::InvalidArgument(m) => PyValueError::new_err(m),
        Error::WrongDType(m) => PyTypeError::new_err(m),
        Error::UnknownName(m) => PyKeyError::new_err(m),
        Error::Protocol(_) | Error::Damaged(_) => exception(py, "ProtocolError", msg, None),
        Error::Closed(_) => exception(py, "GroupClosedError", msg, None),
        Error::Superseded(_) => exception(py, "SupersededError", msg, None),
        Error::Io(_) => exception(py, "MCPError", msg, None),
    }
}
