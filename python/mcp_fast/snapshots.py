"""In-memory snapshots of the training state, delta-coded, and rollback to the last good one.

::

    snaps = mcp_fast.Snapshots(model, optimizer, every=50, budget_bytes=2 << 30)
    for step in range(steps):
        loss = model(x).loss; loss.backward(); optimizer.step(); optimizer.zero_grad()
        snaps.maybe_take(step)          # between steps only; every 50th step is kept
    ...
    snaps.rollback()                    # model and optimizer back to the newest good snapshot

What a snapshot holds: every tensor of ``model.state_dict()`` and ``optimizer.state_dict()``
(and of ``arrays``, a mapping of numpy arrays restored in place), plus the non-tensor values
(learning rates, betas, step counts kept as numbers), pickled. :meth:`Snapshots.rollback`
restores them bit for bit: ``model.load_state_dict`` copies into the parameters in place,
``optimizer.load_state_dict`` replaces the optimiser's state.

Coding (reverse deltas): the newest snapshot is stored in full, each tensor compressed by the
delta codec (:func:`mcp_fast.delta.encode` with no reference: byte planes, zstd); every older
snapshot is stored as the delta codec's difference against the next newer one. Taking a
snapshot decodes the previous newest and re-codes it against the new state. So rolling back
to the newest snapshot decodes one blob per tensor, and evicting the oldest snapshot (the
least recently used: rollbacks go to the newest good one first) never breaks a chain.

Memory: :attr:`Snapshots.nbytes` is what the blobs and pickled values really take; snapshots
are evicted oldest first while it exceeds ``budget_bytes``. One snapshot that alone exceeds
the budget is refused with :class:`SnapshotError`.

Good: a snapshot whose floating-point tensors are all finite. A state with a NaN or Inf is
not stored as a snapshot (:meth:`Snapshots.maybe_take` returns ``False`` and logs a warning),
so that rollback never lands on a damaged state.

Never during backward: a snapshot copies the whole state, which in the middle of a backward
pass is half updated (and, on an accelerator, doubles the memory the pass needs).
:meth:`Snapshots.maybe_take` raises :class:`SnapshotError` when autograd is running a
backward pass: on the calling thread (``torch._C._current_graph_task_id()``, e.g. from a hook)
or on another thread over this model (hooks on the parameters mark a backward from its first
parameter gradient until its end; a forward pass clears the mark of a backward that failed).
"""

from __future__ import annotations

import logging
import math
import pickle
import sys
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import delta
from .errors import MCPError

__all__ = ["SnapshotError", "SnapshotInfo", "Snapshots"]

log = logging.getLogger(__name__)


class SnapshotError(MCPError):
    """A snapshot cannot be taken or restored: during a backward pass, larger than the
    memory budget, or no good snapshot to roll back to. The message says which and what to
    do."""


@dataclass(frozen=True)
class SnapshotInfo:
    """One stored snapshot.

    Attributes:
        step: the step it was taken after.
        nbytes: bytes its blobs and pickled values take.
        raw_nbytes: bytes of the tensors it holds, uncoded.
        mode: ``"full"`` (the newest) or ``"delta"`` (against the next newer one).
    """

    step: int
    nbytes: int
    raw_nbytes: int
    mode: str


