"""Functions that the multi-process tests run on every rank (see ``_launch.run``)."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import numpy as np

import mcp_fast as mcp

DTYPES = ["float32", "float64", "float16", "int32", "int64", "uint8"]
OPS = ["sum", "avg", "min", "max", "prod"]


def data(dtype: str, op: str, rank: int, n: int, salt: int = 0) -> np.ndarray:
    """Small integers (powers of two for prod) so that every order of reduction is exact."""
    i = np.arange(n, dtype=np.int64)
    h = (i * 31 + rank * 17 + salt * 7) % 9
    if op == "prod":
        vals = np.array([1.0, 2.0, 1.0, 0.5] if dtype.startswith("float") else [1, 2, 1, 1])
        return vals[h % 4].astype(dtype)
    if dtype == "uint8":
        return h.astype(dtype)
    return (h - 4).astype(dtype)


def all_reduce_sweep(
    g: mcp.Group, rank: int, algorithms: list[str], sizes: list[int]
) -> dict[str, Any]:
    """Every algorithm x dtype x op x size of all_reduce on ``data``, keyed by what it ran."""
    out: dict[str, Any] = {}
    for algo in algorithms:
        for dtype in DTYPES:
            for op in OPS:
                if op == "avg" and not dtype.startswith("float"):
                    continue
                for n in sizes:
                    a = data(dtype, op, rank, n)
                    g.all_reduce(a, op=op, algorithm=algo)
                    out[f"all_reduce/{algo}/{dtype}/{op}/{n}"] = a
    return out


def every_collective(rank: int, world: int, sizes: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with mcp.init(timeout=60) as g:
        assert (g.rank, g.world_size) == (rank, world)
        out.update(all_reduce_sweep(g, rank, ["auto", "ring", "tree", "recursive_doubling"], sizes))
        for root in range(world):
            for n in sizes:
                b = (
                    data("int64", "sum", rank, n, salt=root)
                    if rank == root
                    else np.zeros(n, "int64")
                )
                g.broadcast(b, src=root)
                out[f"broadcast/{root}/{n}"] = b
        for n in sizes:
            x = data("float32", "sum", rank, n, salt=3).reshape(n, 1)
            o = np.empty((world, n, 1), "float32")
            g.all_gather(o, x)
            out[f"all_gather/{n}"] = o
            for op in ["sum", "max"]:
                x = data("int32", op, rank, n * world, salt=5)
                keep = x.copy()
                o = np.empty(n, "int32")
                g.reduce_scatter(o, x, op=op)
                assert np.array_equal(x, keep), "reduce_scatter modified its input"
                out[f"reduce_scatter/{op}/{n}"] = o
        g.barrier()
        # send/recv around the ring, twice, with tags
        for tag in (0, 7):
            s = data("float64", "sum", rank, 1001, salt=tag)
            r = np.empty(1001, "float64")
            ws = g.send(s, dst=(rank + 1) % world, tag=tag, async_op=True)
            g.recv(r, src=(rank - 1) % world, tag=tag)
            ws.wait()
            out[f"recv/{tag}"] = r
        # async handles, several in flight
        a1 = data("float32", "sum", rank, 5000, salt=1)
        a2 = data("float32", "sum", rank, 5000, salt=2)
        w1 = g.all_reduce(a1, async_op=True)
        w2 = g.all_reduce(a2, op="max", async_op=True)
        assert w2.wait() and w1.wait()
        assert w1.is_completed() and w1.is_success() and w1.exception() is None
        out["async/1"], out["async/2"] = a1, a2
        # A synchronous call runs on the calling thread while an earlier asynchronous one is
        # still on the runtime: each keeps the order it was called in, on every rank.
        a3 = data("float32", "sum", rank, 300_001, salt=3)
        a4 = data("float32", "sum", rank, 1000, salt=4)
        w3 = g.all_reduce(a3, async_op=True)
        g.all_reduce(a4, op="max")
        g.barrier()
        assert w3.wait()
        out["async/3"], out["sync/4"] = a3, a4
    return out


def torch_tensors(rank: int, world: int) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    with mcp.init(timeout=60) as g:
        for dtype in [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]:
            t = torch.arange(1000, dtype=torch.int64).remainder(7).add(rank).to(dtype)
            g.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
            out[str(dtype)] = t.to(torch.float64).numpy()
        p = torch.full((3, 4), float(rank), dtype=torch.bfloat16)
        g.broadcast(p, src=world - 1)
        out["broadcast"] = p.float().numpy()
        big = torch.ones(1 << 20) * (rank + 1)
        g.all_reduce(big, op="avg")
        out["avg"] = float(big[12345])
    return out


def spec_mismatch(rank: int, world: int, odd: int) -> None:
    with mcp.init(timeout=30) as g:
        n = 12 if rank == odd else 10
        g.all_reduce(np.zeros(n, "float32"))


def wrong_dtype(rank: int, world: int) -> None:
    with mcp.init(timeout=30) as g:
        g.all_reduce(np.zeros(16, "float64" if rank == 0 else "int64"))


def idle_peer(rank: int, world: int, op_timeout: float) -> None:
    g = mcp.init(timeout=op_timeout)
    if rank == 1:
        time.sleep(op_timeout + 2)
    else:
        g.all_reduce(np.zeros(10, "float32"))
    g.close()


def join_only(rank: int, world: int, connect_timeout: float) -> None:
    mcp.init(connect_timeout=connect_timeout).close()


def join_with_secrets(rank: int, world: int, secrets: list[str], connect_timeout: float) -> None:
    mcp.init(secret=secrets[rank], connect_timeout=connect_timeout).close()


def join_with_versions(rank: int, world: int, majors: list[int], connect_timeout: float) -> None:
    mcp.init(secret="s", connect_timeout=connect_timeout, _protocol_major=majors[rank]).close()


def generated_secret(rank: int, world: int) -> float:
    os.environ.pop("MCP_SECRET", None)
    with mcp.init(timeout=30) as g:
        a = np.ones(1000, "float32")
        g.all_reduce(a)
        return float(a.sum())


def killed_peer(rank: int, world: int, victim: int, how: str = "kill") -> None:
    """The victim kills (or freezes) itself right after an all-reduce; a survivor's error
    carries ``detected_after``: seconds from the end of that all-reduce to the error, an
    upper bound of the detection time."""
    g = mcp.init(timeout=60, heartbeat=0.5)
    a = np.ones(1 << 16, "float32")
    g.all_reduce(a)  # everyone connected and working
    done = time.monotonic()
    if rank == victim:
        # Once a second all-reduce is done here, every rank has finished the first (each
        # one's contribution is in it): a survivor can only fail in the loop below, never in
        # the first all-reduce, whose last messages could otherwise die unsent with us.
        g.all_reduce(a)
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    try:
        for _ in range(1000):
            g.all_reduce(a)
    except mcp.PeerLostError as e:
        e.detected_after = time.monotonic() - done  # type: ignore[attr-defined]
        raise
    g.close()


def closed_group(rank: int, world: int) -> None:
    g = mcp.init(timeout=10)
    g.close()
    g.barrier()


def under_chaos(rank: int, world: int, spec: str) -> dict[str, Any]:
    """Collectives through a lossy, reordering socket: the results must be exact."""
    out: dict[str, Any] = {}
    with mcp.init(timeout=120, chaos=spec) as g:
        for n in (1000, 300_001):
            a = data("float32", "sum", rank, n)
            g.all_reduce(a)
            out[f"all_reduce/{n}"] = a
        b = data("int64", "sum", 0, 50_000) if rank == 0 else np.zeros(50_000, "int64")
        g.broadcast(b, src=0)
        out["broadcast"] = b
        out["stats"] = g.chaos_stats()
        out["quic"] = g.stats()
        out["health"] = g.health()
    return out


def corrupted(rank: int, world: int) -> None:
    with mcp.init(timeout=30, chaos="corrupt=1.0,seed=3") as g:
        g.all_reduce(np.ones(10_000, "float32"))


def cut_off(rank: int, world: int) -> None:
    g = mcp.init(timeout=60, heartbeat=0.5, chaos="loss=0,seed=1")
    a = np.ones(1000, "float32")
    g.all_reduce(a)
    if rank == 1:
        g.chaos_kill()  # this host vanishes from the network
        time.sleep(6)
        return
    try:
        g.all_reduce(a)
    except mcp.PeerLostError:
        (h,) = g.health()
        assert h["state"] == "lost" and h["rank"] == 1 and "no packets" in h["reason"], h
        raise


def coded_collectives(rank: int, world: int) -> dict[str, Any]:
    """all_reduce / all_gather / broadcast / send-recv with each codec."""
    out: dict[str, Any] = {}
    rng = np.random.default_rng(rank)
    with mcp.init(timeout=60) as g:
        for codec in ["fp16", "bf16", "int8", "lossless"]:
            a = rng.uniform(-1, 1, 100_003).astype("float32")
            out[f"in/{codec}"] = a.copy()
            g.all_reduce(a, codec=codec, block=128)
            out[f"all_reduce/{codec}"] = a
            gathered = np.empty((world, 1000), "float32")
            g.all_gather(gathered, out[f"in/{codec}"][:1000].copy(), codec=codec)
            out[f"all_gather/{codec}"] = gathered
        b = np.linspace(-3, 3, 4096, dtype="float32") if rank == 0 else np.zeros(4096, "float32")
        g.broadcast(b, src=0, codec="bf16")
        out["broadcast"] = b
    return out


def any_source(rank: int, world: int) -> list[tuple[int, float]]:
    """Rank 0 receives from whoever sends first; the last rank sends first."""
    got: list[tuple[int, float]] = []
    with mcp.init(timeout=30) as g:
        if rank == 0:
            for _ in range(world - 1):
                buf = np.zeros(1000, "float64")
                src = g.recv(buf)
                got.append((src, float(buf[0])))
        else:
            time.sleep(0.3 * (world - 1 - rank))
            g.send(np.full(1000, float(rank), "float64"), dst=0)
        g.barrier()
    return got


def auto_codec(rank: int, world: int) -> tuple[str, list[float]]:
    with mcp.init(timeout=60) as g:
        a = np.full(1 << 19, float(rank + 1), np.float32)
        g.all_reduce(a, codec="auto")
        return str(g._auto_codec), [float(a[0]), float(a[-1])]


def aborted(rank: int, world: int) -> float:
    """Rank 0 starts an all-reduce that rank 1 never joins, then aborts it."""
    g = mcp.init(timeout=60)
    if rank == 1:
        time.sleep(3)
        g.close()
        return 0.0
    w = g.all_reduce(np.ones(1000, "float32"), async_op=True)
    time.sleep(0.3)
    t0 = time.monotonic()
    g.abort()
    try:
        w.wait()
    except mcp.GroupClosedError:
        return time.monotonic() - t0
    raise AssertionError("the aborted operation did not fail")


def sigint_after(seconds: float) -> float:
    """Sends this process SIGINT (what Ctrl-C sends) after ``seconds``, with Python's own
    handler in place (a background job inherits SIGINT ignored); returns when it fires."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.daemon = True
    timer.start()
    return time.monotonic() + seconds


