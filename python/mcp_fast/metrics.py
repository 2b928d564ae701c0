"""Metrics of the process's groups, as a dict or as a Prometheus endpoint.

::

    from mcp_fast import metrics
    metrics.snapshot()                       # every open group of this process
    host, port = metrics.start_exporter()    # http://127.0.0.1:<port>/metrics
    metrics.stop_exporter()

A snapshot holds, per group: rank, world size, the transport counters of
:meth:`Group.stats` (frames and bytes sent and received, corrupt frames, refused handshakes:
totals of the process over all peers), the smoothed QUIC round-trip time to every other rank
(None until connected), the fault injector's counters when ``chaos=`` is on, and the
operations started / finished ok / failed by kind, counted in Python by :class:`Group`.

The exporter serves these in the Prometheus text format (version 0.0.4), with metric names
prefixed ``mcp_`` and labels ``rank`` (and ``peer``, ``op``, ``result``; ``group`` when the
process has several groups). It uses ``prometheus_client`` when installed
(``pip install mcp-fast[metrics]``), else a small ``http.server`` thread; both bind
127.0.0.1 unless told otherwise, and collect on every scrape, off the training threads'
path.
"""

from __future__ import annotations

import atexit
import contextlib
import http.server
import math
import os
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .errors import MCPError
from .group import Group, _live_groups

__all__ = ["discover_exporters", "registry_dir", "render", "snapshot", "start_exporter"]
__all__ += ["stop_exporter"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _group_snapshot(g: Group) -> dict[str, Any]:
    core = g._core
    out: dict[str, Any] = {
        "rank": g.rank,
        "world_size": g.world_size,
        "open": core is not None,
        "transport": {},
        "rtt": {},
        "path": {},
        "chaos": {},
        "ops": g._metrics.copy(),
    }
    if core is None:
        return out
    try:
        out["transport"] = dict(core.stats())
        out["rtt"] = {p: core.rtt(p) for p in range(g.world_size) if p != g.rank}
        out["path"] = {
            h["rank"]: {k: h[k] for k in _PATH_KEYS}
            for h in core.health()
            if h["sent_packets"] is not None
        }
        out["chaos"] = dict(core.chaos_stats())
    except MCPError:  # closed under our feet
        out["open"] = False
    return out


def _open_groups() -> list[Group]:
    """The live groups, in a stable order (a WeakSet cannot be iterated while another thread
    adds to it: retry a few times)."""
    for _ in range(5):
        try:
            found = list(_live_groups)
        except RuntimeError:  # "Set changed size during iteration"
            continue
        return sorted(found, key=lambda g: (g.rank, g.world_size, id(g)))
    return []


def snapshot(group: Group | None = None) -> dict[str, Any]:
    """The metrics of ``group``, or of every open group of this process.

    Returns ``{"timestamp": unix seconds, "pid": int, "groups": [...]}``, one entry per
    group (ordered by rank): ``rank``, ``world_size``, ``open``, ``transport``
    (``{"bytes_sent": n, ...}``), ``rtt`` (``{peer: seconds or None}``), ``chaos`` (empty
    without a fault injector) and ``ops`` (``{"all_reduce": {"started": n, "ok": n,
    "failed": n}, ...}``).
    """
    groups = [group] if group is not None else _open_groups()
    return {
        "timestamp": time.time(),
        "pid": os.getpid(),
        "groups": [_group_snapshot(g) for g in groups],
    }


# ---- Prometheus text -------------------------------------------------------------------------


@dataclass
class _Family:
    name: str  # without the _total of counters
    kind: str  # "counter" or "gauge"
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)

    @property
    def sample_name(self) -> str:
        return self.name + "_total" if self.kind == "counter" else self.name


_PATH_KEYS = ("sent_packets", "lost_packets", "lost_bytes", "congestion_events", "cwnd", "mtu")
_PATH_COUNTERS = {
    "sent_packets": "QUIC packets sent to the peer",
    "lost_packets": "QUIC packets to the peer declared lost (and resent)",
    "lost_bytes": "Bytes of QUIC packets to the peer declared lost",
    "congestion_events": "Congestion events on the path to the peer",
}
_PATH_GAUGES = {
    "cwnd": ("mcp_peer_cwnd_bytes", "QUIC congestion window to the peer"),
    "mtu": ("mcp_peer_mtu_bytes", "Path MTU to the peer"),
}

_TRANSPORT_HELP = {
    "frames_sent": "MCP frames sent to all peers",
    "frames_received": "MCP frames received from all peers",
    "bytes_sent": "Bytes of MCP frames sent to all peers",
    "bytes_received": "Bytes of MCP frames received from all peers",
    "corrupt_frames": "Frames received whose checksum failed",
    "refused_handshakes": "Connections refused at the TLS handshake (wrong secret, version)",
    "quic_sent_packets": "QUIC packets sent on the connections open now",
    "quic_lost_packets": "QUIC packets declared lost on the connections open now",
    "reconnects": "Connections that broke while their peer lived and were re-established",
    "resumed_frames": "Frames sent again on a new connection, unacknowledged when one broke",
    "zero_rtt_accepted": "Reconnections whose 0-RTT data the peer accepted",
    "zero_rtt_rejected": "Reconnections whose 0-RTT data the peer refused (a full handshake)",
    "duplicate_frames": "Copies of frames already received (resent across a reconnection)",
}


