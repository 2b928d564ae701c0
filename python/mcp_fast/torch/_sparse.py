"""All-reduce of sparse COO tensors (``nn.Embedding(sparse=True)`` gradients under DDP).

Each rank's tensor is coalesced, the ranks exchange how many entries they hold, then gather
every rank's indices and values padded to the largest count, and each sums the ranks' tensors
in rank order, as Gloo does: every rank gets the same, bit-identical coalesced result. Only
SUM is defined on sparse tensors here (as on Gloo).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..group import Group, Work


@dataclass
class SparseGather:
    """One tensor's gather in flight: the buffers the ranks' entries arrive in."""

    tensor: torch.Tensor
    counts: list[int]
    indices: torch.Tensor  # (world, sparse_dim, max count)
    values: torch.Tensor  # (world, max count, *dense shape)

    def result(self) -> torch.Tensor:
        """The sum of every rank's tensor, coalesced, on the host."""
        shape = self.tensor.shape
        parts = [
            torch.sparse_coo_tensor(
                self.indices[r, :, :n],
                self.values[r, :n],
                shape,
                is_coalesced=True,
                # Entries from other ranks: checked, so that a bad index is an error, not a
                # write out of bounds.
                check_invariants=True,
            )
            for r, n in enumerate(self.counts)
        ]
        total = parts[0]
        for part in parts[1:]:
            total = total + part  # in rank order, as Gloo adds them
        return total.coalesce()

    def write_back(self) -> None:
        """Replaces the tensor's entries by the sum (the tensor keeps its device)."""
        with torch.no_grad():
            self.tensor.copy_(self.result().to(self.tensor.device))


def start_sparse_all_reduce(
    group: Group, tensor: torch.Tensor, op: str
) -> tuple[SparseGather, list[Work | None]]:
    """Starts the all-reduce of the sparse ``tensor``. The exchange of entry counts, shapes
    and ops completes before this returns (every rank must have called it), so that the
    gathers that follow are issued in call order like every other operation. An op other than
    SUM, or a shape that differs, is refused after that exchange, on every rank alike: a rank
    that refused alone would leave the others waiting for it until their timeout."""
    local = tensor.detach().cpu().coalesce()
    world = group.world_size
    # Each rank's entry count, whether it asked for SUM, and shape: a rank whose tensor has
    # another number of dimensions fails this gather on every rank; the rest is checked below.
    summing = int(op == "sum")
    meta = torch.tensor(
        [local._nnz(), summing, local.sparse_dim(), *local.shape], dtype=torch.int64
    )
    metas = torch.empty((world, meta.numel()), dtype=torch.int64)
    group.all_gather(metas, meta)
    others = [r for r, flag in enumerate(metas[:, 1].tolist()) if flag != 1]
    if others:
        raise ValueError(
            f"all_reduce of a sparse tensor supports only SUM; rank(s) {others} asked for "
            f"another operation (this rank: {op.upper()}): densify the tensor "
            "(tensor.to_dense()) for other operations"
        )
    if not bool((metas[:, 2:] == meta[2:]).all()):
        shapes = [f"{tuple(m[3:].tolist())} sparse_dim={int(m[2])}" for m in metas]
        raise ValueError(
            f"all_reduce of sparse tensors of different shapes across ranks: {shapes}; "
            "every rank must pass a tensor of the same size and sparse dimensions"
        )
    counts = [int(c) for c in metas[:, 0].tolist()]
    most = max(counts)
    idx = torch.zeros((local.sparse_dim(), most), dtype=torch.int64)
    idx[:, : local._nnz()] = local._indices()
    vals = torch.zeros((most, *local._values().shape[1:]), dtype=local.dtype)
    vals[: local._nnz()] = local._values()
    gather = SparseGather(
        tensor,
        counts,
        torch.empty((world, *idx.shape), dtype=idx.dtype),
        torch.empty((world, *vals.shape), dtype=vals.dtype),
    )
    if most == 0:
        return gather, []  # every rank's tensor is empty: so is the sum
    works = [
        group.all_gather(gather.indices, idx, async_op=True),
        group.all_gather(gather.values, vals, async_op=True),
    ]
    return gather, works
