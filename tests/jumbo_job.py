"""One rank of the jumbo-frame test: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the
environment, on a 9,000-byte link, with ``mtu`` 8,972 in the transport config when argv[2]
is "set" or left to MTU discovery; all-reduces from a few KiB to 4 MiB, bit-exact against
numpy; writes its results as JSON to argv[1]."""

from __future__ import annotations

import json
import sys
import time

import numpy as np

import mcp_fast as mcp


def main() -> None:
    config = {"mtu": 8972} if sys.argv[2] == "set" else None
    with mcp.init(timeout=30, config=config) as g:
        rank, world = g.rank, g.world_size
        # Discovery probes a few round trips after the handshake: give it a bounded while,
        # every rank deciding alike (from all-reduced flags) when to stop waiting.
        deadline = time.monotonic() + 20
        for _ in range(2_000):
            reached = np.array([all(p.get("mtu") == 8972 for p in g.health())], np.int32)
            expired = np.array([time.monotonic() > deadline], np.int32)
            g.all_reduce(reached, op="min")
            g.all_reduce(expired, op="max")
            if reached[0] or expired[0]:
                break
            time.sleep(0.01)
        ok = {}
        for n in [1_000, 16_000, 260_001, 1 << 20]:  # float32: 4 KB to 4 MiB
            a = np.arange(n, dtype=np.float32) * (rank + 1)
            g.all_reduce(a)
            want = np.arange(n, dtype=np.float32) * sum(range(1, world + 1))
            ok[str(n)] = bool(np.array_equal(a, want))
        out = {"rank": rank, "ok": ok, "mtu": [p.get("mtu") for p in g.health()]}
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
