//! The parameter server's Python face: `PsServer` and `PsWorker`. Tensors arrive as
//! (name, buffer) pairs, checked by the core against the registered tensors and exported
//! while the call runs; the GIL is released for the whole operation.

use crate::errors::to_py;
use crate::runtime::{block_on_or_signal, runtime};
use crate::tensor_arg::{Access, TensorArg};
use mcp_core::ps::optim::OptState;
use mcp_core::ps::store::{Piece, PieceId};
use mcp_core::ps::{self, Aggregate, ClientConfig, Optimizer, ServerConfig};
use mcp_core::transport::quic::chaos::ChaosConfig;
use mcp_core::wire::Codec;
use mcp_core::RawBuf;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

fn seconds(name: &str, s: f64) -> PyResult<Duration> {
    if s > 0.0 && s.is_finite() {
        Ok(Duration::from_secs_f64(s))
    } else {
        Err(PyValueError::new_err(format!(
            "{name} must be a positive number of seconds, got {s}"
        )))
    }
}

fn addr(s: &str) -> PyResult<SocketAddr> {
    let addrs: Vec<SocketAddr> = s
        .to_socket_addrs()
        .map_err(|e| PyValueError::new_err(format!("cannot resolve {s:?} (host:port): {e}")))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or_else(|| addrs.first())
        .copied()
        .ok_or_else(|| PyValueError::new_err(format!("{s:?} resolves to nothing")))
}

fn chaos(spec: Option<&str>) -> PyResult<Option<ChaosConfig>> {
    spec.map(|s| {
        ChaosConfig::parse(s).map_err(|e| PyValueError::new_err(format!("chaos {s:?}: {e}")))
    })
    .transpose()
}

/// Named buffers as the client takes them.
type Named = Vec<(String, RawBuf)>;

