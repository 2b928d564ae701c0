"""Parameter server: mcp_fast.ps against the same logic on torch.distributed (Gloo), same run.

    python benches/bench_ps.py [--steps 50] [--compute-ms 20]

One server and three workers on this machine. Every step, each worker pulls the parameters,
"computes" (a sleep, so the CPU stays free for the communication), pushes a gradient of the
same size and advances its clock; the server averages the gradients of each
clock, applies SGD with momentum once the clock is complete, and lets a worker go on only
while it is at most ``s`` clocks ahead of the slowest. The Gloo version is that logic written
with send/recv: a worker sends its clock and gradient, the server answers with the parameters
once the staleness bound allows; mcp_fast's ``Worker.step(grads, into=params)`` is the same
single round trip (push, clock, pull).

Two tables: push+pull throughput (no compute; bytes of gradients pushed plus parameters
pulled by all workers, per second; mcp_fast also with int8-coded pushes), and the step time
of the fast workers when every step computes ``--compute-ms`` and worker 0 takes 30 % longer,
for s = 0 and s = 3 (and without the slow worker, for reference), and of all workers when
each of them, at each step, takes 30 % longer with probability 1/3 (random stragglers).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from mcp_fast import ps

WORKERS = 3


def _compute(wid: int, step: int, cfg: dict[str, Any]) -> None:
    if cfg.get("jitter"):
        # every worker, every step, is 30 % slower with probability 1/3 (seeded)
        slow = 0.3 if np.random.default_rng(wid * 100_003 + step).random() < 1 / 3 else 0.0
    else:
        slow = cfg["slow"] if wid == 0 else 0.0
    time.sleep(cfg["compute_ms"] * (1.0 + slow) / 1e3)


def _grad(n: int, wid: int) -> np.ndarray:
    return np.full(n, 1e-4 * (wid + 1), np.float32)


# ---------------------------------------------------------------------------------- mcp_fast


def mcp_worker(w: ps.Worker, cfg: dict[str, Any]) -> dict[str, Any]:
    n = cfg["numel"]
    params = {"w": np.zeros(n, np.float32)}
    grad = {"w": _grad(n, w.worker_id)}
    w.init(params)
    w.sync()
    w.pull(into=params)
    times = []
    t0 = time.perf_counter()
    for step in range(cfg["steps"]):
        ts = time.perf_counter()
        _compute(w.worker_id, step, cfg)
        # push, clock and pull in one round trip, as the Gloo version does
        w.step(grad, into=params, codec=cfg.get("codec", "none"))
        times.append(time.perf_counter() - ts)
    elapsed = time.perf_counter() - t0
    w.sync()
    final = w.pull()["w"]
    return {"times": times, "elapsed": elapsed, "check": float(final[0])}


def run_mcp(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    return ps.launch(
        mcp_worker,
        num_workers=WORKERS,
        num_servers=1,
        args=(cfg,),
        server_kwargs={
            "optimizer": "sgd",
            "lr": 0.1,
            "momentum": 0.9,
            "staleness": cfg["s"],
            "checkpoint_every": 3600.0,
        },
        worker_kwargs={"split_above": 1 << 40},
        timeout=600,
    )


# ------------------------------------------------------------------------------------- Gloo


def _gloo_server(cfg: dict[str, Any]) -> None:
    n, s = cfg["numel"], cfg["s"]
    params = torch.zeros(n)
    momentum = torch.zeros(n)
    ranks = list(range(1, WORKERS + 1))
    for r in ranks:
        dist.send(params, dst=r)
    clocks = {r: 0 for r in ranks}
    live = set(ranks)
    acc: dict[int, tuple[torch.Tensor, int]] = {}
    applied = 0
    waiting: list[int] = []
    hdr = torch.zeros(2, dtype=torch.int64)
    gbuf = torch.empty(n)
    while live:
        src = dist.recv(hdr)
        clock, done = int(hdr[0]), int(hdr[1])
        if done:
            live.discard(src)
        else:
            dist.recv(gbuf, src=src)
            if clock in acc:
                acc[clock][0].add_(gbuf)
                acc[clock] = (acc[clock][0], acc[clock][1] + 1)
            else:
                acc[clock] = (gbuf.clone(), 1)
            clocks[src] = clock + 1
            waiting.append(src)
        low = min((clocks[r] for r in live), default=None)
        while acc and (low is None or min(acc) < low):
            c = min(acc)
            total, count = acc.pop(c)
            total.div_(count)
            momentum.mul_(0.9).add_(total)
            params.sub_(momentum, alpha=0.1)
            applied = c + 1
        for r in list(waiting):
            if low is None or clocks[r] - low <= s:
                dist.send(params, dst=r)
                waiting.remove(r)
    del applied


def _gloo_worker(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    n = cfg["numel"]
    wid = rank - 1
    params = torch.empty(n)
    grad = torch.from_numpy(_grad(n, wid))
    dist.recv(params, src=0)
    hdr = torch.zeros(2, dtype=torch.int64)
    times = []
    t0 = time.perf_counter()
    for clock in range(cfg["steps"]):
        ts = time.perf_counter()
        _compute(wid, clock, cfg)
        hdr[0], hdr[1] = clock, 0
        dist.send(hdr, dst=0)
        dist.send(grad, dst=0)
        dist.recv(params, src=0)  # the parameters, once the bound allows
        times.append(time.perf_counter() - ts)
    elapsed = time.perf_counter() - t0
    hdr[1] = 1
    dist.send(hdr, dst=0)
    return {"times": times, "elapsed": elapsed, "check": float(params[0])}


def _gloo_main(rank: int, port: int, cfg: dict[str, Any], q: Any) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORKERS + 1)
    try:
        if rank == 0:
            _gloo_server(cfg)
        else:
            q.put((rank - 1, _gloo_worker(rank, cfg)))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as t:
        t.bind(("127.0.0.1", 0))
        return int(t.getsockname()[1])


def run_gloo(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    ctx = tmp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_gloo_main, args=(r, port, cfg, q)) for r in range(WORKERS + 1)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    for _ in range(WORKERS):
        wid, res = q.get(timeout=600)
        out[wid] = res
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    return [out[w] for w in range(WORKERS)]


# ------------------------------------------------------------------------------------ driver


def summary(res: list[dict[str, Any]], cfg: dict[str, Any]) -> tuple[float, float, float]:
    """(push+pull GB/s, median fast-worker step ms, run time s)."""
    bytes_moved = 2 * 4 * cfg["numel"] * cfg["steps"] * WORKERS
    run = max(r["elapsed"] for r in res)
    fast = [t for r in (res if cfg.get("jitter") else res[1:]) for t in r["times"]]
    return bytes_moved / run / 1e9, statistics.median(fast) * 1e3, run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--compute-ms", type=float, default=20.0)
    p.add_argument("--sizes", default="0.25,4", help="parameter sizes in MiB")
    p.add_argument("--step-mib", type=float, default=1.0, help="size for the step-time table")
    args = p.parse_args()
    sizes = [float(x) for x in args.sizes.split(",") if x]
    backends: list[tuple[str, Any, str]] = [
        ("mcp_fast", run_mcp, "none"),
        ("mcp_fast int8 push", run_mcp, "int8"),
        ("gloo", run_gloo, "none"),
    ]
    print(f"parameter server, 1 server + {WORKERS} workers, {args.steps} steps per run")
    print("\npush+pull throughput (no compute)\n")
    print("| size | s | backend | push+pull GB/s | step (median) | vs gloo |")
    print("|---|---|---|---|---|---|")
    for mib in sizes:
        for st in (0, 3):
            cfg = {
                "numel": int(mib * (1 << 20)) // 4,
                "steps": args.steps,
                "compute_ms": 0.0,
                "slow": 0.0,
                "s": st,
            }
            got = {}
            for name, fn, codec in backends:
                got[name] = summary(fn({**cfg, "codec": codec}), cfg)
            for name, _, _ in backends:
                r = got[name]
                print(
                    f"| {mib:g} MiB | {st} | {name} | {r[0]:.3f} | {r[1]:.2f} ms | "
                    f"{r[0] / got['gloo'][0]:.2f}x |",
                    flush=True,
                )
    print(
        f"\nstep time, {args.compute_ms:g} ms compute per step, worker 0 30 % slower, "
        f"{args.step_mib:g} MiB\n"
    )
    print("| s | slow worker | backend | fast-worker step (median) | run | throughput GB/s |")
    print("|---|---|---|---|---|---|")
    for st, slow, jitter in (
        (0, 0.3, False),
        (3, 0.3, False),
        (3, 0.0, False),
        (0, 0.0, True),
        (3, 0.0, True),
    ):
        cfg = {
            "numel": int(args.step_mib * (1 << 20)) // 4,
            "steps": args.steps,
            "compute_ms": args.compute_ms,
            "slow": slow,
            "jitter": jitter,
            "s": st,
        }
        for name, fn, codec in (backends[0], backends[2]):
            r = summary(fn({**cfg, "codec": codec}), cfg)
            who = "random 30 % stragglers" if jitter else "30 % slower" if slow else "none"
            print(
                f"| {st} | {who} | {name} | {r[1]:.1f} ms | {r[2]:.2f} s | {r[0]:.3f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
