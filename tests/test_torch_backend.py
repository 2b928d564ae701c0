"""torch.distributed with backend "mcp": every collective, DDP in its common modes, errors."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from _launch import Failure, ok, run  # noqa: E402
from workers import check_interrupted  # noqa: E402


def as_torch(obj):
    """Results come back as numpy arrays; compare them as tensors."""
    import numpy as np

    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: as_torch(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [as_torch(v) for v in obj]
    return obj


@pytest.mark.parametrize("world", [2, 3])
def test_every_collective_against_a_reference(world: int) -> None:
    results = as_torch(ok(run("torch_workers.every_collective", world, timeout=180)))
    for rank, out in enumerate(results):
        s = sum(range(world))
        assert out["backend"] == "mcp"
        torch.testing.assert_close(out["all_reduce"], torch.arange(10.0) * world + s)
        torch.testing.assert_close(out["all_reduce_max"], torch.full((4,), float(world)))
        torch.testing.assert_close(
            out["all_reduce_avg"], torch.full((4,), (s + world) / world, dtype=torch.float64)
        )
        torch.testing.assert_close(out["broadcast"], torch.full((3, 3), float(1 % world)))
        if rank == 0:
            torch.testing.assert_close(out["reduce"], torch.full((5,), float(s + world)))
            torch.testing.assert_close(
                out["gather"], torch.stack([torch.full((2,), float(i)) for i in range(world)])
            )
        torch.testing.assert_close(
            out["all_gather"], torch.stack([torch.full((2,), float(i)) for i in range(world)])
        )
        torch.testing.assert_close(
            out["all_gather_into_tensor"],
            torch.cat([torch.full((3,), float(i)) for i in range(world)]),
        )
        torch.testing.assert_close(out["scatter"], torch.full((2,), float(rank * 10)))
        torch.testing.assert_close(out["reduce_scatter"], torch.full((2,), float(s + world * rank)))
        base = torch.arange(2 * world, dtype=torch.float32)[2 * rank : 2 * rank + 2]
        torch.testing.assert_close(out["reduce_scatter_tensor"], base * world + s)
        want = torch.cat(
            [
                torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) + 100 * i
                for i in range(world)
            ]
        )
        torch.testing.assert_close(out["all_to_all_single"], want)
        want = torch.cat([torch.full((rank + 1,), float(100 * i + rank)) for i in range(world)])
        torch.testing.assert_close(out["all_to_all_uneven"], want)
        torch.testing.assert_close(
            out["all_to_all"], torch.tensor([float(10 * i + rank) for i in range(world)])
        )
        torch.testing.assert_close(out["p2p"], torch.full((3,), float((rank - 1) % world)))
        total = world * (world + 1) / 2
        torch.testing.assert_close(out["async"], torch.full((1000,), total))
        torch.testing.assert_close(out["future"], torch.full((1000,), total))
        torch.testing.assert_close(out["coalesced"][0], torch.full((3,), float(s)))
        torch.testing.assert_close(out["coalesced"][1], torch.full((2, 2), total))
        if rank in (0, world - 1):
            torch.testing.assert_close(out["subgroup"], torch.full((4,), float(1 + world)))
        for name, t in out["dtypes"].items():
            torch.testing.assert_close(t, torch.full((7,), total, dtype=torch.float64), msg=name)


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_on_views_that_are_not_contiguous(world: int) -> None:
    # The result lands in the view's elements and nowhere else in its base.
    results = as_torch(ok(run("torch_workers.strided_views", world, timeout=180)))
    weight = sum(r + 1 for r in range(world))
    for rank, out in enumerate(results):
        m = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (rank + 1)
        m[:, 1] = torch.tensor([1.0, 5.0, 9.0]) * weight
        torch.testing.assert_close(out["all_reduce_column"], m, rtol=0, atol=0)
        t = torch.arange(6, dtype=torch.float64).reshape(2, 3) + (world - 1)
        torch.testing.assert_close(out["all_reduce_transpose"], t, rtol=0, atol=0)
        b = torch.full((2, 6), float(rank + 7))
        b[:, ::2] = float(world - 1 + 7)
        torch.testing.assert_close(out["broadcast_every_other"], b, rtol=0, atol=0)
        g = torch.zeros(world, 4)
        for i in range(world):
            g[i, ::2] = float(i)
        torch.testing.assert_close(out["all_gather_into_views"], g, rtol=0, atol=0)
        rs = torch.zeros(2, 2)
        rs[:, 0] = float(sum(r + rank for r in range(world)))
        torch.testing.assert_close(out["reduce_scatter_into_column"], rs, rtol=0, atol=0)


MODES = [
    "plain",
    "find_unused",
    "bucket_view",
    "static_graph",
    "no_sync",
    "join",
    "hook_allreduce",
    "hook_fp16",
    "hook_powersgd",
    "hook_thread",
    "compiled",
]


@pytest.mark.parametrize("mode", MODES)
def test_ddp_matches_gloo(mode: str) -> None:
    world = 2
    mcp = as_torch(ok(run("torch_workers.ddp_train", world, "mcp", mode, timeout=180)))
    gloo = as_torch(ok(run("torch_workers.ddp_train", world, "gloo", mode, timeout=180)))
    for rank in range(world):
        for a, b in zip(mcp[rank], gloo[rank], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(mcp[rank], mcp[0], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # replicas agree exactly


@pytest.mark.parametrize(("world", "replicas"), [(2, 1), (3, 1), (4, 2)])
def test_fsdp2_matches_gloo(world: int, replicas: int) -> None:
    # FSDP2 over "mcp": all_gather_into_tensor and reduce_scatter_tensor on flat shards (3
    # ranks: uneven, padded), gradient accumulation without sync; 4 ranks as HSDP (2 replicas
    # of 2 shards: the mesh's subgroups, and an all-reduce across replicas). FSDP1 needs an
    # accelerator.
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)")
    steps = 4
    args = ("torch_workers.fsdp2_train", world)
    mcp = as_torch(ok(run(*args, "mcp", steps, replicas, timeout=180)))
    gloo = as_torch(ok(run(*args, "gloo", steps, replicas, timeout=180)))
    for rank in range(world):
        for a, b in zip(mcp[rank]["full"], gloo[rank]["full"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(mcp[rank]["full"], mcp[0]["full"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # every rank gathers the same
        moved = [
            float((a - b).abs().max())
            for a, b in zip(mcp[rank]["full"], mcp[rank]["initial"], strict=True)
        ]
        assert min(moved) > 1e-4, moved  # every layer trained


def test_fsdp2_with_a_gradient_divide_factor() -> None:
    # set_gradient_divide_factor(3) on 2 ranks: FSDP2 reduce-scatters with PREMUL_SUM(1/3),
    # which Gloo refuses; on mcp it must train as Gloo does when FSDP2 sums and divides after.
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp.FSDPModule, "set_force_sum_reduction_for_comms"):
        pytest.skip("this torch's FSDP2 has no set_force_sum_reduction_for_comms")
    args = ("torch_workers.fsdp2_train", 2)
    premul = run(*args, "gloo", 2, 1, 3.0, False, timeout=180)
    assert all(isinstance(f, Failure) and "PREMUL_SUM" in f.message for f in premul), premul
    mcp = as_torch(ok(run(*args, "mcp", 4, 1, 3.0, False, timeout=180)))
    gloo = as_torch(ok(run(*args, "gloo", 4, 1, 3.0, True, timeout=180)))
    default = as_torch(ok(run(*args, "mcp", 4, 1, timeout=180)))
    for rank in range(2):
        for a, b in zip(mcp[rank]["full"], gloo[rank]["full"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        # the factor took effect: other parameters than with the default (the world size)
        assert any(
            not torch.allclose(a, b, rtol=1e-4, atol=1e-5)
            for a, b in zip(mcp[rank]["full"], default[rank]["full"], strict=True)
        )


def test_shape_mismatch_is_an_error_on_every_rank() -> None:
    res = run("torch_workers.shape_mismatch", 2, timeout=90)
    for f in res:
        assert isinstance(f, Failure) and "SpecMismatchError" in f.message, f


def test_different_collectives_are_an_error_on_every_rank() -> None:
    res = run("torch_workers.wrong_collective", 2, timeout=90)
    for f in res:
        assert isinstance(f, Failure) and "SpecMismatchError" in f.message, f


def test_all_to_all_whose_split_sizes_disagree_names_the_all_to_all_not_its_messages() -> None:
    r0, r1 = as_torch(ok(run("torch_workers.all_to_all_splits_disagree", 2, timeout=90)))
    # The receiver of the part that does not fit is told which collective and what to mend,
    # with both sides' sizes, and not the backend's internal message tag.
    msg = r1["a2a"]
    assert msg.startswith("SpecMismatchError: all_to_all on rank 1: a part another rank"), msg
    assert "float32[2]" in msg and "float32[3]" in msg and "tag=" not in msg, msg
    # The group goes on: the next all-reduce is exact on both ranks.
    for r in (r0, r1):
        torch.testing.assert_close(r["next"], torch.tensor([3.0, 3.0]))


def test_scatter_whose_sizes_disagree_names_the_scatter_on_the_rank_it_does_not_fit() -> None:
    r0, r1 = as_torch(ok(run("torch_workers.scatter_sizes_disagree", 2, timeout=90)))
    torch.testing.assert_close(r0["scatter"], torch.tensor([10.0, 10.0]))
    msg = r1["scatter"]
    assert msg.startswith("SpecMismatchError: scatter on rank 1: a part another rank"), msg
    assert "float32[2]" in msg and "float32[3]" in msg and "tag=" not in msg, msg
    for r in (r0, r1):
        torch.testing.assert_close(r["next"], torch.tensor([3.0, 3.0]))


def test_all_to_all_whose_part_for_itself_does_not_fit_is_refused_on_that_rank() -> None:
    r0, r1 = as_torch(ok(run("torch_workers.all_to_all_misfit_for_itself", 2, timeout=90)))
    # Rank 0's exchange was whole: rank 1 sent it its first two elements (10, 11).
    torch.testing.assert_close(r0["a2a"], torch.tensor([0.0, 1.0, 10.0, 11.0]))
    # Rank 1 is told what does not fit, after receiving rank 0's part (not its own).
    assert r1["a2a"].startswith("ValueError: all_to_all on rank 1: the part this rank"), r1
    assert "2 x torch.float32" in r1["a2a"] and "1 x torch.float32" in r1["a2a"], r1
    torch.testing.assert_close(r1["received"], torch.tensor([2.0, 3.0, -1.0]))
    # The group goes on.
    for r in (r0, r1):
        torch.testing.assert_close(r["next"], torch.tensor([3.0, 3.0]))


def test_all_to_all_whose_tensor_for_itself_has_another_shape_is_refused_there() -> None:
    # The same count in another shape: refused as a peer's part of that shape would be
    # (Gloo refuses it too), after the exchange with the other rank, not before it.
    res = as_torch(ok(run("torch_workers.all_to_all_list_misshaped_for_itself", 2, timeout=90)))
    for rank, r in enumerate(res):
        assert r["a2a"].startswith(f"ValueError: all_to_all on rank {rank}:"), r
        assert "shape (3, 2)" in r["a2a"] and "shape (2, 3)" in r["a2a"], r
        peer = 1 - rank
        want = torch.arange(6.0).reshape(3, 2) + 10 * peer + 100 * rank
        torch.testing.assert_close(r["from_peer"], want)
        torch.testing.assert_close(r["next"], torch.tensor([3.0, 3.0]))


def test_wrong_secret_is_an_authentication_error() -> None:
    ours, intruder = run("torch_workers.wrong_secret", 2, timeout=90)
    assert isinstance(intruder, Failure) and intruder.type == "AuthenticationError", intruder
    assert "AuthenticationError" in intruder.mro and "MCPError" in intruder.mro
    # Nothing of the intruder was accepted: rank 0 is still waiting for a rank 1 at its deadline.
    assert isinstance(ours, Failure) and ours.type == "MCPTimeoutError", ours


def test_mcp_chaos_and_mcp_lane_reach_the_torch_backend() -> None:
    # Damaged frames injected through the environment are healed in a torch process group.
    env = {"MCP_CHAOS": "corrupt=0.05,seed=3", "MCP_LANE": "stream"}
    results = ok(run("torch_workers.through_env_chaos", 2, 20, timeout=120, env=env))
    assert all(out["lane"] == "stream" for out in results)
    assert sum(out["stats"]["retransmits"] for out in results) > 0, results


def _expected(name: str, rank: int, world: int) -> dict[str, bytes]:
    """What every collective of ``torch_workers.every_dtype`` must give, for a dtype that Gloo
    cannot move: the same values, built here byte for byte."""
    import numpy as np

    from torch_workers import _values

    dt = getattr(torch, name)

    def raw(t: torch.Tensor) -> bytes:
        return t.contiguous().view(torch.uint8).numpy().tobytes()

    out = {
        "broadcast": raw(_values(dt, 0)),
        "all_gather": b"".join(raw(_values(dt, r)) for r in range(world)),
        "all_to_all": b"".join(raw(_values(dt, r, 3)) for r in range(world)),
        "p2p": raw(_values(dt, 0)),
    }
    if not name.startswith("float8"):
        total = sum(_values(dt, r).numpy().astype(np.dtype(name)) for r in range(world))
        out["all_reduce"] = np.asarray(total, dtype=np.dtype(name)).tobytes()
    return out


def test_every_dtype_moves_bit_exactly_and_reduces_like_gloo() -> None:
    # torch's own distributed tests broadcast and gather int8, bool, ... tensors: every dtype
    # torch has travels bit for bit, and all-reduce gives Gloo's answer where Gloo reduces it
    # (and the wrapping integer sum where Gloo knows no such dtype).
    from torch_workers import NOT_IN_GLOO, TORCH_DTYPES

    mcp = ok(run("torch_workers.every_dtype", 2, "mcp", timeout=180))
    gloo = ok(run("torch_workers.every_dtype", 2, "gloo", timeout=180))
    for rank in range(2):
        assert set(mcp[rank]) == set(TORCH_DTYPES)
        for name, res in mcp[rank].items():
            want = _expected(name, rank, 2) if name in NOT_IN_GLOO else gloo[rank][name]
            assert set(res) == set(want), name
            for key, got in res.items():
                assert got == want[key], (rank, name, key)


def test_bitwise_ops_reduce_like_gloo_and_floats_are_refused() -> None:
    # BAND, BOR and BXOR on every integer dtype Gloo reduces and on bool, 3 ranks (an odd
    # count, where a xor counted twice would show): Gloo's bytes; a float tensor is a
    # ValueError naming the op, and so is PREMUL_SUM of integers, on every rank.
    mcp = ok(run("torch_workers.bitwise_ops", 3, "mcp", timeout=180))
    gloo = ok(run("torch_workers.bitwise_ops", 3, "gloo", timeout=180))
    for rank in range(3):
        assert len(gloo[rank]) == (30 if rank == 2 else 15)
        for key, want in gloo[rank].items():
            assert mcp[rank][key] == want, (rank, key)
        assert mcp[rank]["float BXOR"].startswith("ValueError: op 'bxor' is bitwise")
        assert mcp[rank]["int PREMUL_SUM"].startswith("ValueError: PREMUL_SUM multiplies")


def test_ctrl_c_interrupts_a_collective(tmp_path: Path) -> None:
    # torch waits on the backend's work from C++: the KeyboardInterrupt must come through
    # it (and through the work's future, which takes only Exceptions) within the 50 ms
    # poll, bounded at 5 s under load, not after the 120 s timeout.
    rank0, rank1 = ok(run("torch_workers.interrupted", 2, str(tmp_path / "told"), timeout=90))
    check_interrupted(rank0, rank1)


def test_ctrl_c_interrupts_a_rank_waiting_for_rank_zero_in_init() -> None:
    # torch's store.get would block in C++ for the 120 s timeout.
    _, late = ok(run("torch_workers.interrupted_init", 2, timeout=90))
    assert late < 5.0, late


def test_premul_sum_scales_each_ranks_tensor_before_the_sum() -> None:
    # NCCL's PREMUL_SUM, which FSDP2 reduce-scatters with after set_gradient_divide_factor
    # (Gloo refuses it): sum over ranks of (tensor x factor), the factor a float or a
    # one-element tensor in the tensor's dtype; bit-exact for 2 ranks (one addition per
    # element); inputs left as they were; integer tensors refused on every rank, and the
    # group goes on.
    res = as_torch(ok(run("torch_workers.premul_sum", 2, timeout=180)))
    x = [torch.linspace(-3.0, 5.0, 12) * (r + 1) + 0.1 * r for r in range(2)]
    for fname, factor in [("float", 0.37), ("tensor", torch.tensor([1.0 / 3.0]))]:
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            key = f"{fname} {dtype}"
            f = factor.to(dtype).reshape(()) if isinstance(factor, torch.Tensor) else factor
            want = x[0].to(dtype) * f + x[1].to(dtype) * f
            if dtype == torch.bfloat16:
                want = want.float()  # results come back as float32 (numpy has no bfloat16)
            for rank in range(2):
                got = res[rank]
                mine = x[rank].to(dtype)
                if dtype == torch.bfloat16:
                    mine = mine.float()
                exact = {"rtol": 0, "atol": 0}
                torch.testing.assert_close(got[f"{key} all_reduce"], want, **exact)
                torch.testing.assert_close(got[f"{key} all_reduce_coalesced"], want, **exact)
                if rank == 0:
                    torch.testing.assert_close(got[f"{key} reduce"], want, **exact)
                chunk = want.chunk(2)[rank]
                torch.testing.assert_close(got[f"{key} reduce_scatter_tensor"], chunk, **exact)
                torch.testing.assert_close(got[f"{key} reduce_scatter"], chunk, **exact)
                torch.testing.assert_close(got[f"{key} its input"], mine, **exact)
    for rank in range(2):
        assert res[rank]["int"].startswith("ValueError: PREMUL_SUM multiplies each rank's"), res
        assert res[rank]["after"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("first", ["mcp_fast.torch", "mcp_fast", "torch"])
def test_any_import_order_registers_the_backend(first: str) -> None:
    # `import mcp_fast.torch` first makes torch's import run our entry point while the package
    # is half-loaded: that must neither fail nor leave "mcp" unregistered.
    check = "import torch.distributed as dist\nassert 'mcp' in dist.Backend.backend_list"
    code = f"import {first}\n{check}"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_loading_the_backend_does_not_import_dynamo() -> None:
    # torch loads mcp_fast at `import torch`; were that to import Dynamo, every Gloo user's DDP
    # teardown could deadlock in torch (see _eager in the backend). Compared with torch alone.
    code = (
        "import sys, torch\n"
        "before = 'torch._dynamo' in sys.modules\n"
        "import mcp_fast.torch\n"
        "assert ('torch._dynamo' in sys.modules) == before, 'mcp_fast imported torch._dynamo'"
    )
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert r.returncode == 0, r.stderr


def test_int8_with_error_feedback_converges_like_uncompressed() -> None:
    pytest.importorskip("sklearn")
    plain = ok(run("torch_workers.digits_loss", 2, None, timeout=180))
    int8 = ok(run("torch_workers.digits_loss", 2, "int8", timeout=180))
    assert plain[0] == plain[1] and int8[0] == int8[1]
    assert int8[0] != plain[0], "the hook changed nothing: was it applied?"
    assert abs(int8[0] - plain[0]) <= 0.02 * plain[0], (int8[0], plain[0])


def test_recv_without_a_source() -> None:
    got = ok(run("torch_workers.torch_any_source", 3, timeout=90))[0]
    assert got == [2, 1]


def test_a_rank_whose_store_goes_away_while_it_waits_for_rank_zero_is_told_rank_zero_stopped():
    """Rank 0 hosts torch's TCPStore: when it fails to start, it takes the store down, and a
    rank polling for its address must say so rather than raise the store's socket error."""
    import torch.distributed as dist

    from _launch import free_port
    from mcp_fast.errors import PeerLostError
    from mcp_fast.torch import backend

    port = free_port()
    # A "rank 0" that hosts the store, then exits without publishing anything once told to
    # (its stdin closes): only after this rank is connected, however loaded the machine is.
    code = (
        "import sys, torch.distributed as d\n"
        f"s = d.TCPStore('127.0.0.1', {port}, 2, True, wait_for_workers=False)\n"
        "print('up', flush=True); sys.stdin.read()\n"
    )
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    with subprocess.Popen([sys.executable, "-c", code], **pipes) as p:
        try:
            assert p.stdin is not None and p.stdout is not None
            assert p.stdout.readline().strip() == "up"
            client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=30))
            p.stdin.close()
            with pytest.raises(PeerLostError, match="rank 0 stopped before it published") as e:
                backend._published(client, "mcp/addr", 30.0)
            assert e.value.rank == 0 and e.value.op == "init_process_group"
        finally:
            p.kill()