def _families(snap: dict[str, Any]) -> list[_Family]:
    fams: dict[str, _Family] = {}

    def fam(name: str, kind: str, help: str) -> _Family:
        if name not in fams:
            fams[name] = _Family(name, kind, help)
        return fams[name]

    groups = snap["groups"]
    several = len(groups) > 1
    for i, g in enumerate(groups):
        base = {"rank": str(g["rank"])}
        if several:
            base["group"] = str(i)
        fam("mcp_world_size", "gauge", "Ranks in the group").samples.append(
            (base, float(g["world_size"]))
        )
        fam("mcp_group_open", "gauge", "1 while the group is open").samples.append(
            (base, 1.0 if g["open"] else 0.0)
        )
        for key, value in sorted(g["transport"].items()):
            if key == "last_reconnect_us":
                fam(
                    "mcp_last_reconnect_seconds",
                    "gauge",
                    "How long the last reconnection took (0: none yet)",
                ).samples.append((base, value / 1e6))
                continue
            if key == "retransmits":
                fam(
                    "mcp_retransmits",
                    "counter",
                    "Frames sent again, by reason (checksum: the receiver found them damaged)",
                ).samples.append(({**base, "reason": "checksum"}, float(value)))
                continue
            help = _TRANSPORT_HELP.get(key, f"Transport counter {key}")
            fam(f"mcp_{key}", "counter", help).samples.append((base, float(value)))
        for peer, rtt in sorted(g["rtt"].items()):
            labels = {**base, "peer": str(peer)}
            fam("mcp_peer_connected", "gauge", "1 when connected to the peer").samples.append(
                (labels, 0.0 if rtt is None else 1.0)
            )
            if rtt is not None:
                fam(
                    "mcp_peer_rtt_seconds", "gauge", "Smoothed QUIC round-trip time to the peer"
                ).samples.append((labels, float(rtt)))
        for peer, figures in sorted(g.get("path", {}).items()):
            labels = {**base, "peer": str(peer)}
            for key, help in _PATH_COUNTERS.items():
                fam(f"mcp_peer_{key}", "counter", help).samples.append(
                    (labels, float(figures[key]))
                )
            for key, (name, help) in _PATH_GAUGES.items():
                fam(name, "gauge", help).samples.append((labels, float(figures[key])))
        for key, value in sorted(g["chaos"].items()):
            fam(
                f"mcp_chaos_{key}", "counter", f"Fault injector: datagrams {key.replace('_', ' ')}"
            ).samples.append((base, float(value)))
        for op, c in g["ops"].items():
            fam("mcp_ops_started", "counter", "Operations started, by kind").samples.append(
                ({**base, "op": op}, float(c["started"]))
            )
            for result in ("ok", "failed"):
                fam("mcp_ops", "counter", "Operations finished, by kind and result").samples.append(
                    ({**base, "op": op, "result": result}, float(c[result]))
                )
    return list(fams.values())


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _number(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(int(v)) if v.is_integer() and abs(v) < 2**53 else repr(v)


def render(snap: dict[str, Any] | None = None) -> str:
    """A snapshot (default: a fresh one of every group) in the Prometheus text format."""
    snap = snapshot() if snap is None else snap
    lines: list[str] = []
    for f in _families(snap):
        lines.append(f"# HELP {f.sample_name} {f.help}")
        lines.append(f"# TYPE {f.sample_name} {f.kind}")
        for labels, value in f.samples:
            lab = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            lines.append(f"{f.sample_name}{{{lab}}} {_number(value)}")
    return "\n".join(lines) + "\n"


# ---- the exporter ----------------------------------------------------------------------------


class _Source:
    """What the exporter reports: one group (kept alive by the exporter) or all of them."""

    def __init__(self, group: Group | None) -> None:
        self.group = group

    def snapshot(self) -> dict[str, Any]:
        return snapshot(self.group)


def registry_dir() -> str:
    """Where the exporters of this user's processes on this host register their URL, for
    ``mcp-monitor`` to find them: ``MCP_METRICS_DIR``, else ``<tmp>/mcp-metrics-<uid>``."""
    return os.environ.get("MCP_METRICS_DIR") or os.path.join(
        tempfile.gettempdir(), f"mcp-metrics-{os.getuid()}"
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def discover_exporters(directory: str | None = None) -> list[str]:
    """The URLs of the exporters registered in ``directory`` (default :func:`registry_dir`)
    by processes still alive, in the order they started; entries of dead processes (killed
    before they could remove theirs) are removed."""
    d = directory or registry_dir()
    try:
        names = os.listdir(d)
    except OSError:
        return []
    found: list[tuple[float, str]] = []
    for name in names:
        if not name.endswith(".url"):
            continue
        path = os.path.join(d, name)
        try:
            pid = int(name.split("-", 1)[0])
            with open(path) as f:
                url = f.read().strip()
            started = os.stat(path).st_mtime
        except (OSError, ValueError):
            continue
        if not _alive(pid):
            with contextlib.suppress(OSError):
                os.unlink(path)
            continue
        found.append((started, url))
    return [u for _, u in sorted(found)]


def _register(host: str, port: int) -> str | None:
    """Leaves this exporter's URL in :func:`registry_dir`; the file's path, or None when
    the directory cannot be written (discovery is a convenience, never a failure)."""
    d = registry_dir()
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        path = os.path.join(d, f"{os.getpid()}-{port}.url")
        shown = f"[{host}]" if ":" in host else host
        with open(path + ".tmp", "w") as f:
            f.write(f"http://{shown}:{port}/metrics\n")
        os.replace(path + ".tmp", path)
        return path
    except OSError:
        return None


class _Exporter:
    def __init__(self, server: Any, thread: threading.Thread, host: str, port: int) -> None:
        self.server = server
        self.thread = thread
        self.host = host
        self.port = port
        self.registered: str | None = None

    def stop(self) -> None:
        if self.registered is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.registered)
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


_exporter: _Exporter | None = None
_exporter_lock = threading.Lock()


def _start_builtin(source: _Source, addr: str, port: int) -> tuple[Any, threading.Thread]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] not in ("/", "/metrics"):
                self.send_error(404, "try /metrics")
                return
            try:
                body = render(source.snapshot()).encode()
            except Exception as e:
                self.send_error(500, f"collecting metrics failed: {e}")
                return
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    class Server(http.server.ThreadingHTTPServer):
        daemon_threads = True

    server = Server((addr, port), Handler)
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="mcp-metrics", daemon=True
    )
    thread.start()
    return server, thread


