//! The simulator's entry points for `mcp-sim`: one all-reduce, one rendezvous, or one
//! membership change, in virtual time.

use crate::errors::to_py;
use mcp_core::group::Algorithm;
use mcp_core::membership::coordinator::CoordinatorConfig;
use mcp_core::sim::{
    simulate_elastic, time_all_reduce, time_rendezvous, Cpus, ElasticPlan, EpochPlan, Fault,
    LinkSpec, SimConfig, Topology,
};
use mcp_core::wire::Codec;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::time::Duration;

fn secs(what: &str, s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s).map_err(|_| {
        PyValueError::new_err(format!(
            "{what} must be a non-negative number of seconds, got {s}"
        ))
    })
}

/// The hosts and links: `(Gbit/s, RTT s, overhead s)` inside and between hosts.
fn topology(
    ranks_per_host: usize,
    intra: (f64, f64, f64),
    inter: (f64, f64, f64),
    loss: f64,
) -> PyResult<Topology> {
    Ok(Topology {
        ranks_per_host,
        intra: LinkSpec::new(secs("intra_rtt_s", intra.1)?, intra.0 * 1e9 / 8.0)
            .with_overhead(secs("intra_overhead_s", intra.2)?),
        inter: LinkSpec::new(secs("inter_rtt_s", inter.1)?, inter.0 * 1e9 / 8.0)
            .with_loss(loss)
            .with_overhead(secs("inter_overhead_s", inter.2)?),
    })
}

/// Times one all-reduce of `nbytes` per rank (as float32 gradients) on a simulated network
/// and returns what it took: the algorithm that ran (`"auto"` resolved as a real group
/// resolves it for that size), virtual seconds, bytes per rank, frames, and whether the
/// result was exact. `intra_overhead_s` / `inter_overhead_s` add a fixed software time to
/// every frame's arrival on that kind of link (default 0). With `cores` > 0 the frames also
/// cost processor time, `*_cpu_tx` / `*_cpu_rx` nanoseconds per wire byte at the sending and
/// receiving end, on `cores` cores per machine shared by `ranks_per_machine` consecutive
/// ranks (0: every rank on one machine). `inter_burst_bytes` > 0 puts the links between
/// hosts behind a token-bucket shaper (`tc tbf`) of that burst over a line of
/// `inter_peak_gbps`. With `direct_reads` the ranks of a host read each other's tensors
/// where the algorithm does (hierarchical), as real processes do, each copy costing a core
/// `intra_cpu_rx` nanoseconds per byte. A
/// failed rank is found by the transport's own failure detector, with keep-alives every
/// `heartbeat_s`.
#[pyfunction]
#[pyo3(signature = (
    world, algorithm, nbytes, *, ranks_per_host=1, codec="none", block=256,
    intra_gbps=2400.0, intra_rtt_s=4e-6, inter_gbps=100.0, inter_rtt_s=20e-6, loss=0.0,
    seed=0, heartbeat_s=5.0, fail_rank=None, fail_at_s=0.0, timeout_s=86400.0,
    intra_overhead_s=0.0, inter_overhead_s=0.0, cores=0, ranks_per_machine=0,
    intra_cpu_tx=0.0, intra_cpu_rx=0.0, inter_cpu_tx=0.0, inter_cpu_rx=0.0,
    inter_burst_bytes=0.0, inter_peak_gbps=0.0, direct_reads=false
))]
#[allow(clippy::too_many_arguments)]
pub fn sim_all_reduce<'py>(
    py: Python<'py>,
    world: usize,
    algorithm: &str,
    nbytes: f64,
    ranks_per_host: usize,
    codec: &str,
    block: u32,
    intra_gbps: f64,
    intra_rtt_s: f64,
    inter_gbps: f64,
    inter_rtt_s: f64,
    loss: f64,
    seed: u64,
    heartbeat_s: f64,
    fail_rank: Option<usize>,
    fail_at_s: f64,
    timeout_s: f64,
    intra_overhead_s: f64,
    inter_overhead_s: f64,
    cores: usize,
    ranks_per_machine: usize,
    intra_cpu_tx: f64,
    intra_cpu_rx: f64,
    inter_cpu_tx: f64,
    inter_cpu_rx: f64,
    inter_burst_bytes: f64,
    inter_peak_gbps: f64,
    direct_reads: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let algorithm = Algorithm::from_name(algorithm).map_err(|e| to_py(py, e))?;
    let codec = Codec::from_name(codec, block).map_err(|e| to_py(py, e))?;
    let mut topology = topology(
        ranks_per_host,
        (intra_gbps, intra_rtt_s, intra_overhead_s),
        (inter_gbps, inter_rtt_s, inter_overhead_s),
        loss,
    )?;
    topology.intra = topology.intra.with_cpu(intra_cpu_tx, intra_cpu_rx);
    topology.inter = topology
        .inter
        .with_cpu(inter_cpu_tx, inter_cpu_rx)
        .with_bucket(inter_burst_bytes, inter_peak_gbps * 1e9 / 8.0);
    let mut cfg = SimConfig::new(world, topology);
    if cores > 0 {
        cfg.cpu = Some(Cpus {
            cores,
            ranks_per_machine: if ranks_per_machine == 0 {
                world
            } else {
                ranks_per_machine
            },
        });
    }
    cfg.seed = seed;
    cfg.direct_reads = direct_reads;
    cfg.heartbeat = secs("heartbeat_s", heartbeat_s)?;
    if let Some(rank) = fail_rank {
        cfg.faults.push(Fault::Rank {
            rank,
            at: secs("fail_at_s", fail_at_s)?,
        });
    }
    let timeout = secs("timeout_s", timeout_s)?;
    let t = py
        .detach(|| time_all_reduce(&cfg, algorithm, nbytes, codec, timeout))
        .map_err(|e| to_py(py, e))?;
    let d = PyDict::new(py);
    d.set_item("algorithm", t.algorithm.name())?;
    d.set_item("elapsed_s", t.elapsed.as_secs_f64())?;
    d.set_item("max_rank_bytes", t.max_rank_bytes)?;
    d.set_item("mean_rank_bytes", t.mean_rank_bytes)?;
    d.set_item("host_card_bytes", t.host_card_bytes)?;
    d.set_item("frames", t.frames)?;
    d.set_item("ok_ranks", t.ok_ranks)?;
    d.set_item("exact", t.exact)?;
    d.set_item("error", t.first_error.map(|e| e.to_string()))?;
    Ok(d)
}

