"""Type stubs of the Rust extension module (rust/mcp-py)."""

from collections.abc import Callable
from typing import Any, Self, final

from typing_extensions import Buffer

from mcp_fast._buffers import Buffer as TensorArg
from mcp_fast.group import Topology

PROTOCOL_MAJOR: int
PROTOCOL_MINOR: int
__version__: str

def reduce_into(dst: TensorArg, src: TensorArg, op: str) -> None: ...
def codec_round_trip(x: TensorArg, codec: str, block: int = 256) -> None: ...
def check_settings(
    config: dict[str, Any] | None = None, model_spec: dict[str, Any] | None = None
) -> None: ...
def netem_forward(
    fd_a: int,
    fd_b: int,
    stop_fd: int,
    *,
    delay_s: float = 0.0,
    jitter_s: float = 0.0,
    loss: float = 0.0,
    rate_bit_s: float | None = None,
    queue_s: float = 0.05,
    seed: int = 0,
) -> dict[str, Any]: ...
def sim_all_reduce(
    world: int,
    algorithm: str,
    nbytes: float,
    *,
    ranks_per_host: int = 1,
    codec: str = "none",
    block: int = 256,
    intra_gbps: float = 2400.0,
    intra_rtt_s: float = 4e-6,
    inter_gbps: float = 100.0,
    inter_rtt_s: float = 20e-6,
    loss: float = 0.0,
    seed: int = 0,
    heartbeat_s: float = 5.0,
    fail_rank: int | None = None,
    fail_at_s: float = 0.0,
    timeout_s: float = 86400.0,
    intra_overhead_s: float = 0.0,
    inter_overhead_s: float = 0.0,
    cores: int = 0,
    ranks_per_machine: int = 0,
    intra_cpu_tx: float = 0.0,
    intra_cpu_rx: float = 0.0,
    inter_cpu_tx: float = 0.0,
    inter_cpu_rx: float = 0.0,
    inter_burst_bytes: float = 0.0,
    inter_peak_gbps: float = 0.0,
    direct_reads: bool = False,
) -> dict[str, Any]: ...
def sim_rendezvous(
    world: int,
    *,
    ranks_per_host: int = 1,
    intra_gbps: float = 2400.0,
    intra_rtt_s: float = 4e-6,
    inter_gbps: float = 100.0,
    inter_rtt_s: float = 20e-6,
    loss: float = 0.0,
    seed: int = 0,
    timeout_s: float = 600.0,
) -> dict[str, Any]: ...
def sim_membership_change(
    members: int,
    *,
    ranks_per_host: int = 1,
    intra_gbps: float = 2400.0,
    intra_rtt_s: float = 4e-6,
    inter_gbps: float = 100.0,
    inter_rtt_s: float = 20e-6,
    seed: int = 0,
    heartbeat_s: float = 0.1,
    dead_after_s: float = 0.3,
    die_after_s: float = 0.001,
    fails_after_s: float | None = None,
    limit_s: float = 600.0,
) -> dict[str, Any]: ...

@final
class Work:
    def wait(self, timeout: float | None = None) -> bool: ...
    def is_completed(self) -> bool: ...
    def is_success(self) -> bool: ...
    def exception(self) -> BaseException | None: ...
    def source_rank(self) -> int | None: ...

@final
class ProcessGroup:
    def __new__(
        cls,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        secret: bytes | None = None,
        timeout: float = 300.0,
        connect_timeout: float = 300.0,
        idle_timeout: float = 30.0,
        chunk_bytes: int = 1048576,
        small_bytes: int = 65536,
        protocol_major: int | None = None,
        on_bound: Callable[[str], None] | None = None,
        chaos: str | None = None,
        heartbeat: float | None = None,
        lane: str | None = None,
        resend_limit: int = 8,
        stall_timeout: float = 60.0,
        allow_generated_secret: bool = False,
        epoch_of: tuple[ElasticMember, int] | None = None,
        zero_rtt: bool = True,
        shm: bool | None = None,
        host_id: str | None = None,
        config: dict[str, Any] | None = None,
        model_spec: dict[str, Any] | None = None,
    ) -> Self: ...
    def health(self) -> list[dict[str, Any]]: ...
    def set_topology(self, host_ids: list[str]) -> None: ...
    def topology(self) -> Topology: ...
    def shm_fallbacks(self) -> list[tuple[int, str]]: ...
    def shm_stats(self) -> dict[str, int]: ...
    def lane_stats(self) -> dict[str, int]: ...
    @property
    def lane(self) -> str: ...
    def chaos_kill(self) -> None: ...
    def chaos_cut(self, seconds: float) -> None: ...
    def chaos_reset(self) -> None: ...
    def chaos_stats(self) -> dict[str, int]: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def secret(self) -> bytes: ...
    @property
    def local_addr(self) -> str: ...
    def stats(self) -> dict[str, int]: ...
    def rtt(self, peer: int) -> float | None: ...
    def all_reduce(
        self,
        tensor: TensorArg,
        op: str,
        algorithm: str,
        codec: str = ...,
        block: int = ...,
        wait: bool = ...,
    ) -> Work: ...
    def broadcast(
        self,
        tensor: TensorArg,
        src: int,
        codec: str = ...,
        block: int = ...,
        wait: bool = ...,
    ) -> Work: ...
    def all_gather(
        self,
        out: TensorArg,
        input: TensorArg,
        codec: str = ...,
        block: int = ...,
        wait: bool = ...,
    ) -> Work: ...
    def reduce_scatter(
        self,
        out: TensorArg,
        input: TensorArg,
        op: str,
        codec: str = ...,
        block: int = ...,
        wait: bool = ...,
    ) -> Work: ...
    def barrier(self, wait: bool = ...) -> Work: ...
    def send(
        self,
        tensor: TensorArg,
        dst: int,
        tag: int,
        codec: str = ...,
        block: int = ...,
        wait: bool = ...,
    ) -> Work: ...
    def recv(
        self,
        tensor: TensorArg,
        src: int,
        tag: int,
        codec: str = ...,
        block: int = ...,
        wait: bool = ...,
    ) -> Work: ...
    def recv_any(
        self, tensor: TensorArg, tag: int, codec: str = ..., block: int = ..., wait: bool = ...
    ) -> Work: ...
    def abort(self) -> None: ...
    def close(self) -> None: ...

