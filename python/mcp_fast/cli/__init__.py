"""Command-line tools of mcp_fast: ``mcp-diag`` (:mod:`.diag`), ``mcp-chaos``
(:mod:`.chaos`) and ``mcp-monitor`` (:mod:`.monitor`). Each has ``main(argv=None) -> int``."""

from __future__ import annotations

import re

__all__ = ["parse_size"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
}


def parse_size(text: str) -> int:
    """``"4MiB"`` → 4194304, ``"256kb"`` → 256000, ``"4096"`` → 4096 (bytes; SI or IEC)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 256kb, 4MiB, 1GiB)")
    return int(float(m.group(1)) * _UNITS[unit])


def positive_size(text: str) -> int:
    """argparse type: a size (see :func:`parse_size`) of at least one byte."""
    import argparse

    try:
        n = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return n
