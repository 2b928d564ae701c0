"""Local SGD, DiLoCo and streaming DiLoCo over an mcp_fast :class:`~mcp_fast.Group`.

Every member takes ``sync_every`` (H) steps of its own inner optimizer on its own data; then
the *outer step* averages the pseudo-gradient ``θ_outer - θ_local`` over the members,
compressed with ``codec``, applies the outer optimizer to ``θ_outer`` (Nesterov SGD, lr 0.7,
momentum 0.9 by default, as in the DiLoCo paper) and sets every member's model to the new
``θ_outer``, bit-identical on every member::

    from mcp_fast.torch import DiLoCo
    group = mcp_fast.init()                       # any Group: the outer, slow link
    dl = DiLoCo(model, inner_opt, group, sync_every=50, codec="int8")
    for x, y in data:
        inner_opt.zero_grad(); loss_fn(model(x), y).backward(); inner_opt.step()
        dl.step()                                 # counts inner steps; syncs every H
    dl.finish()                                   # every member now holds θ_outer

:class:`LocalSGD` is the simple case (outer lr 1, no momentum: the parameters are averaged
every H steps). With ``fragments=F`` the parameters are split into F fragments synced at
staggered inner steps, each fragment's all-reduce running on a background thread while the
inner steps go on, its result merged ``delay`` (τ) inner steps later (Streaming DiLoCo).

Codecs: ``"none"`` (float32), ``"fp16"``, ``"bf16"``, ``"int8"`` (the core's all-reduce
codecs, with error feedback for the lossy ones), and ``"int4"`` (blockwise 4-bit with
error feedback, :mod:`mcp_fast.torch.int4`, exchanged with an all-gather of packed bytes and
averaged locally in rank order).

A pseudo-gradient with a NaN or Inf is refused before averaging (every member tells the
others, with an all-gather of one flag): that member's contribution is skipped with a
:class:`PseudoGradientWarning` and the others are averaged. Members whose models differ
(names, dtypes, shapes) are refused at construction with
:class:`~mcp_fast.SpecMismatchError` naming both.

The outer group may be any Group. Inside a host, DDP over
:func:`mcp_fast.torch.host_group` (or the user's own over NCCL or Gloo) keeps the host's ranks
equal, and DiLoCo over the whole job's group averages across hosts: with several ranks per
host its all-reduce runs hierarchically, each rank carrying a shard across.
:class:`mcp_fast.torch.ElasticDiLoCo` runs the outer steps in an elastic job.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import SpecMismatchError
from ..group import Group
from ..kernels import codec_round_trip
from .elastic import state_spec
from .int4 import decode_int4, encode_int4

__all__ = ["CODECS", "DiLoCo", "LocalSGD", "PseudoGradientWarning", "check_same_model"]

#: The codecs of the outer all-reduce.
CODECS = ("none", "fp16", "bf16", "int8", "int4")

OuterFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


class PseudoGradientWarning(RuntimeWarning):
    """A member's pseudo-gradient was not finite: its contribution was skipped."""


def check_same_model(group: Group, model: torch.nn.Module) -> None:
    """Raises :class:`~mcp_fast.SpecMismatchError` on every member when the members' models
    differ in names, dtypes or shapes (of parameters and buffers), naming both sides."""
    spec = state_spec(model).encode()
    w = group.world_size
    if w == 1:
        return
    sizes = np.zeros((w, 1), dtype=np.int64)
    group.all_gather(sizes, np.array([len(spec)], dtype=np.int64))
    longest = int(sizes.max())
    mine = np.zeros(longest, dtype=np.uint8)
    mine[: len(spec)] = np.frombuffer(spec, dtype=np.uint8)
    every = np.zeros((w, longest), dtype=np.uint8)
    group.all_gather(every, mine)
    specs = [every[r, : int(sizes[r, 0])].tobytes().decode() for r in range(w)]
    for r in range(1, w):
        if specs[r] != specs[0]:
            a, b = specs[0].split(";"), specs[r].split(";")
            i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
            if i is None:
                shorter, n = (0, len(a)) if len(a) < len(b) else (r, len(b))
                what = (
                    f"member {shorter}'s model ends after {n} entries; the other goes on with "
                    f"{(b if shorter == 0 else a)[n]!r}"
                )
            else:
                what = f"member 0 has {a[i]!r}, member {r} has {b[i]!r} (entry {i})"
            raise SpecMismatchError(
                f"the members' models differ: {what}. Every member of a DiLoCo group must "
                "build the same model (same names, dtypes and shapes)."
            )


