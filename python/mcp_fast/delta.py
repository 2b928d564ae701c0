"""Lossless (optionally lossy) delta coding of a tensor against its previous version.

The coding runs in the Rust core (``mcp_fast._core``): every element is compared with the
same element of ``prev`` (XOR for bytes and bools, wrapping difference for integers, distance
in units in the last place for floats, against ``α · prev`` where one factor explains the
change). Float residuals are coded one rANS symbol per element (magnitude class and sign)
plus their raw low bits; other dtypes and full snapshots are split into byte planes, each
stored as a constant, zstd or raw bytes. Chunks of 1 MiB are coded on all cores with the GIL
released. Every blob carries the dtype, the shape, checksums and a 64-bit content
hash of the tensor it decodes to, which :func:`decode` checks.

Both numpy arrays and torch CPU tensors of every dtype torch uses are accepted (``float32``,
``float64``, ``bfloat16``, ``float16``, ``complex64/128``, ``int8/16/32/64``, ``uint8/16/32/64``,
``bool``). When ``prev`` is ``None`` or has another shape or dtype, the tensor is stored in
full. Example::

    blob = delta.encode(prev_weights, weights)
    again = delta.decode(prev_weights, blob)   # bit-identical to ``weights``
"""

from __future__ import annotations

import sys
from typing import Any, Literal

import numpy as np

from mcp_fast import _core
from mcp_fast.errors import MCPError

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DeltaCodecError",
    "content_hash",
    "decode",
    "encode",
    "info",
    "to_bytes_view",
]

DEFAULT_CHUNK_BYTES = 1 << 20
"""Bytes of tensor per independently coded chunk."""


class DeltaCodecError(MCPError):
    """A blob cannot be decoded: it is truncated, corrupt, or not paired with the tensor it
    was encoded against (its content hash does not match).

    Attributes:
        kind: ``"truncated"``, ``"bad_magic"``, ``"corrupt"``, ``"hash_mismatch"`` or ``"zstd"``.
    """

    def __init__(self, message: str, kind: str = "corrupt") -> None:
        super().__init__(message)
        self.kind = kind


Tensor = Any  # numpy.ndarray or torch.Tensor


def _torch() -> Any:
    """The torch module, imported on first need (importing mcp_fast.delta stays fast, and
    torch stays optional: a process that never imported torch holds no tensors)."""
    import torch

    return torch