def test_bind_address_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from mcp_fast.torch import backend

    monkeypatch.setenv("MCP_BIND_ADDR", "10.1.2.3")
    assert backend._bind_ip() == "10.1.2.3"
    monkeypatch.delenv("MCP_BIND_ADDR")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert backend._bind_ip() == "127.0.0.1"
    # A host name that resolves to loopback on a multi-node job: nobody else could reach it.
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(
        socket,
        "getaddrinfo",
        lambda *a, **k: [(socket.AF_INET, socket.SOCK_DGRAM, 17, "", ("127.0.1.1", 0))],
    )
    with pytest.raises(ValueError, match="--local-addr"):
        backend._bind_ip()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # a single node: loopback is right
    assert backend._bind_ip() == "127.0.1.1"


class _SlowFuture:
    """A torch Future whose completion takes a while, to widen the window in which a
    ``wait()`` that returned early would find the future still pending."""

    def __init__(self) -> None:
        self.inner: torch.futures.Future = torch.futures.Future()

    def set_result(self, value: object) -> None:
        import time

        time.sleep(0.2)
        self.inner.set_result(value)

    def set_exception(self, error: BaseException) -> None:
        import time

        time.sleep(0.2)
        self.inner.set_exception(error)


class _CoreWork:
    """Stands in for a core operation: it ends (with ``error``, if any) when ``end()`` is
    called, from any thread."""

    def __init__(self, error: BaseException | None = None) -> None:
        import threading

        self._ended = threading.Event()
        self._error = error

    def end(self) -> None:
        self._ended.set()

    def wait(self, timeout: float | None = None) -> bool:
        assert self._ended.wait(10), "the stand-in operation never ended"
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._ended.is_set()


