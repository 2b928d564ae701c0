"""The baseline of bench_elastic.py: the same model under DDP on Gloo, launched by
``torchrun --max-restarts``, checkpointing to disk; after a restart every worker reloads the
last checkpoint. Rank 0 appends 'step unix-time' to ``--timeline`` at every step."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from train_elastic import CharModel, batch, corpus, evaluate


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--timeline", required=True)
    p.add_argument("--json", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    train, held = corpus(2 << 20)
    torch.manual_seed(0)
    model = CharModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = 0
    if os.path.exists(a.ckpt):
        state = torch.load(a.ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = int(state["step"])
    ddp = nn.parallel.DistributedDataParallel(model)
    loss_fn = nn.CrossEntropyLoss()
    timeline = open(a.timeline, "a", buffering=1) if rank == 0 else None
    while step < a.steps:
        x, y = batch(train, step, rank, world, 32, 0)
        opt.zero_grad(set_to_none=True)
        loss_fn(ddp(x), y).backward()
        if a.step_sleep:
            time.sleep(a.step_sleep)
        opt.step()
        step += 1
        if timeline is not None:
            timeline.write(f"{step} {time.time():.6f}\n")
        if rank == 0 and step % a.ckpt_every == 0:
            tmp = a.ckpt + ".tmp"
            torch.save(
                {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp
            )
            os.replace(tmp, a.ckpt)
    if rank == 0:
        Path(a.json).write_text(json.dumps({"eval_loss": evaluate(model, held), "step": step}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
