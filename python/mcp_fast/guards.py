"""The gradient-norm guard: catch exploding or non-finite gradients before they reach the
optimiser.

::

    guard = mcp_fast.GradientGuard(max_norm=1.0, policy="skip")
    loss.backward()
    r = guard.check(model.parameters())    # global L2 norm; clips in place above max_norm
    if r.apply_update:
        optimizer.step()

Each step's global L2 norm (over every tensor, accumulated in float64 by the Rust core with
the GIL released) is judged:

- ``"ok"``: at or under ``max_norm``; nothing changes.
- ``"clipped"``: above it; every gradient is scaled in place by
  ``factor = max_norm / (norm + 1e-6)``, as ``torch.nn.utils.clip_grad_norm_`` does.
- ``"nonfinite"``: a NaN or Inf somewhere; the gradients are left as they are, the update
  should be skipped, and a :class:`GradientWarning` is issued.
- ``"tripped"``: ``trip_after`` steps in a row (3 by default) were clipped or non-finite.
  With ``policy="skip"`` the update should be skipped and a :class:`GradientWarning` is
  issued; with ``policy="raise"``, :class:`mcp_fast.errors.GradientError` is raised. The
  gradients are not modified. One good step resets the count.

Inputs: numpy arrays or CPU torch tensors (float32, float64, float16, bfloat16), C-contiguous;
``nn.Parameter``\\s (and other leaf tensors that require grad) stand for their ``.grad``, and
those whose ``.grad`` is ``None`` are left out.
"""

from __future__ import annotations

import logging
import math
import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _core
from ._buffers import Buffer, is_torch_tensor, view
from .errors import GradientError

__all__ = ["GradientGuard", "GradientWarning", "GuardResult"]

log = logging.getLogger(__name__)

_FLOATS = ("float32", "float64", "float16", "bfloat16")
_POLICIES = ("skip", "raise")


class GradientWarning(RuntimeWarning):
    """A step's gradients were non-finite, or the guard tripped with ``policy="skip"``."""


@dataclass(frozen=True)
class GuardResult:
    """The outcome of :meth:`GradientGuard.check` for one step.

    Attributes:
        verdict: ``"ok"``, ``"clipped"``, ``"nonfinite"`` or ``"tripped"``.
        norm: the global L2 norm before clipping (NaN when non-finite).
        factor: the scale applied to the gradients (1.0 unless clipped).
        consecutive_bad: clipped or non-finite steps in a row, this one included.
    """

    verdict: str
    norm: float
    factor: float
    consecutive_bad: int

    @property
    def apply_update(self) -> bool:
        """Whether the optimiser step should run (``ok`` or ``clipped``)."""
        return self.verdict in ("ok", "clipped")

    @property
    def clipped(self) -> bool:
        """Whether the gradients were scaled down in place."""
        return self.verdict == "clipped"


def _is_parameter_like(x: Any) -> bool:
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor):
        return False
    return isinstance(x, torch.nn.Parameter) or (x.requires_grad and x.is_leaf)


def _gradients(params_or_grads: Any) -> list[Any]:
    if isinstance(params_or_grads, np.ndarray) or is_torch_tensor(params_or_grads):
        items = [params_or_grads]
    elif isinstance(params_or_grads, Iterable):
        items = list(params_or_grads)
    else:
        raise TypeError(
            "expected an array, a tensor, or an iterable of them (e.g. model.parameters()), "
            f"got {type(params_or_grads).__name__}"
        )
    grads = []
    for x in items:
        if _is_parameter_like(x):
            if x.grad is None:
                continue
            x = x.grad
        grads.append(x)
    return grads


def _buffers(grads: list[Any], *, writable: bool) -> list[Buffer]:
    bufs = []
    for i, g in enumerate(grads):
        b = view(g, name=f"gradient {i}", writable=writable)
        if b.dtype not in _FLOATS:
            raise TypeError(
                f"gradient {i}: dtype {b.dtype} is not a floating-point type; "
                f"use one of {', '.join(_FLOATS)}"
            )
        bufs.append(b)
    return bufs


class GradientGuard:
    """Clips gradients above ``max_norm`` and stops training on repeated bad steps.

    Args:
        max_norm: the largest global L2 norm let through unchanged; positive and finite.
        policy: what a trip does: ``"skip"`` (warn, skip the update) or ``"raise"``
            (:class:`~mcp_fast.errors.GradientError`).
        trip_after: clipped or non-finite steps in a row that trip the guard (>= 1).
    """

    def __init__(self, max_norm: float, policy: str = "skip", trip_after: int = 3) -> None:
        if policy not in _POLICIES:
            raise ValueError(f'policy must be "skip" or "raise", got {policy!r}')
        if isinstance(trip_after, bool) or not isinstance(trip_after, int) or trip_after < 1:
            raise ValueError(f"trip_after must be an integer >= 1, got {trip_after!r}")
        max_norm = float(max_norm)
        if not (math.isfinite(max_norm) and max_norm > 0):
            raise ValueError(f"max_norm must be positive and finite, got {max_norm}")
        self.max_norm = max_norm
        self.policy = policy
        self.trip_after = trip_after
        self._state = _core.GuardState(max_norm, trip_after)

    @property
    def consecutive_bad(self) -> int:
        """Clipped or non-finite steps in a row so far."""
        return int(self._state.consecutive_bad)

    def reset(self) -> None:
        """Forget past bad steps."""
        self._state.reset()

    @staticmethod
    def norm(params_or_grads: Any) -> tuple[float, bool]:
        """The global L2 norm of the gradients and whether any element is NaN/Inf."""
        bufs = _buffers(_gradients(params_or_grads), writable=False)
        return _core.grad_norm([(b.ptr, b.nbytes, b.dtype) for b in bufs])

    def check(self, params_or_grads: Any) -> GuardResult:
        """Judge one step's gradients, clipping them in place when the norm is too large.

        Raises:
            GradientError: the guard tripped and the policy is ``"raise"``.
        """
        grads = _gradients(params_or_grads)
        bufs = _buffers(grads, writable=False)
        norm, nonfinite = _core.grad_norm([(b.ptr, b.nbytes, b.dtype) for b in bufs])
        if not nonfinite and norm > self.max_norm:
            # Fail on read-only inputs before the step is counted.
            bufs = _buffers(grads, writable=True)
        verdict, factor, bad = self._state.check(norm)
        if verdict == "clipped":
            for b in bufs:
                _core.scale_(b.ptr, b.nbytes, b.dtype, factor)
            log.info(
                "gradient norm %.4g > max_norm %.4g: clipped by %.4g", norm, self.max_norm, factor
            )
        elif verdict == "nonfinite":
            msg = (
                f"non-finite gradients (NaN or Inf); skip this update ({bad} bad step(s) in a row)"
            )
            log.warning(msg)
            warnings.warn(msg, GradientWarning, stacklevel=2)
        elif verdict == "tripped":
            what = "non-finite" if nonfinite else f"norm {norm:.4g} > max_norm {self.max_norm:.4g}"
            msg = (
                f"gradient guard tripped: {bad} bad steps in a row (this one: {what}); "
                "check the learning rate, loss scaling and input data"
            )
            if self.policy == "raise":
                log.error(msg)
                raise GradientError(msg, norm=norm, consecutive=bad)
            log.warning("%s; skipping the update", msg)
            warnings.warn(f"{msg}; skipping the update", GradientWarning, stacklevel=2)
        return GuardResult(verdict, norm, factor, bad)
