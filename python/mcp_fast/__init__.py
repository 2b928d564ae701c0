"""mcp_fast: collectives for training across slow, lossy or untrusted networks.

MCP (Model Control Protocol) over QUIC with mutual TLS, from a Rust core::

    import mcp_fast as mcp
    g = mcp.init()                 # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun
    g.all_reduce(array)            # in place, numpy or torch CPU
"""

from . import _core, checkpoint, delta, guards, ps, snapshots
from .errors import (
    AuthenticationError,
    GradientError,
    GroupClosedError,
    MCPError,
    MCPTimeoutError,
    PeerLostError,
    PeerStalledError,
    ProtocolError,
    SharedMemoryWarning,
    SpecMismatchError,
    SupersededError,
    VersionMismatchError,
)
from .group import Chaos, Group, Topology, Work, init
from .guards import GradientGuard, GuardResult, SafeMode
from .snapshots import SnapshotError, Snapshots

__version__: str = _core.__version__
PROTOCOL_VERSION: str = f"{_core.PROTOCOL_MAJOR}.{_core.PROTOCOL_MINOR}"

__all__ = [
    "PROTOCOL_VERSION",
    "checkpoint",
    "delta",
    "guards",
    "ps",
    "snapshots",
    "AuthenticationError",
    "Chaos",
    "GradientError",
    "GradientGuard",
    "Group",
    "GroupClosedError",
    "GuardResult",
    "MCPError",
    "MCPTimeoutError",
    "PeerLostError",
    "PeerStalledError",
    "ProtocolError",
    "SafeMode",
    "SharedMemoryWarning",
    "SnapshotError",
    "Snapshots",
    "SpecMismatchError",
    "SupersededError",
    "Topology",
    "VersionMismatchError",
    "Work",
    "__version__",
    "init",
]
