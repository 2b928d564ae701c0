"""Two network namespaces joined by a veth pair: two "hosts" on one machine.

::

    with VethPair() as net:          # needs root and iproute2
        net.popen(0, ["torchrun", ...])   # runs in namespace 0, address net.addr[0]
        net.popen(1, ["torchrun", ...])   # namespace 1, address net.addr[1]

Each namespace has ``lo`` up and one end of the veth pair with a private /24 address
(10.213.N.1 and 10.213.N.2, N from the pid) that exists only inside these namespaces: the
host's interfaces and routes are untouched and nothing inside can reach beyond the pair.
On exit every process left in either namespace is killed and both namespaces are deleted,
also when setting them up failed half-way.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from typing import Any

_CMD_TIMEOUT_S = 30


def available() -> bool:
    """Whether this process may create network namespaces (root, iproute2 present)."""
    return os.geteuid() == 0 and shutil.which("ip") is not None


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    if r.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({r.returncode}): {r.stderr.strip()}")


class VethPair:
    """Namespaces ``mcpmh<pid>-0`` and ``mcpmh<pid>-1`` linked by a veth pair."""

    def __init__(self, tag: str = "") -> None:
        pid = os.getpid()
        base = f"mcpmh{pid}{tag}"
        self.ns = [f"{base}-0", f"{base}-1"]
        subnet = 10 + pid % 240  # keeps the /24 apart from concurrent runs, mostly
        self.addr = [f"10.213.{subnet}.1", f"10.213.{subnet}.2"]
        # Each namespace's end of the pair (names live in the namespace after the move,
        # at most 15 characters).
        self.dev = [f"mh{pid}a"[-15:], f"mh{pid}b"[-15:]]
        self._procs: list[subprocess.Popen[Any]] = []

    def __enter__(self) -> VethPair:
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _setup(self) -> None:
        a, b = self.ns
        va, vb = self.dev
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        try:
            _ip("link", "set", va, "netns", a)
            _ip("link", "set", vb, "netns", b)
        except RuntimeError:
            subprocess.run(["ip", "link", "del", va], capture_output=True, timeout=_CMD_TIMEOUT_S)
            raise
        for ns, dev, ip in ((a, va, self.addr[0]), (b, vb, self.addr[1])):
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")

    def popen(self, i: int, cmd: list[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``cmd`` in namespace ``i`` (its own process group, so it can be killed whole)."""
        p = subprocess.Popen(["ip", "netns", "exec", self.ns[i], *cmd], process_group=0, **kw)
        self._procs.append(p)
        return p

    def close(self) -> list[str]:
        """Kill everything started here or left in the namespaces; delete them. Returns problems."""
        problems = []
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=_CMD_TIMEOUT_S)
        for ns in self.ns:
            try:
                pids = subprocess.run(
                    ["ip", "netns", "pids", ns],
                    capture_output=True,
                    text=True,
                    timeout=_CMD_TIMEOUT_S,
                ).stdout.split()
                for pid in pids:
                    if pid.isdigit() and int(pid) != os.getpid():
                        try:
                            os.kill(int(pid), signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                r = subprocess.run(
                    ["ip", "netns", "del", ns], capture_output=True, text=True, timeout=30
                )
                # Deleting a namespace that was never created is not a problem.
                if r.returncode != 0 and "No such file" not in r.stderr:
                    problems.append(f"could not delete {ns}: {r.stderr.strip()}")
            except (OSError, subprocess.TimeoutExpired) as e:
                problems.append(f"could not delete {ns}: {e}")
        return problems


def wait_all(procs: list[subprocess.Popen[Any]], within_s: float) -> list[int | None]:
    """Each process's exit code, all waited for under one deadline ``within_s`` from now;
    ``None`` for one still running at the deadline (``VethPair.close`` kills it)."""
    deadline = time.monotonic() + within_s
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    return codes
