"""torch's ``ReduceOp`` as the core's op name, with ``PREMUL_SUM``'s factor.

``PREMUL_SUM`` (``dist._make_nccl_premul_sum(f)``; FSDP2 reduce-scatters with it after
``set_gradient_divide_factor``) is NCCL's: every rank's tensor is multiplied by ``f`` and
the products summed. The core sums; the factor is applied here, to the rank's own buffer,
before its bytes enter the collective. Gloo refuses the op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Reduction:
    """What the core reduces with (``op``) and the factor each rank's input is scaled by
    first (``factor``: ``PREMUL_SUM`` only)."""

    op: str
    factor: float | torch.Tensor | None = None

    def premultiply_(self, buf: torch.Tensor) -> None:
        """Scales ``buf`` in place by the factor (nothing without one). ``buf`` must be a
        buffer the operation owns, or one its result overwrites."""
        if self.factor is None:
            return
        if not (buf.is_floating_point() or buf.is_complex()):
            raise ValueError(
                f"PREMUL_SUM multiplies each rank's tensor by {self._factor_text()}, which a "
                f"{buf.dtype} tensor cannot hold: reduce with SUM and scale the result, or "
                "use a floating-point tensor"
            )
        factor = self.factor
        if isinstance(factor, torch.Tensor):  # one element: torch checks that on creation
            factor = factor.detach().reshape(()).to(device=buf.device, dtype=buf.dtype)
        try:
            buf.mul_(factor)
        except (RuntimeError, NotImplementedError) as e:
            raise ValueError(
                f"PREMUL_SUM cannot scale a {buf.dtype} tensor here ({e}): use a float16, "
                "bfloat16, float32 or float64 tensor"
            ) from e

    def _factor_text(self) -> str:
        f = self.factor
        return str(f.detach().cpu().reshape(-1).tolist()) if isinstance(f, torch.Tensor) else str(f)


def reduction(reduce_op: Any) -> Reduction:
    """torch ``ReduceOp`` (or its ``RedOpType``) → :class:`Reduction`. The core knows torch's
    other names and refuses the ones it cannot reduce with a ``ValueError`` naming them."""
    op = getattr(reduce_op, "op", reduce_op)
    name = str(getattr(op, "name", op)).rsplit(".", 1)[-1].lower()
    if name != "premul_sum":
        return Reduction(name)
    factor = getattr(reduce_op, "factor", None)
    if factor is None:
        raise ValueError(
            "ReduceOp.PREMUL_SUM needs its factor: make the op with "
            "torch.distributed._make_nccl_premul_sum(factor)"
        )
    return Reduction("sum", factor)