_Averaged = tuple[torch.Tensor, list[int], torch.Tensor | None]


@dataclass
class _Fragment:
    index: int
    params: list[torch.Tensor]
    outer: list[torch.Tensor]
    opt: torch.optim.Optimizer
    offset: int
    numel: int
    residual: torch.Tensor | None = None
    pending: Future[_Averaged] | None = None
    due: int = 0
    syncs: int = 0


def _split(params: list[torch.Tensor], fragments: int) -> list[list[torch.Tensor]]:
    """Contiguous runs of parameters of about equal size (each fragment gets at least one)."""
    n = len(params)
    if fragments > n:
        raise ValueError(f"fragments={fragments} is more than the model's {n} parameter tensors")
    cum = np.cumsum([p.numel() for p in params])
    total = int(cum[-1])
    cuts = [0]
    for k in range(1, fragments):
        j = int(np.searchsorted(cum, total * k / fragments)) + 1  # params in the first k runs
        j = min(max(j, cuts[-1] + 1), n - (fragments - k))
        cuts.append(j)
    cuts.append(n)
    return [params[a:b] for a, b in itertools.pairwise(cuts)]


def _nesterov(params: list[torch.Tensor], lr: float, momentum: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)


class DiLoCo:
    """DiLoCo (and local SGD, and streaming DiLoCo) for ``model`` trained by ``optimizer``
    (the inner optimizer, the user's own), with outer steps on ``group``.

    ``sync_every``: inner steps between two outer steps of a fragment (H). ``outer_lr``,
    ``outer_momentum``: the default outer optimizer, Nesterov SGD; or ``outer_optimizer``, a
    function making an optimizer of a list of tensors. ``codec``: one of :data:`CODECS`;
    ``block``: elements per scale (int8 default 256, int4 default 64). ``error_feedback``:
    keep what the lossy codec dropped and add it to the next pseudo-gradient.

    ``fragments`` (F) splits the parameters into F fragments synced ``H / F`` inner steps
    apart; ``delay`` (τ, default ``H // F // 2`` when F > 1, else 0) is how many inner steps
    later a fragment's averaged pseudo-gradient is applied; meanwhile its all-reduce runs on
    a background thread. When it is merged, the fragment's local parameters become
    ``mix * θ_outer + (1 - mix) * θ_local`` (``mix``: 1 without delay, 0.5 with, as in
    Streaming DiLoCo); without delay, every member holds ``θ_outer`` after each outer step.

    ``average_buffers``: the model's floating-point buffers that are finite at construction
    (batch-norm running statistics; not a causal mask of ``-inf``) are averaged over the
    members with fragment 0's outer step, so that every member evaluates alike; a member
    whose buffers are not finite then is skipped as for a non-finite pseudo-gradient.

    ``group`` may be None at construction (set ``.group`` before the first outer step: an
    elastic job gives a new group to every epoch). ``check_model`` compares the members'
    models at construction (two small all-gathers); ``broadcast`` then gives every member
    rank 0's parameters, so that all start from the same ``θ_outer``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        group: Group | None,
        *,
        sync_every: int = 50,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        outer_optimizer: OuterFactory | None = None,
        codec: str = "none",
        block: int | None = None,
        error_feedback: bool = True,
        fragments: int = 1,
        delay: int | None = None,
        mix: float | None = None,
        check_model: bool = True,
        broadcast: bool = True,
        average_buffers: bool = True,
    ) -> None:
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}: use one of {', '.join(CODECS)}")
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1 inner step, got {sync_every}")
        if fragments < 1 or fragments > sync_every:
            raise ValueError(
                f"fragments must be between 1 and sync_every ({sync_every}), got {fragments}"
            )
        if delay is None:
            delay = max(1, sync_every // fragments // 2) if fragments > 1 else 0
        if not 0 <= delay < max(1, sync_every // fragments):
            raise ValueError(
                f"delay must be >= 0 and below sync_every / fragments "
                f"({sync_every}/{fragments}), so that a fragment is merged before it is "
                f"synced again; got {delay}"
            )
        if mix is None:
            mix = 1.0 if delay == 0 else 0.5
        if not 0.0 < mix <= 1.0:
            raise ValueError(f"mix must be in (0, 1], got {mix}")
        self.model = model
        self.optimizer = optimizer
        self.group = group
        self.sync_every = int(sync_every)
        self.codec = codec
        self.block = int(block if block is not None else (64 if codec == "int4" else 256))
        self.error_feedback = error_feedback
        self.delay = int(delay)
        self.mix = float(mix)
        #: Inner steps taken.
        self.inner_steps = 0
        #: Seconds :meth:`step` and :meth:`finish` spent blocked in outer steps.
        self.blocked_seconds = 0.0
        #: Members whose contribution was skipped, per outer step: (inner step, ranks).
        self.skipped: list[tuple[int, list[int]]] = []
        params: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no parameters that require gradients")
        make = outer_optimizer or (lambda ps: _nesterov(ps, outer_lr, outer_momentum))
        self._fragments: list[_Fragment] = []
        for i, ps in enumerate(_split(params, fragments)):
            outer = [p.detach().clone().float().requires_grad_(True) for p in ps]
            self._fragments.append(
                _Fragment(
                    index=i,
                    params=ps,
                    outer=outer,
                    opt=make(outer),
                    offset=(i + 1) * self.sync_every // fragments,
                    numel=sum(p.numel() for p in ps),
                )
            )
        self._buffers: list[torch.Tensor] = [
            b
            for b in model.buffers()
            if average_buffers and b.is_floating_point() and bool(torch.isfinite(b).all())
        ]
        self._pool: ThreadPoolExecutor | None = None
        if check_model and group is not None:
            check_same_model(group, model)
        if broadcast and group is not None:
            self._broadcast_from_0(params)
        self._bytes_base = self._bytes_now()
        self._started: float | None = None

    # -- what the loop calls --------------------------------------------------------------

    @property
    def fragments(self) -> int:
        """Number of fragments."""
        return len(self._fragments)

    @property
    def outer_steps(self) -> int:
        """Outer steps of fragment 0 completed (every outer step, without fragments)."""
        return self._fragments[0].syncs

    @property
    def fragment_syncs(self) -> list[int]:
        """Outer steps merged so far, per fragment."""
        return [f.syncs for f in self._fragments]

    def step(self) -> bool:
        """Call after every inner ``optimizer.step()``. Counts it; merges the fragments whose
        averaged pseudo-gradient is due, and starts the outer step of those whose turn it is.
        Returns True when an outer step completed in this call."""
        if self._started is None:
            self._started = time.monotonic()
        self.inner_steps += 1
        t = self.inner_steps
        merged = False
        for f in self._fragments:
            if f.pending is not None and t >= f.due:
                self._merge(f)
                merged = True
            if (t - f.offset) % self.sync_every == 0 and t >= f.offset:
                if f.pending is not None:  # not merged yet (delay 0 never gets here)
                    self._merge(f)
                self._start(f)
                if self.delay == 0:
                    self._merge(f)
                    merged = True
        return merged

    def sync(self) -> None:
        """Runs an outer step of every fragment now (blocking), whatever the inner step; the
        pending ones are merged first."""
        for f in self._fragments:
            if f.pending is not None:
                self._merge(f)
            self._start(f)
            self._merge(f, mix=1.0)

    def finish(self) -> None:
        """Merges the outer steps still in flight and sets the model to ``θ_outer`` (the
        same on every member); stops the background thread. The model can go on training
        afterwards with :meth:`step`."""
        for f in self._fragments:
            if f.pending is not None:
                self._merge(f)
            with torch.no_grad():
                for p, o in zip(f.params, f.outer, strict=True):
                    p.copy_(o)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    close = finish

    # -- measurements ---------------------------------------------------------------------

    @property
    def bytes_sent(self) -> int:
        """Bytes this member's transport sent since construction (after the model check and
        the broadcast): every collective on the group, heartbeats and headers included."""
        return self._bytes_now() - self._bytes_base

    def utilisation(self) -> float:
        """1 - (time blocked in outer steps) / (time since the first :meth:`step`)."""
        if self._started is None:
            return 1.0
        wall = time.monotonic() - self._started
        return 1.0 - self.blocked_seconds / wall if wall > 0 else 1.0

    def outer_digest(self) -> str:
        """SHA3-256 of ``θ_outer``: equal on every member after every outer step."""
        h = hashlib.sha3_256()
        for f in self._fragments:
            for o in f.outer:
                h.update(o.detach().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def outer_parameters(self) -> list[torch.Tensor]:
        """The tensors of ``θ_outer`` (float32), in parameter order."""
        return [o for f in self._fragments for o in f.outer]

    # -- state (for an elastic job's heal) ------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``θ_outer``, the outer optimizer's state and the inner step count."""
        return {
            "outer": [o.detach().clone() for o in self.outer_parameters()],
            "outer_optimizers": [f.opt.state_dict() for f in self._fragments],
            "inner_steps": self.inner_steps,
            "syncs": [f.syncs for f in self._fragments],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Installs :meth:`state_dict`'s output and sets the model to ``θ_outer``."""
        outer = state["outer"]
        mine = self.outer_parameters()
        if len(outer) != len(mine):
            raise ValueError(f"state has {len(outer)} outer tensors, this model {len(mine)}")
        with torch.no_grad():
            for o, v in zip(mine, outer, strict=True):
                o.copy_(v)
        for f, s, n in zip(self._fragments, state["outer_optimizers"], state["syncs"], strict=True):
            f.opt.load_state_dict(s)
            f.syncs = int(n)
            f.residual = None
            f.pending = None
            with torch.no_grad():
                for p, o in zip(f.params, f.outer, strict=True):
                    p.copy_(o)
        self.inner_steps = int(state["inner_steps"])

    def save_bytes(self) -> bytes:
        buf = io.BytesIO()
        torch.save(self.state_dict(), buf)
        return buf.getvalue()

    def load_bytes(self, data: bytes) -> None:
        self.load_state_dict(torch.load(io.BytesIO(data), weights_only=True, map_location="cpu"))

    # -- the outer step -------------------------------------------------------------------

    def _g(self) -> Group:
        if self.group is None:
            raise RuntimeError("DiLoCo.group is not set: give it the outer group first")
        return self.group

    def _broadcast_from_0(self, params: list[torch.Tensor]) -> None:
        if self._g().world_size == 1:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        with torch.no_grad():
            for ps in by_dtype.values():
                flat = torch.cat([p.detach().reshape(-1).cpu() for p in ps])
                self._g().broadcast(flat, src=0)
                offset = 0
                for p in ps:
                    p.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
            for f in self._fragments:
                for o, p in zip(f.outer, f.params, strict=True):
                    o.copy_(p)

    def _bytes_now(self) -> int:
        try:
            return self._g().total_bytes_sent()
        except Exception:  # a closed group, a group without counters
            return 0

    def _start(self, f: _Fragment) -> None:
        """Computes the fragment's pseudo-gradient and starts its all-reduce (on the
        background thread with a delay, here without)."""
        with torch.no_grad():
            delta = torch.cat(
                [
                    (o - p.detach().float()).reshape(-1)
                    for o, p in zip(f.outer, f.params, strict=True)
                ]
            )
            buffers = None
            if f.index == 0 and self._buffers:
                buffers = torch.cat([b.detach().reshape(-1).float() for b in self._buffers])
        step = self.inner_steps
        if self.delay == 0:
            fut: Future[_Averaged] = Future()
            t0 = time.monotonic()
            try:
                fut.set_result(self._reduce(f, delta, buffers))
            except BaseException as e:
                fut.set_exception(e)
            finally:
                self.blocked_seconds += time.monotonic() - t0
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="mcp-diloco")
            fut = self._pool.submit(self._reduce, f, delta, buffers)
        f.pending = fut
        f.due = step + self.delay

    def _reduce(self, f: _Fragment, delta: torch.Tensor, buffers: torch.Tensor | None) -> _Averaged:
        """Averages ``delta`` (and ``buffers``) over the members whose pseudo-gradient (and
        buffers) are finite. Every collective of the group runs here, in fragment order, on
        one thread."""
        g = self._g()
        w = g.world_size
        finite = bool(torch.isfinite(delta).all())
        if buffers is not None:
            finite = finite and bool(torch.isfinite(buffers).all())
        flags = np.zeros((w, 1), dtype=np.int32)
        g.all_gather(flags, np.array([1 if finite else 0], dtype=np.int32))
        bad = [r for r in range(w) if not flags[r, 0]]
        n_ok = w - len(bad)
        if not finite:
            delta.zero_()
        elif self.codec != "none" and self.error_feedback and f.residual is not None:
            delta.add_(f.residual)
        if self.codec == "int4":
            packed = encode_int4(delta, self.block)
            if finite and self.error_feedback:
                f.residual = delta - decode_int4(packed, delta.numel(), self.block)
            every = torch.empty((w, packed.numel()), dtype=torch.uint8)
            g.all_gather(every, packed)
            total = torch.zeros_like(delta)
            for r in range(w):
                if r not in bad:
                    total.add_(decode_int4(every[r], delta.numel(), self.block))
            delta = total
        else:
            if self.codec != "none" and finite:
                sent = delta.clone()
                codec_round_trip(sent, self.codec, self.block)
                if self.error_feedback:
                    f.residual = delta.sub_(sent)
                delta = sent
            g.all_reduce(delta, op="sum", codec=self.codec, block=self.block)
        if n_ok:
            delta.div_(n_ok)
        if buffers is not None:
            if not finite:
                buffers.zero_()
            g.all_reduce(buffers, op="sum")
            if n_ok:
                buffers.div_(n_ok)
        return delta, bad, buffers

    def _merge(self, f: _Fragment, mix: float | None = None) -> None:
        """Waits for the fragment's averaged pseudo-gradient, applies the outer optimizer and
        sets (or mixes) the local parameters."""
        assert f.pending is not None
        fut, f.pending = f.pending, None
        t0 = time.monotonic()
        try:
            avg, bad, buffers = fut.result()
        finally:
            self.blocked_seconds += time.monotonic() - t0
        w = self._g().world_size
        if bad:
            self.skipped.append((self.inner_steps, bad))
            warnings.warn(
                f"member(s) {bad} of {w} sent a non-finite "
                f"pseudo-gradient (fragment {f.index}, inner step {self.inner_steps}): their "
                f"contribution was skipped and the outer step averaged the "
                f"{w - len(bad)} others. Lower the inner learning rate "
                "or clip gradients on those members.",
                PseudoGradientWarning,
                stacklevel=3,
            )
        f.syncs += 1
        if len(bad) == w:
            # Nobody had a finite pseudo-gradient: θ_outer stays; every member restarts from it.
            m = 1.0
        else:
            offset = 0
            for o in f.outer:
                n = o.numel()
                o.grad = avg[offset : offset + n].view_as(o).clone()
                offset += n
            f.opt.step()
            f.opt.zero_grad(set_to_none=True)
            m = self.mix if mix is None else mix
        if buffers is not None and len(bad) < w:
            with torch.no_grad():
                offset = 0
                for b in self._buffers:
                    n = b.numel()
                    b.copy_(buffers[offset : offset + n].view_as(b))
                    offset += n
        if self._g().rank in bad:
            self._restart()
            return
        with torch.no_grad():
            for p, o in zip(f.params, f.outer, strict=True):
                if m == 1.0:
                    p.copy_(o)
                else:
                    p.mul_(1.0 - m).add_(o.to(p.dtype), alpha=m)

    def _restart(self) -> None:
        """This member's pseudo-gradient was not finite: the whole model restarts from
        θ_outer (every fragment: NaNs spread through the next forward pass) and the inner
        optimizer's state (which may hold them too) is cleared."""
        with torch.no_grad():
            for f in self._fragments:
                for p, o in zip(f.params, f.outer, strict=True):
                    p.copy_(o)
        if self.optimizer is not None:
            self.optimizer.state.clear()


class LocalSGD(DiLoCo):
    """Local SGD: every ``sync_every`` inner steps the members' parameters are averaged
    (DiLoCo with outer SGD of lr 1 and no momentum)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        group: Group,
        *,
        sync_every: int = 50,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("outer_lr", 1.0)
        kwargs.setdefault("outer_momentum", 0.0)
        super().__init__(model, optimizer, group, sync_every=sync_every, **kwargs)
