"""What the guard tests run on every rank (see ``_launch.run``): DDP with a guarded comm hook,
bad gradients injected on one rank at chosen steps, safe mode with snapshots."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import mcp_fast.torch  # noqa: F401  (registers "mcp")
from mcp_fast.guards import GradientGuard, SafeMode
from mcp_fast.snapshots import Snapshots
from mcp_fast.torch import CompressionState, GuardedState, compression_hook, guarded_allreduce_hook

MAX_NORM = 4.0
LR = 0.1
# step -> (rank, what): rank 1's gradients explode on steps 3-5 (the guard trips on the
# third), rank 0's are NaN on step 7 (in safe mode: a rollback).
FAULTS = {3: (1, 1e6), 4: (1, 1e6), 5: (1, 1e6), 7: (0, float("nan"))}
STEPS = 11


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def guarded_ddp(rank: int, world: int, hook: str) -> dict[str, Any]:
    """Trains with the guarded hook ``hook`` ("allreduce" or "int8") in safe mode, then (with
    "allreduce") once more with ``policy="raise"``; returns both runs' results."""
    dist.init_process_group("mcp", timeout=timedelta(seconds=60))
    out = {"safe": _train(rank, hook, "skip")}
    if hook == "allreduce":
        out["raise"] = _train(rank, hook, "raise")
    dist.destroy_process_group()
    return out


def _train(rank: int, hook: str, policy: str) -> dict[str, Any]:
    """``STEPS`` steps of a small MLP under DDP with the faults of ``FAULTS``: the verdicts,
    the parameters, the update norms, the learning rates and safe mode's counters."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    # Small buckets: several per step, so the hook holds buckets back until the last.
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0001)
    guard = GradientGuard(MAX_NORM, policy=policy, trip_after=3)
    if hook == "allreduce":
        ddp.register_comm_hook(GuardedState(guard), guarded_allreduce_hook)
    else:
        state = CompressionState(codec="int8", block=64, guard=guard)
        ddp.register_comm_hook(state, compression_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    snaps = Snapshots(model, opt, every=2)
    safe = SafeMode(guard, opt, snapshots=snaps, lr_factor=0.1, clip_factor=0.5, recover_after=3)
    gen = torch.Generator().manual_seed(100 + rank)
    out: dict[str, Any] = {"verdicts": [], "update_norms": [], "lrs": [], "local_norms": []}
    snaps.take(0)
    try:
        for step in range(1, STEPS + 1):
            x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
            opt.zero_grad()
            loss = ((ddp(x) - y) ** 2).mean()
            who, scale = FAULTS.get(step, (-1, 1.0))
            if who == rank:
                loss = loss * scale
            before = _flat(model)
            loss.backward()
            r = guard.last
            assert r is not None
            out["verdicts"].append(r.verdict)
            applied = safe.step(step)
            out["update_norms"].append(
                float((_flat(model) - before).norm()) if applied and not safe.rollbacks else None
            )
            out["lrs"].append(opt.param_groups[0]["lr"])
            snaps.maybe_take(step)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
        out["error_mro"] = [c.__name__ for c in type(e).__mro__]
    out["params"] = _flat(model)
    out["entries"], out["rollbacks"], out["active"] = safe.entries, safe.rollbacks, safe.active
    out["max_norm"] = guard.max_norm
    return out