/// Named tensors, checked by the core against the registered ones (`what` names the
/// argument) and exported for the duration of a call: keep the returned args alive until
/// the call that uses the buffers has returned.
fn bufs(
    client: &ps::PsClient,
    items: Vec<(String, Bound<'_, PyAny>)>,
    access: Access,
    what: &str,
) -> PyResult<(Vec<TensorArg>, Named)> {
    let mut args = Vec::with_capacity(items.len());
    let mut raw = Vec::with_capacity(items.len());
    for (k, obj) in items {
        let a = TensorArg::extract(&obj, access)?;
        client
            .check(&k, a.dtype, a.len(), what)
            .map_err(|e| to_py(obj.py(), e))?;
        raw.push((k, a.raw()));
        args.push(a);
    }
    Ok((args, raw))
}

fn pieces_of(pieces: Vec<PieceTuple>) -> PyResult<Vec<(PieceId, Piece)>> {
    let mut out = Vec::with_capacity(pieces.len());
    for (key, off, params, bufs, (t, b1_pow, b2_pow), updates) in pieces {
        let what = format!("{key}[{off}..]");
        let params = floats(&params, &what)?;
        let get = |n: &str| -> PyResult<Vec<f32>> {
            bufs.get(n)
                .map(|b| floats(b, &what))
                .transpose()
                .map(|v| v.unwrap_or_default())
        };
        let state = if bufs.contains_key("m") {
            OptState::Adam {
                m: get("m")?,
                v: get("v")?,
                state: ps::adam::AdamState { t, b1_pow, b2_pow },
            }
        } else {
            OptState::Sgd {
                momentum: get("momentum")?,
            }
        };
        out.push((
            (key, off),
            Piece {
                params,
                state,
                updates,
            },
        ));
    }
    Ok(out)
}

/// One parameter server.
#[pyclass(module = "mcp_fast._core", frozen)]
pub struct PsServer {
    inner: ps::PsServer,
}

/// A checkpointed piece: (key, offset, params, {buffer: bytes}, (t, b1_pow, b2_pow), updates).
type PieceTuple = (
    String,
    u64,
    Vec<u8>,
    HashMap<String, Vec<u8>>,
    (u64, f64, f64),
    u64,
);

fn floats(b: &[u8], what: &str) -> PyResult<Vec<f32>> {
    if !b.len().is_multiple_of(4) {
        return Err(PyValueError::new_err(format!(
            "{what}: {} bytes is not a whole number of float32",
            b.len()
        )));
    }
    Ok(b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

#[pymethods]
impl PsServer {
    /// Binds `bind` ("host:port") and starts serving.
    #[new]
    #[pyo3(signature = (bind, secret, optimizer="sgd", lr=0.01, momentum=0.9, weight_decay=0.0,
                        nesterov=false, betas=(0.9, 0.999), eps=1e-8, aggregate="mean",
                        staleness=3, num_workers=1, dead_after=5.0, register_timeout=300.0,
                        chaos=None, restore=None, config=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        bind: &str,
        secret: Vec<u8>,
        optimizer: &str,
        lr: f64,
        momentum: f64,
        weight_decay: f64,
        nesterov: bool,
        betas: (f64, f64),
        eps: f64,
        aggregate: &str,
        staleness: u64,
        num_workers: usize,
        dead_after: f64,
        register_timeout: f64,
        chaos: Option<&str>,
        restore: Option<(u64, Vec<PieceTuple>, Vec<u32>)>,
        config: Option<&Bound<'_, pyo3::types::PyDict>>,
    ) -> PyResult<PsServer> {
        let transport = crate::config::settings(config)?;
        let restore = restore
            .map(|(applied, pieces, workers)| pieces_of(pieces).map(|p| (applied, p, workers)))
            .transpose()?;
        let opt = Optimizer::from_name(optimizer, lr, momentum, weight_decay, nesterov, betas, eps)
            .map_err(|e| to_py(py, e))?;
        let aggregate = match aggregate {
            "mean" => Aggregate::Mean,
            "sum" => Aggregate::Sum,
            other => {
                return Err(PyValueError::new_err(format!(
                    "aggregate must be 'mean' or 'sum', got {other:?}"
                )))
            }
        };
        let mut cfg = ServerConfig::new(addr(bind)?, secret);
        cfg.optimizer = opt;
        cfg.aggregate = aggregate;
        cfg.staleness = staleness;
        cfg.num_workers = num_workers;
        cfg.dead_after = seconds("dead_after", dead_after)?;
        cfg.register_timeout = seconds("register_timeout", register_timeout)?;
        cfg.chaos = self::chaos(chaos)?;
        if let Some(c) = transport.compression {
            c.install();
        }
        cfg.transport = transport;
        let rt = runtime(py)?;
        let inner = py
            .detach(|| rt.block_on(ps::PsServer::start_with(cfg, restore)))
            .map_err(|e| to_py(py, e))?;
        Ok(PsServer { inner })
    }

    /// The address it listens on.
    #[getter]
    fn local_addr(&self, py: Python<'_>) -> PyResult<String> {
        self.inner
            .local_addr()
            .map(|a| a.to_string())
            .map_err(|e| to_py(py, e))
    }

    /// (applied clock, pieces, live workers): one consistent cut of what the server holds.
    #[allow(clippy::type_complexity)]
    fn snapshot<'py>(
        &self,
        py: Python<'py>,
    ) -> (
        u64,
        Vec<(
            String,
            u64,
            Bound<'py, PyBytes>,
            HashMap<&'static str, Bound<'py, PyBytes>>,
            (u64, f64, f64),
            u64,
        )>,
        Vec<u32>,
    ) {
        let (applied, pieces, workers) = py.detach(|| self.inner.snapshot());
        let out = pieces
            .into_iter()
            .map(|((k, off), p)| {
                let bufs = p
                    .state
                    .buffers()
                    .into_iter()
                    .map(|(n, b)| (n, PyBytes::new(py, bytemuck_bytes(b))))
                    .collect();
                (
                    k,
                    off,
                    PyBytes::new(py, bytemuck_bytes(&p.params)),
                    bufs,
                    p.state.counters(),
                    p.updates,
                )
            })
            .collect();
        (applied, out, workers)
    }

    /// Replaces what the server holds by a snapshot (as [`PsServer::snapshot`] returns,
    /// with bytes); workers register again as they reconnect.
    fn restore(
        &self,
        py: Python<'_>,
        applied: u64,
        pieces: Vec<PieceTuple>,
        workers: Vec<u32>,
    ) -> PyResult<()> {
        let out = pieces_of(pieces)?;
        let rt = runtime(py)?;
        py.detach(|| rt.block_on(async { self.inner.restore(applied, out, workers) }))
            .map_err(|e| to_py(py, e))
    }

    /// Counters by name.
    fn stats(&self) -> HashMap<String, u64> {
        self.inner.stats().into_iter().collect()
    }

    /// (worker, clock, live) of every worker ever registered.
    fn clocks(&self) -> Vec<(u32, u64, bool)> {
        self.inner.clocks()
    }

    /// Cuts the server off the network (needs chaos).
    fn chaos_kill(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.chaos_kill().map_err(|e| to_py(py, e))
    }

    /// Whether it was closed.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_closed()
    }

    /// Stops serving.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let rt = runtime(py)?;
        let s = self.inner.clone();
        py.detach(|| rt.block_on(s.close()));
        Ok(())
    }
}

