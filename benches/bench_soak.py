"""Does every non-fatal fault heal? Thousands of collectives through a mix of faults.

    python benches/bench_soak.py [--world 3] [--ops 2000] [--lane stream|fec|auto]
                                 [--spec "loss=0.02,burst=0.2,..."] [--seed 1]
                                 [--deadline 600] [--json OUT]

``--world`` processes on 127.0.0.1 run ``--ops`` collectives each (all-reduce, broadcast,
all-gather; sizes from 1 KiB to 1 MiB, drawn from ``--seed`` so that every rank runs the same
sequence) behind the seeded fault injector (``--spec``, default: 2 % loss starting bursts of 8
with probability 0.2, 1 % duplicates, 2 % reordering, up to 2 ms of jitter, and 1 % of the
frames damaged above QUIC). Every result is checked bit for bit. An operation counts as
*faulted* on a rank when the injector or the healing counters moved while it ran (a datagram
dropped or duplicated, a frame damaged or resent there; jitter and reordering touch nearly
every operation and are not counted), and as *healed* when it was faulted and still finished
exact. Prints, summed over the ranks: operations attempted,
faulted, healed, failed (with the error), wrong results, hung ranks, and the time lost to
healing (for each faulted operation, its time minus the median time of clean operations of
its size). Exits 1 unless every operation finished exact on every rank.

Short cuts of the link (a flap, a NAT rebinding) are not in the mix: the injector's cut is
permanent (``chaos_kill``), and riding out a short one is not built yet.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import socket
import statistics
import sys
import time
from typing import Any

DEFAULT_SPEC = "loss=0.02,burst=0.2,burst_len=8,dup=0.01,reorder=0.02,jitter=2ms,corrupt=0.01"
SIZES = [256, 4096, 65_536, 262_144]  # float32 elements: 1 KiB to 1 MiB
KINDS = ["all_reduce", "broadcast", "all_gather"]
_MOVED = ("send_dropped", "recv_dropped", "duplicated")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _plan(seed: int, ops: int, world: int) -> list[tuple[str, int, int]]:
    import random

    rng = random.Random(seed)
    return [(rng.choice(KINDS), rng.choice(SIZES), rng.randrange(world)) for _ in range(ops)]


def _fault_count(g: Any) -> int:
    s, c = g.stats(), g.chaos_stats()
    return s["retransmits"] + s["corrupt_frames"] + sum(c.get(k, 0) for k in _MOVED)


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, q: Any) -> None:
    try:
        _soak(rank, world, port, args, q)
    except Exception as e:  # a bug here, not a fault: report it rather than hang the parent
        q.put({"rank": rank, "ops": [], "failed": [f"{type(e).__name__}: {e}"], "wrong": 0})


def _soak(rank: int, world: int, port: int, args: argparse.Namespace, q: Any) -> None:
    import numpy as np

    import mcp_fast as mcp

    out: dict[str, Any] = {"rank": rank, "ops": [], "failed": [], "wrong": 0}
    try:
        g = mcp.init(
            rank=rank,
            world_size=world,
            master_addr="127.0.0.1",
            master_port=port,
            timeout=args.deadline,
            connect_timeout=60,
            chaos=f"{args.spec},seed={args.seed * 1000 + rank}",
            lane=args.lane,
        )
    except mcp.MCPError as e:
        out["failed"].append(f"init: {type(e).__name__}: {e}")
        q.put(out)
        return
    with g:
        for i, (kind, n, root) in enumerate(_plan(args.seed, args.ops, world)):
            mine = (np.arange(n, dtype=np.int64) * 7 + i * 13 + rank) % 101
            before = _fault_count(g)
            t0 = time.perf_counter()
            try:
                if kind == "all_reduce":
                    a = mine.astype(np.float32)
                    g.all_reduce(a)
                    want = sum((np.arange(n) * 7 + i * 13 + r) % 101 for r in range(world))
                    exact = np.array_equal(a, want.astype(np.float32))
                elif kind == "broadcast":
                    a = mine.astype(np.float32) if rank == root else np.zeros(n, np.float32)
                    g.broadcast(a, src=root)
                    want = (np.arange(n) * 7 + i * 13 + root) % 101
                    exact = np.array_equal(a, want.astype(np.float32))
                else:
                    a = np.zeros((world, n), np.float32)
                    g.all_gather(a, mine.astype(np.float32))
                    want = np.stack([(np.arange(n) * 7 + i * 13 + r) % 101 for r in range(world)])
                    exact = np.array_equal(a, want.astype(np.float32))
            except mcp.MCPError as e:
                out["failed"].append(f"op {i} ({kind}, {n}): {type(e).__name__}: {e}")
                if isinstance(e, mcp.PeerLostError):
                    break  # fatal: the peer is gone
                continue
            dt = time.perf_counter() - t0
            out["wrong"] += 0 if exact else 1
            out["ops"].append((n, dt, _fault_count(g) > before, bool(exact)))
        out["stats"] = g.stats()
        out["chaos"] = g.chaos_stats()
    q.put(out)


def summarise(outs: list[dict[str, Any]], hung: int, attempted: int) -> dict[str, Any]:
    ops = [o for out in outs for o in out["ops"]]
    clean: dict[int, list[float]] = {}
    for n, dt, faulted, _ in ops:
        if not faulted:
            clean.setdefault(n, []).append(dt)
    median = {n: statistics.median(v) for n, v in clean.items()}
    faulted = [(n, dt) for n, dt, f, _ in ops if f]
    lost = sum(max(0.0, dt - median.get(n, dt)) for n, dt in faulted)
    wrong = sum(out["wrong"] for out in outs)
    failed = [f for out in outs for f in out["failed"]]
    return {
        "attempted": attempted,
        "finished": len(ops),
        "faulted": len(faulted),
        "healed": sum(1 for _, _, f, exact in ops if f and exact),
        "failed": len(failed),
        "failures": failed[:20],
        "wrong": wrong,
        "hung": hung,
        "time_lost_s": lost,
        "wall_ops_s": sum(op[1] for op in ops),
        "retransmits": sum(out.get("stats", {}).get("retransmits", 0) for out in outs),
        "corrupt_frames": sum(out.get("stats", {}).get("corrupt_frames", 0) for out in outs),
        "datagrams_dropped": sum(
            out.get("chaos", {}).get("send_dropped", 0)
            + out.get("chaos", {}).get("recv_dropped", 0)
            for out in outs
        ),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--ops", type=int, default=2000)
    p.add_argument("--lane", default="stream", choices=["stream", "fec", "auto"])
    p.add_argument("--spec", default=DEFAULT_SPEC)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--deadline", type=float, default=600.0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=rank_main, args=(r, args.world, port, args, q), daemon=True)
        for r in range(args.world)
    ]
    t0 = time.monotonic()
    for pr in procs:
        pr.start()
    outs: list[dict[str, Any]] = []
    end = t0 + args.deadline + 60
    while len(outs) < args.world and time.monotonic() < end:
        try:
            outs.append(q.get(timeout=1.0))
        except queue.Empty:
            if not any(pr.is_alive() for pr in procs) and q.empty():
                break
    hung = args.world - len(outs)
    for pr in procs:
        pr.join(timeout=5)
        if pr.is_alive():
            pr.kill()
            pr.join()
    wall = time.monotonic() - t0
    res = summarise(outs, hung, args.world * args.ops)
    res.update({"world": args.world, "lane": args.lane, "spec": args.spec, "wall_s": wall})
    healed = res["healed"]
    print(f"soak: {args.world} ranks x {args.ops} collectives, lane {args.lane}, {args.spec}")
    print("| attempted | finished | faulted | healed | failed | wrong | hung | time lost |")
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {res['attempted']} | {res['finished']} | {res['faulted']} | {healed} | "
        f"{res['failed']} | {res['wrong']} | {hung} | {res['time_lost_s']:.2f} s of "
        f"{res['wall_ops_s']:.1f} s |"
    )
    print(
        f"frames resent {res['retransmits']}, damaged copies {res['corrupt_frames']}, "
        f"datagrams dropped {res['datagrams_dropped']}; wall {wall:.1f} s"
    )
    for f in res["failures"]:
        print("failure:", f)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    ok = res["finished"] == res["attempted"] and res["wrong"] == 0 and hung == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
