"""Every collective and op across real processes on 127.0.0.1, against a numpy reference.

Inputs are small integers (powers of two for products), so every order of reduction gives the
same bits and the comparison is exact for the floating types too.
"""

from __future__ import annotations

import numpy as np
import pytest

from _launch import ok, run
from workers import DTYPES, OPS, data

SIZES = [0, 1, 7, 1000, 70_003]


def reduce_ref(arrays: list[np.ndarray], op: str) -> np.ndarray:
    acc = arrays[0].copy()
    for a in arrays[1:]:
        if op in ("sum", "avg"):
            acc = (acc + a).astype(acc.dtype)
        elif op == "prod":
            acc = (acc * a).astype(acc.dtype)
        elif op == "min":
            acc = np.minimum(acc, a)
        else:
            acc = np.maximum(acc, a)
    if op == "avg":
        if acc.dtype == np.float16:
            acc = (acc.astype(np.float32) / np.float32(len(arrays))).astype(np.float16)
        else:
            acc = (acc / acc.dtype.type(len(arrays))).astype(acc.dtype)
    return acc


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_collective_matches_numpy(world: int) -> None:
    results = ok(run("every_collective", world, SIZES, timeout=240))
    for rank, out in enumerate(results):
        for algo in ["auto", "ring", "tree", "recursive_doubling"]:
            for dtype in DTYPES:
                for op in OPS:
                    if op == "avg" and not dtype.startswith("float"):
                        continue
                    for n in SIZES:
                        want = reduce_ref([data(dtype, op, r, n) for r in range(world)], op)
                        got = out[f"all_reduce/{algo}/{dtype}/{op}/{n}"]
                        assert got.dtype == want.dtype
                        np.testing.assert_array_equal(
                            got, want, f"{algo} {dtype} {op} n={n} r={rank}"
                        )
        for root in range(world):
            for n in SIZES:
                want = data("int64", "sum", root, n, salt=root)
                np.testing.assert_array_equal(out[f"broadcast/{root}/{n}"], want)
        for n in SIZES:
            want = np.stack(
                [data("float32", "sum", r, n, salt=3).reshape(n, 1) for r in range(world)]
            )
            np.testing.assert_array_equal(out[f"all_gather/{n}"], want)
            for op in ["sum", "max"]:
                full = reduce_ref(
                    [data("int32", op, r, n * world, salt=5) for r in range(world)], op
                )
                np.testing.assert_array_equal(
                    out[f"reduce_scatter/{op}/{n}"], full[rank * n : (rank + 1) * n]
                )
        for tag in (0, 7):
            src = (rank - 1) % world
            np.testing.assert_array_equal(
                out[f"recv/{tag}"], data("float64", "sum", src, 1001, tag)
            )
        a1 = reduce_ref([data("float32", "sum", r, 5000, salt=1) for r in range(world)], "sum")
        a2 = reduce_ref([data("float32", "sum", r, 5000, salt=2) for r in range(world)], "max")
        np.testing.assert_array_equal(out["async/1"], a1)
        np.testing.assert_array_equal(out["async/2"], a2)
        a3 = reduce_ref([data("float32", "sum", r, 300_001, salt=3) for r in range(world)], "sum")
        a4 = reduce_ref([data("float32", "sum", r, 1000, salt=4) for r in range(world)], "max")
        np.testing.assert_array_equal(out["async/3"], a3)
        np.testing.assert_array_equal(out["sync/4"], a4)


def test_torch_cpu_tensors_in_place() -> None:
    pytest.importorskip("torch")
    world = 2
    results = ok(run("torch_tensors", world, timeout=120))
    base = np.arange(1000) % 7
    for out in results:
        for name in ["torch.float32", "torch.bfloat16", "torch.float16", "torch.int64"]:
            np.testing.assert_array_equal(out[name], 2 * base + 1, name)
        np.testing.assert_array_equal(out["torch.uint8"], 2 * base + 1)
        np.testing.assert_array_equal(out["broadcast"], np.full((3, 4), 1.0))
        assert out["avg"] == 1.5


def test_generated_secret_is_handed_out_at_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MCP_SECRET", raising=False)
    assert ok(run("generated_secret", 3, timeout=60)) == [3000.0] * 3


def test_recv_from_any_source_returns_the_sender() -> None:
    got = ok(run("any_source", 3, timeout=60))[0]
    assert got == [(2, 2.0), (1, 1.0)]
