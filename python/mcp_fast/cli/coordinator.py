"""``mcp-coordinator``: the membership coordinator of elastic jobs.

    MCP_SECRET=... mcp-coordinator --bind 0.0.0.0:29400 [--min-members 2]

It is not a training rank: it forms each epoch's member set, tells the members when one dies
(its process exited: the kernel closed its TCP tether to this port; or it was silent for
``--dead-after`` seconds) or newcomers wait, and holds nothing the job cannot rebuild:
restart it and the members tell it their epoch. It listens on UDP (QUIC) and TCP (tethers)
at the same port. Prints ``listening on HOST:PORT``
once it serves, then a line per epoch it forms.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from ..elastic import serve_coordinator


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mcp-coordinator", description=__doc__.split("\n\n")[0])
    p.add_argument("--bind", required=True, help="HOST:PORT to serve on (port 0 picks one)")
    p.add_argument("--secret", help="the job secret (default: MCP_SECRET)")
    p.add_argument("--min-members", type=int, default=1, help="no epoch with fewer (1)")
    p.add_argument(
        "--dead-after",
        type=float,
        default=0.3,
        help="seconds of silence after which a member is dead (0.3: three heartbeats of 0.1)",
    )
    p.add_argument(
        "--join-window",
        type=float,
        default=0.2,
        help="before the first epoch, seconds to wait after the last arrival (0.2)",
    )
    p.add_argument(
        "--change-limit",
        type=float,
        default=60.0,
        help="seconds a change waits for a live member that does not report (60)",
    )
    p.add_argument(
        "--rebuild-window",
        type=float,
        default=2.0,
        help="after a (re)start, seconds to wait for running members before a first epoch (2)",
    )
    a = p.parse_args(argv)
    try:
        c = serve_coordinator(
            a.bind,
            a.secret,
            min_members=a.min_members,
            dead_after=a.dead_after,
            join_window=a.join_window,
            change_limit=a.change_limit,
            rebuild_window=a.rebuild_window,
        )
    except (ValueError, OSError) as e:
        print(f"mcp-coordinator: {e}", file=sys.stderr)
        return 2
    print(f"listening on {c.local_addr}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    last = None
    while not stop.wait(0.1):
        epoch = c.epoch()
        if epoch is not None and epoch["epoch"] != last:
            last = epoch["epoch"]
            steps = sorted({s for _, s in epoch["members"]})
            print(f"epoch {last}: {epoch['world_size']} members, steps {steps}", flush=True)
    c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
