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
    _core.reduce_into(view(dst, name="dst"), view(src, name="src"), _op_name(op))


def codec_round_trip(x: Any, codec: str, block: int = 256) -> None:
    """Replace ``x`` in place by what a peer decodes after sending it with ``codec``."""
    _core.codec_round_trip(view(x, name="x"), codec, block)
