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

__all__ = ["GradientGuard", "GradientWarning", "GuardResult", "SafeMode"]

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


def _buffers(grads: list[Any]) -> list[Buffer]:
    bufs = []
    for i, g in enumerate(grads):
        b = view(g, name=f"gradient {i}")
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
        self.last: GuardResult | None = None
        """The verdict of the latest step judged (by :meth:`check`, :meth:`judge`, a DDP
        hook or a parameter-server push), or ``None``."""

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
        return _core.grad_norm(_buffers(_gradients(params_or_grads)))

    def clip_factor(self, norm: float) -> float:
        """The scale :meth:`check` applies to gradients of global norm ``norm`` above
        ``max_norm`` (``max_norm / (norm + 1e-6)``; 1.0 at or under it, or non-finite)."""
        if not math.isfinite(norm) or norm <= self.max_norm:
            return 1.0
        return self.max_norm / (norm + 1e-6)

    @staticmethod
    def scale_(params_or_grads: Any, factor: float) -> None:
        """Multiplies the gradients by ``factor`` in place (by the Rust core)."""
        for b in _buffers(_gradients(params_or_grads)):
            _core.scale_(b, factor)

    def set_max_norm(self, max_norm: float) -> None:
        """Changes ``max_norm`` (safe mode tightens it); forgets past bad steps."""
        max_norm = float(max_norm)
        if not (math.isfinite(max_norm) and max_norm > 0):
            raise ValueError(f"max_norm must be positive and finite, got {max_norm}")
        self.max_norm = max_norm
        self._state = _core.GuardState(max_norm, self.trip_after)

    def check(self, params_or_grads: Any) -> GuardResult:
        """Judge one step's gradients, clipping them in place when the norm is too large.

        Raises:
            GradientError: the guard tripped and the policy is ``"raise"``.
        """
        grads = _gradients(params_or_grads)
        bufs = _buffers(grads)
        norm, nonfinite = _core.grad_norm(bufs)
        if not nonfinite and norm > self.max_norm:
            # Fail on read-only inputs before the step is counted (tensors are writable).
            for b in bufs:
                if isinstance(b.data, np.ndarray) and not b.data.flags.writeable:
                    raise ValueError(f"{b.name}: the array is read-only; clipping writes into it")
        r = self.judge(norm, nonfinite, _stacklevel=3)
        if r.verdict == "clipped":
            for b in bufs:
                _core.scale_(b, r.factor)
        return r

    def judge(self, norm: float, nonfinite: bool = False, *, _stacklevel: int = 2) -> GuardResult:
        """Count one step whose global norm was measured elsewhere (e.g. the largest of every
        rank's, as the DDP hooks do); changes no gradient. Returns the verdict (also kept in
        :attr:`last`) with the factor :meth:`check` would clip by.

        Raises:
            GradientError: the guard tripped and the policy is ``"raise"``.
        """
        if nonfinite:
            norm = math.nan
        verdict, factor, bad = self._state.check(norm)
        r = GuardResult(verdict, norm, factor, bad)
        self.last = r
        if verdict == "clipped":
            log.info(
                "gradient norm %.4g > max_norm %.4g: clipped by %.4g", norm, self.max_norm, factor
            )
        elif verdict == "nonfinite":
            msg = (
                f"non-finite gradients (NaN or Inf); skip this update ({bad} bad step(s) in a row)"
            )
            log.warning(msg)
            warnings.warn(msg, GradientWarning, stacklevel=_stacklevel)
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
            warnings.warn(f"{msg}; skipping the update", GradientWarning, stacklevel=_stacklevel)
        return r


