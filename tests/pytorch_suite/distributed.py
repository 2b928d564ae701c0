"""PyTorch's own backend tests (``torch.testing._internal.distributed.distributed_test``),
pointed at the backend "mcp" with two ranks, as torch's ``test_distributed_spawn.py`` points
them at Gloo. ``tests/test_pytorch_suite.py`` runs a subset; the whole of it (65 passed, 220
skipped for needing a GPU, NCCL or Gloo-only features; 6 minutes on 2 vCPUs)::

    BACKEND=mcp WORLD_SIZE=2 .venv/bin/python -m pytest tests/pytorch_suite/distributed.py \\
        -c /dev/null -p no:cacheprovider --timeout 120

Not named ``test_*``: it is collected only when named on the command line.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("BACKEND", "mcp")
os.environ.setdefault("WORLD_SIZE", "2")
if "TEMP_DIR" not in os.environ:
    # Made once, by the process that runs the suite (its spawned ranks inherit the variable),
    # and removed when it exits.
    _temp_dir = tempfile.mkdtemp(prefix="mcp-pytorch-suite-")
    os.environ["TEMP_DIR"] = _temp_dir
    atexit.register(shutil.rmtree, _temp_dir, ignore_errors=True)

from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed.distributed_test import (
    DistributedTest,
    TestDistBackend,
)

import mcp_fast.torch  # noqa: F401  (registers "mcp" in every spawned rank too)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    run_tests()