class _Leaf:
    """Where a tensor sat in a pickled skeleton."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return (_Leaf, (self.index,))


def _torch() -> Any:
    return sys.modules.get("torch")


def _is_tensor(x: Any) -> bool:
    torch = _torch()
    return (torch is not None and isinstance(x, torch.Tensor)) or isinstance(x, np.ndarray)


def _flatten(x: Any, path: str, leaves: list[tuple[str, Any]]) -> Any:
    """``x`` with every tensor replaced by a :class:`_Leaf`; the tensors go to ``leaves``."""
    if _is_tensor(x):
        leaves.append((path, x))
        return _Leaf(len(leaves) - 1)
    if isinstance(x, dict):
        return {k: _flatten(v, f"{path}/{k}", leaves) for k, v in x.items()}
    if isinstance(x, list | tuple):
        items = [_flatten(v, f"{path}/{i}", leaves) for i, v in enumerate(x)]
        return items if isinstance(x, list) else tuple(items)
    return x


def _rebuild(x: Any, tensors: list[Any]) -> Any:
    if isinstance(x, _Leaf):
        return tensors[x.index]
    if isinstance(x, dict):
        return {k: _rebuild(v, tensors) for k, v in x.items()}
    if isinstance(x, list | tuple):
        items = [_rebuild(v, tensors) for v in x]
        return items if isinstance(x, list) else tuple(items)
    return x


_NORM_DTYPES = ("float32", "float64", "float16", "bfloat16")


def _nonfinite_paths(leaves: list[tuple[str, Any]]) -> list[str]:
    """The paths of the tensors that hold a NaN or Inf. The float dtypes the guard's norm
    reads are checked by the Rust core in one pass (GIL released); others here."""
    from .guards import GradientGuard

    bad = []
    for path, t in leaves:
        if isinstance(t, np.ndarray):
            dtype, c = t.dtype.name, np.ascontiguousarray(t)
        else:
            dtype, c = str(t.dtype).removeprefix("torch."), t.detach().cpu().contiguous()
        if dtype in _NORM_DTYPES:
            if GradientGuard.norm([c])[1]:
                bad.append(path)
        elif dtype.startswith("complex"):
            a = c if isinstance(c, np.ndarray) else c.numpy()
            if not np.isfinite(a).all():
                bad.append(path)
    return bad


def _nbytes(t: Any) -> int:
    if isinstance(t, np.ndarray):
        return int(t.nbytes)
    return int(t.numel() * t.element_size())


def _threads(nbytes: int) -> int:
    """One thread for a tensor of one chunk (starting the pool costs more than it saves)."""
    return 0 if nbytes > delta.DEFAULT_CHUNK_BYTES else 1


def _encode(prev: Any, cur: Any, level: int) -> bytes:
    return delta.encode(prev, cur, level=level, threads=_threads(_nbytes(cur)))


def _decode_blob(prev: Any, blob: bytes, kind: str) -> Any:
    n = int(delta.info(blob)["nbytes"])
    return delta.decode(prev, blob, kind=kind, threads=_threads(n))  # type: ignore[arg-type]


@dataclass
class _Snap:
    step: int
    skeleton: bytes
    paths: list[str]
    kinds: list[str]
    blobs: list[bytes]
    mode: str
    raw_nbytes: int

    @property
    def nbytes(self) -> int:
        return len(self.skeleton) + sum(len(b) for b in self.blobs)


class _BackwardWatch:
    """Marks the backward passes that reach a model's parameters (see the module docstring)."""

    def __init__(self, model: Any) -> None:
        torch = _torch()
        assert torch is not None
        self._lock = threading.Lock()
        self._active: set[int] = set()
        self._handles: list[Any] = []
        ref = weakref.ref(self)

        def on_grad(grad: Any) -> None:
            me = ref()
            if me is not None:
                me._enter()

        def on_forward(*_: Any) -> None:
            me = ref()
            if me is not None:
                with me._lock:
                    me._active.clear()

        for p in model.parameters():
            if p.requires_grad:
                self._handles.append(p.register_hook(on_grad))
        self._handles.append(model.register_forward_pre_hook(on_forward))

    def _enter(self) -> None:
        torch = _torch()
        assert torch is not None
        task = _graph_task_id()
        with self._lock:
            if task in self._active:
                return
            self._active.add(task)

        def leave() -> None:
            with self._lock:
                self._active.discard(task)

        torch.autograd.Variable._execution_engine.queue_callback(leave)

    def running(self) -> bool:
        with self._lock:
            return bool(self._active)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _graph_task_id() -> int:
    """The autograd graph task running on this thread, -1 outside a backward pass (or where
    torch lacks the query)."""
    torch = _torch()
    query = getattr(getattr(torch, "_C", None), "_current_graph_task_id", None)
    return int(query()) if query is not None else -1


def in_backward() -> bool:
    """Whether the calling thread is inside an autograd backward pass (e.g. in a hook)."""
    return _graph_task_id() != -1


