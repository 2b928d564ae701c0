"""Memory and time of in-memory snapshots (``python benches/bench_snapshots.py``).

An MLP of 4.2 M parameters trained with AdamW (lr 1e-3) on random data; a snapshot every
``EVERY`` steps within a 256 MiB budget. Prints what one snapshot holds raw (weights and both
Adam moments), what the newest (full) and the older (delta) snapshots take coded, how many
fit the budget against raw copies, and the time to take one and to roll back.
"""

from __future__ import annotations

import time

import torch

from mcp_fast.snapshots import Snapshots

EVERY = 10
BUDGET = 256 << 20


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[m for _ in range(4) for m in (torch.nn.Linear(1024, 1024), torch.nn.GELU())]
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    snaps = Snapshots(model, opt, every=EVERY, budget_bytes=BUDGET)
    x, y = torch.randn(64, 1024), torch.randn(64, 1024)
    takes = []
    for step in range(1, 12 * EVERY + 1):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        t0 = time.perf_counter()
        if snaps.maybe_take(step):
            takes.append(time.perf_counter() - t0)
    info = snaps.info()
    raw = info[-1].raw_nbytes
    deltas = [i.nbytes for i in info[:-1]]
    t0 = time.perf_counter()
    snaps.rollback()
    newest = time.perf_counter() - t0
    print(f"parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M")
    print(f"one snapshot raw (weights + Adam moments): {raw / 2**20:.1f} MiB")
    print(
        f"newest (full, zstd byte planes): {info[-1].nbytes / 2**20:.1f} MiB "
        f"({info[-1].nbytes / raw:.2f} of raw)"
    )
    print(
        f"older (delta vs next newer, {EVERY} steps apart): "
        f"{sum(deltas) / len(deltas) / 2**20:.1f} MiB on average "
        f"({sum(deltas) / len(deltas) / raw:.2f} of raw)"
    )
    print(
        f"stored: {len(info)} snapshots in {snaps.nbytes / 2**20:.1f} MiB of a "
        f"{BUDGET / 2**20:.0f} MiB budget (raw copies: {BUDGET // raw}); "
        f"ratio {snaps.ratio():.2f}; {snaps.evicted} evicted"
    )
    print(
        f"take: {sum(takes) / len(takes) * 1e3:.0f} ms on average; "
        f"rollback to the newest: {newest * 1e3:.0f} ms"
    )


if __name__ == "__main__":
    main()
