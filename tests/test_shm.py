"""The shared-memory path between ranks of one host: topology discovery, every collective
bit-exact over it (rings small enough to wrap many times), a mixed run of two network
namespaces with two ranks each, a local peer SIGKILLed mid-collective, no leaked segment,
and the fallback to QUIC when shared memory cannot be set up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import _netns
import mcp_fast as mcp
from _launch import free_port, ok, run
from _peer_reads import sibling_reads_allowed
from test_collectives import reduce_ref
from workers import DTYPES, OPS, data

SIZES = [1, 1000, 300_001]  # uneven; 300_001 float64 pass a 64 KiB ring ~37 times per frame
SMALL_RING = {"MCP_SHM_RING_BYTES": str(64 << 10)}


def _dev_shm() -> set[str]:
    """What is in /dev/shm, but the semaphores of multiprocessing's queues."""
    if not os.path.isdir("/dev/shm"):
        return set()
    return {n for n in os.listdir("/dev/shm") if not n.startswith("sem.mp-")}


def _check_collectives(results: list[dict], world: int, sizes: list[int]) -> None:
    for rank, out in enumerate(results):
        for algo in ["ring", "tree", "recursive_doubling", "direct"]:
            for dtype in DTYPES:
                for op in OPS:
                    if op == "avg" and not dtype.startswith("float"):
                        continue
                    for n in sizes:
                        want = reduce_ref([data(dtype, op, r, n) for r in range(world)], op)
                        got = out[f"all_reduce/{algo}/{dtype}/{op}/{n}"]
                        assert got.dtype == want.dtype
                        np.testing.assert_array_equal(got, want, f"{algo} {dtype} {op} {n}")
        for n in sizes:
            root = n % world
            want = data("int64", "sum", root, n, salt=root)
            np.testing.assert_array_equal(out[f"broadcast/{n}"], want)
            want = np.stack([data("float32", "sum", r, n, salt=3) for r in range(world)])
            np.testing.assert_array_equal(out[f"all_gather/{n}"], want)
            full = reduce_ref(
                [data("int32", "sum", r, n * world, salt=5) for r in range(world)], "sum"
            )
            np.testing.assert_array_equal(
                out[f"reduce_scatter/{n}"], full[rank * n : (rank + 1) * n]
            )
            want = data("float64", "sum", (rank - 1) % world, n, salt=9)
            np.testing.assert_array_equal(out[f"recv/{n}"], want)


@pytest.mark.parametrize("world", [2, 4])
def test_every_collective_over_shared_memory_is_bit_exact(world: int) -> None:
    shm_before = _dev_shm()
    results = ok(run("shm_workers.collectives", world, SIZES, None, timeout=240, env=SMALL_RING))
    _check_collectives(results, world, SIZES)
    for rank, out in enumerate(results):
        topo = out["topology"]
        assert topo["hosts"] == [list(range(world))], topo
        assert topo["host_of_rank"] == [0] * world
        assert (topo["host"], topo["local_rank"], topo["local_world_size"]) == (0, rank, world)
        assert len(set(topo["host_ids"])) == 1 and "/netns:" in topo["host_ids"][0]
        assert topo["shm_peers"] == [p for p in range(world) if p != rank]
        # Every data byte went through the rings: QUIC carried only the rendezvous.
        assert out["shm_stats"]["bytes_sent"] > 1 << 20
        assert out["stats"]["bytes_sent"] < 64 << 10, out["stats"]
        assert out["mappings"] > 0, "the rings are mapped from memfds"
        assert out["warnings"] == []
    assert _dev_shm() == shm_before, "nothing is ever created in /dev/shm"


@pytest.mark.parametrize("declines", [[], [1], [0, 2]], ids=["all-read", "one-declines", "two"])
def test_ranks_of_one_host_read_each_other_directly_unless_one_declines(declines: list) -> None:
    world = 3
    results = ok(run("shm_workers.direct_reads", world, declines, timeout=120))
    want_sum = reduce_ref([data("float32", "sum", r, 300_001) for r in range(world)], "sum")
    want_avg = reduce_ref([data("float64", "avg", r, 1 << 20) for r in range(world)], "avg")
    direct = not declines and sibling_reads_allowed()
    for out in results:
        np.testing.assert_array_equal(out["sum"], want_sum)
        np.testing.assert_array_equal(out["avg"], want_avg)
        if not direct:
            # Every rank fell back to the ring in the same operation: the data crossed the rings.
            assert out["ring_bytes"] > 8 << 20, out["ring_bytes"]
            assert out["direct"] == (0, 2), out["direct"]
        else:
            # Only the small frames that order the reads went through the rings.
            assert out["ring_bytes"] < 64 << 10, out["ring_bytes"]
            assert out["direct"] == (2, 0), out["direct"]


