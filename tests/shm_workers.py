"""What the shared-memory tests run on every rank (see ``test_shm.py`` and ``_launch.run``)."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
import warnings
from typing import Any

import numpy as np

import mcp_fast as mcp
from workers import all_reduce_sweep, data


def shm_mappings() -> int:
    """How many mappings of our memfd rings this process holds."""
    with open("/proc/self/maps") as f:
        return sum("memfd:mcp-shm-ring" in line for line in f)


def _collectives(g: mcp.Group, rank: int, world: int, sizes: list[int]) -> dict[str, Any]:
    out = all_reduce_sweep(g, rank, ["ring", "tree", "recursive_doubling", "direct"], sizes)
    for n in sizes:
        root = n % world
        b = data("int64", "sum", rank, n, salt=root) if rank == root else np.zeros(n, "int64")
        g.broadcast(b, src=root)
        out[f"broadcast/{n}"] = b
        x = data("float32", "sum", rank, n, salt=3)
        o = np.empty((world, n), "float32")
        g.all_gather(o, x)
        out[f"all_gather/{n}"] = o
        x = data("int32", "sum", rank, n * world, salt=5)
        o = np.empty(n, "int32")
        g.reduce_scatter(o, x, op="sum")
        out[f"reduce_scatter/{n}"] = o
        s = data("float64", "sum", rank, n, salt=9)
        r = np.empty(n, "float64")
        ws = g.send(s, dst=(rank + 1) % world, tag=3, async_op=True)
        g.recv(r, src=(rank - 1) % world, tag=3)
        ws.wait()
        out[f"recv/{n}"] = r
    g.barrier()
    return out


def collectives(rank: int, world: int, sizes: list[int], host_ids: list[str] | None) -> dict:
    """Every collective, then the topology and the counters of both paths."""
    if host_ids is not None:
        os.environ["MCP_HOST_ID"] = host_ids[rank]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = mcp.init(timeout=120)
    with g:
        out = _collectives(g, rank, world, sizes)
        out["topology"] = g.topology()
        out["shm_stats"] = g.shm_stats()
        out["stats"] = g.stats()
        out["mappings"] = shm_mappings()
    out["warnings"] = [str(w.message) for w in caught if w.category is mcp.SharedMemoryWarning]
    return out


def killed_mid_collective(rank: int, world: int, victim: int) -> dict:
    """All-reduces 4 MiB until a peer dies; the victim SIGKILLs itself in the middle."""
    g = mcp.init(timeout=30)
    before = shm_mappings()
    a = np.ones(1 << 20, "float32")
    g.all_reduce(a)  # everyone is up and the rings are in use
    if rank == victim:
        # From another thread, while the main thread is inside an all-reduce.
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
    err: BaseException | None = None
    t0 = time.monotonic()
    for _ in range(100_000):
        try:
            g.all_reduce(a)
        except mcp.MCPError as e:
            err = e
            break
        if time.monotonic() - t0 > 20:
            break
    g.close()
    del g
    gc.collect()
    return {
        "type": type(err).__name__,
        "rank": getattr(err, "rank", None),
        "message": str(err),
        "mappings_before": before,
        "mappings_after": shm_mappings(),
    }


def with_failure(rank: int, world: int, fail: dict[int, str]) -> dict:
    """`MCP_SHM_FAIL` on some ranks: the warnings, the topology and a checked all-reduce."""
    if rank in fail:
        os.environ["MCP_SHM_FAIL"] = fail[rank]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = mcp.init(timeout=60)
    with g:
        a = data("float32", "sum", rank, 300_001)
        g.all_reduce(a)
        out = {
            "sum": a,
            "topology": g.topology(),
            "shm_stats": g.shm_stats(),
            "warnings": [str(w.message) for w in caught if w.category is mcp.SharedMemoryWarning],
        }
    return out


def direct_reads(rank: int, world: int, declines: list[int]) -> dict:
    """All-reduces with the default algorithm, `MCP_SHM_DIRECT=0` on the ranks in `declines`:
    the result and how many bytes went through the rings."""
    if rank in declines:
        os.environ["MCP_SHM_DIRECT"] = "0"
    g = mcp.init(timeout=60)
    with g:
        before = g.shm_stats()["bytes_sent"]
        a = data("float32", "sum", rank, 300_001)
        g.all_reduce(a)
        b = data("float64", "avg", rank, 1 << 20)
        g.all_reduce(b, op="avg")
        st = g.shm_stats()
        return {
            "sum": a,
            "avg": b,
            "ring_bytes": st["bytes_sent"] - before,
            "direct": (st["direct_ops"], st["direct_fallbacks"]),
        }
