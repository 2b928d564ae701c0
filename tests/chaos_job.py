"""A small real job for ``chaosmcp`` tests: ``python chaos_job.py WORLD ROUNDS`` runs
``workers.healed`` (all-reduces and broadcasts, every result checked exactly) on WORLD ranks
on 127.0.0.1; exit status 0 when every rank finished exact, 1 otherwise."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _launch import Failure, run


def main() -> int:
    world, rounds = int(sys.argv[1]), int(sys.argv[2])
    results = run("healed", world, rounds, timeout=150)
    failed = [r for r in results if isinstance(r, Failure)]
    for f in failed:
        print(f"rank failed: {f.type}: {f.message}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