def seconds_to_interrupt(call: Any, what: str, after: float = 1.0) -> float:
    """Runs ``call``, which must block, with Ctrl-C sent ``after`` seconds in: how late
    after the signal the KeyboardInterrupt came."""
    fires = sigint_after(after)
    try:
        call()
    except KeyboardInterrupt:
        return time.monotonic() - fires
    raise AssertionError(f"{what} finished without the interrupt")


def refusal(call: Any, error: type[BaseException]) -> dict[str, str]:
    """What ``call`` raised on a group or worker closed by an interrupt (it must raise
    ``error``): its type name and message."""
    try:
        call()
    except error as e:
        return {"then": type(e).__name__, "message": str(e)}
    raise AssertionError("it still ran operations after the interrupt")


def check_interrupted(rank0: dict[str, Any], rank1: dict[str, Any]) -> None:
    """The assertions on ``interrupted``'s results (mcp's API or torch's): rank 0's
    KeyboardInterrupt came within 5 s of the signal (50 ms polls; 5 s is the bound under
    load), its group then refused calls naming the interrupt, and rank 1's receive failed
    naming rank 0 while rank 0 still lived."""
    assert rank0["late"] < 5.0, rank0
    assert rank0["then"] == "GroupClosedError", rank0
    assert "KeyboardInterrupt interrupted an operation" in rank0["message"], rank0
    assert rank0["told"], "rank 1 learnt nothing while rank 0 lived"
    assert rank1 == {"error": "PeerLostError", "rank": 0}, rank1


