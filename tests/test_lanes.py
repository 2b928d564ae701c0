"""The FEC lane: results are bit-exact whatever the lane, through loss and corruption."""

from __future__ import annotations

import numpy as np
import pytest

import mcp_fast as mcp
from _launch import free_port, ok, run
from workers import data


@pytest.fixture(autouse=True)
def _quic_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests exercise QUIC itself: ranks of this host stay off shared memory."""
    monkeypatch.setenv("MCP_SHM", "0")


def _check(results: list[dict], world: int) -> None:
    for out in results:
        for n in (1000, 300_001):
            want = sum(data("float32", "sum", r, n) for r in range(world))
            np.testing.assert_array_equal(out[f"all_reduce/{n}"], want)
        np.testing.assert_array_equal(out["broadcast"], data("int64", "sum", 0, 200_000))
    np.testing.assert_array_equal(results[1]["p2p"], data("float64", "sum", 0, 70_000, salt=3))


def test_forced_fec_lane_is_exact_through_loss_and_corruption() -> None:
    world = 3
    spec = str(mcp.Chaos(loss=0.2, corrupt=0.01, seed=2))
    results = ok(run("on_lane", world, "fec", spec, timeout=180))
    _check(results, world)
    for out in results:
        assert out["lane"] == "fec"
        # Every data frame went as shards; corrupted shards were erasures, no frame failed.
        assert out["lane_stats"]["frames_sent"] >= 3, out["lane_stats"]
        assert out["lane_stats"]["frames_received"] >= 3, out["lane_stats"]
        assert out["corrupt_frames"] == 0


def test_clean_fec_lane_matches_the_stream_lane() -> None:
    world = 2
    fec = ok(run("on_lane", world, "fec", None, timeout=120))
    stream = ok(run("on_lane", world, "stream", None, timeout=120))
    _check(fec, world)
    _check(stream, world)
    for f, s in zip(fec, stream, strict=True):
        for key in ("all_reduce/1000", "all_reduce/300001", "broadcast"):
            assert f[key].tobytes() == s[key].tobytes(), key
        assert s["lane_stats"]["frames_sent"] == 0
        assert f["lane_stats"]["frames_sent"] > 0


def test_auto_lane_is_exact_through_loss() -> None:
    world = 2
    spec = str(mcp.Chaos(loss=0.2, seed=4))
    results = ok(run("on_lane", world, None, spec, timeout=180, env={"MCP_LANE": "auto"}))
    _check(results, world)
    assert all(out["lane"] == "auto" for out in results)


def test_lane_is_checked() -> None:
    with pytest.raises(ValueError, match="lane"):
        mcp.init(rank=0, world_size=1, master_port=free_port(), lane="udp")
    g = mcp.init(rank=0, world_size=1, master_port=free_port(), lane="stream")
    try:
        assert g.lane == "stream"
        assert g.lane_stats() == {
            "frames_sent": 0,
            "frames_received": 0,
            "repair_shards": 0,
            "fallbacks": 0,
        }
    finally:
        g.close()


def test_auto_lane_takes_the_fec_lane_on_a_long_lossy_path() -> None:
    # 20 ms each way and 5 % loss: once the loss is measured, frames of 256 KiB and more go
    # as coded datagrams (the documented auto policy), and every result stays exact.
    spec = str(mcp.Chaos(loss=0.05, delay=0.02, seed=6))
    results = ok(run("auto_on_long_path", 2, spec, 8, timeout=180))
    for out in results:
        assert out["lane_stats"]["frames_sent"] > 0, out["lane_stats"]
        assert out["lane_stats"]["frames_received"] > 0, out["lane_stats"]
        assert out["corrupt_frames"] == 0
