"""One rank of the jumbo-frame test: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the
environment, ``mtu`` 8,972 in the transport config (a 9,000-byte link); all-reduces from a
few KiB to 4 MiB, bit-exact against numpy; writes its results as JSON to argv[1]."""

from __future__ import annotations

import json
import sys

import numpy as np

import mcp_fast as mcp


def main() -> None:
    with mcp.init(timeout=30, config={"mtu": 8972}) as g:
        rank, world = g.rank, g.world_size
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
