//! Python binding of elastic membership (`mcp_core::membership`): the coordinator, and a
//! member's connection to it. Waiting calls release the GIL.

use crate::errors::to_py;
use crate::group::{resolve, seconds, ProcessGroup};
use crate::runtime::{block_on_or_signal, runtime};
use mcp_core::membership::client::{MemberClient, MemberConfig};
use mcp_core::membership::coordinator::CoordinatorConfig;
use mcp_core::membership::server::CoordinatorServer;
use mcp_core::membership::Epoch;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::net::SocketAddr;

fn host_port(addr: &str) -> PyResult<SocketAddr> {
    let (host, port) = addr
        .rsplit_once(':')
        .ok_or_else(|| PyValueError::new_err(format!("address {addr:?} must be HOST:PORT")))?;
    let port: u16 = port
        .parse()
        .map_err(|_| PyValueError::new_err(format!("address {addr:?}: bad port {port:?}")))?;
    resolve(host.trim_start_matches('[').trim_end_matches(']'), port)
}

fn epoch_dict<'py>(
    py: Python<'py>,
    e: &Epoch,
    me: Option<u64>,
    secret: &[u8],
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("epoch", e.number)?;
    d.set_item("incarnation", e.incarnation)?;
    let members: Vec<(u64, i64)> = e.members.iter().map(|m| (m.id, m.step)).collect();
    d.set_item("members", members)?;
    d.set_item("world_size", e.members.len())?;
    if let Some(id) = me {
        d.set_item("rank", e.rank_of(id))?;
    }
    let (source, takers) = e.heal_plan();
    d.set_item("source", source)?;
    d.set_item("takers", takers)?;
    d.set_item("step", e.step_after_heal())?;
    d.set_item("group_secret", PyBytes::new(py, &e.group_secret(secret)))?;
    Ok(d)
}

/// The membership coordinator of an elastic job (what `mcp-coordinator` runs).
#[pyclass(frozen, module = "mcp_fast._core")]
pub struct Coordinator {
    server: CoordinatorServer,
}

#[pymethods]
impl Coordinator {
    /// Serves at `bind` (`HOST:PORT`; port 0 picks one) the members that hold `secret`.
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (bind, secret, min_members=1, dead_after=0.5, join_window=0.2, change_limit=60.0, rebuild_window=2.0))]
    fn new(
        py: Python<'_>,
        bind: &str,
        secret: Vec<u8>,
        min_members: usize,
        dead_after: f64,
        join_window: f64,
        change_limit: f64,
        rebuild_window: f64,
    ) -> PyResult<Coordinator> {
        let cfg = CoordinatorConfig {
            min_members,
            dead_after: seconds("dead_after", dead_after)?,
            join_window: seconds("join_window", join_window)?,
            change_limit: seconds("change_limit", change_limit)?,
            rebuild_window: seconds("rebuild_window", rebuild_window)?,
        };
        let addr = host_port(bind)?;
        let rt = runtime(py)?;
        let _enter = rt.enter();
        let server = CoordinatorServer::start(addr, &secret, cfg).map_err(|e| to_py(py, e))?;
        Ok(Coordinator { server })
    }

    /// The address members dial.
    #[getter]
    fn local_addr(&self) -> String {
        self.server.local_addr().to_string()
    }

    /// The latest epoch: `{"epoch", "incarnation", "members": [(id, step)], ...}` or None.
    fn epoch<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        match self.server.current() {
            Some(e) => Ok(Some(epoch_dict(py, &e, None, b"")?)),
            None => Ok(None),
        }
    }

    /// Counters: `live_members`, `refused_handshakes`, `requests`.
    fn stats(&self) -> std::collections::HashMap<&'static str, u64> {
        [
            ("live_members", self.server.live_members() as u64),
            ("refused_handshakes", self.server.refused_handshakes()),
            ("requests", self.server.requests()),
        ]
        .into_iter()
        .collect()
    }

    /// Stops serving and releases the socket.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let rt = runtime(py)?;
        py.detach(|| rt.block_on(self.server.close()));
        Ok(())
    }
}

/// One process's membership in an elastic job.
#[pyclass(frozen, module = "mcp_fast._core")]
pub struct ElasticMember {
    client: MemberClient,
    secret: Vec<u8>,
    coordinator: SocketAddr,
}

impl ElasticMember {
    /// The core client.
    pub(crate) fn client(&self) -> &MemberClient {
        &self.client
    }
}

#[pymethods]
impl ElasticMember {
    /// Registers with the coordinator at `coordinator` (`HOST:PORT`). `spec` names the
    /// training state (`name:dtype[shape];...`); a coordinator whose job has another refuses
    /// with `SpecMismatchError`.
    #[new]
    #[pyo3(signature = (coordinator, secret, spec, member_id, heartbeat=0.1, connect_timeout=30.0))]
    fn new(
        py: Python<'_>,
        coordinator: &str,
        secret: Vec<u8>,
        spec: String,
        member_id: u64,
        heartbeat: f64,
        connect_timeout: f64,
    ) -> PyResult<ElasticMember> {
        if secret.is_empty() {
            return Err(PyValueError::new_err(
                "an elastic job needs a job secret (MCP_SECRET or secret=...), the same on the coordinator and every member",
            ));
        }
        let addr = host_port(coordinator)?;
        let cfg = MemberConfig {
            coordinator: addr,
            secret: secret.clone(),
            id: member_id,
            spec,
            heartbeat: seconds("heartbeat", heartbeat)?,
            connect_timeout: seconds("connect_timeout", connect_timeout)?,
        };
        let rt = runtime(py)?;
        let client = block_on_or_signal(py, rt, std::pin::pin!(MemberClient::connect(cfg)))?
            .map_err(|e| to_py(py, e))?;
        Ok(ElasticMember {
            client,
            secret,
            coordinator: addr,
        })
    }

