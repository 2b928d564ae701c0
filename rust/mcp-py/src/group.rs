//! `ProcessGroup`: the Python face of a core group over QUIC. Tensors arrive as
//! [`TensorArg`]s (the buffer protocol); an operation keeps its arguments exported until it
//! has finished, so the memory stays valid even if the caller drops its handle.

use crate::errors::to_py;
use crate::runtime::{block_on_or_signal, runtime};
use crate::tensor_arg::{release_later, release_now, release_pending, Access, TensorArg};
use crate::work::{Work, WorkState};
use mcp_core::transport::quic::{LanePolicy, QuicConfig, QuicTransport};
use mcp_core::wire::Codec;
use mcp_core::{Algorithm, Error, Group, GroupConfig, OpFuture, ReduceOp, Tensor, Topology};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

pub(crate) fn seconds(name: &str, s: f64) -> PyResult<Duration> {
    if s > 0.0 && s.is_finite() {
        Ok(Duration::from_secs_f64(s))
    } else {
        Err(PyValueError::new_err(format!(
            "{name} must be a positive number of seconds, got {s}"
        )))
    }
}

pub(crate) fn resolve(host: &str, port: u16) -> PyResult<SocketAddr> {
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| PyValueError::new_err(format!("cannot resolve master address {host:?}: {e}")))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or_else(|| addrs.first())
        .copied()
        .ok_or_else(|| {
            PyValueError::new_err(format!("master address {host:?} resolves to nothing"))
        })
}

/// The core's description of `arg`, travelling with `codec`.
fn tensor_of(arg: &TensorArg, codec: Codec) -> Tensor<'_> {
    Tensor {
        buf: arg.raw(),
        dtype: arg.dtype,
        shape: &arg.shape,
        codec,
    }
}

/// `dst = op(dst, src)` element-wise with the core's SIMD kernels (for benchmarks and tests).
#[pyfunction]
pub fn reduce_into(
    py: Python<'_>,
    dst: &Bound<'_, PyAny>,
    src: &Bound<'_, PyAny>,
    op: &str,
) -> PyResult<()> {
    let mut d = TensorArg::extract(dst, Access::Write)?;
    let s = TensorArg::extract(src, Access::Read)?;
    let op = ReduceOp::from_name(op).map_err(|e| to_py(py, e))?;
    if d.dtype != s.dtype || d.len() != s.len() {
        return Err(PyValueError::new_err(format!(
            "dst ({}, {} B) and src ({}, {} B) differ",
            d.dtype,
            d.len(),
            s.dtype,
            s.len()
        )));
    }
    let dtype = d.dtype;
    py.detach(|| mcp_core::reduce::reduce_into(dtype, op, d.bytes_mut(), s.bytes()))
        .map_err(|e| to_py(py, e))
}

/// Replaces the buffer by what a peer would decode after `codec` (error feedback uses it).
#[pyfunction]
#[pyo3(signature = (x, codec, block=256))]
pub fn codec_round_trip(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    codec: &str,
    block: u32,
) -> PyResult<()> {
    let mut x = TensorArg::extract(x, Access::Write)?;
    let codec = Codec::from_name(codec, block).map_err(|e| to_py(py, e))?;
    let dtype = x.dtype;
    py.detach(|| {
        let buf = x.bytes_mut();
        let mut enc = Vec::new();
        mcp_core::codec::encode(codec, dtype, buf, &mut enc)?;
        mcp_core::codec::decode(codec, dtype, &enc, buf)
    })
    .map_err(|e| to_py(py, e))
}

/// The ranks of one job, connected over QUIC with mutual TLS.
#[pyclass(module = "mcp_fast._core", frozen)]
pub struct ProcessGroup {
    pub(crate) group: Group<QuicTransport>,
}

