"""The exceptions mcp_fast raises.

Every failure of a communication operation is an :class:`MCPError`. The subclasses say what
went wrong so that a training loop can react (retry, shrink the job, stop) without parsing
messages. Bad arguments are reported before anything is sent, as the built-in
``TypeError``/``ValueError``.
"""

from __future__ import annotations


class MCPError(RuntimeError):
    """Base class of every error raised by mcp_fast's communication layer."""


class SpecMismatchError(MCPError):
    """Ranks called the same operation with different dtypes, shapes, ops or roots.

    Raised on every rank of the operation; the message names the ranks and both specs.
    """


class PeerLostError(MCPError):
    """A peer stopped answering (killed, frozen, or its link cut).

    Attributes:
        rank: the rank that was lost, or ``-1`` when unknown.
        op: the operation that needed it.
        since: seconds since the peer was last heard from, when known.
    """

    def __init__(self, message: str, rank: int = -1, op: str = "", since: float | None = None):
        super().__init__(message)
        self.rank = rank
        self.op = op
        self.since = since


class PeerStalledError(MCPError):
    """A peer answers heartbeats but its training loop does not move: it has not started the
    operation the others wait in for longer than the progress watchdog's limit (a hung
    kernel, a deadlock, an endless data-loader wait). Distinct from :class:`PeerLostError`,
    whose peer is silent.

    Attributes:
        rank: the stalled rank.
        op: where it is stuck, as far as its progress reports tell.
    """

    def __init__(self, message: str, rank: int = -1, op: str = ""):
        super().__init__(message)
        self.rank = rank
        self.op = op


class MCPTimeoutError(MCPError, TimeoutError):
    """An operation or the rendezvous did not finish within its timeout."""


class AuthenticationError(MCPError):
    """The TLS handshake failed: the two sides do not hold the same job secret."""


class VersionMismatchError(MCPError):
    """The peer speaks another major version of the MCP protocol; the message names both."""


class ProtocolError(MCPError):
    """A peer sent bytes that are not valid MCP (bad frame, checksum failure)."""


class GroupClosedError(MCPError):
    """The group was closed or aborted before the operation could run."""


class SupersededError(MCPError):
    """This process's worker id was taken over by a replacement while it was dropped as dead
    (it was frozen or cut off for longer than ``dead_after``). It must stop: its place, data
    shard included, belongs to the replacement now."""


class GradientError(MCPError):
    """The gradient-norm guard tripped with policy ``"raise"``: several steps in a row had a
    norm above ``max_norm`` or a NaN/Inf.

    Attributes:
        norm: the global L2 norm of the step that tripped it (NaN when non-finite).
        consecutive: bad steps in a row, this one included.
    """

    def __init__(self, message: str, norm: float = float("nan"), consecutive: int = 0):
        super().__init__(message)
        self.norm = norm
        self.consecutive = consecutive


__all__ = [
    "AuthenticationError",
    "GradientError",
    "GroupClosedError",
    "MCPError",
    "MCPTimeoutError",
    "PeerLostError",
    "PeerStalledError",
    "ProtocolError",
    "SpecMismatchError",
    "SupersededError",
    "VersionMismatchError",
]


class SharedMemoryWarning(RuntimeWarning):
    """Shared memory with a peer on this host could not be set up (memfd, mmap or the
    memory limit failed, the peer's socket was unreachable or failed its credential check):
    that peer is reached over QUIC instead. The message names the peer and the cause."""
