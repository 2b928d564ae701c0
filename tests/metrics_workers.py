"""Functions that the metrics tests run on every rank (see ``_launch.run``)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

import mcp_fast as mcp
from mcp_fast import metrics


def _some_traffic(g: mcp.Group, rank: int, world: int) -> None:
    a = np.ones(1 << 16, np.float32)
    for _ in range(3):
        g.all_reduce(a)
    g.broadcast(a, src=0)
    w = g.all_reduce(np.ones(10, np.float64), async_op=True)
    assert w is not None and w.wait()
    small = np.arange(8, dtype=np.int32)
    if rank == 0:
        g.send(small, dst=1)
    elif rank == 1:
        assert g.recv(small, src=None) == 0  # a sync recv returns the sender's rank
    g.barrier()
    try:  # rejected before anything is sent: counts as a failed broadcast on every rank
        g.broadcast(a, src=world)
    except ValueError:
        pass


def snapshot_after_collectives(rank: int, world: int) -> dict[str, Any]:
    with mcp.init(timeout=30) as g:
        _some_traffic(g, rank, world)
        everything = metrics.snapshot()
        mine = metrics.snapshot(g)
        g.barrier()
    closed = metrics.snapshot(g)
    return {"all": everything, "mine": mine, "closed": closed, "live_after": metrics.snapshot()}


def serve_metrics(rank: int, world: int, workdir: str, hold_s: float) -> dict[str, Any]:
    """Run some collectives, serve metrics (rank 0 through prometheus_client when installed,
    the others through the built-in server), publish the port in ``workdir/<rank>.port`` and
    hold until ``workdir/stop`` appears (at most ``hold_s`` seconds)."""
    d = Path(workdir)
    with mcp.init(timeout=60) as g:
        _some_traffic(g, rank, world)
        host, port = metrics.start_exporter(use_prometheus_client=None if rank == 0 else False)
        try:
            tmp = d / f"{rank}.port.tmp"
            tmp.write_text(f"{host}:{port}")
            os.replace(tmp, d / f"{rank}.port")
            deadline = time.monotonic() + hold_s
            while not (d / "stop").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            metrics.stop_exporter()
        g.barrier()
    return {"host": host, "port": port}
