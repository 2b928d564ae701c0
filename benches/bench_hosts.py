"""mcp_fast vs Gloo across two "hosts": network namespaces joined by a veth pair (MTU 1500).

    sudo python benches/bench_hosts.py [--per-host 1 2] [--rate 1gbit] [--max-mib 64] [--runs 1]

Creates the two namespaces itself (root and iproute2 needed), runs ``--per-host`` ranks in
each, and times float32 all-reduce from 4 KiB to ``--max-mib`` MiB over Gloo and over
mcp_fast alternately, in the same processes. ``--rate`` caps each direction of the veth
with tbf (e.g. ``1gbit``); ``--mtu`` sets the veth MTU. Every namespace and process it made
is removed on exit. ``--json OUT`` writes the rows for ``make plots``.

Each size is timed ``--repeats`` times in the same processes and the fastest kept;
``--runs R`` does all of that R times, each in fresh namespaces with fresh processes, and
reports the median of the R runs (each run's figure is kept in the row's ``runs``): on 2
shared cores whole runs differ more than the repeats within one.

``--limits`` first measures the path itself with ``rust/mcp-core/examples/link_limits.rs``
(built with cargo if needed): raw UDP with GSO/GRO, a plain quinn bulk transfer on one
stream, a UDP ping-pong of 4 KiB and a plain quinn one (4 KiB each way on one stream, one
thread), so the all-reduce figures can be read against them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _runs import median_of_runs

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

GLOO_PORT, MCP_PORT = 29611, 29612


def sizes(min_kib: int, max_mib: int) -> list[int]:
    out, b = [], min_kib << 10
    while b <= max_mib << 20:
        out.append(b)
        b *= 4
    return out


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import mcp_fast as mcp

    torch.set_num_threads(1)
    rank, world = args.rank, args.world
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}:{GLOO_PORT}",
        rank=rank,
        world_size=world,
    )
    g = mcp.init(
        rank=rank,
        world_size=world,
        master_addr=args.master,
        master_port=MCP_PORT,
        secret="bench-hosts",
        timeout=120,
    )
    rows = []
    for nbytes in sizes(args.min_kib, args.max_mib):
        t = torch.ones(nbytes // 4)
        iters = max(3, min(200, int(2e8 // nbytes)))
        timing: dict[str, list[float]] = {"gloo": [], "mcp": []}
        runners = {
            "gloo": lambda t=t: dist.all_reduce(t),
            "mcp": lambda t=t: g.all_reduce(t, algorithm=args.algorithm),
        }
        for _ in range(args.repeats):
            for name, fn in runners.items():
                fn()  # warm up
                # Each backend from its own barrier (see bench_loss.py).
                (dist.barrier if name == "gloo" else g.barrier)()
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                timing[name].append((time.perf_counter() - t0) / iters)
        rows.append({"bytes": nbytes, "gloo_s": min(timing["gloo"]), "mcp_s": min(timing["mcp"])})
    g.close()
    dist.destroy_process_group()
    if rank == 0:
        print("ROWS " + json.dumps(rows), flush=True)


def human(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


# tbf's queue: 256 KiB of burst, 50 ms of latency (then drops), as a shaped WAN port has.
TBF_BURST_BYTES = 256 * 1024
TBF = ["burst", str(TBF_BURST_BYTES), "latency", "50ms", "rate"]
# What --limits sends through raw UDP and through a plain quinn stream.
BLAST_BYTES = 256 << 20
LIMITS_BIN = HERE.parent / "target" / "release" / "examples" / "link_limits"
# Tries of the both-ways transfer whose median --limits reports.
BOTH_WAYS_TRIES = 5


def shape_link(net, args: argparse.Namespace) -> None:
    for i in (0, 1):
        dev = net.dev[i]
        if args.mtu:
            subprocess.run(["ip", "-n", net.ns[i], "link", "set", dev, "mtu", str(args.mtu)])
        if args.rate:
            subprocess.run(
                ["tc", "-n", net.ns[i], "qdisc", "add", "dev", dev, "root", "tbf", *TBF, args.rate],
                check=True,
            )


def both_ways(net: Any, nbytes: str, cert: str) -> float:
    """One plain quinn transfer each way at once; the slower receiver's rate (Gbit/s)."""
    both = []
    for side, port in ((1, 9104), (0, 9105)):
        addr, cert_i = f"{net.addr[side]}:{port}", f"{cert}.{side}"
        srv = net.popen(
            side,
            [str(LIMITS_BIN), "quic-sink", addr, nbytes, cert_i],
            stdout=subprocess.PIPE,
            text=True,
        )
        both.append((srv, addr, cert_i, 1 - side))
    time.sleep(0.5)
    clis = [
        net.popen(
            other,
            [str(LIMITS_BIN), "quic-send", addr, nbytes, cert_i],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _, addr, cert_i, other in both
    ]
    rates = []
    for p in clis + [b[0] for b in both]:
        for line in p.communicate(timeout=120)[0].splitlines():
            if line.startswith("{"):
                rates.append(json.loads(line)["quic_gbit_s"])
    for _, _, cert_i, _ in both:
        if os.path.exists(cert_i):
            os.unlink(cert_i)
    return min(rates) if rates else 0.0


def limits(args: argparse.Namespace) -> dict:
    """The path's own figures: raw UDP (GSO/GRO), plain quinn, UDP and quinn ping-pongs."""
    from _netns import VethPair

    if not LIMITS_BIN.exists():
        subprocess.run(
            ["cargo", "build", "--release", "-q", "-p", "mcp-core", "--example", "link_limits"],
            cwd=HERE.parent,
            check=True,
        )
    out: dict = {}
    nbytes = str(BLAST_BYTES)
    with VethPair(tag="lim") as net:
        shape_link(net, args)
        cert = f"/tmp/link_limits_{os.getpid()}.der"
        pairs = [
            (
                ["udp-sink", f"{net.addr[1]}:9101", nbytes],
                ["udp-blast", f"{net.addr[1]}:9101", nbytes],
            ),
            (
                ["quic-sink", f"{net.addr[1]}:9102", nbytes, cert],
                ["quic-send", f"{net.addr[1]}:9102", nbytes, cert],
            ),
            (
                ["pong", f"{net.addr[1]}:9103", "4096", "2000"],
                ["ping", f"{net.addr[1]}:9103", "4096", "2000"],
            ),
            (
                ["quic-pong", f"{net.addr[1]}:9106", "4096", "2000", cert],
                ["quic-ping", f"{net.addr[1]}:9106", "4096", "2000", cert],
            ),
        ]
        try:
            # Both directions at once, as an all-reduce loads the path: one quinn transfer
            # each way, the slower receiver's rate; the median of a few tries, since one try
            # on 2 shared cores can read a third low.
            tries = [both_ways(net, nbytes, cert) for _ in range(BOTH_WAYS_TRIES)]
            out["quic_both_ways_gbit_s"] = statistics.median(tries)
            out["quic_both_ways_tries_gbit_s"] = tries
            for server, client in pairs:
                srv = net.popen(1, [str(LIMITS_BIN), *server], stdout=subprocess.PIPE, text=True)
                time.sleep(0.5)
                cli = net.popen(0, [str(LIMITS_BIN), *client], stdout=subprocess.PIPE, text=True)
                texts = [p.communicate(timeout=120)[0] for p in (cli, srv)]
                for text in texts:
                    for line in text.splitlines():
                        if line.startswith("{"):
                            out.update(json.loads(line))
        finally:
            if os.path.exists(cert):
                os.unlink(cert)
    return out


def run_one(per_host: int, args: argparse.Namespace) -> list[dict]:
    from _netns import VethPair

    world = 2 * per_host
    with VethPair(tag=f"b{per_host}") as net:
        shape_link(net, args)
        devs = net.dev
        procs = []
        for r in range(world):
            # Gloo binds to the address the hostname resolves to unless told the interface.
            env = {**os.environ, "GLOO_SOCKET_IFNAME": devs[r // per_host]}
            cmd = [sys.executable, __file__, "--worker", "--rank", str(r), "--world", str(world)]
            cmd += ["--master", net.addr[0], "--max-mib", str(args.max_mib)]
            cmd += ["--min-kib", str(args.min_kib), "--repeats", str(args.repeats)]
            cmd += ["--algorithm", args.algorithm]
            procs.append(net.popen(r // per_host, cmd, stdout=subprocess.PIPE, text=True, env=env))
        try:
            out, _ = procs[0].communicate(timeout=1800)
            for p in procs[1:]:
                p.wait(timeout=120)
        except subprocess.TimeoutExpired as e:
            raise SystemExit(f"{world} ranks: no result in time") from e
        for line in out.splitlines():
            if line.startswith("ROWS "):
                return json.loads(line[5:])
        raise SystemExit(f"{world} ranks: rank 0 printed no result (exit {procs[0].returncode})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--per-host", type=int, nargs="+", default=[1, 2])
    p.add_argument("--min-kib", type=int, default=4)
    p.add_argument("--max-mib", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--runs", type=int, default=1, help="fresh runs of everything (median)")
    p.add_argument("--rate", default="", help="tbf cap per direction, e.g. 1gbit")
    p.add_argument("--mtu", type=int, default=0, help="veth MTU (default: the kernel's 1500)")
    p.add_argument("--algorithm", default="auto")
    p.add_argument("--limits", action="store_true", help="first measure the path itself")
    p.add_argument("--json", default="")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--master", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.runs < 1:
        p.error("--runs must be at least 1")
    if os.geteuid() != 0:
        raise SystemExit("bench_hosts.py makes network namespaces: run it as root")
    cpu = platform.processor() or platform.machine()
    link = f"veth MTU {args.mtu or 1500}" + (f", tbf {args.rate}" if args.rate else "")
    print(f"# {platform.node()}: {os.cpu_count()} CPUs, {cpu}; {link}")
    lim = limits(args) if args.limits else {}
    if lim:
        got, blasted = lim.get("udp_received_bytes", 0), BLAST_BYTES
        # A blast the receiving socket cannot keep up with leaves a few batches counted over
        # a few microseconds: a rate from those would be meaningless.
        udp = (
            f"raw UDP (GSO {lim.get('udp_gbit_s', 0):.2f} Gbit/s received)"
            if got >= blasted // 2
            else f"raw UDP: the blast outran the receiving socket ({got >> 20} of "
            f"{blasted >> 20} MiB arrived), no figure"
        )
        print(
            f"# path limits: {udp}, "
            f"plain quinn one stream {lim.get('quic_gbit_s', 0):.2f} Gbit/s "
            f"(each way while both ways run: {lim.get('quic_both_ways_gbit_s', 0):.2f}), "
            f"UDP ping-pong of 4 KiB {lim.get('ping_median_s', 0) * 1e3:.3f} ms, "
            f"plain quinn ping-pong of 4 KiB on one stream "
            f"{lim.get('quic_ping_median_s', 0) * 1e3:.3f} ms"
        )
    print("| ranks/host | size | Gloo | mcp_fast | Gloo / mcp_fast |")
    print("|---|---|---|---|---|")
    result = []
    for per_host in args.per_host:
        runs = [run_one(per_host, args) for _ in range(args.runs)]
        for row in median_of_runs(runs, key="bytes"):
            tg, tm = row["gloo_s"], row["mcp_s"]
            print(
                f"| {per_host} | {human(row['bytes'])} | {tg * 1e3:.2f} ms | {tm * 1e3:.2f} ms "
                f"| {tg / tm:.2f}x |",
                flush=True,
            )
            result.append({"per_host": per_host, **row})
    if args.json:
        meta = {
            "command": " ".join(sys.argv),
            "link": link,
            "date": time.strftime("%F"),
            "cpus": os.cpu_count(),
            **({"tbf_burst_bytes": TBF_BURST_BYTES} if args.rate else {}),
            **lim,
        }
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": result}, indent=1))


if __name__ == "__main__":
    main()
