"""Hierarchical collectives over QUIC on 127.0.0.1, with fake hosts named by MCP_HOST_ID:
every collective, dtype and op against a numpy reference (exact), a coded all-reduce that
every rank ends with the same bits of, and topologies that are refused."""

from __future__ import annotations

import numpy as np
import pytest

from _launch import ok, run
from test_collectives import reduce_ref
from workers import DTYPES, OPS, data

SIZES = [0, 7, 70_003]


@pytest.mark.parametrize(
    "hosts, topology",
    [
        (["a", "a", "b", "b"], [0, 0, 1, 1]),
        (["x", "y", "x", "y", "y"], [0, 1, 0, 1, 1]),
    ],
)
def test_every_collective_over_fake_hosts(hosts: list[str], topology: list[int]) -> None:
    world = len(hosts)
    results = ok(run("hier_workers.every_collective", world, hosts, SIZES, timeout=300))
    for rank, out in enumerate(results):
        assert out["topology"] == topology
        for algo in ["auto", "hierarchical", "ring"]:
            for dtype in DTYPES:
                for op in OPS:
                    if op == "avg" and not dtype.startswith("float"):
                        continue
                    for n in SIZES:
                        want = reduce_ref([data(dtype, op, r, n) for r in range(world)], op)
                        got = out[f"all_reduce/{algo}/{dtype}/{op}/{n}"]
                        np.testing.assert_array_equal(
                            got, want, f"{algo} {dtype} {op} n={n} r={rank}"
                        )
        for root in range(world):
            for n in SIZES:
                want = data("int64", "sum", root, n, salt=root)
                np.testing.assert_array_equal(out[f"broadcast/{root}/{n}"], want)
        for n in SIZES:
            want = np.stack([data("float32", "sum", r, n, salt=3) for r in range(world)])
            np.testing.assert_array_equal(out[f"all_gather/{n}"], want)
            for op in ["sum", "max"]:
                full = reduce_ref(
                    [data("int32", op, r, n * world, salt=5) for r in range(world)], op
                )
                np.testing.assert_array_equal(
                    out[f"reduce_scatter/{op}/{n}"], full[rank * n : (rank + 1) * n]
                )
    # int8 between hosts: the same bits everywhere, within the quantisation bound.
    exact = sum(out["coded/input"].astype(np.float64) for out in results)
    for out in results:
        np.testing.assert_array_equal(out["coded"], results[0]["coded"])
    err = np.abs(results[0]["coded"] - exact).max()
    assert 0 < err <= world * world / 127


def test_bad_topologies_are_refused() -> None:
    for empty, short, long, topology in ok(run("hier_workers.bad_host", 2, timeout=60)):
        assert "at least one rank" in empty
        assert "covers 1 ranks but the group has 2" in short
        assert "covers 3 ranks but the group has 2" in long
        assert topology == "[0, 0]"  # left as it was


def test_hierarchical_collectives_are_exact_through_a_lossy_socket() -> None:
    hosts = ["a", "a", "b", "b"]
    world = len(hosts)
    results = ok(
        run("hier_workers.under_chaos", world, hosts, "loss=0.1,reorder=0.05,seed=5", timeout=240)
    )
    want = sum(data("float32", "sum", r, 300_001) for r in range(world))
    for out in results:
        np.testing.assert_array_equal(out["all_reduce"], want)
        np.testing.assert_array_equal(out["broadcast"], data("int64", "sum", 1, 50_000))
        assert out["stats"]["send_dropped"] + out["stats"]["recv_dropped"] > 0, out["stats"]
