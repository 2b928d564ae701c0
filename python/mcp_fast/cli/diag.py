"""``mcp-diag``: measure what a training job's performance rests on.

Commands::

    mcp-diag disk [--path DIR] [--latency] [--size 4MiB] [--count 50] [--json]
    mcp-diag network [--rank R --world N --master HOST:PORT] [--packet-loss] [--secret S]
                     [--size 16MiB] [--count 20] [--timeout 60] [--json]
    mcp-diag --disk --latency ...            (the documents' forms of the same commands)
    mcp-diag --network --packet-loss ...

``disk`` writes ``count`` blocks of ``size`` random bytes to a temporary file in DIR, calling
``fsync`` after each, and reports the latency of each write+fsync (p50, p99, max) and the
throughput (bytes written / total time): what a checkpoint write to that filesystem costs.
The temporary file is removed afterwards, also on error or Ctrl-C. DIR defaults to the
current directory; ``--latency`` shows the latency percentiles alone (p50, p90, p99, max).

``network`` runs on every rank of a job (on several machines, or several times on one: rank 0
listens on UDP HOST:PORT, the others connect to it) and measures, over MCP itself: the
latency of ``count`` small all-reduces (4 bytes: one exchange between two ranks, so about one
round trip) with p50/p99/max, the smoothed QUIC round-trip time to each peer, the bandwidth of
``count`` all-reduces of ``size`` bytes (algorithm bandwidth = size / time; bus bandwidth =
algorithm bandwidth × 2(N-1)/N, the bytes each rank moves, as nccl-tests report it), the
bytes the transport sent and received meanwhile, and loss hints: corrupt frames, refused
handshakes and, under a fault injector (``MCP_CHAOS``), the datagrams it dropped. Each rank
prints its own table. The secret defaults to ``MCP_SECRET``, else rank 0 makes one and hands
it out at the rendezvous (see the README). ``--rank``, ``--world`` and ``--master`` default to
torchrun's ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR``:``MASTER_PORT``. ``--packet-loss`` adds
a table of QUIC's own packet counts per peer during the measurement (sent, declared lost, the
loss rate, congestion window, path MTU): the loss the network really inflicts, not only the
fault injector's.

Exit status: 0 on success, 2 on an error (bad arguments, path not writable, no space, a peer
that never came or a failed operation).
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
from typing import Any

from ..errors import MCPError
from . import positive_size

__all__ = ["disk_latency", "main", "network_probe"]


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
        "p90_s": _percentile(lat, 0.90),
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
    if args.latency:
        print(
            f"  latency p50 {r['p50_s'] * 1e3:.2f} ms   p90 {r['p90_s'] * 1e3:.2f} ms   "
            f"p99 {r['p99_s'] * 1e3:.2f} ms   max {r['max_s'] * 1e3:.2f} ms"
        )
        return 0
    print(
        f"  latency p50 {r['p50_s'] * 1e3:.2f} ms   p99 {r['p99_s'] * 1e3:.2f} ms   "
        f"max {r['max_s'] * 1e3:.2f} ms"
    )
    print(f"  throughput {float(r['throughput_Bps']) / 1e6:.1f} MB/s")
    return 0


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items()}


def network_probe(
    rank: int,
    world: int,
    host: str,
    port: int,
    secret: str | None,
    size: int,
    count: int,
    timeout: float,
) -> dict[str, Any]:
    """Join a job as ``rank`` and measure latency, bandwidth and loss hints over MCP."""
    import numpy as np

    import mcp_fast as mcp

    with mcp.init(
        rank=rank,
        world_size=world,
        master_addr=host,
        master_port=port,
        secret=secret,
        timeout=timeout,
        shm=False,  # the network is what is measured, also between ranks of one host
    ) as g:
        small = np.ones(1, np.float32)
        big = np.ones(max(1, size // 4), np.float32)
        g.all_reduce(small)  # warm up: connections to every peer
        g.all_reduce(big)
        g.barrier()
        t_before, c_before = g.stats(), g.chaos_stats()
        h_before = {h["rank"]: h for h in g.health()}
        lat: list[float] = []
        for _ in range(count):
            t0 = time.perf_counter()
            g.all_reduce(small)
            lat.append(time.perf_counter() - t0)
        g.barrier()
        sent_before = g.stats()["bytes_sent"]
        start = time.perf_counter()
        for _ in range(count):
            g.all_reduce(big)
        elapsed = time.perf_counter() - start
        t_after, c_after = g.stats(), g.chaos_stats()
        h_after = {h["rank"]: h for h in g.health()}
        rtt = {p: g.rtt(p) for p in range(world) if p != rank}
        g.barrier()  # nobody leaves while a peer still measures
    lat.sort()
    algbw = big.nbytes * count / elapsed if elapsed > 0 else float("inf")
    return {
        "rank": rank,
        "world_size": world,
        "count": count,
        "size": int(big.nbytes),
        "latency_p50_s": _percentile(lat, 0.50),
        "latency_p99_s": _percentile(lat, 0.99),
        "latency_max_s": lat[-1],
        "rtt_s": rtt,
        "allreduce_time_s": elapsed / count,
        "algbw_Bps": algbw,
        "busbw_Bps": algbw * 2 * (world - 1) / world,
        "wire_sent_Bps": (t_after["bytes_sent"] - sent_before) / elapsed,
        "transport": _delta(t_after, t_before),
        "chaos": _delta(c_after, c_before),
        "peers": {p: _path_delta(h_after.get(p), h_before.get(p)) for p in rtt},
    }


def _path_delta(after: dict[str, Any] | None, before: dict[str, Any] | None) -> dict[str, Any]:
    """One peer's QUIC packet counts between two ``health()`` looks (``None`` where the path
    was not connected at the second)."""

    def count(h: dict[str, Any] | None, key: str) -> int:
        return int((h or {}).get(key) or 0)

    if after is None or after.get("sent_packets") is None:
        return {"sent_packets": None, "lost_packets": None, "loss": None, "cwnd": None, "mtu": None}
    sent = count(after, "sent_packets") - count(before, "sent_packets")
    lost = count(after, "lost_packets") - count(before, "lost_packets")
    if sent < 0 or lost < 0:  # a reconnection in between: the counters began again
        sent, lost = count(after, "sent_packets"), count(after, "lost_packets")
    return {
        "sent_packets": sent,
        "lost_packets": lost,
        "loss": lost / sent if sent else 0.0,
        "cwnd": after.get("cwnd"),
        "mtu": after.get("mtu"),
    }


def _from_env(args: argparse.Namespace) -> None:
    """``--rank``, ``--world``, ``--master`` left out: torchrun's environment."""
    if args.rank is None:
        v = os.environ.get("RANK")
        if v is None or not v.isdigit():
            raise ValueError("network needs --rank (or RANK in the environment)")
        args.rank = int(v)
    if args.world is None:
        v = os.environ.get("WORLD_SIZE")
        if v is None or not v.isdigit():
            raise ValueError("network needs --world (or WORLD_SIZE in the environment)")
        args.world = int(v)
    if args.master is None:
        addr = os.environ.get("MASTER_ADDR")
        if not addr:
            raise ValueError("network needs --master HOST:PORT (or MASTER_ADDR and MASTER_PORT)")
        args.master = _master(f"{addr}:{os.environ.get('MASTER_PORT') or 29500}")


