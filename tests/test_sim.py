"""``mcp-sim`` and ``_core.sim_all_reduce``: the simulator from Python, on small worlds."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

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


def test_a_failed_rank_fails_every_survivor_once_the_detector_finds_it_silent() -> None:
    # Connected at 0, dead at 1 ms before its first keep-alive: its neighbours' detectors
    # (the transport's) pass 2 x 1 s + max(0.25 s, 1.3 x RTT) at their check of 2.5 s, and
    # their aborts reach every survivor within a round trip.
    out = _core.sim_all_reduce(32, "ring", 1e9, fail_rank=5, fail_at_s=1e-3, heartbeat_s=1.0)
    assert out["ok_ranks"] == 0
    assert "rank 5" in out["error"]
    assert 2.5 <= out["elapsed_s"] < 2.51


@pytest.mark.parametrize(
    "kwargs",
    [
        {"world": 0},
        {"algorithm": "butterfly"},
        {"inter_rtt_s": -1.0},
        {"loss": 0.95},
        {"nbytes": 1.0},
        {"fail_rank": 99},
        {"heartbeat_s": 0.0},
        {"cores": 2, "inter_cpu_tx": -1.0},
        {"cores": 2, "intra_cpu_rx": float("nan")},
    ],
)
def test_bad_arguments_are_value_errors(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"world": 4, "algorithm": "ring", "nbytes": 1e6}
    args.update(kwargs)
    world, algorithm, nbytes = args.pop("world"), args.pop("algorithm"), args.pop("nbytes")
    with pytest.raises(ValueError):
        _core.sim_all_reduce(world, algorithm, nbytes, **args)  # type: ignore[arg-type]


def test_frames_cost_processor_time_on_the_cores_the_ranks_share() -> None:
    # Two ranks' ring over a fast link, 1 ns per byte at each end: four cores let the two
    # directions run at once; two cores (both ranks on one machine) make them take turns.
    kw: dict[str, Any] = {"inter_gbps": 1e4, "inter_cpu_tx": 1.0, "inter_cpu_rx": 1.0}
    bare = _core.sim_all_reduce(2, "ring", 64e6, inter_gbps=1e4)["elapsed_s"]
    four = _core.sim_all_reduce(2, "ring", 64e6, cores=4, **kw)["elapsed_s"]
    two = _core.sim_all_reduce(2, "ring", 64e6, cores=2, **kw)["elapsed_s"]
    assert bare < 0.01
    assert four == pytest.approx(64e-3, rel=0.02)  # 2 steps x 32 MB x 1 ns
    assert two == pytest.approx(2 * four, rel=0.02)
    # Without cores the costs are not charged.
    assert _core.sim_all_reduce(2, "ring", 64e6, **kw)["elapsed_s"] == bare


def test_ranks_that_read_their_host_peers_directly_send_only_what_crosses_hosts() -> None:
    # Two hosts of two ranks, hierarchical: as frames, a rank sends half the buffer to its
    # local peer twice and half to the other host; read directly, only the latter (and a
    # few signals), and the copies cost their readers the intra-host processor time.
    kw: dict[str, Any] = {"ranks_per_host": 2, "intra_gbps": 1e4, "inter_gbps": 1e4}
    rings = _core.sim_all_reduce(4, "hierarchical", 64e6, **kw)
    direct = _core.sim_all_reduce(4, "hierarchical", 64e6, direct_reads=True, **kw)
    assert rings["exact"] and direct["exact"]
    assert rings["mean_rank_bytes"] == pytest.approx(96e6, rel=0.01)
    assert direct["mean_rank_bytes"] == pytest.approx(32e6, rel=0.03)
    assert direct["host_card_bytes"] == pytest.approx(rings["host_card_bytes"], rel=1e-3)
    # Each rank copies 64 MB at 1 ns a byte: four cores let the four copy side by side, two
    # take twice as long (the scaled signals cost their receivers a few percent more).
    cpu: dict[str, Any] = {"intra_cpu_rx": 1.0, "direct_reads": True}
    four = _core.sim_all_reduce(4, "hierarchical", 64e6, cores=4, **cpu, **kw)["elapsed_s"]
    two = _core.sim_all_reduce(4, "hierarchical", 64e6, cores=2, **cpu, **kw)["elapsed_s"]
    assert direct["elapsed_s"] < 1e-3
    assert 64e-3 <= four < 64e-3 * 1.05
    assert 128e-3 <= two < 128e-3 * 1.05


@pytest.mark.parametrize("dead", [1, 2])
def test_a_rank_lost_while_its_host_peer_reads_it_fails_every_survivor(dead: int) -> None:
    # Two hosts of two ranks reading each other directly, over a slow card (the operation
    # takes 5.1 s): rank 1 (rank 0's host peer) or rank 2 (on the other host) dies at 1 ms.
    # Every survivor ends in the same named loss when the detectors find it silent, none
    # waits for a signal that never comes.
    kw: dict[str, Any] = {"ranks_per_host": 2, "inter_gbps": 0.1, "direct_reads": True}
    out = _core.sim_all_reduce(
        4, "hierarchical", 64e6, fail_rank=dead, fail_at_s=1e-3, heartbeat_s=1.0, **kw
    )
    assert out["ok_ranks"] == 0
    assert f"peer rank {dead} lost" in out["error"], out["error"]
    assert 2.5 <= out["elapsed_s"] < 2.51


def test_a_rendezvous_takes_a_latency_each_way_and_rank_0s_card_sending_the_tables() -> None:
    # 8 hosts at 8 Gbit/s (1 GB/s), 1 ms RTT: the Hellos arrive half a round trip after the
    # start, rank 0's card sends the 7 tables one after the other, the last lands half a
    # round trip later.
    out = sim._meet(8, 1, inter_gbps=8.0, inter_rtt_s=1e-3)
    assert out["ok_ranks"] == 8 and out["error"] is None
    assert 7 * out["table_bytes"] < out["rank0_bytes"] < 7 * (out["table_bytes"] + 200)
    assert out["elapsed_s"] == pytest.approx(1e-3 + out["rank0_bytes"] / 1e9, abs=2e-6)
    # Beyond --max-meet, two smaller rendezvous predict it (rank 0 sends W - G tables of W
    # lines).
    whole = sim._meet(256, 8, inter_gbps=8.0, inter_rtt_s=1e-3)
    est, note = sim._rendezvous(256, 8, 128, inter_gbps=8.0, inter_rtt_s=1e-3)
    assert note == "~ extrapolated from 128 and 64 ranks"
    assert est["elapsed_s"] == pytest.approx(whole["elapsed_s"], rel=0.05)
    assert est["rank0_bytes"] == pytest.approx(whole["rank0_bytes"], rel=0.05)


@pytest.mark.parametrize("kwargs", [{"world": 0}, {"inter_rtt_s": -1.0}, {"loss": 0.95}])
def test_bad_rendezvous_arguments_are_value_errors(kwargs: dict[str, Any]) -> None:
    args: dict[str, Any] = {"world": 4}
    args.update(kwargs)
    with pytest.raises(ValueError):
        _core.sim_rendezvous(**args)


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
    # The transport's detector at the default 5 s heartbeat: the node dies at 1 ms, before its
    # first keep-alive; its limit is 2 x 5 s + min(1 s, 5 s / 4), passed at the check of 11.25 s
    # (every 1.25 s), and the aborts cross in microseconds.
    assert doc["facts"]["abort_after_failure_s"] == pytest.approx(11.25 - 1e-3, abs=1e-3)
    assert doc["facts"]["rendezvous_s"] > 0 and doc["facts"]["rendezvous_note"] == ""
    # Elastic: the coordinator finds the node silent after its 0.3 s limit, long before the
    # transport's detector; each failure costs that, the new group's rendezvous and a step.
    change = doc["facts"]["epoch_change_s"]
    assert 0.2 < change < 0.31, change
    for r in doc["rows"]:
        per_failure = change + doc["facts"]["rendezvous_s"] + r["step_s"]
        failures = 4 * 0.05 * (50 * r["step_s"] + r["checkpoint_s"]) / sim.DAY_S
        assert r["failure_s"] == pytest.approx(failures * per_failure)


def test_a_node_lost_by_an_elastic_job_is_replaced_by_the_next_epoch_within_the_silence_limit() -> (
    None
):
    # 8 hosts of 4 members and the coordinator; the members of host 4 die 1 ms into the first
    # epoch, between two heartbeats (every 0.1 s): the coordinator declares them dead 0.3 s
    # after it last heard them, 0.2-0.3 s after their death, and forms the next epoch of the
    # 28 survivors, which every survivor holds within a few hundred microseconds.
    out = _core.sim_membership_change(32, ranks_per_host=4, heartbeat_s=0.1, dead_after_s=0.3)
    assert out["error"] is None and out["agreed"] is True
    assert 0.2 <= out["change_s"] <= 0.301, out
    # A collective that fails earlier changes nothing: the epoch waits for the silence limit.
    early = _core.sim_membership_change(32, ranks_per_host=4, fails_after_s=0.01)
    assert early["change_s"] == pytest.approx(out["change_s"], abs=1e-3)
    # A faster coordinator limit, a faster change.
    fast = _core.sim_membership_change(32, ranks_per_host=4, heartbeat_s=0.02, dead_after_s=0.06)
    assert 0.04 <= fast["change_s"] <= 0.061, fast
    # The coordinator sends every member the first epoch whole (16 bytes per member), and the
    # survivors the next as the change from it: 248 of 256 survivors would take 984 kB whole.
    big = _core.sim_membership_change(256, ranks_per_host=8)
    assert big["agreed"] is True and big["coordinator_bytes"] > 256 * 256 * 16, big
    assert 248 * 16 < big["change_coordinator_bytes"] < 248 * 248 * 16 / 4, big


@pytest.mark.parametrize(
    "kwargs",
    [
        {"members": 30, "ranks_per_host": 4},
        {"members": 4, "ranks_per_host": 4},
        {"members": 8, "ranks_per_host": 0},
        {"members": 8, "dead_after_s": -1.0},
        {"members": 8, "heartbeat_s": float("nan")},
    ],
)
def test_bad_membership_change_arguments_are_value_errors(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        _core.sim_membership_change(**kwargs)


def test_the_cli_refuses_bad_settings(capsys: pytest.CaptureFixture[str]) -> None:
    assert sim.main(["--nodes", "0"]) == 2
    assert "--nodes must be at least 1" in capsys.readouterr().err
    assert sim.main(["--loss", "0.99", "--nodes", "2", "--gpus-per-node", "1"]) == 2
    assert "loss" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        sim.main(["--help"])
    assert e.value.code == 0
    assert "--preset" in capsys.readouterr().out


# --- mcp-sim validate: the simulator against the benchmarks' measurements ----------------

DATA = Path(__file__).resolve().parents[1] / "docs" / "data" / "validation"


def test_an_overhead_per_frame_delays_a_single_exchange_by_exactly_itself() -> None:
    kw: dict[str, Any] = {"inter_gbps": 3.2, "inter_rtt_s": 28e-6}
    plain = _core.sim_all_reduce(2, "auto", 4096.0, **kw)
    slow = _core.sim_all_reduce(2, "auto", 4096.0, inter_overhead_s=150e-6, **kw)
    assert plain["algorithm"] == slow["algorithm"] == "recursive_doubling"
    assert slow["elapsed_s"] - plain["elapsed_s"] == pytest.approx(150e-6, abs=1e-9)
    big = _core.sim_all_reduce(4, "auto", 1 << 20, ranks_per_host=2, **kw)
    assert big["algorithm"] == "hierarchical" and big["exact"]
    with pytest.raises(ValueError):
        _core.sim_all_reduce(2, "ring", 4096.0, inter_overhead_s=-1.0)


def test_a_shaped_link_passes_its_burst_before_it_holds_the_rate() -> None:
    """tbf's bucket: a transfer that fits the burst leaves at the line's speed; a long one
    pays the rate for what exceeds it; a shaper without a line faster than its rate is
    refused."""
    kw = dict(inter_gbps=1.0, inter_rtt_s=50e-6)
    plain = _core.sim_all_reduce(2, "ring", 8 << 20, **kw)["elapsed_s"]
    shaped = _core.sim_all_reduce(
        2, "ring", 8 << 20, inter_burst_bytes=1 << 20, inter_peak_gbps=100.0, **kw
    )["elapsed_s"]
    # A 2-rank ring sends the tensor once each way: 1 MiB of it at 100 Gbit/s, not 1 Gbit/s.
    saved = (1 << 20) * 8 / 1e9 * (1 - 1 / 100)
    assert plain - shaped == pytest.approx(saved, rel=0.02)
    with pytest.raises(ValueError, match="peak"):
        _core.sim_all_reduce(2, "ring", 4096.0, inter_burst_bytes=1e5, **kw)


def test_validate_predicts_every_measured_row_from_the_shipped_data() -> None:
    v = sim.validate(DATA)
    docs = {n: json.loads((DATA / f"{n}.json").read_text()) for n in sim.DATA_FILES}
    want = [("hosts_clean", r["mcp_s"]) for r in docs["hosts_clean"]["rows"]]
    want += [("hosts_1gbit", r["mcp_s"]) for r in docs["hosts_1gbit"]["rows"]]
    want += [("loss", r["auto"]) for r in docs["loss"]["rows"]]
    assert [(r.source, r.measured_s) for r in v.rows] == want
    for r in v.rows:
        assert math.isfinite(r.predicted_s) and r.predicted_s > 0, r
        assert r.error == pytest.approx((r.predicted_s - r.measured_s) / r.measured_s)
        assert r.within == (abs(r.error) <= sim.TOLERANCE)
    # The algorithm a real group picks: recursive doubling up to 64 KiB, then the ring with
    # one rank per host and the hierarchical all-reduce with two.
    for r in v.rows:
        if r.nbytes <= 64 << 10:
            assert r.algorithm == "recursive_doubling", r
        else:
            assert r.algorithm == ("hierarchical" if r.ranks_per_host > 1 else "ring"), r
    # Three rows lent a calibration figure; they are not counted as predictions.
    fits = [r for r in v.rows if r.role == "fit"]
    assert [(r.source, r.world, r.nbytes, r.loss) for r in fits] == [
        ("hosts_clean", 2, 4096, 0.0),
        ("hosts_clean", 4, 4096, 0.0),
        ("loss", 2, 16 << 20, 0.0),
    ]
    assert len(v.predictions()) == len(v.rows) - 3
    assert v.within() == sum(r.within for r in v.predictions())


def test_the_calibration_is_what_the_measurement_files_say() -> None:
    v = sim.validate(DATA)
    c = v.calibration
    clean = json.loads((DATA / "hosts_clean.json").read_text())["meta"]
    capped = json.loads((DATA / "hosts_1gbit.json").read_text())["meta"]
    assert c.cores == clean["cpus"]
    # Plain quinn both ways: 2 directions x 2 ends x c per byte on the shared cores.
    both = clean["quic_both_ways_gbit_s"] * 1e9 / 8
    assert c.quic_cpu_ns == pytest.approx(1e9 * c.cores / 4 / both, rel=1e-12)
    assert c.app_cpu_ns == pytest.approx(
        c.quic_cpu_ns * sim.APP_CPU_SHARE / (1 - sim.APP_CPU_SHARE), rel=1e-12
    )
    assert c.veth_rtt_s == clean["ping_median_s"]
    assert c.veth_1g_gbps == capped["quic_both_ways_gbit_s"]
    assert c.veth_1g_rtt_s == capped["ping_median_s"]
    assert c.veth_1g_burst_bytes == capped["tbf_burst_bytes"] == 256 * 1024
    assert c.shm_gbps == sim.SHM_GBPS
    # Every fitted row is reproduced by its own figure.
    for r in v.rows:
        if r.role == "fit":
            assert r.predicted_s == pytest.approx(r.measured_s, rel=1e-3), r


def test_the_processor_model_predicts_plain_quinn_one_way_from_both_ways() -> None:
    """The model's check on itself: calibrated from plain quinn running both ways at once, it
    predicts plain quinn one way (one sender, one receiver) as the benchmark measured it."""
    c = sim.validate(DATA).calibration
    clean = json.loads((DATA / "hosts_clean.json").read_text())["meta"]
    one_way_gbps = 8 / c.quic_cpu_ns  # each end on its own core: one byte per c
    assert one_way_gbps == pytest.approx(clean["quic_gbit_s"], rel=0.15)


def test_validate_is_a_pure_function_of_its_data_and_seed() -> None:
    a, b = sim.validate(DATA, seed=3), sim.validate(DATA, seed=3)
    assert [r.predicted_s for r in a.rows] == [r.predicted_s for r in b.rows]
    c = sim.validate(DATA, seed=4)
    clean = [i for i, r in enumerate(a.rows) if r.loss == 0]
    lossy = [i for i, r in enumerate(a.rows) if r.loss > 0]
    assert all(a.rows[i].predicted_s == c.rows[i].predicted_s for i in clean)
    assert any(a.rows[i].predicted_s != c.rows[i].predicted_s for i in lossy)


def test_the_validate_command_prints_and_writes_its_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "v.json"
    assert sim.main(["validate", "--data", str(DATA), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "software overhead per frame" in text and "predictions within 15%" in text
    assert "cores shared by every rank" in text
    doc = json.loads(out.read_text())
    assert len(doc["rows"]) == 34 and doc["predictions"] == 31
    assert doc["within"] == sum(r["within"] for r in doc["rows"] if r["role"] == "prediction")


def test_validate_refuses_a_missing_or_broken_data_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match="no measurement directory"):
        sim.validate(tmp_path / "nowhere")
    assert sim.main(["validate", "--data", str(tmp_path / "nowhere")]) == 2
    assert "mcp-sim validate: error: no measurement directory" in capsys.readouterr().err
    for name in ("hosts_clean", "hosts_1gbit"):
        shutil.copy(DATA / f"{name}.json", tmp_path)
    with pytest.raises(ValueError, match=r"loss\.json"):
        sim.validate(tmp_path)
    (tmp_path / "loss.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        sim.validate(tmp_path)
    (tmp_path / "loss.json").write_text('{"rows": [1]}')
    with pytest.raises(ValueError, match="no rows"):
        sim.validate(tmp_path)
    doc = json.loads((DATA / "hosts_clean.json").read_text())
    del doc["meta"]["quic_both_ways_gbit_s"]
    (tmp_path / "hosts_clean.json").write_text(json.dumps(doc))
    shutil.copy(DATA / "loss.json", tmp_path)
    with pytest.raises(ValueError, match="quic_both_ways_gbit_s"):
        sim.validate(tmp_path)
    doc = json.loads((DATA / "hosts_clean.json").read_text())
    del doc["meta"]["cpus"]
    (tmp_path / "hosts_clean.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="cpus"):
        sim.validate(tmp_path)
    with pytest.raises(ValueError, match="shm"):
        sim.validate(DATA, shm_gbps=0.0)