def test_host_ids_split_loopback_ranks_into_hosts() -> None:
    ids = ["fake-a", "fake-a", "fake-b", "fake-b"]
    results = ok(run("shm_workers.collectives", 4, [1, 70_003], ids, timeout=180))
    _check_collectives(results, 4, [1, 70_003])
    for rank, out in enumerate(results):
        topo = out["topology"]
        assert topo["hosts"] == [[0, 1], [2, 3]], topo
        assert topo["host_of_rank"] == [0, 0, 1, 1]
        assert topo["host_ids"] == ids
        assert (topo["host"], topo["local_rank"], topo["local_world_size"]) == (
            rank // 2,
            rank % 2,
            2,
        )
        assert topo["shm_peers"] == [rank ^ 1]
        assert out["stats"]["bytes_sent"] > 0  # the other "host" over QUIC


def test_shm_off_uses_quic_only() -> None:
    results = ok(run("shm_workers.collectives", 2, [1000], None, timeout=120, env={"MCP_SHM": "0"}))
    _check_collectives(results, 2, [1000])
    for out in results:
        assert out["topology"]["shm_peers"] == []
        assert out["topology"]["hosts"] == [[0, 1]]
        assert out["shm_stats"]["bytes_sent"] == 0
        assert out["mappings"] == 0 and out["warnings"] == []


def test_a_local_peer_killed_mid_collective_is_named_by_every_survivor() -> None:
    shm_before = _dev_shm()
    t0 = time.monotonic()
    results = run("shm_workers.killed_mid_collective", 3, 1, timeout=60)
    elapsed = time.monotonic() - t0
    assert results[1].type == "Died", results[1]
    for r in (0, 2):
        out = results[r]
        assert out["type"] == "PeerLostError", out
        assert out["rank"] == 1, out
        assert "rank 1" in out["message"]
        assert out["mappings_before"] > 0, out  # the rings, mapped from memfds
        # Released with the group: no mapping of ours is left in the survivor either.
        assert out["mappings_after"] == 0, out
    assert _dev_shm() == shm_before
    assert elapsed < 60


@pytest.mark.parametrize(
    ("fail", "where"),
    [({1: "memfd"}, "memfd_create"), ({0: "mmap"}, "mmap")],
    ids=["connector-memfd", "listener-mmap"],
)
def test_shared_memory_that_cannot_be_set_up_falls_back_to_quic(fail: dict, where: str) -> None:
    fail = {int(k): v for k, v in fail.items()}
    results = ok(run("shm_workers.with_failure", 2, fail, timeout=120))
    want = data("float32", "sum", 0, 300_001) + data("float32", "sum", 1, 300_001)
    for rank, out in enumerate(results):
        np.testing.assert_array_equal(out["sum"], want)
        assert out["topology"]["shm_peers"] == []
        assert out["shm_stats"]["bytes_sent"] == 0
        assert len(out["warnings"]) == 1, out["warnings"]
        assert f"rank {1 - rank}" in out["warnings"][0]
        assert "QUIC" in out["warnings"][0]
    failing = next(iter(fail))
    assert where in results[failing]["warnings"][0], results[failing]["warnings"]


@pytest.mark.parametrize(
    ("env", "what"),
    [({"MCP_SHM_RING_BYTES": "12"}, "MCP_SHM_RING_BYTES"), ({"MCP_HOST_ID": "a b"}, "MCP_HOST_ID")],
)
def test_bad_shared_memory_settings_are_refused(
    monkeypatch: pytest.MonkeyPatch, env: dict, what: str
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=what):
        mcp.init(rank=0, world_size=1, master_port=free_port(), connect_timeout=5)


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.skipif(not _netns.available(), reason="needs root and iproute2 (ip netns)")
def test_two_namespace_hosts_of_two_ranks_each(tmp_path: Path) -> None:
    job = Path(__file__).with_name("shm_netns_job.py")
    port = 29411  # the namespaces are fresh: nothing else can hold it
    with _netns.VethPair("shm") as net:
        procs = []
        for rank in range(4):
            node = rank // 2
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": "4",
                "MASTER_ADDR": net.addr[0],
                "MASTER_PORT": str(port),
                "MCP_SECRET": "shm-netns-test",
                "OMP_NUM_THREADS": "1",
                **SMALL_RING,
            }
            env.pop("MCP_HOST_ID", None)
            cmd = [sys.executable, str(job), str(tmp_path / f"rank{rank}.json")]
            with open(tmp_path / f"rank{rank}.log", "wb") as log:
                procs.append(net.popen(node, cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        codes = _netns.wait_all(procs, 90)
        problems = net.close()
    for rank, rc in enumerate(codes):
        log = (tmp_path / f"rank{rank}.log").read_text(errors="replace")[-3000:]
        assert rc == 0, f"rank {rank} ended with {rc}\n{log}"
    assert not problems, problems
    outs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for rank, out in enumerate(outs):
        assert all(out["ok"].values()), out["ok"]
        topo = out["topology"]
        assert topo["hosts"] == [[0, 1], [2, 3]], topo
        assert topo["host_ids"][0] == topo["host_ids"][1] != topo["host_ids"][2]
        assert topo["shm_peers"] == [rank ^ 1], topo
        assert out["shm_stats"]["bytes_sent"] > 0 and out["shm_stats"]["bytes_received"] > 0
