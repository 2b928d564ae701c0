"""The chaos soak, short: every collective finishes exact through loss bursts, duplicates,
reordering, jitter and damaged frames, on the stream lane and on the FEC lane."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benches" / "bench_soak.py"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lane", ["stream", "fec"])
def test_short_soak_heals_every_fault(lane: str, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(BENCH), "--ops", "150", "--lane", lane, "--json", str(out)]
    cmd += ["--deadline", "200"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["finished"] == res["attempted"] == 3 * 150, res
    assert res["wrong"] == 0 and res["failed"] == 0 and res["hung"] == 0, res
    assert res["faulted"] > 0 and res["healed"] == res["faulted"], res
    assert res["datagrams_dropped"] > 0, res
    if lane == "stream":
        assert res["retransmits"] > 0 and res["retransmits"] == res["corrupt_frames"], res