impl ProcessGroup {
    /// Runs `op` and returns its handle; the buffers in `args` are released when it ends.
    /// With `wait`, the calling thread drives the operation itself (without the GIL) and the
    /// handle comes back finished: a synchronous call then costs no hand-over to a runtime
    /// thread and no wake-up back, which is most of a small operation's time. Otherwise it
    /// runs on the runtime, overlapping whatever the caller does next.
    fn start(
        &self,
        py: Python<'_>,
        name: &'static str,
        op: Result<OpFuture, Error>,
        args: Vec<TensorArg>,
        wait: bool,
    ) -> PyResult<Work> {
        let op = op.map_err(|e| to_py(py, e))?;
        let state = Arc::new(WorkState::default());
        let rt = runtime(py)?;
        if wait {
            // The operation's sequence number was taken when it was built, so operations
            // started earlier with `async_op=True` keep their order on every rank.
            let mut op = op;
            match block_on_or_signal(py, rt, op.as_mut()) {
                Ok(r) => {
                    state.complete(r);
                    release_now(py, args);
                }
                Err(interrupt) => {
                    self.abandon(py, &interrupt, op, args)?;
                    return Err(interrupt);
                }
            }
        } else {
            let done = state.clone();
            rt.spawn(async move {
                let r = op.await;
                // Handed over before the result is visible, so that the wait that sees it
                // releases the buffers before the caller touches them again.
                release_later(args);
                done.complete(r);
            });
        }
        Ok(Work {
            state,
            op: name,
            source: None,
            abort_on_signal: Some(self.group.downgrade()),
        })
    }

    /// A signal handler raised (Ctrl-C) while `op` ran on the calling thread. The ranks can
    /// no longer agree on what this rank has done, so the group is aborted: `op` stops at
    /// once, the peers see this rank leave (a `PeerLostError` naming it, not a timeout),
    /// and later calls raise `GroupClosedError`. The buffers are released once `op` has
    /// let go of them.
    fn abandon(
        &self,
        py: Python<'_>,
        interrupt: &PyErr,
        mut op: OpFuture,
        args: Vec<TensorArg>,
    ) -> PyResult<()> {
        abort_for(py, &self.group, interrupt);
        let rt = runtime(py)?;
        let stopped = py
            .detach(|| rt.block_on(async { tokio::time::timeout(ABANDON_WAIT, op.as_mut()).await }))
            .is_ok();
        if stopped {
            release_now(py, args);
        } else {
            rt.spawn(async move {
                let _ = op.await;
                release_later(args);
            });
        }
        Ok(())
    }
}

/// Aborts `group` because a signal handler raised `interrupt` during one of its operations.
pub(crate) fn abort_for(py: Python<'_>, group: &Group<QuicTransport>, interrupt: &PyErr) {
    let name = interrupt
        .get_type(py)
        .name()
        .map_or_else(|_| "an exception".to_owned(), |n| n.to_string());
    group.abort_because(&format!(
        "the group was aborted because {name} interrupted an operation on this rank"
    ));
}

/// How long an interrupted operation may take to stop after its group was aborted before
/// the exception goes on without it (it ends with `Closed` at its next await).
pub(crate) const ABANDON_WAIT: Duration = Duration::from_secs(2);

