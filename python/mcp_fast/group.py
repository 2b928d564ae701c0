"""The process group: ``mcp_fast.init()`` and the collectives on numpy arrays and tensors."""

from __future__ import annotations

import atexit
import functools
import json
import os
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Concatenate, ParamSpec, TypedDict, TypeVar

from . import _core
from ._buffers import Buffer, view
from .errors import GroupClosedError, SharedMemoryWarning
from .settings import Settings, env_int


def _op_name(op: Any) -> str:
    """The name of ``op``: a name ('sum', 'avg', 'min', 'max', 'prod', 'band', 'bor',
    'bxor') or a torch.distributed.ReduceOp (the core refuses the names it does not know)."""
    if isinstance(op, str):
        return op
    return str(getattr(op, "name", op)).rsplit(".", 1)[-1]


class _OpCounts:
    """Operations started, and finished ok or failed, by kind (``all_reduce``, ``send``...),
    as seen from Python: read by :mod:`mcp_fast.metrics`. An operation started with
    ``async_op=True`` counts as finished when its :meth:`Work.wait` returns or raises.

    A plain dict increment per event, no lock: under the GIL two threads can lose an
    increment only if both finish an operation of the same kind within one bytecode.
    """

    __slots__ = ("failed", "ok", "started")

    def __init__(self) -> None:
        self.started: dict[str, int] = {}
        self.ok: dict[str, int] = {}
        self.failed: dict[str, int] = {}

    def copy(self) -> dict[str, dict[str, int]]:
        """``{op: {"started": n, "ok": n, "failed": n}}``."""
        started, ok, failed = dict(self.started), dict(self.ok), dict(self.failed)
        return {
            op: {"started": started.get(op, 0), "ok": ok.get(op, 0), "failed": failed.get(op, 0)}
            for op in sorted(started.keys() | ok.keys() | failed.keys())
        }


class Work:
    """Handle of an operation started with ``async_op=True``."""

    __slots__ = ("_counts", "_op", "_work")

    def __init__(self, work: _core.Work) -> None:
        self._work = work
        self._counts: _OpCounts | None = None  # set by @_counted; cleared once counted
        self._op = ""

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done; raise the operation's error if it failed (an MCPError subclass)."""
        try:
            done = self._work.wait(timeout)
        except BaseException:
            if self._counts is not None and self._work.is_completed():
                f = self._counts.failed
                f[self._op] = f.get(self._op, 0) + 1
                self._counts = None
            raise
        if done and self._counts is not None:
            ok = self._counts.ok
            ok[self._op] = ok.get(self._op, 0) + 1
            self._counts = None
        return done

    def is_completed(self) -> bool:
        """True once the operation has finished, successfully or not."""
        return self._work.is_completed()

    def is_success(self) -> bool:
        """True once the operation has finished successfully."""
        return self._work.is_success()

    def exception(self) -> BaseException | None:
        """The error of a failed operation, or None."""
        return self._work.exception()

    def source_rank(self) -> int | None:
        """For a receive: the rank the data came from (known once it started arriving)."""
        return self._work.source_rank()

    def __repr__(self) -> str:
        return repr(self._work)


