"""Train a small transformer language model on real text with DiLoCo (or local SGD, streaming
DiLoCo, or DDP every step, for comparison) over mcp_fast.

    python examples/train_diloco.py --members 4 --steps 500 --sync-every 50 --codec int8
    python examples/train_diloco.py --members 4 --steps 500 --sync-every 50 --fragments 4
    python examples/train_diloco.py --members 4 --steps 500 --mode ddp              # every step
    python examples/train_diloco.py --members 4 --steps 500 --mode ddp --backend gloo

``--members N`` starts N-1 more processes of this script on 127.0.0.1 and runs rank 0 here;
without it the script is one member, started by torchrun or by hand (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), or of an elastic job (``--join
HOST:PORT``, with ``MCP_SECRET`` and an ``mcp-coordinator``; DiLoCo only).

The text is the Python standard library's own source (``stdlib_text.py``); every 10th file is
held out for evaluation. Every inner step, the members together draw one global batch from
a generator seeded by the step, and each takes its share by rank, so DiLoCo and DDP see the
same tokens. ``--json OUT`` writes the losses, the bytes every member sent, the wall time and
the compute utilisation (time in inner steps / wall time).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import mcp_fast as mcp
from mcp_fast.torch import DiLoCo, ElasticDiLoCo
from mcp_fast.torch.hooks import CompressionState
from stdlib_text import VOCAB, corpus


class TinyLM(nn.Module):
    """A causal transformer over characters: embeddings, ``layers`` pre-norm blocks, a head."""

    def __init__(self, context: int, width: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.pos = nn.Parameter(torch.zeros(context, width))
        block = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        h = self.embed(x) + self.pos[:n]
        h = self.blocks(h, mask=self.mask[:n, :n], is_causal=True)
        return self.head(self.norm(h))


def windows(
    text: np.ndarray, starts: np.ndarray, context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + np.arange(context + 1)[None, :]
    w = torch.from_numpy(text[idx])
    return w[:, :-1], w[:, 1:]


def batch(text: np.ndarray, step: int, rank: int, world: int, per_rank: int, a: Any):
    """This member's share of inner step ``step``'s global batch."""
    rng = np.random.default_rng([a.seed, step])
    starts = rng.integers(0, text.size - a.context - 1, size=per_rank * world)
    return windows(text, starts[rank * per_rank : (rank + 1) * per_rank], a.context)


@torch.no_grad()
def evaluate(model: nn.Module, text: np.ndarray, context: int, n: int = 256) -> float:
    starts = np.random.default_rng(12345).integers(0, text.size - context - 1, size=n)
    x, y = windows(text, starts, context)
    total = 0.0
    for i in range(0, n, 64):
        logits = model(x[i : i + 64])
        total += float(nn.functional.cross_entropy(logits.flatten(0, 1), y[i : i + 64].flatten()))
    return total / math.ceil(n / 64)


def free_port() -> int:
    for _ in range(100):
        port = 20000 + secrets.randbelow(12000)
        try:
            for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
                for p in (port, port + 1):
                    with socket.socket(socket.AF_INET, kind) as s:
                        s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair found in 20000-32000")


def spawn(a: argparse.Namespace, argv: list[str]) -> tuple[list[subprocess.Popen[bytes]], str]:
    """Starts members 1..N-1 of a local job; returns them and the folder they report to."""
    port = free_port()
    out = tempfile.mkdtemp(prefix="diloco-")
    os.environ.update(
        {
            "RANK": "0",
            "WORLD_SIZE": str(a.members),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "MCP_SECRET": os.environ.get("MCP_SECRET") or secrets.token_hex(32),
            "OMP_NUM_THREADS": "1",
        }
    )
    i = argv.index("--members")
    rest = argv[:i] + argv[i + 2 :]
    procs = []
    for r in range(1, a.members):
        env = {**os.environ, "RANK": str(r)}
        cmd = [sys.executable, __file__, *rest, "--quiet", "--report", f"{out}/{r}.json"]
        procs.append(subprocess.Popen(cmd, env=env))
    return procs, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--members", type=int, help="start this many members on 127.0.0.1")
    p.add_argument("--join", help="HOST:PORT of an mcp-coordinator: an elastic job")
    p.add_argument("--mode", choices=["diloco", "ddp"], default="diloco")
    p.add_argument("--backend", choices=["mcp", "gloo"], default="mcp", help="for --mode ddp")
    p.add_argument("--steps", type=int, default=500, help="inner steps (DDP: steps)")
    p.add_argument("--sync-every", type=int, default=50, help="H: inner steps per outer step")
    p.add_argument("--codec", default="none", help="none, fp16, bf16, int8, int4 (DDP: no int4)")
    p.add_argument("--fragments", type=int, default=1, help="F: streaming fragments")
    p.add_argument("--delay", type=int, help="τ: inner steps until a fragment merges")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--lr", type=float, default=3e-3, help="inner AdamW learning rate")
    p.add_argument("--batch", type=int, default=16, help="sequences per member per step")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-bytes", type=int, default=3 << 20)
    p.add_argument("--time-limit", type=float, help="stop (all members together) after S s")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--report", help=argparse.SUPPRESS)
    p.add_argument("--kill-at", type=int, help=argparse.SUPPRESS)  # tests: exit at this step
    p.add_argument("--step-sleep", type=float, default=0.0, help=argparse.SUPPRESS)
    a = p.parse_args()
    torch.set_num_threads(1)
    procs: list[subprocess.Popen[bytes]] = []
    folder = None
    if a.members:
        procs, folder = spawn(a, sys.argv[1:])
    try:
        result = train(a)
    except BaseException:
        for pr in procs:
            pr.kill()
        raise
    if folder is not None:
        members = [result]
        for r, pr in enumerate(procs, start=1):
            rc = pr.wait(timeout=600)
            if rc != 0:
                print(f"member {r} exited with {rc}", file=sys.stderr)
                return 1
            members.append(json.loads(Path(folder, f"{r}.json").read_text()))
        result = merge(members)
    if a.report:
        Path(a.report).write_text(json.dumps(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    if not a.quiet:
        keys = ["mode", "members", "inner_steps", "eval_loss", "wall_s", "utilisation"]
        print(json.dumps({k: result.get(k) for k in [*keys, "bytes_sent"]}))
    return 0


def merge(members: list[dict[str, Any]]) -> dict[str, Any]:
    """One result for the job: rank 0's, with every member's bytes and times."""
    out = dict(members[0])
    out["bytes_sent"] = sum(m["bytes_sent"] for m in members)
    out["bytes_sent_per_member"] = [m["bytes_sent"] for m in members]
    out["wall_s"] = max(m["wall_s"] for m in members)
    util = [m["utilisation"] for m in members]
    out["utilisation"] = None if None in util else sum(util) / len(util)
    out["utilisation_per_member"] = [m["utilisation"] for m in members]
    out["digests"] = [m["digest"] for m in members]
    return out


def train(a: argparse.Namespace) -> dict[str, Any]:
    train_text, held = corpus(a.corpus_bytes)
    torch.manual_seed(a.seed)
    model = TinyLM(a.context, a.width, a.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    loss_fn = nn.CrossEntropyLoss()
    if a.join:
        return train_elastic(a, model, opt, train_text, held)
    group = mcp.init(timeout=120)
    rank, world = group.rank, group.world_size
    stepper: Any
    if a.mode == "diloco":
        dl = DiLoCo(
            model,
            opt,
            group,
            sync_every=a.sync_every,
            codec=a.codec,
            fragments=a.fragments,
            delay=a.delay,
            outer_lr=a.outer_lr,
            outer_momentum=a.outer_momentum,
        )
        stepper = dl.step
    elif a.backend == "mcp":
        dl = None
        stepper = ddp_mcp(model, group, a.codec)
    else:
        dl = None
        stepper, model = ddp_gloo(model, rank, world)
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    bytes0 = group.total_bytes_sent()
    losses: list[tuple[int, float]] = []
    bar = None
    if rank == 0 and not a.quiet:
        from tqdm import tqdm

        bar = tqdm(total=a.steps, unit="step", desc=f"{a.mode} x{world}")
    compute = 0.0
    started = time.monotonic()
    stopped_early = False
    step = 0
    for step in range(a.steps):
        if a.time_limit and step % 10 == 0 and step > 0:
            flag = np.array([time.monotonic() - started > a.time_limit], dtype=np.int32)
            group.all_reduce(flag, op="max")
            if flag[0]:
                stopped_early = True
                break
        if a.kill_at is not None and step == a.kill_at:
            os._exit(3)
        t0 = time.perf_counter()
        x, y = batch(train_text, step, rank, world, a.batch, a)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        if a.mode == "diloco":
            opt.step()
            compute += time.perf_counter() - t0
            stepper()
        else:
            compute += time.perf_counter() - t0
            stepper()  # the gradient all-reduce
            t1 = time.perf_counter()
            opt.step()
            compute += time.perf_counter() - t1
        if step % 10 == 0 or step == a.steps - 1:
            losses.append((step, loss.item()))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
    else:
        step = a.steps
    if dl is not None:
        dl.finish()
    wall = time.monotonic() - started
    if bar is not None:
        bar.close()
    eval_model = model.module if hasattr(model, "module") else model
    result = {
        "mode": a.mode if a.mode == "diloco" else f"ddp-{a.backend}",
        "members": world,
        "rank": rank,
        "inner_steps": step,
        "tokens": step * world * a.batch * a.context,
        "stopped_early": stopped_early,
        "sync_every": a.sync_every if a.mode == "diloco" else 1,
        "codec": a.codec,
        "fragments": a.fragments if a.mode == "diloco" else 0,
        "delay": dl.delay if dl is not None else 0,
        "parameters": sum(p.numel() for p in eval_model.parameters()),
        "train_losses": losses,
        "eval_loss": evaluate(eval_model, held, a.context),
        "bytes_sent": group.total_bytes_sent() - bytes0,
        "wall_s": wall,
        "compute_s": compute,
        "utilisation": compute / wall if wall > 0 else 1.0,
        "blocked_s": dl.blocked_seconds if dl is not None else wall - compute,
        "skipped": dl.skipped if dl is not None else [],
        "digest": dl.outer_digest() if dl is not None else "",
    }
    if a.backend == "gloo" and a.mode == "ddp":
        result["bytes_sent"] = gloo_bytes(eval_model, step, world)
        # DDP's all-reduce runs inside backward(): compute and communication are not apart.
        result["utilisation"] = None
        import torch.distributed as dist

        dist.destroy_process_group()
    group.close()
    return result


def ddp_mcp(model: nn.Module, group: mcp.Group, codec: str):  # type: ignore[no-untyped-def]
    """Averages the gradients over the group every step (DDP's arithmetic), with ``codec``
    and error feedback."""
    params = [p for p in model.parameters() if p.requires_grad]
    state = CompressionState(codec=codec if codec != "none" else "int8", error_feedback=True)

    def all_reduce() -> None:
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
        if codec != "none":
            state.quantise(0, flat)
        group.all_reduce(flat, op="avg", codec=codec)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))  # type: ignore[union-attr]
            offset += p.numel()

    return all_reduce


def ddp_gloo(model: nn.Module, rank: int, world: int):  # type: ignore[no-untyped-def]
    """PyTorch's DistributedDataParallel over Gloo (on MASTER_PORT + 1)."""
    import datetime

    import torch.distributed as dist

    os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + 1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    ddp = nn.parallel.DistributedDataParallel(model)
    return (lambda: None), ddp


def gloo_bytes(model: nn.Module, steps: int, world: int) -> int:
    """Gloo has no byte counters: what its ring all-reduce of float32 gradients sends (per
    member 2 (W-1)/W of the gradient each step), summed over members."""
    n = sum(p.numel() for p in model.parameters())
    return int(steps * 2 * (world - 1) / world * 4 * n)


def train_elastic(a: argparse.Namespace, model: nn.Module, opt: torch.optim.Optimizer, text, held):  # type: ignore[no-untyped-def]
    """One member of an elastic job: outer steps over the live members."""
    loss_fn = nn.CrossEntropyLoss()
    dl = ElasticDiLoCo(
        model,
        opt,
        coordinator=a.join,
        sync_every=a.sync_every,
        codec=a.codec,
        outer_lr=a.outer_lr,
        outer_momentum=a.outer_momentum,
    )
    digests: list[tuple[int, int, str]] = []
    started = time.monotonic()
    while dl.inner_steps < a.steps:
        if a.kill_at is not None and dl.inner_steps == a.kill_at:
            os._exit(3)
        x, y = batch(text, dl.inner_steps, dl.rank, dl.world_size, a.batch, a)
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        if a.step_sleep:
            time.sleep(a.step_sleep)
        if dl.step():
            digests.append((dl.outer_steps, dl.epoch, dl.diloco.outer_digest()))
    result = {
        "mode": "elastic-diloco",
        "inner_steps": dl.inner_steps,
        "outer_steps": dl.outer_steps,
        "eval_loss": evaluate(model, held, a.context),
        "digest": dl.diloco.outer_digest(),
        "digests": digests,
        "changes": [c.__dict__ for c in dl.changes],
        "wall_s": time.monotonic() - started,
        # The last epoch's group: its hosts, and what went through shared memory inside them.
        "hosts": dl.job.group.topology()["hosts"],
        "shm_bytes": dl.job.group.shm_stats()["bytes_sent"],
    }
    dl.close()
    return result


if __name__ == "__main__":
    sys.exit(main())