/// Times the rendezvous of `world` ranks (every rank's Hello to rank 0, the table back to
/// each) on a simulated network and returns virtual seconds until the last rank had the
/// table, the table's bytes, the wire bytes rank 0 sent, the ranks that met, and the first
/// error (a rendezvous longer than `timeout_s` fails).
#[pyfunction]
#[pyo3(signature = (
    world, *, ranks_per_host=1, intra_gbps=2400.0, intra_rtt_s=4e-6, inter_gbps=100.0,
    inter_rtt_s=20e-6, loss=0.0, seed=0, timeout_s=600.0
))]
#[allow(clippy::too_many_arguments)]
pub fn sim_rendezvous<'py>(
    py: Python<'py>,
    world: usize,
    ranks_per_host: usize,
    intra_gbps: f64,
    intra_rtt_s: f64,
    inter_gbps: f64,
    inter_rtt_s: f64,
    loss: f64,
    seed: u64,
    timeout_s: f64,
) -> PyResult<Bound<'py, PyDict>> {
    let topology = topology(
        ranks_per_host,
        (intra_gbps, intra_rtt_s, 0.0),
        (inter_gbps, inter_rtt_s, 0.0),
        loss,
    )?;
    let mut cfg = SimConfig::new(world, topology);
    cfg.seed = seed;
    let timeout = secs("timeout_s", timeout_s)?;
    let t = py
        .detach(|| time_rendezvous(&cfg, timeout))
        .map_err(|e| to_py(py, e))?;
    let d = PyDict::new(py);
    d.set_item("elapsed_s", t.elapsed.as_secs_f64())?;
    d.set_item("table_bytes", t.table_bytes)?;
    d.set_item("rank0_bytes", t.rank0_bytes)?;
    d.set_item("ok_ranks", t.ok_ranks)?;
    d.set_item("error", t.first_error.map(|e| e.to_string()))?;
    Ok(d)
}

