"""Real text that ships with every Python installation: the standard library's own source.

    from stdlib_text import corpus
    train, held = corpus(2 << 20)      # ASCII codes (int64), every 10th file held out

Used by ``train_elastic.py`` and ``train_diloco.py`` (and the benchmarks that run them).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

VOCAB = 128


def corpus(max_bytes: int, vocab: int = VOCAB) -> tuple[np.ndarray, np.ndarray]:
    """The standard library's ``*.py`` files (over 2 kB, in name order) as character codes
    below ``vocab`` (others become ``?``), up to about ``max_bytes``: (training text,
    held-out text), every 10th file held out."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.glob("*.py") if p.stat().st_size > 2000)
    train, held = [], []
    size = 0
    for i, p in enumerate(files):
        data = np.frombuffer(p.read_bytes(), dtype=np.uint8)
        data = np.where(data < vocab, data, ord("?")).astype(np.int64)
        (held if i % 10 == 0 else train).append(data)
        size += data.size
        if size >= max_bytes:
            break
    return np.concatenate(train), np.concatenate(held)
