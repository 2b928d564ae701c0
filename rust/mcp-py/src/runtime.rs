//! The one tokio runtime of the process, made on first use and refused in a forked child.

use crate::errors::mcp_error;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

struct Rt {
    rt: tokio::runtime::Runtime,
    pid: u32,
}

static RUNTIME: PyOnceLock<Rt> = PyOnceLock::new();

/// The process's runtime. Its worker threads carry the network and the reductions while
/// Python threads wait with the GIL released.
pub fn runtime(py: Python<'_>) -> PyResult<&'static tokio::runtime::Runtime> {
    let rt = RUNTIME.get_or_try_init(py, || {
        let threads = worker_threads().map_err(|e| mcp_error(py, e))?;
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("mcp-worker")
            .enable_all()
            .build()
            .map(|rt| Rt {
                rt,
                pid: std::process::id(),
            })
            .map_err(|e| mcp_error(py, format!("cannot start the mcp_fast runtime: {e}")))
    })?;
    if rt.pid != std::process::id() {
        return Err(mcp_error(
            py,
            "mcp_fast was initialised in a parent process and cannot be used after fork(); \
             create groups in the child (use the 'spawn' start method or torchrun)"
                .to_string(),
        ));
    }
    Ok(&rt.rt)
}

/// The runtime's worker threads: `MCP_THREADS`, checked in the core.
fn worker_threads() -> Result<usize, String> {
    mcp_core::config::worker_threads(std::env::var("MCP_THREADS").ok().as_deref())
}
