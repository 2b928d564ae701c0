"""The torch.distributed backend ``"mcp"``: a ProcessGroup written in Python over mcp_fast.

Endpoints are exchanged through the Store torch hands the backend (as Gloo and NCCL do):
rank 0 binds an ephemeral UDP port and publishes ``host:port``; the others read it and meet
there. The job secret comes from ``MCP_SECRET`` or, when unset, rank 0 generates one and
publishes it through the same Store: then whoever can read the Store can join (the Store is
torch's own trust boundary; set ``MCP_SECRET`` to make the TLS handshake the boundary).

Every operation returns a torch Work (:class:`MCPWork`): ``wait()`` finishes it on the
calling thread once the Rust core has; its Future, once asked for, is fulfilled by a small pool
of completion threads, never on the transport's threads, so hooks that ``wait()`` inside
``then`` callbacks (PowerSGD) cannot deadlock it.
CUDA tensors are staged through host memory (see ``_staging``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .. import _core
from ..errors import SpecMismatchError
from ..group import Group, Work
from ..settings import Settings
from ._reduce_op import Reduction, reduction
from ._sparse import SparseGather, start_sparse_all_reduce
from ._staging import Staged, stage

BACKEND = "mcp"
_A2A_TAG = 0x4D415441  # marks the point-to-point messages of all_to_all


def _eager(cls: type) -> type:
    """Keeps torch.compile out of the class's methods.

    While a compiled region runs the parts it could not capture (DDP's bucket rebuilding in
    ``forward``, for one), Dynamo compiles every Python frame that starts, and torch's C++
    calls our methods from there: it would trace the group's collectives and stop at the
    group itself (a script object it cannot look into). They are communication, not graph;
    Gloo's and NCCL's are C++ and never seen by Dynamo, so ours are marked to run eagerly,
    with whatever they call. The mark is set on the code objects through torch's C module,
    so that importing mcp_fast (which torch does at ``import torch``) does not import Dynamo.
    """
    frames = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    strategy = getattr(frames, "_FrameExecStrategy", None)
    action = getattr(frames, "_FrameAction", None)
    if strategy is None or action is None or not hasattr(frames, "set_code_exec_strategy"):
        return cls  # a torch without Dynamo's frame strategies
    skip = strategy(action.SKIP, action.SKIP)  # this frame, and the frames it calls
    for member in vars(cls).values():
        fn = member.fget if isinstance(member, property) else member
        code = getattr(fn, "__code__", None)
        if code is not None:
            frames.set_code_exec_strategy(code, skip)
    return cls


@_eager
class MCPWork(dist._Work):
    """The work handle of one operation over the core's operations ``works``.

    ``wait()`` waits for them on the calling thread and finishes the work there: the
    ``after`` steps (writing staged tensors back, copying gathered results out), then
    ``cleanup`` and the future; a synchronous call therefore wakes once, from the core.
    ``get_future()`` hands the same finishing to a completion thread, so that the future
    completes although nobody waits (DDP chains its callbacks on it). Whichever thread gets
    there first finishes the work, once; ``wait()`` raises the operation's error (a torch
    Work made from a bare Future would swallow it)."""

    def __init__(
        self,
        result: Any,
        pool: ThreadPoolExecutor,
        works: Sequence[Any] = (),
        after: Callable[[], None] | None = None,
        cleanup: Callable[[], None] | None = None,
        explain: Callable[[BaseException], BaseException] | None = None,
    ) -> None:
        super().__init__()
        self._result = result
        self._pool = pool
        self._after = after
        self._cleanup = cleanup
        self._explain = explain
        self.works: list[Any] = list(works)
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._future: torch.futures.Future = torch.futures.Future()
        self._source: Callable[[], int | None] | None = None
        self._finisher: int | None = None
        self._settle_lock = threading.RLock()  # a future callback may ask is_completed()
        self._settled = False
        self._scheduled = False

    def _settle(self, blocking: bool = True) -> None:
        """Waits for the core's operations on this thread, then finishes the work unless
        another thread already has. Not ``blocking``: returns at once if another thread is
        finishing it (its future's callbacks may take long, or wait on other works)."""
        error: BaseException | None = None
        try:
            for w in self.works:
                w.wait()
        except BaseException as e:
            error = e if self._explain is None else self._explain(e)
        if not self._settle_lock.acquire(blocking=blocking):
            return
        try:
            if self._settled:
                return
            self._settled = True
            try:
                if error is None and self._after is not None:
                    self._after()
            except BaseException as e:
                error = e
            finally:
                if self._cleanup is not None:
                    self._cleanup()
            self._finish(error)
        finally:
            self._settle_lock.release()

    def _schedule(self) -> None:
        """Has a completion thread finish the work (once)."""
        with self._settle_lock:
            if self._settled or self._scheduled:
                return
            self._scheduled = True
        self._pool.submit(self._settle)

    def _finish(self, error: BaseException | None) -> None:
        # The future is completed before `wait()` may return, so that a caller who saw
        # `wait()` return always finds `get_future()` done. Its callbacks run on the thread
        # that finishes the work; one that waits on this very work must not block on itself.
        self._error = error
        self._finisher = threading.get_ident()
        try:
            if error is None:
                self._future.set_result(self._result)
            elif isinstance(error, Exception):
                self._future.set_exception(error)
            else:
                # A signal handler's KeyboardInterrupt (or SystemExit) aborted the group
                # mid-operation: `wait()` raises it as it is; the future takes Exceptions
                # only, so its callbacks see what became of the operation.
                from ..errors import GroupClosedError

                self._future.set_exception(
                    GroupClosedError(
                        f"the operation was interrupted ({type(error).__name__}) "
                        "and its group aborted on this rank"
                    )
                )
        finally:
            self._done.set()

    def wait(self, timeout: Any = None) -> bool:
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        if seconds is not None and seconds <= 0:
            seconds = None
        if self._finisher != threading.get_ident() and not self._done.is_set():
            if seconds is None:
                self._settle()
            else:
                # A bounded wait: a completion thread finishes it while this one watches
                # the clock.
                self._schedule()
                if not self._done.wait(seconds):
                    from ..errors import MCPTimeoutError

                    raise MCPTimeoutError(f"operation still running after {seconds} s")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        if not self._done.is_set() and all(w.is_completed() for w in self.works):
            # Every core operation ended: finishing the work here waits for nothing, and
            # if another thread is finishing it, that thread's answer is not waited for.
            self._settle(blocking=False)
        return self._done.is_set()

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error if self.is_completed() else None

    def get_future(self) -> torch.futures.Future:
        self._schedule()
        return self._future

    def _source_rank(self) -> int:
        """The sender of a receive from any source (torch asks after ``wait()``)."""
        source = self._source() if self._source is not None else None
        if source is None:
            raise RuntimeError("this work is not a receive from any source, or has not finished")
        return int(source)

    def result(self) -> Any:
        return self._result


def _reduction(opts: Any) -> Reduction:
    """The reduction an options object asks for (``SUM`` without one)."""
    return reduction(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)


def _is_local(ip: str) -> bool:
    try:
        fam = socket.AF_INET6 if ipaddress.ip_address(ip).version == 6 else socket.AF_INET
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


def _bind_ip() -> str:
    """The address rank 0 listens on: ``MCP_BIND_ADDR`` when set; else MASTER_ADDR when it is
    ours, else our address on the route to it; loopback when no MASTER_ADDR is set."""
    explicit = os.environ.get("MCP_BIND_ADDR")
    if explicit:
        return explicit
    master = os.environ.get("MASTER_ADDR")
    if not master:
        return "127.0.0.1"
    infos = socket.getaddrinfo(master, None, type=socket.SOCK_DGRAM)
    ips = [i[4][0] for i in infos if i[0] == socket.AF_INET] or [i[4][0] for i in infos]
    for ip in ips:
        if _is_local(ip):
            multi_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) < int(
                os.environ.get("WORLD_SIZE", "0") or 0
            )
            literal_loopback = master in ("localhost",) or master.startswith("127.")
            if ipaddress.ip_address(ip).is_loopback and multi_node and not literal_loopback:
                raise ValueError(
                    f"MASTER_ADDR={master!r} resolves to the loopback address {ip} on rank 0's "
                    "host, which the other nodes cannot reach: start torchrun with "
                    "--local-addr=<this node's IP>, or set MCP_BIND_ADDR to it"
                )
            return ip
    fam = socket.AF_INET6 if ":" in ips[0] else socket.AF_INET
    with socket.socket(fam, socket.SOCK_DGRAM) as s:
        s.connect((ips[0], 9))  # no packet is sent: this only asks for the route
        return str(s.getsockname()[0])


