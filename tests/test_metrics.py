"""mcp_fast.metrics (snapshot, Prometheus exporter), mcp-monitor and mcp-diag network."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from _launch import free_port, ok, run
from mcp_fast import metrics
from mcp_fast.cli import monitor

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _quic_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests exercise QUIC itself: ranks of this host stay off shared memory."""
    monkeypatch.setenv("MCP_SHM", "0")


TRANSPORT = {
    "frames_sent",
    "frames_received",
    "bytes_sent",
    "bytes_received",
    "corrupt_frames",
    "retransmits",
    "refused_handshakes",
    "quic_sent_packets",
    "quic_lost_packets",
    "reconnects",
    "resumed_frames",
    "zero_rtt_accepted",
    "zero_rtt_rejected",
    "duplicate_frames",
    "last_reconnect_us",
}


def _cli(module: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", f"mcp_fast.cli.{module}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(30)
def test_snapshot_after_collectives_in_two_ranks():
    res = ok(run("metrics_workers.snapshot_after_collectives", 2, timeout=25))
    for rank, r in enumerate(res):
        assert [g["rank"] for g in r["all"]["groups"]] == [rank]  # the one live group
        assert r["all"]["pid"] == r["mine"]["pid"] and r["all"]["timestamp"] > 1.6e9
        g = r["mine"]["groups"][0]
        assert (g["rank"], g["world_size"], g["open"]) == (rank, 2, True)
        assert set(g["transport"]) == TRANSPORT
        assert g["transport"]["bytes_sent"] > 4 * (1 << 16)
        assert g["transport"]["bytes_received"] > 4 * (1 << 16)
        assert g["transport"]["frames_sent"] > 0 and g["transport"]["corrupt_frames"] == 0
        assert g["transport"]["quic_sent_packets"] > 0
        assert g["path"][1 - rank]["sent_packets"] > 0 and g["path"][1 - rank]["cwnd"] > 0
        peer = 1 - rank
        assert list(g["rtt"]) == [peer]
        assert 0 < g["rtt"][peer] < 1.0
        assert g["chaos"] == {}
        assert g["ops"]["all_reduce"] == {"started": 4, "ok": 4, "failed": 0}
        assert g["ops"]["broadcast"] == {"started": 2, "ok": 1, "failed": 1}
        assert g["ops"]["barrier"] == {"started": 1, "ok": 1, "failed": 0}
        p2p = "send" if rank == 0 else "recv"
        assert g["ops"][p2p] == {"started": 1, "ok": 1, "failed": 0}
        # after close: counters of Python survive, the transport is gone
        c = r["closed"]["groups"][0]
        assert c["open"] is False and c["transport"] == {} and c["rtt"] == {}
        assert c["ops"]["barrier"]["ok"] == 2
        assert r["live_after"]["groups"] == []


def test_render_without_groups_and_escaping():
    snap = {
        "timestamp": 0.0,
        "pid": 1,
        "groups": [
            {
                "rank": 0,
                "world_size": 2,
                "open": True,
                "transport": {"bytes_sent": 10},
                "rtt": {1: None},
                "chaos": {"send_dropped": 3},
                "ops": {"send": {"started": 1, "ok": 0, "failed": 1}},
            }
        ],
    }
    text = metrics.render(snap)
    assert 'mcp_bytes_sent_total{rank="0"} 10' in text
    assert 'mcp_peer_connected{rank="0",peer="1"} 0' in text
    assert "mcp_peer_rtt_seconds{" not in text  # not connected: no sample
    assert 'mcp_chaos_send_dropped_total{rank="0"} 3' in text
    assert 'mcp_ops_total{rank="0",op="send",result="failed"} 1' in text
    parsed = monitor.parse_text(text)
    assert parsed[("mcp_world_size", (("rank", "0"),))] == 2
    assert metrics.render({"timestamp": 0, "pid": 1, "groups": []}) == "\n"
    # several groups in one process: a group label tells them apart
    two = metrics.render({**snap, "groups": [snap["groups"][0], snap["groups"][0]]})
    assert 'mcp_bytes_sent_total{rank="0",group="1"} 10' in two


def test_monitor_table_marks_a_down_endpoint():
    def text(sent_bytes: int, packets: int, lost: int) -> str:
        path = {"sent_packets": packets, "lost_packets": lost, "lost_bytes": 1200 * lost}
        path.update(congestion_events=1, cwnd=12000, mtu=1200)
        group = {"rank": 1, "world_size": 2, "open": True, "rtt": {0: 0.0025}, "chaos": {}}
        group.update(transport={"bytes_sent": sent_bytes, "bytes_received": 0}, ops={})
        group["path"] = {0: path}
        return metrics.render({"timestamp": 0.0, "pid": 1, "groups": [group]})

    s0 = monitor._Scrape(0.0, monitor.parse_text(text(3_000_000, 100, 2)))
    s1 = monitor._Scrape(1.0, monitor.parse_text(text(5_000_000, 300, 12)))
    rows = monitor.table(
        ["u", "v"],
        {"u": s0, "v": s0},
        {"u": s0, "v": s0},
        {"u": s1, "v": monitor._Scrape(1.0, None)},
    )
    # QUIC's loss since the first scrape: 10 of 200 packets.
    assert rows[1].split() == [
        "1",
        "0",
        "2.500",
        "2.00",
        "0.00",
        "0",
        "-",
        "2.500",
        "2.500",
        "5.00",
        "u",
    ]
    assert rows[2].split() == ["?", "-", "DOWN", "v"]


# ---- a running 2-rank job with exporters ----------------------------------------------------


@pytest.fixture(scope="module")
def exporters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Two ranks under a light fault injector serving metrics: rank 0 with prometheus_client
    (when installed), rank 1 with the built-in server. Yields their URLs; stops them at the
    end of the module."""
    d = tmp_path_factory.mktemp("exporters")
    out: dict[str, Any] = {}

    def job() -> None:
        try:
            out["res"] = run(
                "metrics_workers.serve_metrics",
                2,
                str(d),
                40.0,
                timeout=55,
                env={"MCP_CHAOS": "loss=0.02,seed=3"},  # fault counters show up too
            )
        except BaseException as e:
            out["err"] = e

    t = threading.Thread(target=job, daemon=True)
    t.start()
    deadline = time.monotonic() + 25
    ports = [d / f"{r}.port" for r in range(2)]
    while not all(p.exists() for p in ports):
        assert time.monotonic() < deadline, f"exporters did not start: {out}"
        assert t.is_alive(), f"ranks ended early: {out}"
        time.sleep(0.05)
    try:
        yield [f"http://{p.read_text()}/metrics" for p in ports]
    finally:
        (d / "stop").write_text("")
        t.join(30)
    assert "err" not in out, out.get("err")
    ok(out["res"])


def _get(url: str) -> tuple[str, str]:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.headers["Content-Type"], r.read().decode()


_EXPECTED = [
    "mcp_bytes_sent_total",
    "mcp_bytes_received_total",
    "mcp_frames_sent_total",
    "mcp_corrupt_frames_total",
    "mcp_retransmits_total",
    "mcp_peer_rtt_seconds",
    "mcp_peer_sent_packets_total",
    "mcp_peer_lost_packets_total",
    "mcp_peer_cwnd_bytes",
    "mcp_peer_mtu_bytes",
    "mcp_peer_connected",
    "mcp_ops_total",
    "mcp_ops_started_total",
    "mcp_world_size",
    "mcp_chaos_send_dropped_total",
    "mcp_chaos_sent_total",
]


def _parse(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        for (name, labels), v in monitor.parse_text(text).items():
            samples.setdefault(name, []).append((dict(labels), v))
        return samples
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return samples


@pytest.mark.timeout(30)
def test_exporters_serve_prometheus_text(exporters):
    for rank, url in enumerate(exporters):
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", url)
        ctype, text = _get(url)
        assert ctype.startswith("text/plain")
        s = _parse(text)
        for name in _EXPECTED:
            assert name in s, f"{name} missing from rank {rank}'s metrics:\n{text}"
        [(labels, sent)] = s["mcp_bytes_sent_total"]
        assert labels == {"rank": str(rank)} and sent > 4 * (1 << 16)
        [(labels, resent)] = s["mcp_retransmits_total"]
        assert labels == {"rank": str(rank), "reason": "checksum"} and resent == 0
        [(labels, rtt)] = s["mcp_peer_rtt_seconds"]
        assert labels == {"rank": str(rank), "peer": str(1 - rank)} and 0 < rtt < 1
        ops = {(lab["op"], lab["result"]): v for lab, v in s["mcp_ops_total"]}
        assert ops[("all_reduce", "ok")] == 4 and ops[("broadcast", "failed")] == 1
        assert all(lab["rank"] == str(rank) for lab, _ in s["mcp_ops_total"])
    # the same metric names and label sets from both servers
    a, b = (_parse(_get(u)[1]) for u in exporters)
    assert set(a) == set(b)


def test_exporter_404_and_single_instance(exporters):
    base = exporters[1].rsplit("/", 1)[0]  # the built-in server (prometheus_client's
    # serves its metrics on any path)
    with pytest.raises(urllib.error.HTTPError) as e:
        _get(base + "/nothing")
    assert e.value.code == 404
    e.value.close()
    host, port = metrics.start_exporter(use_prometheus_client=False)
    try:
        assert host == "127.0.0.1" and port > 0
        with pytest.raises(RuntimeError, match="already runs"):
            metrics.start_exporter()
        assert _get(f"http://{host}:{port}/metrics")[1] == "\n"  # no group in this process
    finally:
        metrics.stop_exporter()
    metrics.stop_exporter()  # twice is fine


@pytest.mark.timeout(30)
def test_monitor_prints_a_table(exporters):
    short = exporters[1].removeprefix("http://").removesuffix("/metrics")
    r = _cli(
        "monitor",
        "--latency",
        "--url",
        exporters[0],
        "--url",
        short,
        "--count",
        "2",
        "--interval",
        "0.2",
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert sum(line.startswith("mcp-monitor") for line in lines) == 2
    assert sum("RTT_MS" in line for line in lines) == 2
    rows = [line.split() for line in lines if re.match(r"\s+\d+\s+\d+\s", line)]
    assert {(row[0], row[1]) for row in rows} == {("0", "1"), ("1", "0")}
    for row in rows:
        assert 0 < float(row[2]) < 1000  # RTT in ms
        assert row[5] == "0" and int(row[6]) >= 0  # no errors; drops since the first scrape
        assert row[9] == "-" or 0 <= float(row[9]) <= 100  # QUIC loss % (no traffic: -)


@pytest.mark.timeout(60)
def test_monitor_finds_the_job_by_itself(exporters, monkeypatch):
    """No --url: MCP_METRICS_URLS, else the exporters registered on this host; the latency
    view's p50 and p99 are over the tables so far."""
    assert set(exporters) <= set(metrics.discover_exporters())
    for env in ({"MCP_METRICS_URLS": ", ".join(exporters)}, {}):
        monkeypatch.delenv("MCP_METRICS_URLS", raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        r = _cli("monitor", "--latency", "--count", "3", "--interval", "0.2")
        assert r.returncode == 0, r.stderr
        rows = [line.split() for line in r.stdout.splitlines() if re.match(r"\s+\d+\s+\d+\s", line)]
        ours = [row for row in rows if row[-1] in exporters]
        assert {(row[0], row[1]) for row in ours} == {("0", "1"), ("1", "0")}, r.stdout
        for row in ours:
            assert 0 < float(row[7]) <= float(row[8]) < 1000  # p50 <= p99, in ms


def test_exporters_register_and_stale_entries_are_dropped(tmp_path, monkeypatch):
    monkeypatch.setenv("MCP_METRICS_DIR", str(tmp_path))
    (tmp_path / "999999999-1.url").write_text("http://127.0.0.1:1/metrics\n")  # a dead pid
    assert metrics.discover_exporters() == []
    assert list(tmp_path.iterdir()) == []
    host, port = metrics.start_exporter(use_prometheus_client=False)
    try:
        assert metrics.discover_exporters() == [f"http://{host}:{port}/metrics"]
    finally:
        metrics.stop_exporter()
    assert metrics.discover_exporters() == [] and list(tmp_path.iterdir()) == []


def test_monitor_unreachable_exits_2(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MCP_METRICS_DIR", str(tmp_path))  # nothing registered
    monkeypatch.delenv("MCP_METRICS_URLS", raising=False)
    url = f"http://127.0.0.1:{free_port()}/metrics"
    assert monitor.main(["--url", url, "--count", "1", "--timeout", "1"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach" in err and url in err
    assert monitor.main(["--count", "1"]) == 2
    assert "--url" in capsys.readouterr().err


def test_monitor_parse_errors():
    with pytest.raises(ValueError, match="not a Prometheus sample"):
        monitor.parse_text("this is not it\n")
    assert monitor.normalize_url("127.0.0.1:9") == "http://127.0.0.1:9/metrics"
    assert monitor.normalize_url("http://h:9/x") == "http://h:9/x"
    labels = (("a", 'x"y\\'),)
    assert monitor.parse_text('m{a="x\\"y\\\\"} 1.5\n') == {("m", labels): 1.5}


@pytest.mark.timeout(30)
def test_diag_network_two_processes():
    port = str(free_port())
    cmd = ["network", "--world", "2", "--master", f"127.0.0.1:{port}", "--size", "1MiB"]
    cmd += ["--count", "5", "--timeout", "20", "--secret", "test-secret"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "mcp_fast.cli.diag", *cmd, "--rank", str(r)]
            + (["--json"] if r == 1 else []),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=25))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    human, js = outs[0][0], json.loads(outs[1][0])
    assert "RTT (4 B all-reduce)" in human and "p99" in human
    assert "bandwidth" in human and "MB/s" in human and "loss hints" in human
    assert "QUIC lost" in human and "packets" in human
    assert js["rank"] == 1 and js["size"] == 1 << 20 and js["count"] == 5
    assert 0 < js["latency_p50_s"] <= js["latency_p99_s"] < 5
    assert js["algbw_Bps"] > 0 and js["busbw_Bps"] == pytest.approx(js["algbw_Bps"])
    assert 0 < js["rtt_s"]["0"] < 1
    assert js["transport"]["bytes_sent"] >= 5 * (1 << 20)
    assert js["transport"]["quic_sent_packets"] > 0


def test_diag_network_bad_arguments(capsys):
    from mcp_fast.cli import diag

    assert diag.main(["network", "--rank", "2", "--world", "2", "--master", "h:1"]) == 2
    assert "not a rank" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        diag.main(["network", "--rank", "0", "--world", "2", "--master", "nohostport"])
    assert e.value.code == 2


@pytest.mark.parametrize(
    ("module", "words"),
    [
        ("monitor", ["mcp-monitor", "--latency", "--url", "--count"]),
        ("diag", ["mcp-diag", "disk", "network"]),
    ],
)
def test_help(module, words):
    r = _cli(module, "--help")
    assert r.returncode == 0, r.stderr
    for w in words:
        assert w in r.stdout


def test_diag_network_help():
    r = _cli("diag", "network", "--help")
    assert r.returncode == 0, r.stderr
    for w in ["--rank", "--world", "--master", "--secret", "--size", "--count"]:
        assert w in r.stdout
