"""``chaosmcp``: run a command with damaged MCP frames, and say whether the job healed.

::

    chaosmcp corrupt --probability 0.2 --mode flip_bits [--seed N] [--timeout S]
                     [--report FILE] -- CMD ...
    chaosmcp memory --interval 5m --duration 100ms [--probability 0.05] [--seed N] -- CMD ...

``corrupt`` runs CMD with ``corrupt=P`` in ``MCP_CHAOS`` (merged into an ``MCP_CHAOS``
already set: its other keys are kept, ``corrupt`` and ``seed`` are replaced), so that every
mcp_fast group CMD starts damages each frame it sends with probability P, above QUIC, as
host memory errors would. The frame checksums catch the damage and the receiver asks for
the frame again (up to ``MCP_RESEND_LIMIT`` resends; on the FEC lane a damaged shard is an
erasure that the code or a repair shard fills in). The one mode the core has is
``flip_bits``: one bit of a damaged frame's payload is flipped.

After CMD ends, the summary (on stderr, and as JSON with ``--report``) adds up what each
group of CMD counted when it closed (``MCP_CHAOS_REPORT``, a temporary directory): frames
that failed their checksum, frames sent again, FEC repair shards, and whether every frame
found damaged on the stream lane was sent again.

``memory`` runs CMD with memory errors in windows: for ``--duration`` every ``--interval``
(the first window at each group's start), each payload a group sends or receives is damaged
with probability ``--probability`` (default 0.05) — the send buffer after its checksum was
computed, the receive buffer before it is checked — through ``MCP_CHAOS`` keys
``corrupt=P,corrupt_every=...,corrupt_for=...``. The checksums must catch every one and the
resend repair it; the summary says how many payloads were damaged on purpose and how many
failed their checksum. Resends inside a window are damaged too: a try fails with probability
about 2P (sent and received), and a frame fails with ``ProtocolError`` once
``MCP_RESEND_LIMIT`` (8) + 1 tries in a row fail, i.e. with probability (2P)^9 per frame in a
window — 1e-9 at the default, 2e-3 at P = 0.3. Raise ``MCP_RESEND_LIMIT`` for heavier damage.

Exit status: CMD's own, or 128+N when it was ended by signal N; 124 when ``--timeout``
expired; 2 when chaosmcp itself could not run (bad arguments, CMD not found, ``memory``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = ["MODES", "main", "merge_chaos", "parse_duration"]

MODES = {"flip_bits": "one bit of each damaged frame's payload is flipped before it is sent"}
"""The corruption modes of the core (``MCP_CHAOS`` ``corrupt=``), with what each does."""

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """``"100ms"`` → 0.1, ``"5m"`` → 300.0, ``"2s"``, ``"1h"`` (seconds)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)\s*", text)
    if m is None:
        raise ValueError(f"not a duration: {text!r} (examples: 100ms, 30s, 5m, 1h)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _duration(text: str) -> float:
    try:
        d = parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if d <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return d


def _probability(text: str) -> float:
    try:
        p = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < p <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {p}")
    return p


def _mode(text: str) -> str:
    if text not in MODES:
        allowed = "; ".join(f"{k}: {v}" for k, v in MODES.items())
        raise argparse.ArgumentTypeError(
            f"mode {text!r} is not one the core can inject; allowed: {allowed}"
        )
    return text


def _timeout(text: str) -> float:
    try:
        t = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not t > 0:
        raise argparse.ArgumentTypeError("must be positive")
    return t


def merge_chaos(existing: str | None, **keys: Any) -> str:
    """``existing`` (an ``MCP_CHAOS`` spec, or ``None``) with ``keys`` set (``None`` values
    left out); the other keys keep their order and values."""
    parts: dict[str, str] = {}
    for item in (existing or "").split(","):
        item = item.strip()
        if not item:
            continue
        k, sep, v = item.partition("=")
        if not sep:
            raise ValueError(f"MCP_CHAOS={existing!r}: {item!r} is not key=value")
        parts[k.strip()] = v.strip()
    for k, v in keys.items():
        if v is not None:
            parts[k] = str(v)
    return ",".join(f"{k}={v}" for k, v in parts.items())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="chaosmcp",
        description="Run CMD with damaged MCP frames and report whether the job healed.",
    )
    sub = p.add_subparsers(dest="what", required=True, metavar="{corrupt,memory}")
    c = sub.add_parser(
        "corrupt",
        help="damage each frame sent with a probability",
        epilog="Example: chaosmcp corrupt --probability 0.2 --mode flip_bits -- "
        "torchrun --nproc-per-node 2 train.py",
    )
    c.add_argument("--probability", type=_probability, required=True, help="per frame, in (0, 1]")
    c.add_argument("--mode", type=_mode, default="flip_bits", help=f"one of: {', '.join(MODES)}")
    c.add_argument("--seed", type=int, help="seed of the fault injector (MCP_CHAOS seed=)")
    c.add_argument("--timeout", type=_timeout, help="kill CMD after this many seconds (124)")
    c.add_argument("--report", type=Path, help="also write the summary to this JSON file")
    c.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command")
    m = sub.add_parser(
        "memory",
        help="damage sent and received buffers in windows, as memory errors would",
        epilog="Example: chaosmcp memory --interval 5m --duration 100ms -- "
        "torchrun --nproc-per-node 2 train.py",
    )
    m.add_argument("--interval", type=_duration, required=True, help="a window every, e.g. 5m")
    m.add_argument("--duration", type=_duration, required=True, help="each lasting, e.g. 100ms")
    m.add_argument(
        "--probability", type=_probability, default=0.05, help="per payload, in windows (0.05)"
    )
    m.add_argument("--seed", type=int, help="seed of the fault injector (MCP_CHAOS seed=)")
    m.add_argument("--timeout", type=_timeout, help="kill CMD after this many seconds (124)")
    m.add_argument("--report", type=Path, help="also write the summary to this JSON file")
    m.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command")
    return p


