//! The one tokio runtime of the process, made on first use and refused in a forked child.

use crate::errors::mcp_error;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

/// How often a thread blocked in the core comes back to Python to run the handlers of
/// signals that arrived meanwhile. Python runs them only on the main thread and only when
/// it gets there: without this, Ctrl-C during a collective that waits for a dead peer
/// would do nothing until the collective's timeout, minutes later.
pub const SIGNAL_POLL: Duration = Duration::from_millis(50);

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

/// Drives `fut` on the calling thread without the GIL until it finishes, returning to
/// Python every [`SIGNAL_POLL`] to run pending signal handlers (with the GIL and outside
/// the runtime, so that a handler may itself call mcp_fast). `Err` is the exception a
/// handler raised (Ctrl-C's `KeyboardInterrupt`); `fut` has then not finished, and the
/// caller decides how to stop it.
pub fn block_on_or_signal<F>(
    py: Python<'_>,
    rt: &tokio::runtime::Runtime,
    mut fut: Pin<&mut F>,
) -> PyResult<F::Output>
where
    F: Future + Send + ?Sized,
    F::Output: Send,
{
    loop {
        let slice = py.detach(|| {
            rt.block_on(async { tokio::time::timeout(SIGNAL_POLL, fut.as_mut()).await })
        });
        match slice {
            Ok(out) => return Ok(out),
            Err(_still_running) => py.check_signals()?,
        }
    }
}
