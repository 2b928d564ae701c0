"""Local SGD, DiLoCo and streaming DiLoCo (``mcp_fast.torch.diloco``): the outer step's
arithmetic against references computed here, bit-identical θ_outer on every member, the
codecs' error, the 4-bit codec's bound, the non-finite guard, the model check, streaming's
merges, and an elastic job losing a member between outer steps (real processes).

The in-process tests run each member as a thread with its own Group on 127.0.0.1 (the
collectives release the GIL); models are built in the main thread, since torch's global
generator is shared by threads.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import mcp_fast as mcp
from _launch import free_port
from _peer_reads import sibling_reads_allowed
from mcp_fast.errors import SpecMismatchError
from mcp_fast.torch import DiLoCo, LocalSGD, PseudoGradientWarning
from mcp_fast.torch.int4 import decode_int4, encode_int4, int4_nbytes, int4_round_trip

torch.set_num_threads(1)
SECRET = "diloco-test-secret-0123456789abcdef"


def run_members(models: list[nn.Module], fn: Callable[..., Any], timeout: float = 60) -> list[Any]:
    """Runs ``fn(rank, group, model)`` in one thread per model, each with its own Group;
    returns the results (re-raises the first member's exception, if any, as it was)."""
    world = len(models)
    port = free_port()
    out: dict[int, Any] = {}

    def member(r: int) -> None:
        try:
            with mcp.init(
                rank=r, world_size=world, master_port=port, secret=SECRET, timeout=timeout
            ) as g:
                out[r] = fn(r, g, models[r])
        except BaseException as e:  # reported to the test below
            out[r] = e

    threads = [threading.Thread(target=member, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout + 10
    for t in threads:
        t.join(max(0.1, deadline - time.monotonic()))
    assert all(not t.is_alive() for t in threads), "a member hung"
    return [out[r] for r in range(world)]


def ok(results: list[Any]) -> list[Any]:
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def small_model(seed: int = 0, width: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 4), nn.Tanh(), nn.Linear(4, 1)
    )


def data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 8, generator=g)
    return x, x[:, :1] * 2 - x[:, 1:2]


def grad_step(model: nn.Module, rank: int, step: int) -> None:
    model.zero_grad(set_to_none=True)
    x, y = data(rank, step)
    nn.functional.mse_loss(model(x), y).backward()


def flat(ts: Any) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in ts])


def copies(n: int, **kw: Any) -> list[nn.Module]:
    m = small_model(**kw)
    return [copy.deepcopy(m) for _ in range(n)]


