"""Compression on the wire: every codec through real processes, every rank the same bits."""

from __future__ import annotations

import numpy as np
import pytest

from _launch import ok, run
from mcp_fast.kernels import codec_round_trip

# Relative size of one quantisation error for values in [-1, 1].
REL = {"fp16": 2.0**-11, "bf16": 2.0**-8, "int8": 1 / 127, "lossless": 0.0}


@pytest.mark.parametrize("world", [2, 3])
def test_coded_collectives(world: int) -> None:
    results = ok(run("coded_collectives", world, timeout=120))
    for codec, rel in REL.items():
        exact = sum(r[f"in/{codec}"].astype(np.float64) for r in results)
        for r in results:
            np.testing.assert_array_equal(
                r[f"all_reduce/{codec}"], results[0][f"all_reduce/{codec}"]
            )
            np.testing.assert_array_equal(
                r[f"all_gather/{codec}"], results[0][f"all_gather/{codec}"]
            )
        err = np.abs(results[0][f"all_reduce/{codec}"] - exact).max()
        assert err <= world * world * rel + 1e-5, (codec, err)
        if codec == "lossless":
            np.testing.assert_array_equal(
                results[0]["all_gather/lossless"],
                np.stack([r["in/lossless"][:1000] for r in results]),
            )
        else:
            assert err > 0, f"{codec} left no trace: was it applied?"
    for r in results:
        np.testing.assert_array_equal(r["broadcast"], results[0]["broadcast"])


def test_round_trip_and_bad_codec() -> None:
    x = np.linspace(-1, 1, 1000, dtype="float32")
    y = x.copy()
    codec_round_trip(y, "bf16")
    assert 0 < np.abs(x - y).max() <= 2.0**-8
    z = x.copy()
    codec_round_trip(z, "lossless")
    np.testing.assert_array_equal(z, x)
    with pytest.raises(ValueError, match="codec"):
        codec_round_trip(x.copy(), "zip")
    with pytest.raises(ValueError):
        codec_round_trip(np.zeros(4, "int32"), "int8")


def test_auto_codec_is_agreed_by_every_rank() -> None:
    results = ok(run("auto_codec", 2, timeout=60))
    assert results[0][0] == results[1][0]
    assert results[0][0] in ("none", "bf16", "int8")
    for _, vals in results:
        assert vals == [3.0, 3.0]  # 1 + 2, exact in every codec
