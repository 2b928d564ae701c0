"""A parameter server over MCP: servers hold the parameters, workers push gradients and pull
parameters under a stale-synchronous clock.

::

    from mcp_fast import ps

    # on each server host (or let ps.launch start them)
    srv = ps.Server("10.0.0.1:29600", secret=s, optimizer="adam", lr=1e-3, staleness=3,
                    num_workers=3, checkpoint_dir="ckpt/server-0")
    srv.serve()                                  # until every worker has left

    # on each worker
    w = ps.Worker(["10.0.0.1:29600", "10.0.0.2:29600"], worker_id=rank, secret=s)
    w.init(ps.params_of(model))                  # the first worker's values win
    for batch in data:
        w.pull(into=ps.params_of(model))         # in place, into the model's tensors
        loss(model(batch)).backward()
        w.push(ps.grads_of(model))
        w.step()                                 # next clock; waits while > s ahead
    w.sync()                                     # barrier: every worker now reads the same
    w.close()

Tensors are float32 numpy arrays or CPU torch tensors, read and written in place.
Parameters are sharded by name over the servers (tensors above ``split_above`` elements are
split across all of them). Each server applies the optimizer (SGD with momentum, Adam,
AdamW) in the Rust core, off the GIL, once per clock to the mean of the gradients the workers
pushed for that clock, summed in worker order: the result does not depend on the order the
pushes arrive in, and with ``staleness=0`` it is exactly one process averaging the workers'
gradients every step.

Consistency (stale-synchronous parallel, bound ``s``): :meth:`Worker.step` moves the worker
from clock ``c`` to ``c + 1`` and returns once the slowest live worker is at ``c + 1 - s`` or
later. A worker at clock ``c`` therefore reads parameters that include every update of the
clocks below ``c - s``. ``s = 0`` is fully synchronous. :meth:`Worker.sync` is a barrier
(``s = 0`` for that one step) after which every worker reads the same parameters.

Failures: a worker whose connection falls silent for ``dead_after`` seconds (killed, frozen,
cut off) is dropped from the minimum, so the others go on; it can rejoin (a new ``Worker``
with the same id), at the slowest live clock. A replacement that does not know which worker
died starts with ``worker_id="vacant"``: server 0 gives it the lowest vacant id (a worker
dropped as dead, or one never registered; it waits until one falls vacant), and it takes
over that worker's place and data shard (``worker.worker_id``) at the slowest live clock
(``worker.clock``). The dead process, should it come back (it was only frozen), is refused
with ``SupersededError``. ``launch(..., restart_workers=N)`` starts such replacements.

A server saves its shard with the delta checkpointer (``checkpoint_dir``, every
``checkpoint_every`` seconds); a standby started with ``restore=True`` on the same address
(``launch`` does it) reloads the latest checkpoint, and the workers reconnect with backoff
(0.5 s doubling to 5 s, jitter) and carry on; the workers live at the checkpoint hold the
standby's staleness minimum until they have registered again (or ``2 * dead_after + 6`` s
have passed). What is lost is stated in the README: every update that server applied after
its last checkpoint, and the gradients pushed to it for clocks it had not yet applied.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import secrets as _secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from . import _core
from ._buffers import Buffer, view
from .checkpoint import DeltaCheckpointer
from .guards import GradientGuard
from .settings import Settings, load_config

log = logging.getLogger(__name__)

__all__ = [
    "Server",
    "Worker",
    "grads_of",
    "launch",
    "params_of",
    "run_from_env",
]


def _secret_bytes(secret: str | bytes | None) -> bytes:
    secret = Settings.resolve(secret=secret).secret
    if secret is None:
        raise ValueError(
            "the parameter server needs the job secret: pass secret= or set MCP_SECRET "
            "(ps.launch generates one for the processes it starts)"
        )
    return secret


def _chaos(chaos: Any) -> str | None:
    return Settings.resolve(chaos=chaos).chaos


def params_of(model: Any) -> dict[str, Any]:
    """A module's parameters by name, as tensors sharing their memory (pull writes into
    the model in place)."""
    return {n: p.detach() for n, p in model.named_parameters()}


def grads_of(model: Any) -> dict[str, Any]:
    """A module's gradients by name (zeros where a parameter has none)."""
    import torch

    return {
        n: (p.grad.detach() if p.grad is not None else torch.zeros_like(p.detach()))
        for n, p in model.named_parameters()
    }


