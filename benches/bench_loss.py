"""Gloo vs mcp_fast all-reduce on a lossy link: same run, same link, same tensors.

    python benches/bench_loss.py [--worlds 2 4] [--mib 16 64] [--losses 0 0.05 0.2] [--rate 1gbit]
                                 [--runs 1] [--no-gloo] [--json docs/data/loss.json]

Each link condition is a fresh network namespace made by ``mcp-chaos`` (needs root, iproute2,
nftables): its loopback drops that share of packets, silently, on input (nftables
``numgen random``), and with ``--rate`` a second set of runs is rate-capped (tbf). Gloo's TCP
and mcp_fast's UDP go through the same rule. Inside, every rank runs Gloo and mcp_fast
(one group per ``--lanes`` entry, ``MCP_LANE``) alternately on the same float32 tensor, each
all-reduce after its own backend's barrier, and checks that every all-reduce gave exactly the
right values. Prints a Markdown table: median
time per all-reduce, speed-up over Gloo, and each mcp lane's slow-down against itself on the
clean link. ``--json FILE`` also writes every row (seconds per all-reduce) for
``benches/plots.py``.

``--runs R`` runs each link R times, each in a fresh namespace with fresh processes, and
reports the median of the R runs' medians (each run's median is kept in the row's ``runs``):
a median of one run's all-reduces leaves out how far whole runs differ, which on 2 shared
cores is the larger spread. ``--no-gloo`` times mcp_fast alone: no Gloo group, and no TCP
traffic of its own on the lossy link (Gloo at 20 % loss can take minutes per run).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from _runs import median_of_runs


def free_port(kind: int) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker(rank: int, world: int, ports: list[int], args: argparse.Namespace, q: Any) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    import mcp_fast as mcp

    torch.set_num_threads(1)
    if not args.no_gloo:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=world
        )
    groups = {}
    for i, lane in enumerate(args.lanes):
        os.environ["MCP_LANE"] = lane
        groups[lane] = mcp.init(
            rank=rank, world_size=world, master_port=ports[1 + i], secret="bench", timeout=600
        )
    rows = []
    for mib in args.mib:
        n = (mib << 20) // 4
        base = np.arange(n, dtype=np.float32) % 1024 + rank
        want = (np.arange(n, dtype=np.float32) % 1024) * world + world * (world - 1) / 2
        iters = args.iters if mib <= 16 else max(2, args.iters // 2)
        gloo: dict[str, list[float]] = {} if args.no_gloo else {"gloo": []}
        times: dict[str, list[float]] = {**gloo, **{lane: [] for lane in groups}}
        t = torch.from_numpy(base.copy())
        a = base.copy()
        for it in range(iters + 1):  # the first round warms up
            for name in times:
                if name == "gloo":
                    t.copy_(torch.from_numpy(base))
                    dist.barrier()
                    t0 = time.perf_counter()
                    dist.all_reduce(t)
                    dt = time.perf_counter() - t0
                    ok = np.array_equal(t.numpy(), want)
                else:
                    a[:] = base
                    # Each backend starts from its own barrier: under heavy loss Gloo's lets
                    # the ranks go hundreds of milliseconds apart (TCP's retransmission
                    # timeout), and that wait would be timed as the all-reduce's.
                    groups[name].barrier()
                    t0 = time.perf_counter()
                    groups[name].all_reduce(a)
                    dt = time.perf_counter() - t0
                    ok = np.array_equal(a, want)
                if not ok:
                    raise AssertionError(f"{name}: wrong all-reduce result at {mib} MiB")
                if it > 0:
                    times[name].append(dt)
        if rank == 0:
            rows.append({"mib": mib, **{k: statistics.median(v) for k, v in times.items()}})
    for g in groups.values():
        g.close()
    if not args.no_gloo:
        dist.destroy_process_group()
    if rank == 0:
        q.put(rows)


def child(args: argparse.Namespace) -> None:
    """Inside the namespace: run the ranks, print one JSON line."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ports = [free_port(socket.SOCK_STREAM)] + [free_port(socket.SOCK_DGRAM) for _ in args.lanes]
    procs = [
        ctx.Process(target=worker, args=(r, args.world, ports, args, q)) for r in range(args.world)
    ]
    for p in procs:
        p.start()
    rows = q.get(timeout=args.timeout)
    for p in procs:
        p.join(60)
    print(json.dumps(rows), flush=True)


