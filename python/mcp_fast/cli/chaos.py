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

CMD's ranks all run on one host, where mcp_fast would connect them through shared memory
and never cross the emulated link: mcp-chaos sets ``MCP_SHM=0`` for CMD unless ``MCP_SHM`` is
already set. The host's own ``lo`` and every other interface are untouched, and nothing in the
namespace can reach beyond it. The namespace is deleted when CMD ends, when mcp-chaos is interrupted
(SIGINT, SIGTERM, SIGHUP are passed on to CMD, which runs in its own process group;
a second signal kills it), or when setting it up fails; processes
CMD left behind in it are killed.

Two hosts (``--hosts 2``)::

    mcp-chaos --hosts 2 --delay 25ms --jitter 5ms --loss 0.01 --rate 200mbit -- CMD ...

CMD runs twice, once in each of two fresh namespaces ``mcpchaos-<pid>-0`` and ``-1``. Each
has ``lo`` and one TUN device (``--mtu``, 1500) with the address 10.201.0.1 (host 0) or
10.201.0.2 (host 1), a point-to-point route to the other, and nothing else. A forwarder in
mcp-chaos itself (Rust, ``mcp_fast._core.netem_forward``) carries every IP packet between
the two TUNs, each direction on its own: ``--delay`` one way, ``--jitter`` (uniform, never
reordering: a packet never overtakes the one before it), drop probability ``--loss``, and
``--rate`` as a serialising link whose queue holds at most ``--queue`` of waiting (a packet
that would wait longer is dropped). ``--seed`` seeds loss and jitter. TCP, UDP and QUIC all
see the same path. Each CMD gets ``MCP_CHAOS_HOST`` (0 or 1), ``MCP_CHAOS_ADDRS``
(``10.201.0.1,10.201.0.2``), ``MCP_CHAOS_ADDR`` (its own address) and ``MCP_CHAOS_IFNAME``
(its TUN, for ``GLOO_SOCKET_IFNAME``); for torchrun use ``--master-addr 10.201.0.1
--node-rank $MCP_CHAOS_HOST``. The forwarder's counters are printed on stderr at the end.
Exit status: the first non-zero status of the two, as below; when one fails the other is
given ``--grace`` seconds (10) before it is killed.

Exit status: CMD's own, or 128+N when it was ended by signal N (as a shell reports it);
124 when ``--timeout`` expired; 2 when mcp-chaos itself could not run (not root, ``ip``,
``tc`` or ``nft`` missing, bad arguments, a setup command failing), with the reason on
stderr.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType

from . import positive_size

