"""pytest-benchmark suite of the delta codec (`make bench`: ``pytest benches --benchmark-enable``).

Float32 and bfloat16 tensors of 16 MiB changed as one AdamW step changes weights (relative
change about 1e-3), encoded against the previous version; zstd-3 on the raw bytes in the same
run for reference. The ratio is recorded in ``extra_info``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from mcp_fast import delta

try:
    import zstandard
except ImportError:  # pragma: no cover
    zstandard = None  # type: ignore[assignment]

N = 4 * 1024 * 1024


def pair(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    prev = (torch.randn(N, generator=g) * 0.05).to(dtype)
    step = torch.randn(N, generator=g).sign() * 1e-4
    return prev, (prev.float() + step).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_encode(benchmark: Any, dtype: torch.dtype) -> None:
    prev, cur = pair(dtype)
    blob = benchmark(delta.encode, prev, cur)
    benchmark.extra_info["ratio"] = cur.numel() * cur.element_size() / len(blob)
    assert torch.equal(delta.decode(prev, blob).view(torch.uint8), cur.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode(benchmark: Any, dtype: torch.dtype) -> None:
    prev, cur = pair(dtype)
    blob = delta.encode(prev, cur)
    out = benchmark(delta.decode, prev, blob)
    assert torch.equal(out.view(torch.uint8), cur.view(torch.uint8))


@pytest.mark.skipif(zstandard is None, reason="zstandard not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_zstd3_raw_reference(benchmark: Any, dtype: torch.dtype) -> None:
    _, cur = pair(dtype)
    raw = cur.view(torch.uint8).numpy().tobytes()
    c = zstandard.ZstdCompressor(level=3)
    blob = benchmark(c.compress, raw)
    benchmark.extra_info["ratio"] = len(raw) / len(blob)
    assert zstandard.ZstdDecompressor().decompress(blob) == raw


def test_pair_is_a_small_change() -> None:
    prev, cur = pair(torch.float32)
    rel = ((cur - prev).abs() / prev.abs().clamp_min(1e-6)).median().item()
    assert 1e-4 < rel < 1e-1
    assert np.count_nonzero((cur != prev).numpy()) > N // 2
