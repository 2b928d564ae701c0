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

/// The runtime's worker threads: `MCP_THREADS`, else one where this rank has at most two
/// cores to itself (the cores this process may use over the ranks on its host, torchrun's
/// `LOCAL_WORLD_SIZE`, one when unset), else two. With two ranks on two cores, one worker
/// each spent a quarter less processor time per 4 KiB all-reduce than two and was as fast
/// or faster from 4 KiB to 64 MiB (docs/benchmarks.md): a second worker there only adds
/// wake-ups between threads that share the same cores.
fn worker_threads() -> Result<usize, String> {
    if let Ok(v) = std::env::var("MCP_THREADS") {
        return match v.trim().parse::<usize>() {
            Ok(n) if (1..=256).contains(&n) => Ok(n),
            _ => Err(format!(
                "MCP_THREADS={v:?} is not a thread count: set it to an integer from 1 to 256, \
                 or unset it to size the runtime from the cores and LOCAL_WORLD_SIZE"
            )),
        };
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let local_ranks = std::env::var("LOCAL_WORLD_SIZE")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n >= 1)
        .unwrap_or(1);
    Ok(threads_for(cores, local_ranks))
}

/// One worker when a rank has at most two cores, else two.
fn threads_for(cores: usize, local_ranks: usize) -> usize {
    if cores <= 2 * local_ranks {
        1
    } else {
        2
    }
}
