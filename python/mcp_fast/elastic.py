"""Elastic jobs: members may die, freeze or arrive at any step, and training goes on.

A job runs each step over an agreed member set, its *epoch*, formed by the coordinator
(``mcp-coordinator --bind HOST:PORT``, a small process that is not a training rank). When a
member dies or leaves, the coordinator tells the others at once (their collective in flight
is aborted), forms the next epoch of the survivors, and every member joins that epoch's
group; a newcomer waits until the members reach a step boundary, then joins. After every
change the members with fewer committed steps than the best, and every newcomer, take the
state of the member with the most, over MCP (nothing touches disk): afterwards every member
holds the same state at the same step.

A step is *committed* on a member when its collectives completed there. If a member dies in
the middle of a step, the survivors whose collective completed keep the step, the others
take it from them at the next epoch; if none completed it, it is redone. Either way every
live member ends with identical state.

:class:`ElasticJob` is the framework-free core of it (``save``/``load`` callables carry the
state); :class:`mcp_fast.torch.ElasticDDP` wraps a torch model and optimizer with it.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _core
from .errors import AuthenticationError, MCPError, MCPTimeoutError, VersionMismatchError
from .group import Group
from .settings import Settings, env_float

__all__ = ["ElasticJob", "EpochChange", "serve_coordinator"]

#: The tag of the heal messages: far from the small tags user code picks.
_HEAL_TAG = 0x7E_A1


@dataclass
class EpochChange:
    """What one change of epoch did on this member."""

    epoch: int
    world_size: int
    rank: int
    #: Steps every member held once healed.
    step: int
    #: ``"source"`` (sent its state), ``"taker"`` (received it) or ``"kept"``.
    role: str
    #: Bytes of state sent or received.
    heal_bytes: int
    #: Seconds from leaving the old epoch to being ready in the new one.
    seconds: float
    #: Attempts it took (a member dying during the change makes another one).
    attempts: int = 1


@dataclass
class _Epoch:
    number: int
    rank: int
    world_size: int
    group: Group


@dataclass
class _Counters:
    changes: list[EpochChange] = field(default_factory=list)
    failed_steps: int = 0


# Errors another attempt cannot mend: a member of another protocol version, or one that does
# not hold the epoch's secret, would be refused again until the timeout hid the cause.
_WONT_HEAL = (AuthenticationError, VersionMismatchError)


class ElasticJob:
    """One process's membership in an elastic job.

    ``save()`` returns the training state as bytes and ``load(data)`` installs such bytes;
    ``spec`` describes the state (names, dtypes, shapes): the coordinator refuses a process
    whose spec is not the job's, with :class:`~mcp_fast.SpecMismatchError` naming both. A
    declared Model-Spec (``model_spec=`` or ``MCP_MODEL_SPEC``, as for :func:`mcp_fast.init`)
    is part of it: a process declaring another model is refused at admission too.

    The loop::

        job = ElasticJob("10.0.0.1:29400", save=..., load=..., spec=...)
        while job.step < steps:
            group = job.begin()        # (re)forms the epoch, admits newcomers, heals
            ...compute, then collectives on group...
            job.commit()               # or job.abandon() when a collective raised MCPError

    ``coordinator`` defaults to ``MCP_COORDINATOR``; ``secret`` to ``MCP_SECRET`` (required:
    the coordinator and the members authenticate with it). ``heartbeat`` (seconds, default
    ``MCP_ELASTIC_HEARTBEAT`` or 0.1) is how often this member tells the coordinator it
    lives; the coordinator's ``--dead-after`` should be three of them.
    ``rendezvous_timeout`` bounds joining one epoch's group (a member that dies during it
    makes the others try the next epoch). Other keyword arguments are the data groups'
    settings, as for :func:`mcp_fast.init`.
    """

    def __init__(
        self,
        coordinator: str | None = None,
        *,
        save: Callable[[], bytes],
        load: Callable[[bytes], None],
        spec: str,
        secret: str | bytes | None = None,
        heartbeat: float | None = None,
        timeout: float | None = None,
        rendezvous_timeout: float = 10.0,
        member_id: int | None = None,
        **group_settings: Any,
    ) -> None:
        coordinator = coordinator or os.environ.get("MCP_COORDINATOR")
        if not coordinator:
            raise ValueError(
                "an elastic job needs its coordinator's address: pass coordinator='HOST:PORT' "
                "or set MCP_COORDINATOR (start one with `mcp-coordinator --bind HOST:PORT`)"
            )
        self._settings = Settings.resolve(secret=secret, timeout=timeout, **group_settings)
        if not self._settings.secret:
            raise ValueError(
                "an elastic job needs a job secret, the same on the coordinator and every "
                "member: set MCP_SECRET (e.g. $(openssl rand -hex 32)) or pass secret=..."
            )
        if self._settings.model_spec is not None:
            declared = json.dumps(self._settings.model_spec, sort_keys=True, separators=(",", ":"))
            spec = f"{spec};model_spec:{declared}"
        hb = heartbeat if heartbeat is not None else env_float("MCP_ELASTIC_HEARTBEAT")
        self._save, self._load = save, load
        self._rendezvous_timeout = float(rendezvous_timeout)
        self._member = _core.ElasticMember(
            coordinator,
            self._settings.secret,
            spec,
            member_id if member_id is not None else random.getrandbits(63),
            heartbeat=hb if hb is not None else 0.1,
            connect_timeout=self._settings.connect_timeout,
        )
        self._epoch: _Epoch | None = None
        self._seen = 0
        self._has_state = False
        self._counters = _Counters()
        #: Steps committed.
        self.step = 0

    # -- what the loop reads ------------------------------------------------------------

    @property
    def member_id(self) -> int:
        """This process's id in the job (random, new for every process)."""
        return self._member.id

    @property
    def epoch(self) -> int:
        """The epoch this member runs in (0 before the first)."""
        return self._epoch.number if self._epoch else 0

    @property
    def rank(self) -> int:
        """This member's rank in the current epoch."""
        return self._current().rank

    @property
    def world_size(self) -> int:
        """Members of the current epoch: the live count to average over."""
        return self._current().world_size

    @property
    def group(self) -> Group:
        """The current epoch's group."""
        return self._current().group

    @property
    def changes(self) -> list[EpochChange]:
        """Every change of epoch this member went through."""
        return list(self._counters.changes)

    @property
    def failed_steps(self) -> int:
        """Steps abandoned because a collective failed."""
        return self._counters.failed_steps

    def _current(self) -> _Epoch:
        if self._epoch is None:
            raise RuntimeError("not in an epoch yet: call begin() first")
        return self._epoch

    # -- the loop -------------------------------------------------------------------------

    def begin(self) -> Group:
        """Call at every step boundary. Returns the group to run this step's collectives on:
        the current epoch's, or, when the epoch is over (a member died or left, newcomers
        wait, this member was expelled), the next one's, joined and healed."""
        e = self._epoch
        if e is not None:
            beat = self._member.beat()
            over = self._member.epoch_over(e.number)
            due = (
                beat is not None
                and beat["member"]
                and beat["latest"] == e.number
                and beat["change_at"] is not None
                and self.step >= beat["change_at"]
            )
            if not (over or due):
                return e.group
            if beat is not None and not beat["member"]:
                self._expelled()
            self._leave_epoch(abort=over)
        self._join()
        return self._current().group

    def commit(self) -> None:
        """This step's collectives completed: count it."""
        self.step += 1
        self._has_state = True
        self._member.set_step(self.step)

    def abandon(self) -> None:
        """This step's collectives failed (an :class:`~mcp_fast.MCPError`): leave the epoch;
        the next :meth:`begin` joins the next one, where this member either takes the step
        from a member that completed it, or redoes it with the others."""
        self._counters.failed_steps += 1
        beat = self._member.beat()
        if beat is not None and not beat["member"] and beat["latest"] >= self.epoch:
            self._expelled()
        self._leave_epoch(abort=True)

    def close(self) -> None:
        """Leave the job for good (the others go on without this member)."""
        self._leave_epoch(abort=False)
        self._member.leave()

    def __enter__(self) -> ElasticJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- epochs ---------------------------------------------------------------------------

    def _expelled(self) -> None:
        # Declared dead while it was frozen or cut off: whatever it holds may include a step
        # the others never committed, so it rejoins as a newcomer and takes their state.
        self._has_state = False
        self._member.forget_view()

    def _leave_epoch(self, abort: bool) -> None:
        e, self._epoch = self._epoch, None
        if e is None:
            return
        self._member.unwatch()
        if abort:
            e.group.abort()
        else:
            e.group.close()

    def _join(self) -> None:
        started = time.monotonic()
        deadline = started + self._settings.timeout
        attempts = 0
        while True:
            attempts += 1
            left = deadline - time.monotonic()
            if left <= 0:
                raise MCPTimeoutError(
                    f"no epoch could be joined within {self._settings.timeout:.0f} s "
                    f"({attempts - 1} attempts): are enough members up, and the coordinator?"
                )
            ann = self._member.report(self._seen, self.step if self._has_state else -1, left)
            self._seen = ann["epoch"]
            try:
                group = self._connect(ann)
            except _WONT_HEAL:
                raise
            except MCPError:
                continue
            # Watched from here on: a member dying during the heal aborts it at once.
            self._member.watch(ann["epoch"], group.core)
            try:
                role, nbytes = self._heal(group, ann)
            except MCPError:
                self._member.unwatch()
                group.abort()
                continue
            self.step = ann["step"]
            self._has_state = True
            self._member.set_step(self.step)
            self._epoch = _Epoch(ann["epoch"], ann["rank"], ann["world_size"], group)
            self._counters.changes.append(
                EpochChange(
                    epoch=ann["epoch"],
                    world_size=ann["world_size"],
                    rank=ann["rank"],
                    step=self.step,
                    role=role,
                    heal_bytes=nbytes,
                    seconds=time.monotonic() - started,
                    attempts=attempts,
                )
            )
            return

    def _connect(self, ann: dict[str, Any]) -> Group:
        epoch, rank, world = ann["epoch"], ann["rank"], ann["world_size"]
        kw = self._settings.core_kwargs()
        kw["secret"] = ann["group_secret"]
        kw["connect_timeout"] = min(self._rendezvous_timeout, self._settings.connect_timeout)
        if rank == 0:
            member = self._member
            core = _core.ProcessGroup(
                0,
                world,
                member.local_ip,
                0,
                on_bound=lambda addr: member.announce_master(epoch, addr),
                epoch_of=(member, epoch),
                **kw,
            )
        else:
            addr = self._member.master(epoch, kw["connect_timeout"])
            if addr is None:
                raise MCPError(f"epoch {epoch} ended before it started")
            host, port = addr.rsplit(":", 1)
            core = _core.ProcessGroup(
                rank, world, host.strip("[]"), int(port), epoch_of=(self._member, epoch), **kw
            )
        return Group(core)

    def _heal(self, group: Group, ann: dict[str, Any]) -> tuple[str, int]:
        source, takers = ann["source"], ann["takers"]
        if group.rank == source and takers:
            blob = np.frombuffer(self._save(), dtype=np.uint8)
            size = np.array([blob.size], dtype=np.int64)
            works = []
            for t in takers:
                works.append(group.send(size, t, tag=_HEAL_TAG, async_op=True))
                works.append(group.send(blob, t, tag=_HEAL_TAG, async_op=True))
            for w in works:
                if w is not None:
                    w.wait()
            return "source", blob.size * len(takers)
        if group.rank in takers:
            size = np.zeros(1, dtype=np.int64)
            group.recv(size, source, tag=_HEAL_TAG)
            blob = np.empty(int(size[0]), dtype=np.uint8)
            group.recv(blob, source, tag=_HEAL_TAG)
            self._has_state = False
            self._load(blob.tobytes())
            return "taker", blob.size
        return "kept", 0


def serve_coordinator(
    bind: str,
    secret: str | bytes | None = None,
    *,
    min_members: int = 1,
    dead_after: float = 0.3,
    join_window: float = 0.2,
    change_limit: float = 60.0,
    rebuild_window: float = 2.0,
) -> _core.Coordinator:
    """Starts a coordinator in this process (``mcp-coordinator`` runs one); returns it.
    ``bind`` is ``HOST:PORT`` (port 0 picks one: read ``.local_addr``)."""
    s = secret if secret is not None else os.environ.get("MCP_SECRET")
    if not s:
        raise ValueError(
            "the coordinator needs the job secret: set MCP_SECRET or pass --secret/secret="
        )
    return _core.Coordinator(
        bind,
        s.encode() if isinstance(s, str) else bytes(s),
        min_members=min_members,
        dead_after=dead_after,
        join_window=join_window,
        change_limit=change_limit,
        rebuild_window=rebuild_window,
    )
