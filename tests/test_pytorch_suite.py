"""A few minutes of PyTorch's own distributed backend tests on the backend "mcp" (the whole
suite is documented in ``tests/pytorch_suite/distributed.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("expecttest")

SUITE = Path(__file__).resolve().parent / "pytorch_suite" / "distributed.py"

# The collectives a DDP/FSDP job and torch's own tests lean on, every dtype among them.
SUBSET = " or ".join(
    [
        "test_broadcast",
        "test_all_gather_coalesced",
        "test_all_reduce_sum",
        "test_all_reduce_max",
        "test_send_recv",
    ]
)


@pytest.mark.timeout(900)
def test_pytorch_distributed_tests_pass_on_mcp(tmp_path: Path) -> None:
    env = {**os.environ, "BACKEND": "mcp", "WORLD_SIZE": "2", "TEMP_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "pytest", str(SUITE), "-q", "-k", SUBSET]
    cmd += ["-c", os.devnull, "-p", "no:cacheprovider", "--timeout", "120", "-rf"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=880, env=env)
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout and " failed" not in r.stdout, tail
