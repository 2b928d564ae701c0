"""The command-line tools: mcp-diag and mcp-chaos."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from mcp_fast.cli import chaos, diag, parse_size

_NETNS = os.geteuid() == 0 and all(shutil.which(t) for t in ("ip", "nft", "tc"))
netns = pytest.mark.skipif(not _NETNS, reason="needs root, ip, tc and nft")


def test_ci_as_root_runs_the_lossy_link_tests() -> None:
    # `make test` installs nftables and iproute2 when it runs as root: in CI (root) the
    # lossy-link tests must run, not be skipped.
    if os.environ.get("CI") == "true" and os.geteuid() == 0:
        assert _NETNS, "root in CI without ip, tc or nft: make test should have installed them"


def _cli(
    module: str, *args: str, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", f"mcp_fast.cli.{module}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _cli_pid(module: str, *args: str, timeout: float = 60) -> tuple[int, int]:
    """Runs a CLI; returns its exit code and its pid (mcp-chaos names its namespace after it)."""
    with subprocess.Popen(
        [sys.executable, "-m", f"mcp_fast.cli.{module}", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    ) as p:
        try:
            return p.wait(timeout=timeout), p.pid
        finally:
            if p.poll() is None:
                p.kill()


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.mark.parametrize("module", ["diag", "chaos"])
def test_help(module):
    r = _cli(module, "--help")
    assert r.returncode == 0, r.stderr
    assert f"mcp-{module}" in r.stdout
    assert "--loss" in r.stdout if module == "chaos" else "disk" in r.stdout


def test_parse_size():
    assert parse_size("4MiB") == 4 << 20
    assert parse_size("256kb") == 256_000
    assert parse_size("4096") == 4096
    assert parse_size("1.5k") == 1500
    for bad in ["", "4XB", "-1", "MiB"]:
        with pytest.raises(ValueError, match="not a size"):
            parse_size(bad)


def test_diag_disk_reports_numbers_and_cleans_up(tmp_path):
    r = _cli("diag", "disk", "--path", str(tmp_path), "--size", "64KiB", "--count", "20", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["size"] == 65536 and out["count"] == 20
    assert 0 < out["p50_s"] <= out["p99_s"] <= out["max_s"] < 60
    assert out["throughput_Bps"] > 0
    assert list(tmp_path.iterdir()) == []


def test_diag_disk_human_output(tmp_path, capsys):
    assert diag.main(["disk", "--path", str(tmp_path), "--size", "4k", "--count", "3"]) == 0
    out = capsys.readouterr().out
    assert "p99" in out and "MB/s" in out


def test_diag_disk_errors_exit_2(tmp_path, capsys):
    assert diag.main(["disk", "--path", str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        diag.main(["disk", "--path", str(tmp_path), "--size", "lots"])
    assert e.value.code == 2


def test_diag_documents_disk_form_shows_latency_percentiles(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --path defaults to the current directory
    assert diag.main(["--disk", "--latency", "--size", "4k", "--count", "5"]) == 0
    out = capsys.readouterr().out
    assert f"disk {tmp_path}" in out and "p90" in out and "MB/s" not in out
    assert list(tmp_path.iterdir()) == []


def _free_udp_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_diag_documents_network_form_counts_quic_packets_per_peer() -> None:
    """``mcp-diag --network --packet-loss`` with torchrun's environment, on two ranks under a
    fault injector that drops 10 %: QUIC's own counts show the loss per peer."""
    port = _free_udp_port()
    args = ["--network", "--packet-loss", "--size", "1MiB", "--count", "5", "--json"]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
        env.update(MASTER_PORT=str(port), MCP_CHAOS=f"loss=0.1,seed={rank + 1}")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "mcp_fast.cli.diag", *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
        assert p.returncode == 0, err
        outs.append(json.loads(out))
    for rank, r in enumerate(outs):
        peer = r["peers"][str(1 - rank)]
        assert r["rank"] == rank and peer["sent_packets"] > 0, r
        assert 0 < peer["lost_packets"] < peer["sent_packets"], r  # 10 % of datagrams dropped
        assert peer["loss"] == pytest.approx(peer["lost_packets"] / peer["sent_packets"])
        assert peer["mtu"] > 0 and peer["cwnd"] > 0


