"""Elastic membership: members die (kill -9), freeze (SIGSTOP), arrive and heal, the
coordinator restarts; the survivors keep training, with identical state after every
committed step. Real processes on 127.0.0.1 (see ``_elastic.py``), and the bad inputs
in-process."""

from __future__ import annotations

import json
import os as _os
import random
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import _netns
import mcp_fast as mcp
from _elastic import SECRET, ElasticRun, assert_consistent
from mcp_fast.elastic import ElasticJob, serve_coordinator

STEPS = 400


def _kill(run: ElasticRun, name: str) -> None:
    run.members[name].kill()
    run.members[name].wait(timeout=10)


def test_killing_rank0_a_middle_and_the_last_rank_and_a_newcomer_joining(tmp_path):
    rng = random.Random()
    with ElasticRun(tmp_path, STEPS) as run:
        for i in range(4):
            run.spawn(f"m{i}")
        run.wait_epoch(4)
        time.sleep(rng.uniform(0.2, 1.0))
        e, ranks = run.by_rank()
        _kill(run, ranks[0])  # rank 0, at a random moment
        run.wait_epoch(3, after=e)
        time.sleep(rng.uniform(0.0, 0.5))
        e, ranks = run.by_rank()
        _kill(run, ranks[1])  # a middle rank
        run.wait_epoch(2, after=e)
        run.spawn("new")
        e = run.wait_epoch(3, after=e)
        time.sleep(rng.uniform(0.1, 0.6))
        e, ranks = run.by_rank()
        _kill(run, ranks[max(ranks)])  # the last rank (the newcomer, unless one was expelled)
        run.wait_epoch(2, after=e)
        results = run.finish([n for n, p in run.members.items() if p.returncode is None])
    assert len(results) == 2, list(results)
    assert_consistent(results, STEPS)


def test_two_members_dying_at_once_and_one_during_the_change(tmp_path):
    with ElasticRun(tmp_path, STEPS) as run:
        for i in range(5):
            run.spawn(f"m{i}")
        e = run.wait_epoch(5)
        time.sleep(0.5)
        run.members["m1"].kill()
        run.members["m2"].kill()
        time.sleep(0.25)  # the coordinator is deciding that they are dead
        run.members["m4"].kill()
        results = run.finish(["m0", "m3"])
    assert_consistent(results, STEPS)
    assert any(n == 2 for _, ep, n in run.coordinator.epochs() if ep > e), run.said()


def test_a_frozen_member_is_expelled_and_rejoins_as_a_newcomer(tmp_path):
    with ElasticRun(tmp_path, STEPS) as run:
        for i in range(3):
            run.spawn(f"m{i}")
        e = run.wait_epoch(3)
        time.sleep(0.5)
        run.members["m1"].send_signal(signal.SIGSTOP)
        e = run.wait_epoch(2, after=e)
        time.sleep(0.5)
        run.members["m1"].send_signal(signal.SIGCONT)
        run.wait_epoch(3, after=e)
        results = run.finish(["m0", "m1", "m2"])
    assert_consistent(results, STEPS)
    roles = [c["role"] for c in results["m1"]["changes"]]
    assert "taker" in roles[1:], results["m1"]["changes"]


def test_a_newcomer_killed_while_it_heals_leaves_the_group_as_it_was(tmp_path):
    with ElasticRun(tmp_path, STEPS, step_sleep=0.03) as run:
        for i in range(2):
            run.spawn(f"m{i}")
        e = run.wait_epoch(2)
        # A slow link makes the newcomer's heal (about 0.8 MB) last about half a second.
        run.spawn("victim", env={"MCP_CHAOS": "rate=12mbit,seed=3"})
        e = run.wait_epoch(3, after=e)
        time.sleep(0.15)
        _kill(run, "victim")
        run.wait_epoch(2, after=e)
        results = run.finish(["m0", "m1"])
    assert_consistent(results, STEPS)


def test_training_goes_on_while_the_coordinator_is_down_and_a_restarted_one_admits(tmp_path):
    with ElasticRun(tmp_path, STEPS, step_sleep=0.03) as run:
        for i in range(3):
            run.spawn(f"m{i}")
        e = run.wait_epoch(3)
        time.sleep(0.5)
        run.coordinator.stop()
        down = time.time()
        time.sleep(2.0)
        up = time.time()
        c = run.start_coordinator()
        run.spawn("new")
        run.wait_epoch(4, after=e)
        results = run.finish(["m0", "m1", "m2", "new"])
    assert_consistent(results, STEPS)
    # Steps were committed while no coordinator ran (every member's commit timeline).
    while_down = [
        float(t)
        for f in tmp_path.glob("m*.timeline")
        for _, _, t in (line.split() for line in f.read_text().splitlines())
        if down + 0.2 < float(t) < up
    ]
    assert len(while_down) > 10, (len(while_down), up - down)
    assert any(ep > e for _, ep, _ in c.epochs()), c.lines