__all__ = ["ChaosError", "main"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_SETUP_TIMEOUT_S = 30
HOST_ADDRS = ("10.201.0.1", "10.201.0.2")
_TUNSETIFF = 0x400454CA
_IFF_TUN, _IFF_NO_PI = 0x0001, 0x1000
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_RATE_UNITS.update({"bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12})


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


def seconds_of(text: str) -> float:
    """A `_tc_time` string (``25ms``) in seconds."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(us|ms|s)", text)
    if m is None:
        raise ValueError(f"not a time: {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def bits_per_second(text: str) -> float:
    """A `_tc_rate` string (``200mbit``) in bits per second."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]+)", text)
    if m is None or m.group(2) not in _RATE_UNITS:
        raise ValueError(f"not a rate: {text!r}")
    return float(m.group(1)) * _RATE_UNITS[m.group(2)]


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
    p.add_argument(
        "--hosts",
        type=int,
        choices=(1, 2),
        default=1,
        help="2: run CMD in two namespace hosts joined by an emulated WAN path",
    )
    p.add_argument("--delay", type=_tc_time, default="0ms", help="one-way delay (--hosts 2)")
    p.add_argument("--jitter", type=_tc_time, default="0ms", help="± delay jitter (--hosts 2)")
    p.add_argument(
        "--queue", type=_tc_time, default="50ms", help="longest wait for --rate (--hosts 2)"
    )
    p.add_argument("--mtu", type=int, default=1500, help="TUN MTU, 576..65535 (--hosts 2)")
    p.add_argument("--seed", type=int, default=0, help="loss and jitter seed (--hosts 2)")
    p.add_argument("--grace", type=_timeout, default=10.0, help="see --hosts 2 (10 s)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command")
    return p


def _check_environment(args: argparse.Namespace) -> None:
    needed = {"ip": "iproute2"}
    if args.hosts == 2:
        if not os.path.exists("/dev/net/tun"):
            raise ChaosError(
                "--hosts 2 needs /dev/net/tun (the tun module, or --device in a container)"
            )
        if not 576 <= args.mtu <= 65535:
            raise ChaosError(f"--mtu must be between 576 and 65535, got {args.mtu}")
    elif seconds_of(args.delay) or seconds_of(args.jitter):
        raise ChaosError("--delay and --jitter need --hosts 2 (the loopback cannot delay)")
    if args.rate and args.hosts == 1:
        needed["tc"] = "iproute2"
    if args.loss > 0 and args.hosts == 1:
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


def _one_host_env() -> dict[str, str]:
    """CMD's environment in the one-namespace mode: its ranks share one host, and would
    reach each other through shared memory, never crossing the emulated loopback; so
    ``MCP_SHM=0`` unless the caller chose (set ``MCP_SHM=1`` to keep shared memory)."""
    env = dict(os.environ)
    env.setdefault("MCP_SHM", "0")
    return env


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
                child = subprocess.Popen(
                    ["ip", "netns", "exec", ns, *cmd], env=_one_host_env(), process_group=0
                )
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


def _open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError as e:
        os.close(fd)
        raise ChaosError(f"could not create TUN device {name}: {e}") from None
    return fd


def _setup_host(ns: str, tun: str, me: str, peer: str, mtu: int) -> None:
    _run(["ip", "link", "set", tun, "netns", ns])
    ex = ["ip", "-n", ns]
    _run([*ex, "link", "set", "lo", "up"])
    _run([*ex, "addr", "add", me, "peer", peer, "dev", tun])
    _run([*ex, "link", "set", tun, "mtu", str(mtu), "txqueuelen", "1000", "up"])


def _forwarder(
    args: argparse.Namespace, fds: list[int], stop_r: int
) -> tuple[threading.Thread, list[object]]:
    from .. import _core

    netem_forward = getattr(_core, "netem_forward", None)
    if netem_forward is None:
        raise ChaosError("this mcp_fast build has no WAN forwarder (netem_forward); reinstall it")
    result: list[object] = []

    def run() -> None:
        try:
            result.append(
                netem_forward(
                    fds[0],
                    fds[1],
                    stop_r,
                    delay_s=seconds_of(args.delay),
                    jitter_s=seconds_of(args.jitter),
                    loss=args.loss,
                    rate_bit_s=bits_per_second(args.rate) if args.rate else None,
                    queue_s=seconds_of(args.queue),
                    seed=args.seed,
                )
            )
        except Exception as e:  # reported by the main thread
            result.append(e)

    t = threading.Thread(target=run, name="mcp-chaos-forwarder", daemon=True)
    t.start()
    return t, result


def _wait_hosts(
    children: list[subprocess.Popen[bytes]], args: argparse.Namespace, cmd: list[str]
) -> int:
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    first_failure: float | None = None
    while True:
        codes = [c.poll() for c in children]
        if all(rc is not None for rc in codes):
            failed = [rc for rc in codes if rc != 0]
            return _exit_code(failed[0]) if failed else 0
        now = time.monotonic()
        if any(rc not in (None, 0) for rc in codes) and first_failure is None:
            first_failure = now
        if deadline is not None and now > deadline:
            print(
                f"mcp-chaos: {cmd[0]} still running after {args.timeout} s; killing it",
                file=sys.stderr,
            )
            return 124
        if first_failure is not None and now - first_failure > args.grace:
            print(
                f"mcp-chaos: one host failed; the other still runs after {args.grace} s; "
                "killing it",
                file=sys.stderr,
            )
            for c in children:
                if c.poll() is None:
                    c.kill()
        time.sleep(0.05)


def _chaos_hosts(args: argparse.Namespace, cmd: list[str]) -> int:
    pid = os.getpid()
    nss = [f"mcpchaos-{pid}-{i}" for i in range(2)]
    tuns = [f"mcpw{pid}{'ab'[i]}" for i in range(2)]
    children: list[subprocess.Popen[bytes]] = []
    received: list[int] = []
    made: list[str] = []
    fds: list[int] = []
    stop_r, stop_w = os.pipe()
    forwarder: threading.Thread | None = None
    result: list[object] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)
        if not children:
            raise KeyboardInterrupt  # during setup: unwind through `finally`
        for c in children:
            if c.poll() is None:
                c.send_signal(signal.SIGKILL if len(received) > 1 else signum)

    previous = {s: signal.signal(s, forward) for s in _SIGNALS}
    try:
        for i in range(2):
            _run(["ip", "netns", "add", nss[i]])
            made.append(nss[i])
            fds.append(_open_tun(tuns[i]))
            _setup_host(nss[i], tuns[i], HOST_ADDRS[i], HOST_ADDRS[1 - i], args.mtu)
        forwarder, result = _forwarder(args, fds, stop_r)
        for i in range(2):
            env = dict(os.environ)
            env.update(
                MCP_CHAOS_HOST=str(i),
                MCP_CHAOS_ADDRS=",".join(HOST_ADDRS),
                MCP_CHAOS_ADDR=HOST_ADDRS[i],
                MCP_CHAOS_IFNAME=tuns[i],
            )
            try:
                children.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", nss[i], *cmd], env=env, process_group=0
                    )
                )
            except OSError as e:
                raise ChaosError(f"could not start {cmd[0]}: {e}") from None
        return _wait_hosts(children, args, cmd)
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait()
        if forwarder is not None:
            os.write(stop_w, b"x")
            forwarder.join(timeout=_SETUP_TIMEOUT_S)
            _report(result)
        for fd in (*fds, stop_r, stop_w):
            os.close(fd)
        for ns in made:
            for problem in _teardown(ns):
                print(f"mcp-chaos: warning: {problem}", file=sys.stderr)
        for s, h in previous.items():
            signal.signal(s, h)


def _report(result: list[object]) -> None:
    if not result:
        print("mcp-chaos: warning: the forwarder did not stop", file=sys.stderr)
    elif isinstance(result[0], Exception):
        print(f"mcp-chaos: warning: the forwarder failed: {result[0]}", file=sys.stderr)
    elif isinstance(result[0], dict):
        s = result[0]
        for way, label in (("a_to_b", "0->1"), ("b_to_a", "1->0")):
            d = s[way]
            print(
                f"mcp-chaos: path {label}: {d['delivered']} packets ({d['delivered_bytes']} B) "
                f"delivered, {d['lost']} lost, {d['overflow']} dropped by the full queue",
                file=sys.stderr,
            )


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
        return _chaos_hosts(args, cmd) if args.hosts == 2 else _chaos(args, cmd)
    except ChaosError as e:
        print(f"mcp-chaos: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mcp-chaos: interrupted; namespace removed", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
