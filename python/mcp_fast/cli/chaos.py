"""``mcp-chaos``: run a command over a lossy and/or rate-limited loopback.

::

    mcp-chaos --loss 0.2 [--rate 1gbit] [--burst 256kb] [--latency 50ms] [--timeout S] -- CMD ...

CMD runs inside a fresh network namespace ``mcpchaos-<pid>`` whose only interface is its own
``lo`` (127.0.0.1), set up as in the design notes:

- ``--loss P``: an nftables rule drops each packet with probability P
  (``numgen random mod 1000 < round(1000·P) drop``); on loopback every packet passes the
  hook once, so P is the loss rate of every datagram and segment, in both directions.
  ``--hook output`` (the default, the design notes' recipe) drops a packet as it is sent,
  and the sender's ``send`` fails with EPERM for it; ``--hook input`` drops it on arrival,
  silently, as a real lossy link does.
- ``--rate R``: a ``tbf`` qdisc on ``lo`` caps throughput at R (tc syntax: ``1gbit``,
  ``100mbit``); ``--burst`` is its bucket size and ``--latency`` the longest a packet may wait
  in its queue before being dropped. ``--latency`` adds no delay of its own.

The host's own ``lo`` and every other interface are untouched, and nothing in the namespace
can reach beyond it. The namespace is deleted when CMD ends, when mcp-chaos is interrupted
(SIGINT, SIGTERM, SIGHUP are passed on to CMD, which runs in its own process group;
a second signal kills it), or when setting it up fails; processes
CMD left behind in it are killed.

Exit status: CMD's own, or 128+N when it was ended by signal N (as a shell reports it);
124 when ``--timeout`` expired; 2 when mcp-chaos itself could not run (not root, ``ip``,
``tc`` or ``nft`` missing, bad arguments, a setup command failing), with the reason on
stderr.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from types import FrameType

from . import positive_size

__all__ = ["ChaosError", "main"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_SETUP_TIMEOUT_S = 30


class ChaosError(Exception):
    """mcp-chaos cannot do what was asked; the message says what is needed."""


def _loss(text: str) -> float:
    try:
        p = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= p <= 1.0:
        raise argparse.ArgumentTypeError(f"loss must be between 0 and 1, got {p}")
    return p


def _tc_rate(text: str) -> str:
    if not re.fullmatch(r"\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)", text):
        raise argparse.ArgumentTypeError(
            f"not a tc rate: {text!r} (examples: 1gbit, 100mbit, 500kbit)"
        )
    return text


def _tc_size(text: str) -> str:
    return str(positive_size(text))  # bytes, which tc reads unambiguously


def _tc_time(text: str) -> str:
    if not re.fullmatch(r"\d+(\.\d+)?(us|ms|s)", text):
        raise argparse.ArgumentTypeError(f"not a time: {text!r} (examples: 50ms, 1s, 500us)")
    return text


def _timeout(text: str) -> float:
    try:
        t = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not t > 0:
        raise argparse.ArgumentTypeError("must be positive")
    return t


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mcp-chaos",
        description="Run CMD in a fresh network namespace whose loopback drops packets "
        "and/or is rate-limited (needs root, iproute2, and nftables for --loss).",
        epilog="Example: mcp-chaos --loss 0.2 -- torchrun --nproc-per-node 2 train.py",
    )
    p.add_argument("--loss", type=_loss, default=0.0, help="drop probability, 0..1 (e.g. 0.2)")
    p.add_argument(
        "--hook",
        choices=("output", "input"),
        default="output",
        help="where packets are dropped: output (send fails with EPERM) or input (silent)",
    )
    p.add_argument("--rate", type=_tc_rate, help="rate cap in tc syntax (e.g. 1gbit)")
    p.add_argument("--burst", type=_tc_size, default="256kb", help="tbf bucket (256kb)")
    p.add_argument(
        "--latency", type=_tc_time, default="50ms", help="tbf queueing limit, not a delay (50ms)"
    )
    p.add_argument("--timeout", type=_timeout, help="kill CMD after this many seconds (exit 124)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command")
    return p


def _check_environment(args: argparse.Namespace) -> None:
    needed = {"ip": "iproute2"}
    if args.rate:
        needed["tc"] = "iproute2"
    if args.loss > 0:
        needed["nft"] = "nftables"
    missing = [
        f"{tool} (Debian package {pkg})" for tool, pkg in needed.items() if not shutil.which(tool)
    ]
    if missing:
        pkgs = " ".join(sorted({needed[m.split()[0]] for m in missing}))
        raise ChaosError(
            f"missing tools: {', '.join(missing)}; install them with: apt-get install -y {pkgs}"
        )
    if os.geteuid() != 0:
        raise ChaosError(
            "needs root to create a network namespace (ip netns add); run it with sudo, "
            "or as root in a container with CAP_NET_ADMIN"
        )


def _run(cmd: list[str]) -> None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=_SETUP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ChaosError(f"`{' '.join(cmd)}` failed: {e}") from None
    if r.returncode != 0:
        raise ChaosError(f"`{' '.join(cmd)}` failed ({r.returncode}): {r.stderr.strip()}")


def _setup(ns: str, args: argparse.Namespace) -> None:
    ex = ["ip", "netns", "exec", ns]
    _run([*ex, "ip", "link", "set", "lo", "up"])
    if args.rate:
        _run(
            [
                *ex,
                "tc",
                "qdisc",
                "add",
                "dev",
                "lo",
                "root",
                "tbf",
                "rate",
                args.rate,
                "burst",
                args.burst,
                "latency",
                args.latency,
            ]
        )
    if args.loss > 0:
        n = round(args.loss * 1000)
        _run([*ex, "nft", "add", "table", "inet", "chaos"])
        _run(
            [
                *ex,
                "nft",
                "add",
                "chain",
                "inet",
                "chaos",
                "out",
                f"{{ type filter hook {args.hook} priority 0; }}",
            ]
        )
        _run(
            [
                *ex,
                "nft",
                "add",
                "rule",
                "inet",
                "chaos",
                "out",
                "numgen",
                "random",
                "mod",
                "1000",
                "<",
                str(n),
                "drop",
            ]
        )


def _teardown(ns: str) -> list[str]:
    """Kill what is left in the namespace and delete it; returns the problems met."""
    problems = []
    try:
        pids = subprocess.run(
            ["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=_SETUP_TIMEOUT_S
        ).stdout.split()
        for pid in pids:
            if pid.isdigit() and int(pid) != os.getpid():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        r = subprocess.run(
            ["ip", "netns", "del", ns], capture_output=True, text=True, timeout=_SETUP_TIMEOUT_S
        )
        if r.returncode != 0:
            problems.append(f"could not delete namespace {ns}: {r.stderr.strip()}")
    except (OSError, subprocess.TimeoutExpired) as e:
        problems.append(f"could not delete namespace {ns}: {e}")
    return problems


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def _chaos(args: argparse.Namespace, cmd: list[str]) -> int:
    ns = f"mcpchaos-{os.getpid()}"
    child: subprocess.Popen[bytes] | None = None
    received: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)
        if child is not None and child.poll() is None:
            # A second signal means "now": kill instead of asking.
            child.send_signal(signal.SIGKILL if len(received) > 1 else signum)
        elif child is None:
            raise KeyboardInterrupt  # during setup: unwind through `finally`

    previous = {s: signal.signal(s, forward) for s in _SIGNALS}
    try:
        _run(["ip", "netns", "add", ns])
        try:
            _setup(ns, args)
            try:
                # Its own process group: a Ctrl-C reaches it once, forwarded by us.
                child = subprocess.Popen(["ip", "netns", "exec", ns, *cmd], process_group=0)
            except OSError as e:
                raise ChaosError(f"could not start {cmd[0]}: {e}") from None
            try:
                rc = child.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                print(
                    f"mcp-chaos: {cmd[0]} still running after {args.timeout} s; killing it",
                    file=sys.stderr,
                )
                child.kill()
                child.wait()
                return 124
            return _exit_code(rc)
        finally:
            if child is not None and child.poll() is None:
                child.kill()
                child.wait()
            for problem in _teardown(ns):
                print(f"mcp-chaos: warning: {problem}", file=sys.stderr)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        parser.print_usage(sys.stderr)
        print("mcp-chaos: error: no command given (put it after --)", file=sys.stderr)
        return 2
    try:
        _check_environment(args)
        return _chaos(args, cmd)
    except ChaosError as e:
        print(f"mcp-chaos: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mcp-chaos: interrupted; namespace removed", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
