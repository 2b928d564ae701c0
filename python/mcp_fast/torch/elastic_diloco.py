"""DiLoCo in an elastic job: :class:`ElasticDiLoCo`.

Each outer step is one step of an :class:`~mcp_fast.elastic.ElasticJob`::

    from mcp_fast.torch import ElasticDiLoCo
    dl = ElasticDiLoCo(model, inner_opt, coordinator="10.0.0.1:29400", sync_every=50)
    while dl.outer_steps < rounds:
        x, y = batch(dl.inner_steps, dl.rank, dl.world_size)
        inner_opt.zero_grad(); loss_fn(model(x), y).backward(); inner_opt.step()
        dl.step()                     # every H steps: the outer step over the live members
    dl.close()

A member lost during the inner steps makes the outer all-reduce fail (the coordinator aborts
it at once); the survivors join the next epoch and redo the outer step among themselves,
with the pseudo-gradients they hold: the lost member is dropped from the average. If some
survivors had completed it, the others take θ_outer from them instead. A newcomer is
admitted right after an outer step: it heals θ_outer, the outer optimizer's state, the inner
step count (and the source's inner optimizer state) from a member, and starts its inner steps
with the others, so it never dilutes an average with a zero pseudo-gradient.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from ..elastic import ElasticJob, EpochChange
from ..errors import MCPError
from .diloco import DiLoCo
from .elastic import state_spec

__all__ = ["ElasticDiLoCo"]


class ElasticDiLoCo:
    """:class:`~mcp_fast.torch.DiLoCo` (one fragment, no delay) whose outer steps run over
    the live members of an elastic job. DiLoCo's keyword arguments (``sync_every``,
    ``codec``, ``outer_lr``, ``outer_momentum``, ``outer_optimizer``, ``block``,
    ``error_feedback``) are taken; the others go to :class:`~mcp_fast.elastic.ElasticJob`
    (``secret``, ``heartbeat``, ``timeout``, ...). The constructor joins the job (and heals
    from a member that trains already)."""

    _DILOCO_KEYS = (
        "sync_every",
        "codec",
        "block",
        "error_feedback",
        "outer_lr",
        "outer_momentum",
        "outer_optimizer",
        "average_buffers",
    )

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        coordinator: str | None = None,
        **kwargs: Any,
    ) -> None:
        if "fragments" in kwargs or "delay" in kwargs:
            raise ValueError(
                "ElasticDiLoCo runs whole outer steps (fragments=1, delay=0): streaming "
                "fragments across a change of members is not supported"
            )
        dl_kwargs = {k: kwargs.pop(k) for k in self._DILOCO_KEYS if k in kwargs}
        self.model = model
        self.optimizer = optimizer
        # The group changes with every epoch: set before each outer step. Every member takes
        # rank 0's state in the first epoch, so no model check or broadcast is needed here;
        # the coordinator compares the specs.
        self._dl = DiLoCo(model, optimizer, None, check_model=False, broadcast=False, **dl_kwargs)
        self.job = ElasticJob(
            coordinator,
            save=self._save,
            load=self._load,
            spec=state_spec(model, optimizer),
            **kwargs,
        )
        self.job.begin()

    @property
    def diloco(self) -> DiLoCo:
        """The DiLoCo object (its ``skipped``, ``outer_digest()``, ``blocked_seconds``)."""
        return self._dl

    @property
    def inner_steps(self) -> int:
        return self._dl.inner_steps

    @property
    def outer_steps(self) -> int:
        """Outer steps committed (the elastic job's step)."""
        return self.job.step

    @property
    def rank(self) -> int:
        return self.job.rank

    @property
    def world_size(self) -> int:
        return self.job.world_size

    @property
    def epoch(self) -> int:
        return self.job.epoch

    @property
    def changes(self) -> list[EpochChange]:
        return self.job.changes

    def step(self) -> bool:
        """Call after every inner ``optimizer.step()``. Every ``sync_every`` calls, runs the
        outer step over the live members (redone among the survivors if a member is lost),
        then admits newcomers. Returns True when an outer step was committed."""
        dl = self._dl
        if (dl.inner_steps + 1) % dl.sync_every:
            dl.inner_steps += 1
            return False
        frag = dl._fragments[0]
        residual = None if frag.residual is None else frag.residual.clone()
        while True:
            before = self.job.step
            dl.group = self.job.group
            try:
                dl.step()
            except MCPError:
                dl.inner_steps -= 1
                frag.residual, frag.pending = residual, None
                self.job.abandon()
                self.job.begin()  # the survivors' epoch (bounded by the job's timeout)
                if self.job.step > before:
                    return True  # others completed it: this member took their θ_outer
                continue
            self.job.commit()
            self.job.begin()  # newcomers are admitted here, healed with the new θ_outer
            return True

    def close(self) -> None:
        """Leaves the job."""
        self.job.close()

    def _save(self) -> bytes:
        buf = io.BytesIO()
        torch.save({"diloco": self._dl.state_dict(), "inner": self.optimizer.state_dict()}, buf)
        return buf.getvalue()

    def _load(self, data: bytes) -> None:
        state = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        self._dl.load_state_dict(state["diloco"])
        self.optimizer.load_state_dict(state["inner"])
