"""The side-by-side table of ``make demo`` (examples/demo_compare.py), without training."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location(
    "demo_compare", Path(__file__).resolve().parent.parent / "examples" / "demo_compare.py"
)
assert SPEC is not None and SPEC.loader is not None
demo = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(demo)


def result(done: int, rc: int, cut: bool, seconds: float | None = 12.5) -> dict:
    rows = [
        {"epoch": e + 1, "loss": 1.0 / (e + 1), "accuracy": 0.5 + 0.05 * e} for e in range(done)
    ]
    return {"rows": rows, "seconds": seconds, "rc": rc, "wall": 30.0, "cut": cut, "limit": 90.0,
            "done": done}  # fmt: skip


def test_a_finished_run_shows_its_training_time_loss_and_accuracy() -> None:
    assert demo.row("mcp", result(8, 0, False), 8) == [
        "mcp", "12.5 s", "8/8", "0.1250", "0.850", "30 s"
    ]  # fmt: skip


def test_a_run_cut_off_says_so_and_how_far_it_got() -> None:
    cells = demo.row("gloo", result(3, 124, True), 8)
    assert cells[1] == "cut off after 90 s" and cells[2] == "3/8" and cells[3] == "0.3333"


def test_a_failed_run_with_nothing_done() -> None:
    assert demo.row("gloo", result(0, 1, False, None), 8)[1:5] == [
        "failed (exit 1)",
        "0/8",
        "-",
        "-",
    ]
