"""Recovery of an elastic job against torchrun's restart-everything, on the same model.

    python benches/bench_elastic.py [--members 4] [--kills 20] [--steps 1500]
                                    [--torchrun-kills 3] [--json OUT]

1. **mcp_fast elastic**: ``--members`` processes of ``examples/train_elastic.py`` and an
   ``mcp-coordinator`` on 127.0.0.1. ``--kills`` times, a random member is killed with
   SIGKILL at a random moment and a replacement is started at once (as torchrun or a
   scheduler would). Recovery = kill → the first step a survivor commits in the epoch formed
   after it (every member writes a timeline of its commits). Also: steps abandoned, the
   final held-out loss.
2. **the same run without failures**: the loss to compare with (goal: within 2 %).
3. **torchrun, restart everything**: the same model under DDP on Gloo, checkpointing to disk
   every ``--ckpt-every`` steps; a killed worker makes torchrun stop the others, and every
   worker starts again and reloads the checkpoint. (torchrun's own ``--max-restarts``
   restarts fail Gloo's second rendezvous with torch 2.13 here, "connectFullMesh failed ...
   Connection refused", so the bench starts torchrun again itself: the same work.)
   Recovery = kill → the first step committed after the restart; the steps since the
   checkpoint are lost.

Prints a table (median / max recovery, steps lost, final loss) and writes it with
``--json``. Timings are loopback and this machine's CPUs: the detection part (the
coordinator's ``--dead-after``, 0.5 s) dominates the elastic figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train_elastic.py"
WORKER = Path(__file__).resolve().parent / "_torchrun_ckpt_worker.py"


def read_timelines(d: Path) -> list[tuple[int, int, float]]:
    out = []
    for f in d.glob("*.timeline"):
        for line in f.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3:
                out.append((int(parts[0]), int(parts[1]), float(parts[2])))
    return sorted(out, key=lambda r: r[2])


def elastic_run(args: argparse.Namespace, kills: int, tmp: Path) -> dict:
    env = {**os.environ, "MCP_SECRET": "bench-elastic", "OMP_NUM_THREADS": "1"}
    coord = subprocess.Popen(
        [sys.executable, "-m", "mcp_fast.cli.coordinator", "--bind", "127.0.0.1:0"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert coord.stdout is not None
    addr = coord.stdout.readline().split()[-1]
    procs: dict[int, subprocess.Popen] = {}
    n = 0

    def spawn() -> None:
        nonlocal n
        n += 1
        procs[n] = subprocess.Popen(
            [
                sys.executable,
                str(TRAIN),
                "--join",
                addr,
                "--steps",
                str(args.steps),
                "--step-sleep",
                str(args.step_sleep),
                "--quiet",
                "--timeline",
                str(tmp / f"{n}.timeline"),
                "--json",
                str(tmp / f"{n}.json"),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    rng = random.Random(args.seed)
    kill_times = []
    try:
        for _ in range(args.members):
            spawn()
        # Wait until the job trains with every member.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not read_timelines(tmp):
            time.sleep(0.1)
        for _ in tqdm(range(kills), desc="elastic kills", disable=not kills, file=sys.stderr):
            time.sleep(rng.uniform(args.kill_gap * 0.5, args.kill_gap * 1.5))
            # Only members that train: a replacement still starting up is not a failure.
            alive = [
                k
                for k, p in procs.items()
                if p.poll() is None
                and (tmp / f"{k}.timeline").exists()
                and (tmp / f"{k}.timeline").stat().st_size > 0
            ]
            if len(alive) < 2:
                continue
            victim = rng.choice(alive)
            kill_times.append(time.time())
            procs[victim].send_signal(signal.SIGKILL)
            procs[victim].wait()
            spawn()
        for p in procs.values():
            p.wait(timeout=600)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        coord.kill()
        coord.wait()
        coord.stdout.close()
    timeline = read_timelines(tmp)
    recoveries = []
    for t in kill_times:
        # The first step committed in an epoch that formed after the kill (a step already
        # in flight may still complete in the old epoch just after it).
        before = max((c[1] for c in timeline if c[2] <= t), default=0)
        after = [c for c in timeline if c[2] > t and c[1] > before]
        if after:
            recoveries.append(after[0][2] - t)
    results = [json.loads(f.read_text()) for f in tmp.glob("*.json")]
    finished = [r for r in results if r["final_step"] == args.steps]
    t0 = timeline[0][2] if timeline else 0.0
    return {
        "recoveries": recoveries,
        # for benches/plots.py: the job's committed steps over time, and when each kill was
        "kills": [round(t - t0, 3) for t in kill_times],
        "commits": _progress([(c[2] - t0, c[0]) for c in timeline]),  # (step, epoch, time)
        "failed_steps": sum(r["failed_steps"] for r in results),
        "eval_loss": finished[0]["eval_loss"] if finished else float("nan"),
        "same_state": len({r["sha3"] for r in finished}) == 1,
        "members_finished": len(finished),
        "wall": max((r["seconds"] for r in finished), default=float("nan")),
    }


def torchrun_run(args: argparse.Namespace, tmp: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    timeline = tmp / "torchrun.timeline"
    ckpt = tmp / "ckpt.pt"

    def launch() -> subprocess.Popen:
        port = 29000 + random.randrange(900)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.members}",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            str(WORKER),
            "--steps",
            str(args.torchrun_steps),
            "--step-sleep",
            str(args.step_sleep),
            "--ckpt",
            str(ckpt),
            "--ckpt-every",
            str(args.ckpt_every),
            "--timeline",
            str(timeline),
            "--json",
            str(tmp / "torchrun.json"),
        ]
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait_commit_after(t: float) -> None:
        end = time.monotonic() + 180
        while time.monotonic() < end and not [r for r in _timeline(timeline) if r[1] > t]:
            time.sleep(0.05)

    rng = random.Random(args.seed + 1)
    kills = []
    run = launch()
    try:
        wait_commit_after(0.0)
        for _ in tqdm(range(args.torchrun_kills), desc="torchrun kills", file=sys.stderr):
            time.sleep(rng.uniform(args.kill_gap * 0.5, args.kill_gap * 1.5))
            workers = [
                int(p)
                for p in subprocess.run(
                    ["pgrep", "-f", f"python[^ ]* -u {WORKER}"], capture_output=True, text=True
                ).stdout.split()
            ]
            if not workers or run.poll() is not None:
                break
            kills.append((time.time(), _last_step(timeline), 0.0))
            os.kill(rng.choice(workers), signal.SIGKILL)
            # torchrun stops the other workers; all of them start again from the checkpoint.
            run.wait(timeout=120)
            relaunched = time.time()
            kills[-1] = (kills[-1][0], kills[-1][1], relaunched)
            run = launch()
            wait_commit_after(relaunched)
        run.wait(timeout=900)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    rows = _timeline(timeline)
    recoveries, lost = [], []
    for t, step_at_kill, relaunched in kills:
        after = [r for r in rows if r[1] > relaunched]
        if after:
            recoveries.append(after[0][1] - t)
            lost.append(max(0, step_at_kill + 1 - after[0][0]))
    out_f = tmp / "torchrun.json"
    out = json.loads(out_f.read_text()) if out_f.exists() else {}
    t0 = rows[0][1] if rows else 0.0
    return {
        "recoveries": recoveries,
        "kills": [round(t - t0, 3) for t, _, _ in kills],
        "commits": _progress([(r[1] - t0, r[0]) for r in rows]),
        "steps_lost": sum(lost),
        "eval_loss": out.get("eval_loss", float("nan")),
    }


def _timeline(f: Path) -> list[tuple[int, float]]:
    if not f.exists():
        return []
    rows = []
    for line in f.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            rows.append((int(parts[0]), float(parts[1])))
    return rows


def _progress(points: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """(seconds, step) of every commit, in time order, as the job's progress line: the steps a
    restart redoes show as a drop."""
    out: list[tuple[float, int]] = []
    for t, step in sorted(points):
        if not out or out[-1][1] != step:  # the first member to commit a step marks it
            out.append((round(t, 3), step))
    return out


def _last_step(f: Path) -> int:
    rows = _timeline(f)
    return rows[-1][0] if rows else 0


def summary(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs) * 1000:.0f} ms / {max(xs) * 1000:.0f} ms"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--members", type=int, default=4)
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--step-sleep", type=float, default=0.02)
    p.add_argument("--kill-gap", type=float, default=2.0, help="mean seconds between kills")
    p.add_argument("--torchrun-kills", type=int, default=3)
    p.add_argument("--torchrun-steps", type=int, default=600)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json")
    a = p.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory() as d0, tempfile.TemporaryDirectory() as d1:
        faulty = elastic_run(a, a.kills, Path(d0))
        clean = elastic_run(a, 0, Path(d1))
    with tempfile.TemporaryDirectory() as d2:
        tr = torchrun_run(a, Path(d2)) if a.torchrun_kills > 0 else None
    gap = (faulty["eval_loss"] - clean["eval_loss"]) / clean["eval_loss"] * 100
    print(f"elastic, {a.members} members, {len(faulty['recoveries'])} kills + restarts:")
    print(
        f"  recovery (kill -> next committed step), median / max: {summary(faulty['recoveries'])}"
    )
    print(f"  steps abandoned (all members): {faulty['failed_steps']}")
    print(
        f"  final held-out loss {faulty['eval_loss']:.4f} vs {clean['eval_loss']:.4f} "
        f"without failures ({gap:+.2f} %); identical final state on all "
        f"{faulty['members_finished']} finishers: {faulty['same_state']}"
    )
    if tr is not None:
        print(f"torchrun restart-everything, Gloo DDP, checkpoint every {a.ckpt_every} steps:")
        print(
            f"  recovery (kill -> next committed step), median / max: {summary(tr['recoveries'])}"
        )
        print(f"  steps lost (redone from the checkpoint): {tr['steps_lost']}")
    if a.json:
        meta = {
            "command": shlex.join(["python", "benches/bench_elastic.py", *sys.argv[1:]]),
            "date": started,
            "cpus": os.cpu_count(),
            "title": f"{a.members} members on loopback: steps committed while members are "
            "killed (kill -9), mcp_fast elastic vs torchrun restart-everything on Gloo",
        }
        clean.pop("commits", None)
        out = {"meta": meta, "elastic": faulty, "clean": clean, "torchrun": tr}
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({**out, "loss_gap_pct": gap}) + "\n")
    return 0 if faulty["same_state"] else 1


if __name__ == "__main__":
    sys.exit(main())
