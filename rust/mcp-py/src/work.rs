//! A handle on an operation running on the runtime: `wait()`, `is_completed()`, callbacks.

use crate::errors::to_py;
use crate::group::ABANDON_WAIT;
use crate::runtime::SIGNAL_POLL;
use mcp_core::transport::quic::QuicTransport;
use mcp_core::{Error, WeakGroup};
use pyo3::prelude::*;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Where a running operation leaves its result.
#[derive(Default)]
pub struct WorkState {
    result: Mutex<Option<Result<(), Error>>>,
    done: Condvar,
}

impl WorkState {
    /// Records the result and wakes every waiter.
    pub fn complete(&self, r: Result<(), Error>) {
        let mut g = self.result.lock().unwrap_or_else(|p| p.into_inner());
        *g = Some(r);
        self.done.notify_all();
    }

    /// Blocks (without the GIL) until done or `timeout`; the result if done.
    fn wait(&self, timeout: Option<Duration>) -> Option<Result<(), Error>> {
        let until = timeout.map(|t| Instant::now() + t);
        let mut g = self.result.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(r) = g.as_ref() {
                return Some(r.clone());
            }
            g = match until {
                None => self.done.wait(g).unwrap_or_else(|p| p.into_inner()),
                Some(u) => {
                    let left = u.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return None;
                    }
                    self.done
                        .wait_timeout(g, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
    }
}

/// A handle on an asynchronous operation (what `async_op=True` returns).
#[pyclass(module = "mcp_fast._core", frozen)]
pub struct Work {
    pub(crate) state: Arc<WorkState>,
    pub(crate) op: &'static str,
    /// For a receive from any source: the rank it came from, once known.
    pub(crate) source: Option<Arc<std::sync::atomic::AtomicUsize>>,
    /// The group to abort if a signal handler raises while `wait()` waits (see
    /// `ProcessGroup::abandon`); weak, so that a kept handle does not keep the group open.
    pub(crate) abort_on_signal: Option<WeakGroup<QuicTransport>>,
}

impl Work {
    /// Waits up to `timeout` (None: until done) without the GIL, coming back to Python every
    /// [`SIGNAL_POLL`] to run signal handlers. If one raises (Ctrl-C), the group is aborted,
    /// as for a synchronous call, and its exception is returned.
    fn wait_or_signal(
        &self,
        py: Python<'_>,
        timeout: Option<Duration>,
    ) -> PyResult<Option<Result<(), Error>>> {
        let until = timeout.map(|t| Instant::now() + t);
        loop {
            let slice = until.map_or(SIGNAL_POLL, |u| {
                SIGNAL_POLL.min(u.saturating_duration_since(Instant::now()))
            });
            let state = self.state.clone();
            if let Some(r) = py.detach(move || state.wait(Some(slice))) {
                return Ok(Some(r));
            }
            if until.is_some_and(|u| Instant::now() >= u) {
                return Ok(None);
            }
            if let Err(interrupt) = py.check_signals() {
                if let Some(g) = self.abort_on_signal.as_ref().and_then(WeakGroup::upgrade) {
                    crate::group::abort_for(py, &g, &interrupt);
                    let state = self.state.clone();
                    py.detach(move || state.wait(Some(ABANDON_WAIT)));
                }
                return Err(interrupt);
            }
        }
    }
}

#[pymethods]
impl Work {
    /// Blocks until the operation finishes and raises its error if it failed. With
    /// `timeout` (seconds), raises `MCPTimeoutError` if it is still running by then.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let t = match timeout {
            Some(s) if !(s >= 0.0 && s.is_finite()) => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "timeout must be a non-negative number of seconds, got {s}"
                )))
            }
            Some(s) => Some(Duration::from_secs_f64(s)),
            None => None,
        };
        let result = self.wait_or_signal(py, t);
        crate::tensor_arg::release_pending(py);
        let result = result?;
        match result {
            Some(Ok(())) => Ok(true),
            Some(Err(e)) => Err(to_py(py, e)),
            None => Err(to_py(
                py,
                Error::Timeout {
                    what: format!("{} is still running", self.op),
                    after: t.unwrap_or_default(),
                },
            )),
        }
    }

    /// True once the operation has finished, successfully or not.
    fn is_completed(&self) -> bool {
        self.state
            .result
            .lock()
            .map(|g| g.is_some())
            .unwrap_or(true)
    }

    /// True once the operation has finished successfully.
    fn is_success(&self) -> bool {
        self.state
            .result
            .lock()
            .map(|g| matches!(*g, Some(Ok(()))))
            .unwrap_or(false)
    }

    /// The error of a failed operation (as the exception it would raise), else None.
    fn exception(&self, py: Python<'_>) -> Option<PyErr> {
        let g = self.state.result.lock().ok()?;
        match g.as_ref() {
            Some(Err(e)) => Some(to_py(py, e.clone())),
            _ => None,
        }
    }

    /// The rank a receive came from (for `recv` without a source), else None.
    fn source_rank(&self) -> Option<usize> {
        let s = self
            .source
            .as_ref()?
            .load(std::sync::atomic::Ordering::Acquire);
        (s != usize::MAX).then_some(s)
    }

    fn __repr__(&self) -> String {
        format!(
            "<mcp_fast Work {} completed={}>",
            self.op,
            self.is_completed()
        )
    }
}