def _collect(directory: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted(directory.glob("*.json")):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    return out


def summarize(reports: list[dict[str, Any]], probability: float, mode: str, rc: int) -> dict:
    """The totals of the groups' reports."""

    def total(key: str) -> int:
        return sum(int(r.get("stats", {}).get(key, 0)) for r in reports)

    damaged, resent = total("corrupt_frames"), total("retransmits")
    return {
        "probability": probability,
        "mode": mode,
        "exit_code": rc,
        "groups": len(reports),
        "frames_sent": total("frames_sent"),
        "damaged_on_purpose": sum(int(r.get("chaos_stats", {}).get("damaged", 0)) for r in reports),
        "corrupt_frames": damaged,
        "retransmits": resent,
        "repair_shards": total("repair_shards"),
        "every_damaged_frame_resent": damaged == resent,
    }


def _run(cmd: list[str], env: dict[str, str], timeout: float | None) -> int:
    try:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    except OSError as e:
        print(f"chaosmcp: error: cannot run {cmd[0]!r}: {e}", file=sys.stderr)
        return 2
    seen: list[int] = []

    def forward(sig: int, _frame: FrameType | None) -> None:
        seen.append(sig)
        try:
            os.killpg(proc.pid, sig if len(seen) == 1 else signal.SIGKILL)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in _SIGNALS}
    try:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                rc = proc.wait(timeout=left)
                break
            except subprocess.TimeoutExpired:
                print(f"chaosmcp: {timeout} s passed: killing the command", file=sys.stderr)
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
                return 124
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 128 - rc if rc < 0 else rc


def _us(seconds: float) -> str:
    return f"{round(seconds * 1e6)}us"


def _corrupt(args: argparse.Namespace, cmd: list[str]) -> int:
    env = dict(os.environ)
    windows: dict[str, Any] = {}
    if args.what == "memory":
        windows = {"corrupt_every": _us(args.interval), "corrupt_for": _us(args.duration)}
    try:
        env["MCP_CHAOS"] = merge_chaos(
            env.get("MCP_CHAOS"), corrupt=args.probability, seed=args.seed, **windows
        )
    except ValueError as e:
        print(f"chaosmcp: error: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="chaosmcp-") as d:
        env["MCP_CHAOS_REPORT"] = d
        rc = _run(cmd, env, args.timeout)
        mode = "memory" if args.what == "memory" else args.mode
        s = summarize(_collect(Path(d)), args.probability, mode, rc)
    s["mcp_chaos"] = env["MCP_CHAOS"]
    if s["groups"] == 0:
        print(
            "chaosmcp: no mcp_fast group reported (did CMD start one, and close it or exit "
            "normally?)",
            file=sys.stderr,
        )
    else:
        verdict = (
            "every frame found damaged was sent again"
            if s["every_damaged_frame_resent"]
            else "not every damaged frame was sent again (FEC lane repairs, or a failure)"
        )
        print(
            f"chaosmcp: MCP_CHAOS={s['mcp_chaos']} ({s['mode']}): {s['groups']} group(s) "
            f"reported {s['frames_sent']} frames sent, {s['damaged_on_purpose']} payloads "
            f"damaged on purpose, {s['corrupt_frames']} failed their "
            f"checksum, {s['retransmits']} resent, {s['repair_shards']} FEC repair shards; "
            f"{verdict}; command exited {rc}",
            file=sys.stderr,
        )
    if args.report is not None:
        args.report.write_text(json.dumps(s, indent=2) + "\n")
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("chaosmcp: error: no command given (put it after --)", file=sys.stderr)
        return 2
    if args.what == "memory":
        if args.duration >= args.interval:
            print(
                f"chaosmcp: error: --duration ({args.duration:g} s) must be shorter than "
                f"--interval ({args.interval:g} s)",
                file=sys.stderr,
            )
            return 2
    return _corrupt(args, cmd)


if __name__ == "__main__":
    sys.exit(main())