class _CountingPool:
    """A completion pool that counts what it is handed."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.inner = ThreadPoolExecutor(max_workers=2)
        self.submitted = 0

    def submit(self, fn: Any) -> Any:
        self.submitted += 1
        return self.inner.submit(fn)


@pytest.mark.parametrize("error", [None, RuntimeError("peer lost")])
def test_future_is_complete_once_wait_returns(error: BaseException | None) -> None:
    # The future was asked for, so a completion thread and the waiting thread both finish
    # the work: whichever gets there second must still find the future complete.
    import threading

    from mcp_fast.torch.backend import MCPWork

    pool = _CountingPool()
    out = [torch.ones(2)]
    work = MCPWork(out, pool)  # type: ignore[arg-type]
    core = _CoreWork(error)
    work.works = [core]
    slow = _SlowFuture()
    work._future = slow  # type: ignore[assignment]
    work.get_future()
    threading.Timer(0.05, core.end).start()
    if error is None:
        assert work.wait() is True
        assert slow.inner.done()
        torch.testing.assert_close(slow.inner.value()[0], torch.ones(2))
    else:
        with pytest.raises(RuntimeError, match="peer lost"):
            work.wait()
        assert slow.inner.done()
    assert pool.submitted == 1
    pool.inner.shutdown(wait=True)


def test_a_waited_work_finishes_on_the_waiting_thread_once() -> None:
    # A synchronous call: the caller waits, the work's after-steps run on its thread, once,
    # and no completion thread is involved (each would be a thread hop per operation).
    import threading

    from mcp_fast.torch.backend import MCPWork

    pool = _CountingPool()
    ran: list[int] = []
    work = MCPWork([], pool, after=lambda: ran.append(threading.get_ident()))  # type: ignore[arg-type]
    core = _CoreWork()
    work.works = [core]
    assert not work.is_completed()
    threading.Timer(0.05, core.end).start()
    assert work.wait() is True
    assert work.wait() is True  # a second wait finds it finished
    assert ran == [threading.get_ident()]
    assert pool.submitted == 0
    assert work.is_completed() and work.is_success() and work.exception() is None
    assert work.get_future().done()
    pool.inner.shutdown(wait=True)


def test_a_failed_work_raises_on_every_wait_and_skips_its_after_steps() -> None:
    from mcp_fast.torch.backend import MCPWork

    pool = _CountingPool()
    ran: list[str] = []
    work = MCPWork(
        [], pool, after=lambda: ran.append("after"), cleanup=lambda: ran.append("cleanup")
    )  # type: ignore[arg-type]
    core = _CoreWork(RuntimeError("peer lost"))
    work.works = [core]
    core.end()
    assert work.is_completed()
    assert not work.is_success()
    assert isinstance(work.exception(), RuntimeError)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="peer lost"):
            work.wait()
    assert ran == ["cleanup"]
    pool.inner.shutdown(wait=True)


def test_a_bounded_wait_times_out_while_the_operation_runs() -> None:
    from mcp_fast.errors import MCPTimeoutError
    from mcp_fast.torch.backend import MCPWork

    pool = _CountingPool()
    work = MCPWork([], pool)  # type: ignore[arg-type]
    core = _CoreWork()
    work.works = [core]
    with pytest.raises(MCPTimeoutError, match="still running"):
        work.wait(timeout=0.05)
    core.end()
    assert work.wait(timeout=10) is True
    pool.inner.shutdown(wait=True)


def test_is_completed_does_not_wait_for_another_thread_finishing_the_work() -> None:
    # A thread finishing the work runs its after-steps and its future's callbacks, which may
    # wait on other works; asking is_completed() meanwhile (from a callback of one of them,
    # say) must answer, not queue behind it.
    import threading

    from mcp_fast.torch.backend import MCPWork

    pool = _CountingPool()
    started, gate = threading.Event(), threading.Event()

    def slow_after() -> None:
        started.set()
        gate.wait(10)

    core = _CoreWork()
    core.end()
    work = MCPWork([], pool, [core], after=slow_after)  # type: ignore[arg-type]
    finisher = threading.Thread(target=work.wait)
    finisher.start()
    assert started.wait(10)
    assert work.is_completed() is False
    assert not gate.is_set()  # answered while the other thread still held the work
    gate.set()
    finisher.join(10)
    assert work.is_completed() is True
    pool.inner.shutdown(wait=True)


def test_wait_inside_the_works_own_callback_does_not_block() -> None:
    from mcp_fast.torch.backend import MCPWork

    pool = _CountingPool()
    work = MCPWork([torch.zeros(1)], pool)  # type: ignore[arg-type]
    seen: list[bool] = []
    work.get_future().then(lambda _f: seen.extend([work.wait(), work.is_completed()]))
    assert work.wait() is True
    assert len(seen) == 2 and seen[0] is True
    pool.inner.shutdown(wait=True)


_TORCHRUN_SCRIPT = """
import sys
import torch
import torch.distributed as dist
import torch.nn as nn

