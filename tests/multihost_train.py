"""A few DDP steps of a small MLP with backend "mcp", for test_multihost.py; run under torchrun.

    torchrun ... tests/multihost_train.py --out DIR [--steps N]

Every rank trains on its own shard of a seeded synthetic data set and writes, under DIR,
``rank<R>.bin`` (its final parameters, float32, concatenated in ``parameters()`` order) and
``rank<R>.json`` (the environment torchrun gave it and the address mcp_fast listened on).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import mcp_fast.torch  # noqa: F401  (registers the backend "mcp")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--backend", default="mcp")
    args = p.parse_args()
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    # ~0.6 MiB of gradients: larger than one datagram, several ring chunks on the wire.
    model = nn.Sequential(nn.Linear(64, 384), nn.ReLU(), nn.Linear(384, 384), nn.Linear(384, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + rank)  # a different shard on every rank
    for _ in range(args.steps):
        x = torch.randn(32, 64, generator=gen)
        y = torch.randint(0, 10, (32,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.bin").write_bytes(flat.numpy().tobytes())
    mcp = getattr(dist.group.WORLD, "mcp_group", None)
    info = {
        "rank": rank,
        "world": world,
        "master_addr": os.environ.get("MASTER_ADDR"),
        "local_rank": int(os.environ.get("LOCAL_RANK", "-1")),
        "group_rank": int(os.environ.get("GROUP_RANK", "-1")),
        "hostname": socket.gethostname(),
        "mcp_addr": mcp.local_addr if mcp is not None else None,
        "bytes_sent": mcp.stats()["bytes_sent"] if mcp is not None else 0,
    }
    (args.out / f"rank{rank}.json").write_text(json.dumps(info))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
