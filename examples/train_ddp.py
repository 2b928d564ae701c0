"""Train a classifier on scikit-learn's handwritten digits with DDP over MCP (or Gloo).

    torchrun --nproc-per-node 2 examples/train_ddp.py --backend mcp --epochs 8 [--json OUT]

The data ships with scikit-learn (1,797 8x8 images, 10 classes); each rank trains on its
shard. Rank 0 shows a progress bar (tqdm, on a terminal), prints per-epoch loss, accuracy on a
held-out split, throughput and the bytes mcp_fast put on the wire, and a summary table at the
end. With ``--json OUT`` rank 0 also rewrites OUT after every epoch (backend, seconds since
the start, loss and accuracy of each epoch so far), so that a run cut off by a time limit
still says how far it got (``examples/demo_compare.py`` reads it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.datasets import load_digits
from tqdm import tqdm

import mcp_fast.torch  # noqa: F401  (registers the backend "mcp")


def data(rank: int, world: int) -> tuple[torch.Tensor, ...]:
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(x), generator=gen)
    x, y = x[perm], y[perm]
    n_test = 297
    xt, yt, xs, ys = x[:n_test], y[:n_test], x[n_test:], y[n_test:]
    return xs[rank::world], ys[rank::world], xt, yt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["mcp", "gloo"], default="mcp")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0, help="model initialisation")
    p.add_argument("--json", help="rank 0 rewrites this file after every epoch")
    args = p.parse_args()
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    xs, ys, xt, yt = data(rank, world)
    steps = len(xs) // args.batch
    # With "mcp", the default group is our ProcessGroup: its mcp_group has the counters.
    mcp_group = getattr(dist.group.WORLD, "mcp_group", None)
    rows = []
    t_start = time.perf_counter()
    show = rank == 0 and sys.stderr.isatty()
    for epoch in range(args.epochs):
        t0 = time.perf_counter()
        total = 0.0
        bar = tqdm(
            range(steps), desc=f"{args.backend} epoch {epoch + 1}", leave=False, disable=not show
        )
        for i in bar:
            xb, yb = (
                xs[i * args.batch : (i + 1) * args.batch],
                ys[i * args.batch : (i + 1) * args.batch],
            )
            opt.zero_grad()
            loss = nn.functional.cross_entropy(ddp(xb), yb)
            loss.backward()
            opt.step()
            total += loss.item()
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
        dt = time.perf_counter() - t0
        with torch.no_grad():
            acc = (model(xt).argmax(1) == yt).float().mean().item()
        loss_t = torch.tensor([total / steps])
        dist.all_reduce(
            loss_t, op=dist.ReduceOp.AVG if args.backend == "mcp" else dist.ReduceOp.SUM
        )
        mean_loss = loss_t.item() / (1 if args.backend == "mcp" else world)
        wire = mcp_group.total_bytes_sent() if mcp_group is not None else 0
        rows.append((epoch + 1, mean_loss, acc, steps * args.batch * world / dt, wire))
        if rank == 0 and args.json:
            Path(args.json).write_text(
                json.dumps(
                    {
                        "backend": args.backend,
                        "world": world,
                        "seed": args.seed,
                        "epochs": args.epochs,
                        "seconds": time.perf_counter() - t_start,
                        "rows": [
                            {"epoch": e, "loss": lo, "accuracy": ac, "samples_per_s": sp}
                            for e, lo, ac, sp, _ in rows
                        ],
                    }
                )
            )
        if rank == 0:
            print(
                f"epoch {epoch + 1:2d}  loss {mean_loss:.4f}  test acc {acc:.3f}  "
                f"{rows[-1][3]:8.0f} samples/s  wire {wire / 2**20:7.2f} MiB sent by rank 0",
                flush=True,
            )
    elapsed = time.perf_counter() - t_start
    if rank == 0:
        print(f"\nsummary ({args.backend}, {world} ranks, {elapsed:.1f} s)")
        print("| epoch | loss | test accuracy | samples/s | MiB sent (rank 0) |")
        print("|---|---|---|---|---|")
        for e, lo, ac, sps, w in rows:
            print(f"| {e} | {lo:.4f} | {ac:.3f} | {sps:.0f} | {w / 2**20:.2f} |")
    final_acc = rows[-1][2]
    dist.destroy_process_group()
    if final_acc < 0.85:
        print(
            f"rank {rank}: accuracy {final_acc:.3f} is below 0.85: training failed", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