# No "import mcp_fast": torch's entry point registered backend "mcp" when torch started.
dist.init_process_group("mcp")
rank = dist.get_rank()
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
model = nn.parallel.DistributedDataParallel(net)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(rank)
for _ in range(5):
    x = torch.randn(32, 8, generator=g)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
torch.save({"backend": dist.get_backend(), "world": dist.get_world_size(), "params": flat},
           f"{sys.argv[1]}/rank{rank}.pt")
dist.destroy_process_group()
"""


@pytest.mark.parametrize("world", [2, 3])
def test_torchrun_without_importing_mcp_fast(world: int, tmp_path) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    from _launch import free_port

    script = tmp_path / "train.py"
    script.write_text(_TORCHRUN_SCRIPT)
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [
            str(torchrun),
            f"--nproc-per-node={world}",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            str(script),
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    assert all(r["backend"] == "mcp" and r["world"] == world for r in results)
    for r in results[1:]:
        torch.testing.assert_close(r["params"], results[0]["params"], rtol=0, atol=0)


@pytest.mark.parametrize("world", [2, 3])
def test_sparse_all_reduce_matches_gloo_bit_exactly(world: int) -> None:
    mcp = ok(run("torch_workers.sparse_all_reduce", world, "mcp", timeout=120))
    gloo = ok(run("torch_workers.sparse_all_reduce", world, "gloo", timeout=120))
    for rank in range(world):
        assert mcp[rank].keys() == gloo[rank].keys()
        for name, got in mcp[rank].items():
            if name == "async":
                torch.testing.assert_close(as_torch(got), torch.tensor([float(world), 0, 0, 0]))
                continue
            want = gloo[rank][name]
            assert bool(got["coalesced"]), name
            for key in ("indices", "values", "dense"):
                torch.testing.assert_close(
                    as_torch(got[key]), as_torch(want[key]), rtol=0, atol=0, msg=f"{name} {key}"
                )
    # Against a reference, so that both backends cannot agree on a wrong sum.
    import torch_workers

    cases = [torch_workers._sparse_cases(r) for r in range(world)]
    for name in cases[0]:
        want = sum(c[name].to_dense() for c in cases)
        torch.testing.assert_close(as_torch(mcp[0][name]["dense"]), want, msg=name)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("max", "rank(s) [0, 1] asked for another operation"),
        ("max_on_one", "rank(s) [0] asked for another operation"),
        ("shapes", "different shapes"),
    ],
)
def test_a_sparse_all_reduce_it_cannot_do_is_refused_on_every_rank(case: str, message: str) -> None:
    # The same ValueError on every rank (the ops are exchanged first), where a rank refusing
    # alone left the others to a timeout or a lost peer.
    res = run("torch_workers.sparse_refused", 2, case, timeout=90)
    for f in res:
        assert isinstance(f, Failure) and "ValueError" in f.message and message in f.message, f


def test_ddp_with_a_sparse_embedding_matches_gloo() -> None:
    world = 2
    mcp = as_torch(ok(run("torch_workers.ddp_sparse_embedding", world, "mcp", timeout=180)))
    gloo = as_torch(ok(run("torch_workers.ddp_sparse_embedding", world, "gloo", timeout=180)))
    for rank in range(world):
        for a, b in zip(mcp[rank], gloo[rank], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for a, b in zip(mcp[rank], mcp[0], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("world", [2, 3])
def test_tensor_parallel_matches_training_alone(world: int) -> None:
    # DTensor's column- and row-wise parallel linear layers over "mcp" (3 ranks: uneven
    # shards): the same losses and parameters as the unsplit model trained alone, and as Gloo.
    pytest.importorskip("torch.distributed.tensor.parallel")
    mcp = as_torch(ok(run("torch_workers.tensor_parallel_train", world, "mcp", timeout=180)))
    gloo = as_torch(ok(run("torch_workers.tensor_parallel_train", world, "gloo", timeout=180)))
    for rank in range(world):
        got = mcp[rank]
        assert got["losses"]["tp"] == pytest.approx(got["losses"]["alone"], rel=1e-5)
        assert got["losses"]["tp"] == pytest.approx(gloo[rank]["losses"]["tp"], rel=1e-6)
        for a, b, g in zip(got["full"], got["alone"], gloo[rank]["full"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(a, g, rtol=1e-6, atol=1e-7)
        spread = [
            float((a - b).abs().max()) for a, b in zip(got["full"], mcp[0]["full"], strict=True)
        ]
        assert spread == [0.0] * len(spread)  # every rank holds the same model


@pytest.mark.parametrize(("world", "schedule"), [(2, "gpipe"), (2, "1f1b"), (3, "1f1b")])
def test_pipeline_parallel_matches_training_alone(world: int, schedule: str) -> None:
    # torch.distributed.pipelining over "mcp": activations and gradients travel point to
    # point between stages; every stage ends the step as the whole model trained alone would.
    pytest.importorskip("torch.distributed.pipelining")
    res = as_torch(ok(run("torch_workers.pipeline_train", world, "mcp", schedule, timeout=180)))
    last = res[world - 1]
    torch.testing.assert_close(last["output"], last["ref_output"], rtol=1e-5, atol=1e-6)
    assert last["losses"] == pytest.approx(last["ref_losses"], rel=1e-5)
    for rank in range(world):
        assert len(res[rank]["stage"]) == 4
        for a, b in zip(res[rank]["stage"], res[rank]["ref_stage"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_torch_finds_a_backend_for_each_device_of_an_mcp_group() -> None:
    # torch's own code asks a group for its backend per device (init_process_group with a
    # device_id; DeviceMesh and FSDP2 in some set-ups): "mcp" answers for cpu and cuda, as a
    # backend without NCCL-style splitting, coalescing or allocation, and refuses others.
    world = 2
    res = as_torch(ok(run("torch_workers.device_backends", world, timeout=180)))
    for rank, out in enumerate(res):
        for name in ("world", "sub"):
            for d in ("cpu", "cuda"):
                assert out[f"{name}/{d}"] == ["mcp", False, False, False], (name, d, out)
            assert "takes cpu and cuda tensors, not meta" in out[f"{name}/meta"], out
            want = torch.full((3,), float((rank - 1) % world))
            torch.testing.assert_close(out[f"{name}/exchanged"], want, rtol=0, atol=0)
            torch.testing.assert_close(out[f"{name}/all_reduce"], torch.full((4,), 2.0))


def test_distributed_checkpoint_async_save_and_broadcast_from_rank0(tmp_path: Path) -> None:
    # torch.distributed.checkpoint on "mcp": async_save refused to run without a CPU device
    # on the group, and broadcast_from_rank0 picked a device from an empty list.
    world = 3
    res = as_torch(
        ok(run("torch_workers.checkpoint_round_trip", world, str(tmp_path), timeout=180))
    )
    for out in res:
        assert out["device_types"] == ["cpu", "cuda"]
        for a, b in zip(out["loaded"], out["saved"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for a, b in zip(out["received"], res[0]["received"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # rank 0's weights everywhere
    assert not torch.equal(res[0]["received"][0], res[0]["saved"][0])  # they differ from seed 0


def test_zero_and_post_local_sgd_match_gloo() -> None:
    # ZeroRedundancyOptimizer and PostLocalSGDOptimizer over "mcp": bit-identical to Gloo.
    world = 2
    mcp = as_torch(ok(run("torch_workers.zero_and_post_local_sgd", world, "mcp", timeout=180)))
    gloo = as_torch(ok(run("torch_workers.zero_and_post_local_sgd", world, "gloo", timeout=180)))
    for rank in range(world):
        for key in ("zero", "local_sgd"):
            for a, b, c in zip(mcp[rank][key], gloo[rank][key], mcp[0][key], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
                torch.testing.assert_close(a, c, rtol=0, atol=0)
