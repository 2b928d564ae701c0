"""Reduction kernel vs numpy's in-place add, same arrays, same run (`make bench`)."""

from __future__ import annotations

import numpy as np
import pytest

from mcp_fast.kernels import reduce_into

SIZES = {"64KiB": 1 << 14, "4MiB": 1 << 20, "64MiB": 1 << 24}


@pytest.mark.parametrize("size", list(SIZES))
def test_numpy_add(benchmark, size: str) -> None:
    a = np.ones(SIZES[size], np.float32)
    b = np.ones(SIZES[size], np.float32)
    benchmark(np.add, a, b, out=a)


@pytest.mark.parametrize("size", list(SIZES))
def test_mcp_reduce_sum(benchmark, size: str) -> None:
    a = np.ones(SIZES[size], np.float32)
    b = np.ones(SIZES[size], np.float32)
    benchmark(reduce_into, a, b)


def test_kernel_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal(100_003).astype(np.float32)
    b = rng.standard_normal(100_003).astype(np.float32)
    want = a + b
    reduce_into(a, b)
    np.testing.assert_array_equal(a, want)