def wait_for_file(path: str, within_s: float) -> bool:
    """Whether ``path`` appears within ``within_s`` seconds."""
    until = time.monotonic() + within_s
    while time.monotonic() < until:
        if os.path.exists(path):
            return True
        time.sleep(0.05)
    return False


def interrupted(rank: int, world: int, how: str, flag: str) -> dict[str, Any]:
    """Ctrl-C on rank 0 during an all-reduce that rank 1 never joins (it waits in a receive
    from rank 0), called synchronously or waited on (``how``). Rank 0 reports how late the
    KeyboardInterrupt came, what a later call raises, and whether rank 1's receive failed
    while rank 0 still lived (rank 1 writes ``flag`` then): the abort, not the process's
    exit, told it."""
    g = mcp.init(timeout=120)
    if rank == 1:
        try:
            g.recv(np.zeros(4, "float32"), src=0)
        except mcp.PeerLostError as e:
            open(flag, "w").close()
            return {"error": "PeerLostError", "rank": e.rank}
        raise AssertionError("rank 0 sent nothing, yet the receive finished")
    a = np.ones(1 << 18, "float32")

    def all_reduce() -> None:
        if how == "sync":
            g.all_reduce(a)
        else:
            w = g.all_reduce(a, async_op=True)
            assert w is not None
            w.wait()

    late = seconds_to_interrupt(all_reduce, "the all-reduce without rank 1")
    then = refusal(g.barrier, mcp.GroupClosedError)
    return {"late": late, **then, "told": wait_for_file(flag, 60)}


