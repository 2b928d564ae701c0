"""Secure by default: without a job secret, rank 0's generated one is handed out on loopback
only; on any other address the job refuses to start unless the user opts in."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import _netns
import mcp_fast as mcp
from _launch import free_port

# Rank 0 of two on one address of a namespace host, no secret; prints the outcome.
_RANK = """
import sys, numpy as np, mcp_fast as mcp
rank, master, allow = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
try:
    g = mcp.init(rank=rank, world_size=2, master_addr=master, master_port=29731,
                 timeout=30, allow_generated_secret=allow or None)
except ValueError as e:
    print("refused:", e)
    sys.exit(0)
a = np.full(4, rank + 1.0, "float32")
g.all_reduce(a)
print("ok", a.tolist())
g.close()
"""


def test_no_secret_off_loopback_is_refused_before_anything_is_sent(monkeypatch) -> None:
    monkeypatch.delenv("MCP_SECRET", raising=False)
    monkeypatch.delenv("MCP_ALLOW_GENERATED_SECRET", raising=False)
    # 192.0.2.1 (TEST-NET-1) is never routed: the refusal comes before any bind or packet.
    for rank in (0, 1):
        with pytest.raises(ValueError, match="MCP_SECRET") as e:
            mcp.init(rank=rank, world_size=2, master_addr="192.0.2.1", master_port=free_port())
        assert "MCP_ALLOW_GENERATED_SECRET" in str(e.value)


def test_loopback_keeps_the_generated_secret(monkeypatch) -> None:
    monkeypatch.delenv("MCP_SECRET", raising=False)
    g = mcp.init(rank=0, world_size=1, master_port=free_port())
    try:
        assert len(g.core.secret) == 32
    finally:
        g.close()


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _netns.available(), reason="needs root and iproute2 (ip netns)")
@pytest.mark.parametrize("allow", [False, True])
def test_two_hosts_without_a_secret_refuse_unless_opted_in(allow: bool) -> None:
    env = {
        k: v for k, v in os.environ.items() if k not in ("MCP_SECRET", "MCP_ALLOW_GENERATED_SECRET")
    }
    with _netns.VethPair("sec") as net:
        procs = [
            net.popen(
                i,
                [sys.executable, "-c", _RANK, str(i), net.addr[0], "1" if allow else "0"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(2)
        ]
        outs = [p.communicate(timeout=90) for p in procs]
        problems = net.close()
    assert not problems, problems
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        if allow:
            assert out.strip() == "ok [3.0, 3.0, 3.0, 3.0]", (out, err)
        else:
            assert out.startswith("refused:") and "MCP_SECRET" in out, (out, err)
