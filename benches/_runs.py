"""Several fresh runs of a benchmark read as one: on 2 shared cores whole runs differ more
than the operations within one, so a figure is the median over runs, each run's kept."""

from __future__ import annotations

import statistics
from typing import Any


def median_of_runs(runs: list[list[dict[str, Any]]], key: str) -> list[dict[str, Any]]:
    """The runs' rows (the same ``key`` values, in the same order, in every run) as one:
    every other figure is the median over the runs, and with more than one run each run's
    figure is kept under ``runs``."""
    rows = []
    for i, first in enumerate(runs[0]):
        per = {k: [run[i][k] for run in runs] for k in first if k != key}
        row = {key: first[key], **{k: statistics.median(v) for k, v in per.items()}}
        if len(runs) > 1:
            row["runs"] = per
        rows.append(row)
    return rows
