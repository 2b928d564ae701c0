"""One settings reader for every kind of group: arguments first, then MCP_*, then defaults."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from _launch import free_port
from mcp_fast.settings import Settings


def test_arguments_beat_the_environment_which_beats_the_defaults(monkeypatch) -> None:
    for k in ("MCP_SECRET", "MCP_TIMEOUT", "MCP_CONNECT_TIMEOUT", "MCP_LANE", "MCP_CHAOS"):
        monkeypatch.delenv(k, raising=False)
    d = Settings.resolve()
    assert (d.secret, d.timeout, d.connect_timeout, d.lane, d.chaos) == (
        None,
        300.0,
        300.0,
        "auto",
        None,
    )
    assert (d.resend_limit, d.stall_timeout, d.allow_generated_secret) == (8, 60.0, False)
    monkeypatch.setenv("MCP_TIMEOUT", "20")
    monkeypatch.setenv("MCP_LANE", "fec")
    monkeypatch.setenv("MCP_CHAOS", "loss=0.1")
    monkeypatch.setenv("MCP_SECRET", "s3")
    e = Settings.resolve()
    assert (e.timeout, e.connect_timeout, e.lane, e.chaos, e.secret) == (
        20.0,
        20.0,
        "fec",
        "loss=0.1",
        b"s3",
    )
    a = Settings.resolve(timeout=5, lane="stream", secret=b"x", resend_limit=2)
    assert (a.timeout, a.lane, a.secret, a.resend_limit) == (5.0, "stream", b"x", 2)
    assert a.core_kwargs()["resend_limit"] == 2 and a.core_kwargs()["lane"] == "stream"


@pytest.mark.parametrize(
    ("name", "value", "what"),
    [("MCP_TIMEOUT", "soon", "a number"), ("MCP_RESEND_LIMIT", "8.5", "an integer")],
)
def test_a_bad_environment_value_names_the_variable(monkeypatch, name, value, what) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}='{value}' is not {what}"):
        Settings.resolve()


@pytest.mark.parametrize(
    ("config", "spec", "message"),
    [
        ('{"mtu": 1300, "mtus": 1}', None, 'unknown transport config key "mtus"'),
        ('{"mtu": "big"}', None, "mtu"),
        (None, '{"arch": "gpt2", "precisionn": "bf16"}', "precisionn"),
    ],
)
def test_a_bad_config_or_model_spec_file_is_refused_as_it_is_read(
    monkeypatch, tmp_path, config, spec, message
) -> None:
    """Before any socket or store: each rank of a job refuses the file by itself."""
    for name, text in (("MCP_CONFIG", config), ("MCP_MODEL_SPEC", spec)):
        monkeypatch.delenv(name, raising=False)
        if text is not None:
            (tmp_path / f"{name}.json").write_text(text)
            monkeypatch.setenv(name, str(tmp_path / f"{name}.json"))
    with pytest.raises(ValueError, match=message):
        Settings.resolve()


_COUNT_WORKERS = """
import os, sys, time
import mcp_fast as mcp
port, want = int(sys.argv[1]), int(sys.argv[2])
try:
    g = mcp.init(rank=0, world_size=1, master_port=port, timeout=30)
except mcp.MCPError as e:
    print("MCPError:", e)
    raise SystemExit(0)
def workers():
    tasks = os.listdir("/proc/self/task")
    return sum(open(f"/proc/self/task/{t}/comm").read().startswith("mcp-worker") for t in tasks)
# A thread takes its name once it first runs: wait (bounded) until the count can be judged.
t0 = time.monotonic()
while workers() < want and time.monotonic() - t0 < 30:
    time.sleep(0.05)
time.sleep(0.1)  # and a moment more, so that one worker too many would show too
print(workers())
g.close()
"""


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, "2"),
        ({"MCP_THREADS": "1"}, "1"),
        ({"MCP_THREADS": "3"}, "3"),
        ({"MCP_THREADS": "0"}, 'MCPError: MCP_THREADS="0" is not a thread count'),
        ({"MCP_THREADS": "many"}, 'MCPError: MCP_THREADS="many" is not a thread count'),
    ],
)
def test_mcp_threads_sets_the_runtime_workers_and_a_bad_value_is_refused(env, want) -> None:
    clean = {k: v for k, v in os.environ.items() if k != "MCP_THREADS"}
    expected = want if want.isdigit() else "1"
    out = subprocess.run(
        [sys.executable, "-c", _COUNT_WORKERS, str(free_port()), expected],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.strip()
    assert out == want if want.isdigit() else out.startswith(want), out
