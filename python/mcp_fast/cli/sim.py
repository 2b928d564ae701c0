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
each card); DiLoCo = one such all-reduce every H steps; failures = the measured abort time
plus recovery, times the expected number of failures in a training; checkpoints = their size
over the disks' bandwidth. A ring too large to simulate within ``--max-frames`` is simulated
at two smaller sizes and extrapolated by the ring's cost form (marked ``~``).

Exit status: 0 on success, 2 on bad arguments or a failed simulation.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
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
    p.add_argument("--detect-s", type=float, default=15.0, help="failure detector timeout, s")
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


def _settings(args: argparse.Namespace) -> argparse.Namespace:
    if args.preset == "seed":
        defaults = build_parser().parse_args([])
        for k, v in SEED_PRESET.items():
            if getattr(args, k) == getattr(defaults, k):
                setattr(args, k, v)
    for name in ("nodes", "gpus_per_node", "steps", "checkpoint_every", "diloco_h"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("params", "compute_s", "disk_gbps"):
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
        "detect_s": args.detect_s,
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
    ckpt_bytes = args.params * args.checkpoint_bytes_per_param
    full_write_s = ckpt_bytes / (n * args.disk_gbps * 1e9 / 8)
    delta_write_s = full_write_s * args.delta_ratio
    facts = {
        "gradient_bytes": grad,
        "intra_host_all_reduce_s": intra_s,
        "abort_after_failure_s": abort_s,
        "abort_errors": fail_n - failed["ok_ranks"],
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
        if args.checkpoint == "elastic":
            per_failure = abort_s + step  # survivors re-form and redo the step
        else:
            per_failure = abort_s + args.restart_s + full_write_s + step * args.checkpoint_every / 2
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
        f" {facts['abort_after_failure_s']:.2f} s after it (detector {args.detect_s:g} s);"
        f" checkpoint {_si(facts['checkpoint_full_bytes'], 'B')} full,"
        f" {_si(facts['checkpoint_delta_bytes'], 'B')} delta, written in"
        f" {facts['checkpoint_full_write_s']:.2f} s / {facts['checkpoint_delta_write_s']:.2f} s"
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


def main(argv: Sequence[str] | None = None) -> int:
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