/// Times a membership change of an elastic job of `members` (plus the coordinator on a host
/// of its own), the protocol's every message a frame: the job forms, then the members of
/// one host die `die_after_s` into the first epoch; the coordinator finds them silent after
/// `dead_after_s` (heartbeats every `heartbeat_s`), or the survivors report earlier when
/// their collective fails (`fails_after_s`, if given) or their watch on the epoch says it
/// ended. Returns virtual seconds from the deaths until the last survivor had the next
/// epoch, until every member had the first, the bytes the coordinator sent (in all, and from
/// the deaths on), requests and frames, and whether every survivor was handed the same next
/// epoch of exactly the survivors.
#[pyfunction]
#[pyo3(signature = (
    members, *, ranks_per_host=1, intra_gbps=2400.0, intra_rtt_s=4e-6, inter_gbps=100.0,
    inter_rtt_s=20e-6, seed=0, heartbeat_s=0.1, dead_after_s=0.3, die_after_s=0.001,
    fails_after_s=None, limit_s=600.0
))]
#[allow(clippy::too_many_arguments)]
pub fn sim_membership_change<'py>(
    py: Python<'py>,
    members: usize,
    ranks_per_host: usize,
    intra_gbps: f64,
    intra_rtt_s: f64,
    inter_gbps: f64,
    inter_rtt_s: f64,
    seed: u64,
    heartbeat_s: f64,
    dead_after_s: f64,
    die_after_s: f64,
    fails_after_s: Option<f64>,
    limit_s: f64,
) -> PyResult<Bound<'py, PyDict>> {
    if ranks_per_host == 0
        || !members.is_multiple_of(ranks_per_host)
        || members < 2 * ranks_per_host
    {
        return Err(PyValueError::new_err(format!(
            "a membership change needs at least two whole hosts of members, got {members} \
             members at {ranks_per_host} per host"
        )));
    }
    let topology = topology(
        ranks_per_host,
        (intra_gbps, intra_rtt_s, 0.0),
        (inter_gbps, inter_rtt_s, 0.0),
        0.0,
    )?;
    // The coordinator is one more rank, alone on the host after the members'.
    let world = members + 1;
    let mut cfg = SimConfig::new(world, topology);
    cfg.seed = seed;
    cfg.trace = true; // to count what the coordinator sent for the change alone
    let host = members / ranks_per_host / 2;
    let die_after = secs("die_after_s", die_after_s)?;
    let dying: Vec<usize> = (host * ranks_per_host..(host + 1) * ranks_per_host).collect();
    let plan = ElasticPlan {
        coordinator: CoordinatorConfig {
            dead_after: secs("dead_after_s", dead_after_s)?,
            ..CoordinatorConfig::default()
        },
        heartbeat: secs("heartbeat_s", heartbeat_s)?,
        epochs: vec![
            EpochPlan {
                deaths: dying.iter().map(|&r| (r, die_after)).collect(),
                fails_after: fails_after_s
                    .map(|s| secs("fails_after_s", s))
                    .transpose()?,
            },
            EpochPlan::default(),
        ],
        limit: secs("limit_s", limit_s)?,
    };
    let run = py
        .detach(|| simulate_elastic(&cfg, &plan))
        .map_err(|e| to_py(py, e))?;
    let survivors: Vec<_> = run
        .members
        .iter()
        .enumerate()
        .filter(|(r, _)| !dying.contains(r))
        .map(|(_, l)| l)
        .collect();
    let first_s = run
        .members
        .iter()
        .filter_map(|l| l.formed_at.first())
        .max()
        .map(|d| d.as_secs_f64());
    let deaths_at = dying
        .iter()
        .filter_map(|&r| run.members[r].formed_at.first())
        .min()
        .map(|d| *d + die_after);
    let changed = survivors
        .iter()
        .map(|l| l.formed_at.get(1).copied())
        .collect::<Option<Vec<_>>>()
        .and_then(|v| v.into_iter().max());
    let next = survivors.first().and_then(|l| l.epochs.get(1));
    let agreed = next.is_some_and(|e| {
        e.members.len() == survivors.len()
            && survivors.iter().all(|l| l.epochs.get(1) == Some(e))
            && e.members.iter().all(|m| {
                let r = (m.id - mcp_core::sim::member_id(0)) as usize;
                !dying.contains(&r)
            })
    });
    let error = run
        .members
        .iter()
        .find_map(|l| l.error.as_ref())
        .map(|e| e.to_string())
        .or_else(|| {
            run.coordinator
                .hit_limit
                .then(|| format!("the job did not end within {limit_s} s"))
        });
    let d = PyDict::new(py);
    d.set_item(
        "change_s",
        changed.zip(deaths_at).map(|(c, a)| (c - a).as_secs_f64()),
    )?;
    d.set_item("first_epoch_s", first_s)?;
    d.set_item("agreed", agreed)?;
    d.set_item(
        "coordinator_bytes",
        run.report.wire_bytes.last().copied().unwrap_or(0.0),
    )?;
    let since = deaths_at.map_or(u64::MAX, |t| t.as_nanos() as u64);
    let change_bytes: u64 = run
        .report
        .trace
        .iter()
        .filter(|f| f.src == members && f.sent_ns >= since)
        .map(|f| f.wire_bytes)
        .sum();
    d.set_item("change_coordinator_bytes", change_bytes)?;
    d.set_item("requests", run.coordinator.requests)?;
    d.set_item("frames", run.report.frames)?;
    d.set_item("error", error)?;
    Ok(d)
}
