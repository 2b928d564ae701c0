"""Collectives on one host: mcp_fast through shared memory, mcp_fast over QUIC (shm=False) and
Gloo, in the same processes and the same run, with the machine's memcpy bandwidth beside them.

    python benches/bench_shm.py [--world 2] [--sizes-mib 1 4 16 64] [--repeats 3] [--op OP]

``--op``: all_reduce (default), all_gather, reduce_scatter or broadcast (from rank 0). The
size is the largest tensor's (the all-gather's output, the reduce-scatter's input). Time per
float32 operation (best of ``--repeats`` blocks) and bus bandwidth as nccl-tests count it
(bytes x 2(W-1)/W for all-reduce, (W-1)/W for all-gather and reduce-scatter, 1 for
broadcast, over the time). The memcpy figure is one thread copying 64 MiB with numpy (read +
write), the bound a one-copy-per-byte path approaches.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import socket
import time


def free_port(kind: int) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def memcpy_gbs(nbytes: int = 64 << 20, iters: int = 20) -> float:
    import numpy as np

    a = np.ones(nbytes // 8)
    b = np.empty_like(a)
    np.copyto(b, a)
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _runners(op: str, dist, shm, quic, t, part) -> dict:
    """The operation `op` on tensor `t` (and its 1/W part) for each of the three groups."""
    w = t.numel() // part.numel()
    if op == "all_gather":
        return {
            "gloo": lambda: dist.all_gather_into_tensor(t, part),
            "shm": lambda: shm.all_gather(t.view(w, -1), part),
            "quic": lambda: quic.all_gather(t.view(w, -1), part),
        }
    if op == "reduce_scatter":
        return {
            "gloo": lambda: dist.reduce_scatter_tensor(part, t),
            "shm": lambda: shm.reduce_scatter(part, t),
            "quic": lambda: quic.reduce_scatter(part, t),
        }
    if op == "broadcast":
        return {
            "gloo": lambda: dist.broadcast(t, src=0),
            "shm": lambda: shm.broadcast(t, src=0),
            "quic": lambda: quic.broadcast(t, src=0),
        }
    return {
        "gloo": lambda: dist.all_reduce(t),
        "shm": lambda: shm.all_reduce(t),
        "quic": lambda: quic.all_reduce(t),
    }


def worker(rank: int, world: int, ports: tuple[int, int, int], args: argparse.Namespace, q) -> None:
    import torch
    import torch.distributed as dist

    import mcp_fast as mcp

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=world
    )
    shm = mcp.init(rank=rank, world_size=world, master_port=ports[1], secret="b", timeout=300)
    quic = mcp.init(
        rank=rank, world_size=world, master_port=ports[2], secret="b", timeout=300, shm=False
    )
    assert len(shm.topology()["shm_peers"]) == world - 1, shm.topology()
    world = args.world
    rows = []
    for mib in args.sizes_mib:
        nbytes = mib << 20
        n = nbytes // 4 // world * world
        t = torch.ones(n)
        part = torch.ones(n // world)
        iters = max(3, min(50, int(2e9 // nbytes)))
        timing: dict[str, list[float]] = {"gloo": [], "shm": [], "quic": []}
        runners = _runners(args.op, dist, shm, quic, t, part)
        for _ in range(args.repeats):
            for name, fn in runners.items():
                if name == "quic" and args.no_quic:
                    continue
                fn()
                # Each backend from its own barrier (see bench_loss.py).
                {"gloo": dist.barrier, "shm": shm.barrier, "quic": quic.barrier}[name]()
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                timing[name].append((time.perf_counter() - t0) / iters)
        if rank == 0:
            rows.append((nbytes, {k: min(v) if v else float("nan") for k, v in timing.items()}))
    shm.close()
    quic.close()
    dist.destroy_process_group()
    if rank == 0:
        q.put(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-quic", action="store_true", help="skip the shm=False column")
    p.add_argument(
        "--op",
        default="all_reduce",
        choices=["all_reduce", "all_gather", "reduce_scatter", "broadcast"],
    )
    args = p.parse_args()
    cpu = platform.processor() or platform.machine()
    print(f"# {platform.node()}: {os.cpu_count()} CPUs, {cpu}; load {os.getloadavg()[0]:.2f}")
    print(f"# memcpy (numpy, 1 thread, 64 MiB): {memcpy_gbs():.1f} GB/s; {args.op}")
    print("| ranks | size | Gloo | mcp shm | mcp QUIC | shm busbw | shm vs Gloo | shm vs QUIC |")
    print("|---|---|---|---|---|---|---|---|")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ports = (
        free_port(socket.SOCK_STREAM),
        free_port(socket.SOCK_DGRAM),
        free_port(socket.SOCK_DGRAM),
    )
    procs = [
        ctx.Process(target=worker, args=(r, args.world, ports, args, q)) for r in range(args.world)
    ]
    for pr in procs:
        pr.start()
    rows = q.get(timeout=1800)
    for pr in procs:
        pr.join(60)
    factor = {"all_reduce": 2 * (args.world - 1) / args.world, "broadcast": 1.0}.get(
        args.op, (args.world - 1) / args.world
    )
    for nbytes, t in rows:
        bw = nbytes * factor / t["shm"] / 1e9
        print(
            f"| {args.world} | {nbytes >> 20} MiB | {t['gloo'] * 1e3:.1f} ms "
            f"| {t['shm'] * 1e3:.1f} ms | {t['quic'] * 1e3:.1f} ms | {bw:.2f} GB/s "
            f"| {t['gloo'] / t['shm']:.2f}x "
            f"| {t['quic'] / t['shm']:.2f}x |",
            flush=True,
        )
    print(f"# load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
