"""mcp-chaos --hosts 2: two namespace hosts joined by the TUN forwarder (delay, loss)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from mcp_fast import _core
from mcp_fast.cli import chaos

_OK = (
    os.geteuid() == 0
    and shutil.which("ip") is not None
    and os.path.exists("/dev/net/tun")
    and hasattr(_core, "netem_forward")
)
_CLI = [sys.executable, "-m", "mcp_fast.cli.chaos", "--hosts", "2"]
wan = pytest.mark.skipif(not _OK, reason="needs root, ip and /dev/net/tun")

# Host 1 serves; host 0 measures. Every wait is bounded (the whole probe ends in < 40 s).
_PROBE = textwrap.dedent(
    """
    import os, socket, sys, time
    host = int(os.environ["MCP_CHAOS_HOST"])
    a0, a1 = os.environ["MCP_CHAOS_ADDRS"].split(",")
    assert os.environ["MCP_CHAOS_ADDR"] == (a0, a1)[host]
    mode = sys.argv[1]
    N = 1000
    if host == 1:
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        u.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE: no drops of our own
        u.bind((a1, 5102))
        lst = socket.create_server((a1, 5101))
        lst.settimeout(30)
        c, _ = lst.accept()
        c.settimeout(30)
        while (b := c.recv(1)) == b"p":
            c.sendall(b"p")
        if mode == "rtt":
            u.settimeout(30)
            for _ in range(5):
                data, peer = u.recvfrom(64)
                u.sendto(data, peer)
        else:
            got, u_deadline = 0, time.monotonic() + 30
            u.settimeout(2.0)
            while time.monotonic() < u_deadline and got < N:
                try:
                    u.recv(64)
                except TimeoutError:
                    if got:
                        break
                    continue
                got += 1
            print(f"RECEIVED {got} OF {N}", flush=True)
    else:
        deadline = time.monotonic() + 30
        while True:
            try:
                c = socket.create_connection((a1, 5101), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        c.settimeout(30)
        tcp = []
        for _ in range(5):
            t0 = time.monotonic()
            c.sendall(b"p")
            assert c.recv(1) == b"p"
            tcp.append(time.monotonic() - t0)
        c.sendall(b"q")
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        if mode == "rtt":
            u.settimeout(30)
            udp = []
            for i in range(5):
                t0 = time.monotonic()
                u.sendto(bytes([i]), (a1, 5102))
                assert u.recv(64) == bytes([i])
                udp.append(time.monotonic() - t0)
            print(f"RTT tcp {min(tcp):.6f} udp {min(udp):.6f}", flush=True)
        else:
            for i in range(N):
                u.sendto(i.to_bytes(4, "big"), (a1, 5102))
                time.sleep(0.0005)
    """
)


def _hosts(*args: str, mode: str) -> tuple[subprocess.CompletedProcess[str], int]:
    with subprocess.Popen(
        [*_CLI, *args, "--timeout", "60", "--", sys.executable, "-c", _PROBE, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as p:
        try:
            out, err = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
        return subprocess.CompletedProcess(p.args, p.returncode, out, err), p.pid


def _left_behind(pid: int) -> list[str]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [w for w in (ns + links).split() if f"mcpchaos-{pid}-" in w or f"mcpw{pid}" in w]


def _pids(pid: int, host: int) -> list[str]:
    ns = f"mcpchaos-{pid}-{host}"
    return subprocess.run(
        ["ip", "netns", "pids", ns], capture_output=True, text=True
    ).stdout.split()


@pytest.mark.netns
@wan
def test_tcp_and_udp_round_trips_take_at_least_two_delays_and_nothing_is_left() -> None:
    r, pid = _hosts("--delay", "25ms", "--jitter", "5ms", "--seed", "3", mode="rtt")
    assert r.returncode == 0, r.stderr
    _, tcp, _, udp = r.stdout.split("RTT")[1].split()
    # Each way takes at least delay - jitter = 20 ms; no upper bound (a loaded machine).
    assert float(tcp) >= 0.040 and float(udp) >= 0.040, r.stdout
    assert "path 0->1" in r.stderr and "path 1->0" in r.stderr, r.stderr
    assert _left_behind(pid) == []


@pytest.mark.netns
@wan
def test_loss_drops_about_the_asked_fraction_of_datagrams() -> None:
    r, pid = _hosts("--loss", "0.2", "--seed", "5", mode="loss")
    assert r.returncode == 0, r.stderr
    got = int(r.stdout.split("RECEIVED")[1].split()[0])
    # Binomial(1000, 0.8): sd 13; [700, 900] is more than 7 sd either side.
    assert 700 <= got <= 900, (got, r.stderr)
    assert _left_behind(pid) == []


@pytest.mark.netns
@wan
def test_a_failing_host_fails_the_run_and_nothing_is_left() -> None:
    script = "import os, sys; sys.exit(3) if os.environ['MCP_CHAOS_HOST'] == '1' else None"
    with subprocess.Popen(
        [*_CLI, "--delay", "1ms", "--", sys.executable, "-c", script],
        stderr=subprocess.PIPE,
        text=True,
    ) as p:
        _, err = p.communicate(timeout=60)
    assert p.returncode == 3, err
    assert _left_behind(p.pid) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--delay", "5ms"], "need --hosts 2"),
        (["--hosts", "2", "--mtu", "100"], "--mtu must be between"),
    ],
)
def test_bad_two_host_arguments_are_refused(monkeypatch, capsys, args, message) -> None:
    monkeypatch.setattr(chaos.shutil, "which", lambda tool: tool)
    monkeypatch.setattr(chaos.os, "geteuid", lambda: 0)
    assert chaos.main([*args, "--", "true"]) == 2
    assert message in capsys.readouterr().err


def test_rates_and_times_are_read_in_tc_units() -> None:
    assert chaos.bits_per_second("200mbit") == 200e6
    assert chaos.bits_per_second("1gbps") == 8e9
    assert chaos.seconds_of("25ms") == pytest.approx(0.025)
    assert chaos.seconds_of("500us") == pytest.approx(0.0005)
    with pytest.raises(ValueError):
        chaos.bits_per_second("fast")


def test_bad_forwarder_parameters_are_value_errors() -> None:
    with pytest.raises(ValueError, match="loss"):
        _core.netem_forward(-1, -1, -1, loss=2.0)
    with pytest.raises(ValueError, match="jitter"):
        _core.netem_forward(-1, -1, -1, delay_s=0.001, jitter_s=0.002)
    with pytest.raises(ValueError, match="delay_s"):
        _core.netem_forward(-1, -1, -1, delay_s=-1.0)


@pytest.mark.netns
@wan
def test_a_terminated_run_removes_both_hosts() -> None:
    with subprocess.Popen(
        [*_CLI, "--delay", "1ms", "--", "sleep", "30"], stderr=subprocess.PIPE
    ) as p:
        try:
            deadline = time.monotonic() + 20
            # Both CMDs started (a signal during setup is an interrupt, exit 130).
            while not all(_pids(p.pid, i) for i in (0, 1)) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert all(_pids(p.pid, i) for i in (0, 1))
            p.send_signal(signal.SIGTERM)
            p.communicate(timeout=30)
        finally:
            if p.poll() is None:
                p.kill()
    assert p.returncode == 128 + signal.SIGTERM
    assert _left_behind(p.pid) == []
