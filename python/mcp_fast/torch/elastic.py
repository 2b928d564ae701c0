"""Data-parallel training that survives ranks dying and joining: :class:`ElasticDDP`.

A DDP script becomes elastic in four lines::

    from mcp_fast.torch import ElasticDDP
    ddp = ElasticDDP(model, optimizer, coordinator="10.0.0.1:29400")   # 1: wrap
    while ddp.step < steps:
        ddp.begin()                                  # 2: at every step boundary
        x, y = batch(ddp.step, ddp.rank, ddp.world_size)
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        ddp.commit()                                 # 3: instead of optimizer.step()
    ddp.close()                                      # 4: leave the job

``commit()`` averages the gradients over the members live in this step and runs
``optimizer.step()`` only if that all-reduce completed; otherwise it returns False and the
step is redone (or taken from a member that completed it) after the next ``begin()``. The
model needs no ``DistributedDataParallel`` wrapper and no ``init_process_group``.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Mapping
from typing import Any

import torch

from ..elastic import ElasticJob, EpochChange
from ..errors import MCPError

__all__ = ["ElasticDDP", "state_spec"]


def state_spec(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> str:
    """Names, dtypes and shapes of what a member holds, as the coordinator compares them."""
    parts = [
        f"{name}:{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
        for name, t in model.state_dict().items()
    ]
    if optimizer is not None:
        sizes = [len(g["params"]) for g in optimizer.param_groups]
        parts.append(f"optimizer:{type(optimizer).__name__}{sizes}")
    return ";".join(parts)


class ElasticDDP:
    """Averages gradients over the live members of an elastic job and heals newcomers.

    ``extra_state`` maps names to objects with ``state_dict()`` / ``load_state_dict()`` (a
    data-loader position, an RNG, a learning-rate scheduler) that travel with the model and
    optimizer state when a newcomer heals. Other keyword arguments go to
    :class:`mcp_fast.elastic.ElasticJob` (``secret``, ``heartbeat``, ``timeout``, ...).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        coordinator: str | None = None,
        *,
        extra_state: Mapping[str, Any] | None = None,
        **job_kwargs: Any,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self._extra = dict(extra_state or {})
        for k, v in self._extra.items():
            if not (hasattr(v, "state_dict") and hasattr(v, "load_state_dict")):
                raise TypeError(f"extra_state[{k!r}] has no state_dict()/load_state_dict()")
        self._params = [p for p in model.parameters() if p.requires_grad]
        self.job = ElasticJob(
            coordinator,
            save=self._save,
            load=self._load,
            spec=state_spec(model, optimizer),
            **job_kwargs,
        )

    @property
    def step(self) -> int:
        """Steps committed."""
        return self.job.step

    @property
    def rank(self) -> int:
        """This member's rank in the current epoch."""
        return self.job.rank

    @property
    def world_size(self) -> int:
        """Members live in the current epoch."""
        return self.job.world_size

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self.job.epoch

    @property
    def changes(self) -> list[EpochChange]:
        """Every change of epoch this member went through."""
        return self.job.changes

    def begin(self) -> None:
        """At every step boundary: joins the next epoch when the current one is over, and
        heals this member from a live one when it is behind (or new)."""
        self.job.begin()

    def commit(self) -> bool:
        """Averages the gradients over this epoch's members; if that completed, runs
        ``optimizer.step()``, counts the step and returns True. If it failed (a member died
        or left), zeroes the gradients, leaves the epoch and returns False."""
        group = self.job.group
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, g in enumerate(grads):
            by_dtype.setdefault(g.dtype, []).append(i)
        try:
            for idx in by_dtype.values():
                flat = torch.cat([grads[i].detach().reshape(-1).cpu() for i in idx])
                group.all_reduce(flat, op="avg")
                offset = 0
                for i in idx:
                    p = self._params[i]
                    n = p.numel()
                    g = flat[offset : offset + n].view_as(p).to(p.device)
                    if p.grad is None:
                        p.grad = g
                    else:
                        p.grad.copy_(g)
                    offset += n
        except MCPError:
            self.optimizer.zero_grad(set_to_none=True)
            self.job.abandon()
            return False
        self.optimizer.step()
        self.job.commit()
        return True

    def state_digest(self) -> str:
        """SHA3-256 of the model's state (parameters and buffers, in order): equal on every
        member after every committed step."""
        h = hashlib.sha3_256()
        for name, t in self.model.state_dict().items():
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def close(self) -> None:
        """Leaves the job."""
        self.job.close()

    def _save(self) -> bytes:
        buf = io.BytesIO()
        torch.save(
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "extra": {k: v.state_dict() for k, v in self._extra.items()},
            },
            buf,
        )
        return buf.getvalue()

    def _load(self, data: bytes) -> None:
        state = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        for k, v in self._extra.items():
            v.load_state_dict(state["extra"][k])
