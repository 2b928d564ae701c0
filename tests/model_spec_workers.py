"""What the Model-Spec tests run on every rank (see ``_launch.run``)."""

from __future__ import annotations

import os
from typing import Any


def torch_with_spec(rank: int, world: int, specs: list[str | None]) -> dict[str, Any]:
    """``init_process_group("mcp")`` with this rank's ``MCP_MODEL_SPEC`` (``None``: unset),
    then an exact all-reduce."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import mcp_fast.torch  # noqa: F401  (registers "mcp")

    if specs[rank] is None:
        os.environ.pop("MCP_MODEL_SPEC", None)
    else:
        os.environ["MCP_MODEL_SPEC"] = specs[rank]  # type: ignore[assignment]
    dist.init_process_group("mcp", timeout=timedelta(seconds=60))
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    dist.destroy_process_group()
    return {"sum": t.numpy()}
