"""Turning numpy arrays and torch tensors into (address, length, dtype, shape) for the core.

Nothing is copied: the core reads and writes the array's own memory. That is only safe for
memory it may write, laid out contiguously, so every such condition is checked here, before
anything is sent, and reported as ``TypeError``/``ValueError`` with what to do about it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

# numpy's (and ml_dtypes') names for the core's dtypes; torch's are the same.
_NUMPY_DTYPES = {
    name: name
    for name in (
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "int32",
        "int64",
        "uint8",
        "int8",
        "int16",
        "uint16",
        "uint32",
        "uint64",
        "bool",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
    )
}

SUPPORTED = ", ".join(_NUMPY_DTYPES)


@dataclass(frozen=True)
class Buffer:
    """Where an argument's bytes are and what they hold; ``obj`` keeps them alive."""

    ptr: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    obj: Any

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _torch_dtype_name(t: Any) -> str | None:
    name = str(t.dtype).removeprefix("torch.")
    return name if name in _NUMPY_DTYPES else None


def is_torch_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def view(x: Any, *, name: str, writable: bool) -> Buffer:
    """Describe ``x`` (a numpy array or a CPU torch tensor) for the core, in place."""
    if isinstance(x, np.ndarray):
        dtype = _NUMPY_DTYPES.get(x.dtype.name)
        if dtype is None:
            raise TypeError(f"{name}: dtype {x.dtype} is not supported; use one of {SUPPORTED}")
        if not x.flags.c_contiguous:
            raise ValueError(
                f"{name}: the array is not C-contiguous; pass np.ascontiguousarray(a) and copy "
                "the result back if you need it in the original"
            )
        if writable and not x.flags.writeable:
            raise ValueError(f"{name}: the array is read-only; the operation writes into it")
        if x.dtype.byteorder == ">":
            raise TypeError(f"{name}: big-endian arrays are not supported; use .astype('<...')")
        return Buffer(int(x.ctypes.data), int(x.nbytes), dtype, tuple(x.shape), x)
    if is_torch_tensor(x):
        if x.device.type != "cpu":
            raise TypeError(
                f"{name}: tensors on {x.device} are not supported by this API; "
                "move them to the CPU (.cpu()) or use the torch.distributed backend 'mcp'"
            )
        dtype = _torch_dtype_name(x)
        if dtype is None:
            raise TypeError(f"{name}: dtype {x.dtype} is not supported; use one of {SUPPORTED}")
        if x.is_sparse or not x.is_contiguous():
            raise ValueError(f"{name}: the tensor is not contiguous; pass t.contiguous()")
        if x.is_conj() or x.is_neg():
            raise ValueError(
                f"{name}: lazily conjugated/negated views are not supported; resolve()"
            )
        nbytes = x.numel() * x.element_size()
        return Buffer(int(x.data_ptr()), nbytes, dtype, tuple(x.shape), x)
    raise TypeError(f"{name}: expected a numpy.ndarray or a torch.Tensor, got {type(x).__name__}")