#[pymethods]
impl ProcessGroup {
    /// Joins the job: rank 0 listens on (master_addr, master_port), every rank meets there.
    #[new]
    #[pyo3(signature = (rank, world_size, master_addr, master_port, secret=None, timeout=300.0,
                        connect_timeout=300.0, idle_timeout=30.0, chunk_bytes=1<<20,
                        small_bytes=65536, protocol_major=None, on_bound=None, chaos=None,
                        heartbeat=None, lane=None, resend_limit=8,
                        stall_timeout=60.0, allow_generated_secret=false, epoch_of=None,
                        zero_rtt=true, shm=None, host_id=None, config=None,
                        model_spec=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        rank: usize,
        world_size: usize,
        master_addr: &str,
        master_port: u16,
        secret: Option<Vec<u8>>,
        timeout: f64,
        connect_timeout: f64,
        idle_timeout: f64,
        chunk_bytes: usize,
        small_bytes: usize,
        protocol_major: Option<u8>,
        on_bound: Option<Py<PyAny>>,
        chaos: Option<&str>,
        heartbeat: Option<f64>,
        lane: Option<&str>,
        resend_limit: u32,
        stall_timeout: f64,
        allow_generated_secret: bool,
        epoch_of: Option<(PyRef<'_, crate::elastic::ElasticMember>, u64)>,
        zero_rtt: bool,
        shm: Option<bool>,
        host_id: Option<String>,
        config: Option<&Bound<'_, pyo3::types::PyDict>>,
        model_spec: Option<&Bound<'_, pyo3::types::PyDict>>,
    ) -> PyResult<ProcessGroup> {
        let tune = crate::config::settings(config)?;
        let model_decl = crate::model_decl::canonical(model_spec)?;
        if world_size == 0 || rank >= world_size {
            return Err(PyValueError::new_err(format!(
                "rank must be in [0, world_size); got rank={rank}, world_size={world_size}"
            )));
        }
        if chunk_bytes < 64 {
            return Err(PyValueError::new_err("chunk_bytes must be at least 64"));
        }
        let mut cfg = QuicConfig::new(rank, world_size, resolve(master_addr, master_port)?);
        cfg.secret = secret;
        cfg.allow_generated_secret = allow_generated_secret;
        cfg.connect_timeout = seconds("connect_timeout", connect_timeout)?;
        cfg.idle_timeout = seconds("idle_timeout", idle_timeout)?;
        // An explicit heartbeat (seconds) wins over the config's heartbeat_interval.
        tune.apply(&mut cfg);
        if let Some(h) = heartbeat {
            cfg.heartbeat = seconds("heartbeat", h)?;
        }
        cfg.resend_limit = resend_limit;
        cfg.stall_timeout = seconds("stall_timeout", stall_timeout)?;
        cfg.zero_rtt = zero_rtt;
        if let Some(on) = shm {
            cfg.shm = on;
        }
        cfg.host_id = host_id;
        cfg.model_decl = model_decl;
        if let Some(v) = protocol_major {
            cfg.protocol_major = v;
        }
        if let Some(name) = lane {
            cfg.bulk.policy = LanePolicy::parse(name).ok_or_else(|| {
                PyValueError::new_err(format!(
                    "lane must be 'auto', 'stream' or 'fec', got {name:?}"
                ))
            })?;
        }
        if let Some(spec) = chaos {
            cfg.chaos = Some(
                mcp_core::transport::quic::chaos::ChaosConfig::parse(spec)
                    .map_err(|e| PyValueError::new_err(format!("chaos {spec:?}: {e}")))?,
            );
        }
        let gcfg = GroupConfig {
            timeout: seconds("timeout", timeout)?,
            chunk_bytes,
            small_bytes,
        };
        let rt = runtime(py)?;
        // `on_bound(addr)` runs once the socket is bound, before the rendezvous: the torch
        // backend publishes rank 0's address through its Store there.
        let publish = move |addr: std::net::SocketAddr| -> Result<(), Error> {
            match &on_bound {
                None => Ok(()),
                Some(f) => Python::attach(|py| {
                    f.call1(py, (addr.to_string(),))
                        .map(|_| ())
                        .map_err(|e| Error::Io(format!("on_bound callback failed: {e}")))
                }),
            }
        };
        // In an elastic job, the rendezvous of an epoch gives up as soon as the coordinator
        // says the epoch is over (a member died before it joined).
        let ended = epoch_of.map(|(m, e)| (m.client().clone(), e));
        let rendezvous = std::pin::pin!(async move {
            let connect = QuicTransport::connect_with(cfg, publish);
            match ended {
                None => connect.await,
                Some((client, epoch)) => tokio::select! {
                    r = connect => r,
                    () = client.ended(epoch) => Err(Error::Closed(format!(
                        "epoch {epoch} ended before its group formed"
                    ))),
                },
            }
        });
        // Ctrl-C while waiting for ranks that have not come drops the rendezvous (and its
        // socket) and raises at once.
        let t = block_on_or_signal(py, rt, rendezvous)?.map_err(|e| to_py(py, e))?;
        // Which ranks share a host, as the rendezvous found it: the collectives go
        // hierarchical on a job of several hosts with several ranks on one.
        let topology = Topology::from_host_of_rank(t.host_of_rank()).map_err(|e| to_py(py, e))?;
        let group = Group::new(t, gcfg);
        group.set_topology(topology).map_err(|e| to_py(py, e))?;
        Ok(ProcessGroup { group })
    }

