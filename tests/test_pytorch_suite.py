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


# Tests torch runs on Gloo only (DDP on CPU, no_sync with a hook chaining `then`, sparse
# all-reduce, batched point-to-point with tags, work futures, a barrier's timeout, whose
# message the test matches against Gloo's wording), each on "mcp".
AS_GLOO_SUBSET = [
    "test_DistributedDataParallelCPU",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_sparse_all_reduce_sum",
    "test_batch_isend_irecv_gloo_tags",
    "test_get_future",
    "test_barrier_timeout_full_group",
]


def _run_suite(subset: str, tmp_path: Path, as_gloo: bool) -> str:
    env = {**os.environ, "WORLD_SIZE": "2", "TEMP_DIR": str(tmp_path)}
    env["BACKEND"] = "gloo" if as_gloo else "mcp"
    env["MCP_SUITE_AS_GLOO"] = "1" if as_gloo else "0"
    cmd = [sys.executable, "-m", "pytest", str(SUITE), "-v", "-k", subset]
    cmd += ["-c", os.devnull, "-p", "no:cacheprovider", "--timeout", "120", "-rfs"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=880, env=env)
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout and " failed" not in r.stdout, tail
    return r.stdout


@pytest.mark.timeout(900)
def test_pytorch_distributed_tests_pass_on_mcp(tmp_path: Path) -> None:
    _run_suite(SUBSET, tmp_path, as_gloo=False)


@pytest.mark.timeout(900)
def test_pytorch_tests_gated_on_gloo_pass_on_mcp(tmp_path: Path) -> None:
    subset = " or ".join(f"{name} and not cuda" for name in AS_GLOO_SUBSET)
    out = _run_suite(subset, tmp_path, as_gloo=True)
    for name in AS_GLOO_SUBSET:
        # It ran and passed: a skip would pass without testing anything.
        assert f"::{name} PASSED" in out, (name, out[-3000:])
