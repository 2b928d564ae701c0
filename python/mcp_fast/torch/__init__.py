"""torch.distributed integration: the backend ``"mcp"``.

``import mcp_fast.torch`` (or nothing at all: torch loads our ``torch.backends`` entry point
when it is imported) registers the backend, after which::

    torch.distributed.init_process_group("mcp")      # under torchrun, or with store/rank/size

runs every collective of torch.distributed, DistributedDataParallel included, over MCP.
:class:`ElasticDDP` trains through members dying and joining (see :mod:`mcp_fast.elastic`);
:class:`DiLoCo` and :class:`LocalSGD` sync every H steps (see :mod:`mcp_fast.torch.diloco`);
:func:`host_group` gives DDP a group per host for two-level training.
"""

from __future__ import annotations

from .backend import MCPProcessGroup, register
from .diloco import DiLoCo, LocalSGD, PseudoGradientWarning
from .elastic import ElasticDDP, state_spec
from .elastic_diloco import ElasticDiLoCo
from .hierarchy import host_group
from .hooks import CompressionState, GuardedState, compression_hook, guarded_allreduce_hook

__all__ = [
    "CompressionState",
    "DiLoCo",
    "ElasticDDP",
    "ElasticDiLoCo",
    "GuardedState",
    "LocalSGD",
    "MCPProcessGroup",
    "PseudoGradientWarning",
    "compression_hook",
    "guarded_allreduce_hook",
    "host_group",
    "register",
    "state_spec",
]
