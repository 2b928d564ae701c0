"""The same DDP training over Gloo and over mcp_fast, same seed, same lossy link, side by side.

    python examples/demo_compare.py [--loss 0.1] [--gloo-limit 90] [--epochs 8] [--seed 0]

Runs ``examples/train_ddp.py`` under ``torchrun --nproc-per-node 2`` twice, first with
``--backend gloo``, then with ``--backend mcp``. When this machine can make a lossy link (root,
with ``ip`` and ``nft``), each run gets a fresh network namespace from ``mcp-chaos`` whose
loopback drops ``--loss`` of the packets at random (Gloo's TCP, mcp_fast's QUIC and torchrun's
store all cross it); elsewhere both run on plain loopback and the table says so. The Gloo run
is bounded by ``--gloo-limit`` seconds: if it hits the bound it is stopped, and the table shows
how far it got. Ends with a table: training time, final loss and held-out accuracy, per
backend. This is what ``make demo`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


def tool(name: str) -> str | None:
    return shutil.which(name, path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")


def lossy_link_possible() -> str | None:
    """None when mcp-chaos can make a lossy link here, else why not."""
    if os.geteuid() != 0:
        return "not root"
    missing = [t for t in ("ip", "nft") if shutil.which(t) is None]
    if missing:
        return f"no {' or '.join(missing)}"
    if tool("mcp-chaos") is None:
        return "no mcp-chaos on PATH"
    return None


def run(backend: str, args: argparse.Namespace, lossy: bool, out: Path, limit: float) -> dict:
    """One training run; returns what train_ddp.py wrote, the run's wall time and whether it
    was cut off."""
    cmd = [tool("torchrun") or "torchrun", "--nproc-per-node", "2", str(HERE / "train_ddp.py")]
    cmd += ["--backend", backend, "--seed", str(args.seed), "--epochs", str(args.epochs)]
    cmd += ["--json", str(out)]
    if lossy:  # mcp-chaos stops CMD after `limit` seconds itself (exit 124)
        chaos = [tool("mcp-chaos") or "mcp-chaos", "--loss", str(args.loss), "--hook", "input"]
        cmd = [*chaos, "--timeout", f"{limit:g}", "--", *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        rc = p.wait(timeout=limit + (30 if lossy else 0))
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
        # its own session (so that the whole run can be stopped): pass Ctrl-C on, too
        os.killpg(p.pid, signal.SIGINT if isinstance(e, KeyboardInterrupt) else signal.SIGTERM)
        try:
            rc = p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            rc = p.wait()
        if isinstance(e, KeyboardInterrupt):
            raise
    wall = time.perf_counter() - t0
    res = json.loads(out.read_text()) if out.exists() else {"rows": [], "seconds": None}
    done = len(res["rows"])
    cut = done < args.epochs and (rc in (124, -signal.SIGTERM, -signal.SIGKILL) or wall >= limit)
    return {**res, "rc": rc, "wall": wall, "cut": cut, "limit": limit, "done": done}


def row(backend: str, r: dict, epochs: int) -> list[str]:
    last = r["rows"][-1] if r["rows"] else None
    if r["cut"]:
        time_s = f"cut off after {r['limit']:g} s"
    elif r["rc"] != 0 and not (last and r["done"] == epochs):
        time_s = f"failed (exit {r['rc']})"
    else:
        time_s = f"{r['seconds']:.1f} s"
    return [
        backend,
        time_s,
        f"{r['done']}/{epochs}",
        f"{last['loss']:.4f}" if last else "-",
        f"{last['accuracy']:.3f}" if last else "-",
        f"{r['wall']:.0f} s",
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loss", type=float, default=0.1, help="share of packets dropped")
    p.add_argument("--gloo-limit", type=float, default=90, help="seconds before Gloo is stopped")
    p.add_argument("--mcp-limit", type=float, default=300, help="seconds before mcp is stopped")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write both runs' results to this file")
    args = p.parse_args()
    why_not = lossy_link_possible() if args.loss > 0 else "--loss 0"
    lossy = why_not is None
    link = f"{args.loss:.0%} random packet loss (mcp-chaos)" if lossy else f"loopback ({why_not})"
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for backend, limit in (("gloo", args.gloo_limit), ("mcp", args.mcp_limit)):
            print(
                f"\n== DDP over {backend}, 2 ranks, {link}, seed {args.seed}, at most {limit:g} s",
                flush=True,
            )
            results[backend] = run(backend, args, lossy, Path(d) / f"{backend}.json", limit)
    head = ["backend", "training time", "epochs", "final loss", "test accuracy", "whole run"]
    rows = [row(b, r, args.epochs) for b, r in results.items()]
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    print(f"\nsame model, data, seed ({args.seed}) and link: {link}")
    for cells in [head, ["-" * w for w in widths], *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
    g, m = results["gloo"], results["mcp"]
    if m["done"] == args.epochs and m["seconds"]:
        if g["cut"]:
            print(
                f"Gloo was stopped after {args.gloo_limit:g} s at epoch {g['done']}/"
                f"{args.epochs}; mcp_fast trained all {args.epochs} epochs in "
                f"{m['seconds']:.1f} s."
            )
        elif g["done"] == args.epochs and g["seconds"]:
            print(
                f"mcp_fast trained {g['seconds'] / m['seconds']:.1f}x faster than Gloo "
                "(training time, without torchrun's start-up)."
            )
    print("(whole run: torchrun, imports and rendezvous included)")
    if args.json:
        Path(args.json).write_text(json.dumps({"link": link, "seed": args.seed, **results}))
    return 0 if m["done"] == args.epochs else 1


if __name__ == "__main__":
    raise SystemExit(main())