def _network(args: argparse.Namespace) -> int:
    _from_env(args)
    host, port = args.master
    if not 0 <= args.rank < args.world:
        raise ValueError(f"--rank {args.rank} is not a rank of --world {args.world}")
    r = network_probe(
        args.rank, args.world, host, port, args.secret, args.size, args.count, args.timeout
    )
    if args.json:
        print(json.dumps(r))
        return 0
    tr, ch = r["transport"], r["chaos"]
    print(
        f"network rank {r['rank']}/{r['world_size']} via {host}:{port}: "
        f"{r['count']} x 4 B and {r['count']} x {r['size']} B all-reduces"
    )
    print(f"  {'peer':>6}  {'QUIC RTT':>10}")
    for peer, rtt in r["rtt_s"].items():
        shown = "not conn." if rtt is None else f"{rtt * 1e3:.3f} ms"
        print(f"  {peer:>6}  {shown:>10}")
    print(
        f"  RTT (4 B all-reduce)  p50 {r['latency_p50_s'] * 1e3:.3f} ms   "
        f"p99 {r['latency_p99_s'] * 1e3:.3f} ms   max {r['latency_max_s'] * 1e3:.3f} ms"
    )
    print(
        f"  bandwidth             {r['algbw_Bps'] / 1e6:.1f} MB/s algorithm, "
        f"{r['busbw_Bps'] / 1e6:.1f} MB/s bus, {r['wire_sent_Bps'] / 1e6:.1f} MB/s sent "
        f"on the wire ({r['allreduce_time_s'] * 1e3:.2f} ms per all-reduce)"
    )
    hints = [f"corrupt frames {tr.get('corrupt_frames', 0)}"]
    hints.append(f"refused handshakes {tr.get('refused_handshakes', 0)}")
    sent, lost = tr.get("quic_sent_packets", 0), tr.get("quic_lost_packets", 0)
    pct = f" ({100 * lost / sent:.2f}%)" if sent else ""
    hints.append(f"QUIC lost {lost} of {sent} packets{pct}")
    if ch:
        dropped = ch.get("send_dropped", 0) + ch.get("recv_dropped", 0) + ch.get("rate_dropped", 0)
        total = ch.get("sent", 0) + ch.get("received", 0)
        pct = f" ({100 * dropped / total:.1f}% of datagrams)" if total else ""
        hints.append(f"fault injector dropped {dropped}{pct}")
    p50, p99 = r["latency_p50_s"], r["latency_p99_s"]
    if r["count"] >= 20 and p99 > 5 * p50 and p99 - p50 > 1e-3:
        hints.append("p99 > 5 x p50: retransmissions or a busy host")
    print(f"  loss hints            {'; '.join(hints)}")
    if args.packet_loss:
        print(
            f"  {'peer':>6}  {'QUIC sent':>10}  {'lost':>8}  {'loss':>7}  {'cwnd':>10}  {'MTU':>6}"
        )
        for peer, q in r["peers"].items():
            if q["sent_packets"] is None:
                print(f"  {peer:>6}  {'not connected':>10}")
                continue
            print(
                f"  {peer:>6}  {q['sent_packets']:>10}  {q['lost_packets']:>8}  "
                f"{100 * q['loss']:>6.2f}%  {q['cwnd'] or 0:>10}  {q['mtu'] or 0:>6}"
            )
    return 0


