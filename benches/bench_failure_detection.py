"""How fast do survivors learn that a peer died? Kill one rank mid-all-reduce, many times.

    python benches/bench_failure_detection.py [--runs 20] [--world 3] [--heartbeat 0.5]
                                              [--how kill|stop] [--deadline 30]

Each run starts ``--world`` processes on 127.0.0.1 that all-reduce in a loop; after a few
rounds the last rank stamps the time and sends itself SIGKILL (or SIGSTOP with ``--how
stop``: a frozen process). Every survivor must raise ``PeerLostError`` naming that rank; the
detection time is when it raised minus the stamp. A run in which a survivor neither raised
nor finished within ``--deadline`` seconds counts as hung (and is killed). Prints the median
and maximum detection time over all survivors of all runs against the promise (within 3
heartbeats), and how many runs hung; exits 1 if any did or if a survivor saw another error.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import signal
import socket
import statistics
import sys
import time
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, q: Any) -> None:
    import numpy as np

    import mcp_fast as mcp

    victim = world - 1
    try:
        g = mcp.init(
            rank=rank,
            world_size=world,
            master_addr="127.0.0.1",
            master_port=port,
            timeout=args.deadline,
            heartbeat=args.heartbeat,
        )
        a = np.ones(1 << 16, np.float32)
        for _ in range(5):  # everyone connected and working
            g.all_reduce(a)
        if rank == victim:
            q.put((rank, "victim", time.time()))
            q.close()
            q.join_thread()  # the stamp must leave before the process dies
            os.kill(os.getpid(), signal.SIGKILL if args.how == "kill" else signal.SIGSTOP)
        for _ in range(1_000_000):
            g.all_reduce(a)
        q.put((rank, "no error", time.time()))
    except mcp.PeerLostError as e:
        q.put((rank, "lost" if e.rank == victim else f"lost rank {e.rank}", time.time()))
    except Exception as e:  # reported, then counted as a failure of the run
        q.put((rank, f"{type(e).__name__}: {e}", time.time()))


def one_run(args: argparse.Namespace) -> tuple[list[float], str | None]:
    """Detection times of the survivors of one run, and what went wrong (None if nothing)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=rank_main, args=(r, args.world, port, args, q), daemon=True)
        for r in range(args.world)
    ]
    for p in procs:
        p.start()
    killed_at: float | None = None
    seen: dict[int, tuple[str, float]] = {}
    end = time.monotonic() + args.deadline + 30  # spawning and the rendezvous take seconds
    try:
        while len(seen) < args.world - 1 and time.monotonic() < end:
            try:
                rank, what, at = q.get(timeout=0.5)
            except queue.Empty:
                continue
            if what == "victim":
                killed_at = at
            else:
                seen[rank] = (what, at)
    finally:
        for p in procs:
            p.kill()  # the victim (stopped or dead) and any survivor still running
            p.join(10)
        q.close()
    if killed_at is None:
        return [], "the victim never reached its kill (rendezvous failed?)"
    if len(seen) < args.world - 1:
        return [], f"hung: ranks {sorted(set(range(args.world - 1)) - set(seen))} never reported"
    bad = {r: w for r, (w, _) in seen.items() if w != "lost"}
    times = [at - killed_at for w, at in seen.values() if w == "lost"]
    return times, (f"unexpected outcome: {bad}" if bad else None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--world", type=int, default=3, help="ranks per run (at least 2)")
    ap.add_argument("--heartbeat", type=float, default=0.5, help="seconds")
    ap.add_argument("--how", choices=["kill", "stop"], default="kill")
    ap.add_argument("--deadline", type=float, default=30.0, help="seconds before 'hung'")
    args = ap.parse_args()
    if args.world < 2 or args.runs < 1:
        ap.error("--world must be at least 2 and --runs at least 1")
    times: list[float] = []
    failures: list[str] = []
    for i in range(args.runs):
        t, problem = one_run(args)
        times += t
        if problem:
            failures.append(f"run {i + 1}: {problem}")
        shown = f"{max(t):.2f} s" if t else "-"
        print(
            f"run {i + 1:2d}/{args.runs}: slowest survivor {shown}"
            + (f"  ({problem})" * bool(problem)),
            flush=True,
        )
    bound = 3 * args.heartbeat
    signal_name = "SIGKILL" if args.how == "kill" else "SIGSTOP"
    print(
        f"\n{signal_name} to 1 of {args.world} ranks, heartbeat {args.heartbeat} s, "
        f"{args.runs} runs, {len(times)} survivor detections"
    )
    if times:
        print(
            f"detection time: median {statistics.median(times):.2f} s, max {max(times):.2f} s "
            f"(promised: within 3 heartbeats, {bound:.2f} s)"
        )
    print(f"runs hung or wrong: {len(failures)}")
    for f in failures:
        print("  " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
