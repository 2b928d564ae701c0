"""Hierarchical vs flat ring all-reduce (mcp_fast) vs Gloo, two veth "hosts" x 2 ranks.

    sudo python benches/bench_hierarchical.py [--mib 64] [--repeats 5] [--rate 1gbit]

Two network namespaces joined by a veth pair (MTU 1500) are the two hosts; each runs two
ranks, rank 0-1 on host 0 and 2-3 on host 1, every rank with its host's MCP_HOST_ID. In the
same processes and the same run, one all-reduce of a float32 tensor each way, in turn:
Gloo, mcp_fast hierarchical, mcp_fast ring. Reports the time per all-reduce (median and
best over the repeats, on rank 0) and the bytes each host's veth end transmitted per
all-reduce (``/sys/class/net/<veth>/statistics/tx_bytes``, headers included), as a multiple
of the tensor: the hierarchical all-reduce's payload is 2(H-1)/H = 1.0 of it. ``--rate``
caps each veth end with tbf (the link, not the CPUs, then bounds the time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

ORDER = ["gloo", "mcp_hierarchical", "mcp_ring"]


def veth() -> str:
    return next(d for d in os.listdir("/sys/class/net") if d != "lo")


def tx_bytes(dev: str) -> int:
    return int(Path(f"/sys/class/net/{dev}/statistics/tx_bytes").read_text())


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import mcp_fast as mcp

    torch.set_num_threads(1)
    rank, world = args.rank, 4
    dev = veth()
    os.environ["GLOO_SOCKET_IFNAME"] = dev
    dist.init_process_group(
        "gloo", init_method=f"tcp://{args.addr}:{args.port}", rank=rank, world_size=world
    )
    g = mcp.init(
        rank=rank,
        world_size=world,
        master_addr=args.addr,
        master_port=args.port + 1,
        secret="bench-hierarchical",
        timeout=300,
        host_id=f"host{rank // 2}",
    )
    hosts = g.topology()["host_of_rank"]
    assert hosts == [0, 0, 1, 1], hosts
    t = torch.ones(args.mib << 18)
    runs = {
        "gloo": lambda: dist.all_reduce(t),
        "mcp_hierarchical": lambda: g.all_reduce(t, algorithm="hierarchical"),
        "mcp_ring": lambda: g.all_reduce(t, algorithm="ring"),
    }
    times: dict[str, list[float]] = {k: [] for k in ORDER}
    tx: dict[str, list[int]] = {k: [] for k in ORDER}
    for name in ORDER:
        runs[name]()  # warm up: connections, buffers
    for _ in range(args.repeats):
        for name in ORDER:
            g.barrier()
            before = tx_bytes(dev)
            t0 = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - t0)
            g.barrier()
            tx[name].append(tx_bytes(dev) - before)
    print(json.dumps({"rank": rank, "times": times, "tx": tx}), flush=True)
    g.close()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=64, help="tensor size in MiB (float32)")
    p.add_argument("--repeats", type=int, default=5, help="timed all-reduces per backend")
    p.add_argument("--rate", default="", help="tbf rate cap on each veth end, e.g. 1gbit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--addr", default="", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=29611, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    import _netns

    if not _netns.available():
        sys.exit("needs root and iproute2 (network namespaces)")
    with _netns.VethPair("hb") as net:
        if args.rate:
            for ns in net.ns:
                dev = subprocess.run(
                    ["ip", "netns", "exec", ns, "ls", "/sys/class/net"],
                    capture_output=True,
                    text=True,
                    check=True,
                    timeout=30,
                ).stdout.split()
                dev.remove("lo")
                tbf = ["tc", "qdisc", "add", "dev", dev[0], "root", "tbf", "rate", args.rate]
                tbf += ["burst", "256kb", "latency", "50ms"]
                subprocess.run(["ip", "netns", "exec", ns, *tbf], check=True, timeout=30)
        procs = []
        for rank in range(4):
            cmd = [sys.executable, __file__, "--worker", "--rank", str(rank)]
            cmd += ["--addr", net.addr[0], "--port", str(args.port)]
            cmd += ["--mib", str(args.mib), "--repeats", str(args.repeats)]
            procs.append(net.popen(rank // 2, cmd, stdout=subprocess.PIPE, text=True))
        outs = []
        for pr in procs:
            out, _ = pr.communicate(timeout=900)
            if pr.returncode != 0:
                sys.exit(f"a rank failed ({pr.returncode})")
            outs.append(json.loads(out.strip().splitlines()[-1]))
    nbytes = args.mib << 20
    cap = f", veth capped at {args.rate}" if args.rate else ""
    print(f"all-reduce float32 {args.mib} MiB, 2 veth hosts x 2 ranks{cap}, {args.repeats} repeats")
    print(f"{'':18} {'median ms':>10} {'best ms':>8} {'tx/host':>8}  vs Gloo (median)")
    gloo = statistics.median(outs[0]["times"]["gloo"])
    for name in ORDER:
        ts = outs[0]["times"][name]
        per_host = [statistics.median(outs[r]["tx"][name]) / nbytes for r in (0, 2)]
        med = statistics.median(ts)
        print(
            f"{name:18} {med * 1e3:10.1f} {min(ts) * 1e3:8.1f} {max(per_host):8.3f}  "
            f"{gloo / med:.2f}x"
        )


if __name__ == "__main__":
    main()
