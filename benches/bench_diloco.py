"""DDP every step vs DiLoCo (H = 50) vs streaming DiLoCo (F = 4): held-out loss, bytes on the
wire, wall time and compute utilisation, same machine, same run, same tokens.

    python benches/bench_diloco.py --json bench_diloco.json          # loopback, + chaos as root

Each configuration is ``examples/train_diloco.py --members N`` (a small transformer LM on the
standard library's source). On loopback: DDP over mcp_fast (float32), DiLoCo (with
``--int8``, also DiLoCo with int8), streaming DiLoCo. As root, again inside
``mcp-chaos --rate 100mbit --loss 0.05 --hook input`` (a network namespace whose loopback
is capped at 100 Mbit/s and silently drops 5 % of the packets): DDP over Gloo and DDP
over mcp_fast with int8, each cut after ``--ddp-time-limit`` seconds (their time to the
full token count is then extrapolated from the steps they did: said in the table), DiLoCo
and streaming DiLoCo.

Bytes are what every member's transport sent (mcp_fast's counters, QUIC headers, FEC repair
and heartbeats included); Gloo has no counters, so its row shows the float32 ring
all-reduce's payload, a lower bound.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train_diloco.py"


def run(name: str, args: list[str], a: argparse.Namespace, chaos: bool) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="bench-diloco-")) / "r.json"
    cmd = [sys.executable, str(TRAIN), "--members", str(a.members), "--steps", str(a.steps)]
    cmd += ["--quiet", "--json", str(out), *args]
    if chaos:
        chaos_bin = shutil.which("mcp-chaos") or str(Path(sys.executable).parent / "mcp-chaos")
        cmd = [chaos_bin, "--rate", "100mbit", "--loss", "0.05", "--hook", "input"]
        cmd += ["--timeout", str(a.run_timeout), "--", sys.executable, str(TRAIN)]
        cmd += ["--members", str(a.members), "--steps", str(a.steps), "--quiet"]
        cmd += ["--json", str(out), *args]
    started = time.monotonic()
    print(f"[{name}] {' '.join(cmd)}", file=sys.stderr, flush=True)
    p = subprocess.run(cmd, timeout=a.run_timeout + 60, capture_output=True, text=True)
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-4000:], file=sys.stderr)
        return {"name": name, "failed": p.returncode}
    r = json.loads(out.read_text())
    r["name"] = name
    r["link"] = "100 Mbit/s, 5 % loss" if chaos else "loopback"
    r["process_s"] = time.monotonic() - started
    done = max(1, r["inner_steps"])
    r["wall_full_s"] = r["wall_s"] * a.steps / done
    print(
        f"[{name}] loss {r['eval_loss']:.4f} wall {r['wall_s']:.1f} s "
        f"util {r['utilisation']} bytes {r['bytes_sent'] / 1e6:.1f} MB",
        file=sys.stderr,
        flush=True,
    )
    return r


def table(rows: list[dict[str, Any]], ref_loss: float, ref_bytes: float) -> str:
    lines = [
        "| link | run | steps done | held-out loss | vs DDP | MB sent (all members) | "
        "fewer bytes | wall s | wall s, full run | utilisation |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "failed" in r:
            lines.append(f"| | {r['name']} | failed ({r['failed']}) | | | | | | | |")
            continue
        cut = r["stopped_early"]
        loss = "(cut)" if cut else f"{r['eval_loss']:.4f}"
        rel = "" if cut else f"{(r['eval_loss'] / ref_loss - 1) * 100:+.1f} %"
        fewer_s = f"{ref_bytes / r['bytes_sent']:.0f}x" if not cut else ""
        full = f"{r['wall_full_s']:.1f}" + (" (extrapolated)" if cut else "")
        lines.append(
            f"| {r['link']} | {r['name']} | {r['inner_steps']} | {loss} | {rel} | "
            f"{r['bytes_sent'] / 1e6:.1f} | {fewer_s} | {r['wall_s']:.1f} | {full} | "
            f"{'n/a' if r['utilisation'] is None else format(r['utilisation'], '.3f')} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--members", type=int, default=4)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--sync-every", type=int, default=50)
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--ddp-time-limit", type=float, default=60.0)
    p.add_argument("--run-timeout", type=int, default=400)
    p.add_argument("--no-chaos", action="store_true", help="loopback only")
    p.add_argument("--int8", action="store_true", help="also DiLoCo with int8 on loopback")
    p.add_argument("--only", help="comma-separated run names")
    p.add_argument("--json", help="write every run's results here")
    p.add_argument("extra", nargs="*", help="more arguments for train_diloco.py (after --)")
    a = p.parse_args()
    h = ["--sync-every", str(a.sync_every), *a.extra]
    lim = ["--time-limit", str(a.ddp_time_limit)]
    stream = [*h, "--fragments", str(a.fragments)]
    plan: list[tuple[str, list[str], bool]] = [
        ("DDP mcp_fast", ["--mode", "ddp", *a.extra], False),
        (f"DiLoCo H={a.sync_every}", h, False),
        (f"streaming F={a.fragments}", stream, False),
    ]
    if a.int8:
        plan.insert(2, (f"DiLoCo H={a.sync_every} int8", [*h, "--codec", "int8"], False))
    can_chaos = os.geteuid() == 0 and shutil.which("tc") and shutil.which("nft")
    if not a.no_chaos and can_chaos:
        plan += [
            ("DDP Gloo", ["--mode", "ddp", "--backend", "gloo", *lim, *a.extra], True),
            ("DDP mcp_fast int8", ["--mode", "ddp", "--codec", "int8", *lim, *a.extra], True),
            (f"DiLoCo H={a.sync_every}", h, True),
            (f"streaming F={a.fragments}", stream, True),
        ]
    elif not a.no_chaos:
        print("not root (or tc/nft missing): the 100 Mbit/s runs are skipped", file=sys.stderr)
    if a.only:
        keep = set(a.only.split(","))
        plan = [x for x in plan if x[0] in keep]
    rows = [run(name, args, a, chaos) for name, args, chaos in plan]
    ref = next(r for r in rows if r.get("name") == "DDP mcp_fast" and "failed" not in r)
    text = table(rows, ref["eval_loss"], ref["bytes_sent"])
    print(text)
    meta = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
    }
    print(json.dumps(meta))
    if a.json:
        Path(a.json).write_text(json.dumps({"meta": meta, "runs": rows, "table": text}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
