"""What the transport-config tests run on every rank (see ``_launch.run``)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import mcp_fast as mcp


def with_config(
    rank: int, world: int, configs: list[Any], heartbeat: float | None, lane: str | None
) -> dict[str, Any]:
    """Joins with this rank's config, all-reduces losslessly coded and plain data, and reports
    the path as ``health()`` sees it."""
    out: dict[str, Any] = {}
    with mcp.init(timeout=60, config=configs[rank], heartbeat=heartbeat, lane=lane) as g:
        rng = np.random.default_rng(rank)
        # Gradient-like values with many zeros: every coder (raw, Huffman, zstd) has planes.
        a = np.where(rng.random(300_001) < 0.3, 0, rng.standard_normal(300_001)).astype("float32")
        out["in"] = a.copy()
        g.all_reduce(a, codec="lossless")
        out["lossless"] = a
        b = np.full(2_000_000, rank + 1, "float32")
        g.all_reduce(b)
        out["plain"] = b
        # The heartbeat monitor sets each peer's silence limit at its first look (within a
        # heartbeat); wait for it, bounded. No rank closes before every rank has looked (the
        # all-reduce after), so every peer is still connected here.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            out["health"] = g.health()
            if all(
                p["state"] == "connected" and p["silence_limit"] is not None for p in out["health"]
            ):
                break
            time.sleep(0.05)
        g.all_reduce(np.zeros(1, "float32"))
        out["lane_stats"] = g.lane_stats()
    return out


def codec_per_rank(rank: int, world: int, codecs: list[str], configs: list[Any]) -> None:
    """All-reduces with this rank's codec (ranks that disagree must fail, not sum garbage)."""
    with mcp.init(timeout=30, config=configs[rank]) as g:
        g.all_reduce(np.ones(100_000, "float32"), codec=codecs[rank])


def torch_with_config(rank: int, world: int, pg_options: Any) -> dict[str, Any]:
    """``init_process_group("mcp", pg_options=...)`` (``None``: from ``MCP_CONFIG``): an exact
    all-reduce, and the path's MTU."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import mcp_fast.torch  # noqa: F401  (registers "mcp")

    dist.init_process_group("mcp", timeout=timedelta(seconds=60), pg_options=pg_options)
    t = torch.full((100_000,), float(rank + 1))
    dist.all_reduce(t)
    g = dist.group.WORLD.mcp_group  # type: ignore[union-attr]
    out = {"sum": t.numpy(), "mtu": [p["mtu"] for p in g.health() if p["state"] == "connected"]}
    dist.barrier()
    dist.destroy_process_group()
    return out


def torch_rank0_refuses(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 alone has a lane the core refuses (``MCP_LANE``); every rank tries
    ``init_process_group("mcp")``."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    import mcp_fast.torch  # noqa: F401  (registers "mcp")

    if rank == 0:
        os.environ["MCP_LANE"] = "fast"
    dist.init_process_group("mcp", timeout=timedelta(seconds=60))
    dist.destroy_process_group()
    return {}
