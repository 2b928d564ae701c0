"""``mcp-monitor``: a live per-peer table from the metrics exporters of running ranks.

::

    mcp-monitor --latency [--url http://127.0.0.1:PORT/metrics ...] [--interval 1] [--count N]

Each rank serves its metrics with ``mcp_fast.metrics.start_exporter()``, which also registers
its URL in a per-user directory of this host (``MCP_METRICS_DIR``, default
``<tmp>/mcp-metrics-<uid>``). mcp-monitor scrapes every ``--url`` (``HOST:PORT`` is short for
``http://HOST:PORT/metrics``); without one, the URLs of ``MCP_METRICS_URLS`` (separated by
commas or spaces: ranks on other machines), else every live exporter registered on this host.
It scrapes them once, then every ``--interval`` seconds prints one row per (rank, peer): the
smoothed QUIC round-trip time and its p50 and p99 over the tables so far (the latency view),
QUIC's own packet loss to the peer since the first scrape (LOSS%: what a real lossy link
shows, with or without a fault injector),
the rank's send and receive rates (MB/s, over all its peers: the core counts bytes per
process, not per peer), its errors (corrupt frames + refused handshakes + failed operations,
since the first scrape) and, with a fault injector, its dropped datagrams. ``--count N``
stops after N tables; without it, mcp-monitor runs until Ctrl-C.

Exit status: 0 after ``--count`` tables, 2 when an endpoint cannot be reached at the first
scrape or the arguments are bad, 130 on Ctrl-C. An endpoint that stops answering later is
shown as DOWN.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["EndpointError", "main", "parse_text", "scrape"]

Labels = tuple[tuple[str, str], ...]

_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$"
)
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


class EndpointError(Exception):
    """An exporter could not be scraped; the message names the URL and the reason."""


def parse_text(text: str) -> dict[tuple[str, Labels], float]:
    """Samples of a Prometheus text exposition: ``{(name, sorted labels): value}``."""
    out: dict[tuple[str, Labels], float] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise ValueError(f"line {lineno} is not a Prometheus sample: {raw!r}")
        labels: list[tuple[str, str]] = []
        body = m.group("labels") or ""
        pos = 0
        while pos < len(body):
            lm = _LABEL.match(body, pos)
            if lm is None:
                raise ValueError(f"line {lineno}: bad labels {body!r}")
            value = re.sub(r"\\.", lambda e: _UNESCAPE.get(e.group(0), e.group(0)), lm.group(2))
            labels.append((lm.group(1), value))
            pos = lm.end()
        try:
            v = float(m.group("value"))
        except ValueError:
            raise ValueError(f"line {lineno}: bad value {m.group('value')!r}") from None
        out[(m.group("name"), tuple(sorted(labels)))] = v
    return out


def normalize_url(text: str) -> str:
    """``HOST:PORT`` → ``http://HOST:PORT/metrics``; a URL without a path gets ``/metrics``."""
    url = text if "://" in text else f"http://{text}"
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"not an http URL: {text!r}")
    if url.split("://", 1)[1].find("/") < 0:
        url += "/metrics"
    return url


