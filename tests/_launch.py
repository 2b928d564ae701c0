"""Run a function of ``workers.py`` in N real processes on 127.0.0.1 and collect the results.

Each rank is a fresh interpreter (multiprocessing 'spawn'), so nothing is shared but the
network. A rank's exception comes back as ``Failure`` with its type name, message and
attributes, so that tests can assert on the error every rank saw. Every run is bounded in
time; ranks still running at the deadline are killed and reported.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import random
import socket
import time
import traceback
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Failure:
    """The exception a rank raised."""

    type: str
    message: str
    attrs: dict[str, Any] = field(default_factory=dict)
    mro: list[str] = field(default_factory=list)


def free_port() -> int:
    """A port free for both UDP (our rank 0) and TCP (torch's store) on 127.0.0.1.

    Chosen below the kernel's ephemeral range (32768 and up), so that sockets other processes
    bind to port 0 meanwhile cannot take it between this check and rank 0's bind.
    """
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
                u.bind(("127.0.0.1", port))
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t:
                t.bind(("127.0.0.1", port))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port found in 20000-32000")


def plain(obj: Any) -> Any:
    """Torch tensors become numpy arrays (a tensor sent through a queue would be shared
    memory that vanishes with its process); containers are converted recursively."""
    if type(obj).__module__.startswith("torch") and hasattr(obj, "numpy"):
        t = obj.detach().cpu()
        return t.float().numpy() if str(t.dtype) == "torch.bfloat16" else t.numpy()
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(plain(v) for v in obj)
    return obj


def _child(fn_name: str, rank: int, world: int, port: int, args: tuple, env: dict, q: Any) -> None:
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    import importlib

    module, _, fn = fn_name.rpartition(".")
    try:
        result = getattr(importlib.import_module(module or "workers"), fn)(rank, world, *args)
        q.put((rank, "ok", plain(result)))
    except BaseException as e:
        attrs = {k: v for k, v in vars(e).items() if isinstance(v, (int, float, str, type(None)))}
        mro = [c.__name__ for c in type(e).__mro__]
        msg = f"{e}\n{traceback.format_exc()}"
        q.put((rank, "err", Failure(type(e).__name__, msg, attrs, mro)))


def run(
    fn_name: str,
    world: int,
    *args: Any,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    ranks: list[int] | None = None,
    expect_stuck: list[int] | None = None,
) -> list[Any]:
    """Run ``workers.<fn_name>(rank, world, *args)`` on every rank (or only ``ranks``).

    Returns each rank's result, or a :class:`Failure`. Raises ``TimeoutError`` if a rank
    neither returned nor failed within ``timeout`` seconds, except the ranks listed in
    ``expect_stuck`` (a frozen process): once the others are done, those are killed and
    reported as ``Failure("Stuck", ...)``.
    """
    stuck = set(expect_stuck or [])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    env = dict(env or {})
    ranks = list(range(world)) if ranks is None else ranks
    procs = {
        r: ctx.Process(target=_child, args=(fn_name, r, world, port, args, env, q), daemon=True)
        for r in ranks
    }
    for p in procs.values():
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while any(r not in results for r in ranks if r not in stuck):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, _status, value = q.get(timeout=min(left, 0.5))
            except queue.Empty:
                # A rank that died without reporting (killed on purpose, or crashed).
                for r, p in procs.items():
                    if r not in results and not p.is_alive() and p.exitcode is not None:
                        results[r] = Failure("Died", f"exit code {p.exitcode}")
                continue
            results[rank] = value
    finally:
        for r in stuck:
            procs[r].kill()  # SIGKILL ends a stopped process too
        for p in procs.values():
            p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join(5)
        q.close()
    for r in stuck:
        results.setdefault(r, Failure("Stuck", "killed after the others finished"))
    missing = [r for r in ranks if r not in results]
    if missing:
        raise TimeoutError(f"ranks {missing} of {fn_name} did not finish within {timeout} s")
    return [results[r] for r in ranks]


def ok(results: list[Any]) -> list[Any]:
    """Assert that every rank succeeded and return the results."""
    bad = {r: f for r, f in enumerate(results) if isinstance(f, Failure)}
    assert not bad, "ranks failed:\n" + "\n".join(f"rank {r}: {f.message}" for r, f in bad.items())
    return results