def interrupted_rendezvous(rank: int, world: int) -> float:
    """Ctrl-C on rank 0 while it waits for a rank that never comes: how late it came."""
    return seconds_to_interrupt(
        lambda: mcp.init(world_size=2, timeout=120, connect_timeout=120),
        "the rendezvous without rank 1",
    )


def late_master(rank: int, world: int, delay: float) -> float:
    """Rank 0 starts `delay` seconds late: the others reach it through backoff."""
    t0 = time.monotonic()
    if rank == 0:
        time.sleep(delay)
    with mcp.init(timeout=60) as g:
        a = np.ones(10, "float32")
        g.all_reduce(a)
        assert a[0] == world
    return time.monotonic() - t0


def on_lane(rank: int, world: int, lane: str | None, spec: str | None) -> dict[str, Any]:
    """Collectives and send/recv on one lane, through a fault injector when ``spec`` is set."""
    out: dict[str, Any] = {}
    with mcp.init(timeout=120, chaos=spec, lane=lane) as g:
        out["lane"] = g.lane
        for n in (1000, 300_001):
            a = data("float32", "sum", rank, n)
            g.all_reduce(a)
            out[f"all_reduce/{n}"] = a
        b = data("int64", "sum", 0, 200_000) if rank == 0 else np.zeros(200_000, "int64")
        g.broadcast(b, src=0)
        out["broadcast"] = b
        if rank < 2:
            m = data("float64", "sum", rank, 70_000, salt=3)
            if rank == 0:
                g.send(m, dst=1)
            else:
                g.recv(m, src=0)
            out["p2p"] = m
        out["lane_stats"] = g.lane_stats()
        out["corrupt_frames"] = g.stats()["corrupt_frames"]
    return out


def auto_on_long_path(rank: int, world: int, spec: str, rounds: int) -> dict[str, Any]:
    """``rounds`` 1 MiB all-reduces on the auto lane through ``spec``; checks every result."""
    with mcp.init(timeout=120, chaos=spec, lane="auto") as g:
        n = 1 << 18
        for i in range(rounds):
            a = data("float32", "sum", rank, n, salt=i)
            g.all_reduce(a)
            want = sum(data("float32", "sum", r, n, salt=i) for r in range(world))
            np.testing.assert_array_equal(a, want)
        return {"lane_stats": g.lane_stats(), "corrupt_frames": g.stats()["corrupt_frames"]}


def healed(rank: int, world: int, rounds: int) -> dict[str, Any]:
    """All-reduces of mixed sizes and broadcasts through the faults of ``MCP_CHAOS`` on the lane
    of ``MCP_LANE``; every result is checked here, exactly."""
    with mcp.init(timeout=120, heartbeat=10) as g:
        for i in range(rounds):
            n = (1000, 65_537, 300_001)[i % 3]
            a = data("float32", "sum", rank, n, salt=i)
            g.all_reduce(a)
            want = sum(data("float32", "sum", r, n, salt=i) for r in range(world))
            np.testing.assert_array_equal(a, want)
            b = data("int64", "sum", 0, 50_000, salt=i)
            if rank != i % world:
                b[:] = 0
            g.broadcast(b, src=i % world)
            np.testing.assert_array_equal(b, data("int64", "sum", 0, 50_000, salt=i))
        return {"lane": g.lane, "stats": g.stats(), "lane_stats": g.lane_stats()}