class Snapshots:
    """Keeps delta-coded snapshots of a model's and optimiser's state in memory.

    Args:
        model: a ``torch.nn.Module`` (its ``state_dict()``), or ``None``.
        optimizer: a ``torch.optim.Optimizer`` (its ``state_dict()``), or ``None``.
        arrays: a mapping of numpy arrays (or CPU tensors) restored in place, or ``None``.
        every: :meth:`maybe_take` keeps a snapshot when ``step % every == 0`` (>= 1).
        budget_bytes: the most memory the snapshots may take; the oldest are evicted first.
        level: zstd level of the full snapshot's byte planes (1-22).
    """

    def __init__(
        self,
        model: Any = None,
        optimizer: Any = None,
        *,
        arrays: Mapping[str, Any] | None = None,
        every: int = 100,
        budget_bytes: int = 1 << 30,
        level: int = 1,
    ) -> None:
        if model is None and optimizer is None and arrays is None:
            raise ValueError("nothing to snapshot: give a model, an optimizer and/or arrays")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an integer >= 1, got {every!r}")
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1:
            raise ValueError(f"budget_bytes must be a positive integer, got {budget_bytes!r}")
        if arrays is not None:
            for k, a in arrays.items():
                if not _is_tensor(a):
                    raise TypeError(f"arrays[{k!r}]: expected a numpy array or a tensor")
        for what, obj, method in (
            ("model", model, "load_state_dict"),
            ("optimizer", optimizer, "load_state_dict"),
        ):
            if obj is not None and not hasattr(obj, method):
                raise TypeError(f"{what}: {type(obj).__name__} has no state_dict/{method}")
        self.model = model
        self.optimizer = optimizer
        self.arrays = arrays
        self.every = every
        self.budget_bytes = budget_bytes
        self.level = level
        self._snaps: list[_Snap] = []  # oldest first
        self._watch = _BackwardWatch(model) if model is not None and _torch() else None
        self.evicted = 0
        """Snapshots dropped to stay within the budget."""
        self.rollbacks = 0
        """Rollbacks done."""

    # -- taking ---------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if self.model is not None:
            state["model"] = self.model.state_dict()
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        if self.arrays is not None:
            state["arrays"] = dict(self.arrays)
        return state

    def _check_not_in_backward(self) -> None:
        if in_backward() or (self._watch is not None and self._watch.running()):
            raise SnapshotError(
                "a snapshot cannot be taken during a backward pass (the state is half "
                "updated); call maybe_take()/take() between steps, after optimizer.step()"
            )

    def maybe_take(self, step: int) -> bool:
        """Takes a snapshot after ``step`` when ``step % every == 0``; returns whether one was
        stored (``False`` also when the state holds a NaN or Inf: it is not good).

        Raises:
            SnapshotError: called during a backward pass, or one snapshot exceeds the budget.
        """
        self._check_not_in_backward()
        if step % self.every != 0:
            return False
        return self.take(step)

    def take(self, step: int) -> bool:
        """Takes a snapshot after ``step`` now, whatever ``every`` says (see
        :meth:`maybe_take`)."""
        self._check_not_in_backward()
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {type(step).__name__}")
        if self._snaps and step <= self._snaps[-1].step:
            raise ValueError(
                f"step {step} is not after the newest snapshot's step {self._snaps[-1].step}"
            )
        leaves: list[tuple[str, Any]] = []
        skeleton = pickle.dumps(_flatten(self._state(), "", leaves), protocol=5)
        bad = _nonfinite_paths(leaves)
        if bad:
            log.warning(
                "no snapshot at step %d: %s holds NaN or Inf (not a good state)", step, bad[0]
            )
            return False
        kinds = ["numpy" if isinstance(t, np.ndarray) else "torch" for _, t in leaves]
        blobs = [_encode(None, t, self.level) for _, t in leaves]
        new = _Snap(
            step=step,
            skeleton=skeleton,
            paths=[p for p, _ in leaves],
            kinds=kinds,
            blobs=blobs,
            mode="full",
            raw_nbytes=sum(_nbytes(t) for _, t in leaves),
        )
        if new.nbytes > self.budget_bytes:
            raise SnapshotError(
                f"one snapshot takes {new.nbytes} bytes (coded), over budget_bytes="
                f"{self.budget_bytes}; raise the budget to at least {2 * new.nbytes} to keep two"
            )
        if self._snaps:
            # Re-code the previous newest against the new state (reverse delta).
            prev = self._snaps[-1]
            cur = {p: t for p, t in leaves}
            old = self._decode_full(prev)
            prev.blobs = [
                _encode(cur.get(p), t, self.level) for p, t in zip(prev.paths, old, strict=True)
            ]
            prev.mode = "delta"
        self._snaps.append(new)
        while self.nbytes > self.budget_bytes and len(self._snaps) > 1:
            gone = self._snaps.pop(0)
            self.evicted += 1
            log.info("snapshot of step %d evicted (budget %d bytes)", gone.step, self.budget_bytes)
        return True

    # -- reading --------------------------------------------------------------------------

    def _decode_full(self, s: _Snap) -> list[Any]:
        return [_decode_blob(None, b, k) for b, k in zip(s.blobs, s.kinds, strict=True)]

    def _decode(self, index: int) -> list[Any]:
        """The tensors of snapshot ``index``, decoded from the newest backwards."""
        newest = self._snaps[-1]
        tensors = self._decode_full(newest)
        by_path = dict(zip(newest.paths, tensors, strict=True))
        for s in reversed(self._snaps[index:-1]):
            out = []
            for p, b, k in zip(s.paths, s.blobs, s.kinds, strict=True):
                ref = by_path.get(p)
                out.append(_decode_blob(ref if delta.info(b)["mode"] != "full" else None, b, k))
            tensors = out
            by_path = dict(zip(s.paths, tensors, strict=True))
        return tensors

    @property
    def nbytes(self) -> int:
        """Bytes all stored snapshots take (blobs and pickled values)."""
        return sum(s.nbytes for s in self._snaps)

    @property
    def steps(self) -> list[int]:
        """The steps of the stored snapshots, oldest first."""
        return [s.step for s in self._snaps]

    def info(self) -> list[SnapshotInfo]:
        """The stored snapshots, oldest first."""
        return [SnapshotInfo(s.step, s.nbytes, s.raw_nbytes, s.mode) for s in self._snaps]

    def state(self, step: int | None = None) -> dict[str, Any]:
        """A decoded copy of a snapshot's state (the newest by default): ``{"model": ...,
        "optimizer": ..., "arrays": ...}`` as far as they are snapshotted."""
        index = self._index(step)
        s = self._snaps[index]
        return _rebuild(pickle.loads(s.skeleton), self._decode(index))  # type: ignore[no-any-return]

    def _index(self, step: int | None, max_step: int | None = None) -> int:
        if not self._snaps:
            raise SnapshotError(
                "no snapshot to roll back to: none was taken yet (call maybe_take() after "
                "each step), or every state seen held NaN/Inf"
            )
        if step is not None:
            for i, s in enumerate(self._snaps):
                if s.step == step:
                    return i
            raise SnapshotError(
                f"no snapshot of step {step}; the stored ones are {self.steps} (older ones "
                "were evicted to stay within budget_bytes)"
            )
        if max_step is not None:
            for i in range(len(self._snaps) - 1, -1, -1):
                if self._snaps[i].step <= max_step:
                    return i
            raise SnapshotError(
                f"no snapshot at or before step {max_step}; the stored ones are {self.steps}"
            )
        return len(self._snaps) - 1

    # -- rolling back ---------------------------------------------------------------------

    def rollback(self, step: int | None = None, *, max_step: int | None = None) -> int:
        """Restores the model, optimiser and arrays bit for bit to a snapshot: the newest (by
        default), the one of ``step``, or the newest taken at or before ``max_step``. The
        snapshots newer than it are dropped (they belong to the abandoned run). Returns the
        step restored.

        Raises:
            SnapshotError: during a backward pass, or no such snapshot.
        """
        self._check_not_in_backward()
        index = self._index(step, max_step)
        s = self._snaps[index]
        tensors = self._decode(index)
        state = _rebuild(pickle.loads(s.skeleton), tensors)
        if self.model is not None:
            self.model.load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.arrays is not None:
            for k, v in state["arrays"].items():
                dst = self.arrays[k]
                if isinstance(dst, np.ndarray):
                    np.copyto(dst, v)
                else:
                    with _torch().no_grad():  # type: ignore[union-attr]
                        dst.copy_(v)
        # The restored snapshot becomes the newest: stored in full again.
        del self._snaps[index + 1 :]
        s.blobs = [_encode(None, t, self.level) for t in tensors]
        s.mode = "full"
        self.rollbacks += 1
        log.warning("rolled back to the snapshot of step %d", s.step)
        return s.step

    def clear(self) -> None:
        """Drops every snapshot."""
        self._snaps.clear()

    def close(self) -> None:
        """Drops every snapshot and removes the hooks on the model."""
        self.clear()
        if self._watch is not None:
            self._watch.remove()
            self._watch = None

    def ratio(self) -> float:
        """Coded bytes over raw bytes of the stored snapshots (NaN when none)."""
        raw = sum(s.raw_nbytes for s in self._snaps)
        return self.nbytes / raw if raw else math.nan
