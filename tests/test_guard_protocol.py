"""The gradient-norm guard in the protocol layer: on the DDP comm hooks (plain and
compressed) and on parameter-server pushes, and safe mode after it trips (rollback to a
snapshot, a lower learning rate, harder clipping)."""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import pytest
import torch

import guard_workers as gw
from _launch import free_port, ok, run
from mcp_fast import ps
from mcp_fast.guards import GradientGuard, GradientWarning, SafeMode
from mcp_fast.snapshots import Snapshots
from mcp_fast.torch import CompressionState, GuardedState

# What every rank's guard says at each step of guard_workers.FAULTS: rank 1's exploding
# gradients are clipped twice, then the guard trips (safe mode: rollback, lr x0.1); rank 0's
# NaN on step 7 is skipped and rolled back; three good steps later safe mode ends.
EXPECTED = ["ok", "ok", "clipped", "clipped", "tripped", "ok", "nonfinite", "ok", "ok", "ok", "ok"]
LRS = [0.1] * 4 + [0.1 * 0.1] * 5 + [0.1] * 2


@pytest.mark.parametrize("hook", ["allreduce", "int8"])
def test_ddp_hooks_guard_the_wire_agree_on_every_rank_and_enter_safe_mode(hook: str) -> None:
    results = ok(run("guard_workers.guarded_ddp", 2, hook, timeout=150))
    runs = [r["safe"] for r in results]
    for r in runs:
        assert "error" not in r, r.get("error")
        assert r["verdicts"] == EXPECTED, r["verdicts"]
        assert r["lrs"] == pytest.approx(LRS)
        assert (r["entries"], r["rollbacks"], r["active"]) == (1, 2, False)
        assert r["max_norm"] == gw.MAX_NORM  # back to normal after safe mode
        assert torch.isfinite(torch.as_tensor(r["params"])).all()
        # The clipped steps' updates: rank 1's 1e6-times gradients were clipped to max_norm
        # before they were sent, so the averaged update is at most lr * max_norm.
        for step in (3, 4):
            assert r["update_norms"][step - 1] <= gw.LR * gw.MAX_NORM * 1.001, r["update_norms"]
    # The replicas stayed identical through clipping, skipping and rollbacks.
    a, b = (np.asarray(r["params"]) for r in runs)
    assert a.tobytes() == b.tobytes()
    if hook == "allreduce":
        # policy="raise": the trip fails the backward pass on every rank, typed.
        for r in results:
            e = r["raise"]
            assert e["verdicts"] == EXPECTED[:4], e
            assert e["error"].startswith("GradientError: gradient guard tripped"), e["error"]
            assert "MCPError" in e["error_mro"]


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(8, 16)


def _backward(model: torch.nn.Module, x: torch.Tensor, scale: float = 1.0) -> None:
    model.zero_grad()
    (model(x).square().mean() * scale).backward()


@pytest.mark.filterwarnings("ignore::mcp_fast.guards.GradientWarning")
def test_safe_mode_rolls_back_lowers_lr_clips_harder_and_recovers() -> None:
    model, opt, x = _model()
    guard = GradientGuard(max_norm=10.0, trip_after=3)
    snaps = Snapshots(model, opt, every=1)
    safe = SafeMode(guard, opt, snapshots=snaps, lr_factor=0.5, clip_factor=0.25, recover_after=2)
    saved = {}
    for step in range(1, 4):
        _backward(model, x)
        guard.check(model.parameters())
        assert safe.step(step)
        snaps.maybe_take(step)
        saved[step] = copy.deepcopy(model.state_dict())
    # Steps 4-6 explode: clipped, clipped (applied, clipped to max_norm), then tripped.
    for step in (4, 5, 6):
        _backward(model, x, 1e6)
        r = guard.check(model.parameters())
        applied = safe.step(step)
        assert applied == (step != 6) and r.verdict == ("tripped" if step == 6 else "clipped")
        snaps.maybe_take(step)
    # Rolled back to the snapshot from before the streak (step 3), not the newest (step 5).
    assert safe.active and safe.entries == 1 and safe.rollbacks == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[3][k]), k
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert guard.max_norm == 2.5 and guard.consecutive_bad == 0
    # A NaN in safe mode: skipped and rolled back again.
    snaps.maybe_take(7)
    _backward(model, x, float("nan"))
    assert guard.check(model.parameters()).verdict == "nonfinite"
    assert not safe.step(8) and safe.rollbacks == 2
    # Two good steps end safe mode: lr and max_norm as before.
    for step in (9, 10):
        _backward(model, x)
        guard.check(model.parameters())
        assert safe.step(step)
    assert not safe.active
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1) and guard.max_norm == 10.0


