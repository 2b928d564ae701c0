"""mcp_fast vs Gloo on an emulated WAN path: two namespace hosts joined by mcp-chaos's TUN
forwarder (one-way delay, rate cap, random loss), 1 rank per host, in the same run.

    sudo python benches/bench_wan.py [--delay 25ms] [--rate 200mbit] [--loss 0 0.001 0.01 0.05]
    sudo python benches/bench_wan.py --stream     # is the forwarder itself a bottleneck?

For each loss rate, ``mcp-chaos --hosts 2`` runs one worker per host; each worker times a
16 MiB float32 all-reduce (``--mib``) over Gloo and over mcp_fast alternately, ``--iters``
times each after a small warm-up (one 4 KiB operation each, then ``--warmup`` untimed
operations of the full size, as nccl-tests' ``-w``: a training job's first steps, in which the
congestion controllers learn the path), and rank 0 prints the medians beside the path's limit
(bytes / rate + 2 x one-way delay). ``--stream`` instead times one TCP stream for 3 s through
the forwarder (no delay, no loss, no cap) and over a plain veth pair beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "python"))

GLOO_PORT, MCP_PORT, STREAM_PORT = 29621, 29622, 29623
CHUNK = 1 << 20


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import mcp_fast as mcp

    torch.set_num_threads(1)
    rank = int(os.environ["MCP_CHAOS_HOST"])
    master = os.environ["MCP_CHAOS_ADDRS"].split(",")[0]
    os.environ["GLOO_SOCKET_IFNAME"] = os.environ["MCP_CHAOS_IFNAME"]
    dist.init_process_group(
        "gloo", init_method=f"tcp://{master}:{GLOO_PORT}", rank=rank, world_size=2
    )
    g = mcp.init(
        rank=rank,
        world_size=2,
        master_addr=master,
        master_port=MCP_PORT,
        secret="bench-wan",
        timeout=args.op_timeout,
    )
    t = torch.ones((args.mib << 20) // 4)
    small = torch.ones(1024)
    runners = {"gloo": lambda x: dist.all_reduce(x), "mcp": lambda x: g.all_reduce(x)}
    # Each backend starts from its own barrier: under loss Gloo's releases the ranks as far
    # apart as TCP's retransmission timeout, a wait that would be timed as mcp_fast's.
    barriers = {"gloo": dist.barrier, "mcp": g.barrier}
    timing: dict[str, list[float]] = {"gloo": [], "mcp": []}
    for fn in runners.values():
        fn(small)  # connections up
    for i in range(args.warmup + args.iters):
        for name, fn in runners.items():
            t.fill_(1.0)
            barriers[name]()
            t0 = time.perf_counter()
            fn(t)
            if i >= args.warmup:
                timing[name].append(time.perf_counter() - t0)
            assert float(t[0]) == 2.0 and float(t[-1]) == 2.0, name
    g.close()
    dist.destroy_process_group()
    if rank == 0:
        print("TIMES " + json.dumps(timing), flush=True)


def stream_worker(addr: str, role: str, seconds: float) -> None:
    """One TCP stream: `role` send or recv; the receiver prints Gbit/s."""
    buf = bytearray(CHUNK)
    if role == "recv":
        lst = socket.create_server((addr, STREAM_PORT))
        lst.settimeout(30)
        c, _ = lst.accept()
        c.settimeout(30)
        got, t0 = 0, time.perf_counter()
        while n := c.recv_into(buf):
            got += n
        print(f"GBIT {got * 8 / (time.perf_counter() - t0) / 1e9:.3f}", flush=True)
        return
    deadline = time.monotonic() + 30
    while True:
        try:
            c = socket.create_connection((addr, STREAM_PORT), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        c.sendall(buf)
    c.close()


def chaos(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "mcp_fast.cli.chaos", "--hosts", "2", *args]
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "python")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def run_stream(seconds: float) -> None:
    from _netns import VethPair

    script = [sys.executable, __file__, "--stream-role"]
    # Through the forwarder: host 1 receives, host 0 sends.
    shell = (
        f'if [ "$MCP_CHAOS_HOST" = 1 ]; then {" ".join(script)} recv $MCP_CHAOS_ADDR {seconds}; '
        f"else sleep 0.5; {' '.join(script)} send ${{MCP_CHAOS_ADDRS#*,}} {seconds}; fi"
    )
    r = chaos("--timeout", "120", "--", "sh", "-c", shell, timeout=180)
    fwd = r.stdout.split("GBIT")[1].split()[0] if "GBIT" in r.stdout else f"failed: {r.stderr}"
    with VethPair(tag="wan") as net:
        rx = net.popen(
            1,
            [*script, "recv", net.addr[1], str(seconds)],
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(0.5)
        tx = net.popen(0, [*script, "send", net.addr[1], str(seconds)])
        out, _ = rx.communicate(timeout=120)
        tx.wait(timeout=60)
    veth = out.split("GBIT")[1].split()[0] if "GBIT" in out else "failed"
    print(f"# TCP stream {seconds} s, MTU 1500: forwarder {fwd} Gbit/s, plain veth {veth} Gbit/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--delay", default="25ms")
    p.add_argument("--rate", default="200mbit")
    p.add_argument("--loss", type=float, nargs="+", default=[0.0, 0.001, 0.01, 0.05])
    p.add_argument("--mib", type=int, default=16)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument(
        "--warmup", type=int, default=0, help="untimed full-size operations per backend first"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1200, help="per loss rate, seconds")
    p.add_argument("--op-timeout", type=float, default=600, help="mcp_fast's, per operation")
    p.add_argument("--stream", action="store_true", help="time the forwarder itself")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stream-role", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.stream_role:
        role, addr, secs = args.stream_role
        stream_worker(addr, role, float(secs))
        return
    if os.geteuid() != 0:
        raise SystemExit("bench_wan.py makes network namespaces: run it as root")
    from mcp_fast.cli.chaos import bits_per_second, seconds_of

    cpu = platform.processor() or platform.machine()
    print(f"# {platform.node()}: {os.cpu_count()} CPUs, {cpu}; {time.strftime('%F %H:%M')} UTC")
    print(f"# load average {os.getloadavg()[0]:.2f}")
    if args.stream:
        run_stream(3.0)
        return
    nbytes = args.mib << 20
    limit = nbytes * 8 / bits_per_second(args.rate) + 2 * seconds_of(args.delay)
    print(
        f"# path: {args.delay} each way, {args.rate}, TUN MTU 1500; {args.mib} MiB all-reduce, "
        f"median of {args.iters} after {args.warmup} untimed"
    )
    print("| loss | link limit | Gloo | mcp_fast | Gloo / mcp_fast |")
    print("|---|---|---|---|---|")
    for loss in args.loss:
        r = chaos(
            "--delay",
            args.delay,
            "--rate",
            args.rate,
            "--loss",
            str(loss),
            "--seed",
            str(args.seed),
            "--timeout",
            str(args.timeout),
            "--",
            sys.executable,
            __file__,
            "--worker",
            "--mib",
            str(args.mib),
            "--iters",
            str(args.iters),
            "--warmup",
            str(args.warmup),
            "--op-timeout",
            str(args.op_timeout),
            timeout=args.timeout + 60,
        )
        if "TIMES " not in r.stdout:
            print(f"| {loss:.1%} | {limit:.2f} s | failed (exit {r.returncode}) | | |", flush=True)
            print(r.stderr[-8000:], file=sys.stderr)
            continue
        times = json.loads(r.stdout.split("TIMES ")[1].splitlines()[0])
        tg, tm = statistics.median(times["gloo"]), statistics.median(times["mcp"])
        print(
            f"| {loss:.1%} | {limit:.2f} s | {tg:.2f} s | {tm:.2f} s | {tg / tm:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
