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
- ``MCP_CONFIG`` / ``config``: the transport config as the documents write it, a dict or the
  path of a JSON or TOML file holding one: ``max_streams``, ``fec_group_size``,
  ``compression`` (``"none"``, ``"zstd"``, ``"zstd@L3"``), ``heartbeat_interval``
  (milliseconds) and ``mtu`` (see docs/configuration.md).
- ``MCP_THREADS`` (read once per process, when the first group, server or client starts):
  worker threads that carry the network and the reductions (2). Ranks of a collective group
  with two cores or fewer each do better with 1; a parameter server needs 2
  (docs/benchmarks.md, "Worker threads per rank").
- ``MCP_MODEL_SPEC`` / ``model_spec``: the model this rank declares, the documents'
  Model-Spec (``{"arch": ..., "precision": ..., "io_schema": {...}}``), as JSON text or the
  path of a JSON or TOML file; the rendezvous refuses ranks that declare different ones.

Precedence: an explicit keyword argument, then the config (``config=``, else the file
``MCP_CONFIG`` names), then the other environment variables, then the defaults. The one key
that overlaps another setting is ``heartbeat_interval`` (``heartbeat=`` / ``MCP_HEARTBEAT``).

Values are checked by the core, which names the setting that is wrong; the config and the
model spec as soon as they are read, so that a bad file stops every rank at once instead of
one rank failing while the others wait for it.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _core

__all__ = ["Settings", "env_float", "env_int", "load_config", "load_model_spec"]


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


def _load_table(path: Path, what: str) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"{what} file {str(path)!r} cannot be read: {e}") from None
    try:
        loaded = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as e:
        kind = "TOML" if path.suffix == ".toml" else "JSON"
        raise ValueError(f"{what} file {str(path)!r} is not valid {kind}: {e}") from None
    if not isinstance(loaded, dict):
        raise ValueError(
            f"{what} file {str(path)!r} must hold a table of keys, got {type(loaded).__name__}"
        )
    return loaded


def load_config(config: Mapping[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any]:
    """The transport config: ``config`` itself when it is a mapping, else the JSON or TOML
    file it names (by its suffix: ``.toml`` is TOML, anything else JSON), else the file
    ``MCP_CONFIG`` names, else empty. The keys and values are checked by the core."""
    if config is None:
        config = os.environ.get("MCP_CONFIG") or None
        if config is None:
            return {}
    if isinstance(config, Mapping):
        return dict(config)
    return _load_table(Path(config), "transport config")


def load_model_spec(
    spec: Mapping[str, Any] | str | os.PathLike[str] | None,
) -> dict[str, Any] | None:
    """The declared model: ``spec`` itself when it is a mapping, else JSON text (starting
    with ``{``) or the JSON or TOML file it names, else the same read from
    ``MCP_MODEL_SPEC``, else ``None``. The keys and values are checked by the core."""
    if spec is None:
        spec = os.environ.get("MCP_MODEL_SPEC") or None
        if spec is None:
            return None
    if isinstance(spec, Mapping):
        return dict(spec)
    if isinstance(spec, str) and spec.lstrip().startswith("{"):
        try:
            loaded = json.loads(spec)
        except ValueError as e:
            raise ValueError(f"model_spec {spec!r} is not valid JSON: {e}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"model_spec {spec!r} must be a JSON object")
        return loaded
    return _load_table(Path(spec), "model_spec")


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


@dataclass(frozen=True)
class Settings:
    """What a group's transport is set up with; make one with :meth:`Settings.resolve`."""

    secret: bytes | None
    timeout: float
    connect_timeout: float
    idle_timeout: float
    heartbeat: float | None
    chaos: str | None
    lane: str
    resend_limit: int
    stall_timeout: float
    allow_generated_secret: bool
    zero_rtt: bool
    config: dict[str, Any] = field(default_factory=dict)
    model_spec: dict[str, Any] | None = None

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
        config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
        model_spec: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    ) -> Settings:
        """The settings for the given arguments; those left ``None`` come from the
        config, then the environment, then the defaults. ``heartbeat`` is ``None`` when the
        config's ``heartbeat_interval`` decides it."""
        cfg = load_config(config)
        spec = load_model_spec(model_spec)
        # Checked here, by the core, so that a bad file fails each rank at once, before it
        # waits on the others (or on a store that a failed rank 0 takes down with it).
        _core.check_settings(cfg or None, spec)
        if heartbeat is None and "heartbeat_interval" not in cfg:
            heartbeat = _first(env_float("MCP_HEARTBEAT"), 5.0)
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
            heartbeat=float(heartbeat) if heartbeat is not None else None,
            chaos=str(chaos) if chaos is not None else None,
            lane=_first(lane, os.environ.get("MCP_LANE") or None, "auto"),
            resend_limit=int(_first(resend_limit, env_int("MCP_RESEND_LIMIT"), 8)),
            stall_timeout=float(_first(stall_timeout, env_float("MCP_STALL_TIMEOUT"), 60.0)),
            allow_generated_secret=bool(
                _first(allow_generated_secret, env_int("MCP_ALLOW_GENERATED_SECRET"), 0)
            ),
            zero_rtt=bool(_first(zero_rtt, env_int("MCP_ZERO_RTT"), 1)),
            config=cfg,
            model_spec=spec,
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
            "config": self.config or None,
            "model_spec": self.model_spec,
        }
