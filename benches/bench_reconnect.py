"""Reconnection time, with and without 0-RTT session resumption.

    python benches/bench_reconnect.py [--resets 30] [--delays 0,10ms] [--json OUT]

Two ranks on 127.0.0.1. Rank 1 drops its connection (``Group.chaos_reset``, as a middlebox
that lost its state would) and at once all-reduces 4 KiB: the operation waits for the
connection to be re-established (rank 1 dials rank 0 again) and completes on the new one.
Reported per setting, medians over ``--resets`` resets: the reconnection as the transport
measures it (break → new connection usable), and the all-reduce across the break against
one without. ``--delays``: one-way delay each process adds to its datagrams (the fault
injector's ``delay``), so that the round trips 0-RTT saves show (10 ms each way = 20 ms
RTT). 0-RTT sends the Hello and the first frames with the resumed session's first flight;
without it they wait for the full handshake (one round trip more, and the certificate
checks).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, zero_rtt: bool, delay: str, resets: int, q: Any) -> None:
    import mcp_fast as mcp

    chaos = f"seed=1,delay={delay}" if delay else None
    out: dict[str, list[float]] = {"reconnect": [], "across": [], "plain": []}
    with mcp.init(
        rank=rank,
        world_size=2,
        master_port=port,
        secret="bench-reconnect",
        zero_rtt=zero_rtt,
        chaos=chaos,
        timeout=60,
    ) as g:
        a = np.ones(1024, np.float32)
        for _ in range(5):
            g.all_reduce(a)
        for _ in range(resets):
            g.barrier()
            t0 = time.perf_counter()
            g.all_reduce(a)
            out["plain"].append(time.perf_counter() - t0)
            g.barrier()
            t0 = time.perf_counter()
            if rank == 1:
                g.chaos_reset()
            g.all_reduce(a)
            out["across"].append(time.perf_counter() - t0)
            g.barrier()
            out["reconnect"].append(g.stats()["last_reconnect_us"] / 1e6)
        s = g.stats()
        out["zero_rtt_accepted"] = [s["zero_rtt_accepted"]]
    q.put((rank, out))


def run(zero_rtt: bool, delay: str, resets: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, zero_rtt, delay, resets, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    res = dict(q.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(30)
    r1 = res[1]
    return {
        "zero_rtt": zero_rtt,
        "delay": delay or "0",
        "reconnect_ms": statistics.median(r1["reconnect"]) * 1e3,
        "across_ms": statistics.median(r1["across"]) * 1e3,
        "plain_ms": statistics.median(r1["plain"]) * 1e3,
        "zero_rtt_accepted": int(r1["zero_rtt_accepted"][0]),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--resets", type=int, default=30)
    p.add_argument("--delays", default="0,10ms", help="one-way delays to try (0: none)")
    p.add_argument("--json")
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    cases = [(d if d != "0" else "", z) for d in a.delays.split(",") for z in (True, False)]
    for delay, zero_rtt in tqdm(cases, desc="settings"):
        rows.append(run(zero_rtt, delay, a.resets))
    print(f"\n2 ranks, 127.0.0.1, {a.resets} resets each, medians (rank 1)\n")
    print("| one-way delay | 0-RTT | reconnection | 4 KiB all-reduce across it | without a break |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['delay']} | {'on' if r['zero_rtt'] else 'off'} "
            f"| {r['reconnect_ms']:.2f} ms | {r['across_ms']:.2f} ms | {r['plain_ms']:.2f} ms |"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
