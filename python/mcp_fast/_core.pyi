"""Type stubs of the Rust extension module (rust/mcp-py)."""

from collections.abc import Buffer, Callable
from typing import Any

PROTOCOL_MAJOR: int
PROTOCOL_MINOR: int
__version__: str

def reduce_into(dst_ptr: int, src_ptr: int, nbytes: int, dtype: str, op: str) -> None: ...
def codec_round_trip(ptr: int, nbytes: int, dtype: str, codec: str, block: int = 256) -> None: ...

class Work:
    def wait(self, timeout: float | None = None) -> bool: ...
    def is_completed(self) -> bool: ...
    def is_success(self) -> bool: ...
    def exception(self) -> BaseException | None: ...
    def source_rank(self) -> int | None: ...

class ProcessGroup:
    def __init__(
        self,
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
        heartbeat: float = 5.0,
        lane: str | None = None,
    ) -> None: ...
    def health(self) -> list[dict[str, Any]]: ...
    def lane_stats(self) -> dict[str, int]: ...
    @property
    def lane(self) -> str: ...
    def chaos_kill(self) -> None: ...
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
        ptr: int,
        nbytes: int,
        dtype: str,
        shape: list[int],
        op: str,
        algorithm: str,
        keepalive: Any,
        codec: str = ...,
        block: int = ...,
    ) -> Work: ...
    def broadcast(
        self,
        ptr: int,
        nbytes: int,
        dtype: str,
        shape: list[int],
        src: int,
        keepalive: Any,
        codec: str = ...,
        block: int = ...,
    ) -> Work: ...
    def all_gather(
        self,
        out_ptr: int,
        out_nbytes: int,
        out_shape: list[int],
        in_ptr: int,
        in_nbytes: int,
        in_shape: list[int],
        dtype: str,
        keepalive: Any,
        codec: str = ...,
        block: int = ...,
    ) -> Work: ...
    def reduce_scatter(
        self,
        out_ptr: int,
        out_nbytes: int,
        out_shape: list[int],
        in_ptr: int,
        in_nbytes: int,
        in_shape: list[int],
        dtype: str,
        op: str,
        keepalive: Any,
        codec: str = ...,
        block: int = ...,
    ) -> Work: ...
    def barrier(self) -> Work: ...
    def send(
        self,
        ptr: int,
        nbytes: int,
        dtype: str,
        shape: list[int],
        dst: int,
        tag: int,
        keepalive: Any,
        codec: str = ...,
        block: int = ...,
    ) -> Work: ...
    def recv(
        self,
        ptr: int,
        nbytes: int,
        dtype: str,
        shape: list[int],
        src: int,
        tag: int,
        keepalive: Any,
        codec: str = ...,
        block: int = ...,
    ) -> Work: ...
    def recv_any(
        self,
        ptr: int,
        nbytes: int,
        dtype: str,
        shape: list[int],
        tag: int,
        keepalive: Any,
        codec: str = ...,
        block: int = ...,
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
def grad_norm(buffers: list[tuple[int, int, str]]) -> tuple[float, bool]: ...
def scale_(ptr: int, nbytes: int, dtype: str, factor: float) -> None: ...

class GuardState:
    def __init__(self, max_norm: float, trip_after: int = 3) -> None: ...
    def check(self, norm: float) -> tuple[str, float, int]: ...
    @property
    def consecutive_bad(self) -> int: ...
    def reset(self) -> None: ...
