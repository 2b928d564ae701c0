"""One rank of the two-namespace shared-memory test: RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT from the environment; writes its results as JSON to argv[1]."""

from __future__ import annotations

import json
import sys

import numpy as np

import mcp_fast as mcp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from workers import data


def main() -> None:
    with mcp.init(timeout=60) as g:
        rank, world = g.rank, g.world_size
        ok = {}
        for dtype, op in [("float32", "sum"), ("int64", "max"), ("float64", "prod")]:
            for n in [1, 1001, 600_007]:
                a = data(dtype, op, rank, n)
                g.all_reduce(a, op=op)
                want = data(dtype, op, 0, n)
                for r in range(1, world):
                    b = data(dtype, op, r, n)
                    want = {
                        "sum": lambda x, y: (x + y).astype(x.dtype),
                        "max": np.maximum,
                        "prod": lambda x, y: (x * y).astype(x.dtype),
                    }[op](want, b)
                ok[f"{dtype}/{op}/{n}"] = bool(np.array_equal(a, want))
        out = {
            "rank": rank,
            "ok": ok,
            "topology": g.topology(),
            "shm_stats": g.shm_stats(),
            "bytes_sent": g.stats()["bytes_sent"],
        }
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
