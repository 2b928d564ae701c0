"""Train the digits MLP asynchronously with a parameter server over MCP.

    python examples/train_ps.py --servers 2 --workers 3 --staleness 3
    torchrun --nproc-per-node 5 examples/train_ps.py --servers 2 --torchrun

The model and data are those of examples/train_ddp.py (scikit-learn's 8x8 digits, a
64-256-256-10 MLP). Each worker trains on its shard: pull the parameters into the model,
compute the gradient of a batch, push it, step the clock (``w.step(grads, into=params)``
does all three in one round trip); the servers apply SGD with
momentum (or Adam) to the mean of each clock's gradients, and let no worker run more than
``--staleness`` clocks ahead of the slowest. ``--slow`` makes worker 0 that much slower
(0.3 = 30 %). At the end every worker enters evaluation mode (a barrier) and reports the
test accuracy of the same parameters.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.nn as nn
from sklearn.datasets import load_digits
from tqdm import tqdm

from mcp_fast import ps


def data(rank: int, world: int) -> tuple[torch.Tensor, ...]:
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    n_test = 297
    xt, yt, xs, ys = x[:n_test], y[:n_test], x[n_test:], y[n_test:]
    return xs[rank::world], ys[rank::world], xt, yt


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )


def train(w: ps.Worker, epochs: int, batch: int, slow: float, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    net = model()
    params = ps.params_of(net)
    w.init(params)
    xs, ys, xt, yt = data(w.worker_id, world)
    steps = len(xs) // batch
    rows = []
    t_start = time.perf_counter()
    for epoch in range(epochs):
        t0 = time.perf_counter()
        total = 0.0
        w.pull(into=params)
        show = w.worker_id == 0 and sys.stderr.isatty()  # worker 0's progress, on a terminal
        for i in tqdm(range(steps), desc=f"epoch {epoch + 1}", leave=False, disable=not show):
            t_step = time.perf_counter()
            xb, yb = xs[i * batch : (i + 1) * batch], ys[i * batch : (i + 1) * batch]
            net.zero_grad()
            loss = nn.functional.cross_entropy(net(xb), yb)
            loss.backward()
            if slow and w.worker_id == 0:
                time.sleep(slow * (time.perf_counter() - t_step))
            # push the gradients, finish the clock, pull the parameters: one round trip
            w.step(ps.grads_of(net), into=params)
            total += loss.item()
        rows.append((epoch + 1, total / steps, steps * batch / (time.perf_counter() - t0)))
    with w.evaluation() as final:
        for k, t in params.items():
            t.copy_(torch.from_numpy(final[k]).view_as(t))
    with torch.no_grad():
        acc = (net(xt).argmax(1) == yt).float().mean().item()
    return {"rows": rows, "acc": acc, "elapsed": time.perf_counter() - t_start}


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> int:
    print(
        f"parameter server: {args.servers} server(s), {len(results)} workers, "
        f"staleness {args.staleness}, {args.optimizer}"
    )
    print("| epoch | mean loss (workers) | samples/s (all workers) |")
    print("|---|---|---|")
    for e in range(args.epochs):
        loss = sum(r["rows"][e][1] for r in results) / len(results)
        sps = sum(r["rows"][e][2] for r in results)
        print(f"| {e + 1} | {loss:.4f} | {sps:.0f} |")
    accs = {round(r["acc"], 6) for r in results}
    acc = results[0]["acc"]
    print(
        f"test accuracy after the evaluation barrier: {acc:.3f} (same on every worker: "
        f"{len(accs) == 1}); {max(r['elapsed'] for r in results):.1f} s"
    )
    if acc < 0.85:
        print(f"accuracy {acc:.3f} is below 0.85: training failed", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--staleness", type=int, default=3)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--optimizer", choices=["sgd", "adam", "adamw"], default="adam")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--slow", type=float, default=0.0, help="worker 0 is this much slower")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--torchrun", action="store_true", help="roles from RANK/WORLD_SIZE")
    args = p.parse_args()
    lr = args.lr if args.lr is not None else (0.02 if args.optimizer == "sgd" else 1e-3)
    skw = {"optimizer": args.optimizer, "lr": lr, "momentum": 0.9, "staleness": args.staleness}
    if args.torchrun:
        world = int(os.environ["WORLD_SIZE"]) - args.servers
        out = ps.run_from_env(
            lambda w: train(w, args.epochs, args.batch, args.slow, world),
            num_servers=args.servers,
            server_kwargs=skw,
        )
        if out is not None:
            print(f"worker {os.environ['RANK']}: test accuracy {out['acc']:.3f}")
            return 0 if out["acc"] >= 0.85 else 1
        return 0
    results = ps.launch(
        train,
        num_workers=args.workers,
        num_servers=args.servers,
        args=(args.epochs, args.batch, args.slow, args.workers),
        server_kwargs=skw,
        checkpoint_dir=args.checkpoint_dir,
    )
    return report(results, args)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