def _split_addr(addr: str) -> tuple[str, int]:
    host, port = addr.rsplit(":", 1)
    return host.strip("[]"), int(port)


# The device types whose tensors the group takes (CUDA ones are staged through host memory).
DEVICE_TYPES = ("cpu", "cuda")


class DeviceBackend:
    """What ``group._get_backend(device)`` answers for an "mcp" group.

    The group is a Python ``ProcessGroup`` that serves every device itself, so torch holds no
    per-device backend for it, and its code that asks for one (``init_process_group(...,
    device_id=cuda:N)`` as NCCL scripts call it; DeviceMesh and FSDP2 in some set-ups) would
    stop at "No backend type associated with device type". This answers as a backend that
    neither splits communicators nor coalesces NCCL-style, allocates no tensors and estimates
    no times, so torch takes its plain path, which calls the group."""

    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def name(self) -> str:
        return BACKEND

    def supports_tensor_alloc(self, device: torch.device) -> bool:
        return False

    def __repr__(self) -> str:
        return f"DeviceBackend({BACKEND!r}, {self.device})"


@_eager
class MCPProcessGroup(dist.ProcessGroup):
    """A torch ProcessGroup whose collectives run on mcp_fast's Rust core."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: timedelta,
        config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(rank, size)
        self._group_name = ""
        self._group_desc = ""
        seconds = max(1.0, timeout.total_seconds())
        # torch's timeout bounds every operation; the rest comes from the transport config
        # (pg_options, else MCP_CONFIG) and MCP_* like mcp.init's.
        settings = Settings.resolve(timeout=seconds, config=config)
        if settings.secret is None:
            # torch's Store is the trust boundary here, as for Gloo.
            if rank == 0:
                secret = secrets.token_hex(32)
                store.set("mcp/secret", secret)
            else:
                secret = _published(store, "mcp/secret", seconds).decode()
            settings = dataclasses.replace(settings, secret=secret.encode())
        kwargs: dict[str, Any] = {
            **settings.core_kwargs(),
            # The rendezvous may be bounded more tightly than operations (MCP_CONNECT_TIMEOUT).
            "connect_timeout": min(seconds, settings.connect_timeout),
        }
        if rank == 0:
            try:
                ip = _bind_ip()
            except ValueError as e:
                _tell_the_others(store, size, str(e), seconds)
                raise
            try:
                core = _core.ProcessGroup(
                    0,
                    size,
                    ip,
                    0,
                    on_bound=lambda addr: store.set("mcp/addr", addr),
                    **kwargs,
                )
            except ValueError as e:
                # A bad setting only rank 0 has (e.g. its MCP_LANE) is refused before binding.
                _tell_the_others(store, size, str(e), seconds)
                raise
        else:
            addr = _published(store, "mcp/addr", seconds).decode()
            if addr.startswith("error:"):
                with contextlib.suppress(_STORE_GONE):  # rank 0 may have stopped waiting
                    store.add(_ERROR_READ, 1)  # rank 0 may go now
                raise ValueError(f"rank 0 could not start the mcp backend: {addr[6:]}")
            host, port = _split_addr(addr)
            core = _core.ProcessGroup(rank, size, host, port, **kwargs)
        self._mcp = Group(core)
        # Completion threads: enough that a hook waiting inside a callback never starves them.
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="mcp-complete")
        self._closed = False
        self._lock = threading.Lock()

    # ---- plumbing -------------------------------------------------------------------------

    def _work(
        self,
        start: Callable[[], list[Work | None]],
        result: Any,
        staged: Sequence[Staged] = (),
        after: Callable[[], None] | None = None,
        explain: Callable[[BaseException], BaseException] | None = None,
    ) -> MCPWork:
        """Starts the operation now (so every rank issues it in call order) and returns its
        work handle (see :class:`MCPWork`), which finishes with ``result``; ``explain``
        rewrites an error of the core's operations (see :meth:`_parts_of`)."""

        def write_back() -> None:
            for s in staged:
                s.write_back()
            if after is not None:
                after()

        def release() -> None:
            for s in staged:
                s.release()

        try:
            works = [w for w in start() if w is not None]
        except BaseException as e:
            release()
            raise e
        return MCPWork(result, self._pool, works, write_back, release, explain)

    def _parts_of(self, op: str) -> Callable[[BaseException], BaseException]:
        """For a collective built of point-to-point messages under the backend's own tag:
        a mismatch of one of them names ``op`` and what disagrees, not the messages' tag."""
        me = self.rank()

        def explain(e: BaseException) -> BaseException:
            if not isinstance(e, SpecMismatchError):
                return e
            detail = str(e).replace(f", tag={_A2A_TAG}", "")
            err = SpecMismatchError(
                f"{op} on rank {me}: a part another rank sent does not fit the part this rank "
                f"expects from it; make the ranks' split sizes (or tensors) agree. {detail}"
            )
            err.__cause__ = e
            return err

        return explain

    # ---- identity -------------------------------------------------------------------------

    def getBackendName(self) -> str:
        return BACKEND

    @property
    def _device_types(self) -> list[torch.device]:  # type: ignore[override]
        # torch's Python-backend path registers no device for this group; its code that asks
        # (DCP's async_save wants CPU, broadcast_from_rank0 picks a device from the list)
        # must find the devices whose tensors the group takes.
        return [torch.device(d) for d in DEVICE_TYPES]

    def _get_backend(self, device: torch.device | str) -> DeviceBackend:  # type: ignore[override]
        dev = torch.device(device)
        if dev.type not in DEVICE_TYPES:
            raise RuntimeError(
                f"the mcp backend takes {' and '.join(DEVICE_TYPES)} tensors, not {dev.type}: "
                "move the tensors to one of those, or use a backend for that device"
            )
        return DeviceBackend(dev)

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    @property
    def mcp_group(self) -> Group:
        """The underlying :class:`mcp_fast.Group` (for health, RTT, diagnostics)."""
        return self._mcp

    # ---- collectives ----------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        red = _reduction(opts)
        if any(t.is_sparse for t in tensors):
            return self._sparse_allreduce(tensors, red)
        staged = [stage(t) for t in tensors]

        def start() -> list[Work | None]:
            for s in staged:
                red.premultiply_(s.host)  # the result overwrites it
            return [self._mcp.all_reduce(s.host, op=red.op, async_op=True) for s in staged]

        return self._work(start, tensors, staged)

    def _sparse_allreduce(self, tensors: list[torch.Tensor], red: Reduction) -> MCPWork:
        if not all(t.is_sparse for t in tensors):
            raise ValueError("all_reduce: a list of tensors mixes sparse and dense ones")
        if red.factor is not None:
            raise ValueError(
                "PREMUL_SUM of sparse tensors is not supported: scale the tensor and reduce "
                "with SUM"
            )
        op = red.op
        gathers: list[SparseGather] = []

        def start() -> list[Work | None]:
            works: list[Work | None] = []
            for t in tensors:
                gather, started = start_sparse_all_reduce(self._mcp, t, op)
                gathers.append(gather)
                works.extend(started)
            return works

        def after() -> None:
            for g in gathers:
                g.write_back()

        return self._work(start, tensors, after=after)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        red = _reduction(opts)
        flat = torch._utils._flatten_dense_tensors([t.detach().cpu() for t in tensors])

        def after() -> None:
            outs = torch._utils._unflatten_dense_tensors(flat, tensors)
            for t, o in zip(tensors, outs, strict=True):
                t.copy_(o)

        def start() -> list[Work | None]:
            red.premultiply_(flat)  # a copy of the inputs
            return [self._mcp.all_reduce(flat, op=red.op, async_op=True)]

        return self._work(start, tensors, after=after)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        root = opts.rootRank
        staged = [stage(t, read=True) for t in tensors]
        return self._work(
            lambda: [self._mcp.broadcast(s.host, src=root, async_op=True) for s in staged],
            tensors,
            staged,
        )

    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any
    ) -> Any:
        return self._allgather_lists(output_tensors, input_tensors)

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor], opts: Any
    ) -> Any:
        # Coalesced outputs are indexed [rank][input] (allgather's are [input][rank]).
        per_input = [[out[i] for out in output_lists] for i in range(len(input_list))]
        return self._allgather_lists(per_input, input_list, result=output_lists)

    def _allgather_lists(
        self, outs: list[list[torch.Tensor]], ins: list[torch.Tensor], result: Any = None
    ) -> Any:
        gathered = []
        for inp in ins:
            src = inp.detach().contiguous().cpu()
            gathered.append((src, torch.empty((self.size(), *src.shape), dtype=src.dtype)))

        def after() -> None:
            for out_list, (_, g) in zip(outs, gathered, strict=True):
                for r, o in enumerate(out_list):
                    o.copy_(g[r])

        return self._work(
            lambda: [self._mcp.all_gather(g, s, async_op=True) for s, g in gathered],
            outs if result is None else result,
            after=after,
        )

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self.all_gather_single(output, input, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        if output.numel() != input.numel() * self.size():
            raise ValueError(
                f"all_gather_into_tensor: output has {output.numel()} elements, expected "
                f"world_size ({self.size()}) x {input.numel()}"
            )
        out = stage(output)
        src = input.detach().contiguous().cpu()
        view = out.host.view((self.size(), *src.shape))
        return self._work(lambda: [self._mcp.all_gather(view, src, async_op=True)], output, [out])

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return self._chain(works, outputs)

    def reduce_scatter(
        self, output_tensors: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any
    ) -> Any:
        red = _reduction(opts)
        pairs = []
        for out, ins in zip(output_tensors, input_lists, strict=True):
            flat = torch.cat([i.detach().cpu().reshape(-1) for i in ins])
            pairs.append((stage(out), flat))

        def start() -> list[Work | None]:
            for _, f in pairs:
                red.premultiply_(f)  # a copy of the inputs
            return [self._mcp.reduce_scatter(s.host, f, op=red.op, async_op=True) for s, f in pairs]

        return self._work(start, output_tensors, [s for s, _ in pairs])

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Any:
        return self.reduce_scatter_single(output, input, opts)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Any:
        red = _reduction(opts)
        out = stage(output)
        src = input.detach().contiguous().cpu()

        def start() -> list[Work | None]:
            scaled = src
            if red.factor is not None:
                scaled = src.clone()  # src may be the caller's input, which must not change
                red.premultiply_(scaled)
            return [self._mcp.reduce_scatter(out.host, scaled, op=red.op, async_op=True)]

        return self._work(start, output, [out])

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        works = [
            self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)
        ]
        return self._chain(works, outputs)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        red, root = _reduction(opts), opts.rootRank
        tmp = [t.detach().contiguous().cpu().clone() for t in tensors]

        def after() -> None:
            if self.rank() == root:
                for t, r in zip(tensors, tmp, strict=True):
                    t.copy_(r)

        def start() -> list[Work | None]:
            for r in tmp:
                red.premultiply_(r)  # a copy of the inputs
            return [self._mcp.all_reduce(r, op=red.op, async_op=True) for r in tmp]

        return self._work(start, tensors, after=after)

    def gather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any
    ) -> Any:
        # An all-gather whose results only the root keeps: simple, one round of the ring.
        root = opts.rootRank
        outs = output_tensors if self.rank() == root else [[] for _ in input_tensors]
        return self._allgather_lists(outs, input_tensors, result=output_tensors)

    def scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any
    ) -> Any:
        root = opts.rootRank
        out = stage(output_tensors[0])

        def start() -> list[Work | None]:
            if self.rank() != root:
                return [self._mcp.recv(out.host, src=root, tag=_A2A_TAG, async_op=True)]
            works: list[Work | None] = []
            for r, t in enumerate(input_tensors[0]):
                src = t.detach().contiguous().cpu()
                if r == root:
                    out.host.copy_(src)
                else:
                    works.append(self._mcp.send(src, dst=r, tag=_A2A_TAG, async_op=True))
            return works

        return self._work(start, output_tensors, [out], explain=self._parts_of("scatter"))

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> Any:
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> Any:
        w = self.size()
        out = stage(output)
        src = input.detach().contiguous().cpu()
        outs = _split(out.host, output_split_sizes, w)
        ins = _split(src, input_split_sizes, w)
        return self._exchange_work(outs, ins, output, [out])

    def alltoall(
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any
    ) -> Any:
        staged = [stage(o) for o in output_tensors]
        ins = [i.detach().contiguous().cpu() for i in input_tensors]
        return self._exchange_work([s.host for s in staged], ins, output_tensors, staged)

    def _exchange_work(
        self,
        outs: list[torch.Tensor],
        ins: list[torch.Tensor],
        result: Any,
        staged: Sequence[Staged],
    ) -> MCPWork:
        """An all-to-all. A rank whose part for itself does not fit (its input and output
        split sizes, or tensors, differ at its own index) still exchanges with the others, so
        that they are not left waiting, and raises ``ValueError`` once that is done. The part
        must match as a peer's must: the same shape and dtype."""
        me = self.rank()
        mine, theirs = ins[me], outs[me]
        if mine.shape == theirs.shape and mine.dtype == theirs.dtype:
            return self._work(
                lambda: self._exchange(outs, ins),
                result,
                staged,
                explain=self._parts_of("all_to_all"),
            )
        error = ValueError(
            f"all_to_all on rank {me}: the part this rank sends itself ({mine.numel()} x "
            f"{mine.dtype}, shape {tuple(mine.shape)}) does not fit the part it receives from "
            f"itself ({theirs.numel()} x {theirs.dtype}, shape {tuple(theirs.shape)}); make the "
            f"input and output split sizes (or the tensors at index {me}) agree. The exchange "
            "with the other ranks went ahead."
        )

        def refuse() -> None:
            raise error

        return self._work(
            lambda: self._exchange(outs, ins, itself=False),
            result,
            staged,
            refuse,
            self._parts_of("all_to_all"),
        )

    def _exchange(
        self, outs: list[torch.Tensor], ins: list[torch.Tensor], itself: bool = True
    ) -> list[Work | None]:
        me, w = self.rank(), self.size()
        if itself:
            outs[me].copy_(ins[me])
        works: list[Work | None] = []
        # Send to the next ranks in ring order and receive from the previous, so that every
        # pair's send is matched by the peer's receive in the same order.
        for k in range(1, w):
            dst, src = (me + k) % w, (me - k) % w
            works.append(self._mcp.send(ins[dst], dst=dst, tag=_A2A_TAG, async_op=True))
            works.append(self._mcp.recv(outs[src], src=src, tag=_A2A_TAG, async_op=True))
        return works

    def barrier(self, opts: Any = None) -> Any:
        return self._work(lambda: [self._mcp.barrier(async_op=True)], [])

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        srcs = [t.detach().contiguous().cpu() for t in tensors]
        return self._work(
            lambda: [self._mcp.send(s, dst=dst, tag=tag, async_op=True) for s in srcs], tensors
        )

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        staged = [stage(t) for t in tensors]
        return self._work(
            lambda: [self._mcp.recv(s.host, src=src, tag=tag, async_op=True) for s in staged],
            tensors,
            staged,
        )

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        staged = [stage(t) for t in tensors]
        works: list[Work] = []

        def start() -> list[Work | None]:
            works.extend(self._mcp.recv(s.host, src=None, tag=tag, async_op=True) for s in staged)
            return list(works)

        work = self._work(start, tensors, staged)
        work._source = lambda: works[0].source_rank() if works else None
        return work

    def _chain(self, works: list[Any], result: Any) -> MCPWork:
        return MCPWork(result, self._pool, works)

    # ---- lifetime -------------------------------------------------------------------------

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._mcp.close()
        self._pool.shutdown(wait=True)

    def abort(self) -> None:
        self._mcp.abort()  # in-flight operations fail at once
        self.shutdown()