def delta_encode(
    cur: Buffer,
    dtype: str,
    shape: list[int],
    prev: Buffer | None = None,
    *,
    level: int = 1,
    chunk_bytes: int = 1048576,
    threads: int = 0,
    max_abs_error: float | None = None,
) -> bytes: ...
def delta_decode_into(
    blob: Buffer, prev: Buffer | None, out: Buffer, *, threads: int = 0
) -> None: ...
def delta_info(blob: Buffer) -> dict[str, Any]: ...
def delta_content_hash(data: Buffer) -> int: ...
def grad_norm(buffers: list[TensorArg]) -> tuple[float, bool]: ...
def scale_(x: TensorArg, factor: float) -> None: ...

@final
class GuardState:
    def __new__(cls, max_norm: float, trip_after: int = 3) -> Self: ...
    def check(self, norm: float) -> tuple[str, float, int]: ...
    @property
    def consecutive_bad(self) -> int: ...
    def reset(self) -> None: ...

_PieceTuple = tuple[str, int, bytes, dict[str, bytes], tuple[int, float, float], int]

@final
class PsServer:
    def __new__(
        cls,
        bind: str,
        secret: bytes,
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
        chaos: str | None = None,
        restore: tuple[int, list[_PieceTuple], list[int]] | None = None,
        config: dict[str, Any] | None = None,
    ) -> Self: ...
    @property
    def local_addr(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    def snapshot(self) -> tuple[int, list[_PieceTuple], list[int]]: ...
    def restore(self, applied: int, pieces: list[_PieceTuple], workers: list[int]) -> None: ...
    def stats(self) -> dict[str, int]: ...
    def clocks(self) -> list[tuple[int, int, bool]]: ...
    def chaos_kill(self) -> None: ...
    def close(self) -> None: ...

@final
class PsWorker:
    def __new__(
        cls,
        servers: list[str],
        worker: int | None,
        secret: bytes,
        timeout: float = 60.0,
        dead_after: float = 5.0,
        split_above: int = 262144,
        chaos: str | None = None,
        config: dict[str, Any] | None = None,
    ) -> Self: ...
    @property
    def worker(self) -> int: ...
    @property
    def generation(self) -> int: ...
    @property
    def resends(self) -> int: ...
    @property
    def clock(self) -> int: ...
    def set_tensors(self, tensors: list[tuple[str, int]]) -> list[tuple[str, int, int, int]]: ...
    def init(self, items: list[tuple[str, TensorArg]]) -> None: ...
    def check(self, items: list[tuple[str, TensorArg]], what: str) -> None: ...
    def push(
        self, items: list[tuple[str, TensorArg]], codec: str = "none", block: int = 256
    ) -> None: ...
    def pull(self, items: list[tuple[str, TensorArg]]) -> int: ...
    def advance(self, staleness: int | None = None) -> tuple[int, int | None]: ...
    def step(
        self,
        grads: list[tuple[str, TensorArg]],
        into: list[tuple[str, TensorArg]],
        codec: str = "none",
        block: int = 256,
        staleness: int | None = None,
    ) -> tuple[int, int | None]: ...
    def stats(self) -> list[dict[str, int]]: ...
    def counters(self) -> tuple[int, int]: ...
    def replace_server(self, slot: int, address: str) -> None: ...
    def servers(self) -> tuple[int, list[str]]: ...
    def chaos_kill(self) -> None: ...
    def close(self) -> None: ...

@final
class Coordinator:
    def __new__(
        cls,
        bind: str,
        secret: bytes,
        min_members: int = 1,
        dead_after: float = 0.5,
        join_window: float = 0.2,
        change_limit: float = 60.0,
        rebuild_window: float = 2.0,
    ) -> Self: ...
    @property
    def local_addr(self) -> str: ...
    def epoch(self) -> dict[str, Any] | None: ...
    def stats(self) -> dict[str, int]: ...
    def close(self) -> None: ...

@final
class ElasticMember:
    def __new__(
        cls,
        coordinator: str,
        secret: bytes,
        spec: str,
        member_id: int,
        heartbeat: float = 0.1,
        connect_timeout: float = 30.0,
    ) -> Self: ...
    @property
    def id(self) -> int: ...
    @property
    def local_ip(self) -> str: ...
    def report(self, seen: int, step: int, timeout: float) -> dict[str, Any]: ...
    def publish_master(self, epoch: int, addr: str, timeout: float) -> bool: ...
    def announce_master(self, epoch: int, addr: str) -> None: ...
    def master(self, epoch: int, timeout: float) -> str | None: ...
    def watch(self, epoch: int, group: ProcessGroup) -> None: ...
    def unwatch(self) -> None: ...
    def forget_view(self) -> None: ...
    def set_step(self, step: int) -> None: ...
    def beat(self) -> dict[str, Any] | None: ...
    def epoch_over(self, epoch: int) -> bool: ...
    def counters(self) -> tuple[int, int]: ...
    def leave(self) -> None: ...