    /// This process's rank.
    #[getter]
    fn rank(&self) -> usize {
        self.group.rank()
    }

    /// Number of ranks.
    #[getter]
    fn world_size(&self) -> usize {
        self.group.world_size()
    }

    /// The job secret (rank 0 generates one when none was given).
    #[getter]
    fn secret(&self) -> Vec<u8> {
        self.group.transport().secret().to_vec()
    }

    /// The UDP address this process listens on.
    #[getter]
    fn local_addr(&self, py: Python<'_>) -> PyResult<String> {
        self.group
            .transport()
            .local_addr()
            .map(|a| a.to_string())
            .map_err(|e| to_py(py, e))
    }

    /// Overrides which ranks share a host for the algorithms (the rendezvous found it):
    /// `host_ids[r]` names rank r's host, ranks with equal names share one. Every rank must
    /// give the same list before its next collective.
    fn set_topology(&self, py: Python<'_>, host_ids: Vec<String>) -> PyResult<()> {
        let topo = Topology::from_host_ids(&host_ids).map_err(|e| to_py(py, e))?;
        self.group.set_topology(topo).map_err(|e| to_py(py, e))
    }

    /// Transport counters: frames and bytes sent and received, corrupt frames, frames resent
    /// after a failed checksum, refused handshakes, and QUIC's packets sent and lost over
    /// the connections open now.
    fn stats(&self) -> std::collections::HashMap<&'static str, u64> {
        use std::sync::atomic::Ordering::Relaxed;
        let t = self.group.transport();
        let s = t.stats();
        let paths: Vec<_> = t.health().into_iter().filter_map(|h| h.path).collect();
        [
            ("refused_handshakes", s.refused_handshakes.load(Relaxed)),
            ("frames_received", s.frames_received.load(Relaxed)),
            ("frames_sent", s.frames_sent.load(Relaxed)),
            ("corrupt_frames", s.corrupt_frames.load(Relaxed)),
            ("retransmits", s.retransmits.load(Relaxed)),
            ("reconnects", s.reconnects.load(Relaxed)),
            ("resumed_frames", s.resumed_frames.load(Relaxed)),
            ("zero_rtt_accepted", s.zero_rtt_accepted.load(Relaxed)),
            ("zero_rtt_rejected", s.zero_rtt_rejected.load(Relaxed)),
            ("duplicate_frames", t.mailbox_duplicates()),
            (
                "last_reconnect_us",
                t.last_reconnect().map_or(0, |d| d.as_micros() as u64),
            ),
            ("bytes_sent", s.bytes_sent.load(Relaxed)),
            ("bytes_received", s.bytes_received.load(Relaxed)),
            (
                "quic_sent_packets",
                paths.iter().map(|p| p.sent_packets).sum(),
            ),
            (
                "quic_lost_packets",
                paths.iter().map(|p| p.lost_packets).sum(),
            ),
        ]
        .into_iter()
        .collect()
    }

    /// Where every rank runs: `hosts` (the ranks of each host, hosts in order of first
    /// appearance by rank), `host_of_rank`, this rank's `host`, `local_rank` and
    /// `local_world_size`, every rank's `host_ids`, and the `shm_peers` this rank reaches
    /// through shared memory.
    fn topology<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let t = self.group.transport();
        let host_of_rank = self.group.topology().host_of_rank().to_vec();
        let hosts = mcp_core::transport::host::ranks_by_host(&host_of_rank);
        let me = self.group.rank();
        let host = host_of_rank.get(me).copied().unwrap_or(0);
        let mine = hosts.get(host).cloned().unwrap_or_default();
        let d = pyo3::types::PyDict::new(py);
        d.set_item("hosts", hosts)?;
        d.set_item("host_of_rank", host_of_rank)?;
        d.set_item("host", host)?;
        d.set_item(
            "local_rank",
            mine.iter().position(|&r| r == me).unwrap_or(0),
        )?;
        d.set_item("local_world_size", mine.len())?;
        d.set_item("host_ids", t.host_ids())?;
        d.set_item("shm_peers", t.shm_peers())?;
        Ok(d)
    }

    /// The peers of this host reached over QUIC because their shared memory could not be
    /// set up: (rank, why).
    fn shm_fallbacks(&self) -> Vec<(usize, String)> {
        self.group.transport().shm_fallbacks()
    }

    /// The shared-memory path's counters: frames and bytes sent and received through it, and
    /// operations that read the local peers' tensors directly or fell back to the rings.
    fn shm_stats(&self) -> std::collections::HashMap<&'static str, u64> {
        use std::sync::atomic::Ordering::Relaxed;
        let s = self.group.transport().stats();
        [
            ("frames_sent", s.shm_frames_sent.load(Relaxed)),
            ("bytes_sent", s.shm_bytes_sent.load(Relaxed)),
            ("frames_received", s.shm_frames_received.load(Relaxed)),
            ("bytes_received", s.shm_bytes_received.load(Relaxed)),
            ("direct_ops", s.direct_ops.load(Relaxed)),
            ("direct_fallbacks", s.direct_fallbacks.load(Relaxed)),
        ]
        .into_iter()
        .collect()
    }

    /// The bulk (FEC) lane's counters: frames sent and received over it, shards resent on
    /// request, and transfers its repairs could not finish (carried on a stream instead).
    fn lane_stats(&self) -> std::collections::HashMap<&'static str, u64> {
        use std::sync::atomic::Ordering::Relaxed;
        let s = self.group.transport().stats();
        [
            ("frames_sent", s.bulk_frames_sent.load(Relaxed)),
            ("frames_received", s.bulk_frames_received.load(Relaxed)),
            ("repair_shards", s.repair_shards.load(Relaxed)),
            ("fallbacks", s.bulk_fallbacks.load(Relaxed)),
        ]
        .into_iter()
        .collect()
    }

    /// The lane policy: "auto", "stream" or "fec".
    #[getter]
    fn lane(&self) -> &'static str {
        self.group.transport().lane().name()
    }

    /// Each other rank's state ("connected", "not connected", "lost"), RTT and last-seen
    /// time in seconds, silence limit, and why it was lost.
    fn health<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, pyo3::types::PyDict>>> {
        self.group
            .transport()
            .health()
            .into_iter()
            .map(|h| {
                let d = pyo3::types::PyDict::new(py);
                d.set_item("rank", h.rank)?;
                d.set_item("state", h.state)?;
                d.set_item("rtt", h.rtt.map(|d| d.as_secs_f64()))?;
                d.set_item("last_seen", h.last_seen.map(|d| d.as_secs_f64()))?;
                d.set_item("silence_limit", h.silence_limit.map(|d| d.as_secs_f64()))?;
                d.set_item("reason", h.reason)?;
                let p = h.path;
                d.set_item("sent_packets", p.map(|p| p.sent_packets))?;
                d.set_item("lost_packets", p.map(|p| p.lost_packets))?;
                d.set_item("lost_bytes", p.map(|p| p.lost_bytes))?;
                d.set_item("congestion_events", p.map(|p| p.congestion_events))?;
                d.set_item("cwnd", p.map(|p| p.cwnd))?;
                d.set_item("mtu", p.map(|p| p.mtu))?;
                Ok(d)
            })
            .collect()
    }

    /// Cuts this process off the network (needs `chaos=` at init): every datagram in and
    /// out is dropped from now on.
    fn chaos_kill(&self, py: Python<'_>) -> PyResult<()> {
        self.group
            .transport()
            .chaos_kill()
            .map_err(|e| to_py(py, e))
    }

    /// Cuts this process off the network for `seconds` (needs `chaos=` at init), as a link
    /// flap would; returns at once, the path comes back by itself.
    fn chaos_cut(&self, py: Python<'_>, seconds: f64) -> PyResult<()> {
        let d = self::seconds("seconds", seconds)?;
        let _in_runtime = runtime(py)?.enter();
        self.group
            .transport()
            .chaos_cut(d)
            .map_err(|e| to_py(py, e))
    }

    /// Drops every connection of this process at once (a path reset): they are
    /// re-established and the operations in flight resume.
    fn chaos_reset(&self, py: Python<'_>) -> PyResult<()> {
        let _in_runtime = runtime(py)?.enter();
        self.group.transport().chaos_reset();
        Ok(())
    }

    /// The fault injector's counters (empty without `chaos=`).
    fn chaos_stats(&self) -> std::collections::HashMap<&'static str, u64> {
        use std::sync::atomic::Ordering::Relaxed;
        let Some(s) = self.group.transport().chaos_stats() else {
            return Default::default();
        };
        [
            ("sent", s.sent.load(Relaxed)),
            ("send_dropped", s.send_dropped.load(Relaxed)),
            ("rate_dropped", s.rate_dropped.load(Relaxed)),
            ("duplicated", s.duplicated.load(Relaxed)),
            ("delayed", s.delayed.load(Relaxed)),
            ("received", s.received.load(Relaxed)),
            ("recv_dropped", s.recv_dropped.load(Relaxed)),
            ("killed", s.killed.load(Relaxed)),
            (
                "damaged",
                self.group.transport().stats().chaos_damaged.load(Relaxed),
            ),
        ]
        .into_iter()
        .collect()
    }

    /// Smoothed round-trip time to `peer` in seconds, if connected.
    fn rtt(&self, peer: usize) -> Option<f64> {
        self.group.transport().rtt(peer).map(|d| d.as_secs_f64())
    }

    /// All-reduce in place.
    #[pyo3(signature = (tensor, op, algorithm, codec="none", block=256, wait=false))]
    #[allow(clippy::too_many_arguments)]
    fn all_reduce(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        op: &str,
        algorithm: &str,
        codec: &str,
        block: u32,
        wait: bool,
    ) -> PyResult<Work> {
        let a = TensorArg::extract(tensor, Access::Write)?;
        let codec = Codec::from_name(codec, block).map_err(|e| to_py(py, e))?;
        let op = ReduceOp::from_name(op).map_err(|e| to_py(py, e))?;
        let algo = Algorithm::from_name(algorithm).map_err(|e| to_py(py, e))?;
        let fut = self.group.all_reduce(tensor_of(&a, codec), op, algo);
        self.start(py, "all_reduce", fut, vec![a], wait)
    }

    /// Broadcast in place from `src`.
    #[pyo3(signature = (tensor, src, codec="none", block=256, wait=false))]
    fn broadcast(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        src: usize,
        codec: &str,
        block: u32,
        wait: bool,
    ) -> PyResult<Work> {
        let a = TensorArg::extract(tensor, Access::Write)?;
        let codec = Codec::from_name(codec, block).map_err(|e| to_py(py, e))?;
        let fut = self.group.broadcast(tensor_of(&a, codec), src);
        self.start(py, "broadcast", fut, vec![a], wait)
    }

    /// All-gather `input` into `out`.
    #[pyo3(signature = (out, input, codec="none", block=256, wait=false))]
    fn all_gather(
        &self,
        py: Python<'_>,
        out: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
        codec: &str,
        block: u32,
        wait: bool,
    ) -> PyResult<Work> {
        let o = TensorArg::extract(out, Access::Write)?;
        let i = TensorArg::extract(input, Access::Read)?;
        let codec = Codec::from_name(codec, block).map_err(|e| to_py(py, e))?;
        let fut = self
            .group
            .all_gather(tensor_of(&o, codec), tensor_of(&i, codec));
        self.start(py, "all_gather", fut, vec![o, i], wait)
    }

    /// Reduce-scatter `input` into `out`.
    #[pyo3(signature = (out, input, op, codec="none", block=256, wait=false))]
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        out: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
        op: &str,
        codec: &str,
        block: u32,
        wait: bool,
    ) -> PyResult<Work> {
        let o = TensorArg::extract(out, Access::Write)?;
        let i = TensorArg::extract(input, Access::Read)?;
        let codec = Codec::from_name(codec, block).map_err(|e| to_py(py, e))?;
        let op = ReduceOp::from_name(op).map_err(|e| to_py(py, e))?;
        let fut = self
            .group
            .reduce_scatter(tensor_of(&o, codec), tensor_of(&i, codec), op);
        self.start(py, "reduce_scatter", fut, vec![o, i], wait)
    }

    /// Receive from whichever rank sends first.
    #[pyo3(signature = (tensor, tag, codec="none", block=256, wait=false))]
    fn recv_any(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        tag: u32,
        codec: &str,
        block: u32,
        wait: bool,
    ) -> PyResult<Work> {
        let a = TensorArg::extract(tensor, Access::Write)?;
        let codec = Codec::from_name(codec, block).map_err(|e| to_py(py, e))?;
        let source = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(usize::MAX));
        let fut = self
            .group
            .recv_any(tensor_of(&a, codec), tag, source.clone());
        let mut work = self.start(py, "recv", fut, vec![a], wait)?;
        work.source = Some(source);
        Ok(work)
    }

    /// Barrier.
    #[pyo3(signature = (wait=false))]
    fn barrier(&self, py: Python<'_>, wait: bool) -> PyResult<Work> {
        let fut = self.group.barrier();
        self.start(py, "barrier", fut, Vec::new(), wait)
    }

    /// Send to `dst`.
    #[pyo3(signature = (tensor, dst, tag, codec="none", block=256, wait=false))]
    #[allow(clippy::too_many_arguments)]
    fn send(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        dst: usize,
        tag: u32,
        codec: &str,
        block: u32,
        wait: bool,
    ) -> PyResult<Work> {
        let a = TensorArg::extract(tensor, Access::Read)?;
        let codec = Codec::from_name(codec, block).map_err(|e| to_py(py, e))?;
        let fut = self.group.send(tensor_of(&a, codec), dst, tag);
        self.start(py, "send", fut, vec![a], wait)
    }

    /// Receive from `src`.
    #[pyo3(signature = (tensor, src, tag, codec="none", block=256, wait=false))]
    #[allow(clippy::too_many_arguments)]
    fn recv(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        src: usize,
        tag: u32,
        codec: &str,
        block: u32,
        wait: bool,
    ) -> PyResult<Work> {
        let a = TensorArg::extract(tensor, Access::Write)?;
        let codec = Codec::from_name(codec, block).map_err(|e| to_py(py, e))?;
        let fut = self.group.recv(tensor_of(&a, codec), src, tag);
        self.start(py, "recv", fut, vec![a], wait)
    }

    /// Cancels every operation in flight now (they raise GroupClosedError).
    fn abort(&self) {
        self.group.abort();
    }

    /// Closes the group: delivers what was sent, says goodbye, releases the socket.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let rt = runtime(py)?;
        let g = self.group.clone();
        py.detach(|| rt.block_on(g.close()));
        release_pending(py);
        Ok(())
    }
}
