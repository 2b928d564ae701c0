"""Functions that the parameter-server tests run in worker threads and processes."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np

from mcp_fast import ps

D, K = 20, 4


def data(seed: int, n: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """A separable 4-class problem; every worker draws its own shard from ``seed``."""
    centers = np.random.default_rng(1234).normal(0, 0.5, (K, D)).astype(np.float32)
    rng = np.random.default_rng(seed)
    y = rng.integers(0, K, n)
    x = (centers[y] + rng.normal(0, 1.0, (n, D))).astype(np.float32)
    return x, y


def init_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "W": (rng.normal(0, 0.1, (D, K))).astype(np.float32),
        "b": np.zeros(K, np.float32),
    }


def loss_and_grads(
    p: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray
) -> tuple[float, dict[str, np.ndarray]]:
    """Softmax regression: mean cross-entropy and its gradients (deterministic numpy)."""
    logits = x @ p["W"] + p["b"]
    logits = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(logits)
    prob = e / e.sum(axis=1, keepdims=True)
    n = len(y)
    loss = float(-np.log(prob[np.arange(n), y] + 1e-12).mean())
    d = prob.copy()
    d[np.arange(n), y] -= 1.0
    d /= np.float32(n)
    return loss, {"W": (x.T @ d).astype(np.float32), "b": d.sum(axis=0).astype(np.float32)}


def batch(x: np.ndarray, y: np.ndarray, step: int, size: int = 64) -> tuple[np.ndarray, ...]:
    i = (step * size) % (len(x) - size)
    return x[i : i + size], y[i : i + size]


def train(
    wid: int | str,
    servers: list[str],
    secret: str,
    steps: int,
    die_at: int | None,
    pause: float,
    dead_after: float,
    freeze_at: int | None = None,
) -> dict[str, Any]:
    """Train softmax regression for ``steps`` clocks; SIGKILL itself at clock ``die_at``,
    SIGSTOP itself at clock ``freeze_at`` (until someone sends SIGCONT).

    ``wid="vacant"`` starts a replacement: it trains on the shard of the id it takes over.
    Returns the worker id, the clock it started at, the trace of (clock after step, slowest
    live clock reported, loss, time) and the connection counters."""
    trace = []
    with ps.Worker(servers, wid, secret=secret, timeout=30, dead_after=dead_after) as w:  # type: ignore[arg-type]
        start_clock = w.clock
        x, y = data(seed=w.worker_id)
        w.init(init_params())
        for _ in range(steps):
            p = w.pull()
            loss, g = loss_and_grads(p, *batch(x, y, w.clock + w.worker_id))
            w.push(g)
            if die_at is not None and w.clock >= die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if freeze_at is not None and w.clock == freeze_at:
                os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(pause)
            c = w.step()
            trace.append((c, w.last_min_clock, loss, time.time()))
        counters = w.counters()
    return {
        "worker_id": w.worker_id,
        "generation": w.generation,
        "start_clock": start_clock,
        "trace": trace,
        "counters": counters,
    }


def until_clock(w: ps.Worker, steps: int, die_at: int) -> dict[str, Any]:
    """The worker function of ``ps.launch`` in the worker-replacement test: trains until clock
    ``steps``; the first holder of id 1 SIGKILLs itself at clock ``die_at``."""
    x, y = data(seed=w.worker_id)
    w.init(init_params())
    start = w.clock
    while w.clock < steps:
        p = w.pull()
        _, g = loss_and_grads(p, *batch(x, y, w.clock + w.worker_id))
        w.push(g)
        if w.worker_id == 1 and w.generation == 0 and w.clock >= die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.01)
        w.step()
    return {"generation": w.generation, "start": start, "end": w.clock, "pid": os.getpid()}


def launched(w: ps.Worker, steps: int, pause: float) -> dict[str, Any]:
    """The worker function of ``ps.launch`` in the server-recovery test."""
    x, y = data(seed=w.worker_id)
    w.init(init_params())
    trace = []
    for _ in range(steps):
        p = w.pull()
        loss, g = loss_and_grads(p, *batch(x, y, w.clock + w.worker_id))
        w.push(g)
        time.sleep(pause)
        c = w.step()
        trace.append((c, loss, time.time()))
    with w.evaluation() as params:
        final, _ = loss_and_grads(params, *data(seed=99))
    return {"trace": trace, "counters": w.counters(), "final": final, "params": params}


def interrupted_step(q: Any, server: str, secret: str, fused: bool) -> None:
    """Worker 0 steps past worker 1, which never steps, under staleness 0, and gets Ctrl-C
    while it waits: puts how late the KeyboardInterrupt came and what a later call raised."""
    from workers import refusal, seconds_to_interrupt

    try:
        with ps.Worker([server], 0, secret=secret, timeout=60) as w:
            params = init_params()
            w.init(params)
            _, g = loss_and_grads(params, *batch(*data(0), 0))
            late = seconds_to_interrupt(
                (lambda: w.step(g, params)) if fused else w.step,
                "the step past the staleness bound",
            )
            then = refusal(w.pull, Exception)
            q.put(("w0", "ok", {"late": late, **then}))
    except BaseException as e:
        q.put(("w0", "err", f"{type(e).__name__}: {e}"))
