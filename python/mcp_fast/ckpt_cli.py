"""``mcp-ckpt``: inspect, verify and restore delta checkpoints written by
:class:`mcp_fast.checkpoint.DeltaCheckpointer`.

Commands::

    mcp-ckpt info DIR                list the committed steps (kind, base, sizes, ratio)
    mcp-ckpt verify DIR              decode every step and check every hash (exit 1 if damaged)
    mcp-ckpt restore DIR STEP OUT    write the state of STEP to OUT: a ``torch.save`` file, or a
                                     numpy ``.npz`` of every tensor by path when OUT ends in .npz
                                     (``bfloat16`` is widened, exactly, to ``float32`` there)
    mcp-ckpt stats DIR [--step S]    stored size and compression ratio of every tensor

Exit status: 0 on success, 1 when ``verify`` finds damage, 2 on any other error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mcp_fast.checkpoint import CheckpointError, DeltaCheckpointer

__all__ = ["main"]


def _ratio(raw: int, stored: int) -> str:
    return f"{raw / stored:.2f}x" if stored else "-"


def _info(args: argparse.Namespace) -> int:
    ckpt = DeltaCheckpointer(args.dir)
    steps = ckpt.info()
    if not steps:
        print(f"{args.dir}: no checkpoint")
        return 0
    print(f"{'step':>12} {'kind':>5} {'base':>12} {'tensors':>7} {'raw':>12} {'stored':>12} ratio")
    for s in steps:
        base = "-" if s.base is None else str(s.base)
        print(
            f"{s.step:>12} {s.kind:>5} {base:>12} {s.tensors:>7} {s.raw_bytes:>12} "
            f"{s.stored_bytes:>12} {_ratio(s.raw_bytes, s.stored_bytes)}"
        )
    raw = sum(s.raw_bytes for s in steps)
    stored = sum(s.stored_bytes for s in steps)
    print(f"{len(steps)} steps, {raw} bytes of tensors stored in {stored} ({_ratio(raw, stored)})")
    return 0


#: ``verify`` shows a progress bar (tqdm, when installed) on a terminal above this many
#: stored bytes.
PROGRESS_ABOVE = 256 << 20


def _progress_bar(total: int, desc: str) -> Any:
    """A tqdm bar of ``total`` bytes on stderr, or None (not a terminal, small, no tqdm)."""
    if total <= PROGRESS_ABOVE or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr, leave=False)


def _verify(args: argparse.Namespace) -> int:
    ckpt = DeltaCheckpointer(args.dir)
    sizes = {s.step: s.stored_bytes for s in ckpt.info()} if sys.stderr.isatty() else {}
    bar = _progress_bar(sum(sizes.values()), "verify")
    try:
        results = ckpt.verify(
            progress=None if bar is None else lambda r: bar.update(sizes.get(r.step, 0))
        )
    finally:
        if bar is not None:
            bar.close()
    for r in results:
        print(f"step {r.step}: OK" if r.ok else f"step {r.step}: FAILED: {r.error}")
    bad = sum(not r.ok for r in results)
    print(f"{len(results) - bad} of {len(results)} steps OK")
    return 1 if bad else 0


def _flatten(x: Any, path: str, out: dict[str, np.ndarray]) -> None:
    if isinstance(x, dict):
        for k, v in x.items():
            _flatten(v, f"{path}/{k}", out)
    elif isinstance(x, list | tuple):
        for i, v in enumerate(x):
            _flatten(v, f"{path}/{i}", out)
    elif isinstance(x, np.ndarray | np.generic):
        out[path] = np.asarray(x)
    elif type(x).__module__.startswith("torch") and hasattr(x, "detach"):
        import torch

        t = x.detach().cpu()
        out[path] = (t.float() if t.dtype == torch.bfloat16 else t).numpy()
    elif isinstance(x, bool | int | float | complex | str | bytes) or x is None:
        out[path] = np.asarray(x if x is not None else np.nan)


def _restore(args: argparse.Namespace) -> int:
    state = DeltaCheckpointer(args.dir).load(args.step)
    out = Path(args.out)
    if out.suffix == ".npz":
        arrays: dict[str, np.ndarray] = {}
        _flatten(state, "", arrays)
        np.savez(out, **{k.lstrip("/") or "value": v for k, v in arrays.items()})
    else:
        import torch

        torch.save(state, out)
    print(f"step {args.step} written to {out}")
    return 0


def _stats(args: argparse.Namespace) -> int:
    ckpt = DeltaCheckpointer(args.dir)
    steps = ckpt.steps()
    if not steps:
        print(f"{args.dir}: no checkpoint")
        return 0
    step = steps[-1] if args.step is None else args.step
    records = ckpt.records(step)
    print(f"step {step}")
    print(f"{'tensor':<48} {'dtype':>9} {'mode':>9} {'raw':>12} {'stored':>12} ratio")
    for r in records:
        print(
            f"{r.path:<48} {r.dtype:>9} {r.mode:>9} {r.nbytes:>12} {r.length:>12} "
            f"{_ratio(r.nbytes, r.length)}"
        )
    raw = sum(r.nbytes for r in records)
    stored = sum(r.length for r in records)
    print(f"{'total':<48} {'':>9} {'':>9} {raw:>12} {stored:>12} {_ratio(raw, stored)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``mcp-ckpt``."""
    p = argparse.ArgumentParser(
        prog="mcp-ckpt",
        description="Inspect, verify and restore mcp_fast delta checkpoints.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = sub.add_parser("info", help="list the committed steps")
    s.add_argument("dir", help="checkpoint directory")
    s.set_defaults(func=_info)
    s = sub.add_parser("verify", help="decode every step and check every hash")
    s.add_argument("dir", help="checkpoint directory")
    s.set_defaults(func=_verify)
    s = sub.add_parser(
        "restore",
        help="write one step's state to a torch.save file (or .npz)",
        description="Write the state saved at STEP to OUT: a torch.save file, or, when OUT ends "
        "in .npz, a numpy archive of every tensor and scalar keyed by its path (bfloat16 "
        "widened exactly to float32).",
    )
    s.add_argument("dir", help="checkpoint directory")
    s.add_argument("step", type=int, help="the step to restore")
    s.add_argument("out", help="output file (.pt for torch.save, .npz for numpy)")
    s.set_defaults(func=_restore)
    s = sub.add_parser("stats", help="compression ratio of every tensor of a step")
    s.add_argument("dir", help="checkpoint directory")
    s.add_argument("--step", type=int, default=None, help="the step (default: the latest)")
    s.set_defaults(func=_stats)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``mcp-ckpt`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except CheckpointError as e:
        print(f"mcp-ckpt: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
