"""``mcp-diag``: measure what a training job's performance rests on.

Commands::

    mcp-diag disk --path DIR [--size 4MiB] [--count 50] [--json]

``disk`` writes ``count`` blocks of ``size`` random bytes to a temporary file in DIR, calling
``fsync`` after each, and reports the latency of each write+fsync (p50, p99, max) and the
throughput (bytes written / total time): what a checkpoint write to that filesystem costs.
The temporary file is removed afterwards, also on error or Ctrl-C.

Exit status: 0 on success, 2 on an error (bad arguments, path not writable, no space).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence

from . import parse_size

__all__ = ["disk_latency", "main"]


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending, non-empty list."""
    rank = max(1, min(len(sorted_values), math.ceil(q * len(sorted_values))))
    return sorted_values[rank - 1]


def disk_latency(path: str, size: int, count: int) -> dict[str, float | int | str]:
    """Write+fsync ``count`` blocks of ``size`` bytes in ``path``; latencies in seconds."""
    if size <= 0 or count <= 0:
        raise ValueError("size and count must be positive")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: not a directory")
    free = shutil.disk_usage(path).free
    if free < size * count + (64 << 20):
        raise OSError(f"{path}: {free} bytes free, the test needs {size * count} and a margin")
    block = os.urandom(size)
    fd, name = tempfile.mkstemp(prefix=".mcp-diag-", dir=path)
    lat: list[float] = []
    try:
        start = time.perf_counter()
        for _ in range(count):
            t0 = time.perf_counter()
            view = memoryview(block)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
            lat.append(time.perf_counter() - t0)
        total = time.perf_counter() - start
    finally:
        os.close(fd)
        os.unlink(name)
    lat.sort()
    return {
        "path": os.path.abspath(path),
        "size": size,
        "count": count,
        "p50_s": _percentile(lat, 0.50),
        "p99_s": _percentile(lat, 0.99),
        "max_s": lat[-1],
        "throughput_Bps": size * count / total if total > 0 else float("inf"),
    }


def _disk(args: argparse.Namespace) -> int:
    r = disk_latency(args.path, args.size, args.count)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"disk {r['path']}: {r['count']} x {r['size']} bytes, write + fsync each")
    print(
        f"  latency p50 {r['p50_s'] * 1e3:.2f} ms   p99 {r['p99_s'] * 1e3:.2f} ms   "
        f"max {r['max_s'] * 1e3:.2f} ms"
    )
    print(f"  throughput {float(r['throughput_Bps']) / 1e6:.1f} MB/s")
    return 0


def _size(text: str) -> int:
    try:
        n = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return n


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 1 <= n <= 100_000:
        raise argparse.ArgumentTypeError("must be between 1 and 100000")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mcp-diag",
        description="Diagnose what distributed training with mcp_fast depends on.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    d = sub.add_parser(
        "disk",
        help="write + fsync latency and throughput of a filesystem",
        description="Write COUNT blocks of SIZE random bytes to a temporary file in PATH, "
        "fsync after each, report latency p50/p99/max and throughput, remove the file.",
    )
    d.add_argument("--path", required=True, help="a directory on the filesystem to test")
    d.add_argument("--size", type=_size, default=4 << 20, help="block size (default 4MiB)")
    d.add_argument("--count", type=_count, default=50, help="blocks to write (default 50)")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.set_defaults(func=_disk)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (OSError, ValueError) as e:
        print(f"mcp-diag: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mcp-diag: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
