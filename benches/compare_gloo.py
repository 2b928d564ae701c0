"""mcp_fast vs Gloo (torch.distributed) all-reduce, same processes, same tensors, same run.

    python benches/compare_gloo.py [--worlds 2 4] [--max-mib 64] [--algorithm auto]

Prints a table of time per all-reduce and bus bandwidth (bytes x 2(W-1)/W / time), the
figure NCCL's tests report, for float32 tensors from 4 KiB to 64 MiB.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import socket
import sys
import time

from tqdm import tqdm


def free_port(kind: int) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sizes(max_mib: int) -> list[int]:
    out, b = [], 4096
    while b <= max_mib << 20:
        out.append(b)
        b *= 4
    return out


def worker(rank: int, world: int, ports: tuple[int, int], args: argparse.Namespace, q) -> None:
    import torch
    import torch.distributed as dist

    import mcp_fast as mcp

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=world
    )
    g = mcp.init(rank=rank, world_size=world, master_port=ports[1], secret="bench", timeout=120)
    rows = []
    todo = sizes(args.max_mib)
    desc = f"{world} ranks"
    for nbytes in tqdm(todo, desc=desc, unit="size", disable=rank != 0, file=sys.stderr):
        t = torch.ones(nbytes // 4)
        iters = max(3, min(200, int(3e8 // max(nbytes, 1))))
        timing: dict[str, list[float]] = {"gloo": [], "mcp": []}
        runners = {
            "gloo": lambda t=t: dist.all_reduce(t),
            "mcp": lambda t=t: g.all_reduce(t, algorithm=args.algorithm),
        }
        for _ in range(args.repeats):
            for name, fn in runners.items():
                fn()  # warm up (connections, buffers)
                # Each backend from its own barrier (see bench_loss.py).
                (dist.barrier if name == "gloo" else g.barrier)()
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                timing[name].append((time.perf_counter() - t0) / iters)
        if rank == 0:
            rows.append((nbytes, min(timing["gloo"]), min(timing["mcp"])))
    g.close()
    dist.destroy_process_group()
    if rank == 0:
        q.put(rows)


def human(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--max-mib", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--algorithm", default="auto")
    args = p.parse_args()
    cpu = platform.processor() or platform.machine()
    print(f"# {platform.node()}: {os.cpu_count()} CPUs, {cpu}")
    print("| ranks | size | Gloo time | mcp_fast time | Gloo busbw | mcp_fast busbw | speed-up |")
    print("|---|---|---|---|---|---|---|")
    ctx = mp.get_context("spawn")
    for world in args.worlds:
        q = ctx.Queue()
        ports = (free_port(socket.SOCK_STREAM), free_port(socket.SOCK_DGRAM))
        procs = [ctx.Process(target=worker, args=(r, world, ports, args, q)) for r in range(world)]
        for pr in procs:
            pr.start()
        rows = q.get(timeout=1800)
        for pr in procs:
            pr.join(60)
        factor = 2 * (world - 1) / world
        for nbytes, tg, tm in rows:
            bw = [nbytes * factor / t / 1e9 for t in (tg, tm)]
            print(
                f"| {world} | {human(nbytes)} | {tg * 1e3:.3f} ms | {tm * 1e3:.3f} ms "
                f"| {bw[0]:.2f} GB/s | {bw[1]:.2f} GB/s | {tg / tm:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