def test_diag_network_without_rank_or_environment_says_what_is_missing(capsys, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    assert diag.main(["--network", "--packet-loss"]) == 2
    assert "network needs --rank (or RANK in the environment)" in capsys.readouterr().err


def test_chaos_not_root_exits_2_with_a_clear_message(monkeypatch, capsys):
    monkeypatch.setattr(chaos.shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    monkeypatch.setattr(chaos.os, "geteuid", lambda: 1000)
    assert chaos.main(["--loss", "0.1", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert "needs root" in err and "sudo" in err and "Traceback" not in err


def test_chaos_missing_nft_exits_2_naming_the_package(monkeypatch, capsys):
    monkeypatch.setattr(chaos.shutil, "which", lambda tool: None if tool == "nft" else tool)
    monkeypatch.setattr(chaos.os, "geteuid", lambda: 0)
    assert chaos.main(["--loss", "0.1", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert "nft" in err and "apt-get install -y nftables" in err
    # Without --loss, nft is not needed: the next check (root) is reached instead.
    monkeypatch.setattr(chaos.os, "geteuid", lambda: 1000)
    assert chaos.main(["--rate", "1gbit", "--", "true"]) == 2
    assert "needs root" in capsys.readouterr().err


def test_chaos_argument_errors(capsys):
    assert chaos.main([]) == 2
    assert "no command" in capsys.readouterr().err
    for bad in (["--loss", "1.5", "--", "true"], ["--rate", "fast", "--", "true"]):
        with pytest.raises(SystemExit) as e:
            chaos.main(bad)
        assert e.value.code == 2


# Sends N datagrams to itself on 127.0.0.1, draining after each send, and prints the loss.
_LOSS_PROBE = textwrap.dedent(
    """
    import socket, time
    N = 2000
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.setblocking(False)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    got = 0
    def drain():
        global got
        for _ in range(N):
            try:
                rx.recv(64)
            except BlockingIOError:
                return
            got += 1
    for i in range(N):
        try:
            tx.sendto(i.to_bytes(4, "big"), rx.getsockname())
        except PermissionError:  # dropped by nftables on the output hook
            pass
        drain()
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and got < N:
        drain()
        time.sleep(0.01)
    print(f"LOSS {1 - got / N:.4f}")
    """
)


@pytest.mark.netns
@netns
@pytest.mark.parametrize("hook", ["output", "input"])
@pytest.mark.parametrize(("loss", "low", "high"), [(0.3, 0.2, 0.4), (0.0, 0.0, 0.0)])
def test_chaos_drops_the_asked_fraction_of_loopback_datagrams(loss, low, high, hook):
    args = ["--loss", str(loss), "--hook", hook, "--rate", "1gbit"]
    r = _cli("chaos", *args, "--", sys.executable, "-c", _LOSS_PROBE)
    assert r.returncode == 0, r.stderr
    observed = float(r.stdout.split("LOSS")[1])
    assert low <= observed <= high, observed


@pytest.mark.netns
@netns
def test_chaos_keeps_ranks_off_shared_memory_unless_asked() -> None:
    """The ranks under one-namespace mcp-chaos share a host: shared memory would carry their
    frames around the lossy link, so CMD gets MCP_SHM=0 unless the caller set MCP_SHM."""
    show = [sys.executable, "-c", "import os; print('SHM', os.environ.get('MCP_SHM'))"]
    env = {k: v for k, v in os.environ.items() if k != "MCP_SHM"}
    r = _cli("chaos", "--loss", "0.1", "--", *show, env=env)
    assert r.returncode == 0 and "SHM 0" in r.stdout, (r.stdout, r.stderr)
    r = _cli("chaos", "--loss", "0.1", "--", *show, env={**env, "MCP_SHM": "1"})
    assert r.returncode == 0 and "SHM 1" in r.stdout, (r.stdout, r.stderr)


@pytest.mark.netns
@netns
def test_chaos_propagates_the_exit_code_and_removes_the_namespace():
    runs = [
        _cli_pid("chaos", "--loss", "0.1", "--", sys.executable, "-c", "import sys; sys.exit(7)"),
        _cli_pid("chaos", "--", "/nonexistent/cmd"),
        _cli_pid("chaos", "--timeout", "0.5", "--", "sleep", "30"),
    ]
    codes = [code for code, _ in runs]
    assert codes[0] == 7 and codes[1] not in (0, 7) and codes[2] == 124, codes
    # Only our own runs' namespaces: other jobs on the machine may hold theirs.
    left = _namespaces().split()
    assert not [pid for _, pid in runs if f"mcpchaos-{pid}" in left], left


@pytest.mark.netns
@netns
def test_chaos_cleans_up_when_terminated():
    with subprocess.Popen(
        [sys.executable, "-m", "mcp_fast.cli.chaos", "--loss", "0.2", "--", "sleep", "30"],
        stderr=subprocess.PIPE,
        text=True,
    ) as p:
        ns = f"mcpchaos-{p.pid}"
        try:
            deadline = time.monotonic() + 20
            while ns not in _namespaces() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert ns in _namespaces()
            time.sleep(0.3)  # let setup finish and sleep start
            p.send_signal(signal.SIGTERM)
            _, err = p.communicate(timeout=20)
        finally:
            if p.poll() is None:
                p.kill()
    assert p.returncode in (128 + signal.SIGTERM, 130), err
    assert ns not in _namespaces()
