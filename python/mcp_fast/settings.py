"""The transport's settings, read in one place: an explicit argument first, then the
environment, then the default. ``mcp.init``, the torch backend (``init_process_group("mcp")``)
and the parameter server all take their settings from here, so that ``MCP_CHAOS``,
``MCP_LANE`` and the rest reach every kind of group alike.

- ``MCP_SECRET`` / ``secret``: the job secret (none: rank 0 makes one and hands it out).
- ``MCP_ALLOW_GENERATED_SECRET`` / ``allow_generated_secret``: without a secret on an address
  other than loopback, hand rank 0's generated one out anyway (default: refuse to start).
- ``MCP_TIMEOUT`` / ``timeout``: seconds an operation may take (300).
- ``MCP_CONNECT_TIMEOUT`` / ``connect_timeout``: seconds the rendezvous may take (``timeout``).
- ``MCP_IDLE_TIMEOUT`` / ``idle_timeout``: seconds of silence before QUIC closes a path (30).
- ``MCP_HEARTBEAT`` / ``heartbeat``: seconds between heartbeats (5).
- ``MCP_CHAOS`` / ``chaos``: faults to inject, e.g. ``loss=0.2,corrupt=0.01,seed=1``.
- ``MCP_LANE`` / ``lane``: ``auto``, ``stream`` or ``fec`` (``auto``).
- ``MCP_RESEND_LIMIT`` / ``resend_limit``: resends of a damaged frame before failing (8).
- ``MCP_STALL_TIMEOUT`` / ``stall_timeout``: the least wait on a reachable peer that does not
  move before it is reported stalled (60).
- ``MCP_ZERO_RTT`` / ``zero_rtt``: a connection that broke is re-established resuming its
  TLS session, its first frames as 0-RTT data (1); 0 makes a full handshake first.
- ``MCP_HOST_ID`` / ``host_id`` (read by ``mcp.init`` and the torch backend): this rank's
  host name; ranks with equal names share a host and the collectives go hierarchical.

Values are checked once, by the core, which names the setting that is wrong.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

__all__ = ["Settings", "env_float", "env_int"]


def _env(name: str, parse: Any, what: str) -> Any:
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    try:
        return parse(v)
    except ValueError:
        raise ValueError(f"environment variable {name}={v!r} is not {what}") from None


def env_float(name: str) -> float | None:
    """The numeric environment variable ``name``; ``None`` when unset or empty."""
    return _env(name, float, "a number")


def env_int(name: str) -> int | None:
    """The integer environment variable ``name``; ``None`` when unset or empty."""
    return _env(name, int, "an integer")


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


@dataclass(frozen=True)
class Settings:
    """What a group's transport is set up with; make one with :meth:`Settings.resolve`."""

    secret: bytes | None
    timeout: float
    connect_timeout: float
    idle_timeout: float
    heartbeat: float
    chaos: str | None
    lane: str
    resend_limit: int
    stall_timeout: float
    allow_generated_secret: bool
    zero_rtt: bool

    @classmethod
    def resolve(
        cls,
        *,
        secret: str | bytes | None = None,
        timeout: float | None = None,
        connect_timeout: float | None = None,
        idle_timeout: float | None = None,
        heartbeat: float | None = None,
        chaos: Any = None,
        lane: str | None = None,
        resend_limit: int | None = None,
        stall_timeout: float | None = None,
        allow_generated_secret: bool | None = None,
        zero_rtt: bool | None = None,
    ) -> Settings:
        """The settings for the given arguments; those left ``None`` come from the
        environment, then from the defaults."""
        s = _first(secret, os.environ.get("MCP_SECRET") or None)
        timeout = _first(timeout, env_float("MCP_TIMEOUT"), 300.0)
        chaos = _first(chaos, os.environ.get("MCP_CHAOS") or None)
        return cls(
            secret=s.encode() if isinstance(s, str) else (bytes(s) if s is not None else None),
            timeout=float(timeout),
            connect_timeout=float(
                _first(connect_timeout, env_float("MCP_CONNECT_TIMEOUT"), timeout)
            ),
            idle_timeout=float(_first(idle_timeout, env_float("MCP_IDLE_TIMEOUT"), 30.0)),
            heartbeat=float(_first(heartbeat, env_float("MCP_HEARTBEAT"), 5.0)),
            chaos=str(chaos) if chaos is not None else None,
            lane=_first(lane, os.environ.get("MCP_LANE") or None, "auto"),
            resend_limit=int(_first(resend_limit, env_int("MCP_RESEND_LIMIT"), 8)),
            stall_timeout=float(_first(stall_timeout, env_float("MCP_STALL_TIMEOUT"), 60.0)),
            allow_generated_secret=bool(
                _first(allow_generated_secret, env_int("MCP_ALLOW_GENERATED_SECRET"), 0)
            ),
            zero_rtt=bool(_first(zero_rtt, env_int("MCP_ZERO_RTT"), 1)),
        )

    def core_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``_core.ProcessGroup`` that these settings fill."""
        return {
            "secret": self.secret,
            "timeout": self.timeout,
            "connect_timeout": self.connect_timeout,
            "idle_timeout": self.idle_timeout,
            "heartbeat": self.heartbeat,
            "chaos": self.chaos,
            "lane": self.lane,
            "resend_limit": self.resend_limit,
            "stall_timeout": self.stall_timeout,
            "allow_generated_secret": self.allow_generated_secret,
            "zero_rtt": self.zero_rtt,
        }