def run_condition(args: argparse.Namespace, world: int, loss: float, rate: str | None) -> Any:
    chaos = shutil.which("mcp-chaos", path=os.path.dirname(sys.executable)) or "mcp-chaos"
    cmd = [chaos, "--loss", str(loss), "--hook", "input", "--timeout", str(args.timeout)]
    if rate:
        cmd += ["--rate", rate]
    cmd += ["--", sys.executable, os.path.abspath(__file__), "--child", "--world", str(world)]
    cmd += ["--mib", *map(str, args.mib), "--iters", str(args.iters)]
    cmd += ["--lanes", *args.lanes, "--timeout", str(args.timeout)]
    if args.no_gloo:
        cmd.append("--no-gloo")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout + 60)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("[")]
    if r.returncode != 0 or not lines:
        sys.stderr.write(r.stdout[-3000:] + r.stderr[-3000:])
        raise SystemExit(f"run failed: world {world}, loss {loss}, rate {rate}: rc {r.returncode}")
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--mib", type=int, nargs="+", default=[16, 64])
    p.add_argument("--losses", type=float, nargs="+", default=[0.0, 0.05, 0.2])
    p.add_argument("--rate", default="1gbit", help="also run rate-capped ('' to skip)")
    p.add_argument("--lanes", nargs="+", default=["auto"], help="MCP_LANE of each mcp group")
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--runs", type=int, default=1, help="fresh runs of each link (median)")
    p.add_argument("--no-gloo", action="store_true", help="time mcp_fast alone")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", help="also write the rows to this file (for benches/plots.py)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.runs < 1:
        p.error("--runs must be at least 1")
    if args.child:
        child(args)
        return
    conds: list[tuple[float, str | None]] = [(x, None) for x in args.losses]
    if args.rate:
        conds += [(x, args.rate) for x in args.losses]
    lanes = " | ".join(f"mcp {lane}" for lane in args.lanes)
    vs = " | ".join(f"{lane} vs Gloo | {lane} vs clean" for lane in args.lanes)
    print(f"# {os.cpu_count()} CPUs; MCP_CC={os.environ.get('MCP_CC', 'default')}")
    print(f"| link | ranks | size | Gloo | {lanes} | {vs} |")
    print("|---" * (4 + 3 * len(args.lanes)) + "|")
    clean: dict[tuple[int, int, str | None], dict[str, float]] = {}
    records: list[dict[str, Any]] = []
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    todo = [(w, loss, rate) for w in args.worlds for loss, rate in conds]
    for world, loss, rate in tqdm(todo, desc="links", unit="link", file=sys.stderr):
        runs = [run_condition(args, world, loss, rate) for _ in range(args.runs)]
        for row in median_of_runs(runs, key="mib"):
            records.append({"world": world, "loss": loss, "rate": rate, **row})
            key = (world, row["mib"], rate)
            if loss == 0:
                clean[key] = row
            base = clean.get(key, {})
            link = f"{loss:.0%} loss" + (f", {rate}" if rate else "")
            cells = " | ".join(f"{row[lane] * 1e3:.1f} ms" for lane in args.lanes)
            ratios = " | ".join(
                (f"{row['gloo'] / row[lane]:.2f}x | " if "gloo" in row else "- | ")
                + (f"{row[lane] / base[lane]:.2f}x" if lane in base else "-")
                for lane in args.lanes
            )
            gloo_cell = f"{row['gloo'] * 1e3:.1f} ms" if "gloo" in row else "-"
            print(
                f"| {link} | {world} | {row['mib']} MiB | {gloo_cell} | {cells} | {ratios} |",
                flush=True,
            )
    if args.json:
        meta = {
            "command": shlex.join(["python", "benches/bench_loss.py", *sys.argv[1:]]),
            "date": started,
            "cpus": os.cpu_count(),
            "lanes": args.lanes,
            "iters": args.iters,
            "runs": args.runs,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": records}, indent=1) + "\n")


if __name__ == "__main__":
    main()