class Server:
    """One parameter server.

    ``bind`` is ``"host:port"`` (UDP). The optimizer is ``"sgd"`` (``momentum``,
    ``weight_decay``, ``nesterov``), ``"adam"`` or ``"adamw"`` (``betas``, ``eps``,
    ``weight_decay``); ``aggregate`` is ``"mean"`` or ``"sum"`` of the gradients of a clock.
    ``num_workers`` workers must register before any of them starts. With
    ``checkpoint_dir``, :meth:`checkpoint` (called by :meth:`serve` every
    ``checkpoint_every`` seconds) saves the shard there; ``restore=True`` loads the latest
    checkpoint of that directory first. ``config`` (default: the file ``MCP_CONFIG`` names)
    is the transport config (see :mod:`mcp_fast.settings`): its ``max_streams`` and ``mtu``
    shape the server's QUIC endpoint, ``heartbeat_interval`` its ping interval (``dead_after``
    still decides when a silent worker is dropped) and ``compression`` the lossless level;
    ``fec_group_size`` is checked but has no FEC lane to act on here.
    """

    def __init__(
        self,
        bind: str = "127.0.0.1:29600",
        *,
        secret: str | bytes | None = None,
        optimizer: str = "sgd",
        lr: float = 0.01,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        aggregate: str = "mean",
        staleness: int = 3,
        num_workers: int = 1,
        dead_after: float = 5.0,
        register_timeout: float = 300.0,
        chaos: Any = None,
        config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: float = 1.0,
        full_every: int = 10,
        restore: bool = False,
    ) -> None:
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self._ckpt = (
            DeltaCheckpointer(checkpoint_dir, full_every=full_every) if checkpoint_dir else None
        )
        self.checkpoint_every = checkpoint_every
        self._last_saved: int | None = None
        self._stop = threading.Event()
        self.restored_step: int | None = None
        held = None
        if restore:
            if self._ckpt is None:
                raise ValueError("restore=True needs checkpoint_dir")
            held = self._load()
            if held is not None:
                self.restored_step = self._last_saved = held[0]
        self.core = _core.PsServer(
            bind,
            _secret_bytes(secret),
            optimizer=optimizer,
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            nesterov=nesterov,
            betas=betas,
            eps=eps,
            aggregate=aggregate,
            staleness=staleness,
            num_workers=num_workers,
            dead_after=dead_after,
            register_timeout=register_timeout,
            chaos=_chaos(chaos),
            restore=held,
            config=load_config(config) or None,
        )

    @property
    def address(self) -> str:
        """``host:port`` it listens on."""
        return self.core.local_addr

    def _load(self) -> tuple[int, list[Any], list[int]] | None:
        """The latest checkpoint as the core's restore argument, or None."""
        assert self._ckpt is not None
        if not self._ckpt.steps():
            return None
        state = self._ckpt.load()
        pieces = []
        for name, p in state["pieces"].items():
            key, _, off = name.rpartition("@")
            bufs = {k: np.ascontiguousarray(v).tobytes() for k, v in p["buffers"].items()}
            pieces.append(
                (
                    key,
                    int(off),
                    np.ascontiguousarray(p["params"]).tobytes(),
                    bufs,
                    (int(p["t"]), float(p["b1_pow"]), float(p["b2_pow"])),
                    int(p["updates"]),
                )
            )
        return int(state["applied"]), pieces, [int(w) for w in state.get("workers", [])]

    def checkpoint(self) -> int | None:
        """Saves the shard if anything was applied since the last save; returns the step
        (the applied clock) saved, or None."""
        if self._ckpt is None:
            return None
        applied, pieces, workers = self.core.snapshot()
        if self._last_saved is not None and applied <= self._last_saved:
            return None
        if not pieces:
            return None
        state = {
            "applied": applied,
            "workers": list(workers),
            "pieces": {
                f"{key}@{off}": {
                    "params": np.frombuffer(params, np.float32),
                    "buffers": {k: np.frombuffer(v, np.float32) for k, v in bufs.items()},
                    "t": counters[0],
                    "b1_pow": counters[1],
                    "b2_pow": counters[2],
                    "updates": updates,
                }
                for key, off, params, bufs, counters, updates in pieces
            },
        }
        self._ckpt.save(state, step=applied)
        self._last_saved = applied
        return applied

    def serve(self, until_workers_leave: bool = True, timeout: float | None = None) -> None:
        """Serves (checkpointing every ``checkpoint_every`` s) until :meth:`stop`, until
        every worker has left (``until_workers_leave``, once at least one registered), or
        ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        seen_workers = False
        next_save = time.monotonic() + self.checkpoint_every
        while not self._stop.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                break
            self._stop.wait(min(self.checkpoint_every, 0.1))
            if time.monotonic() >= next_save:
                self.checkpoint()
                next_save = time.monotonic() + self.checkpoint_every
            st = self.core.stats()
            seen_workers = seen_workers or st["known_workers"] > 0
            if until_workers_leave and seen_workers and st["live_workers"] == 0:
                break
        self.checkpoint()

    def stop(self) -> None:
        """Makes :meth:`serve` return."""
        self._stop.set()

    def stats(self) -> dict[str, int]:
        """Counters: pushes, pulls, clocks_applied, applied_through, live_workers,
        min_clock, max_granted_gap, bytes_received/sent, refused_handshakes..."""
        return self.core.stats()

    def clocks(self) -> list[tuple[int, int, bool]]:
        """(worker, clock, live) for every worker ever registered."""
        return self.core.clocks()

    def close(self) -> None:
        """Stops serving and releases the socket."""
        self._stop.set()
        self.core.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Worker:
    """A worker's connection to the parameter servers (thread-safe: many threads may push
    and pull at once; one thread should call :meth:`step`).

    ``servers``: ``"host:port"`` of every server slot, the same list in every worker.
    ``worker_id`` defaults to ``RANK``; ``"vacant"`` takes over the lowest vacant id (a
    replacement for a dead worker: read its id and clock from :attr:`worker_id` and
    :attr:`clock`; it waits up to ``timeout`` for an id to fall vacant). ``timeout`` bounds
    every operation, retries and reconnections included
    (``MCPTimeoutError``/``PeerLostError`` after it). ``codec`` (``"none"``, ``"fp16"``,
    ``"bf16"``, ``"int8"``) encodes pushed gradients. ``config``: the transport config, as
    for :class:`Server`.
    """

    def __init__(
        self,
        servers: Sequence[str] | str,
        worker_id: int | Literal["vacant"] | None = None,
        *,
        secret: str | bytes | None = None,
        timeout: float = 60.0,
        dead_after: float = 5.0,
        split_above: int = 1 << 18,
        chaos: Any = None,
        codec: str = "none",
        block: int = 256,
        config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    ) -> None:
        if isinstance(servers, str):
            servers = [s for s in servers.split(",") if s]
        if worker_id is None:
            worker_id = int(os.environ.get("RANK", "0"))
        if worker_id == "vacant":
            wid: int | None = None
        elif isinstance(worker_id, int) and worker_id >= 0:
            wid = worker_id
        else:
            raise ValueError(f'worker_id must be an int >= 0 or "vacant", got {worker_id!r}')
        self.codec = codec
        self.block = block
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()
        self.last_min_clock: int | None = None
        """The slowest live clock the servers reported at the last :meth:`step`."""
        self.skipped_pushes = 0
        """Pushes a guard refused (non-finite gradients, or the guard tripped)."""
        self.core = _core.PsWorker(
            list(servers),
            wid,
            _secret_bytes(secret),
            timeout=timeout,
            dead_after=dead_after,
            split_above=split_above,
            chaos=_chaos(chaos),
            config=load_config(config) or None,
        )

    @property
    def worker_id(self) -> int:
        """This worker's id: its place in the job and its data shard."""
        return self.core.worker

    @property
    def resends(self) -> int:
        """Requests sent again because they or their reply failed a checksum (damaged above
        QUIC, e.g. in memory); each is resent under its id, at most 8 times."""
        return self.core.resends

    @property
    def generation(self) -> int:
        """How many replacements have held this id before (0 for the first holder)."""
        return self.core.generation

    @property
    def clock(self) -> int:
        """Steps finished."""
        return self.core.clock

    def init(self, params: Mapping[str, Any]) -> None:
        """Registers the tensors (every worker must give the same names and shapes) and
        creates them on the servers unless they exist (the first worker's values win)."""
        bufs = self._views(params, "params")
        with self._lock:
            self._shapes = {k: b.shape for k, b in bufs}
            self.core.set_tensors([(k, b.numel) for k, b in bufs])
        self.core.init(bufs)

    @staticmethod
    def _views(items: Mapping[str, Any], what: str) -> list[tuple[str, Buffer]]:
        """The tensors as the core takes them; it checks them against the registered ones."""
        return [(k, view(v, name=f"{what}[{k!r}]")) for k, v in items.items()]

    def _guarded(self, grads: Mapping[str, Any], guard: GradientGuard | None) -> bool:
        """Judges the gradients with ``guard`` (clipping them in place above its
        ``max_norm``); returns whether they may be pushed."""
        if guard is None:
            return True
        if not isinstance(guard, GradientGuard):
            raise TypeError(f"guard must be a GradientGuard, got {type(guard).__name__}")
        self.core.check(self._views(grads, "grads"), "push")  # before clipping them
        r = guard.check(list(grads.values()))
        if not r.apply_update:
            self.skipped_pushes += 1
            log.warning("worker %d: gradients not pushed (%s)", self.worker_id, r.verdict)
        return r.apply_update

    def push(
        self,
        grads: Mapping[str, Any],
        codec: str | None = None,
        *,
        guard: GradientGuard | None = None,
    ) -> bool:
        """Pushes gradients (any subset of the tensors) for the current clock; returns once
        every server has taken them.

        ``guard``: a :class:`~mcp_fast.guards.GradientGuard` that judges the gradients
        before they go on the wire: above its ``max_norm`` they are clipped in place, and
        non-finite ones (or a trip) are not pushed at all. Returns whether they were pushed
        (the verdict is in ``guard.last``)."""
        if not self._guarded(grads, guard):
            return False
        self.core.push(
            self._views(grads, "grads"),
            codec=codec or self.codec,
            block=self.block,
        )
        return True

    def pull(self, into: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The current parameters: into the given tensors in place (any subset), or into new
        float32 numpy arrays of every tensor."""
        if into is None:
            into = {k: np.empty(shape, np.float32) for k, shape in self._shapes.items()}
        self.core.pull(self._views(into, "into"))
        return dict(into)

    def step(
        self,
        grads: Mapping[str, Any] | None = None,
        into: Mapping[str, Any] | None = None,
        *,
        codec: str | None = None,
        guard: GradientGuard | None = None,
    ) -> int:
        """Finishes this clock; returns the new clock once the staleness bound allows.

        With ``grads`` and/or ``into``, it is ``push(grads)``, the step and ``pull(into)``
        in one round trip per server (the fast path of a training loop). ``guard``: as for
        :meth:`push`; gradients it refuses are left out, the clock still advances and
        ``into`` is still pulled."""
        if grads is not None and not self._guarded(grads, guard):
            grads = {}
        if grads is None and into is None:
            clock, low = self.core.advance()
        else:
            clock, low = self.core.step(
                self._views(grads or {}, "grads"),
                self._views(into or {}, "into"),
                codec=codec or self.codec,
                block=self.block,
            )
        self.last_min_clock = low
        return clock

    def sync(self) -> int:
        """A global barrier: returns once every live worker called it (or finished this
        clock) and every update before it is applied, so that every worker now reads the
        same parameters. Counts as a step."""
        clock, low = self.core.advance(staleness=0)
        self.last_min_clock = low
        return clock

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[dict[str, Any]]:
        """``with w.evaluation() as params:`` a barrier, then the parameters every worker
        sees alike."""
        self.sync()
        yield self.pull()

    def stats(self) -> list[dict[str, int]]:
        """Each server's counters, by slot."""
        return self.core.stats()

    def counters(self) -> tuple[int, int]:
        """(retried requests, reconnections) so far."""
        return self.core.counters()

    def replace_server(self, slot: int, address: str) -> None:
        """Points server slot ``slot`` at ``address`` (a standby on another address)."""
        self.core.replace_server(slot, address)

    def close(self) -> None:
        """Leaves (the servers drop this worker from the minimum at once)."""
        self.core.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------- launching


def _server_main(kwargs: dict[str, Any], ready: Any) -> None:
    srv = Server(**kwargs)
    ready.put(srv.address)
    try:
        srv.serve(until_workers_leave=True)
    finally:
        srv.close()


def _worker_main(
    fn: Callable[..., Any],
    wid: int | Literal["vacant"],
    kwargs: dict[str, Any],
    args: tuple,
    q: Any,
    tag: int,
) -> None:
    try:
        with Worker(worker_id=wid, **kwargs) as w:
            result = fn(w, *args)
        q.put((tag, w.worker_id, "ok", result))
    except BaseException as e:
        q.put((tag, wid, "err", f"{type(e).__name__}: {e}"))
        raise


def _free_udp_port(host: str) -> int:
    import random
    import socket

    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
                u.bind((host, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no free UDP port found in 20000-32000")


def launch(
    fn: Callable[..., Any],
    num_workers: int = 3,
    num_servers: int = 1,
    *,
    args: tuple = (),
    host: str = "127.0.0.1",
    ports: Sequence[int] | None = None,
    secret: str | bytes | None = None,
    server_kwargs: Mapping[str, Any] | None = None,
    worker_kwargs: Mapping[str, Any] | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    restart_servers: bool = True,
    restart_workers: int = 0,
    timeout: float = 600.0,
) -> list[Any]:
    """Runs ``fn(worker, *args)`` in ``num_workers`` processes against ``num_servers`` server
    processes on ``host``; returns each worker's result by worker id.

    ``fn`` must be importable (a module-level function): processes are started with 'spawn'.
    With ``checkpoint_dir``, server ``i`` checkpoints into ``checkpoint_dir/server-i``; a server
    process that dies is replaced by a standby on the same address that restores the latest
    checkpoint (``restart_servers``). A worker process that dies (killed, crashed) is
    replaced by a new process that takes over its id, data shard and clock
    (``worker_id="vacant"``), up to ``restart_workers`` times in all; ``fn`` should then run
    from ``worker.clock`` on (e.g. ``while worker.clock < steps``). A worker that fails
    otherwise raises ``RuntimeError`` with its error.
    """
    ctx = mp.get_context("spawn")
    sec = Settings.resolve(secret=secret).secret
    if sec is None:
        sec = _secrets.token_hex(16).encode()
    ports = list(ports) if ports is not None else [_free_udp_port(host) for _ in range(num_servers)]
    if len(ports) != num_servers:
        raise ValueError(f"{num_servers} servers but {len(ports)} ports")
    addrs = [f"{host}:{p}" for p in ports]
    skw: dict[str, Any] = {"num_workers": num_workers, **(server_kwargs or {})}
    wkw: dict[str, Any] = {"servers": addrs, "secret": sec, **(worker_kwargs or {})}

    def server_kwargs_for(i: int, restore: bool) -> dict[str, Any]:
        kw = {**skw, "bind": addrs[i], "secret": sec}
        if checkpoint_dir is not None:
            kw["checkpoint_dir"] = str(Path(checkpoint_dir) / f"server-{i}")
            kw["restore"] = restore
        return kw

    def start_server(i: int, restore: bool) -> Any:
        ready = ctx.Queue()
        p = ctx.Process(
            target=_server_main,
            args=(server_kwargs_for(i, restore), ready),
            name=f"mcp-ps-server-{i}",
        )
        p.start()
        try:
            ready.get(timeout=60)
        except Exception:
            p.kill()
            raise RuntimeError(f"parameter server {i} did not start") from None
        return p

    servers = [start_server(i, restore=False) for i in range(num_servers)]
    q = ctx.Queue()
    workers: list[Any] = []

    def start_worker(wid: int | Literal["vacant"]) -> None:
        p = ctx.Process(
            target=_worker_main, args=(fn, wid, wkw, args, q, len(workers)), daemon=True
        )
        workers.append(p)
        p.start()

    for w in range(num_workers):
        start_worker(w)
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    answered: set[int] = set()
    replaced: set[int] = set()
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < num_workers and time.monotonic() < deadline:
            try:
                tag, wid, status, value = q.get(timeout=0.2)
                answered.add(tag)
                if status == "ok":
                    results[wid] = value
                else:
                    errors[tag] = value
            except Exception:
                pass
            for tag, p in enumerate(workers):
                if tag in answered or tag in replaced or p.exitcode in (None, 0):
                    continue
                if restart_workers > 0:
                    restart_workers -= 1
                    replaced.add(tag)
                    start_worker("vacant")
                else:
                    errors[tag] = f"worker process exited with code {p.exitcode}"
            for i, p in enumerate(servers):
                if p.exitcode is not None and p.exitcode != 0 and restart_servers:
                    if checkpoint_dir is None:
                        raise RuntimeError(f"parameter server {i} died (exit code {p.exitcode})")
                    servers[i] = start_server(i, restore=True)
    finally:
        for p in workers:
            p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join(5)
        for p in servers:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(5)
    if errors:
        raise RuntimeError(
            "parameter-server workers failed: "
            + "; ".join(f"worker process {t}: {e}" for t, e in sorted(errors.items()))
        )
    if len(results) < num_workers:
        raise TimeoutError(f"workers did not finish within {timeout} s")
    return [results[w] for w in range(num_workers)]


def run_from_env(
    fn: Callable[[Worker], Any],
    num_servers: int = 1,
    *,
    server_kwargs: Mapping[str, Any] | None = None,
    worker_kwargs: Mapping[str, Any] | None = None,
) -> Any:
    """For ``torchrun``: ranks below ``num_servers`` serve, the others run ``fn(worker)``.

    Server ``i`` listens on ``MASTER_ADDR:MASTER_PORT+1+i`` (so server ranks must run on the
    master's host); the job secret is ``MCP_SECRET``, or one that rank 0 generates and hands
    out through a torch TCPStore on ``MASTER_PORT``. Returns what ``fn`` returned (None on
    servers).
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500"))
    if world <= num_servers:
        raise ValueError(f"{world} ranks leave no worker beside {num_servers} servers")
    given = Settings.resolve().secret
    sec = given.decode() if given is not None else None
    if not sec:
        from torch.distributed import TCPStore

        store = TCPStore(host, port, world, is_master=rank == 0, timeout=_timedelta(300))
        if rank == 0:
            store.set("mcp_ps_secret", _secrets.token_hex(16))
        sec = store.get("mcp_ps_secret").decode()
    addrs = [f"{host}:{port + 1 + i}" for i in range(num_servers)]
    if rank < num_servers:
        kw = {"num_workers": world - num_servers, **(server_kwargs or {})}
        with Server(addrs[rank], secret=sec, **kw) as srv:
            srv.serve(until_workers_leave=True)
        return None
    with Worker(addrs, worker_id=rank - num_servers, secret=sec, **(worker_kwargs or {})) as w:
        return fn(w)


def _timedelta(s: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=s)