# -- 4-bit codec ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 63, 64, 1001, 4096])
def test_int4_round_trip_is_within_half_a_level(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    x[0] = 0.0
    packed = encode_int4(x)
    assert packed.dtype == torch.uint8 and packed.numel() == int4_nbytes(n) == 4 * -(-n // 64) + -(
        -n // 2
    )
    y = decode_int4(packed, n)
    nb = -(-n // 64)
    pad = torch.zeros(nb * 64)
    pad[:n] = x.abs()
    bound = pad.view(nb, 64).amax(1).repeat_interleave(64)[:n] / 14
    assert ((x - y).abs() <= bound * (1 + 1e-6) + 1e-12).all()
    assert torch.equal(int4_round_trip(x), y)  # deterministic
    assert torch.equal(int4_round_trip(torch.zeros(10)), torch.zeros(10))


def test_int4_refuses_bad_input():
    with pytest.raises(TypeError):
        encode_int4(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="uint8 bytes"):
        decode_int4(torch.zeros(3, dtype=torch.uint8), 100)


# -- the outer step's arithmetic --------------------------------------------------------------


def test_local_sgd_every_step_equals_synchronous_gradient_averaging():
    world, steps, lr = 3, 6, 0.1
    models = copies(world)
    ref = copy.deepcopy(models[0])

    def member(r: int, g: mcp.Group, m: nn.Module) -> torch.Tensor:
        opt = torch.optim.SGD(m.parameters(), lr=lr)
        dl = LocalSGD(m, opt, g, sync_every=1)
        for s in range(steps):
            grad_step(m, r, s)
            opt.step()
            assert dl.step()
        dl.finish()
        return flat(m.parameters())

    got = ok(run_members(models, member))
    for s in range(steps):  # the reference: one model, the gradient averaged over members
        grads = []
        for r in range(world):
            grad_step(ref, r, s)
            grads.append([p.grad.clone() for p in ref.parameters()])
        with torch.no_grad():
            for i, p in enumerate(ref.parameters()):
                p.sub_(lr * sum(gr[i] for gr in grads) / world)
    want = flat(ref.parameters())
    for r in range(world):
        assert torch.equal(got[r], got[0])
        torch.testing.assert_close(got[r], want, rtol=0, atol=1e-6)


def test_diloco_with_outer_lr_1_and_no_momentum_averages_the_parameters():
    world, h, rounds = 3, 5, 3
    models = copies(world)

    def member(r: int, g: mcp.Group, m: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
        opt = torch.optim.Adam(m.parameters(), lr=0.01)
        dl = DiLoCo(m, opt, g, sync_every=h, outer_lr=1.0, outer_momentum=0.0)
        seen = []
        for s in range(h * rounds):
            grad_step(m, r, s)
            opt.step()
            before = flat(m.parameters())
            if dl.step():
                seen.append((before, flat(dl.outer_parameters())))
        return seen

    got = ok(run_members(models, member))
    for k in range(rounds):
        mean = torch.stack([got[r][k][0] for r in range(world)]).mean(0)
        for r in range(world):
            assert torch.equal(got[r][k][1], got[0][k][1])
            torch.testing.assert_close(got[r][k][1], mean, rtol=0, atol=1e-6)


def test_the_outer_step_is_nesterov_sgd_on_the_average_pseudo_gradient():
    world, h = 2, 4
    models = copies(world)
    theta0 = flat(models[0].parameters())

    def member(r: int, g: mcp.Group, m: nn.Module) -> list[torch.Tensor]:
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        dl = DiLoCo(m, opt, g, sync_every=h)  # defaults: lr 0.7, momentum 0.9, Nesterov
        out = []
        for s in range(2 * h):
            grad_step(m, r, s)
            opt.step()
            local = flat(m.parameters())
            if dl.step():
                out += [local, flat(dl.outer_parameters()), flat(m.parameters())]
        return out

    got = ok(run_members(models, member))
    # By hand: g1 = mean(θ0 - local); b1 = g1; θ1 = θ0 - 0.7 (g1 + 0.9 b1); then b2 = 0.9 b1 + g2.
    g1 = torch.stack([theta0 - got[r][0] for r in range(world)]).mean(0)
    theta1 = theta0 - 0.7 * (g1 + 0.9 * g1)
    torch.testing.assert_close(got[0][1], theta1, rtol=0, atol=1e-6)
    g2 = torch.stack([got[0][1] - got[r][3] for r in range(world)]).mean(0)
    b2 = 0.9 * g1 + g2
    torch.testing.assert_close(got[0][4], got[0][1] - 0.7 * (g2 + 0.9 * b2), rtol=0, atol=1e-6)
    for r in range(world):
        assert torch.equal(got[r][1], got[r][2]), "the model is not set to θ_outer"
        assert torch.equal(got[r][4], got[0][4])


def test_sync_runs_an_outer_step_now_whatever_the_inner_step():
    models = copies(2)

    def member(r: int, g: mcp.Group, m: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        dl = LocalSGD(m, opt, g, sync_every=100)
        for s in range(3):
            grad_step(m, r, s)
            opt.step()
            assert not dl.step()
        local = flat(m.parameters())
        dl.sync()
        assert dl.outer_steps == 1
        return local, flat(m.parameters())

    got = ok(run_members(models, member))
    mean = (got[0][0] + got[1][0]) / 2
    for r in range(2):
        torch.testing.assert_close(got[r][1], mean, rtol=0, atol=1e-6)


# -- codecs: identical on every member, error within a stated bound ---------------------------

#: max |θ_outer(codec) - θ_outer(exact)| / max |θ_outer(exact) - θ_0| after one outer step.
TOLERANCE = {"none": 0.0, "fp16": 0.005, "bf16": 0.02, "int8": 0.05, "int4": 0.15}


def _train(codec: str, world: int, h: int, rounds: int, fragments: int = 1, **kw: Any) -> list[Any]:
    models = copies(world, width=48)

    def member(r: int, g: mcp.Group, m: nn.Module) -> dict[str, Any]:
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        dl = DiLoCo(m, opt, g, sync_every=h, codec=codec, fragments=fragments, **kw)
        outer, digests = [], []
        for s in range(h * rounds):
            grad_step(m, r, s)
            opt.step()
            if dl.step():
                digests.append(dl.outer_digest())
                outer.append(flat(dl.outer_parameters()))
        dl.finish()
        return {
            "digests": digests,
            "outer": outer,
            "final": flat(m.parameters()),
            "bytes": dl.bytes_sent,
            "syncs": dl.fragment_syncs,
        }

    return ok(run_members(models, member))


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8", "int4"])
def test_codecs_leave_every_member_bit_identical_and_close_to_exact(codec):
    theta0 = flat(small_model(width=48).parameters())
    exact = _train("none", 3, 4, 3)
    got = _train(codec, 3, 4, 3)
    for res in (exact, got):
        for r in res:
            assert r["digests"] == res[0]["digests"] and len(r["digests"]) == 3
            assert torch.equal(r["final"], res[0]["final"])
    err = (got[0]["outer"][0] - exact[0]["outer"][0]).abs().max()
    scale = (exact[0]["outer"][0] - theta0).abs().max()
    assert err <= TOLERANCE[codec] * scale, (codec, float(err), float(scale))
    assert err > 0  # it did compress
    # Error feedback keeps it from drifting: still close after three outer steps.
    err3 = (got[0]["outer"][2] - exact[0]["outer"][2]).abs().max()
    assert err3 <= 3 * TOLERANCE[codec] * (exact[0]["outer"][2] - theta0).abs().max()


def test_unknown_codec_and_bad_schedules_are_refused():
    m = small_model()
    with pytest.raises(ValueError, match="unknown codec"):
        DiLoCo(m, None, None, codec="int3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fragments"):
        DiLoCo(m, None, None, sync_every=4, fragments=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="delay"):
        DiLoCo(m, None, None, sync_every=8, fragments=2, delay=4)  # type: ignore[arg-type]


# -- bad input: a non-finite member, models that differ ---------------------------------------


def test_a_non_finite_pseudo_gradient_is_skipped_with_a_warning():
    world, h = 3, 4
    models = copies(world)

    def member(r: int, g: mcp.Group, m: nn.Module) -> dict[str, Any]:
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        dl = LocalSGD(m, opt, g, sync_every=h, codec="int8")
        locals_ = []
        for s in range(2 * h):
            grad_step(m, r, s)
            opt.step()
            if r == 1 and s == h - 1:
                with torch.no_grad():
                    next(m.parameters()).view(-1)[3] = float("nan")
            locals_.append(flat(m.parameters()))
            if dl.step():
                assert torch.isfinite(flat(m.parameters())).all()
        return {"locals": locals_, "outer": flat(dl.outer_parameters()), "skipped": dl.skipped}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = ok(run_members(models, member))
    ours = [w for w in caught if issubclass(w.category, PseudoGradientWarning)]
    assert len(ours) == world, [str(w.message) for w in caught]
    assert all("member(s) [1] of 3" in str(w.message) for w in ours)
    for r in range(world):
        assert got[r]["skipped"] == [(h, [1])]
        assert torch.isfinite(got[r]["outer"]).all()
        assert torch.equal(got[r]["outer"], got[0]["outer"])


def test_a_non_finite_member_is_never_averaged_in():
    world, h = 3, 2
    models = copies(world)

    def member(r: int, g: mcp.Group, m: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        dl = LocalSGD(m, opt, g, sync_every=h)
        for s in range(h):
            grad_step(m, r, s)
            opt.step()
            if r == 2 and s == h - 1:
                with torch.no_grad():
                    next(m.parameters()).view(-1)[0] = float("inf")
            local = flat(m.parameters())
            dl.step()
        return local, flat(dl.outer_parameters())

    with warnings.catch_warnings(record=True):  # here: catch_warnings is not thread-safe
        warnings.simplefilter("always")
        got = ok(run_members(models, member))
    mean = (got[0][0] + got[1][0]) / 2  # members 0 and 1 only
    for r in range(world):
        torch.testing.assert_close(got[r][1], mean, rtol=0, atol=1e-6)


def test_a_non_finite_member_is_skipped_and_healed_when_streaming_too():
    world, h = 3, 4
    models = copies(world)

    def member(r: int, g: mcp.Group, m: nn.Module) -> dict[str, Any]:
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        dl = DiLoCo(m, opt, g, sync_every=h, fragments=2, delay=1)
        for s in range(3 * h):
            grad_step(m, r, s)
            opt.step()
            if r == 1 and s == 1:  # fragment 0 (the first parameters) starts at inner step 2
                with torch.no_grad():
                    next(m.parameters()).view(-1)[0] = float("nan")
            dl.step()
            if r == 1 and s == 2:  # merged at step 3: member 1 is back on θ_outer, finite
                assert torch.isfinite(flat(m.parameters())).all()
        dl.finish()
        return {"final": flat(m.parameters()), "skipped": dl.skipped}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = ok(run_members(models, member))
    assert sum(issubclass(w.category, PseudoGradientWarning) for w in caught) == world
    for r in range(world):
        assert got[r]["skipped"] == [(3, [1])]
        assert torch.isfinite(got[r]["final"]).all()
        assert torch.equal(got[r]["final"], got[0]["final"])


def test_members_whose_models_differ_are_refused_naming_both():
    models = [small_model(), small_model(width=17), small_model()]

    def member(r: int, g: mcp.Group, m: nn.Module) -> None:
        DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), g, sync_every=4)

    got = run_members(models, member)
    for r in range(3):
        assert isinstance(got[r], SpecMismatchError), got[r]
        msg = str(got[r])
        assert "member 0 has '0.weight:float32[16, 8]'" in msg, msg
        assert "member 1 has '0.weight:float32[17, 8]'" in msg, msg


def test_a_dtype_mismatch_is_refused_too():
    models = [small_model(), small_model().double()]

    def member(r: int, g: mcp.Group, m: nn.Module) -> None:
        DiLoCo(m, None, g)

    for e in run_members(models, member):
        assert isinstance(e, SpecMismatchError) and "float64" in str(e) and "float32" in str(e)


# -- streaming --------------------------------------------------------------------------------


def test_streaming_syncs_every_fragment_on_its_turn_and_merges_it_later():
    world, h, f, rounds = 3, 8, 4, 4
    models = copies(world, width=48)

    def member(r: int, g: mcp.Group, m: nn.Module) -> dict[str, Any]:
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        dl = DiLoCo(m, opt, g, sync_every=h, fragments=f, delay=1, codec="bf16")
        assert dl.fragments == f
        syncs, merged_at = [], []
        for s in range(h * rounds):
            grad_step(m, r, s)
            opt.step()
            if dl.step():
                merged_at.append(dl.inner_steps)
            syncs.append(list(dl.fragment_syncs))
        dl.finish()
        return {
            "syncs": syncs,
            "merged_at": merged_at,
            "digest": dl.outer_digest(),
            "final": flat(m.parameters()),
        }

    got = ok(run_members(models, member))
    # Fragment i starts at inner steps (i + 1) * h / f + k h and is merged one step later.
    starts = [(i + 1) * h // f for i in range(f)]
    want_merges = sorted(
        s + k * h + 1 for s in starts for k in range(rounds) if s + k * h + 1 <= h * rounds
    )
    for r in range(world):
        assert got[r]["merged_at"] == want_merges, got[r]["merged_at"]
        assert got[r]["syncs"][-1] == [rounds] * (f - 1) + [
            rounds - 1
        ]  # the last is in flight at the end
        assert got[r]["digest"] == got[0]["digest"]
        assert torch.equal(got[r]["final"], got[0]["final"])


def test_fragments_without_delay_sync_in_turn_and_stay_identical():
    got = _train("none", 2, 4, 2, fragments=2, delay=0)
    assert got[0]["syncs"] == [2, 2]
    assert len(got[0]["digests"]) == 4 and got[0]["digests"] == got[1]["digests"]
    assert torch.equal(got[0]["final"], got[1]["final"])


# -- the example, end to end ------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


def test_the_example_trains_two_members_and_writes_its_json(tmp_path):
    out = tmp_path / "out.json"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "train_diloco.py"),
            "--members",
            "2",
            "--steps",
            "20",
            "--sync-every",
            "10",
            "--codec",
            "int8",
            "--fragments",
            "2",
            "--corpus-bytes",
            "200000",
            "--quiet",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["inner_steps"] == 20 and res["members"] == 2
    assert np.isfinite(res["eval_loss"]) and res["bytes_sent"] > 0
    assert 0 < res["utilisation"] <= 1
    assert len(set(res["digests"])) == 1


# -- elastic: a member lost between outer steps, a newcomer healing ---------------------------


def test_elastic_diloco_drops_a_lost_member_and_heals_a_newcomer(tmp_path):
    """Members on two fake hosts (MCP_HOST_ID), so that each epoch's group talks through
    shared memory inside a host and runs the outer all-reduce hierarchically: 2 + 2 members,
    one of host b killed between outer steps (2 + 1), a newcomer on host b (2 + 2)."""
    from _elastic import ElasticRun

    steps, h = 400, 10
    args = ["--steps", str(steps), "--sync-every", str(h), "--codec", "int8", "--width", "32"]
    args += ["--layers", "1", "--batch", "8", "--context", "32", "--corpus-bytes", "200000"]
    args += ["--step-sleep", "0.03", "--quiet"]

    def spawn(run: ElasticRun, name: str, host: str, *extra: str) -> None:
        log = open(tmp_path / f"{name}.log", "w")
        assert run.coordinator is not None
        run.members[name] = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "examples" / "train_diloco.py"),
                "--join",
                run.coordinator.addr,
                *args,
                "--json",
                str(tmp_path / f"{name}.json"),
                *extra,
            ],
            env={**run.env, "MCP_HOST_ID": host},
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        log.close()

    with ElasticRun(tmp_path, steps) as run:
        spawn(run, "m0", "a")
        spawn(run, "m1", "a")
        spawn(run, "m2", "b")
        spawn(run, "m3", "b", "--kill-at", "55")  # exits half-way between outer steps 5 and 6
        e = run.wait_epoch(4)
        e = run.wait_epoch(3, after=e)
        spawn(run, "new", "b")
        run.wait_epoch(4, after=e)
        assert run.members["m3"].wait(timeout=60) == 3
        results = run.finish(["m0", "m1", "m2", "new"])
    finals = {n: r["digest"] for n, r in results.items()}
    assert len(set(finals.values())) == 1, finals
    seen: dict[tuple[int, int], str] = {}
    for n, r in results.items():
        assert r["inner_steps"] == steps and r["outer_steps"] == steps // h, (n, r)
        for outer, epoch, digest in r["digests"]:
            assert seen.setdefault((outer, epoch), digest) == digest, (n, outer, epoch)
    # The survivors did outer step 6 without m3: some outer step ran in a 3-member epoch.
    sizes = {c["epoch"]: c["world_size"] for c in results["m0"]["changes"]}
    assert 3 in sizes.values(), results["m0"]["changes"]
    # The last epoch's group: two hosts of two, the outer steps partly through shared memory.
    for n, r in results.items():
        assert sorted(map(len, r["hosts"])) == [2, 2], (n, r["hosts"])
        assert r["shm_bytes"] > 0, n
    taker = [c for c in results["new"]["changes"] if c["role"] == "taker"]
    assert taker and taker[0]["heal_bytes"] > 0 and taker[0]["step"] > 5, results["new"]["changes"]
    assert results["new"]["digests"][0][0] == taker[0]["step"] + 1


def test_diloco_between_hosts_with_ddp_inside_each_equals_diloco_over_the_hosts():
    """Two fake hosts x 2 ranks (MCP_HOST_ID), real processes and the torch backend: DDP
    over ``host_group()`` every step, DiLoCo over the whole job every H steps. Each host's
    ranks average their gradients, so a host is one DiLoCo member whose batch is its ranks'
    batches together: the result must be that, computed here by hand. Between hosts the
    outer all-reduce runs hierarchically: each rank sends about half the pseudo-gradient
    across per outer step (the flat ring over 4 ranks: 1.5x on the ranks whose neighbour is
    on the other host)."""
    from _launch import run as run_procs
    from torch_workers import hier_data, hier_model

    hosts, steps, h = ["a", "a", "b", "b"], 12, 4
    got = ok(run_procs("torch_workers.diloco_over_hosts", 4, hosts, steps, h, timeout=180))
    assert [r["host_ranks"] for r in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    # By hand: per host, SGD on the mean loss over its ranks' batches; every H steps the
    # outer Nesterov step (lr 0.7, momentum 0.9) on the hosts' average pseudo-gradient.
    ref = [hier_model() for _ in range(2)]
    theta = flat(ref[0].parameters())
    buf = torch.zeros_like(theta)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in ref]
    for step in range(steps):
        for host, (m, opt) in enumerate(zip(ref, opts, strict=True)):
            opt.zero_grad(set_to_none=True)
            grads = []
            for r in (2 * host, 2 * host + 1):
                x, y = hier_data(r, step)
                m.zero_grad(set_to_none=True)
                nn.functional.mse_loss(m(x), y).backward()
                grads.append([p.grad.clone() for p in m.parameters()])
            for p, g0, g1 in zip(m.parameters(), *grads, strict=True):
                p.grad = (g0 + g1) / 2
            opt.step()
        if (step + 1) % h == 0:
            delta = torch.stack([theta - flat(m.parameters()) for m in ref]).mean(0)
            buf = 0.9 * buf + delta
            theta = theta - 0.7 * (delta + 0.9 * buf)
            for m in ref:
                torch.nn.utils.vector_to_parameters(theta.clone(), m.parameters())
    params = [torch.from_numpy(r["params"]) for r in got]
    for r in range(4):
        assert torch.equal(params[r], params[0]), f"rank {r} differs"
    torch.testing.assert_close(params[0], theta, rtol=0, atol=2e-5)
    # Bytes across hosts: three outer all-reduces of B bytes, half of it from each rank.
    b = theta.numel() * 4
    # Inside each host DDP's all-reduces read the peer's gradients directly where the kernel
    # allows it (only the small frames ordering the reads pass the ring), else through it.
    direct = sibling_reads_allowed()
    for r in range(4):
        assert 0.4 * b * 3 < got[r]["quic_bytes"] < 0.75 * b * 3, (r, got[r]["quic_bytes"], b)
        if direct:
            assert 0 < got[r]["shm_bytes"] < 0.4 * b * 3, (r, got[r]["shm_bytes"])
        else:
            assert got[r]["shm_bytes"] > 0.4 * b * 3, (r, got[r]["shm_bytes"])


def test_host_group_refuses_a_group_of_another_backend():
    from _launch import run as run_procs

    (message,) = ok(run_procs("torch_workers.host_group_needs_mcp", 1, timeout=120))
    assert "'mcp' backend" in message and "init_process_group" in message, message


def bn_models(n: int) -> list[nn.Module]:
    """Batch norm (statistics to average) and a causal-mask-like buffer of -inf (to leave)."""
    out = []
    for _ in range(n):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))
        m.register_buffer("mask", torch.tensor([0.0, float("-inf")]))
        out.append(m)
    return out