def test_a_member_killed_under_20_percent_loss(tmp_path):
    with ElasticRun(tmp_path, 250, env={"MCP_CHAOS": "loss=0.2,seed=11"}) as run:
        for i in range(3):
            run.spawn(f"m{i}")
        e = run.wait_epoch(3)
        time.sleep(0.7)
        _kill(run, "m2")
        run.wait_epoch(2, after=e)
        results = run.finish(["m0", "m1"])
    assert_consistent(results, 250)


# -- bad input, in-process --------------------------------------------------------------


def _numpy_job(addr: str, state: dict[str, np.ndarray], **kw) -> ElasticJob:
    def save() -> bytes:
        return state["w"].tobytes()

    def load(b: bytes) -> None:
        state["w"][:] = np.frombuffer(b, dtype=state["w"].dtype)

    return ElasticJob(addr, save=save, load=load, spec=f"w:f32{list(state['w'].shape)}", **kw)


def test_in_process_members_heal_and_average():
    c = serve_coordinator("127.0.0.1:0", SECRET, min_members=2)
    out: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def member(i: int) -> None:
        try:
            state = {"w": np.full(8, float(i), dtype=np.float32)}
            with _numpy_job(c.local_addr, state, secret=SECRET) as job:
                while job.step < 5:
                    g = job.begin()
                    grad = np.full(8, float(g.rank + 1), dtype=np.float32)
                    g.all_reduce(grad, op="avg")
                    state["w"] -= grad
                    job.commit()
                out[i] = state["w"].copy()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=member, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    c.close()
    assert not errors, errors
    # Both start from rank 0's state (healed), then subtract the mean of 1 and 2 five times.
    assert np.array_equal(out[0], out[1])
    assert np.all(out[0] == out[0][0])
    assert out[0][0] in (0 - 7.5, 1 - 7.5)


def test_a_different_model_is_refused_at_admission_naming_both():
    c = serve_coordinator("127.0.0.1:0", SECRET)
    try:
        a = _numpy_job(c.local_addr, {"w": np.zeros(8, np.float32)}, secret=SECRET)
        with pytest.raises(mcp.SpecMismatchError) as ei:
            _numpy_job(c.local_addr, {"w": np.zeros(9, np.float32)}, secret=SECRET)
        assert "w:f32[8]" in str(ei.value) and "w:f32[9]" in str(ei.value)
        a.close()
    finally:
        c.close()


def test_a_member_declaring_another_model_spec_is_refused_at_admission():
    c = serve_coordinator("127.0.0.1:0", SECRET)
    state = {"w": np.zeros(8, np.float32)}
    try:
        gpt = {"arch": "GPT-3", "precision": "bfloat16"}
        a = _numpy_job(c.local_addr, state, secret=SECRET, model_spec=gpt)
        llama = {"arch": "Llama-2", "precision": "bfloat16"}
        with pytest.raises(mcp.SpecMismatchError) as ei:
            _numpy_job(c.local_addr, state, secret=SECRET, model_spec=llama)
        assert "GPT-3" in str(ei.value) and "Llama-2" in str(ei.value), ei.value
        # The same declaration in another key order is the same model: admitted.
        same = {"precision": "bfloat16", "arch": "GPT-3"}
        _numpy_job(c.local_addr, state, secret=SECRET, model_spec=same).close()
        a.close()
    finally:
        c.close()


def test_another_job_secret_is_refused_at_the_handshake():
    c = serve_coordinator("127.0.0.1:0", SECRET)
    try:
        with pytest.raises(mcp.AuthenticationError):
            _numpy_job(c.local_addr, {"w": np.zeros(2, np.float32)}, secret="not-it", timeout=5)
        # The coordinator counts the refusal once its side of the handshake ends.
        end = time.monotonic() + 10
        while c.stats()["refused_handshakes"] < 1 and time.monotonic() < end:
            time.sleep(0.02)
        assert c.stats()["refused_handshakes"] >= 1
    finally:
        c.close()