def scrape(url: str, timeout: float) -> dict[tuple[str, Labels], float]:
    """Fetch and parse one exporter; :class:`EndpointError` if that fails."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            text = r.read().decode("utf-8")
    except urllib.error.HTTPError as e:
        e.close()
        raise EndpointError(f"{url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise EndpointError(f"cannot reach {url}: {reason}") from None
    try:
        return parse_text(text)
    except ValueError as e:
        raise EndpointError(f"{url}: not Prometheus text ({e})") from None


@dataclass
class _Scrape:
    t: float
    samples: dict[tuple[str, Labels], float] | None  # None: the endpoint is down


def _rank_keys(samples: dict[tuple[str, Labels], float]) -> list[Labels]:
    """The (rank[, group]) label sets present, from mcp_world_size."""
    return sorted(
        (labels for (name, labels) in samples if name == "mcp_world_size"),
        key=lambda ls: tuple((k, int(v) if v.isdigit() else v) for k, v in ls),
    )


def _get(samples: dict[tuple[str, Labels], float], name: str, base: Labels, **extra: str) -> float:
    labels = tuple(sorted((*base, *extra.items())))
    return samples.get((name, labels), math.nan)


def _sum(samples: dict[tuple[str, Labels], float], base: Labels, names: list[str]) -> float:
    return sum(v for n in names if not math.isnan(v := _get(samples, n, base)))


def _failed_ops(samples: dict[tuple[str, Labels], float], base: Labels) -> float:
    total = 0.0
    for (name, labels), v in samples.items():
        d = dict(labels)
        if name == "mcp_ops_total" and d.get("result") == "failed":
            rest = tuple(sorted((k, x) for k, x in labels if k not in ("op", "result")))
            if rest == base:
                total += v
    return total


_ERRORS = ["mcp_corrupt_frames_total", "mcp_refused_handshakes_total"]
_DROPS = ["mcp_chaos_send_dropped_total", "mcp_chaos_recv_dropped_total"]
_DROPS += ["mcp_chaos_rate_dropped_total"]


def _rate(cur: float, prev: float, dt: float) -> str:
    if math.isnan(cur) or math.isnan(prev) or dt <= 0 or cur < prev:
        return "-"
    return f"{(cur - prev) / dt / 1e6:.2f}"


def _loss(
    s: dict[tuple[str, Labels], float], fs: dict[tuple[str, Labels], float], base: Labels, peer: str
) -> str:
    """QUIC's own loss to ``peer`` since the first scrape: packets declared lost over packets
    sent, in percent (``-`` without path figures or without packets sent)."""
    sent = _get(s, "mcp_peer_sent_packets_total", base, peer=peer)
    lost = _get(s, "mcp_peer_lost_packets_total", base, peer=peer)
    sent0 = _get(fs, "mcp_peer_sent_packets_total", base, peer=peer)
    lost0 = _get(fs, "mcp_peer_lost_packets_total", base, peer=peer)
    if math.isnan(sent) or math.isnan(lost):
        return "-"
    if not (math.isnan(sent0) or math.isnan(lost0) or sent0 > sent or lost0 > lost):
        sent, lost = sent - sent0, lost - lost0  # else a new connection: its own counts
    return f"{100 * lost / sent:.2f}" if sent > 0 else "-"


#: RTT samples kept per (endpoint, rank, peer) for the percentiles.
HISTORY = 1000


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))]


def table(
    urls: list[str],
    first: dict[str, _Scrape],
    prev: dict[str, _Scrape],
    cur: dict[str, _Scrape],
    history: dict[tuple[str, str, int], list[float]] | None = None,
) -> list[str]:
    """The rows of one table (header first). ``history`` keeps each (endpoint, rank, peer)'s
    RTTs across tables, for the p50 and p99 columns (none: this table's sample alone)."""
    history = {} if history is None else history
    head = f"{'RANK':>5} {'PEER':>5} {'RTT_MS':>9} {'TX_MB/s':>9} {'RX_MB/s':>9} "
    head += f"{'ERRORS':>7} {'DROPS':>7} {'P50_MS':>9} {'P99_MS':>9} {'LOSS%':>7}  ENDPOINT"
    rows = [head]
    for url in urls:
        c, p, f = cur[url], prev[url], first[url]
        if c.samples is None:
            rows.append(f"{'?':>5} {'-':>5} {'DOWN':>9}{'':>35}  {url}")
            continue
        s, ps, fs = c.samples, p.samples or {}, f.samples or {}
        dt = c.t - p.t
        for base in _rank_keys(s):
            d = dict(base)
            rank = d["rank"] + (f"/g{d['group']}" if "group" in d else "")
            tx = _rate(
                _get(s, "mcp_bytes_sent_total", base), _get(ps, "mcp_bytes_sent_total", base), dt
            )
            rx = _rate(
                _get(s, "mcp_bytes_received_total", base),
                _get(ps, "mcp_bytes_received_total", base),
                dt,
            )
            errs = _sum(s, base, _ERRORS) + _failed_ops(s, base)
            errs -= _sum(fs, base, _ERRORS) + _failed_ops(fs, base)
            has_chaos = any((n, base) in s for n in _DROPS)
            drops = f"{_sum(s, base, _DROPS) - _sum(fs, base, _DROPS):.0f}" if has_chaos else "-"
            if _get(s, "mcp_group_open", base) == 0:
                rows.append(
                    f"{rank:>5} {'-':>5} {'CLOSED':>9} {'':>9} {'':>9} {'':>7} {'':>7} "
                    f"{'':>9} {'':>9} {'':>7}  {url}"
                )
                continue
            peers = sorted(
                int(dict(labels)["peer"])
                for (name, labels) in s
                if name == "mcp_peer_connected"
                and tuple(sorted((k, v) for k, v in labels if k != "peer")) == base
            )
            for peer in peers or [None]:
                p50 = p99 = loss = "-"
                if peer is not None:
                    loss = _loss(s, fs, base, str(peer))
                if peer is None:
                    rtt = "-"
                else:
                    v = _get(s, "mcp_peer_rtt_seconds", base, peer=str(peer))
                    rtt = "not conn." if math.isnan(v) else f"{v * 1e3:.3f}"
                    seen = history.setdefault((url, rank, peer), [])
                    if not math.isnan(v):
                        seen.append(v)
                        del seen[:-HISTORY]
                    if seen:
                        p50, p99 = f"{_pct(seen, 0.5) * 1e3:.3f}", f"{_pct(seen, 0.99) * 1e3:.3f}"
                rows.append(
                    f"{rank:>5} {'-' if peer is None else peer:>5} {rtt:>9} {tx:>9} {rx:>9} "
                    f"{errs:>7.0f} {drops:>7} {p50:>9} {p99:>9} {loss:>7}  {url}"
                )
    return rows


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < v <= 3600:
        raise argparse.ArgumentTypeError("must be in (0, 3600] seconds")
    return v


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mcp-monitor",
        description="Poll the metrics exporters of running ranks "
        "(mcp_fast.metrics.start_exporter) and print a live per-peer table: RTT, send and "
        "receive rates, errors, injected drops.",
        epilog="Example: mcp-monitor --latency --url 127.0.0.1:9400 --url 127.0.0.1:9401",
    )
    p.add_argument(
        "--latency",
        action="store_true",
        help="the per-peer latency table: RTT now, p50 and p99 so far (the default view)",
    )
    p.add_argument(
        "--url",
        action="append",
        default=[],
        metavar="URL",
        help="an exporter, http://HOST:PORT/metrics or HOST:PORT; repeat for several ranks "
        "(default: MCP_METRICS_URLS, else the exporters registered on this host)",
    )
    p.add_argument("--interval", type=_positive, default=1.0, help="seconds between tables (1)")
    p.add_argument("--count", type=_count, help="print this many tables, then exit (default: run)")
    p.add_argument(
        "--timeout", type=_positive, default=2.0, help="per-scrape HTTP timeout, seconds (2)"
    )
    return p