# How many ranks have read rank 0's start-up error, and how long rank 0 waits for them.
_ERROR_READ = "mcp/addr_error_read"
_ERROR_LINGER_S = 30.0


def _tell_the_others(store: Any, size: int, error: str, seconds: float) -> None:
    """Publishes rank 0's start-up error, then waits (at most ``_ERROR_LINGER_S`` or the
    timeout) until every other rank has read it: with the default TCPStore, rank 0 hosts the
    store, and raising at once would take it down before the others see why."""
    store.set("mcp/addr", f"error:{error}")
    deadline = time.monotonic() + min(seconds, _ERROR_LINGER_S)
    while store.add(_ERROR_READ, 0) < size - 1 and time.monotonic() < deadline:
        time.sleep(0.01)


# What a torch Store raises once its server is gone (DistNetworkError since torch 2.2).
_STORE_GONE: type[Exception] = getattr(dist, "DistNetworkError", ConnectionError)


def _published(store: Any, key: str, seconds: float) -> bytes:
    """What rank 0 publishes under ``key``, once it is there. ``store.get`` would block in
    C++ until the store's timeout, deaf to Ctrl-C; ``check`` answers at once, so this waits
    in Python, polling at most ten times a second per rank."""
    deadline = time.monotonic() + seconds
    pause = 0.005
    try:
        while not store.check([key]):
            if time.monotonic() > deadline:
                from ..errors import MCPTimeoutError

                raise MCPTimeoutError(
                    f"rank 0 published no {key!r} in torch's store within {seconds:g} s: is "
                    "it running, and did its init_process_group(backend='mcp') start?"
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.1)
        return bytes(store.get(key))
    except _STORE_GONE as e:
        # With the default TCPStore, rank 0 hosts the store: a rank 0 that failed to start
        # takes it down before the others read why.
        from ..errors import PeerLostError

        raise PeerLostError(
            f"torch's store closed while this rank waited for {key!r} from rank 0: rank 0 "
            f"stopped before it published it (its own error says why) ({e})",
            rank=0,
            op="init_process_group",
        ) from e


