"""In-memory snapshots: bit-exact rollback of model and optimiser, reverse-delta coding within
a memory budget, and no snapshot during a backward pass."""

from __future__ import annotations

import copy
import threading
from typing import Any

import numpy as np
import pytest
import torch

from mcp_fast.snapshots import SnapshotError, Snapshots


def _setup(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(16, 32)
    return model, opt, x


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    loss = (model(x) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Model state_dicts or optimiser state_dicts, bit for bit."""
    assert a.keys() == b.keys()
    for k in a:
        va, vb = a[k], b[k]
        if isinstance(va, dict):
            _assert_same_state(va, vb)
        elif isinstance(va, torch.Tensor):
            assert torch.equal(_bits(va), _bits(vb)), k
        elif isinstance(va, list):
            assert len(va) == len(vb)
            for x, y in zip(va, vb, strict=True):
                if isinstance(x, dict):
                    _assert_same_state(x, y)
                else:
                    assert x == y
        else:
            assert va == vb, k


def _copy(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[Any, Any]:
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def test_rollback_restores_model_and_optimizer_bit_exactly_and_training_resumes_identically() -> (
    None
):
    model, opt, x = _setup()
    snaps = Snapshots(model, opt, every=3, budget_bytes=64 << 20)
    saved = {}
    for step in range(1, 10):
        _train_step(model, opt, x)
        if snaps.maybe_take(step):
            saved[step] = _copy(model, opt)
    assert snaps.steps == [3, 6, 9] and set(saved) == {3, 6, 9}
    # The reference run: three more steps from step 9.
    for _ in range(3):
        _train_step(model, opt, x)
    reference = _copy(model, opt)
    # Damage the state (a bad update), then roll back.
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    opt.param_groups[0]["lr"] = 123.0
    assert snaps.rollback() == 9
    _assert_same_state(model.state_dict(), saved[9][0])
    _assert_same_state(opt.state_dict(), saved[9][1])
    for _ in range(3):
        _train_step(model, opt, x)
    _assert_same_state(model.state_dict(), reference[0])
    _assert_same_state(opt.state_dict(), reference[1])
    # An older snapshot, decoded back through the delta chain; newer ones are dropped.
    assert snaps.rollback(step=3) == 3
    _assert_same_state(model.state_dict(), saved[3][0])
    _assert_same_state(opt.state_dict(), saved[3][1])
    assert snaps.steps == [3] and snaps.rollbacks == 2
    # The restored snapshot is stored in full again and can be rolled back to once more.
    assert [i.mode for i in snaps.info()] == ["full"]
    _train_step(model, opt, x)
    snaps.rollback()
    _assert_same_state(model.state_dict(), saved[3][0])


def test_max_step_picks_the_newest_snapshot_not_after_it() -> None:
    model, opt, x = _setup(1)
    snaps = Snapshots(model, opt, every=2)
    saved = {}
    for step in range(1, 9):
        _train_step(model, opt, x)
        if snaps.maybe_take(step):
            saved[step] = _copy(model, opt)
    assert snaps.rollback(max_step=5) == 4
    _assert_same_state(model.state_dict(), saved[4][0])
    with pytest.raises(SnapshotError, match="at or before step 1"):
        snaps.rollback(max_step=1)


def test_a_state_with_nan_is_not_a_good_snapshot() -> None:
    model, opt, x = _setup(2)
    snaps = Snapshots(model, opt, every=1)
    _train_step(model, opt, x)
    assert snaps.maybe_take(1)
    good = _copy(model, opt)
    _train_step(model, opt, x)
    with torch.no_grad():
        model[2].bias[0] = float("inf")
    assert not snaps.maybe_take(2)  # refused: not a good state
    assert snaps.steps == [1]
    assert snaps.rollback() == 1
    _assert_same_state(model.state_dict(), good[0])


def test_snapshots_are_delta_coded_and_stay_within_the_budget_oldest_evicted() -> None:
    torch.manual_seed(3)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(8, 256)
    probe = Snapshots(model, opt, every=1)
    probe.take(0)
    one = probe.nbytes
    probe.close()
    budget = int(one * 2.5)
    snaps = Snapshots(model, opt, every=1, budget_bytes=budget)
    for step in range(1, 12):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert snaps.maybe_take(step)
        assert snaps.nbytes <= budget
    info = snaps.info()
    # Older snapshots are deltas against the next newer one, much smaller than a full one.
    assert [i.mode for i in info][-1] == "full" and all(i.mode == "delta" for i in info[:-1])
    assert all(i.nbytes < 0.7 * info[-1].nbytes for i in info[:-1]), info
    assert len(info) > 2  # more snapshots than two full ones would fit
    assert snaps.ratio() < 0.7
    assert snaps.evicted == 11 - len(info)
    assert snaps.steps == list(range(12 - len(info), 12))
    with pytest.raises(SnapshotError, match="evicted"):
        snaps.rollback(step=1)
    # A budget below one snapshot is refused, with the size needed.
    with pytest.raises(SnapshotError, match="over budget_bytes"):
        Snapshots(model, opt, budget_bytes=1000).take(0)


def test_no_snapshot_during_backward_on_this_thread_or_another() -> None:
    model, opt, x = _setup(4)
    snaps = Snapshots(model, opt, every=1)
    errors: list[str] = []

    def in_hook(g: torch.Tensor) -> torch.Tensor:
        try:
            snaps.maybe_take(1)
        except SnapshotError as e:
            errors.append(str(e))
        return g

    h = model[2].weight.register_hook(in_hook)
    model(x).sum().backward()
    h.remove()
    assert len(errors) == 1 and "during a backward pass" in errors[0]

    # Another thread tries while the backward pass is held in a hook.
    inside, release = threading.Event(), threading.Event()

    def hold(g: torch.Tensor) -> torch.Tensor:
        inside.set()
        assert release.wait(30)
        return g

    h = model[0].weight.register_hook(hold)
    bw = threading.Thread(target=lambda: model(x).sum().backward())
    bw.start()
    assert inside.wait(30)
    with pytest.raises(SnapshotError, match="during a backward pass"):
        snaps.maybe_take(2)
    release.set()
    bw.join(30)
    h.remove()
    opt.zero_grad()
    assert snaps.maybe_take(2)  # after the pass: fine

    # A backward pass that failed leaves a mark, which the next forward pass clears.
    def boom(g: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")

    h = model[0].bias.register_hook(boom)
    with pytest.raises(ValueError, match="boom"):
        model(x).sum().backward()
    h.remove()
    opt.zero_grad()
    with pytest.raises(SnapshotError):
        snaps.maybe_take(3)
    model(x)
    assert snaps.maybe_take(3)


def test_numpy_arrays_are_restored_in_place() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal(10_000).astype(np.float32)
    counts = np.arange(100, dtype=np.int64)
    snaps = Snapshots(arrays={"w": w, "counts": counts}, every=5)
    assert not snaps.maybe_take(3)
    assert snaps.maybe_take(5)
    w0, c0 = w.copy(), counts.copy()
    w *= 1.001
    counts += 1
    assert snaps.maybe_take(10)
    w[:] = np.nan
    assert snaps.rollback(step=5) == 5
    assert w.tobytes() == w0.tobytes() and counts.tobytes() == c0.tobytes()


def test_bad_arguments_are_refused() -> None:
    model, opt, _ = _setup()
    with pytest.raises(ValueError, match="nothing to snapshot"):
        Snapshots()
    with pytest.raises(ValueError, match="every"):
        Snapshots(model, every=0)
    with pytest.raises(ValueError, match="budget_bytes"):
        Snapshots(model, budget_bytes=-1)
    with pytest.raises(TypeError, match="arrays"):
        Snapshots(arrays={"a": [1, 2]})
    with pytest.raises(TypeError, match="state_dict"):
        Snapshots(object())
    snaps = Snapshots(model, opt, every=1)
    with pytest.raises(SnapshotError, match="none was taken"):
        snaps.rollback()
    snaps.take(5)
    with pytest.raises(ValueError, match="not after"):
        snaps.take(5)
    with pytest.raises(SnapshotError, match="no snapshot of step 4"):
        snaps.rollback(step=4)
    assert isinstance(SnapshotError("x"), __import__("mcp_fast").MCPError)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_cuda_model_and_optimizer_roll_back_bit_exactly_and_stay_on_the_device() -> None:
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    model = model.cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64, device="cuda")
    snaps = Snapshots(model, opt, every=2)
    for step in range(1, 5):
        _train_step(model, opt, x)
        snaps.maybe_take(step)
    saved = _copy(model, opt)
    _train_step(model, opt, x)
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    assert snaps.rollback() == 4
    _assert_same_state(model.state_dict(), saved[0])
    _assert_same_state(opt.state_dict(), saved[1])
    assert all(p.is_cuda for p in model.parameters())
    assert all(v.is_cuda for s in opt.state.values() for k, v in s.items() if k != "step")
    _train_step(model, opt, x)  # trains on after the rollback
    assert torch.isfinite(next(model.parameters())).all()
