"""The parameter server: exactness, the staleness bound, threads, errors, failures.

Servers and workers run as threads of this process where the test is about the logic, and
as separate processes where it is about failures (kill -9 of a worker, of a server).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mcp_fast as mcp
import ps_workers
from _launch import free_port
from mcp_fast import ps
from mcp_fast.guards import GradientGuard

SECRET = "ps-test-secret"


def addr() -> str:
    return f"127.0.0.1:{free_port()}"


def run_threads(fns: list[Any], timeout: float = 30.0) -> list[Any]:
    """Run each callable in a thread; return their results, re-raising the first error."""
    out: list[Any] = [None] * len(fns)
    errs: list[BaseException | None] = [None] * len(fns)

    def body(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as e:
            errs[i] = e

    ts = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(fns))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
        assert not t.is_alive(), "a worker thread did not finish in time"
    for e in errs:
        if e is not None:
            raise e
    return out


# --------------------------------------------------------------------------- references


def ref_sgd(lr: float, mu: float, wd: float, nesterov: bool) -> Any:
    lr32, mu32, wd32 = np.float32(lr), np.float32(mu), np.float32(wd)

    def step(p: np.ndarray, g: np.ndarray, st: dict[str, Any]) -> np.ndarray:
        if wd:
            g = g + wd32 * p
        if mu:
            st["b"] = mu32 * st.get("b", np.zeros_like(p)) + g
            d = g + mu32 * st["b"] if nesterov else st["b"]
        else:
            d = g
        return p - lr32 * d

    return step


def ref_adam(lr: float, b1: float, b2: float, eps: float, wd: float, decoupled: bool) -> Any:
    def step(p: np.ndarray, g: np.ndarray, st: dict[str, Any]) -> np.ndarray:
        st["b1p"] = st.get("b1p", 1.0) * b1
        st["b2p"] = st.get("b2p", 1.0) * b2
        m = st.get("m", np.zeros_like(p))
        v = st.get("v", np.zeros_like(p))
        if wd and decoupled:
            p = p * np.float32(1.0 - lr * wd)
        if wd and not decoupled:
            g = g + np.float32(wd) * p
        m = np.float32(b1) * m + np.float32(1.0 - b1) * g
        v = np.float32(b2) * v + np.float32(1.0 - b2) * (g * g)
        st["m"], st["v"] = m, v
        stp = np.float32(lr / (1.0 - st["b1p"]))
        bc2 = np.float32(math.sqrt(1.0 - st["b2p"]))
        return p - stp * (m / (np.sqrt(v) / bc2 + np.float32(eps)))

    return step


OPTIMIZERS = {
    "sgd-nesterov-wd": (
        {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3, "nesterov": True},
        ref_sgd(0.1, 0.9, 1e-3, True),
    ),
    "adam": ({"optimizer": "adam", "lr": 0.01}, ref_adam(0.01, 0.9, 0.999, 1e-8, 0.0, False)),
    "adamw": (
        {"optimizer": "adamw", "lr": 0.01, "weight_decay": 0.05},
        ref_adam(0.01, 0.9, 0.999, 1e-8, 0.05, True),
    ),
}


def grads_for(p: dict[str, np.ndarray], wid: int, step: int) -> dict[str, np.ndarray]:
    x, y = ps_workers.data(seed=wid)
    _, g = ps_workers.loss_and_grads(p, *ps_workers.batch(x, y, step))
    g["E"] = (np.sin(p["E"] * np.float32(wid + 1) + np.float32(step)) * np.float32(0.1)).astype(
        np.float32
    )
    return g


@pytest.mark.parametrize(
    ("name", "fused"),
    [(n, False) for n in OPTIMIZERS] + [("sgd-nesterov-wd", True), ("adam", True)],
)
def test_s0_is_bit_exact_against_a_single_process_reference(name: str, fused: bool) -> None:
    """2 servers, 3 workers, s = 0; "E" (3000 elements) is split across both servers.
    ``fused``: push, step and pull in one call (``step(grads, into)``)."""
    kw, ref = OPTIMIZERS[name]
    steps, workers = 8, 3
    addrs = [addr(), addr()]
    servers = [ps.Server(a, secret=SECRET, staleness=0, num_workers=workers, **kw) for a in addrs]
    p0 = ps_workers.init_params()
    p0["E"] = np.linspace(-1, 1, 3000, dtype=np.float32)

    def worker(wid: int) -> list[Any]:
        seen = []
        with ps.Worker(addrs, wid, secret=SECRET, timeout=20, split_above=1000) as w:
            w.init(p0)
            p = w.pull()
            for t in range(steps):
                if not fused:
                    p = w.pull()
                seen.append((w.clock, {k: v.copy() for k, v in p.items()}))
                if fused:
                    c = w.step(grads_for(p, wid, t), into=p)
                else:
                    w.push(grads_for(p, wid, t))
                    c = w.step()
                assert c == t + 1 and w.last_min_clock == c, "s = 0 is lockstep"
        return seen

    try:
        got = run_threads([lambda i=i: worker(i) for i in range(workers)])
        stats = [s.stats() for s in servers]
    finally:
        for s in servers:
            s.close()
    assert all(st["pieces"] >= 1 for st in stats), "both servers hold pieces"
    # the single-process reference: average the workers' gradients, one step per clock
    p = {k: v.copy() for k, v in p0.items()}
    state: dict[str, dict[str, Any]] = {k: {} for k in p}
    for t in range(steps):
        for wid in range(workers):
            clock, seen = got[wid][t]
            assert clock == t
            for k in p:
                assert np.array_equal(seen[k].view(np.uint32), p[k].view(np.uint32)), (
                    f"worker {wid} step {t} {k}: max diff {np.abs(seen[k] - p[k]).max()}"
                )
        gs = [grads_for(p, wid, t) for wid in range(workers)]
        for k in p:
            mean = ((gs[0][k] + gs[1][k]) + gs[2][k]) / np.float32(3)
            p[k] = ref(p[k], mean, state[k])
    assert not np.array_equal(p["W"], p0["W"]), "training moved the weights"


def _train_two_workers_exact(server_chaos: str, worker_chaos: list[Any]) -> dict[str, Any]:
    """Two workers, s = 0, six steps through the given faults; asserts every worker ends
    bit for bit at the fault-free reference and returns the server's and workers' counters."""
    a = addr()
    srv = ps.Server(a, secret=SECRET, staleness=0, num_workers=2, lr=0.1, chaos=server_chaos)
    p0 = ps_workers.init_params()
    resends: dict[int, int] = {}

    def worker(wid: int) -> dict[str, np.ndarray]:
        x, y = ps_workers.data(wid)
        with ps.Worker([a], wid, secret=SECRET, timeout=30, chaos=worker_chaos[wid]) as w:
            w.init(p0)
            p = w.pull()
            for t in range(6):
                _, g = ps_workers.loss_and_grads(p, *ps_workers.batch(x, y, t))
                w.step(g, into=p)
            resends[wid] = w.resends
            return p

    try:
        got = run_threads([lambda i=i: worker(i) for i in range(2)])
        stats = srv.stats()
    finally:
        srv.close()
    # the fault-free reference: SGD, momentum 0.9, mean of the two workers' gradients
    p = {k: v.copy() for k, v in p0.items()}
    buf = {k: np.zeros_like(v) for k, v in p.items()}
    data = [ps_workers.data(w) for w in range(2)]
    for t in range(6):
        gs = [ps_workers.loss_and_grads(p, *ps_workers.batch(*data[w], t))[1] for w in range(2)]
        for k in p:
            buf[k] = np.float32(0.9) * buf[k] + (gs[0][k] + gs[1][k]) / np.float32(2)
            p[k] = p[k] - np.float32(0.1) * buf[k]
    for r in got:
        for k in p:
            assert np.array_equal(r[k], p[k]), k
    return {"server": stats, "resends": resends}


def test_training_through_packet_loss_stays_exact() -> None:
    """10 % of the datagrams dropped both ways (the fault injector under QUIC): QUIC
    retransmits, the result is bit for bit the loss-free one."""
    res = _train_two_workers_exact(
        "loss=0.1,seed=2", [mcp.Chaos(loss=0.1, seed=10 + wid) for wid in range(2)]
    )
    assert res["server"]["chaos_send_dropped"] > 0, "the fault injector dropped nothing"


def test_damaged_requests_and_replies_are_sent_again_and_training_stays_exact() -> None:
    """A bit flipped above QUIC in 15 % of the requests and of the replies: the checksum
    catches each, the request goes again under its id (a push is never applied twice), and
    the result is bit for bit the fault-free one."""
    res = _train_two_workers_exact(
        "corrupt=0.15,seed=2", [mcp.Chaos(corrupt=0.15, seed=10 + wid) for wid in range(2)]
    )
    assert res["server"]["corrupt_messages"] > 0, "no damaged request reached the server"
    assert sum(res["resends"].values()) >= res["server"]["corrupt_messages"], res


def test_the_staleness_bound_is_never_exceeded_with_a_slow_worker() -> None:
    s, steps = 2, 30
    a = addr()
    srv = ps.Server(a, secret=SECRET, staleness=s, num_workers=3, lr=0.01)
    spread: list[int] = []
    done = threading.Event()

    def monitor() -> None:
        while not done.is_set():
            live = [c for _, c, alive in srv.clocks() if alive]
            if len(live) == 3:
                spread.append(max(live) - min(live))
            time.sleep(0.002)

    def worker(wid: int) -> list[tuple[int, int]]:
        rec = []
        with ps.Worker([a], wid, secret=SECRET, timeout=20) as w:
            w.init(ps_workers.init_params())
            x, y = ps_workers.data(wid)
            for _ in range(steps):
                p = w.pull()
                _, g = ps_workers.loss_and_grads(p, *ps_workers.batch(x, y, w.clock))
                w.push(g)
                if wid == 2:
                    time.sleep(0.02)  # the slow worker
                c = w.step()
                assert w.last_min_clock is not None
                rec.append((c, w.last_min_clock))
        return rec

    mon = threading.Thread(target=monitor, daemon=True)
    mon.start()
    try:
        recs = run_threads([lambda i=i: worker(i) for i in range(3)])
        stats = srv.stats()
    finally:
        done.set()
        mon.join(5)
        srv.close()
    gaps = [c - low for rec in recs for c, low in rec]
    assert max(gaps) <= s, f"a worker went on {max(gaps)} clocks ahead of the slowest"
    fast_gaps = [c - low for rec in recs[:2] for c, low in rec]
    assert max(fast_gaps) == s, "the fast workers should run ahead up to the bound"
    assert stats["max_granted_gap"] == s
    # a waiting worker's clock is at most s + 1 ahead in the table, never more
    assert spread and max(spread) <= s + 1, max(spread)
    assert all(rec[-1][0] == steps for rec in recs)


def test_many_threads_push_and_pull_at_once() -> None:
    a = addr()
    srv = ps.Server(a, secret=SECRET, optimizer="sgd", lr=1.0, momentum=0.0, aggregate="sum")
    n, threads, rounds = 1000, 8, 10
    params = {f"k{j}": np.zeros(n, np.float32) for j in range(threads)}
    params["shared"] = np.zeros(4 * n, np.float32)
    try:
        with ps.Worker([a], 0, secret=SECRET, timeout=20) as w:
            w.init(params)

            def hammer(j: int) -> int:
                mine = np.full(n, 1.0, np.float32)
                shared = np.full(4 * n, 0.5, np.float32)
                into = {f"k{j}": np.empty(n, np.float32), "shared": np.empty(4 * n, np.float32)}
                for _ in range(rounds):
                    w.push({f"k{j}": mine, "shared": shared})
                    w.pull(into=into)
                    # nothing is applied before the clock ends: every read is the old value
                    assert not into[f"k{j}"].any() and not into["shared"].any()
                return j

            assert run_threads([lambda j=j: hammer(j) for j in range(threads)]) == list(
                range(threads)
            )
            w.step()
            out = w.pull()
        stats = srv.stats()
    finally:
        srv.close()
    for j in range(threads):
        assert np.array_equal(out[f"k{j}"], np.full(n, -float(rounds), np.float32))
    assert np.array_equal(out["shared"], np.full(4 * n, -0.5 * rounds * threads, np.float32))
    assert stats["pushes"] == 2 * threads * rounds
    assert stats["duplicate_pushes"] == 0


@pytest.mark.parametrize(("codec", "tol"), [("bf16", 2.0**-8), ("fp16", 2.0**-11)])
def test_pushes_with_a_codec_are_decoded_within_its_bound(codec: str, tol: float) -> None:
    a = addr()
    srv = ps.Server(a, secret=SECRET, lr=1.0, momentum=0.0)
    g = np.random.default_rng(3).normal(0, 1, 5000).astype(np.float32)
    try:
        with ps.Worker([a], 0, secret=SECRET, codec=codec) as w:
            w.init({"x": np.zeros(5000, np.float32)})
            before = w.stats()[0]["bytes_received"]
            w.push({"x": g})
            pushed = w.stats()[0]["bytes_received"] - before
            w.step()
            got = -w.pull()["x"]
            assert pushed < 5000 * 4 * 0.6, f"the push travelled coded ({pushed} bytes)"
            # the fused step codes its pushes the same way
            into = {"x": np.empty(5000, np.float32)}
            w.step({"x": g}, into=into)
            np.testing.assert_allclose(-into["x"] - got, g, rtol=2 * tol, atol=1e-7)
    finally:
        srv.close()
    assert not np.array_equal(got, g), "a lossy codec changes the bits"
    np.testing.assert_allclose(got, g, rtol=tol, atol=1e-7)


def test_torch_tensors_are_pulled_in_place() -> None:
    torch = pytest.importorskip("torch")
    a = addr()
    srv = ps.Server(a, secret=SECRET, lr=0.5, momentum=0.0)
    try:
        model = torch.nn.Linear(3, 2)
        with ps.Worker([a], 0, secret=SECRET) as w:
            w.init(ps.params_of(model))
            before = model.weight.detach().clone()
            model.weight.grad = torch.ones_like(model.weight)
            model.bias.grad = None
            w.push(ps.grads_of(model))
            w.step()
            w.pull(into=ps.params_of(model))
        assert torch.equal(model.weight.detach(), before - 0.5)
    finally:
        srv.close()


def test_errors_are_typed(monkeypatch: pytest.MonkeyPatch) -> None:
    a = addr()
    srv = ps.Server(a, secret=SECRET, num_workers=1)
    try:
        with pytest.raises(mcp.AuthenticationError):
            ps.Worker([a], 0, secret="another secret", timeout=3)
        with ps.Worker([a], 0, secret=SECRET, timeout=5) as w:
            w.init({"x": np.zeros(10, np.float32)})
            with pytest.raises(KeyError, match='"nope" was registered with init'):
                w.push({"nope": np.zeros(10, np.float32)})
            with pytest.raises(ValueError, match="11 float32 elements, but it was registered"):
                w.push({"x": np.zeros(11, np.float32)})
            with pytest.raises(TypeError, match="holds float32 tensors, got float64"):
                w.push({"x": np.zeros(10, np.float64)})
            with pytest.raises(TypeError, match="float32"):
                w.step({"x": np.zeros(10, np.int32)})
            with pytest.raises(KeyError):
                w.step(into={"y": np.zeros(10, np.float32)})
            with pytest.raises(TypeError, match="float32"):
                w.push({"x": np.zeros(10, np.float16)}, guard=GradientGuard(1.0))
            with pytest.raises(ValueError, match="NaN"):
                w.push({"x": np.full(10, np.nan, np.float32)})
            with pytest.raises(ValueError):
                w.pull(into={"x": np.zeros(10, np.float32)[::-1]})
    finally:
        srv.close()
    t0 = time.monotonic()
    with pytest.raises(mcp.PeerLostError):
        ps.Worker([addr()], 0, secret=SECRET, timeout=2)
    assert time.monotonic() - t0 < 6
    # close() released the socket: the same address can be served again
    lonely = ps.Server(a, secret=SECRET, num_workers=2, register_timeout=1.0)
    try:
        with pytest.raises(mcp.MCPTimeoutError, match="1 of 2 workers"):
            ps.Worker([a], 0, secret=SECRET, timeout=5)
    finally:
        lonely.close()
    with pytest.raises(ValueError):
        ps.Server(addr(), secret=SECRET, optimizer="lbfgs")
    monkeypatch.delenv("MCP_SECRET", raising=False)
    with pytest.raises(ValueError, match="secret"):
        ps.Worker([a], 0)


def test_a_standby_on_another_address_takes_over_from_the_checkpoint(tmp_path: Path) -> None:
    a, b = addr(), addr()
    kw = {"secret": SECRET, "lr": 0.1, "momentum": 0.9, "checkpoint_dir": tmp_path}
    first = ps.Server(a, **kw)
    x, y = ps_workers.data(0)
    with ps.Worker([a], 0, secret=SECRET, timeout=20, dead_after=1.0) as w:
        w.init(ps_workers.init_params())
        for _ in range(5):
            _, g = ps_workers.loss_and_grads(w.pull(), *ps_workers.batch(x, y, w.clock))
            w.push(g)
            w.step()
        assert first.checkpoint() == 5
        saved = w.pull()
        _, g = ps_workers.loss_and_grads(saved, *ps_workers.batch(x, y, w.clock))
        w.push(g)
        w.step()  # clock 6 is applied on the first server only: lost with it
        first.close()
        standby = ps.Server(b, restore=True, **kw)
        try:
            assert standby.restored_step == 5
            w.replace_server(0, b)
            assert w.core.servers() == (1, [b])
            back = w.pull()
            for k in saved:
                assert np.array_equal(back[k], saved[k]), "the checkpoint's values, exactly"
            losses = []
            for _ in range(20):
                loss, g = ps_workers.loss_and_grads(w.pull(), *ps_workers.batch(x, y, w.clock))
                w.push(g)
                w.step()
                losses.append(loss)
            assert w.clock == 26 and standby.stats()["applied_through"] == 26
            assert np.mean(losses[-5:]) < np.mean(losses[:5])
        finally:
            standby.close()


def _spawn(ctx: Any, q: Any, *args: Any) -> Any:
    p = ctx.Process(target=_child, args=(q, *args), daemon=True)
    p.start()
    return p


def _child(q: Any, tag: str, *args: Any) -> None:
    try:
        q.put((tag, "ok", ps_workers.train(*args)))
    except BaseException as e:
        q.put((tag, "err", f"{type(e).__name__}: {e}"))


def _collect(q: Any, tags: set[str], timeout: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    deadline = time.monotonic() + timeout
    while tags - out.keys() and time.monotonic() < deadline:
        try:
            tag, status, value = q.get(timeout=0.5)
        except Exception:
            continue
        assert status == "ok", f"{tag}: {value}"
        out[tag] = value
    assert not tags - out.keys(), f"{tags - out.keys()} did not finish"
    return out


@pytest.mark.parametrize("fused", [False, True], ids=["advance", "step_with_arrays"])
def test_ctrl_c_interrupts_a_step_waiting_under_the_staleness_bound(fused: bool) -> None:
    # Worker 1 registers and never steps: without the interrupt, worker 0 would wait for its
    # 60 s timeout. The fused step holds the caller's arrays: it must end before raising.
    a = addr()
    srv = ps.Server(a, secret=SECRET, staleness=0, num_workers=2, lr=0.01)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=ps_workers.interrupted_step, args=(q, a, SECRET, fused))
    p.start()
    slow = None
    try:
        # Registration waits for both workers.
        slow = ps.Worker([a], 1, secret=SECRET, timeout=60)
        slow.init(ps_workers.init_params())
        res = _collect(q, {"w0"}, timeout=60)["w0"]
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join(5)
        if slow is not None:
            slow.close()
        srv.close()
    assert res["late"] < 5.0, res
    assert res["then"] == "GroupClosedError" and "closed" in res["message"], res


def test_a_killed_worker_is_dropped_the_others_go_on_and_it_rejoins() -> None:
    s, dead_after, steps = 1, 1.0, 60
    a = addr()
    srv = ps.Server(a, secret=SECRET, staleness=s, num_workers=3, lr=0.02, dead_after=dead_after)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = []
    try:
        for wid in range(3):
            die = 5 if wid == 2 else None
            procs.append(_spawn(ctx, q, f"w{wid}", wid, [a], SECRET, steps, die, 0.01, dead_after))
        # wait until worker 2 died and the server dropped it
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if procs[2].exitcode is not None and not dict(
                (w, live) for w, _, live in srv.clocks()
            ).get(2, True):
                break
            time.sleep(0.05)
        assert procs[2].exitcode == -signal.SIGKILL
        dropped_at = {w: c for w, c, _ in srv.clocks()}
        assert not next(live for w, _, live in srv.clocks() if w == 2)
        # a fresh process rejoins as worker 2
        procs.append(_spawn(ctx, q, "w2-again", 2, [a], SECRET, 10, None, 0.0, dead_after))
        res = _collect(q, {"w0", "w1", "w2-again"}, timeout=40)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        srv.close()
    for wid in (0, 1):
        tr = res[f"w{wid}"]["trace"]
        assert len(tr) == steps
        assert max(c for c, *_ in tr) > 5 + s + 1, "the others went on without worker 2"
        losses = [loss for _, _, loss, _ in tr]
        assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses
    again = res["w2-again"]
    live_min = min(dropped_at[0], dropped_at[1])
    assert again["start_clock"] >= live_min, "rejoins at the slowest live clock, not at 0"
    assert len(again["trace"]) == 10


def test_a_frozen_worker_is_dropped_and_comes_back_when_it_resumes() -> None:
    s, dead_after, steps = 1, 1.0, 40
    a = addr()
    srv = ps.Server(a, secret=SECRET, staleness=s, num_workers=2, lr=0.02, dead_after=dead_after)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        _spawn(ctx, q, "w0", 0, [a], SECRET, steps, None, 0.01, dead_after),
        _spawn(ctx, q, "w1", 1, [a], SECRET, steps, None, 0.0, dead_after, 3),
    ]
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if any(w == 1 and not live for w, _, live in srv.clocks()):
                break
            time.sleep(0.05)
        frozen_at = {w: c for w, c, _ in srv.clocks()}
        assert not next(live for w, _, live in srv.clocks() if w == 1), "dropped while frozen"
        time.sleep(0.5)
        assert dict((w, c) for w, c, _ in srv.clocks())[0] > frozen_at[0], "worker 0 goes on"
        os.kill(procs[1].pid, signal.SIGCONT)  # type: ignore[arg-type]
        res = _collect(q, {"w0", "w1"}, timeout=40)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        srv.close()
    tr1 = [c for c, *_ in res["w1"]["trace"]]
    assert len(tr1) == steps
    jumps = [b - a for a, b in itertools.pairwise(tr1)]
    assert max(jumps) > 1, "on its return it rejoined at the slowest live clock"
    assert res["w1"]["counters"][1] >= 1, "it reconnected (the server had closed on it)"


def _wait_for(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting until {what}")


def test_a_spare_takes_over_the_id_shard_and_clock_of_a_killed_worker() -> None:
    s, dead_after, steps = 1, 1.0, 40
    a = addr()
    srv = ps.Server(a, secret=SECRET, staleness=s, num_workers=3, lr=0.02, dead_after=dead_after)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = []
    try:
        for wid in range(3):
            die = 6 if wid == 1 else None
            procs.append(_spawn(ctx, q, f"w{wid}", wid, [a], SECRET, steps, die, 0.01, dead_after))
        _wait_for(lambda: len(srv.clocks()) == 3, 30, "the three workers registered")
        # A hot spare: it waits at the server until an id falls vacant.
        procs.append(_spawn(ctx, q, "spare", "vacant", [a], SECRET, 10, None, 0.0, dead_after))
        _wait_for(lambda: procs[1].exitcode is not None, 30, "worker 1 killed itself")
        assert procs[1].exitcode == -signal.SIGKILL
        res = _collect(q, {"w0", "w2", "spare"}, timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        srv.close()
    spare = res["spare"]
    assert (spare["worker_id"], spare["generation"]) == (1, 1), "it took the dead worker's id"
    assert spare["start_clock"] >= 6, "at the slowest live clock, not at 0"
    assert len(spare["trace"]) == 10
    for wid in (0, 2):
        assert len(res[f"w{wid}"]["trace"]) == steps
    assert min(c for c, *_ in spare["trace"]) > spare["start_clock"]


def test_a_frozen_worker_whose_id_was_taken_over_is_refused_when_it_resumes() -> None:
    s, dead_after, steps = 1, 1.0, 30
    a = addr()
    srv = ps.Server(a, secret=SECRET, staleness=s, num_workers=2, lr=0.02, dead_after=dead_after)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        _spawn(ctx, q, "w0", 0, [a], SECRET, steps, None, 0.01, dead_after),
        _spawn(ctx, q, "w1", 1, [a], SECRET, steps, None, 0.0, dead_after, 3),
    ]
    try:
        _wait_for(
            lambda: any(w == 1 and not live for w, _, live in srv.clocks()),
            30,
            "the frozen worker 1 was dropped",
        )
        procs.append(_spawn(ctx, q, "spare", "vacant", [a], SECRET, 10, None, 0.0, dead_after))
        out: dict[str, Any] = {}

        def spare_took_id_1() -> bool:
            # Live under id 1 now, or already done (its 10 quick steps can end between two
            # looks at a loaded machine): its report says which id it held.
            with contextlib.suppress(queue.Empty):
                while True:
                    tag, status, value = q.get_nowait()
                    out[tag] = (status, value)
            return "spare" in out or any(w == 1 and live for w, _, live in srv.clocks())

        _wait_for(spare_took_id_1, 60, "the spare took id 1")
        os.kill(procs[1].pid, signal.SIGCONT)  # type: ignore[arg-type]
        deadline = time.monotonic() + 60
        while len(out) < 3 and time.monotonic() < deadline:
            try:
                tag, status, value = q.get(timeout=0.5)
                out[tag] = (status, value)
            except Exception:
                continue
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        srv.close()
    assert out["w0"][0] == "ok" and len(out["w0"][1]["trace"]) == steps
    assert out["spare"][0] == "ok" and out["spare"][1]["worker_id"] == 1
    status, err = out["w1"]
    assert status == "err" and err.startswith("SupersededError"), err
    assert "taken over" in err and "vacant" in err, err


def test_launch_replaces_a_killed_worker_with_one_that_takes_its_id() -> None:
    res = ps.launch(
        ps_workers.until_clock,
        num_workers=3,
        args=(40, 8),
        server_kwargs={"lr": 0.02, "staleness": 1, "dead_after": 1.0},
        worker_kwargs={"timeout": 30.0, "dead_after": 1.0},
        restart_workers=1,
        timeout=90,
    )
    assert [r["end"] for r in res] == [40, 40, 40]
    assert [r["generation"] for r in res] == [0, 1, 0], "id 1 is held by its replacement"
    assert res[1]["start"] >= 8, "the replacement started where the dead worker was"
    assert len({r["pid"] for r in res}) == 3


def test_a_vacant_id_is_refused_in_the_binding_for_bad_values() -> None:
    with pytest.raises(ValueError, match="vacant"):
        ps.Worker([addr()], worker_id="spare", secret=SECRET)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="vacant"):
        ps.Worker([addr()], worker_id=-1, secret=SECRET)


def _kill_server_when_checkpointed(ckpt: Path, slot: int, killed: list[float]) -> None:
    manifest = ckpt / f"server-{slot}" / "MANIFEST.json"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not manifest.exists():
        time.sleep(0.05)
    time.sleep(0.5)  # let a few more clocks go by after the first checkpoint
    for p in mp.active_children():
        if p.name == f"mcp-ps-server-{slot}":
            os.kill(p.pid, signal.SIGKILL)  # type: ignore[arg-type]
            killed.append(time.time())
            return


def test_a_killed_server_is_restored_from_its_checkpoint_and_training_goes_on(
    tmp_path: Path,
) -> None:
    killed: list[float] = []
    killer = threading.Thread(
        target=_kill_server_when_checkpointed, args=(tmp_path, 1, killed), daemon=True
    )
    killer.start()
    res = ps.launch(
        ps_workers.launched,
        num_workers=3,
        num_servers=2,
        args=(160, 0.01),
        server_kwargs={
            "optimizer": "sgd",
            "lr": 0.01,
            "staleness": 2,
            "dead_after": 1.0,
            "checkpoint_every": 0.2,
        },
        worker_kwargs={"timeout": 30.0, "dead_after": 1.0},
        checkpoint_dir=tmp_path,
        timeout=60,
    )
    killer.join(5)
    assert killed, "the server was not killed (no checkpoint appeared?)"
    t_kill = killed[0]
    for r in res:
        tr = r["trace"]
        assert len(tr) == 160
        before = [loss for _, loss, t in tr if t < t_kill]
        after = [loss for _, loss, t in tr if t > t_kill + 0.5]
        assert before and len(after) >= 10, "training must run on both sides of the kill"
        assert np.mean(after[-10:]) < np.mean(before[-5:]), "loss keeps falling after recovery"
    assert sum(r["counters"][1] for r in res) >= 3, "every worker reconnected to the standby"
    # evaluation mode: every worker saw the same parameters
    for r in res[1:]:
        for k in r["params"]:
            assert np.array_equal(r["params"][k], res[0]["params"][k])
    assert res[0]["final"] < 0.5
    # the standby restored and went on checkpointing
    steps = sorted(int(f.name[5:17]) for f in (tmp_path / "server-1").glob("step-*.mcdc"))
    assert len(steps) >= 2
