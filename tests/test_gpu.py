"""CUDA tensors through the "mcp" backend. Skipped where no GPU is present (CI has none)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _launch import ok, run  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("bind_device", [False, True])
def test_cuda_tensors_are_staged_and_written_back(bind_device: bool) -> None:
    # bind_device: init_process_group("mcp", device_id=cuda:N), as NCCL scripts call it.
    world = 2
    for out in ok(run("torch_workers.cuda_collectives", world, bind_device, timeout=180)):
        np.testing.assert_array_equal(out["all_reduce"], np.full(1 << 20, 3.0, np.float32))
        np.testing.assert_array_equal(out["broadcast"], np.arange(1000, dtype=np.float32))
        np.testing.assert_array_equal(
            out["all_gather"], np.repeat([0.0, 1.0], 4).astype(np.float32)
        )