fn bytemuck_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte is a valid u8; the view lives as long as `v`.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// A worker's connection to the parameter servers.
#[pyclass(module = "mcp_fast._core", frozen)]
pub struct PsWorker {
    inner: Arc<ps::PsClient>,
}

/// Runs a request of this worker (a transfer between the servers and the caller's arrays,
/// or a wait under the staleness bound) until it ends, returning to Python every
/// [`crate::runtime::SIGNAL_POLL`] to run signal handlers. If one raises (Ctrl-C), the
/// worker is closed, which fails every request in flight at once (the servers may have
/// taken part of it: the worker's clock would no longer be known), and the request is
/// driven to its end before the exception is raised: a transfer's tasks write into (or
/// read from) the arrays, which the caller may free as soon as this returns.
fn transfer<F>(
    py: Python<'_>,
    rt: &tokio::runtime::Runtime,
    c: &Arc<ps::PsClient>,
    fut: F,
) -> PyResult<F::Output>
where
    F: std::future::Future + Send,
    F::Output: Send,
{
    let mut fut = std::pin::pin!(fut);
    match block_on_or_signal(py, rt, fut.as_mut()) {
        Ok(out) => Ok(out),
        Err(interrupt) => {
            py.detach(|| {
                rt.block_on(async {
                    c.close().await;
                    fut.as_mut().await
                })
            });
            Err(interrupt)
        }
    }
}

