"""An elastic job of real processes on 127.0.0.1 for the tests: an ``mcp-coordinator`` and
members running ``examples/train_elastic.py``, which the tests kill, freeze and add.

Every process is bounded in time and killed at the end; what the members wrote
(``--json``, with the state digest of every committed step) is checked by
:func:`assert_consistent`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _launch import free_port

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train_elastic.py"
SECRET = "elastic-test-secret"


@dataclass
class Coordinator:
    proc: subprocess.Popen[str]
    addr: str
    lines: list[tuple[float, str]] = field(default_factory=list)
    reader: threading.Thread | None = None

    def stop(self) -> None:
        """Kills it (if it still runs) and releases its pipe."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        if self.reader is not None:
            self.reader.join(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def epochs(self) -> list[tuple[float, int, int]]:
        """(time, epoch, members) of each epoch it formed."""
        out = []
        for t, line in list(self.lines):
            if line.startswith("epoch "):
                head = line.split(":")[0].split()
                n = int(line.split(":")[1].split()[0])
                out.append((t, int(head[1]), n))
        return out


class ElasticRun:
    """A coordinator and members; use as a context manager (everything is killed at exit)."""

    def __init__(
        self,
        tmp: Path,
        steps: int,
        *,
        step_sleep: float = 0.02,
        env: dict[str, str] | None = None,
        min_members: int = 1,
    ) -> None:
        self.tmp, self.steps, self.step_sleep = tmp, steps, step_sleep
        self.port = free_port()
        self.min_members = min_members
        self.env = {
            **os.environ,
            "MCP_SECRET": SECRET,
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.members: dict[str, subprocess.Popen[str]] = {}
        self.coordinator: Coordinator | None = None
        self.coordinators: list[Coordinator] = []
        self.deadline = time.monotonic() + 240

    def __enter__(self) -> ElasticRun:
        self.start_coordinator()
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.members.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait(timeout=10)
        for c in self.coordinators:
            c.stop()

    def start_coordinator(self) -> Coordinator:
        env = {k: v for k, v in self.env.items() if k != "MCP_CHAOS"}
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mcp_fast.cli.coordinator",
                "--bind",
                f"127.0.0.1:{self.port}",
                "--min-members",
                str(self.min_members),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("listening on"), first
        c = Coordinator(proc, first.split()[-1])

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                c.lines.append((time.monotonic(), line.strip()))

        c.reader = threading.Thread(target=read, daemon=True)
        c.reader.start()
        self.coordinator = c
        self.coordinators.append(c)
        return c

    def spawn(self, name: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        assert self.coordinator is not None
        log = open(self.tmp / f"{name}.log", "w")
        p = subprocess.Popen(
            [
                sys.executable,
                str(TRAIN),
                "--join",
                self.coordinator.addr,
                "--steps",
                str(self.steps),
                "--step-sleep",
                str(self.step_sleep),
                "--corpus-bytes",
                "300000",
                "--digests",
                "--quiet",
                "--json",
                str(self.tmp / f"{name}.json"),
                "--status",
                str(self.tmp / f"{name}.status"),
                "--timeline",
                str(self.tmp / f"{name}.timeline"),
            ],
            env={**self.env, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        log.close()
        self.members[name] = p
        return p

    def wait_for(self, what: str, pred: Any, timeout: float = 90) -> Any:
        """Polls ``pred()`` until it is truthy; fails the test after ``timeout``."""
        end = min(time.monotonic() + timeout, self.deadline)
        while time.monotonic() < end:
            v = pred()
            if v:
                return v
            time.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}; coordinator said: {self.said()}")

    def wait_epoch(self, members: int, after: int = 0, timeout: float = 90) -> int:
        """Waits for an epoch newer than ``after`` with ``members`` members; returns it."""
        assert self.coordinator is not None
        c = self.coordinator

        def found() -> int | None:
            for _, e, n in c.epochs():
                if e > after and n == members:
                    return e
            return None

        return self.wait_for(f"an epoch > {after} with {members} members", found, timeout)

    def by_rank(self) -> tuple[int, dict[int, str]]:
        """The epoch every live member runs in, and which member has which rank in it
        (waits until they agree: one may still be on its way into a newer epoch)."""
        assert self.coordinator is not None
        c = self.coordinator

        def ranks() -> tuple[int, dict[int, str]] | None:
            seen: dict[str, dict[str, int]] = {}
            for name, p in self.members.items():
                f = self.tmp / f"{name}.status"
                if p.poll() is None and f.exists():
                    try:
                        seen[name] = json.loads(f.read_text())
                    except ValueError:
                        return None
            epochs = {st["epoch"] for st in seen.values()}
            sizes = {e: n for _, e, n in c.epochs()}
            if len(epochs) != 1:
                return None
            (e,) = epochs
            out = {st["rank"]: name for name, st in seen.items()}
            return (e, out) if len(out) == sizes.get(e) else None

        return self.wait_for("the members to agree on an epoch", ranks, 60)

    def latest_epoch(self) -> int:
        assert self.coordinator is not None
        e = self.coordinator.epochs()
        return e[-1][1] if e else 0

    def said(self) -> list[str]:
        return [line for _, line in self.coordinator.lines] if self.coordinator else []

    def finish(self, names: list[str], timeout: float = 150) -> dict[str, dict[str, Any]]:
        """Waits for ``names`` to exit, and returns what each wrote."""
        out = {}
        for n in names:
            p = self.members[n]
            left = max(1.0, min(timeout, self.deadline - time.monotonic()))
            try:
                rc = p.wait(timeout=left)
            except subprocess.TimeoutExpired:
                p.kill()
                raise AssertionError(
                    f"member {n} hung; its log:\n{(self.tmp / f'{n}.log').read_text()[-3000:]}"
                    f"\ncoordinator: {self.said()}"
                ) from None
            log = (self.tmp / f"{n}.log").read_text()
            assert rc == 0, f"member {n} exited with {rc}:\n{log[-3000:]}"
            out[n] = json.loads((self.tmp / f"{n}.json").read_text())
        return out


def assert_consistent(results: dict[str, dict[str, Any]], steps: int) -> None:
    """Every member reached ``steps`` with the same final state, and after every committed
    step, the members of an epoch that committed it hold the same state."""
    finals = {n: r["sha3"] for n, r in results.items()}
    assert len(set(finals.values())) == 1, f"final states differ: {finals}"
    for n, r in results.items():
        assert r["final_step"] == steps, (n, r["final_step"])
    seen: dict[tuple[int, int], tuple[str, str]] = {}
    for n, r in results.items():
        for step, (epoch, sha) in r["digests"].items():
            key = (int(step), int(epoch))
            if key in seen:
                other, want = seen[key]
                assert sha == want, f"step {step} of epoch {epoch}: {n} and {other} differ"
            else:
                seen[key] = (n, sha)
