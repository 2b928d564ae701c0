"""Time DDP training steps with backend "mcp" against "gloo", on loopback and on a lossy link.

    python benches/bench_ddp.py [--steps 20] [--loss 0.2] [--links loopback,lossy,veth] [--json OUT]

Two ranks (torchrun --standalone) train the same MLP (about 6 MiB of fp32 gradients with the
default --width 1024) from the same seed on the same synthetic batches, once wrapped in DDP
over the default "mcp" group and once over a "gloo" group of the same processes. The two run
in alternating blocks of steps in the same processes, so both see the same machine at the
same time. A step is forward, backward (with DDP's all-reduce) and the optimiser step; its
time is measured on rank 0.

Links: ``loopback`` is the plain 127.0.0.1; ``lossy`` runs the same under
``mcp-chaos --loss P`` (a fresh network namespace whose loopback drops that share of the
packets in both directions, via nftables), which needs root, iproute2 and nftables and is
skipped with a message otherwise. Packets are dropped on arrival by default (``--hook input``),
silently, as on a real lossy link; ``--hook output`` drops them as they are sent, where the
sender's ``send`` fails with EPERM, and TCP (Gloo) then retransmits at once without waiting
for a timeout, so that setting flatters Gloo. ``veth`` puts one rank on each of two network
namespaces joined by a veth pair (MTU 1500, as on Ethernet: two "hosts", QUIC between them,
no shared memory), which needs root and iproute2. Prints a markdown table: median and p90
step time and samples/s per backend and link, and whether the two backends ended with the
same parameters.
``--json OUT`` also writes the step times per link and backend for ``benches/plots.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BACKENDS = ("mcp", "gloo")
# The same model stepped without DDP, interleaved with the others: the step with no
# all-reduce at all, the floor no backend can beat.
FLOOR = "none"


# ---- worker (runs under torchrun) -------------------------------------------------------------


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import mcp_fast.torch  # noqa: F401  (registers the backend "mcp")

    dist.init_process_group("mcp")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {"mcp": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}

    def make() -> nn.Module:
        torch.manual_seed(0)
        w = args.width
        return nn.Sequential(
            nn.Linear(args.inputs, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 10)
        )

    runs = (*BACKENDS, FLOOR)
    models = {b: make() for b in runs}
    nets: dict[str, nn.Module] = {
        b: nn.parallel.DistributedDataParallel(models[b], process_group=groups[b]) for b in BACKENDS
    }
    nets[FLOOR] = models[FLOOR]
    opts = {b: torch.optim.SGD(nets[b].parameters(), lr=0.01, momentum=0.9) for b in runs}
    gens = {b: torch.Generator().manual_seed(1000 + rank) for b in runs}
    times: dict[str, list[float]] = {b: [] for b in runs}
    n_params = sum(p.numel() for p in models["mcp"].parameters())

    def step(b: str) -> float:
        x = torch.randn(args.batch, args.inputs, generator=gens[b])
        y = torch.randint(0, 10, (args.batch,), generator=gens[b])
        t0 = time.perf_counter()
        opts[b].zero_grad()
        nn.functional.cross_entropy(nets[b](x), y).backward()
        opts[b].step()
        return time.perf_counter() - t0

    for b in runs:
        for _ in range(args.warmup):
            step(b)
    block = max(1, args.block)
    done = 0
    order = list(runs)
    t_end = time.monotonic() + args.budget
    while done < args.steps and time.monotonic() < t_end:
        k = min(block, args.steps - done)
        for b in order:
            dist.barrier(group=groups.get(b, groups["gloo"]))
            for _ in range(k):
                times[b].append(step(b))
        order.reverse()  # neither backend always goes first
        done += k
    same = all(
        torch.equal(p, q)
        for p, q in zip(models["mcp"].parameters(), models["gloo"].parameters(), strict=True)
    )
    diff = max(
        (p - q).abs().max().item()
        for p, q in zip(models["mcp"].parameters(), models["gloo"].parameters(), strict=True)
    )
    wire = groups["mcp"].mcp_group.total_bytes_sent()
    if rank == 0:
        out = {
            "world": world,
            "params": n_params,
            "grad_mib": n_params * 4 / 2**20,
            "times": times,
            "same_params": same,
            "max_param_diff": diff,
            "mcp_bytes_sent_rank0": wire,
        }
        Path(args.result).write_text(json.dumps(out))
    dist.destroy_process_group()
    return 0


# ---- driver -----------------------------------------------------------------------------------


def _lossy_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    missing = [t for t in ("ip", "nft") if shutil.which(t) is None]
    if missing:
        return f"missing {', '.join(missing)} (apt-get install -y iproute2 nftables)"
    return None


def _veth_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "missing ip (apt-get install -y iproute2)"
    return None


def _worker_args(args: argparse.Namespace, result: Path) -> list[str]:
    return [
        os.path.abspath(__file__),
        "--worker",
        "--result",
        str(result),
        *("--steps", str(args.steps), "--warmup", str(args.warmup), "--block", str(args.block)),
        *("--batch", str(args.batch), "--width", str(args.width), "--inputs", str(args.inputs)),
        *("--budget", str(args.budget)),
    ]


def _run_veth(args: argparse.Namespace, result: Path) -> tuple[int, float, str]:
    """One rank in each of two namespace hosts, started as torchrun starts a rank of a
    two-node job (RANK, WORLD_SIZE, MASTER_ADDR...), rank 0's host holding the store."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from _netns import VethPair

    t0 = time.monotonic()
    with VethPair(tag="ddp") as net:
        procs = []
        for r in (0, 1):
            env = {
                **os.environ,
                "OMP_NUM_THREADS": str(args.threads),
                "RANK": str(r),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": net.addr[0],
                "MASTER_PORT": "29631",
                # Gloo binds to the address the hostname resolves to unless told the device.
                "GLOO_SOCKET_IFNAME": net.dev[r],
            }
            env.pop("MCP_CHAOS", None)
            cmd = [sys.executable, *_worker_args(args, result)]
            procs.append(
                net.popen(
                    r, cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                )
            )
        logs = []
        try:
            for p in procs:
                logs.append(p.communicate(timeout=args.budget + 60)[0])
        except subprocess.TimeoutExpired:
            return -1, time.monotonic() - t0, "".join(logs)[-2000:]
        rc = next((p.returncode for p in procs if p.returncode != 0), 0)
        return rc, time.monotonic() - t0, "".join(logs)[-3000:]