def _scrape_all(urls: list[str], timeout: float, strict: bool) -> dict[str, _Scrape]:
    out: dict[str, _Scrape] = {}
    for url in urls:
        t = time.monotonic()
        try:
            out[url] = _Scrape(t, scrape(url, timeout))
        except EndpointError:
            if strict:
                raise
            out[url] = _Scrape(t, None)
    return out


def endpoints(given: list[str]) -> list[str]:
    """The exporters to poll: ``given``, else ``MCP_METRICS_URLS``, else those registered on
    this host by live processes."""
    from mcp_fast.metrics import discover_exporters, registry_dir

    urls = given or re.split(r"[,\s]+", os.environ.get("MCP_METRICS_URLS", "").strip())
    urls = [u for u in urls if u] or discover_exporters()
    if not urls:
        raise ValueError(
            "no exporter to poll: none is registered in "
            f"{registry_dir()} (ranks serve and register one with "
            "mcp_fast.metrics.start_exporter()); pass --url http://HOST:PORT/metrics or set "
            "MCP_METRICS_URLS for ranks on other machines"
        )
    return list(dict.fromkeys(normalize_url(u) for u in urls))


def run(args: argparse.Namespace) -> int:
    urls = endpoints(args.url)
    history: dict[tuple[str, str, int], list[float]] = {}
    first = prev = _scrape_all(urls, args.timeout, strict=True)
    clear = sys.stdout.isatty()
    n = 0
    while args.count is None or n < args.count:
        time.sleep(args.interval)
        cur = _scrape_all(urls, args.timeout, strict=False)
        rows = table(urls, first, prev, cur, history)
        if clear:
            sys.stdout.write("\x1b[H\x1b[2J")
        print(f"mcp-monitor  {time.strftime('%H:%M:%S')}  {len(urls)} endpoint(s)")
        print("\n".join(rows))
        print(flush=True)
        # a DOWN endpoint keeps its last good scrape as the reference for rates
        prev = {u: (cur[u] if cur[u].samples is not None else prev[u]) for u in urls}
        n += 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (EndpointError, ValueError) as e:
        print(f"mcp-monitor: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mcp-monitor: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
