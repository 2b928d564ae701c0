"""All-reduce with each wire codec vs Gloo, same processes, same gradients, same run.

    python benches/compare_codecs.py [--mib 16] [--world 2]
    mcp-chaos --rate 1gbit -- python benches/compare_codecs.py     # on a 1 Gbit/s link (root)
        --link "1 Gbit/s (mcp-chaos --rate 1gbit)" --json docs/data/codecs.json

The tensors look like gradients (normal, small spread, 10 % exact zeros). Prints time per
all-reduce and the speed-up over Gloo for each codec; ``--json FILE`` also writes the times
(seconds) for ``benches/plots.py``, with ``--link`` (what link this ran on) in its title.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shlex
import socket
import sys
import time
from pathlib import Path

from tqdm import tqdm

CODECS = ["none", "fp16", "bf16", "int8", "lossless"]


def free_port(kind: int) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def synthetic(rank: int, mib: int):
    import torch

    gen = torch.Generator().manual_seed(rank)
    base = torch.randn(mib << 18, generator=gen) * 1e-3
    base[torch.rand(base.shape, generator=gen) < 0.1] = 0.0
    return base


def real_gradients(rank: int):
    """The flattened gradients of the demo's digits MLP (widened to 64-1024-1024-10, ~5 MiB)
    after a few training steps: what DDP would all-reduce."""
    import torch
    import torch.nn as nn
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)[rank::2]
    y = torch.tensor(y, dtype=torch.long)[rank::2]
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for i in range(5):
        opt.zero_grad()
        nn.functional.cross_entropy(
            model(x[i * 64 : (i + 1) * 64]), y[i * 64 : (i + 1) * 64]
        ).backward()
        opt.step()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).contiguous()


def worker(rank: int, world: int, ports: tuple[int, int], args: argparse.Namespace, q) -> None:
    import torch
    import torch.distributed as dist

    import mcp_fast as mcp

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=world
    )
    g = mcp.init(rank=rank, world_size=world, master_port=ports[1], secret="bench", timeout=300)
    base = real_gradients(rank) if args.real else synthetic(rank, args.mib)
    t = base.clone()
    runs = {"gloo": lambda: dist.all_reduce(t)}
    for c in CODECS:
        runs[f"mcp {c}"] = lambda c=c: g.all_reduce(t, codec=c, block=256)
    times: dict[str, float] = {}
    for name, fn in tqdm(runs.items(), desc="transports", disable=rank != 0, file=sys.stderr):
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
    p.add_argument("--real", action="store_true", help="gradients of the demo model")
    p.add_argument("--link", default="loopback", help="the link this runs on, for --json")
    p.add_argument("--json", help="also write the times to this file (for benches/plots.py)")
    args = p.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
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
    what = "the demo model's gradients" if args.real else f"{args.mib} MiB of synthetic gradients"
    print(f"all-reduce of {what} (float32), {args.world} ranks")
    print("| transport | time | vs Gloo |")
    print("|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {t * 1e3:.1f} ms | {times['gloo'] / t:.2f}x |")
    if args.json:
        meta = {
            "command": shlex.join(["python", "benches/compare_codecs.py", *sys.argv[1:]]),
            "date": started,
            "cpus": os.cpu_count(),
            "title": f"all-reduce of {what}, {args.world} ranks, {args.link}",
        }
        labels = {"gloo": "Gloo", "mcp none": "mcp_fast"}
        labels.update({f"mcp {c}": f"mcp_fast\n{c}" for c in CODECS if c != "none"})
        out = {"meta": meta, "times": times, "labels": labels}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
