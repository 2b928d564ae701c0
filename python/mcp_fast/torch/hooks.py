"""DDP communication hooks: compressed gradients with error feedback, and a gradient-norm
guard on the wire.

    from mcp_fast.torch import compression_hook, CompressionState
    ddp.register_comm_hook(CompressionState(codec="int8", block=256), compression_hook)

Each bucket's gradient ``g`` is corrected by the residual kept from the previous step,
``x = g + r``; what is sent is ``q = Q(x)`` (``Q``: encode then decode with the codec) and the
residual becomes ``r = x - q``, so nothing is lost over time, only delayed (error feedback,
as in 1-bit SGD / EF-SGD). With the backend "mcp" the all-reduce itself travels encoded
(partial sums re-encoded per hop); with other backends the hook still quantises and feeds
back the error, but the bytes on the wire are the backend's own.

The guard (opt-in: ``CompressionState(guard=...)``, or :func:`guarded_allreduce_hook` with a
:class:`GuardedState` for plain averaging) checks every rank's gradients before they go on
the wire, as a whole step (the global L2 norm over every bucket)::

    guard = GradientGuard(max_norm=1.0)
    ddp.register_comm_hook(GuardedState(guard), guarded_allreduce_hook)
    loss.backward()                      # judged here; guard.last holds the verdict
    SafeMode(guard, optimizer).step()    # or: if guard.last.apply_update: optimizer.step()

The hook holds the buckets back until the last one is ready (the guard needs the whole
step's norm, so communication no longer overlaps the backward pass), then:

1. each rank measures its own norm; above ``max_norm`` it clips its own gradients (its
   share of the average) by ``max_norm / (norm + 1e-6)`` before sending anything, so one
   rank's exploding gradients cannot swamp the others';
2. the ranks all-reduce (max) their norms and NaN/Inf flags, and every rank's guard judges
   the same figures (:meth:`GradientGuard.judge`): the verdicts, the bad-step counts and
   the trips are the same on every rank;
3. ``ok``/``clipped``: the buckets are averaged as usual (compressed, with the compression
   hook). ``nonfinite``/``tripped``: nothing is sent, every rank's gradients become zeros
   and the update should be skipped (``guard.last.apply_update`` is false;
   :class:`mcp_fast.guards.SafeMode` skips it). With ``policy="raise"`` a trip fails the
   backward pass on every rank with :class:`mcp_fast.errors.GradientError`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..guards import GradientGuard
from ..kernels import codec_round_trip

_Send = Callable[[torch.Tensor], torch.futures.Future]


class _StepGuard:
    """Holds a step's buckets until the last one, then judges the step once for all ranks."""

    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, torch.futures.Future, _Send]] = []

    def bucket(self, guard: GradientGuard, pg: Any, bucket: Any, send: _Send) -> Any:
        buf: torch.Tensor = bucket.buffer()
        fut: torch.futures.Future = torch.futures.Future()
        self.pending.append((buf, fut, send))
        if bucket.is_last():
            pending, self.pending = self.pending, []
            try:
                self._judge(guard, pg, pending)
            except BaseException:
                # Nothing was sent: leave no future pending, and fail the backward pass with
                # the error (a GradientError trips on every rank alike).
                for b, f, _ in pending:
                    if not f.done():
                        f.set_result(b.zero_())
                raise
        return fut

    @staticmethod
    def _judge(
        guard: GradientGuard,
        pg: Any,
        pending: list[tuple[torch.Tensor, torch.futures.Future, _Send]],
    ) -> None:
        floats = [b for b, _, _ in pending if b.is_floating_point()]
        host = [b for b in floats if b.device.type == "cpu"]
        device = [b for b in floats if b.device.type != "cpu"]
        # The norm by the Rust core; accelerator buckets are measured from a host copy.
        norm, nonfinite = GradientGuard.norm(host + [b.detach().cpu() for b in device])
        factor = guard.clip_factor(norm) if not nonfinite else 1.0
        if factor != 1.0:  # this rank's share, before it is sent
            GradientGuard.scale_(host, factor)
            for b in device:
                b.mul_(factor)
        flags = torch.tensor([0.0 if nonfinite else norm, float(nonfinite)], dtype=torch.float64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=pg)
        r = guard.judge(float(flags[0]), bool(flags[1] > 0))
        if r.apply_update:
            for b, fut, send in pending:
                send(b).add_done_callback(_forward_to(fut))
        else:
            for b, fut, _ in pending:
                b.zero_()
                fut.set_result(b)