def _split(t: torch.Tensor, sizes: list[int], w: int) -> list[torch.Tensor]:
    if not sizes:
        if t.shape[0] % w:
            raise ValueError(
                f"all_to_all_single: dim 0 ({t.shape[0]}) is not divisible by world_size {w}; "
                "pass split sizes"
            )
        sizes = [t.shape[0] // w] * w
    if len(sizes) != w or sum(sizes) != t.shape[0]:
        raise ValueError(f"split sizes {sizes} do not cover dim 0 ({t.shape[0]}) in {w} parts")
    return list(torch.split(t, sizes, dim=0))


def _create(opts: Any, pg_options: Any = None) -> MCPProcessGroup:
    # pg_options of init_process_group("mcp", pg_options=...) is the transport config: a
    # dict or a JSON/TOML file path. new_group() without one hands over a copy of the parent's
    # torch options object, which is no config: MCP_CONFIG applies then.
    config = pg_options if isinstance(pg_options, (Mapping, str, os.PathLike)) else None
    return MCPProcessGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout, config)


_registered = False


def register() -> None:
    """Registers the backend ``"mcp"`` with torch.distributed (idempotent)."""
    global _registered
    if _registered or BACKEND in dist.Backend.backend_list:
        _registered = True
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=list(DEVICE_TYPES))
    _registered = True


register()