class SafeMode:
    """What a training loop does after the guard trips (the circuit breaker).

    ::

        guard = GradientGuard(max_norm=1.0, trip_after=3)
        snaps = Snapshots(model, optimizer, every=50)
        safe = SafeMode(guard, optimizer, snapshots=snaps)
        for step in range(steps):
            loss.backward()                 # a guarded DDP hook judges the step, or:
            guard.check(model.parameters()) # judge it here
            safe.step(step)                 # optimizer.step() unless the step is skipped
            snaps.maybe_take(step)

    :meth:`update` reads the step's verdict (``guard.last``):

    - ``ok`` / ``clipped``: the update runs (returns ``True``).
    - ``nonfinite``: the update is skipped. In safe mode it also rolls back to the newest
      good snapshot: a NaN in safe mode means the state itself may be damaged.
    - ``tripped`` (``trip_after`` bad steps in a row): the update is skipped and safe mode
      begins, or begins again: roll back to the newest good snapshot taken before the bad
      streak began (the newest one when ``step`` is not given), then multiply every
      parameter group's learning rate by ``lr_factor`` and the guard's ``max_norm`` by
      ``clip_factor`` (the guard starts counting anew).
    - After ``recover_after`` updates in a row in safe mode, it ends: the learning rates
      and ``max_norm`` are set back to what they were when it began (a learning-rate
      scheduler's changes during safe mode are overridden).

    Without ``snapshots`` nothing is rolled back; without ``optimizer`` no learning rate is
    changed (a parameter-server worker, whose optimiser runs on the servers: its safe mode
    clips harder). All ranks of a DDP job see the same verdicts (the hooks agree on them), so
    they roll back and change their learning rates together.

    Attributes:
        active: whether safe mode is on.
        entries: how many times it began.
        rollbacks: how many rollbacks it did.
    """

    def __init__(
        self,
        guard: GradientGuard,
        optimizer: Any = None,
        *,
        snapshots: Any = None,
        lr_factor: float = 0.1,
        clip_factor: float = 0.5,
        recover_after: int = 100,
    ) -> None:
        if not isinstance(guard, GradientGuard):
            raise TypeError(f"guard must be a GradientGuard, got {type(guard).__name__}")
        for name, f in (("lr_factor", lr_factor), ("clip_factor", clip_factor)):
            if not (isinstance(f, int | float) and 0 < f <= 1):
                raise ValueError(f"{name} must be in (0, 1], got {f!r}")
        if isinstance(recover_after, bool) or not isinstance(recover_after, int):
            raise ValueError(f"recover_after must be an integer >= 1, got {recover_after!r}")
        if recover_after < 1:
            raise ValueError(f"recover_after must be an integer >= 1, got {recover_after!r}")
        if optimizer is not None and not hasattr(optimizer, "param_groups"):
            raise TypeError(f"optimizer: {type(optimizer).__name__} has no param_groups")
        if snapshots is not None and not hasattr(snapshots, "rollback"):
            raise TypeError(f"snapshots: {type(snapshots).__name__} has no rollback()")
        self.guard = guard
        self.optimizer = optimizer
        self.snapshots = snapshots
        self.lr_factor = float(lr_factor)
        self.clip_factor = float(clip_factor)
        self.recover_after = recover_after
        self.active = False
        self.entries = 0
        self.rollbacks = 0
        self._good = 0
        self._base_lrs: list[float] = []
        self._base_max_norm = guard.max_norm

    def _rollback(self, max_step: int | None) -> None:
        if self.snapshots is None:
            return
        from .snapshots import SnapshotError

        try:
            restored = self.snapshots.rollback(max_step=max_step)
        except SnapshotError as e:
            log.warning("safe mode cannot roll back: %s; training on from this state", e)
            return
        self.rollbacks += 1
        log.warning("safe mode: rolled back to the snapshot of step %d", restored)
        if self.active and self.optimizer is not None:
            # The snapshot's learning rates may predate safe mode: lower them again.
            for g, base in zip(self.optimizer.param_groups, self._base_lrs, strict=True):
                g["lr"] = base * self.lr_factor

    def _enter(self, r: GuardResult, step: int | None) -> None:
        max_step = None if step is None else step - r.consecutive_bad
        was_active = self.active
        self._rollback(max_step)
        if not was_active:
            if self.optimizer is not None:
                self._base_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
                for g in self.optimizer.param_groups:
                    g["lr"] = g["lr"] * self.lr_factor
            self._base_max_norm = self.guard.max_norm
            self.guard.set_max_norm(self._base_max_norm * self.clip_factor)
        else:
            self.guard.reset()
        self.active = True
        self.entries += 1
        self._good = 0
        log.warning(
            "safe mode %s after %d bad steps: lr x%g, max_norm %.4g",
            "continues" if was_active else "begins",
            r.consecutive_bad,
            self.lr_factor,
            self.guard.max_norm,
        )

    def _leave(self) -> None:
        if self.optimizer is not None:
            for g, base in zip(self.optimizer.param_groups, self._base_lrs, strict=True):
                g["lr"] = base
        self.guard.set_max_norm(self._base_max_norm)
        self.active = False
        log.warning("safe mode ends after %d good steps", self._good)

    def update(self, result: GuardResult | None = None, step: int | None = None) -> bool:
        """Acts on one step's verdict (``guard.last`` by default); returns whether the
        optimiser update should run. ``step``: the step being judged, so that a rollback goes
        to a snapshot from before the bad streak. Call it between steps (rollbacks are refused
        during a backward pass)."""
        r = result if result is not None else self.guard.last
        if r is None:
            raise ValueError(
                "no verdict to act on: the guard has not judged a step yet (call guard.check() "
                "after backward, or register a guarded DDP hook)"
            )
        if r.verdict == "tripped":
            self._enter(r, step)
            return False
        if r.verdict == "nonfinite":
            if self.active:
                self._rollback(None if step is None else step - 1)
                self._good = 0
            return False
        if self.active:
            self._good += 1
            if self._good >= self.recover_after:
                self._leave()
        return True

    def step(self, step: int | None = None) -> bool:
        """:meth:`update`, then ``optimizer.step()`` when the update should run; returns
        whether it ran."""
        apply = self.update(step=step)
        if apply and self.optimizer is not None:
            self.optimizer.step()
        return apply