def _finish(work: _core.Work, async_op: bool) -> Work | None:
    """A synchronous call's Work is finished already (the calling thread ran it): ``wait``
    only raises its error."""
    if async_op:
        return Work(work)
    work.wait(None)
    return None


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _counted(
    op: str,
) -> Callable[[Callable[Concatenate[Group, _P], _R]], Callable[Concatenate[Group, _P], _R]]:
    """Count the calls of a Group operation in ``group._metrics``: started, then ok or failed
    (for ``async_op=True``, when the returned Work's ``wait`` returns or raises)."""

    def deco(fn: Callable[Concatenate[Group, _P], _R]) -> Callable[Concatenate[Group, _P], _R]:
        @functools.wraps(fn)
        def counted(self: Group, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
            m = self._metrics
            m.started[op] = m.started.get(op, 0) + 1
            try:
                w = fn(self, *args, **kwargs)
            except BaseException:
                m.failed[op] = m.failed.get(op, 0) + 1
                raise
            if isinstance(w, Work):  # async_op=True: counted when waited for
                w._counts, w._op = m, op
            else:  # None, or recv's source rank
                m.ok[op] = m.ok.get(op, 0) + 1
            return w

        return counted

    return deco


class Topology(TypedDict):
    """Where the ranks of a group run (see :meth:`Group.topology`)."""

    #: The ranks of each host, hosts numbered in order of first appearance by rank.
    hosts: list[list[int]]
    #: The host index of every rank.
    host_of_rank: list[int]
    #: This rank's host index.
    host: int
    #: This rank's index among the ranks of its host.
    local_rank: int
    #: How many ranks share this rank's host.
    local_world_size: int
    #: Every rank's host identity, as announced at the rendezvous.
    host_ids: list[str]
    #: The peers this rank reaches through shared memory.
    shm_peers: list[int]


class Group:
    """The ranks of one job. Every rank must call the same collectives in the same order.

    All operations work in place on numpy arrays or CPU torch tensors (C-contiguous,
    writable), release the GIL for their whole duration and never copy the data through
    Python. With ``async_op=True`` they return a :class:`Work`; otherwise they return None
    once the result is in place.
    """

    def __init__(self, core: _core.ProcessGroup) -> None:
        self._core: _core.ProcessGroup | None = core
        self.rank: int = core.rank
        self.world_size: int = core.world_size
        self._metrics = _OpCounts()
        self._auto_codec: str | None = None
        _live_groups.add(self)
        for peer, why in core.shm_fallbacks():
            warnings.warn(
                f"rank {self.rank}: no shared memory with rank {peer} on this host ({why}); "
                "it is reached over QUIC instead",
                SharedMemoryWarning,
                stacklevel=3,
            )

    @property
    def core(self) -> _core.ProcessGroup:
        if self._core is None:
            raise GroupClosedError("the group is closed; call mcp_fast.init() again")
        return self._core

    @property
    def local_addr(self) -> str:
        """The UDP address (host:port) this rank listens on."""
        return self.core.local_addr

    def stats(self) -> dict[str, int]:
        """Transport counters: frames_sent/received, bytes_sent/received, corrupt_frames,
        refused_handshakes."""
        return self.core.stats()

    def topology(self) -> Topology:
        """Where every rank runs, as learnt at the rendezvous: ``hosts`` (the ranks of each
        host), ``host_of_rank``, this rank's ``host``, ``local_rank`` and
        ``local_world_size``, every rank's ``host_ids``, and the ``shm_peers`` this rank
        reaches through shared memory. A host is a machine and network namespace (with the
        same boot); ``MCP_HOST_ID`` overrides it. torchrun's ``LOCAL_RANK`` is not used."""
        return self.core.topology()

    def shm_stats(self) -> dict[str, int]:
        """The shared-memory path's counters: ``frames_sent``, ``bytes_sent``,
        ``frames_received``, ``bytes_received`` (not counted in :meth:`stats`); and
        ``direct_ops``, the operations whose data this rank read straight from its local peers'
        tensors, and ``direct_fallbacks``, those that would have but ran through the rings
        because some rank could not read (the kernel's ptrace rules, ``MCP_SHM_DIRECT=0``)."""
        return self.core.shm_stats()

    def total_bytes_sent(self) -> int:
        """Bytes of frames sent to every peer by any path: QUIC (:meth:`stats`) and shared
        memory (:meth:`shm_stats`). What a rank sent, wherever it went."""
        return int(self.core.stats()["bytes_sent"]) + int(self.core.shm_stats()["bytes_sent"])

    def health(self) -> list[dict[str, Any]]:
        """Each other rank: ``state`` (connected / not connected / lost), ``rtt`` and
        ``last_seen`` (seconds), ``silence_limit``, and the ``reason`` it was lost."""
        return self.core.health()

    @property
    def lane(self) -> str:
        """How data travels: ``"auto"``, ``"stream"`` or ``"fec"`` (see :func:`init`)."""
        return self.core.lane

    def lane_stats(self) -> dict[str, int]:
        """The FEC lane's counters: ``frames_sent``, ``frames_received`` over it and
        ``repair_shards`` resent because a receiver asked, and ``fallbacks``: transfers whose
        repairs could not finish them, carried on a stream instead."""
        return self.core.lane_stats()

    def chaos_kill(self) -> None:
        """Cut this process off the network (needs ``chaos=`` at init): every datagram in and
        out is dropped from now on, as if the host vanished."""
        self.core.chaos_kill()

    def chaos_cut(self, seconds: float) -> None:
        """Cut this process off the network for ``seconds`` (needs ``chaos=`` at init), as a
        link flap would: every datagram in and out is dropped meanwhile. Returns at once; the
        path comes back by itself, and operations in flight continue."""
        self.core.chaos_cut(seconds)

    def chaos_reset(self) -> None:
        """Drop every connection of this process at once, as a middlebox that lost its state
        would: they are re-established (0-RTT) and the operations in flight resume from what
        was acknowledged. For tests and drills."""
        self.core.chaos_reset()

    def chaos_stats(self) -> dict[str, int]:
        """The fault injector's counters (empty without ``chaos=``)."""
        return self.core.chaos_stats()

    def rtt(self, peer: int) -> float | None:
        """Smoothed round-trip time to ``peer`` in seconds, once connected."""
        return self.core.rtt(peer)

    @_counted("all_reduce")
    def all_reduce(
        self,
        tensor: Any,
        op: Any = "sum",
        algorithm: str = "auto",
        async_op: bool = False,
        codec: str = "none",
        block: int = 256,
    ) -> Work | None:
        """Reduce ``tensor`` across ranks, in place. ``algorithm``: auto, ring, tree,
        recursive_doubling, hierarchical, direct (auto picks recursive doubling up to 64 KiB;
        above, hierarchical when :attr:`topology` has more than one host and more than one
        rank on some host; direct when every rank is on this host with shared memory and no
        codec is asked for: each rank reads its peers' tensors with one kernel copy, falling
        back to the ring where the kernel refuses it; else ring).

        ``codec`` compresses what travels: ``"fp16"``/``"bf16"`` (round to nearest even),
        ``"int8"`` (blockwise scale, ``block`` elements per scale), ``"lossless"``
        (byte planes + zstd, bit-exact), or ``"auto"``: the fastest of none/bf16/int8 for
        this group's link and CPUs (measured once, agreed by every rank; lossy: use it for
        gradients, not parameters; float32 tensors of 1 MiB and more, else none). Partial
        sums accumulate in the tensor's precision and are re-encoded at each hop; every rank
        ends with the same bits."""
        b = view(tensor, name="all_reduce tensor")
        codec = self._resolve_codec(codec, b)
        w = self.core.all_reduce(b, _op_name(op), algorithm, codec, block, not async_op)
        return _finish(w, async_op)

    def _resolve_codec(self, codec: str, b: Buffer) -> str:
        """``"auto"``: the codec that this group's link and CPUs make fastest, agreed by all."""
        if codec != "auto":
            return codec
        if b.dtype != "float32" or b.nbytes < (1 << 20) or self.world_size == 1:
            return "none"
        if self._auto_codec is None:
            self._auto_codec = self._calibrate_codec()
        return self._auto_codec

    def _calibrate_codec(self) -> str:
        """Times a 4 MiB all-reduce (the link) and each codec's round trip (this CPU), predicts
        the time of each codec, and takes the slowest rank's predictions: every rank ends up
        with the same answer. Runs once, at the first ``codec="auto"`` call of the group."""
        import time

        import numpy as np

        from .kernels import codec_round_trip

        n = 1 << 20
        x = np.ones(n, np.float32)
        self.all_reduce(x)
        t0 = time.perf_counter()
        for _ in range(3):
            self.all_reduce(x)
        per_byte_link = (time.perf_counter() - t0) / 3 / x.nbytes
        candidates = {"none": 1.0, "bf16": 0.5, "int8": 0.26}
        predicted = []
        for codec, ratio in candidates.items():
            cost = 0.0
            if codec != "none":
                y = x.copy()
                t0 = time.perf_counter()
                codec_round_trip(y, codec)
                # Encoded and decoded about once per hop of the ring.
                cost = (time.perf_counter() - t0) / x.nbytes * 2
            predicted.append(ratio * per_byte_link + cost)
        agreed = np.array(predicted, np.float64)
        self.all_reduce(agreed, op="max")
        return list(candidates)[int(np.argmin(agreed))]

    @_counted("broadcast")
    def broadcast(
        self,
        tensor: Any,
        src: int = 0,
        async_op: bool = False,
        codec: str = "none",
        block: int = 256,
    ) -> Work | None:
        """Copy rank ``src``'s ``tensor`` into every other rank's, in place (with a lossy
        ``codec``, the root's tensor too becomes what the others decode)."""
        self._check_rank(src, "src")
        w = self.core.broadcast(
            view(tensor, name="broadcast tensor"), src, codec, block, not async_op
        )
        return _finish(w, async_op)

    @_counted("all_gather")
    def all_gather(
        self,
        out: Any,
        tensor: Any,
        async_op: bool = False,
        codec: str = "none",
        block: int = 256,
    ) -> Work | None:
        """Gather every rank's ``tensor`` into ``out`` of shape ``(world_size, *tensor.shape)``."""
        i = view(tensor, name="all_gather input")
        o = view(out, name="all_gather output")
        if o.dtype != i.dtype:
            raise TypeError(f"all_gather: output dtype {o.dtype} differs from input {i.dtype}")
        if o.shape != (self.world_size, *i.shape):
            raise ValueError(
                f"all_gather: output shape must be {(self.world_size, *i.shape)} "
                f"(world_size, *input.shape), got {o.shape}"
            )
        w = self.core.all_gather(o, i, codec, block, not async_op)
        return _finish(w, async_op)

    @_counted("reduce_scatter")
    def reduce_scatter(
        self,
        out: Any,
        tensor: Any,
        op: Any = "sum",
        async_op: bool = False,
        codec: str = "none",
        block: int = 256,
    ) -> Work | None:
        """Reduce ``tensor`` (world_size times ``out``'s elements) across ranks and leave this
        rank's block of the result in ``out``. ``tensor`` is not modified."""
        i = view(tensor, name="reduce_scatter input")
        o = view(out, name="reduce_scatter output")
        if o.dtype != i.dtype:
            raise TypeError(f"reduce_scatter: output dtype {o.dtype} differs from input {i.dtype}")
        if i.numel != o.numel * self.world_size:
            raise ValueError(
                f"reduce_scatter: input must have world_size ({self.world_size}) x {o.numel} = "
                f"{o.numel * self.world_size} elements, got {i.numel}"
            )
        # The input travels as one flat vector whatever its shape.
        flat = replace(i, shape=(i.numel,))
        w = self.core.reduce_scatter(o, flat, _op_name(op), codec, block, not async_op)
        return _finish(w, async_op)

    @_counted("barrier")
    def barrier(self, async_op: bool = False) -> Work | None:
        """Return once every rank has entered the barrier."""
        return _finish(self.core.barrier(not async_op), async_op)

    @_counted("send")
    def send(
        self,
        tensor: Any,
        dst: int,
        tag: int = 0,
        async_op: bool = False,
        codec: str = "none",
        block: int = 256,
    ) -> Work | None:
        """Send ``tensor`` to rank ``dst``; matched in order with that rank's ``recv``."""
        self._check_rank(dst, "dst")
        w = self.core.send(
            view(tensor, name="send tensor"), dst, _tag(tag), codec, block, not async_op
        )
        return _finish(w, async_op)

    @_counted("recv")
    def recv(
        self,
        tensor: Any,
        src: int | None = None,
        tag: int = 0,
        async_op: bool = False,
        codec: str = "none",
        block: int = 256,
    ) -> Work | int:
        """Receive into ``tensor`` (same dtype and shape as sent) from rank ``src``, or from
        whichever rank sends first when ``src`` is None. Returns the sender's rank (or, with
        ``async_op=True``, a Work whose ``source_rank()`` tells it once done)."""
        b = view(tensor, name="recv tensor")
        if src is None:
            w = self.core.recv_any(b, _tag(tag), codec, block, not async_op)
        else:
            self._check_rank(src, "src")
            w = self.core.recv(b, src, _tag(tag), codec, block, not async_op)
        if async_op:
            return Work(w)
        w.wait(None)
        source = w.source_rank()
        return source if source is not None else int(src)  # type: ignore[arg-type]

    def abort(self) -> None:
        """Cancel every operation in flight now: each raises ``GroupClosedError``; then
        close the group (its peers see it leave)."""
        if self._core is not None:
            self._core.abort()
        self.close()

    def close(self) -> None:
        """Deliver what was sent, say goodbye to the peers and release the socket."""
        core, self._core = self._core, None
        if core is not None:
            # After the close, which waits for the peers' verdicts on what was sent: a resend
            # they ask for meanwhile is counted in the report, as their damaged copy is in theirs.
            core.close()
            _write_report(core)
        _live_groups.discard(self)

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_rank(self, r: int, what: str) -> None:
        if not isinstance(r, int) or not 0 <= r < self.world_size:
            raise ValueError(f"{what}={r!r} is not a rank of this group (0..{self.world_size - 1})")

    def __repr__(self) -> str:
        state = "closed" if self._core is None else "open"
        return f"<mcp_fast.Group rank={self.rank} world_size={self.world_size} {state}>"


def _tag(tag: int) -> int:
    if not isinstance(tag, int) or not 0 <= tag < 2**32:
        raise ValueError(f"tag must be an integer in [0, 2**32), got {tag!r}")
    return tag


@dataclass(frozen=True)
class Chaos:
    """Faults to inject, for testing a program against a bad network.

    Under QUIC (per datagram, seeded): ``loss`` probability (``burst``: chance a loss starts
    a burst of ``burst_len``), ``duplicate``, ``reorder``, ``delay``/``jitter`` (seconds),
    ``rate`` (bits/s). Above QUIC: ``corrupt``, the probability that a frame's payload gets
    one bit flipped before sending, as host memory errors would (the frame CRC catches it:
    the operation fails with ProtocolError).
    """

    loss: float = 0.0
    corrupt: float = 0.0
    seed: int = 0
    delay: float = 0.0
    jitter: float = 0.0
    rate: int | None = None
    duplicate: float = 0.0
    reorder: float = 0.0
    burst: float = 0.0
    burst_len: int = 1

    def __str__(self) -> str:
        parts = [f"seed={self.seed}", f"loss={self.loss}", f"corrupt={self.corrupt}"]
        if self.delay:
            parts.append(f"delay={self.delay * 1e3:g}ms")
        if self.jitter:
            parts.append(f"jitter={self.jitter * 1e3:g}ms")
        if self.rate:
            parts.append(f"rate={self.rate}")
        if self.duplicate:
            parts.append(f"dup={self.duplicate}")
        if self.reorder:
            parts.append(f"reorder={self.reorder}")
        if self.burst:
            parts.append(f"burst={self.burst}")
            parts.append(f"burst_len={self.burst_len}")
        return ",".join(parts)


def _write_report(core: _core.ProcessGroup) -> None:
    """With ``MCP_CHAOS_REPORT`` set to a directory (``chaosmcp`` sets it), leaves this
    group's transport and fault-injector counters there as JSON when it closes, for the
    tool's summary. Never fails the close."""
    directory = os.environ.get("MCP_CHAOS_REPORT")
    if not directory:
        return
    try:
        report = {
            "pid": os.getpid(),
            "rank": core.rank,
            "world_size": core.world_size,
            "chaos": os.environ.get("MCP_CHAOS", ""),
            "stats": core.stats(),
            "chaos_stats": core.chaos_stats(),
        }
        name = os.path.join(directory, f"rank{core.rank}-pid{os.getpid()}-{id(core):x}.json")
        with open(name + ".tmp", "w") as f:
            json.dump(report, f)
        os.replace(name + ".tmp", name)
    except Exception as e:  # a report is never worth failing the job for
        import logging

        logging.getLogger(__name__).warning("could not write the chaos report: %s", e)


_live_groups: weakref.WeakSet[Group] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for g in list(_live_groups):
        try:
            g.close()
        except Exception:
            pass


def init(
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    secret: str | bytes | None = None,
    timeout: float | None = None,
    connect_timeout: float | None = None,
    idle_timeout: float | None = None,
    chunk_bytes: int = 1 << 20,
    chaos: Chaos | str | None = None,
    heartbeat: float | None = None,
    lane: str | None = None,
    resend_limit: int | None = None,
    stall_timeout: float | None = None,
    allow_generated_secret: bool | None = None,
    zero_rtt: bool | None = None,
    shm: bool | None = None,
    host_id: str | None = None,
    config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    model_spec: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    _protocol_major: int | None = None,
) -> Group:
    """Join a job and return its :class:`Group`.

    Arguments default to torchrun's environment: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
    (default 127.0.0.1) and ``MASTER_PORT`` (default 29500; rank 0 listens there on UDP).
    ``secret`` defaults to ``MCP_SECRET``; without either, rank 0 generates one and hands it
    to the others at the rendezvous, on loopback only unless ``allow_generated_secret`` (or
    ``MCP_ALLOW_GENERATED_SECRET=1``): elsewhere anyone reaching the port could take it.
    ``timeout`` bounds every operation (default ``MCP_TIMEOUT`` or 300 s); ``connect_timeout``
    bounds the rendezvous (default: ``timeout``). ``chaos`` (default ``MCP_CHAOS``) injects faults:
    ``Chaos(loss=0.2, seed=1)`` or ``"loss=0.2,delay=5ms,rate=1gbit,seed=1"``.
    ``heartbeat`` (seconds): a peer silent for 2 heartbeats plus max(min(1 s, heartbeat / 4),
    1.3 x mean RTT) is declared lost (``PeerLostError``), within 3 heartbeats of its death.
    ``lane`` (default ``MCP_LANE`` or ``"auto"``) picks how
    data travels: ``"stream"`` on reliable QUIC streams only; ``"fec"`` every data frame as
    Reed-Solomon coded datagrams (the loss-proof bulk lane); ``"auto"`` streams, and the FEC
    lane for frames of 256 KiB and more once packet loss above 1 % is measured on the path.
    Results are bit-exact on every lane. A frame that fails its checksum (damaged above
    QUIC, e.g. in memory) is asked for again, up to ``resend_limit`` times (default
    ``MCP_RESEND_LIMIT`` or 8) before the operation fails with ``ProtocolError``.
    ``stall_timeout`` (default ``MCP_STALL_TIMEOUT`` or 60 s): a peer that answers
    heartbeats but keeps this rank waiting in an operation it has not started, for
    max(stall_timeout, 10 x p99 of the intervals between this rank's operations), is reported
    as ``PeerStalledError`` on every rank.
    A connection that breaks while its peer lives (an idle timeout during a cut, a
    middlebox's reset) is re-established within 3 heartbeats (at least 2 s), resuming its TLS
    session with 0-RTT data (``zero_rtt``, default ``MCP_ZERO_RTT`` or on); the operations in
    flight resume from what was acknowledged.
    Ranks on one host (machine and network namespace; ``host_id``, default ``MCP_HOST_ID``,
    overrides) send to each other through shared memory (``shm``, default ``MCP_SHM`` or on;
    off with ``chaos``); a peer whose shared memory cannot be set up is reached over QUIC,
    with a :class:`SharedMemoryWarning`. With more than one host and more than one rank on
    some host, the collectives run hierarchically (see :meth:`Group.topology`).
    ``config`` (default: the JSON or TOML file ``MCP_CONFIG`` names) is the transport config
    as the documents write it, e.g. ``{"max_streams": 4096, "fec_group_size": 8,
    "compression": "zstd@L3", "heartbeat_interval": 5000, "mtu": 1440}``; an unknown key or
    bad value is a ``ValueError`` naming it (see docs/configuration.md). Explicit arguments
    win over it, and it wins over the environment.
    ``model_spec`` (default: ``MCP_MODEL_SPEC``, JSON text or a JSON/TOML file) declares the
    model this rank runs, as the documents' Model-Spec: ``{"arch": "GPT-3", "precision":
    "bfloat16", "io_schema": {"input": ["token_ids:int32[bsz,seq]"], "output": [...]}}``.
    When two ranks declare different models (or one declares none), the rendezvous fails on
    every rank with ``SpecMismatchError`` naming both (see docs/configuration.md).
    Every argument left ``None`` comes from the environment (see :mod:`mcp_fast.settings`).
    """
    rank = rank if rank is not None else env_int("RANK")
    world_size = world_size if world_size is not None else env_int("WORLD_SIZE")
    if rank is None and world_size is None:
        rank, world_size = 0, 1
    if rank is None or world_size is None:
        raise ValueError(
            "rank and world_size are needed: pass them or set RANK and WORLD_SIZE (torchrun does)"
        )
    master_addr = master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    if master_port is None:
        master_port = env_int("MASTER_PORT") or 29500
    settings = Settings.resolve(
        secret=secret,
        timeout=timeout,
        connect_timeout=connect_timeout,
        idle_timeout=idle_timeout,
        heartbeat=heartbeat,
        chaos=chaos,
        lane=lane,
        resend_limit=resend_limit,
        stall_timeout=stall_timeout,
        allow_generated_secret=allow_generated_secret,
        zero_rtt=zero_rtt,
        config=config,
        model_spec=model_spec,
    )
    core = _core.ProcessGroup(
        rank,
        world_size,
        master_addr,
        master_port,
        chunk_bytes=chunk_bytes,
        protocol_major=_protocol_major,
        shm=shm,
        host_id=host_id,
        **settings.core_kwargs(),
    )
    return Group(core)