@pytest.mark.parametrize("fragments", [1, 2])
def test_batch_norm_statistics_are_averaged_with_the_outer_step(fragments):
    """Each member's data shifts its running statistics differently; after the outer step
    (and after finish, with fragments in flight) every member holds their average. The
    causal-mask kind of buffer (not finite at construction) is left alone."""
    world, h = 2, 4
    models = bn_models(world)

    def member(r: int, g: mcp.Group, m: nn.Module, average: bool) -> list[torch.Tensor]:
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        dl = DiLoCo(m, opt, g, sync_every=h, fragments=fragments, average_buffers=average)
        bn, first = m[1], h // fragments  # fragment 0's first outer step starts there
        before: list[torch.Tensor] = []
        for s in range(h):
            x, y = data(r, s)
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(m(x + 3.0 * r), y).backward()  # member r's data shifted
            opt.step()
            if s + 1 == first:  # what fragment 0's outer step takes
                before = [bn.running_mean.clone(), bn.running_var.clone()]
            dl.step()
            if dl.fragment_syncs[0] == 1:  # merged (a step later when streaming)
                break
        dl.finish()
        return [*before, bn.running_mean.clone(), bn.running_var.clone(), m.mask.clone()]

    got = ok(run_members(models, lambda r, g, m: member(r, g, m, True)))
    for i in (0, 1):  # running_mean, running_var
        mean = (got[0][i] + got[1][i]) / 2
        assert not torch.allclose(got[0][i], got[1][i]), "the members' statistics were alike"
        for r in range(world):
            torch.testing.assert_close(got[r][2 + i], mean, rtol=0, atol=1e-6)
    for r in range(world):
        assert torch.equal(got[r][4], torch.tensor([0.0, float("-inf")]))
    # average_buffers=False leaves each member its own.
    models = bn_models(world)
    own = ok(run_members(models, lambda r, g, m: member(r, g, m, False)))
    assert not torch.allclose(own[0][2], own[1][2])


def test_a_member_with_non_finite_buffers_is_skipped_and_takes_the_others():
    world, h = 3, 2
    models = bn_models(world)

    def member(r: int, g: mcp.Group, m: nn.Module) -> tuple[torch.Tensor, list]:
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        dl = DiLoCo(m, opt, g, sync_every=h)
        for s in range(h):
            grad_step(m, r, s)
            opt.step()
            if r == 2 and s == h - 1:
                m[1].running_var.fill_(float("nan"))
            dl.step()
        return m[1].running_var.clone(), dl.skipped

    with warnings.catch_warnings(record=True):  # here: catch_warnings is not thread-safe
        warnings.simplefilter("always")
        got = ok(run_members(models, member))
    for r in range(world):
        assert torch.isfinite(got[r][0]).all(), r
        assert torch.equal(got[r][0], got[0][0])
        assert got[r][1] == [(h, [2])]
