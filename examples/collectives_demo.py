"""A short multi-process run of mcp_fast's collectives on this machine.

    python examples/collectives_demo.py --world 3 [--mib 64] [--chaos]

Starts WORLD processes that meet over MCP (QUIC, mutual TLS) on 127.0.0.1, checks each
collective against the exact answer and prints what it did and how fast.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import time

import numpy as np


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_main(rank: int, world: int, port: int, mib: int, q: mp.Queue) -> None:
    import mcp_fast as mcp

    rows: list[tuple[str, str, float, float]] = []
    with mcp.init(rank=rank, world_size=world, master_port=port, secret="demo", timeout=120) as g:

        def timed(name: str, nbytes: int, fn, reps: int) -> None:
            fn()  # warm up: connections, buffers
            g.barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            dt = (time.perf_counter() - t0) / reps
            rows.append((name, f"{nbytes / 2**20:.3f} MiB", dt * 1e3, nbytes / dt / 1e9))

        n = mib << 18  # float32 elements
        a = np.full(n, rank + 1, np.float32)
        g.all_reduce(a)
        assert a[0] == world * (world + 1) / 2 and a[-1] == a[0], "all_reduce gave a wrong sum"
        timed("all_reduce (ring)", a.nbytes, lambda: g.all_reduce(a), 5)
        small = np.ones(1024, np.float32)
        timed(
            "all_reduce 4 KiB (recursive doubling)", small.nbytes, lambda: g.all_reduce(small), 200
        )
        b = np.arange(n, dtype=np.float32) if rank == 0 else np.zeros(n, np.float32)
        g.broadcast(b, src=0)
        assert b[12345] == 12345.0, "broadcast gave wrong data"
        timed("broadcast", b.nbytes, lambda: g.broadcast(b, src=0), 5)
        part = np.full(n // world, rank, np.float32)
        out = np.empty((world, n // world), np.float32)
        g.all_gather(out, part)
        assert (out[:, 0] == np.arange(world)).all(), "all_gather gave wrong data"
        timed("all_gather", out.nbytes, lambda: g.all_gather(out, part), 5)
    if rank == 0:
        q.put(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--mib", type=int, default=64, help="size of the large tensors, MiB")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_udp_port()
    procs = [
        ctx.Process(target=rank_main, args=(r, args.world, port, args.mib, q))
        for r in range(args.world)
    ]
    for pr in procs:
        pr.start()
    rows = q.get(timeout=600)
    for pr in procs:
        pr.join(60)
    print(f"mcp_fast collectives, {args.world} ranks on 127.0.0.1 (QUIC + mutual TLS), all checked")
    print(f"{'operation':40} {'size':>12} {'time':>10} {'algbw':>10}")
    for name, size, ms, gbps in rows:
        print(f"{name:40} {size:>12} {ms:>8.2f} ms {gbps:>6.2f} GB/s")
    if any(pr.exitcode != 0 for pr in procs):
        raise SystemExit("a rank failed")


if __name__ == "__main__":
    main()
