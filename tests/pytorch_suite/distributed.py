"""PyTorch's own backend tests (``torch.testing._internal.distributed.distributed_test``),
pointed at the backend "mcp" with two ranks, as torch's ``test_distributed_spawn.py`` points
them at Gloo. ``tests/test_pytorch_suite.py`` runs a subset; the whole of it (66 passed, 219
skipped for needing a GPU, NCCL or Gloo-only features; 12 minutes on 2 vCPUs)::

    BACKEND=mcp WORLD_SIZE=2 .venv/bin/python -m pytest tests/pytorch_suite/distributed.py \\
        -c /dev/null -p no:cacheprovider --timeout 120

The tests torch gates on Gloo (``BACKEND == "gloo"``: DDP on CPU, gradient accumulation with
``no_sync``, sparse all-reduce, work futures...) run on "mcp" with ``MCP_SUITE_AS_GLOO=1``:
the suite is then imported as for Gloo, and every process group it creates with
``init_process_group("gloo")`` is made with "mcp" instead (85 passed, 195 skipped, 5 failed
that are Gloo's own: ``monitored_barrier``, which torch allows on Gloo only,
``test_get_backend``, which finds "mcp", and a barrier timeout whose message is matched
against Gloo's wording)::

    MCP_SUITE_AS_GLOO=1 WORLD_SIZE=2 .venv/bin/python -m pytest \\
        tests/pytorch_suite/distributed.py -c /dev/null -p no:cacheprovider --timeout 180

With ``WORLD_SIZE=3`` (2026-12-06, 2 vCPUs): 65 passed and 220 skipped in 13 minutes; as
Gloo, 86 passed, 195 skipped and 4 failed, all Gloo's own (``test_get_backend`` and three
``monitored_barrier`` tests), in 35 minutes.

Not named ``test_*``: it is collected only when named on the command line.
"""

import atexit
import os
import shutil
import tempfile

# What the suite's skip decorators read at import; the spawned ranks inherit it.
if os.environ.get("MCP_SUITE_AS_GLOO") == "1":
    os.environ["BACKEND"] = "gloo"
else:
    os.environ.setdefault("BACKEND", "mcp")
os.environ.setdefault("WORLD_SIZE", "2")
if "TEMP_DIR" not in os.environ:
    # Made once, by the process that runs the suite (its spawned ranks inherit the variable),
    # and removed when it exits.
    _temp_dir = tempfile.mkdtemp(prefix="mcp-pytorch-suite-")
    os.environ["TEMP_DIR"] = _temp_dir
    atexit.register(shutil.rmtree, _temp_dir, ignore_errors=True)

import torch.distributed as dist
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed.distributed_test import (
    DistributedTest,
    TestDistBackend,
)

import mcp_fast.torch  # noqa: F401  (registers "mcp" in every spawned rank too)

if os.environ.get("MCP_SUITE_AS_GLOO") == "1":
    _init_process_group = dist.init_process_group

    def _init_on_mcp(*args, **kwargs):  # type: ignore[no-untyped-def]
        """init_process_group, with the backend "gloo" replaced by "mcp"."""
        if kwargs.get("backend") == "gloo":
            kwargs["backend"] = "mcp"
        elif args and args[0] == "gloo":
            args = ("mcp", *args[1:])
        return _init_process_group(*args, **kwargs)

    dist.init_process_group = _init_on_mcp  # the suite calls it through this module


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    run_tests()