#[pymethods]
impl PsWorker {
    /// Connects to every server and registers (waits for the other workers at start).
    /// `worker=None`: a replacement, which claims a vacant id (waiting for one).
    #[new]
    #[pyo3(signature = (servers, worker, secret, timeout=60.0, dead_after=5.0,
                        split_above=1<<18, chaos=None, config=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        servers: Vec<String>,
        worker: Option<u32>,
        secret: Vec<u8>,
        timeout: f64,
        dead_after: f64,
        split_above: u64,
        chaos: Option<&str>,
        config: Option<&Bound<'_, pyo3::types::PyDict>>,
    ) -> PyResult<PsWorker> {
        let transport = crate::config::settings(config)?;
        if let Some(c) = transport.compression {
            c.install();
        }
        let cfg = ClientConfig {
            transport,
            servers: servers.iter().map(|s| addr(s)).collect::<PyResult<_>>()?,
            worker,
            secret,
            timeout: seconds("timeout", timeout)?,
            dead_after: seconds("dead_after", dead_after)?,
            split_above,
            chaos: self::chaos(chaos)?,
        };
        let rt = runtime(py)?;
        let inner = block_on_or_signal(py, rt, std::pin::pin!(ps::PsClient::connect(cfg)))?
            .map_err(|e| to_py(py, e))?;
        Ok(PsWorker { inner })
    }

    /// This worker's id.
    #[getter]
    fn worker(&self) -> u32 {
        self.inner.worker()
    }

    /// Requests sent again because they or their reply failed a checksum.
    #[getter]
    fn resends(&self) -> u64 {
        self.inner.resends()
    }

    /// The generation of the id this worker holds (0 unless it claimed a vacant one).
    #[getter]
    fn generation(&self) -> u64 {
        self.inner.generation()
    }

    /// Steps finished.
    #[getter]
    fn clock(&self) -> u64 {
        self.inner.clock()
    }

    /// Builds the shard map; returns its pieces as (key, offset, len, server slot).
    fn set_tensors(
        &self,
        py: Python<'_>,
        tensors: Vec<(String, u64)>,
    ) -> PyResult<Vec<(String, u64, u64, usize)>> {
        let m = self.inner.set_tensors(&tensors).map_err(|e| to_py(py, e))?;
        Ok(m.all()
            .map(|p| (p.key.clone(), p.offset, p.len, p.server))
            .collect())
    }

    /// Creates the tensors on their servers unless they exist.
    fn init(&self, py: Python<'_>, items: Vec<(String, Bound<'_, PyAny>)>) -> PyResult<()> {
        let (_held, items) = bufs(&self.inner, items, Access::Read, "init")?;
        let (rt, c) = (runtime(py)?, self.inner.clone());
        py.detach(|| rt.block_on(c.init_all(items)))
            .map_err(|e| to_py(py, e))
    }

    /// Checks tensor arguments of `what` against the registered tensors without using
    /// them (names, dtypes, sizes; the errors of a push or pull with them).
    fn check(&self, items: Vec<(String, Bound<'_, PyAny>)>, what: &str) -> PyResult<()> {
        bufs(&self.inner, items, Access::Read, what).map(|_| ())
    }

    /// Pushes gradients for the current clock.
    #[pyo3(signature = (items, codec="none", block=256))]
    fn push(
        &self,
        py: Python<'_>,
        items: Vec<(String, Bound<'_, PyAny>)>,
        codec: &str,
        block: u32,
    ) -> PyResult<()> {
        let codec = Codec::from_name(codec, block).map_err(|e| to_py(py, e))?;
        let (_held, items) = bufs(&self.inner, items, Access::Read, "push")?;
        let (rt, c) = (runtime(py)?, self.inner.clone());
        transfer(py, rt, &c, c.push_all(items, codec))?.map_err(|e| to_py(py, e))
    }

    /// Pulls parameters into the buffers; returns the oldest applied clock among them.
    fn pull(&self, py: Python<'_>, items: Vec<(String, Bound<'_, PyAny>)>) -> PyResult<u64> {
        let (_held, items) = bufs(&self.inner, items, Access::Write, "pull into")?;
        let (rt, c) = (runtime(py)?, self.inner.clone());
        transfer(py, rt, &c, c.pull_all(items))?.map_err(|e| to_py(py, e))
    }

    /// Finishes the clock and waits under the staleness bound; returns (clock, slowest
    /// live clock or None).
    #[pyo3(signature = (staleness=None))]
    fn advance(&self, py: Python<'_>, staleness: Option<u64>) -> PyResult<(u64, Option<u64>)> {
        let (rt, c) = (runtime(py)?, self.inner.clone());
        let r = transfer(py, rt, &c, c.advance(staleness))?.map_err(|e| to_py(py, e))?;
        Ok((r.clock, r.min))
    }

    /// Pushes `grads`, finishes the clock, waits under the staleness bound, then pulls into
    /// `into`: one round trip per server. Returns (clock, slowest live clock or None).
    #[pyo3(signature = (grads, into, codec="none", block=256, staleness=None))]
    fn step(
        &self,
        py: Python<'_>,
        grads: Vec<(String, Bound<'_, PyAny>)>,
        into: Vec<(String, Bound<'_, PyAny>)>,
        codec: &str,
        block: u32,
        staleness: Option<u64>,
    ) -> PyResult<(u64, Option<u64>)> {
        let codec = Codec::from_name(codec, block).map_err(|e| to_py(py, e))?;
        let (_held_grads, grads) = bufs(&self.inner, grads, Access::Read, "push")?;
        let (_held_into, into) = bufs(&self.inner, into, Access::Write, "pull into")?;
        let (rt, c) = (runtime(py)?, self.inner.clone());
        let r = transfer(py, rt, &c, c.step_all(grads, into, codec, staleness))?
            .map_err(|e| to_py(py, e))?;
        Ok((r.clock, r.min))
    }

    /// Each server's counters.
    fn stats(&self, py: Python<'_>) -> PyResult<Vec<HashMap<String, u64>>> {
        let (rt, c) = (runtime(py)?, self.inner.clone());
        let v = py
            .detach(|| rt.block_on(c.stats()))
            .map_err(|e| to_py(py, e))?;
        Ok(v.into_iter().map(|kv| kv.into_iter().collect()).collect())
    }

    /// (retries, reconnections) so far.
    fn counters(&self) -> (u64, u64) {
        self.inner.counters()
    }

    /// Points server slot `slot` at `address` ("host:port").
    fn replace_server(&self, py: Python<'_>, slot: usize, address: &str) -> PyResult<()> {
        self.inner
            .replace_server(slot, addr(address)?)
            .map_err(|e| to_py(py, e))
    }

    /// (version, addresses) of the server list.
    fn servers(&self) -> (u64, Vec<String>) {
        let l = self.inner.servers();
        (l.version, l.addrs.iter().map(|a| a.to_string()).collect())
    }

    /// Cuts this worker off the network (needs chaos).
    fn chaos_kill(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.chaos_kill().map_err(|e| to_py(py, e))
    }

    /// Leaves the job and closes the endpoint.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let (rt, c) = (runtime(py)?, self.inner.clone());
        py.detach(|| rt.block_on(c.close()));
        Ok(())
    }
}

/// Registers the classes.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PsServer>()?;
    m.add_class::<PsWorker>()?;
    Ok(())
}