def _forward_to(
    fut: torch.futures.Future,
) -> Callable[[torch.futures.Future], None]:
    """A callback that completes ``fut`` with the result (or the error) of another future."""

    def done(f: torch.futures.Future) -> None:
        try:
            fut.set_result(f.value())
        except Exception as e:
            fut.set_exception(e)

    return done


def _average(pg: Any, world: int, grad: torch.Tensor) -> torch.futures.Future:
    fut = dist.all_reduce(grad, group=pg, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(world))


@dataclass
class GuardedState:
    """The state of :func:`guarded_allreduce_hook`: the guard and the process group."""

    guard: GradientGuard
    process_group: Any = None
    _step: _StepGuard = field(default_factory=_StepGuard, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.guard, GradientGuard):
            raise TypeError(f"guard must be a GradientGuard, got {type(self.guard).__name__}")


def guarded_allreduce_hook(state: GuardedState, bucket):  # type: ignore[no-untyped-def]
    """DDP comm hook: average the gradients as DDP does, behind the gradient-norm guard
    (see the module docstring)."""
    pg = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(pg)
    return state._step.bucket(state.guard, pg, bucket, lambda g: _average(pg, world, g))


@dataclass
class CompressionState:
    """Settings and the residuals of error feedback, one per DDP bucket."""

    codec: str = "int8"
    block: int = 256
    error_feedback: bool = True
    process_group: Any = None
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    guard: GradientGuard | None = None
    """Opt-in gradient-norm guard, checked before anything is quantised or sent."""
    _step: _StepGuard = field(default_factory=_StepGuard, repr=False)

    def __post_init__(self) -> None:
        if self.guard is not None and not isinstance(self.guard, GradientGuard):
            raise TypeError(f"guard must be a GradientGuard, got {type(self.guard).__name__}")

    def quantise(self, key: int, grad: torch.Tensor) -> torch.Tensor:
        """``g + r`` → ``q = Q(g + r)`` in place; keeps ``r = (g + r) - q``."""
        if self.error_feedback:
            r = self.residuals.get(key)
            if r is not None and r.shape == grad.shape:
                grad.add_(r)
            x = grad.detach().clone()
        codec_round_trip(grad, self.codec, self.block)
        if self.error_feedback:
            self.residuals[key] = x.sub_(grad)
        return grad


def compression_hook(state: CompressionState, bucket):  # type: ignore[no-untyped-def]
    """DDP comm hook: average the bucket's gradients, compressed with ``state.codec``.

    (No annotation on ``bucket``: DDP compares it with dist.GradBucket, which postponed
    annotations would hide.)"""
    pg = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(pg)
    index = bucket.index()

    def send(grad: torch.Tensor) -> torch.futures.Future:
        if grad.dtype != torch.float32 or grad.device.type != "cpu":
            # Codecs take float32 CPU tensors: fall back to a plain average for the rest.
            return _average(pg, world, grad)
        state.quantise(index, grad)
        mcp_group = getattr(pg, "mcp_group", None)
        if mcp_group is None:
            return _average(pg, world, grad)
        work = pg._work(
            lambda: [
                mcp_group.all_reduce(
                    grad, op="avg", codec=state.codec, block=state.block, async_op=True
                )
            ],
            [grad],
        )
        return work.get_future().then(lambda f: f.value()[0])

    if state.guard is not None:
        return state._step.bucket(state.guard, pg, bucket, send)
    return send(bucket.buffer())


__all__ = ["CompressionState", "GuardedState", "compression_hook", "guarded_allreduce_hook"]