def test_a_member_of_another_protocol_version_fails_at_once_instead_of_retrying():
    c = serve_coordinator("127.0.0.1:0", SECRET, min_members=2)
    errors: list[BaseException] = []
    took: list[float] = []

    def member(major: int | None) -> None:
        t0 = time.monotonic()
        job = _numpy_job(c.local_addr, {"w": np.zeros(4, np.float32)}, secret=SECRET, timeout=20)
        if major is not None:  # this member's peer groups speak MCP <major>.x
            kw = job._settings.core_kwargs  # (Settings is frozen: set on this one instance)
            object.__setattr__(
                job._settings, "core_kwargs", lambda: {**kw(), "protocol_major": major}
            )
        try:
            job.begin()
        except BaseException as e:  # collected and asserted below
            errors.append(e)
            took.append(time.monotonic() - t0)
        finally:
            job.close()

    threads = [threading.Thread(target=member, args=(m,)) for m in (None, 2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        c.close()
    mismatches = [e for e in errors if isinstance(e, mcp.VersionMismatchError)]
    assert mismatches, errors
    # Raised at the first refused handshake (2 s here, most of it forming the epoch), not
    # after the 20 s join timeout that another attempt would end in.
    assert min(took) < 15, took
    assert "speaks MCP 2." in str(mismatches[0]) or "peer speaks MCP 2." in str(mismatches[0])


def test_missing_settings_are_named():
    with pytest.raises(ValueError, match="coordinator"):
        _numpy_job("", {"w": np.zeros(2, np.float32)}, secret=SECRET)
    with pytest.raises(ValueError, match="secret"):
        serve_coordinator("127.0.0.1:0", "")
    with pytest.raises(ValueError, match="HOST:PORT"):
        serve_coordinator("nowhere", SECRET)
    with pytest.raises(ValueError, match="dead_after"):
        serve_coordinator("127.0.0.1:0", SECRET, dead_after=-1)


def test_an_unreachable_coordinator_times_out_with_a_clear_error():
    with pytest.raises(mcp.MCPTimeoutError, match="coordinator"):
        _numpy_job(
            "127.0.0.1:9", {"w": np.zeros(2, np.float32)}, secret=SECRET, connect_timeout=1.0
        )


# -- two hosts, one torchrun each -------------------------------------------------------


def _worker_pid(ns: str) -> int | None:
    """The training worker (not torchrun itself) running in namespace ``ns``."""
    import subprocess

    pids = subprocess.run(
        ["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30
    ).stdout.split()
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"train_elastic.py") for a in argv[1:3]) and b"torchrun" not in argv[0]:
            if not any(b"torch.distributed.run" in a or b"torchrun" in a for a in argv[:3]):
                return int(pid)
    return None


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.skipif(not _netns.available(), reason="needs root and iproute2 for namespaces")
def test_a_worker_killed_on_one_host_is_restarted_by_torchrun_and_heals(tmp_path):
    import subprocess
    import sys

    from _elastic import TRAIN, Coordinator
    from _launch import free_port

    steps = 300
    env = {**_os.environ, "MCP_SECRET": SECRET, "OMP_NUM_THREADS": "1"}
    port = free_port()
    with _netns.VethPair(tag="el") as net:
        coord = net.popen(
            0,
            [sys.executable, "-m", "mcp_fast.cli.coordinator", "--bind", f"{net.addr[0]}:{port}"],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        first = coord.stdout.readline()
        assert first.startswith("listening on"), first
        c = Coordinator(coord, first.split()[-1])

        def read() -> None:
            for line in coord.stdout:
                c.lines.append((time.monotonic(), line.strip()))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        hosts = []
        for i in range(2):
            log = open(tmp_path / f"host{i}.log", "wb")
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=1",
                "--max-restarts=3",
                str(TRAIN),
                "--join",
                f"{net.addr[0]}:{port}",
                "--steps",
                str(steps),
                "--step-sleep",
                "0.03",
                "--corpus-bytes",
                "300000",
                "--quiet",
                "--json",
                str(tmp_path / f"host{i}.json"),
            ]
            hosts.append(net.popen(i, cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
            log.close()

        def epoch_with(n: int, after: int) -> int:
            end = time.monotonic() + 120
            while time.monotonic() < end:
                for _, e, m in c.epochs():
                    if e > after and m == n:
                        return e
                time.sleep(0.05)
            raise AssertionError(f"no epoch > {after} with {n} members: {c.lines}")

        e = epoch_with(2, 0)
        time.sleep(1.0)
        victim = _worker_pid(net.ns[1])
        assert victim is not None
        _os.kill(victim, signal.SIGKILL)
        e = epoch_with(1, e)
        epoch_with(2, e)  # torchrun restarted it; it rejoined and healed
        codes = [h.wait(timeout=180) for h in hosts]
        coord.kill()
        coord.wait()
        reader.join(10)
        coord.stdout.close()
        problems = net.close()
    logs = [(tmp_path / f"host{i}.log").read_text(errors="replace")[-3000:] for i in range(2)]
    assert codes == [0, 0], logs
    assert not problems, problems
    r = [json.loads((tmp_path / f"host{i}.json").read_text()) for i in range(2)]
    assert r[0]["sha3"] == r[1]["sha3"]
    assert r[0]["final_step"] == r[1]["final_step"] == steps
    assert r[1]["changes"][0]["role"] == "taker", r[1]["changes"]


def test_a_closed_coordinator_frees_its_port_for_a_restart():
    import socket

    c = serve_coordinator("127.0.0.1:0", SECRET)
    host, port = c.local_addr.rsplit(":", 1)
    c.close()
    # Both its sockets are free once close() returns: the QUIC port, and the tether
    # listener's (TCP, same port number).
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t:
        t.bind((host, int(port)))
    again = serve_coordinator(f"{host}:{port}", SECRET)
    again.close()
