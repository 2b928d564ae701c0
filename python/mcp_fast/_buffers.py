"""Numpy arrays and torch tensors as the core's one tensor argument.

Nothing is copied: the core reads and writes the argument's own memory through the buffer
protocol (``_core`` checks there that it is C-contiguous, writable where the operation
writes and little-endian, and the dtype's name against the ones it supports). What only
Python can see is checked here: the type, the device, and a torch tensor's layout (its
``uint8`` view would otherwise be a copy).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Buffer:
    """One tensor argument: ``data`` exports its memory, ``dtype`` names its element type
    (torch's and numpy's names, e.g. ``"float32"``), ``name`` says which argument it is in
    error messages."""

    name: str
    data: Any
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def is_torch_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


# numpy computes ``dtype.name`` in Python on every access (microseconds, as long as a small
# all-reduce's own work); the names of the few dtypes a program uses are kept here.
_NUMPY_NAMES: dict[np.dtype[Any], str] = {}


def _numpy_name(dtype: np.dtype[Any]) -> str:
    name = _NUMPY_NAMES.get(dtype)
    if name is None:
        name = dtype.name
        if len(_NUMPY_NAMES) < 256:
            _NUMPY_NAMES[dtype] = name
    return name


# torch dtypes whose tensors ``Tensor.numpy()`` shares as numpy arrays of the same name.
_NUMPY_HAS = frozenset(
    {
        *("bool", "uint8", "int8", "int16", "int32", "int64"),
        *("float16", "float32", "float64", "complex64", "complex128"),
    }
)
_TORCH_NAMES: dict[Any, str] = {}


def _torch_name(dtype: Any) -> str:
    name = _TORCH_NAMES.get(dtype)
    if name is None:
        name = _TORCH_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def view(x: Any, *, name: str) -> Buffer:
    """Describe ``x`` (a numpy array or a CPU torch tensor) for the core, in place."""
    if isinstance(x, np.ndarray):
        # A 0-d array exports no shape, which the buffer protocol's reader refuses: its
        # one-element view shares the memory.
        data = x if x.ndim else x.reshape(1)
        return Buffer(name, data, _numpy_name(x.dtype), tuple(x.shape), int(x.nbytes))
    if is_torch_tensor(x):
        if not x.is_cpu:
            raise TypeError(
                f"{name}: tensors on {x.device} are not supported by this API; "
                "move them to the CPU (.cpu()) or use the torch.distributed backend 'mcp'"
            )
        if x.is_sparse or not x.is_contiguous():
            raise ValueError(f"{name}: the tensor is not C-contiguous; pass t.contiguous()")
        if x.is_conj() or x.is_neg():
            raise ValueError(
                f"{name}: lazily conjugated/negated views are not supported; resolve()"
            )
        dtype = _torch_name(x.dtype)
        t = x.detach() if x.requires_grad else x
        if t.dim() == 0:
            t = t.reshape(1)  # as a 0-d numpy array, see above
        try:
            # numpy's own view where numpy has the dtype (the cheapest), else the bytes.
            if dtype in _NUMPY_HAS:
                data = t.numpy()
            else:
                data = t.reshape(-1).view(sys.modules["torch"].uint8).numpy()
        except (RuntimeError, TypeError) as e:
            raise TypeError(f"{name}: dtype {x.dtype} is not supported ({e})") from None
        return Buffer(name, data, dtype, tuple(x.shape), int(data.nbytes))
    raise TypeError(f"{name}: expected a numpy.ndarray or a torch.Tensor, got {type(x).__name__}")