    /// This member's id.
    #[getter]
    fn id(&self) -> u64 {
        self.client.id()
    }

    /// The local IP address that reaches the coordinator (where rank 0 listens).
    #[getter]
    fn local_ip(&self, py: Python<'_>) -> PyResult<String> {
        mcp_core::transport::quic::local_ip_towards(self.coordinator)
            .map(|ip| ip.to_string())
            .map_err(|e| to_py(py, e))
    }

    /// Waits for an epoch newer than `seen` with this member in it; `step` is what this
    /// member has (-1: nothing). Returns the epoch with this member's `rank`, the heal plan
    /// (`source`, `takers`, `step`) and the data group's `group_secret`.
    fn report<'py>(
        &self,
        py: Python<'py>,
        seen: u64,
        step: i64,
        timeout: f64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let timeout = seconds("timeout", timeout)?;
        let rt = runtime(py)?;
        let e = block_on_or_signal(
            py,
            rt,
            std::pin::pin!(self.client.report(seen, step, timeout)),
        )?
        .map_err(|e| to_py(py, e))?;
        epoch_dict(py, &e, Some(self.client.id()), &self.secret)
    }

    /// Rank 0 of `epoch` publishes where it listens; False if the epoch was superseded.
    fn publish_master(
        &self,
        py: Python<'_>,
        epoch: u64,
        addr: &str,
        timeout: f64,
    ) -> PyResult<bool> {
        let addr = host_port(addr)?;
        let timeout = seconds("timeout", timeout)?;
        let rt = runtime(py)?;
        block_on_or_signal(
            py,
            rt,
            std::pin::pin!(self.client.publish_master(epoch, addr, timeout)),
        )?
        .map_err(|e| to_py(py, e))
    }

    /// As `publish_master`, without waiting (for the group's `on_bound` callback, which runs
    /// inside the runtime): a lost publication makes the others wait in `master` until the
    /// coordinator forms a newer epoch.
    fn announce_master(&self, py: Python<'_>, epoch: u64, addr: &str) -> PyResult<()> {
        let addr = host_port(addr)?;
        let client = self.client.clone();
        runtime(py)?.spawn(async move {
            let _ = client
                .publish_master(epoch, addr, std::time::Duration::from_secs(5))
                .await;
        });
        Ok(())
    }

    /// Where rank 0 of `epoch` listens, or None once the epoch was superseded.
    fn master(&self, py: Python<'_>, epoch: u64, timeout: f64) -> PyResult<Option<String>> {
        let timeout = seconds("timeout", timeout)?;
        let rt = runtime(py)?;
        block_on_or_signal(py, rt, std::pin::pin!(self.client.master(epoch, timeout)))?
            .map_err(|e| to_py(py, e))
    }

    /// Aborts `group` (its operations raise `GroupClosedError`) as soon as the coordinator
    /// says `epoch` is over.
    fn watch(&self, py: Python<'_>, epoch: u64, group: &ProcessGroup) -> PyResult<()> {
        let g = group.group.clone();
        let _rt = runtime(py)?.enter();
        self.client.watch(epoch, Box::new(move || g.abort()));
        Ok(())
    }

    /// Stops watching.
    fn unwatch(&self) {
        self.client.unwatch();
    }

    /// Forgets the epoch this member ran in (after it was expelled).
    fn forget_view(&self) {
        self.client.forget_view();
    }

    /// Records the steps committed; heartbeats carry it.
    fn set_step(&self, step: i64) {
        self.client.set_step(step);
    }

    /// The last heartbeat answer: `{"latest", "ending", "change_at", "member"}`, or None.
    fn beat<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(b) = self.client.beat() else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("latest", b.latest)?;
        d.set_item("ending", b.ending)?;
        d.set_item("change_at", b.change_at)?;
        d.set_item("member", b.member)?;
        Ok(Some(d))
    }

    /// Whether a member running in `epoch` must stop: the coordinator said it is over.
    fn epoch_over(&self, epoch: u64) -> bool {
        self.client.beat().is_some_and(|b| b.ends(epoch))
    }

    /// `(heartbeats answered, reconnections)`.
    fn counters(&self) -> (u64, u64) {
        self.client.counters()
    }

    /// Leaves the job.
    fn leave(&self, py: Python<'_>) -> PyResult<()> {
        let rt = runtime(py)?;
        py.detach(|| rt.block_on(self.client.leave()));
        Ok(())
    }
}

/// Adds the classes to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Coordinator>()?;
    m.add_class::<ElasticMember>()?;
    Ok(())
}
