"""The gradient-norm guard against a numpy reference, for every float dtype and NaN/Inf."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mcp_fast.errors import GradientError, MCPError
from mcp_fast.guards import GradientGuard, GradientWarning


def _ref_norm(arrays) -> float:
    flat = [np.asarray(a, dtype=np.float64).ravel() for a in arrays]
    return float(np.linalg.norm(np.concatenate(flat)))


def _np_arrays(dtype: str, scale: float = 1.0, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = [(1000,), (33, 17), (7,), (0,), (4, 5, 6)]
    return [(rng.standard_normal(s) * scale).astype(dtype) for s in shapes]


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_numpy_norm_matches_reference(dtype):
    arrays = _np_arrays(dtype)
    want = _ref_norm(arrays)
    norm, nonfinite = GradientGuard.norm(arrays)
    assert not nonfinite
    assert norm == pytest.approx(want, rel=1e-12)
    r = GradientGuard(max_norm=want * 2).check(arrays)
    assert r.verdict == "ok" and r.apply_update and r.factor == 1.0
    assert r.norm == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_torch_norm_matches_reference(dtype):
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(s, generator=g).to(dtype) for s in [(513,), (8, 9), (1,)]]
    want = _ref_norm([t.double().numpy() for t in tensors])
    norm, nonfinite = GradientGuard.norm(tensors)
    assert not nonfinite
    assert norm == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_clipping_scales_in_place_to_max_norm(dtype):
    arrays = _np_arrays(dtype, scale=10.0)
    before = [a.astype(np.float64) for a in arrays]
    norm = _ref_norm(arrays)
    guard = GradientGuard(max_norm=1.0)
    r = guard.check(arrays)
    assert r.verdict == "clipped" and r.clipped and r.apply_update
    assert r.factor == pytest.approx(1.0 / (norm + 1e-6))
    rtol = 1e-3 if dtype == "float16" else 1e-6
    for a, b in zip(arrays, before, strict=True):
        np.testing.assert_allclose(a.astype(np.float64), b * r.factor, rtol=rtol, atol=1e-6)
    assert _ref_norm(arrays) == pytest.approx(1.0, rel=rtol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_torch_half_clipping_matches_clip_grad_norm(dtype):
    g = torch.Generator().manual_seed(2)
    ours = [torch.randn(s, generator=g).mul(5).to(dtype) for s in [(300,), (20, 20)]]
    params = [torch.nn.Parameter(t.clone().float()) for t in ours]
    for p, t in zip(params, ours, strict=True):
        p.grad = t.clone().float()
    torch.nn.utils.clip_grad_norm_(params, max_norm=2.0)
    r = GradientGuard(max_norm=2.0).check(ours)
    assert r.verdict == "clipped"
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    for t, p in zip(ours, params, strict=True):
        torch.testing.assert_close(t.float(), p.grad, rtol=tol, atol=tol)


def test_parameters_stand_for_their_grads():
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 2))
    model(torch.randn(4, 10)).pow(2).sum().mul(100).backward()
    extra = torch.nn.Parameter(torch.ones(3))  # no grad: left out
    grads = [p.grad.clone() for p in model.parameters()]
    want = _ref_norm([t.double().numpy() for t in grads])
    ref = [p.detach().clone().requires_grad_() for p in model.parameters()]
    for p, gr in zip(ref, grads, strict=True):
        p.grad = gr.clone()
    torch.nn.utils.clip_grad_norm_(ref, max_norm=0.5)
    r = GradientGuard(max_norm=0.5).check([*model.parameters(), extra])
    assert r.verdict == "clipped"
    assert r.norm == pytest.approx(want, rel=1e-6)
    for p, q in zip(model.parameters(), ref, strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    assert extra.grad is None


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_nonfinite_is_detected_and_left_untouched(bad, dtype):
    tensors = [torch.ones(100, dtype=getattr(torch, dtype)) for _ in range(3)]
    tensors[1][42] = bad
    before = [t.clone() for t in tensors]
    guard = GradientGuard(max_norm=1.0)
    with pytest.warns(GradientWarning, match="non-finite"):
        r = guard.check(tensors)
    assert r.verdict == "nonfinite" and not r.apply_update
    assert math.isnan(r.norm)
    for t, b in zip(tensors, before, strict=True):
        torch.testing.assert_close(t, b, equal_nan=True)


def test_numpy_nan_is_detected():
    a = np.ones(1000, np.float32)
    a[999] = np.nan
    norm, nonfinite = GradientGuard.norm([np.ones(3), a])
    assert nonfinite and math.isnan(norm)


def test_raise_policy_trips_on_the_third_bad_step():
    guard = GradientGuard(max_norm=1.0, policy="raise")
    assert guard.check([np.full(4, 10.0, np.float32)]).verdict == "clipped"
    with pytest.warns(GradientWarning):
        assert guard.check([np.array([np.nan], np.float32)]).verdict == "nonfinite"
    big = np.full(4, 10.0, np.float32)
    with pytest.raises(GradientError, match="3 bad steps in a row") as e:
        guard.check([big])
    assert isinstance(e.value, MCPError)
    assert e.value.consecutive == 3 and e.value.norm == pytest.approx(20.0)
    np.testing.assert_array_equal(big, 10.0)  # a tripped step is not clipped


def test_skip_policy_warns_and_a_good_step_resets():
    guard = GradientGuard(max_norm=1.0, policy="skip", trip_after=2)
    assert guard.check(np.full(4, 3.0)).verdict == "clipped"
    with pytest.warns(GradientWarning, match="tripped"):
        r = guard.check(np.full(4, 3.0))
    assert r.verdict == "tripped" and not r.apply_update and r.consecutive_bad == 2
    assert guard.check(np.full(4, 0.1)).verdict == "ok"
    assert guard.consecutive_bad == 0
    assert guard.check(np.full(4, 3.0)).verdict == "clipped"
    guard.reset()
    assert guard.consecutive_bad == 0


def test_bad_arguments_are_reported():
    with pytest.raises(ValueError, match="policy"):
        GradientGuard(1.0, policy="ignore")
    with pytest.raises(ValueError, match="max_norm"):
        GradientGuard(0.0)
    with pytest.raises(ValueError, match="max_norm"):
        GradientGuard(math.nan)
    with pytest.raises(ValueError, match="trip_after"):
        GradientGuard(1.0, trip_after=0)
    guard = GradientGuard(1.0)
    with pytest.raises(TypeError, match="floating-point"):
        guard.check([np.ones(3, np.int32)])
    with pytest.raises(ValueError, match="C-contiguous"):
        guard.check([np.ones((4, 4), np.float32).T])
    with pytest.raises(TypeError, match="iterable"):
        guard.check(3.0)
    ro = np.full(4, 5.0, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        guard.check([ro])
    assert guard.consecutive_bad == 0  # the refused step was not counted
    assert GradientGuard(100.0).check([ro]).verdict == "ok"  # read-only is fine unclipped
