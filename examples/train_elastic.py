"""Train a character-level language model on real text in an elastic job: start any number of
these, kill some, start more; the others keep training, newcomers heal from a live member.

    export MCP_SECRET=$(openssl rand -hex 32)
    mcp-coordinator --bind 127.0.0.1:29400 &
    python examples/train_elastic.py --join 127.0.0.1:29400 --steps 300 &   # as many as you like
    python examples/train_elastic.py --join 127.0.0.1:29400 --steps 300 --json out.json

The text is the Python standard library's own source (a few MB that ship with every Python);
some files are held out for evaluation. Each step, the members together draw one global
batch from a generator seeded by the step number, and each member takes its share of it by
rank, so the data any step sees depends only on the step and the members, never on who
died. ``--json OUT`` writes what this process did: the steps it committed, the epochs it saw,
the final losses and the SHA3-256 of its final parameters (equal on every member).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from mcp_fast.torch import ElasticDDP
from stdlib_text import VOCAB, corpus

CONTEXT = 16


class CharModel(nn.Module):
    """Embeddings of the last CONTEXT characters, two hidden layers, the next character."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 24)
        self.net = nn.Sequential(
            nn.Linear(24 * CONTEXT, width),
            nn.GELU(),
            nn.Linear(width, width),
            nn.GELU(),
            nn.Linear(width, VOCAB),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.embed(x).flatten(1))


def windows(text: np.ndarray, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + np.arange(CONTEXT + 1)[None, :]
    w = torch.from_numpy(text[idx])
    return w[:, :CONTEXT], w[:, CONTEXT]


def batch(text: np.ndarray, step: int, rank: int, world: int, per_rank: int, seed: int):
    """This member's share of step ``step``'s global batch."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, text.size - CONTEXT - 1, size=per_rank * world)
    return windows(text, starts[rank * per_rank : (rank + 1) * per_rank])


@torch.no_grad()
def evaluate(model: nn.Module, text: np.ndarray, n: int = 4096) -> float:
    starts = np.random.default_rng(12345).integers(0, text.size - CONTEXT - 1, size=n)
    x, y = windows(text, starts)
    return float(nn.functional.cross_entropy(model(x), y))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--join", default=os.environ.get("MCP_COORDINATOR"), help="HOST:PORT")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32, help="samples per member per step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-bytes", type=int, default=2 << 20)
    p.add_argument("--json", help="write what this process did here")
    p.add_argument("--digests", action="store_true", help="record the state digest per step")
    p.add_argument("--timeline", help="append 'step epoch unix-time' to this file at every commit")
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step")
    p.add_argument("--status", help="rewrite this file with epoch, rank and step at each change")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args()
    if not a.join:
        p.error("--join HOST:PORT (or MCP_COORDINATOR) is required")
    torch.set_num_threads(1)
    train, held = corpus(a.corpus_bytes)
    torch.manual_seed(a.seed)
    model = CharModel()
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    ddp = ElasticDDP(model, opt, coordinator=a.join)
    loss_fn = nn.CrossEntropyLoss()
    committed, epochs, digests = 0, [], {}
    last_loss = float("nan")
    started = time.monotonic()
    timeline = open(a.timeline, "a", buffering=1) if a.timeline else None
    # a progress bar on a terminal (tqdm), unless --quiet
    bar = tqdm(total=a.steps, desc="steps", disable=a.quiet or not sys.stderr.isatty())
    try:
        while ddp.step < a.steps:
            ddp.begin()
            if not epochs or epochs[-1] != ddp.epoch:
                epochs.append(ddp.epoch)
                if a.status:
                    tmp = a.status + ".tmp"
                    Path(tmp).write_text(
                        json.dumps(
                            {"epoch": ddp.epoch, "rank": ddp.rank, "world_size": ddp.world_size}
                        )
                    )
                    os.replace(tmp, a.status)
                if not a.quiet:
                    tqdm.write(
                        f"[{ddp.job.member_id:x}] epoch {ddp.epoch}: rank {ddp.rank} of "
                        f"{ddp.world_size} at step {ddp.step}",
                        file=sys.stderr,
                    )
            x, y = batch(train, ddp.step, ddp.rank, ddp.world_size, a.batch, a.seed)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            if a.step_sleep:
                time.sleep(a.step_sleep)
            if ddp.commit():
                committed += 1
                last_loss = loss.item()
                if a.digests:
                    digests[ddp.step] = [ddp.epoch, ddp.state_digest()]
                if timeline is not None:
                    timeline.write(f"{ddp.step} {ddp.epoch} {time.time():.6f}\n")
                bar.set_postfix(loss=f"{last_loss:.3f}", members=ddp.world_size, refresh=False)
            bar.update(ddp.step - bar.n)  # a step a newcomer healed past counts too
    finally:
        bar.close()
        final = {
            "member_id": ddp.job.member_id,
            "steps_committed": committed,
            "final_step": ddp.step,
            "epochs": epochs,
            "failed_steps": ddp.job.failed_steps,
            "changes": [c.__dict__ for c in ddp.changes],
            "train_loss": last_loss,
            "eval_loss": evaluate(model, held),
            "sha3": ddp.state_digest(),
            "seconds": time.monotonic() - started,
        }
        if a.digests:
            final["digests"] = digests
        ddp.close()
        if timeline is not None:
            timeline.close()
    if not a.quiet:
        print(json.dumps({k: v for k, v in final.items() if k not in ("changes", "digests")}))
    if a.json:
        Path(a.json).write_text(json.dumps(final))
    return 0


if __name__ == "__main__":
    sys.exit(main())
