"""A connection that breaks while its peer lives is re-established (the TLS session resumed,
0-RTT), and the operations in flight resume from what was acknowledged: bit-exact results,
no failure."""

from __future__ import annotations

import pytest

from _launch import Failure, ok, run


@pytest.fixture(autouse=True)
def _quic_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests exercise QUIC itself: ranks of this host stay off shared memory."""
    monkeypatch.setenv("MCP_SHM", "0")


@pytest.mark.parametrize("lane", ["stream", "fec"])
def test_connections_dropped_mid_operation_come_back_and_the_results_are_exact(
    lane: str,
) -> None:
    res = ok(run("reset_mid_run", 3, lane, True, timeout=120))
    # rank 1 dropped both its connections, twice: each of the four came back, counted by
    # the rank that dialled it again (rank 1 towards rank 0, rank 2 towards rank 1); the
    # rank that accepts may see the new connection before the end of the old one and count
    # none, so the count is summed over the ranks
    assert sum(r["reconnects"] for r in res) >= 4, res
    # rank 1 dials rank 0 again, rank 2 dials rank 1: resumed sessions, 0-RTT data taken
    assert res[1]["zero_rtt_accepted"] + res[2]["zero_rtt_accepted"] >= 4, res
    assert sum(r["zero_rtt_rejected"] for r in res) == 0, res


def test_without_zero_rtt_a_reconnection_makes_a_full_handshake() -> None:
    res = ok(run("reset_mid_run", 3, "stream", False, 1, timeout=120))
    assert res[1]["reconnects"] >= 2, res
    assert sum(r["zero_rtt_accepted"] + r["zero_rtt_rejected"] for r in res) == 0, res


def test_a_connection_timed_out_during_a_cut_is_dialled_again() -> None:
    res = run("idle_timeout_during_a_cut", 3, 1.5, timeout=120)
    bad = [r for r in res if isinstance(r, Failure)]
    assert not bad, bad
    assert res[1]["reconnects"] >= 2, res  # both of rank 1's connections timed out
