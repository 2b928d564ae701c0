"""All-reduce with each wire codec vs Gloo, same processes, same gradients, same run.

    python benches/compare_codecs.py [--mib 16] [--world 2]
    mcp-chaos --rate 1gbit -- python benches/compare_codecs.py     # on a 1 Gbit/s link (root)

The tensors look like gradients (normal, small spread, 10 % exact zeros). Prints time per
all-reduce and the speed-up over Gloo for each codec.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import time

CODECS = ["none", "fp16", "bf16", "int8", "lossless"]


def free_port(kind: int) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker(rank: int, world: int, ports: tuple[int, int], args: argparse.Namespace, q) -> None:
    import torch
    import torch.distributed as dist

    import mcp_fast as mcp

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=world
    )
    g = mcp.init(rank=rank, world_size=world, master_port=ports[1], secret="bench", timeout=300)
    gen = torch.Generator().manual_seed(rank)
    base = torch.randn(args.mib << 18, generator=gen) * 1e-3
    base[torch.rand(base.shape, generator=gen) < 0.1] = 0.0
    t = base.clone()
    runs = {"gloo": lambda: dist.all_reduce(t)}
    for c in CODECS:
        runs[f"mcp {c}"] = lambda c=c: g.all_reduce(t, codec=c, block=256)
    times: dict[str, float] = {}
    for name, fn in runs.items():
        t.copy_(base)
        fn()
        dist.barrier()
        best = float("inf")
        for _ in range(args.repeats):
            t.copy_(base)
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        times[name] = best
    g.close()
    dist.destroy_process_group()
    if rank == 0:
        q.put(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--mib", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ports = (free_port(socket.SOCK_STREAM), free_port(socket.SOCK_DGRAM))
    procs = [
        ctx.Process(target=worker, args=(r, args.world, ports, args, q)) for r in range(args.world)
    ]
    for pr in procs:
        pr.start()
    times = q.get(timeout=1800)
    for pr in procs:
        pr.join(60)
    print(f"all-reduce of {args.mib} MiB float32 gradients, {args.world} ranks")
    print("| transport | time | vs Gloo |")
    print("|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {t * 1e3:.1f} ms | {times['gloo'] / t:.2f}x |")


if __name__ == "__main__":
    main()
