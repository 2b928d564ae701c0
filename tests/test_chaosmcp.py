"""``chaosmcp``: a real 3-rank job under ``corrupt --probability 0.2 --mode flip_bits`` stays
exact and its summary counts every damaged frame resent; ``memory`` windows damage sent and
received buffers and the job stays exact; exit codes, MCP_CHAOS merging, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from mcp_fast.cli.chaosmcp import MODES, merge_chaos, parse_duration

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def chaosmcp(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    e = dict(os.environ)
    e.pop("MCP_CHAOS", None)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), str(HERE)])
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "mcp_fast.cli.chaosmcp", *args],
        env=e,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_job_under_corrupt_frames_stays_exact_and_every_damaged_frame_is_resent(
    tmp_path: Path,
) -> None:
    report = tmp_path / "report.json"
    job = [sys.executable, str(HERE / "chaos_job.py"), "3", "6"]
    # Stream lane: a damaged frame is asked for again (on the FEC lane it is an erasure).
    r = chaosmcp(
        "corrupt", "--probability", "0.2", "--mode", "flip_bits", "--seed", "7",
        "--report", str(report), "--", *job,
        env={"MCP_LANE": "stream"},
    )  # fmt: skip
    # The job checks every all-reduce and broadcast bit for bit: exit 0 means exact.
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(report.read_text())
    assert s["groups"] == 3 and s["exit_code"] == 0
    assert s["mcp_chaos"] == "corrupt=0.2,seed=7"
    assert s["corrupt_frames"] > 0, s  # frames really were damaged ...
    assert s["retransmits"] == s["corrupt_frames"], s  # ... and each one sent again
    assert s["every_damaged_frame_resent"]
    assert f"{s['corrupt_frames']} failed their checksum" in r.stderr


def test_exit_code_is_passed_through_and_mcp_chaos_is_merged() -> None:
    show = "import os, sys; print(os.environ['MCP_CHAOS']); sys.exit(3)"
    r = chaosmcp(
        "corrupt", "--probability", "0.05", "--", sys.executable, "-c", show,
        env={"MCP_CHAOS": "loss=0.1, seed=1"},
    )  # fmt: skip
    assert r.returncode == 3
    assert r.stdout.strip() == "loss=0.1,seed=1,corrupt=0.05"
    assert "no mcp_fast group reported" in r.stderr
    assert merge_chaos("loss=0.1,corrupt=0.3", corrupt=0.2, seed=None) == "loss=0.1,corrupt=0.2"
    assert merge_chaos(None, corrupt=0.2, seed=4) == "corrupt=0.2,seed=4"
    with pytest.raises(ValueError, match="key=value"):
        merge_chaos("loss", corrupt=0.2)


def test_timeout_kills_the_command() -> None:
    r = chaosmcp(
        "corrupt", "--probability", "0.1", "--timeout", "1", "--",
        sys.executable, "-c", "import time; time.sleep(60)",
    )  # fmt: skip
    assert r.returncode == 124 and "killing the command" in r.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["corrupt", "--probability", "0.2", "--mode", "zero", "--", "true"], "allowed: flip_bits"),
        (["corrupt", "--probability", "1.5", "--", "true"], "must be in (0, 1]"),
        (["corrupt", "--probability", "x", "--", "true"], "not a number"),
        (["corrupt", "--probability", "0.2"], "no command given"),
        (["corrupt", "--probability", "0.2", "--", "/nonexistent/cmd"], "cannot run"),
        (["memory", "--interval", "5m", "--duration", "soon", "--", "true"], "not a duration"),
        (["memory", "--interval", "5m", "--duration", "10m", "--", "true"], "shorter than"),
        (["bogus"], "invalid choice"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_with_what_to_do(args: list[str], message: str) -> None:
    r = chaosmcp(*args, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert message in r.stderr, r.stderr


def test_memory_windows_damage_sent_and_received_buffers_and_the_job_stays_exact(
    tmp_path: Path,
) -> None:
    report = tmp_path / "report.json"
    job = [sys.executable, str(HERE / "chaos_job.py"), "3", "6"]
    # A window of 150 ms every 300 ms, the first at each group's start: the job lives through
    # at least one. Stream lane: a damaged payload is asked for again. Heavy damage (a try
    # fails with probability ~0.5 in a window), so more resends than the default 8 are allowed:
    # 33 failed tries in a row has probability 2e-10.
    r = chaosmcp(
        "memory", "--interval", "300ms", "--duration", "150ms", "--probability", "0.3",
        "--seed", "5", "--report", str(report), "--", *job,
        env={"MCP_LANE": "stream", "MCP_RESEND_LIMIT": "32"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]  # every all-reduce and broadcast exact
    s = json.loads(report.read_text())
    assert s["mode"] == "memory" and s["groups"] == 3 and s["exit_code"] == 0
    assert s["mcp_chaos"] == "corrupt=0.3,seed=5,corrupt_every=300000us,corrupt_for=150000us"
    # Damage happened, the checksums caught it (none slipped through: the results are exact;
    # a frame damaged as its connection closes is never checked), each catch was resent.
    assert s["damaged_on_purpose"] > 0 and 0 < s["corrupt_frames"] <= s["damaged_on_purpose"], s
    assert s["retransmits"] == s["corrupt_frames"], s
    assert f"{s['damaged_on_purpose']} payloads damaged on purpose" in r.stderr
    assert parse_duration("100ms") == pytest.approx(0.1) and parse_duration("5m") == 300.0
    assert parse_duration("1h") == 3600.0
    assert set(MODES) == {"flip_bits"}


def test_the_console_script_is_declared() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["scripts"]["chaosmcp"] == "mcp_fast.cli.chaosmcp:main"
