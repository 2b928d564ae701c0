"""The core's element-wise reduction kernels, for benchmarks and checks against numpy."""

from __future__ import annotations

from typing import Any

from . import _core
from ._buffers import view
from .group import _op_name


def reduce_into(dst: Any, src: Any, op: str = "sum") -> None:
    """``dst = op(dst, src)`` in place (numpy arrays or CPU tensors of one dtype and size).

    ``avg`` accumulates like ``sum`` here; the division happens when a collective finishes.
    """
    d = view(dst, name="dst", writable=True)
    s = view(src, name="src", writable=False)
    if d.dtype != s.dtype or d.nbytes != s.nbytes:
        raise ValueError(f"dst ({d.dtype}, {d.nbytes} B) and src ({s.dtype}, {s.nbytes} B) differ")
    _core.reduce_into(d.ptr, s.ptr, d.nbytes, d.dtype, _op_name(op))


def codec_round_trip(x: Any, codec: str, block: int = 256) -> None:
    """Replace ``x`` in place by what a peer decodes after sending it with ``codec``."""
    b = view(x, name="x", writable=True)
    _core.codec_round_trip(b.ptr, b.nbytes, b.dtype, codec, block)
