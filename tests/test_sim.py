"""``mcp-sim`` and ``_core.sim_all_reduce``: the simulator from Python, on small worlds."""

from __future__ import annotations

import json

import pytest

from mcp_fast import _core
from mcp_fast.cli import sim


def test_a_ring_on_a_clean_link_takes_what_the_pipelined_formula_says() -> None:
    # 8 hosts, 8 Gbit/s (1 GB/s), 1 ms RTT, 64 MB: 2(W-1) segment times plus one latency.
    out = _core.sim_all_reduce(8, "ring", 64e6, inter_gbps=8.0, inter_rtt_s=1e-3)
    assert out["error"] is None and out["exact"] and out["ok_ranks"] == 8
    formula = 14 * (64e6 / 8 / 1e9) + 0.5e-3
    assert out["elapsed_s"] == pytest.approx(formula, rel=1e-3)
    assert out["host_card_bytes"] == pytest.approx(64e6 * 14 / 8, rel=1e-3)


def test_a_failed_rank_fails_every_survivor_after_the_detector_timeout() -> None:
    out = _core.sim_all_reduce(32, "ring", 1e9, fail_rank=5, fail_at_s=1e-3, detect_s=2.0)
    assert out["ok_ranks"] == 0
    assert "peer rank 5 lost" in out["error"] or "rank 5 failed" in out["error"]
    assert 2.0 <= out["elapsed_s"] < 3.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"world": 0},
        {"algorithm": "butterfly"},
        {"inter_rtt_s": -1.0},
        {"loss": 0.95},
        {"nbytes": 1.0},
        {"fail_rank": 99},
    ],
)
def test_bad_arguments_are_value_errors(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"world": 4, "algorithm": "ring", "nbytes": 1e6}
    args.update(kwargs)
    world, algorithm, nbytes = args.pop("world"), args.pop("algorithm"), args.pop("nbytes")
    with pytest.raises(ValueError):
        _core.sim_all_reduce(world, algorithm, nbytes, **args)  # type: ignore[arg-type]


def test_the_cli_prints_every_strategy_and_its_arithmetic_holds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--nodes", "4", "--gpus-per-node", "2", "--params", "1e7", "--dtype", "fp32"]
    argv += ["--steps", "50", "--diloco-h", "8", "--json"]
    assert sim.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["strategy"]: r for r in doc["rows"]}
    for name in [
        "flat ring",
        "flat tree",
        "hierarchical",
        "hierarchical + fp16",
        "hierarchical + int8",
    ]:
        assert name in rows, rows.keys()
    hier = rows["hierarchical"]
    diloco = rows["DiLoCo H=8 (hierarchical)"]
    assert diloco["comm_s"] == pytest.approx(hier["comm_s"] / 8)
    # fp16 halves what crosses the cards; int8 takes about a quarter.
    ratio16 = rows["hierarchical + fp16"]["bytes_per_node"] / hier["bytes_per_node"]
    ratio8 = rows["hierarchical + int8"]["bytes_per_node"] / hier["bytes_per_node"]
    assert ratio16 == pytest.approx(0.5, abs=0.01)
    assert 0.25 < ratio8 < 0.28
    for r in doc["rows"]:
        base = 50 * r["step_s"] + r["checkpoint_s"]
        assert r["training_s"] == pytest.approx(base + r["failure_s"])
        assert r["fits"] == (r["trainings_per_day"] >= 100)
    assert doc["facts"]["abort_after_failure_s"] == pytest.approx(15.0, abs=0.5)


def test_the_cli_refuses_bad_settings(capsys: pytest.CaptureFixture[str]) -> None:
    assert sim.main(["--nodes", "0"]) == 2
    assert "--nodes must be at least 1" in capsys.readouterr().err
    assert sim.main(["--loss", "0.99", "--nodes", "2", "--gpus-per-node", "1"]) == 2
    assert "loss" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        sim.main(["--help"])
    assert e.value.code == 0
    assert "--preset" in capsys.readouterr().out