def _master(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"not HOST:PORT: {text!r} (example: 127.0.0.1:29500)")
    return host.strip("[]"), int(port)


def _nonneg_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError("must not be negative")
    return n


def _seconds(text: str) -> float:
    try:
        t = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < t <= 86400:
        raise argparse.ArgumentTypeError("must be in (0, 86400] seconds")
    return t


_size = positive_size


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
    d.add_argument("--path", default=".", help="a directory on the filesystem to test (.)")
    d.add_argument("--latency", action="store_true", help="latency percentiles alone")
    d.add_argument("--size", type=_size, default=4 << 20, help="block size (default 4MiB)")
    d.add_argument("--count", type=_count, default=50, help="blocks to write (default 50)")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.set_defaults(func=_disk)
    n = sub.add_parser(
        "network",
        help="latency, bandwidth and loss hints between ranks, over MCP",
        description="Run once per rank (rank 0 listens on UDP HOST:PORT). Measures COUNT "
        "small all-reduces (latency, about one round trip with 2 ranks), COUNT all-reduces "
        "of SIZE bytes (bandwidth), the QUIC RTT to each peer and loss hints.",
        epilog="Example, two shells: mcp-diag network --rank 0 --world 2 --master "
        "127.0.0.1:29500   and   mcp-diag network --rank 1 --world 2 --master 127.0.0.1:29500",
    )
    n.add_argument("--rank", type=_nonneg_int, help="this process's rank (RANK)")
    n.add_argument("--world", type=_nonneg_int, help="number of ranks (WORLD_SIZE)")
    n.add_argument(
        "--master",
        type=_master,
        help="HOST:PORT where rank 0 listens, UDP (MASTER_ADDR:MASTER_PORT)",
    )
    n.add_argument(
        "--packet-loss", action="store_true", help="QUIC's packets sent and lost, per peer"
    )
    n.add_argument("--secret", help="job secret (default: MCP_SECRET, else made by rank 0)")
    n.add_argument("--size", type=_size, default=16 << 20, help="bandwidth message (16MiB)")
    n.add_argument("--count", type=_count, default=20, help="repetitions of each test (20)")
    n.add_argument(
        "--timeout", type=_seconds, default=60.0, help="bound on the rendezvous and each op (60)"
    )
    n.add_argument("--json", action="store_true", help="print one JSON object")
    n.set_defaults(func=_network)
    return p


_FLAG_FORMS = {"--disk": "disk", "--network": "network"}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _FLAG_FORMS:  # the documents' forms: mcp-diag --network ...
        argv[0] = _FLAG_FORMS[argv[0]]
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (OSError, ValueError, MCPError) as e:
        print(f"mcp-diag: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mcp-diag: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
