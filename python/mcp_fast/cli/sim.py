"""``mcp-sim``: how long would a training step take on a cluster we do not have?

::

    mcp-sim [--preset seed] [--nodes N] [--gpus-per-node G] [--params P] [--dtype bf16]
            [--intra-gbps 2400] [--inter-gbps 400] [--intra-rtt-us 4] [--inter-rtt-us 20]
            [--loss 0] [--compute-s 1.0] [--steps 1000] [--failure-rate 0.05]
            [--checkpoint {elastic,restart}] [--checkpoint-every 100] [--json]

Every all-reduce below is the real mcp_fast collective code run on a simulated network in
virtual time (``mcp_fast._core.sim_all_reduce``): real frames, real codecs, real failure
detection and abort fan-out, timed by a per-link model of latency, bandwidth (a FIFO queue per
link; a host's card shared by its GPUs), loss (the recovery delay a reliable stream pays) and
the frames' sizes scaled up from a small real buffer. What is composed here, in plain
arithmetic that ``docs/simulator.md`` spells out, is the strategy around those collectives:
hierarchical = intra-host all-reduce + inter-host ring on 1/G of the gradient (G rings sharing
each card); DiLoCo = one such all-reduce every H steps; failures = the simulated recovery (an
elastic job: the membership protocol's own change of epoch, ``_core.sim_membership_change``;
a restart: the abort, the restart and the reload) times the expected number of failures in a
training; checkpoints = their size over the disks' bandwidth. A ring too large to simulate
within ``--max-frames`` is simulated at two smaller sizes and extrapolated by the ring's cost
form (marked ``~``).

``mcp-sim validate [--data DIR] [--json OUT] [--seed N] [--shm-gbps 46.4]`` compares the
simulator's predictions with what ``benches/`` measured on one machine
(``docs/data/validation/hosts_clean.json``, ``hosts_1gbit.json``, ``loss.json``): it
calibrates a few link and processor figures openly from those files (see :func:`calibrate`),
predicts every measured row and prints measured, predicted and the error
(``docs/simulator.md``, "Validation").

Exit status: 0 on success, 2 on bad arguments or a failed simulation.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mcp_fast import _core
from mcp_fast.errors import MCPError

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
DAY_S = 86_400.0

#: The source documents' question: 1,000 nodes of 8 GPUs, 50B parameters, 5 % of the nodes
#: may fail, 100 full trainings a day. The link figures are a common H100 cluster's (NVLink
#: 4: 450 GB/s per GPU each way; 8 x 400 Gbit/s InfiniBand per node); a "full training" is
#: not defined there: 1,000 steps is our assumption, printed with the answer.
SEED_PRESET: dict[str, Any] = {
    "nodes": 1000,
    "gpus_per_node": 8,
    "params": 50e9,
    "dtype": "bf16",
    "intra_gbps": 3600.0,
    "inter_gbps": 3200.0,
    "intra_rtt_us": 4.0,
    "inter_rtt_us": 20.0,
    "failure_rate": 0.05,
    "steps": 1000,
    "compute_s": 0.5,
}


@dataclass
class Row:
    """One strategy's figures."""

    strategy: str
    comm_s: float
    step_s: float
    bytes_per_node: float
    failure_s: float
    checkpoint_s: float
    training_s: float
    trainings_per_day: float
    fits: bool
    note: str


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mcp-sim",
        description="Time training steps on a simulated cluster with the real collectives.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--preset", choices=["seed"], help="the source documents' 1,000 x 8-GPU question"
    )
    p.add_argument("--nodes", type=int, default=16, help="hosts")
    p.add_argument("--gpus-per-node", type=int, default=8, help="ranks per host")
    p.add_argument("--params", type=float, default=1e9, help="model parameters")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16", help="gradient dtype")
    p.add_argument(
        "--intra-gbps", type=float, default=3600.0, help="Gbit/s between two GPUs of a host"
    )
    p.add_argument(
        "--inter-gbps", type=float, default=400.0, help="Gbit/s of a host's network card"
    )
    p.add_argument("--intra-rtt-us", type=float, default=4.0, help="round trip inside a host, µs")
    p.add_argument("--inter-rtt-us", type=float, default=20.0, help="round trip between hosts, µs")
    p.add_argument("--loss", type=float, default=0.0, help="packet loss between hosts (0..0.9)")
    p.add_argument("--compute-s", type=float, default=1.0, help="forward+backward time per step, s")
    p.add_argument("--steps", type=int, default=1000, help="steps in one full training")
    p.add_argument(
        "--failure-rate", type=float, default=0.05, help="fraction of the nodes that fail per day"
    )
    p.add_argument(
        "--heartbeat-s",
        type=float,
        default=5.0,
        help="keep-alive interval of the failure detector, s (a silent node is lost after"
        " 2 intervals + max(interval/4, 1.3 RTT))",
    )
    p.add_argument(
        "--member-heartbeat-s",
        type=float,
        default=0.1,
        help="elastic jobs: interval of each member's heartbeat to the coordinator, s",
    )
    p.add_argument(
        "--dead-after-s",
        type=float,
        default=0.3,
        help="elastic jobs: the coordinator declares a member silent this long dead, s",
    )
    p.add_argument(
        "--checkpoint",
        choices=["elastic", "restart"],
        default="elastic",
        help="elastic: survivors go on; restart: reload the last checkpoint",
    )
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    p.add_argument(
        "--checkpoint-bytes-per-param",
        type=float,
        default=12.0,
        help="full checkpoint size per parameter (fp32 weights + Adam moments: 12)",
    )
    p.add_argument(
        "--delta-ratio",
        type=float,
        default=0.3,
        help="size of a delta checkpoint relative to a full one",
    )
    p.add_argument(
        "--disk-gbps", type=float, default=16.0, help="Gbit/s each node writes to storage"
    )
    p.add_argument("--restart-s", type=float, default=120.0, help="time to restart a job, s")
    p.add_argument("--diloco-h", type=int, default=32, help="DiLoCo: inner steps per outer sync")
    p.add_argument("--seed", type=int, default=0, help="seed of the links' randomness")
    p.add_argument(
        "--max-frames",
        type=float,
        default=2.5e6,
        help="largest simulation (frames); larger rings are extrapolated",
    )
    p.add_argument(
        "--max-meet",
        type=int,
        default=16384,
        help="largest simulated rendezvous (ranks); larger ones are extrapolated",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def _sim(world: int, algorithm: str, nbytes: float, **kw: Any) -> dict[str, Any]:
    out = _core.sim_all_reduce(world, algorithm, nbytes, **kw)
    if out["error"] is not None:
        raise MCPError(
            f"the simulated {algorithm} all-reduce on {world} ranks failed: {out['error']}"
        )
    if not out["exact"]:
        raise MCPError(f"the simulated {algorithm} all-reduce on {world} ranks gave a wrong result")
    return out


def _ring(
    world: int, nbytes: float, group: int, max_frames: float, **kw: Any
) -> tuple[dict[str, Any], str]:
    """A ring all-reduce, simulated whole or, beyond ``max_frames``, extrapolated from two
    smaller rings (multiples of ``group``) by T(W) = a·2(W-1) + b·2(W-1)/W."""
    if world * 2 * (world - 1) <= max_frames or world <= 4 * group:
        return _sim(world, "ring", nbytes, ranks_per_host=group, **kw), ""
    w1 = max(2 * group, int(math.sqrt(max_frames / 2)) // group * group)
    w2 = max(group, w1 // 2 // group * group)
    r1 = _sim(w1, "ring", nbytes, ranks_per_host=group, **kw)
    r2 = _sim(w2, "ring", nbytes, ranks_per_host=group, **kw)
    # Solve t = a*x + b*y for the two sizes, x = 2(W-1), y = 2(W-1)/W.
    x1, y1, x2, y2 = 2 * (w1 - 1), 2 * (w1 - 1) / w1, 2 * (w2 - 1), 2 * (w2 - 1) / w2
    det = x1 * y2 - x2 * y1
    a = (r1["elapsed_s"] * y2 - r2["elapsed_s"] * y1) / det
    b = (x1 * r2["elapsed_s"] - x2 * r1["elapsed_s"]) / det
    est = dict(r1)
    est["elapsed_s"] = a * 2 * (world - 1) + b * 2 * (world - 1) / world
    est["mean_rank_bytes"] = r1["mean_rank_bytes"] * (2 * (world - 1) / world) / y1
    est["host_card_bytes"] = r1["host_card_bytes"] * (2 * (world - 1) / world) / y1
    return est, f"~ extrapolated from rings of {w1} and {w2}"


def _meet(world: int, group: int, **kw: Any) -> dict[str, Any]:
    out = _core.sim_rendezvous(world, ranks_per_host=group, **kw)
    if out["error"] is not None:
        raise MCPError(f"the simulated rendezvous of {world} ranks failed: {out['error']}")
    return out


def _extrapolated(
    simulate: Any,
    world: int,
    group: int,
    max_ranks: int,
    key: str,
    bytes_key: str,
    quadratic: bool = True,
) -> tuple[dict[str, Any], str]:
    """``simulate(world)`` whole up to ``max_ranks``; beyond, extrapolated from two smaller
    worlds by T(W) = a + b·x(W) for ``key`` and B(W) ∝ x(W) for ``bytes_key``, where x(W) is
    W(W-G) when one process (rank 0) sends a message of W lines to each of the W - G ranks
    on other hosts, and W when what it sends each grows no more with W."""
    if world <= max_ranks:
        return simulate(world), ""
    w1 = max(2 * group, max_ranks // group * group)
    w2 = max(group, w1 // 2 // group * group)
    r1, r2 = simulate(w1), simulate(w2)

    def x(w: int) -> float:
        return float(w * (w - group)) if quadratic else float(w)

    b = (r1[key] - r2[key]) / (x(w1) - x(w2))
    a = r1[key] - b * x(w1)
    est = dict(r1)
    est[key] = a + b * x(world)
    est[bytes_key] = r1[bytes_key] * x(world) / x(w1)
    return est, f"~ extrapolated from {w1} and {w2} ranks"


def _rendezvous(world: int, group: int, max_ranks: int, **kw: Any) -> tuple[dict[str, Any], str]:
    """The rendezvous (every Hello to rank 0, the table back to each rank), simulated whole up
    to ``max_ranks`` (8,000 ranks take a fraction of a second) and beyond it extrapolated
    (:func:`_extrapolated`)."""
    est, note = _extrapolated(
        lambda w: _meet(w, group, **kw), world, group, max_ranks, "elapsed_s", "rank0_bytes"
    )
    if note:
        est["table_bytes"] = est["table_bytes"] * world / max(2 * group, max_ranks // group * group)
        est["ok_ranks"] = world
    return est, note


def _membership_change(
    world: int, group: int, max_ranks: int, **kw: Any
) -> tuple[dict[str, Any], str]:
    """An elastic job losing a node: the membership protocol (every member's session, the
    coordinator's service, every message a frame) from the node's death until every survivor
    holds the next epoch; simulated whole up to ``max_ranks`` members (8,000 take about 15 s),
    beyond extrapolated (:func:`_extrapolated`, linearly: each survivor is sent the change
    from the epoch it holds, a size that does not grow with the job)."""

    def simulate(w: int) -> dict[str, Any]:
        out = _core.sim_membership_change(w, ranks_per_host=group, **kw)
        if out["error"] is not None or not out["agreed"] or out["change_s"] is None:
            raise MCPError(f"the simulated membership change of {w} members failed: {out}")
        return out

    return _extrapolated(
        simulate, world, group, max_ranks, "change_s", "change_coordinator_bytes", False
    )


def _settings(args: argparse.Namespace) -> argparse.Namespace:
    if args.preset == "seed":
        defaults = build_parser().parse_args([])
        for k, v in SEED_PRESET.items():
            if getattr(args, k) == getattr(defaults, k):
                setattr(args, k, v)
    for name in ("nodes", "gpus_per_node", "steps", "checkpoint_every", "diloco_h"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("params", "compute_s", "disk_gbps", "member_heartbeat_s", "dead_after_s"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    if not 0 <= args.failure_rate <= 1:
        raise ValueError("--failure-rate is a fraction of the nodes per day, between 0 and 1")
    return args


def run(args: argparse.Namespace) -> tuple[list[Row], dict[str, Any]]:
    """Simulates every strategy; returns its rows and the facts they rest on."""
    n, g = args.nodes, args.gpus_per_node
    grad = args.params * DTYPE_BYTES[args.dtype]
    link = {
        "intra_gbps": args.intra_gbps,
        "inter_gbps": args.inter_gbps,
        "intra_rtt_s": args.intra_rtt_us * 1e-6,
        "inter_rtt_s": args.inter_rtt_us * 1e-6,
        "loss": args.loss,
        "seed": args.seed,
        "heartbeat_s": args.heartbeat_s,
    }
    # The inter-host phase of the hierarchical all-reduce: G rings of N nodes, one per local
    # GPU, each on 1/G of the gradient and 1/G of the card.
    inter = dict(link, inter_gbps=args.inter_gbps / g)
    intra = _sim(g, "ring", grad, ranks_per_host=g, **link) if g > 1 else None
    intra_s = intra["elapsed_s"] if intra else 0.0

    comm: list[tuple[str, float, float, str]] = []  # (strategy, seconds, bytes per node, note)
    flat, note = _ring(n * g, grad, g, args.max_frames, **link)
    comm.append(("flat ring", flat["elapsed_s"], flat["host_card_bytes"], note))
    if n * g * 2 * 16 <= args.max_frames * 4:
        tree = _sim(n * g, "tree", grad, ranks_per_host=g, **link)
        comm.append(("flat tree", tree["elapsed_s"], tree["host_card_bytes"], ""))
    hier_s = {}
    codecs = ["none", "fp16", "int8"] if args.dtype == "fp32" else ["none", "int8"]
    for codec in codecs:
        # Codecs take float32 gradients: with a 2-byte dtype, int8 halves the bytes.
        nbytes = grad / g if codec == "none" else args.params * 4 / g
        r, note = _ring(n, nbytes, 1, args.max_frames, codec=codec, **inter)
        name = "hierarchical" if codec == "none" else f"hierarchical + {codec}"
        t = intra_s + r["elapsed_s"]
        hier_s[codec] = t
        comm.append((name, t, r["host_card_bytes"] * g, note))
    best = min(hier_s, key=lambda c: hier_s[c])
    h = args.diloco_h
    wanted = {"hierarchical", f"hierarchical + {best}"}
    for name, t, b, note in list(comm):
        if name in wanted:
            comm.append((f"DiLoCo H={h} ({name})", t / h, b / h, note))

    # A node failing mid all-reduce: the real detector and abort fan-out, in the inter ring.
    fail_n = min(n, 256)
    failed = _core.sim_all_reduce(
        fail_n, "ring", grad / g, ranks_per_host=1, fail_rank=fail_n // 2, fail_at_s=1e-3, **inter
    )
    abort_s = failed["elapsed_s"] - 1e-3
    # Forming the job (and each new epoch or restart after a failure): the real rendezvous.
    meet_link = {k: v for k, v in link.items() if k != "heartbeat_s"}
    meet, meet_note = _rendezvous(n * g, g, args.max_meet, **meet_link)
    # An elastic job losing a node: the real membership protocol until every survivor holds
    # the next epoch (their watch on the epoch ends it before the transport's detector does).
    change, change_note = None, ""
    if args.checkpoint == "elastic" and n >= 2:
        member_link = {k: v for k, v in meet_link.items() if k != "loss"}
        change, change_note = _membership_change(
            n * g,
            g,
            args.max_meet,
            heartbeat_s=args.member_heartbeat_s,
            dead_after_s=args.dead_after_s,
            fails_after_s=abort_s,
            **member_link,
        )
    ckpt_bytes = args.params * args.checkpoint_bytes_per_param
    full_write_s = ckpt_bytes / (n * args.disk_gbps * 1e9 / 8)
    delta_write_s = full_write_s * args.delta_ratio
    facts = {
        "gradient_bytes": grad,
        "intra_host_all_reduce_s": intra_s,
        "abort_after_failure_s": abort_s,
        "abort_errors": fail_n - failed["ok_ranks"],
        "rendezvous_s": meet["elapsed_s"],
        "rendezvous_table_bytes": meet["table_bytes"],
        "rendezvous_rank0_bytes": meet["rank0_bytes"],
        "rendezvous_note": meet_note,
        "epoch_change_s": change["change_s"] if change else None,
        "epoch_change_coordinator_bytes": change["change_coordinator_bytes"] if change else None,
        "epoch_change_note": change_note,
        "checkpoint_full_bytes": ckpt_bytes,
        "checkpoint_delta_bytes": ckpt_bytes * args.delta_ratio,
        "checkpoint_full_write_s": full_write_s,
        "checkpoint_delta_write_s": delta_write_s,
        "failures_per_day": n * args.failure_rate,
        "steps_per_training": args.steps,
    }
    rows = []
    for name, t, b, note in comm:
        step = args.compute_s + t
        ckpts = args.steps / args.checkpoint_every
        ckpt_s = full_write_s + max(0.0, ckpts - 1) * delta_write_s
        base = args.steps * step + ckpt_s
        # Survivors meet again in a new epoch (or the restarted job meets) and redo work.
        if args.checkpoint == "elastic":
            recovered = change["change_s"] if change else abort_s
            per_failure = recovered + meet["elapsed_s"] + step
        else:
            per_failure = (
                abort_s
                + args.restart_s
                + meet["elapsed_s"]
                + full_write_s
                + step * args.checkpoint_every / 2
            )
        failures = n * args.failure_rate * base / DAY_S
        lost = failures * per_failure
        total = base + lost
        rows.append(
            Row(name, t, step, b, lost, ckpt_s, total, DAY_S / total, DAY_S / total >= 100, note)
        )
    return rows, facts


def _si(x: float, unit: str) -> str:
    for p, f in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= f:
            return f"{x / f:.2f} {p}{unit}"
    return f"{x:.0f} {unit}"


def _print(args: argparse.Namespace, rows: list[Row], facts: dict[str, Any]) -> None:
    print(
        f"{args.nodes} nodes x {args.gpus_per_node} GPUs, {args.params:.3g} parameters"
        f" ({args.dtype}), intra-host {args.intra_gbps:g} Gbit/s, card {args.inter_gbps:g}"
        f" Gbit/s, RTT {args.inter_rtt_us:g} µs, loss {args.loss:g}, compute"
        f" {args.compute_s:g} s/step, {args.steps} steps per training,"
        f" {facts['failures_per_day']:.0f} node failures a day"
    )
    cols = ["comm/step", "step", "card bytes/step", "lost to failures", "ckpt", "training"]
    widths = [10, 9, 16, 17, 8, 10]
    head = " ".join(f"{c:>{w}}" for c, w in zip(cols, widths, strict=True))
    print(f"{'strategy':<34} {head} {'per day':>8}  fits 100/day")
    for r in rows:
        cells = [
            f"{r.comm_s:.3f}s",
            f"{r.step_s:.3f}s",
            _si(r.bytes_per_node, "B"),
            f"{r.failure_s:.1f}s",
            f"{r.checkpoint_s:.1f}s",
            f"{r.training_s:.0f}s",
        ]
        line = " ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True))
        fits = "yes" if r.fits else "no"
        print(f"{r.strategy:<34} {line} {r.trainings_per_day:>8.1f}  {fits} {r.note}".rstrip())
    print(
        "a failure mid all-reduce: every survivor aborted"
        f" {facts['abort_after_failure_s']:.2f} s after it (heartbeat {args.heartbeat_s:g} s);"
        f" checkpoint {_si(facts['checkpoint_full_bytes'], 'B')} full,"
        f" {_si(facts['checkpoint_delta_bytes'], 'B')} delta, written in"
        f" {facts['checkpoint_full_write_s']:.2f} s / {facts['checkpoint_delta_write_s']:.2f} s"
    )
    if facts["epoch_change_s"] is not None:
        sent = _si(facts["epoch_change_coordinator_bytes"], "B")
        line = (
            f"a node failing in the elastic job: every survivor held the next epoch"
            f" {facts['epoch_change_s'] * 1e3:.0f} ms after (the coordinator's silence limit"
            f" {args.dead_after_s:g} s, heartbeats every {args.member_heartbeat_s:g} s;"
            f" the coordinator sent {sent} meanwhile) {facts['epoch_change_note']}"
        )
        print(line.rstrip())
    table = _si(facts["rendezvous_table_bytes"], "B")
    print(
        f"forming the job: {args.nodes * args.gpus_per_node} ranks meet in"
        f" {facts['rendezvous_s'] * 1e3:.1f} ms (rank 0 sends"
        f" {_si(facts['rendezvous_rank0_bytes'], 'B')}, a table of {table} to each rank)"
        f" {facts['rendezvous_note']}".rstrip()
    )
    fit = [r for r in rows if r.fits]
    best = min(rows, key=lambda r: r.training_s)
    if fit:
        print(f"recommended: {best.strategy} ({best.trainings_per_day:.0f} trainings a day)")
    else:
        max_steps = int((DAY_S / 100) / best.step_s)
        print(
            f"no strategy fits 100 trainings a day; the best, {best.strategy}, fits"
            f" {best.trainings_per_day:.1f}: 100 a day allows ~{max_steps} steps per training"
        )


# --- validation against the benchmarks' measurements ------------------------------------

#: The measurement files ``mcp-sim validate`` reads, and the commands that wrote them.
DATA_FILES = {
    "hosts_clean": "sudo python benches/bench_hosts.py --limits --per-host 1 2 --json ...",
    "hosts_1gbit": "sudo python benches/bench_hosts.py --limits --rate 1gbit --per-host 1 2 ...",
    "loss": "sudo python benches/bench_loss.py --worlds 2 4 --mib 16 --losses 0 0.05 0.2 ...",
}
#: Predictions within this share of the measurement count as matching (issue 16).
TOLERANCE = 0.15
#: Shared memory between two ranks of one host: the bus bandwidth docs/shared-memory.md
#: measured for a 64 MiB all-reduce of 2 ranks on this machine reading each other's tensors
#: directly (5.80 GB/s). No file under docs/data holds it, so it is an input, printed with
#: the calibration.
SHM_GBPS = 46.4
#: The share of one rank's processor time that the collective's own work takes beside QUIC's
#: in a 64 MiB all-reduce between the veth hosts: CRC32C 8.3 %, the reduction 2.1 %, the
#: copies into and out of the collective's buffers 8.3 % (``perf record --call-graph dwarf``
#: on rank 0, 2026-12-04, docs/simulator.md). An input, printed with the calibration.
APP_CPU_SHARE = 0.19
#: A veth or loopback "link" is a copy inside the kernel, whose cost is in the processors'
#: time per byte: as a link it is never the limit.
KERNEL_LINK_GBPS = 1000.0


def default_data_dir() -> Path:
    """``docs/data/validation`` of the source tree this module is in: the three files, measured
    on one machine on one day."""
    return Path(__file__).resolve().parents[3] / "docs" / "data" / "validation"


@dataclass
class Calibration:
    """The simulator's figures for this machine, and where each comes from."""

    cores: int
    quic_cpu_ns: float
    app_cpu_ns: float
    veth_rtt_s: float
    veth_1g_gbps: float
    veth_1g_rtt_s: float
    veth_1g_burst_bytes: float
    overhead_s: float
    shm_gbps: float
    shm_overhead_s: float
    loopback_cpu_ns: float
    loopback_rtt_s: float
    sources: dict[str, str] = field(default_factory=dict)


@dataclass
class ValidationRow:
    """One measured configuration and the simulator's prediction of it."""

    source: str
    world: int
    ranks_per_host: int
    nbytes: int
    loss: float
    algorithm: str
    measured_s: float
    predicted_s: float
    error: float
    within: bool
    role: str  # "prediction", or "fit" for a row a calibration figure was taken from


@dataclass
class Validation:
    """What ``mcp-sim validate`` found."""

    calibration: Calibration
    rows: list[ValidationRow]

    def predictions(self) -> list[ValidationRow]:
        return [r for r in self.rows if r.role == "prediction"]

    def within(self) -> int:
        return sum(r.within for r in self.predictions())


def _load(data_dir: Path, name: str) -> dict[str, Any]:
    path = data_dir / f"{name}.json"
    if not path.is_file():
        raise ValueError(
            f"no measurements at {path}: pass --data DIR holding {', '.join(DATA_FILES)}"
            f" (.json), written by {DATA_FILES[name]}"
        )
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the measurements in {path}: {e}") from e
    rows = doc.get("rows") if isinstance(doc, dict) else None
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{path} holds no rows of measurements")
    doc["_path"] = str(path)
    return doc


def _num(doc: dict[str, Any], where: dict[str, Any], key: str) -> float:
    v = where.get(key)
    if not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{doc['_path']}: {key} must be a positive number, got {v!r}")
    return float(v)


def _predict(
    cal: Calibration, link: str, world: int, per_host: int, nbytes: float, loss: float, seed: int
) -> dict[str, Any]:
    """One all-reduce as the benchmark ran it: every rank on one machine of ``cal.cores``
    cores; QUIC frames cost both ends QUIC's and the collective's processor time per byte,
    shared-memory frames cost their receiver a copy at the measured bus bandwidth."""
    quic = cal.quic_cpu_ns + cal.app_cpu_ns
    burst = 0.0
    if link == "loopback":
        gbps, rtt, quic = KERNEL_LINK_GBPS, cal.loopback_rtt_s, cal.loopback_cpu_ns
    elif link == "veth_1g":
        # tbf's bucket lets a burst through at the veth's own speed, then holds the rate.
        gbps, rtt, burst = cal.veth_1g_gbps, cal.veth_1g_rtt_s, cal.veth_1g_burst_bytes
    else:
        gbps, rtt = KERNEL_LINK_GBPS, cal.veth_rtt_s
    return _sim(
        world,
        "auto",
        nbytes,
        ranks_per_host=per_host,
        intra_gbps=KERNEL_LINK_GBPS,
        intra_overhead_s=cal.shm_overhead_s,
        inter_gbps=gbps,
        inter_rtt_s=rtt,
        inter_overhead_s=cal.overhead_s,
        loss=loss,
        seed=seed,
        timeout_s=3600.0,
        cores=cal.cores,
        ranks_per_machine=world,
        intra_cpu_rx=8.0 / cal.shm_gbps,
        inter_cpu_tx=quic,
        inter_cpu_rx=quic,
        inter_burst_bytes=burst,
        inter_peak_gbps=KERNEL_LINK_GBPS if burst else 0.0,
        direct_reads=True,
    )


def _solve(simulate: Any, measured: float, x1: float, what: str) -> float:
    """The ``x >= 0`` at which ``simulate(x)`` (a time that grows with x, close to linearly)
    takes ``measured``: a line through two simulations, then a few secant steps, since
    cores booked frame by frame make it not quite a line."""
    t0, t1 = simulate(0.0), simulate(x1)
    if not (t1 > t0 and measured > t0):
        raise ValueError(
            f"{what}: the measured {measured:.6f} s is not above the simulator's fixed costs"
            f" ({t0:.6f} s): nothing fits it"
        )
    (xa, ta), (xb, tb) = (0.0, t0), (x1, t1)
    for _ in range(4):
        x = max(0.0, xb + (measured - tb) * (xb - xa) / (tb - ta))
        t = simulate(x)
        if abs(t - measured) <= measured * 1e-4 or t == tb:
            return x
        (xa, ta), (xb, tb) = (xb, tb), (x, t)
    return x


def _smallest(doc: dict[str, Any], per_host: int) -> dict[str, Any]:
    """The row an overhead is fitted to: the smallest size with ``per_host`` ranks per host."""
    rows = [r for r in doc["rows"] if r.get("per_host") == per_host]
    if not rows:
        raise ValueError(f"{doc['_path']}: no row with {per_host} rank(s) per host")
    return min(rows, key=lambda r: _num(doc, r, "bytes"))


def calibrate(data: dict[str, dict[str, Any]], *, shm_gbps: float, seed: int) -> Calibration:
    """The figures the simulator takes from the measurement files, never from a row it then
    predicts. From each file's meta (path limits measured without the collectives): the
    cores, QUIC's processor time per byte — a plain quinn transfer each way while both ways
    run, on the cores both ends share: 2 x 2 ends x c per byte over 2 cores, so c = 1 / (2 x
    its rate) — and the paths' RTTs (4 KiB UDP ping-pong) and the 1 Gbit/s path's rate. The
    collective's own share of the processors is ``APP_CPU_SHARE`` (a profile) and shared
    memory ``shm_gbps``. Three figures are fitted, each to one row that is then not counted:
    the per-frame software overhead of QUIC links to the smallest row with one rank per host
    (one exchange), that of shared memory to the smallest with two, and loopback's processor
    time per byte to the clean (0 %) row of 2 ranks in ``loss.json``."""
    clean, capped, loss = data["hosts_clean"], data["hosts_1gbit"], data["loss"]
    for doc in (clean, capped):
        if not isinstance(doc.get("meta"), dict):
            raise ValueError(f"{doc['_path']} has no meta with the path's limits")
    meta = clean["meta"]
    cores = int(_num(clean, meta, "cpus"))
    both_ways_bytes_s = _num(clean, meta, "quic_both_ways_gbit_s") * 1e9 / 8
    quic_cpu_ns = 1e9 * cores / 4 / both_ways_bytes_s
    cal = Calibration(
        cores=cores,
        quic_cpu_ns=quic_cpu_ns,
        app_cpu_ns=quic_cpu_ns * APP_CPU_SHARE / (1 - APP_CPU_SHARE),
        veth_rtt_s=_num(clean, meta, "ping_median_s"),
        veth_1g_gbps=_num(capped, capped["meta"], "quic_both_ways_gbit_s"),
        veth_1g_rtt_s=_num(capped, capped["meta"], "ping_median_s"),
        veth_1g_burst_bytes=_num(capped, capped["meta"], "tbf_burst_bytes"),
        overhead_s=0.0,
        shm_gbps=shm_gbps,
        shm_overhead_s=0.0,
        loopback_cpu_ns=quic_cpu_ns,
        loopback_rtt_s=_num(clean, meta, "ping_median_s"),
    )

    def with_(**kw: float) -> Calibration:
        return Calibration(**{**asdict(cal), **kw})

    one, two = _smallest(clean, 1), _smallest(clean, 2)
    n1, n2 = _num(clean, one, "bytes"), _num(clean, two, "bytes")
    cal.overhead_s = _solve(
        lambda x: _predict(with_(overhead_s=x), "veth", 2, 1, n1, 0.0, seed)["elapsed_s"],
        _num(clean, one, "mcp_s"),
        1e-4,
        f"the {n1:.0f}-byte row of 1 rank per host",
    )
    cal.shm_overhead_s = _solve(
        lambda x: _predict(with_(shm_overhead_s=x), "veth", 4, 2, n2, 0.0, seed)["elapsed_s"],
        _num(clean, two, "mcp_s"),
        1e-4,
        f"the {n2:.0f}-byte row of 2 ranks per host",
    )
    row = next((r for r in loss["rows"] if r.get("world") == 2 and r.get("loss") == 0), None)
    if row is None:
        raise ValueError(f"{loss['_path']}: no clean (loss 0) row for 2 ranks")
    nbytes = _num(loss, row, "mib") * (1 << 20)
    cal.loopback_cpu_ns = _solve(
        lambda x: _predict(with_(loopback_cpu_ns=x), "loopback", 2, 1, nbytes, 0.0, seed)[
            "elapsed_s"
        ],
        _num(loss, row, "auto"),
        1.0,
        "the clean loopback row of 2 ranks",
    )
    cal.sources = {
        "cores": "hosts_clean meta cpus: both network-namespace hosts are one machine",
        "quic_cpu_ns": "hosts_clean meta quic_both_ways_gbit_s (plain quinn, both ways at"
        " once): cores / 4 / rate",
        "app_cpu_ns": f"APP_CPU_SHARE {APP_CPU_SHARE:.0%} of a rank's processor time (a profile)",
        "veth_rtt_s": "hosts_clean meta ping_median_s (UDP ping-pong of 4 KiB)",
        "veth_1g_gbps": "hosts_1gbit meta quic_both_ways_gbit_s",
        "veth_1g_rtt_s": "hosts_1gbit meta ping_median_s",
        "veth_1g_burst_bytes": "hosts_1gbit meta tbf_burst_bytes (the shaper's bucket)",
        "overhead_s": f"fitted: hosts_clean, 1 rank/host, {one['bytes']} B",
        "shm_gbps": "docs/shared-memory.md: 5.80 GB/s bus bandwidth, 2 ranks, 64 MiB, direct reads",
        "shm_overhead_s": f"fitted: hosts_clean, 2 ranks/host, {two['bytes']} B",
        "loopback_cpu_ns": "fitted: loss.json, the 0 % loss row of 2 ranks",
        "loopback_rtt_s": "the veth's ping_median_s (loopback's own was not measured)",
    }
    return cal


def validate(
    data_dir: str | Path | None = None, *, seed: int = 0, shm_gbps: float = SHM_GBPS
) -> Validation:
    """Calibrates the simulator from the measurements in ``data_dir`` (default: the source
    tree's ``docs/data/validation``) and predicts every measured mcp_fast row. Raises
    ``ValueError`` naming the file when a measurement file is missing or malformed."""
    if not (math.isfinite(shm_gbps) and shm_gbps > 0):
        raise ValueError(f"--shm-gbps must be positive, got {shm_gbps}")
    root = Path(data_dir) if data_dir is not None else default_data_dir()
    if not root.is_dir():
        raise ValueError(
            f"no measurement directory at {root}: pass --data DIR holding"
            f" {', '.join(f'{n}.json' for n in DATA_FILES)}"
        )
    data = {name: _load(root, name) for name in DATA_FILES}
    cal = calibrate(data, shm_gbps=shm_gbps, seed=seed)
    # The rows a calibration figure was taken from: (file, world, ranks per host, bytes, loss).
    clean = data["hosts_clean"]
    fit_rows = {("hosts_clean", 2 * k, k, int(_smallest(clean, k)["bytes"]), 0.0) for k in (1, 2)}
    fit_rows |= {
        ("loss", 2, 1, int(r["mib"] * (1 << 20)), 0.0)
        for r in data["loss"]["rows"]
        if r.get("loss") == 0 and r.get("world") == 2
    }
    cases: list[tuple[str, str, int, int, int, float, float]] = []
    for name, link in (("hosts_clean", "veth"), ("hosts_1gbit", "veth_1g")):
        doc = data[name]
        for r in doc["rows"]:
            per_host = int(_num(doc, r, "per_host"))
            nbytes = int(_num(doc, r, "bytes"))
            cases.append((name, link, 2 * per_host, per_host, nbytes, 0.0, _num(doc, r, "mcp_s")))
    for r in data["loss"]["rows"]:
        nbytes = int(_num(data["loss"], r, "mib") * (1 << 20))
        lost = r.get("loss")
        if not isinstance(lost, int | float) or not 0 <= lost <= 0.9:
            raise ValueError(f"{data['loss']['_path']}: loss must be in [0, 0.9], got {lost}")
        measured = _num(data["loss"], r, "auto")
        world = int(_num(data["loss"], r, "world"))
        cases.append(("loss", "loopback", world, 1, nbytes, float(lost), measured))
    rows = []
    for name, link, world, per_host, nbytes, lost, measured in cases:
        out = _predict(cal, link, world, per_host, nbytes, lost, seed)
        predicted = out["elapsed_s"]
        err = (predicted - measured) / measured
        role = "fit" if (name, world, per_host, nbytes, lost) in fit_rows else "prediction"
        rows.append(
            ValidationRow(
                name,
                world,
                per_host,
                nbytes,
                lost,
                out["algorithm"],
                measured,
                predicted,
                err,
                abs(err) <= TOLERANCE,
                role,
            )
        )
    return Validation(cal, rows)


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _print_validation(v: Validation) -> None:
    c = v.calibration
    print("calibration (everything else is predicted):")
    print(
        f"  {c.cores} cores shared by every rank; processor time per wire byte at each end:"
        f" QUIC {c.quic_cpu_ns:.3f} ns + the collective's {c.app_cpu_ns:.3f} ns,"
        f" QUIC on loopback {c.loopback_cpu_ns:.3f} ns (fitted),"
        f" shared memory {8 / c.shm_gbps:.3f} ns at the receiver ({c.shm_gbps:g} Gbit/s)"
    )
    print(f"  veth RTT {c.veth_rtt_s * 1e6:.1f} µs; loopback RTT {c.loopback_rtt_s * 1e6:.1f} µs")
    print(
        f"  veth at 1 Gbit/s {c.veth_1g_gbps:.3f} Gbit/s, RTT {c.veth_1g_rtt_s * 1e6:.1f} µs,"
        f" tbf burst {c.veth_1g_burst_bytes / 1024:.0f} KiB at the veth's speed"
    )
    print(
        f"  software overhead per frame (fitted): QUIC {c.overhead_s * 1e6:.1f} µs,"
        f" shared memory {c.shm_overhead_s * 1e6:.1f} µs"
    )
    print(
        "| data | ranks (per host) | size | loss | algorithm | measured | predicted | error"
        f" | within {TOLERANCE:.0%} |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in v.rows:
        mark = "(fitted)" if r.role == "fit" else ("yes" if r.within else "**no**")
        print(
            f"| {r.source} | {r.world} ({r.ranks_per_host}) | {_size(r.nbytes)} | {r.loss:.0%}"
            f" | {r.algorithm} | {r.measured_s * 1e3:.3f} ms | {r.predicted_s * 1e3:.3f} ms"
            f" | {r.error:+.1%} | {mark} |"
        )
    n = len(v.predictions())
    print(f"{v.within()} of {n} predictions within {TOLERANCE:.0%} ({len(v.rows) - n} rows fitted)")


def validate_main(argv: Sequence[str]) -> int:
    """``mcp-sim validate``: see the module's documentation."""
    p = argparse.ArgumentParser(
        prog="mcp-sim validate",
        description="Compare the simulator's predictions with the benchmarks' measurements.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--data", default=None, help="directory of the measurement JSON files")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the rows to OUT")
    p.add_argument("--seed", type=int, default=0, help="seed of the links' randomness")
    p.add_argument(
        "--shm-gbps", type=float, default=SHM_GBPS, help="shared memory between local ranks"
    )
    args = p.parse_args(argv)
    try:
        v = validate(args.data, seed=args.seed, shm_gbps=args.shm_gbps)
        if args.json:
            doc: dict[str, Any] = {
                "calibration": asdict(v.calibration),
                "rows": [asdict(r) for r in v.rows],
                "within": v.within(),
                "predictions": len(v.predictions()),
            }
            Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    except (ValueError, MCPError, OSError) as e:
        print(f"mcp-sim validate: error: {e}", file=sys.stderr)
        return 2
    _print_validation(v)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["validate"]:
        return validate_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        args = _settings(args)
        rows, facts = run(args)
    except (ValueError, MCPError) as e:
        print(f"mcp-sim: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows], "facts": facts}, indent=2))
    else:
        _print(args, rows, facts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
