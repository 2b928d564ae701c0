"""Staging tensors through host memory.

CPU tensors are used in place when they are contiguous. Other tensors (CUDA ones, or
non-contiguous views) get a contiguous host buffer; CUDA tensors use page-locked (pinned)
buffers from a small pool, so the device-to-host and host-to-device copies run at full
PCIe speed, and are written back after the operation completes.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch


class _PinnedPool:
    """Reuses pinned host buffers by (dtype, numel); bounded so that it never hoards memory."""

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self._free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = defaultdict(list)
        self._bytes = 0
        self._max = max_bytes
        self._lock = threading.Lock()

    def take(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get((dtype, numel))
            if free:
                buf = free.pop()
                self._bytes -= buf.numel() * buf.element_size()
                return buf
        return torch.empty(numel, dtype=dtype, pin_memory=torch.cuda.is_available())

    def give(self, buf: torch.Tensor) -> None:
        size = buf.numel() * buf.element_size()
        with self._lock:
            if self._bytes + size <= self._max:
                self._free[(buf.dtype, buf.numel())].append(buf)
                self._bytes += size


POOL = _PinnedPool()


class Staged:
    """A tensor and the contiguous host tensor the core works on."""

    __slots__ = ("host", "pooled", "tensor")

    def __init__(self, tensor: torch.Tensor, host: torch.Tensor, pooled: bool) -> None:
        self.tensor = tensor
        self.host = host
        self.pooled = pooled

    @property
    def in_place(self) -> bool:
        return self.host is self.tensor

    def write_back(self) -> None:
        if not self.in_place:
            with torch.no_grad():
                self.tensor.copy_(self.host.view(self.tensor.shape))

    def release(self) -> None:
        if self.pooled:
            POOL.give(self.host)
            self.pooled = False


def stage(t: torch.Tensor, read: bool = True) -> Staged:
    """The host tensor an operation on ``t`` uses (``t`` itself for contiguous CPU tensors)."""
    t = t.detach()
    if t.device.type == "cpu" and t.is_contiguous():
        return Staged(t, t, pooled=False)
    if t.device.type == "cuda":
        host = POOL.take(t.dtype, t.numel())
        if read:
            # Synchronous on the tensor's current stream: the data must be final first.
            host.copy_(t.reshape(-1))
        return Staged(t, host.view(t.shape), pooled=True)
    return Staged(t, t.contiguous().clone(), pooled=False)