def test_safe_mode_without_snapshots_or_optimizer_only_clips_harder() -> None:
    guard = GradientGuard(max_norm=1.0, trip_after=2)
    safe = SafeMode(guard, clip_factor=0.5)
    g = np.full(100, 10.0, np.float32)
    with pytest.warns(GradientWarning):
        for _ in range(2):
            guard.check(g.copy())
            safe.update()
    assert safe.active and guard.max_norm == 0.5 and safe.rollbacks == 0


def test_judge_and_check_agree_and_clip_factor_is_checks_factor() -> None:
    a, b = GradientGuard(1.0), GradientGuard(1.0)
    g = np.full(16, 3.0, np.float32)
    norm = float(np.linalg.norm(g.astype(np.float64)))
    r1 = a.check(g.copy())
    r2 = b.judge(norm)
    assert r1 == r2 == a.last and r1.verdict == "clipped"
    assert a.clip_factor(norm) == r1.factor and a.clip_factor(0.5) == 1.0
    with pytest.warns(GradientWarning, match="non-finite"):
        r3 = b.judge(1.0, nonfinite=True)
    assert r3.verdict == "nonfinite" and math.isnan(r3.norm)


def test_parameter_server_pushes_are_clipped_and_bad_ones_never_sent() -> None:
    addr = f"127.0.0.1:{free_port()}"
    server = ps.Server(
        addr, secret="g", optimizer="sgd", lr=0.5, momentum=0.0, staleness=0, num_workers=2
    )
    n, steps = 1000, 4
    p0 = {"w": np.linspace(-1, 1, n, dtype=np.float32)}

    def grad(wid: int, t: int) -> np.ndarray:
        g = (np.sin(np.arange(n, dtype=np.float32) * (wid + 1) + t) * 0.01).astype(np.float32)
        if wid == 1 and t == 1:
            g *= np.float32(1e6)  # explodes: clipped to max_norm before the push
        if wid == 1 and t == 2:
            g[5] = np.nan  # not pushed at all
        return g

    out: dict[int, object] = {}

    def worker(wid: int) -> None:
        guard = GradientGuard(max_norm=1.0)
        with ps.Worker([addr], wid, secret="g", timeout=20) as w:
            w.init(p0)
            p = w.pull()
            for t in range(steps):
                w.step({"w": grad(wid, t)}, into=p, guard=guard)
            out[wid] = (p["w"].copy(), w.skipped_pushes)

    import threading

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GradientWarning)
        ts = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
    server.close()
    assert set(out) == {0, 1}, "a worker failed"
    # The reference: the mean of what was pushed (worker 1's step-1 gradient clipped the
    # way the guard clips, its step-2 gradient left out), plain SGD.
    p = p0["w"].astype(np.float64)
    for t in range(steps):
        pushed = [grad(0, t).astype(np.float64)]
        g1 = grad(1, t)
        if t == 1:
            GradientGuard(1.0).check(g1)
        if t != 2:
            pushed.append(g1.astype(np.float64))
        p -= 0.5 * np.mean(pushed, axis=0)
    for wid in (0, 1):
        got, skipped = out[wid]  # type: ignore[misc]
        np.testing.assert_allclose(got, p, rtol=1e-5, atol=1e-6)
        assert skipped == (1 if wid == 1 else 0)


def test_bad_guard_arguments_are_refused() -> None:
    guard = GradientGuard(1.0)
    with pytest.raises(TypeError, match="GradientGuard"):
        GuardedState(guard=1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="GradientGuard"):
        CompressionState(guard="x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="GradientGuard"):
        SafeMode(1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lr_factor"):
        SafeMode(guard, lr_factor=0)
    with pytest.raises(ValueError, match="clip_factor"):
        SafeMode(guard, clip_factor=2)
    with pytest.raises(ValueError, match="recover_after"):
        SafeMode(guard, recover_after=0)
    with pytest.raises(TypeError, match="param_groups"):
        SafeMode(guard, optimizer=object())
    with pytest.raises(TypeError, match="rollback"):
        SafeMode(guard, snapshots=object())
    with pytest.raises(ValueError, match="not judged a step"):
        SafeMode(guard).update()
    with pytest.raises(ValueError, match="max_norm"):
        guard.set_max_norm(-1)