def _run_link(args: argparse.Namespace, link: str, result: Path) -> tuple[int, float, str]:
    if link == "veth":
        return _run_veth(args, result)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd = [*torchrun, "--nproc-per-node", "2", *_worker_args(args, result)]
    if link == "lossy":
        chaos = shutil.which("mcp-chaos") or str(Path(sys.executable).with_name("mcp-chaos"))
        cmd = [chaos, "--loss", str(args.loss), "--hook", args.hook, "--", *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    env.pop("MCP_CHAOS", None)
    t0 = time.monotonic()
    try:
        r = subprocess.run(
            cmd,
            env=env,
            capture_output=True,
            text=True,
            timeout=args.budget + 60,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired as e:
        # subprocess.run kills the child; mcp-chaos deletes its namespace and what is in it.
        out = (e.stderr or b"")[-2000:]
        return (
            -1,
            time.monotonic() - t0,
            out.decode(errors="replace") if isinstance(out, bytes) else out,
        )
    return r.returncode, time.monotonic() - t0, (r.stdout + r.stderr)[-3000:]


def _row(link: str, backend: str, times: list[float], batch: int, world: int) -> str:
    med = statistics.median(times)
    p90 = sorted(times)[min(len(times) - 1, int(0.9 * len(times)))]
    sps = batch * world / med
    return f"| {link} | {backend} | {len(times)} | {med * 1e3:.2f} | {p90 * 1e3:.2f} | {sps:,.0f} |"


def driver(args: argparse.Namespace) -> int:
    links = [x.strip() for x in args.links.split(",") if x.strip()]
    bad = [x for x in links if x not in ("loopback", "lossy", "veth")]
    if bad:
        print(f"bench_ddp: unknown link(s) {bad}; use loopback,lossy,veth", file=sys.stderr)
        return 2
    rows, notes = [], []
    failed = False
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    per_link: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench_ddp") as d:
        for link in links:
            label = {
                "loopback": "loopback",
                "veth": "two veth hosts (MTU 1500)",
            }.get(link, f"{args.loss:.0%} loss, {args.hook} hook (netns)")
            if link in ("lossy", "veth"):
                why = _lossy_unavailable() if link == "lossy" else _veth_unavailable()
                if why:
                    print(f"skipping the {link} link: {why}", file=sys.stderr)
                    notes.append(f"- {label}: skipped, {why}")
                    continue
            result = Path(d) / f"{link}.json"
            print(f"== {label}: 2 ranks, mcp and gloo interleaved ...", file=sys.stderr, flush=True)
            rc, wall, log = _run_link(args, link, result)
            if rc != 0 or not result.exists():
                failed = True
                print(f"{label}: failed (exit {rc}) after {wall:.0f} s\n{log}", file=sys.stderr)
                notes.append(f"- {label}: FAILED (exit {rc})")
                continue
            res = json.loads(result.read_text())
            per_link[label] = {
                b: {
                    "median_ms": 1e3 * statistics.median(res["times"][b]),
                    "steps_ms": [1e3 * x for x in res["times"][b]],
                }
                for b in BACKENDS
                if res["times"][b]
            }
            for b in (*BACKENDS, FLOOR):
                if res["times"].get(b):
                    name = "no DDP (floor)" if b == FLOOR else b
                    rows.append(_row(label, name, res["times"][b], args.batch, res["world"]))
            t = res["times"]
            if t["mcp"] and t["gloo"]:
                ratio = statistics.median(t["gloo"]) / statistics.median(t["mcp"])
                notes.append(
                    f"- {label}: mcp {ratio:.2f}x gloo's speed (median step); parameters after "
                    f"training {'bit-identical' if res['same_params'] else 'differ'} "
                    f"(max |diff| {res['max_param_diff']:.2e}); mcp rank 0 sent "
                    f"{res['mcp_bytes_sent_rank0'] / 2**20:.1f} MiB; run took {wall:.0f} s"
                )
            if t["gloo"] and t.get(FLOOR):
                floor = statistics.median(t[FLOOR])
                notes.append(
                    f"- {label}: a step without DDP (no all-reduce) takes {1e3 * floor:.2f} ms: "
                    f"no backend can be more than {statistics.median(t['gloo']) / floor:.2f}x "
                    "gloo's speed here"
                )
            grad_mib = res["grad_mib"]
            n_params = res["params"]
    print()
    if rows:
        print(
            f"DDP, 2 ranks, MLP {args.inputs}-{args.width}-{args.width}-10 ({n_params:,} "
            f"parameters, {grad_mib:.1f} MiB fp32 gradients), batch {args.batch} per rank, "
            f"OMP_NUM_THREADS={args.threads}\n"
        )
        print("| link | backend | steps | median step (ms) | p90 step (ms) | samples/s |")
        print("|---|---|---|---|---|---|")
        print("\n".join(rows))
        print()
    print("\n".join(notes))
    if args.json and per_link:
        meta = {
            "command": shlex.join(["python", "benches/bench_ddp.py", *sys.argv[1:]]),
            "date": started,
            "cpus": os.cpu_count(),
            "title": f"DDP step, 2 ranks, MLP {args.inputs}-{args.width}-{args.width}-10 "
            f"({grad_mib:.1f} MiB of gradients), batch {args.batch} per rank",
        }
        out = {"meta": meta, "links": per_link, "labels": {}, "notes": notes}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Example: python benches/bench_ddp.py --steps 20 --loss 0.2",
    )
    p.add_argument(
        "--links",
        default="loopback,lossy",
        help="loopback,lossy,veth (default: loopback,lossy)",
    )
    p.add_argument("--loss", type=float, default=0.2, help="drop probability of the lossy link")
    p.add_argument(
        "--hook",
        choices=("output", "input"),
        default="input",
        help="where mcp-chaos drops packets: input (silent, as a lossy link; default) or "
        "output (the sender's send fails with EPERM, which TCP recovers from at once)",
    )
    p.add_argument("--steps", type=int, default=20, help="timed steps per backend and link")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per backend first")
    p.add_argument("--block", type=int, default=5, help="steps per backend before switching")
    p.add_argument("--batch", type=int, default=64, help="samples per rank and step")
    p.add_argument("--width", type=int, default=1024, help="hidden width of the MLP")
    p.add_argument("--inputs", type=int, default=512, help="input features")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    p.add_argument(
        "--budget", type=float, default=75.0, help="seconds of timed steps per link at most"
    )
    p.add_argument("--json", help="also write the step times to this file (benches/plots.py)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not 0.0 <= args.loss < 1.0:
        p.error("--loss must be in [0, 1)")
    if min(args.steps, args.block, args.batch, args.width, args.inputs, args.threads) < 1:
        p.error("--steps, --block, --batch, --width, --inputs, --threads must be positive")
    return worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    raise SystemExit(main())