def _is_torch(x: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def to_bytes_view(x: Tensor) -> tuple[np.ndarray, str, tuple[int, ...]]:
    """Returns a C-contiguous ``uint8`` view of ``x`` (copying only when ``x`` is not
    contiguous or not on the CPU), its dtype name and its shape."""
    if _is_torch(x):
        torch = _torch()
        t = x.detach()
        if t.layout != torch.strided:
            raise TypeError(f"only dense tensors can be delta-coded, not {t.layout}")
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.resolve_conj().resolve_neg().contiguous()
        name = str(t.dtype).removeprefix("torch.")
        shape = tuple(int(d) for d in t.shape)
        return t.reshape(-1).view(torch.uint8).numpy(), name, shape
    if isinstance(x, np.ndarray | np.generic):
        a = np.asarray(x)
        if not a.flags.c_contiguous:
            a = a.copy(order="C")
        if a.dtype.kind not in "biufc" or a.dtype.byteorder == ">":
            raise TypeError(f"dtype {a.dtype} cannot be delta-coded")
        return a.reshape(-1).view(np.uint8), a.dtype.name, tuple(int(d) for d in a.shape)
    raise TypeError(f"expected a numpy array or a torch tensor, got {type(x).__name__}")


def encode(
    prev: Tensor | None,
    cur: Tensor,
    *,
    level: int = 1,
    max_abs_error: float | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    threads: int = 0,
) -> bytes:
    """Encodes ``cur`` against ``prev`` and returns the blob.

    Args:
        prev: the same tensor at the previous checkpoint, or ``None``. A ``prev`` of another
            shape or dtype is ignored and ``cur`` is stored in full.
        cur: the tensor to store.
        level: zstd level of the byte planes (1–22): full snapshots and non-float dtypes.
        max_abs_error: turns on the lossy mode for float dtypes: every element decodes to
            within this absolute error of ``cur`` (never the default). ``prev`` must then be
            what a decoder holds (the previous *decoded* tensor) so errors do not add up.
        chunk_bytes: bytes per independently coded chunk.
        threads: worker threads, 0 for all cores.
    """
    view, name, shape = to_bytes_view(cur)
    prev_view = None
    if prev is not None:
        p_view, p_name, p_shape = to_bytes_view(prev)
        if p_name == name and p_shape == shape:
            prev_view = p_view
    return _core.delta_encode(
        view,
        name,
        list(shape),
        prev_view,
        level=level,
        chunk_bytes=chunk_bytes,
        threads=threads,
        max_abs_error=max_abs_error,
    )


def info(blob: bytes | bytearray | memoryview) -> dict[str, Any]:
    """The header of a blob: ``mode`` (``"full"``, ``"delta"``, ``"unchanged"`` or
    ``"lossy"``), ``dtype``, ``shape``, ``nbytes``, ``hash``, ``chunk_bytes``, ``n_chunks``,
    ``max_abs_error`` and ``blob_len``."""
    return _core.delta_info(blob)


def _empty(dtype: str, shape: tuple[int, ...], kind: str) -> tuple[Tensor, np.ndarray]:
    """A new tensor/array and a writable uint8 view of its bytes."""
    if kind == "torch":
        torch = _torch()
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        return t, t.reshape(-1).view(torch.uint8).numpy()
    a = np.empty(shape, dtype=np.dtype(dtype))
    return a, a.reshape(-1).view(np.uint8)


def decode(
    prev: Tensor | None,
    blob: bytes | bytearray | memoryview,
    *,
    kind: Literal["numpy", "torch"] | None = None,
    threads: int = 0,
) -> Tensor:
    """Decodes ``blob`` (from :func:`encode`) against ``prev`` and returns the tensor.

    Args:
        prev: the tensor the blob was encoded against (ignored for a full blob).
        blob: the encoded bytes.
        kind: ``"numpy"`` or ``"torch"``; by default the kind of ``prev``, else numpy — except
            for ``bfloat16``, which numpy lacks, returned as a torch tensor.
        threads: worker threads, 0 for all cores.

    Raises:
        DeltaCodecError: the blob is truncated or corrupt, or ``prev`` is not the tensor it was
            encoded against (the content hash does not match).
        ValueError: a delta blob without a matching ``prev``.
    """
    hdr = _core.delta_info(blob)
    dtype, shape = hdr["dtype"], tuple(hdr["shape"])
    if kind is None:
        torch_prev = prev is not None and _is_torch(prev)
        kind = "torch" if torch_prev or dtype == "bfloat16" else "numpy"
    if kind == "numpy" and dtype == "bfloat16":
        raise ValueError("numpy has no bfloat16: decode with kind='torch'")
    prev_view = None
    if hdr["mode"] != "full":
        if prev is None:
            raise ValueError(f"a {hdr['mode']} blob needs the previous tensor")
        prev_view, p_name, p_shape = to_bytes_view(prev)
        if (p_name, p_shape) != (dtype, shape):
            raise ValueError(
                f"previous tensor is {p_name}{list(p_shape)}, the blob needs {dtype}{list(shape)}"
            )
    out, out_view = _empty(dtype, shape, kind)
    _core.delta_decode_into(blob, prev_view, out_view, threads=threads)
    return out


def content_hash(x: Tensor) -> int:
    """The 64-bit content hash (xxh3-64 of the bytes) the codec stores for a tensor."""
    view, _, _ = to_bytes_view(x)
    return int(_core.delta_content_hash(view))
