"""Two "hosts" (network namespaces joined by a veth pair), torchrun on each, DDP over "mcp".

Each namespace has only ``lo`` and one veth end with a private address, so every byte between
the two nodes crosses the veth pair with its 1500-byte MTU, not the 64 KiB loopback: rank 0
listens on node 0's address (``MASTER_ADDR``, as torchrun sets it) and ranks 2 and 3 reach it
from the other namespace.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

import _netns

TRAIN = Path(__file__).with_name("multihost_train.py")
DEADLINE_S = 90.0
RDZV_PORT = 29400  # the namespaces are fresh: nothing else can hold it


def _torchrun(net: _netns.VethPair, node: int, out: Path, run_id: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={net.addr[0]}:{RDZV_PORT}",
        f"--rdzv-id={run_id}",
        # The hostname resolves to 127.0.0.1 in both namespaces, so torchrun cannot tell by
        # itself which node hosts the rendezvous store nor which address is its own.
        f"--rdzv-conf=is_host={int(node == 0)},join_timeout=40",
        f"--local-addr={net.addr[node]}",
        "--max-restarts=0",
        str(TRAIN),
        "--out",
        str(out),
        "--steps",
        "8",
    ]


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.skipif(not _netns.available(), reason="needs root and iproute2 (ip netns)")
def test_ddp_across_two_namespaces_ends_with_identical_parameters(tmp_path: Path) -> None:
    out = tmp_path / "params"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MCP_TIMEOUT": "30"}
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    run_id = f"mh{os.getpid()}"
    with _netns.VethPair() as net:
        logs = [tmp_path / f"node{i}.log" for i in range(2)]
        procs = []
        for i in range(2):
            with open(logs[i], "wb") as log:
                cmd = _torchrun(net, i, out, run_id)
                procs.append(net.popen(i, cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        codes = _netns.wait_all(procs, DEADLINE_S)
        problems = net.close()

    def tail(i: int) -> str:
        return logs[i].read_text(errors="replace")[-3000:]

    for i, rc in enumerate(codes):
        assert rc == 0, (
            f"torchrun on node {i} ended with {rc} (None: still running after "
            f"{DEADLINE_S} s, killed)\n{tail(i)}"
        )
    assert not problems, problems

    infos = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    hosts = [info["mcp_addr"].rsplit(":", 1)[0] for info in infos]
    for info, host in zip(infos, hosts, strict=True):
        assert info["world"] == 4, info
        assert info["bytes_sent"] > 0, info
        # Every rank listened on its own node's veth address, never on loopback.
        assert host in net.addr, info
    by_node = {info["group_rank"]: set() for info in infos}
    for info, host in zip(infos, hosts, strict=True):
        by_node[info["group_rank"]].add(host)
    # Two ranks per node, the nodes in different namespaces, each node on one address.
    assert sorted(by_node) == [0, 1], infos
    assert all(len(h) == 1 for h in by_node.values()), by_node
    assert by_node[0] != by_node[1], by_node
    # Rank 0 bound the MASTER_ADDR torchrun gave every rank: the ranks of the other node
    # reached it across the veth pair.
    assert all(info["master_addr"] == hosts[0] for info in infos), infos
    params = [(out / f"rank{r}.bin").read_bytes() for r in range(4)]
    assert len(params[0]) > 0
    for r in range(1, 4):
        assert params[r] == params[0], f"rank {r}'s parameters differ from rank 0's"


@pytest.mark.netns
@pytest.mark.skipif(not _netns.available(), reason="needs root and iproute2 (ip netns)")
@pytest.mark.parametrize("mtu", ["set", "discovered"])
def test_jumbo_frames(mtu: str, tmp_path: Path) -> None:
    # A 9,000-byte link, with mtu 8,972 in the transport config or without: discovery climbs
    # to it because the interface has jumbo frames (it stopped at quinn's 1,452 before).
    # quinn's segmentation-offload batches of such datagrams must fit one sendmsg (64 KiB).
    # They did not (10 x 8,972), the kernel refused each full batch, quinn counted it as
    # sent, and a 1 MiB all-reduce stalled until its timeout.
    job = Path(__file__).with_name("jumbo_job.py")
    with _netns.VethPair("jb") as net:
        for ns, dev in zip(net.ns, net.dev, strict=True):
            subprocess.run(
                ["ip", "-n", ns, "link", "set", dev, "mtu", "9000"], check=True, timeout=10
            )
        procs = []
        for rank in range(2):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": net.addr[0],
                "MASTER_PORT": "29412",  # the namespaces are fresh: nothing else can hold it
                "MCP_SECRET": "jumbo-test",
                "OMP_NUM_THREADS": "1",
            }
            cmd = [sys.executable, str(job), str(tmp_path / f"rank{rank}.json"), mtu]
            with open(tmp_path / f"rank{rank}.log", "wb") as log:
                procs.append(net.popen(rank, cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        codes = _netns.wait_all(procs, DEADLINE_S)
        problems = net.close()
    for rank, rc in enumerate(codes):
        log = (tmp_path / f"rank{rank}.log").read_text(errors="replace")[-3000:]
        assert rc == 0, f"rank {rank} ended with {rc}\n{log}"
    assert not problems, problems
    for rank in range(2):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert all(out["ok"].values()), out
        assert out["mtu"] == [8972], out  # the jumbo datagrams were in use
