"""Rank functions for test_hierarchical.py: each rank names its fake host in MCP_HOST_ID."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

import mcp_fast as mcp
from workers import all_reduce_sweep, data


def every_collective(rank: int, world: int, hosts: list[str], sizes: list[int]) -> dict[str, Any]:
    os.environ["MCP_HOST_ID"] = hosts[rank]
    out: dict[str, Any] = {}
    with mcp.init(timeout=60) as g:
        out["topology"] = g.topology()["host_of_rank"]
        out.update(all_reduce_sweep(g, rank, ["auto", "hierarchical", "ring"], sizes))
        for root in range(world):
            for n in sizes:
                b = data("int64", "sum", rank, n, salt=root)
                if rank != root:
                    b[:] = 0
                g.broadcast(b, src=root)
                out[f"broadcast/{root}/{n}"] = b
        for n in sizes:
            x = data("float32", "sum", rank, n, salt=3)
            o = np.empty((world, n), "float32")
            g.all_gather(o, x)
            out[f"all_gather/{n}"] = o
            for op in ["sum", "max"]:
                x = data("int32", op, rank, n * world, salt=5)
                keep = x.copy()
                o = np.empty(n, "int32")
                g.reduce_scatter(o, x, op=op)
                assert np.array_equal(x, keep), "reduce_scatter modified its input"
                out[f"reduce_scatter/{op}/{n}"] = o
        rng = np.random.default_rng(rank)
        c = rng.uniform(-1, 1, 100_003).astype(np.float32)
        out["coded/input"] = c.copy()
        g.all_reduce(c, codec="int8", algorithm="hierarchical")
        out["coded"] = c
    return out


def bad_host(rank: int, world: int) -> list[str]:
    """Topologies that do not cover the group: each a ValueError, the topology unchanged."""
    refused = []
    with mcp.init(timeout=20) as g:
        for bad in ([], ["a"], ["a", "b", "c"]):
            try:
                g.core.set_topology(bad)
            except ValueError as e:
                refused.append(str(e))
        refused.append(str(g.topology()["host_of_rank"]))
    return refused


def under_chaos(rank: int, world: int, hosts: list[str], spec: str) -> dict[str, Any]:
    """Hierarchical collectives through a lossy, reordering socket: exact results."""
    out: dict[str, Any] = {}
    with mcp.init(timeout=120, chaos=spec, host_id=hosts[rank]) as g:
        a = data("float32", "sum", rank, 300_001)
        g.all_reduce(a, algorithm="hierarchical")
        out["all_reduce"] = a
        b = data("int64", "sum", 1, 50_000) if rank == 1 else np.zeros(50_000, "int64")
        g.broadcast(b, src=1)
        out["broadcast"] = b
        out["stats"] = g.chaos_stats()
    return out