def stalled_peer(rank: int, world: int, victim: int, stall_timeout: float, pause: float) -> None:
    """After ten quick all-reduces the victim's training loop hangs for ``pause`` seconds (its
    process, and so its QUIC stack, keeps answering); then it tries to go on. An error
    carries ``detected_after``: seconds from the end of the tenth all-reduce to the error."""
    g = mcp.init(timeout=60, heartbeat=0.5, stall_timeout=stall_timeout)
    a = np.ones(1000, "float32")
    for _ in range(10):
        g.all_reduce(a)
    t0 = time.monotonic()
    if rank == victim:
        time.sleep(pause)
    try:
        for _ in range(100_000):
            g.all_reduce(a)
    except mcp.MCPError as e:
        e.detected_after = time.monotonic() - t0  # type: ignore[attr-defined]
        raise
    finally:
        g.close()


def slow_peer(rank: int, world: int, victim: int, stall_timeout: float, pause: float) -> int:
    """The victim computes ``pause`` seconds before each of 8 all-reduces (after 5 quick
    ones): slow, never stuck. Returns the all-reduces done."""
    with mcp.init(timeout=60, heartbeat=0.5, stall_timeout=stall_timeout) as g:
        a = np.ones(1000, "float32")
        for i in range(13):
            if rank == victim and i >= 5:
                time.sleep(pause)
            g.all_reduce(a)
            assert (a == world ** (i + 1)).all()
        return 13


def flapped(rank: int, world: int, lane: str, cut: float) -> dict[str, Any]:
    """All-reduces while rank 1's link goes down for ``cut`` seconds (a flap, shorter than
    the failure detector's limit) after the tenth; every result is checked exactly."""
    with mcp.init(timeout=120, chaos="seed=1", lane=lane) as g:
        for i in range(30):
            if rank == 1 and i == 10:
                g.chaos_cut(cut)
            n = 65_537 if i % 2 else 300_001
            a = data("float32", "sum", rank, n, salt=i)
            t0 = time.monotonic()
            g.all_reduce(a)
            if rank == 1 and i == 10:
                stalled = time.monotonic() - t0
            want = sum(data("float32", "sum", r, n, salt=i) for r in range(world))
            np.testing.assert_array_equal(a, want)
        return {"killed": g.chaos_stats()["killed"], "stalled": stalled if rank == 1 else 0.0}


def reset_mid_run(
    rank: int, world: int, lane: str, zero_rtt: bool, resets: int = 2
) -> dict[str, Any]:
    """All-reduces of mixed sizes while rank 1 drops all its connections ``resets`` times
    (from a thread, while an all-reduce is in flight); every result is checked exactly."""
    import threading

    with mcp.init(timeout=60, lane=lane, zero_rtt=zero_rtt) as g:
        for i in range(12 * resets + 6):
            reset = rank == 1 and i % 12 == 6
            if reset:
                threading.Timer(0.002, g.chaos_reset).start()
            n = 65_537 if i % 2 else 1_000_003
            a = data("float32", "sum", rank, n, salt=i)
            g.all_reduce(a)
            want = sum(data("float32", "sum", r, n, salt=i) for r in range(world))
            np.testing.assert_array_equal(a, want)
        g.barrier()
        s = g.stats()
        keys = ["reconnects", "zero_rtt_accepted", "zero_rtt_rejected", "duplicate_frames"]
        return {k: s[k] for k in keys}


def idle_timeout_during_a_cut(rank: int, world: int, cut: float) -> dict[str, Any]:
    """Rank 1's link goes down for ``cut`` seconds, longer than QUIC's idle timeout (0.5 s)
    and shorter than the failure detector's limit (heartbeat 2 s): the connections time out,
    are dialled again once the path is back, and the all-reduce in flight finishes exact."""
    with mcp.init(timeout=60, chaos="seed=1", idle_timeout=0.5, heartbeat=2.0) as g:
        for i in range(16):
            if rank == 1 and i == 8:
                g.chaos_cut(cut)
            n = 65_537 if i % 2 else 300_001
            a = data("float32", "sum", rank, n, salt=i)
            g.all_reduce(a)
            want = sum(data("float32", "sum", r, n, salt=i) for r in range(world))
            np.testing.assert_array_equal(a, want)
        g.barrier()
        return {"reconnects": g.stats()["reconnects"]}
