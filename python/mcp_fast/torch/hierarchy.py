"""Two-level training: a process group per host, for DDP inside a host while
:class:`~mcp_fast.torch.DiLoCo` (or any collective of the whole job) goes between hosts.

::

    dist.init_process_group("mcp")
    host = host_group()                                   # the ranks sharing this host
    ddp = DistributedDataParallel(model, process_group=host)   # every step, shared memory
    diloco = DiLoCo(model, opt, dist.group.WORLD.mcp_group, sync_every=50)

The ranks of a host hold the same parameters (their DDP keeps them so), so DiLoCo's outer
all-reduce over the whole job is the average over hosts; with more than one host and more
than one rank per host it runs hierarchically: each local rank carries its own shard of the
pseudo-gradient across the network, and a host sends ``2 (H-1)/H`` of it per outer step.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def host_group(group: Any = None) -> Any:
    """This rank's host as a ``torch.distributed`` process group (backend ``"mcp"``, so the
    ranks of a host talk through shared memory): the ranks of ``group`` (default: the world)
    that share its host, as the rendezvous found them (machine and network namespace, or
    ``MCP_HOST_ID``). Every rank of ``group`` must call it, as for ``dist.new_group``: it
    creates one group per host."""
    pg = dist.group.WORLD if group is None else group
    mcp = getattr(pg, "mcp_group", None)
    if mcp is None:
        raise TypeError(
            "host_group needs a process group of the 'mcp' backend: call "
            'dist.init_process_group("mcp") (or pass such a group)'
        )
    hosts = mcp.topology()["hosts"]
    to_global = [dist.get_global_rank(pg, r) for r in range(dist.get_world_size(pg))]
    ranks = [[to_global[r] for r in host] for host in hosts]
    mine, _ = dist.new_subgroups_by_enumeration(ranks, backend="mcp")
    return mine