def _start_prometheus_client(source: _Source, addr: str, port: int) -> tuple[Any, threading.Thread]:
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError as e:
        raise ImportError(
            f"prometheus_client is not installed ({e}): pip install 'mcp-fast[metrics]', "
            "or pass use_prometheus_client=None to fall back to the built-in server"
        ) from None
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

    class Collector:
        def collect(self) -> Iterator[Metric]:
            for f in _families(source.snapshot()):
                names = sorted({k for labels, _ in f.samples for k in labels})
                cls = CounterMetricFamily if f.kind == "counter" else GaugeMetricFamily
                m = cls(f.name, f.help, labels=names)
                for labels, value in f.samples:
                    m.add_metric([labels.get(k, "") for k in names], value)
                yield m

        def describe(self) -> Iterable[Metric]:
            return []

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())  # type: ignore[arg-type]
    return start_http_server(port, addr=addr, registry=registry)


def start_exporter(
    port: int = 0,
    addr: str = "127.0.0.1",
    group: Group | None = None,
    *,
    use_prometheus_client: bool | None = None,
) -> tuple[str, int]:
    """Serve the metrics of ``group`` (default: every open group, found at each scrape) at
    ``http://addr:port/metrics`` in the Prometheus text format, from a daemon thread.

    ``port=0`` picks a free port; the address actually bound is returned as ``(host, port)``.
    ``use_prometheus_client``: None uses it when installed, True requires it, False uses the
    built-in server. One exporter per process: call :func:`stop_exporter` before starting
    another. Raises ``OSError`` when the address cannot be bound.
    """
    global _exporter
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535, got {port}")
    if use_prometheus_client is None:
        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            use_prometheus_client = False
        else:
            use_prometheus_client = True
    source = _Source(group)
    with _exporter_lock:
        if _exporter is not None:
            raise RuntimeError(
                f"a metrics exporter already runs at http://{_exporter.host}:{_exporter.port}"
                "/metrics; call stop_exporter() first"
            )
        start = _start_prometheus_client if use_prometheus_client else _start_builtin
        server, thread = start(source, addr, port)
        host, bound = server.server_address[:2]
        _exporter = _Exporter(server, thread, str(host), int(bound))
        _exporter.registered = _register(_exporter.host, _exporter.port)
        return _exporter.host, _exporter.port


def stop_exporter() -> None:
    """Stop the exporter started by :func:`start_exporter` (nothing if none runs)."""
    global _exporter
    with _exporter_lock:
        e, _exporter = _exporter, None
    if e is not None:
        with contextlib.suppress(OSError):
            e.stop()


@atexit.register
def _unregister_at_exit() -> None:
    e = _exporter
    if e is not None and e.registered is not None:
        with contextlib.suppress(OSError):
            os.unlink(e.registered)
