"""Functions the torch backend tests run on every rank (see ``_launch.run``)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import mcp_fast
import mcp_fast.torch  # registers "mcp" even where entry points are not installed


def _init(backend: str = "mcp", timeout: float = 60) -> None:
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))


def every_collective(rank: int, world: int) -> dict[str, Any]:
    _init()
    out: dict[str, Any] = {}
    r = float(rank)
    t = torch.arange(10, dtype=torch.float32) + r
    dist.all_reduce(t)
    out["all_reduce"] = t
    t = torch.full((4,), r + 1)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out["all_reduce_max"] = t
    t = torch.full((4,), r + 1, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    out["all_reduce_avg"] = t
    t = torch.full((3, 3), r) if rank == 1 % world else torch.zeros(3, 3)
    dist.broadcast(t, src=1 % world)
    out["broadcast"] = t
    t = torch.full((5,), r + 1)
    dist.reduce(t, dst=0)
    out["reduce"] = t if rank == 0 else None
    outs = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(outs, torch.full((2,), r))
    out["all_gather"] = torch.stack(outs)
    o = torch.zeros(world * 3)
    dist.all_gather_into_tensor(o, torch.full((3,), r))
    out["all_gather_into_tensor"] = o
    g = [torch.zeros(2) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((2,), r), gather_list=g, dst=0)
    out["gather"] = torch.stack(g) if g is not None else None
    s = torch.zeros(2)
    dist.scatter(s, [torch.full((2,), float(i * 10)) for i in range(world)] if rank == 0 else None)
    out["scatter"] = s
    rs = torch.zeros(2)
    dist.reduce_scatter(rs, [torch.full((2,), float(rank + i)) for i in range(world)])
    out["reduce_scatter"] = rs
    rs = torch.zeros(2)
    dist.reduce_scatter_tensor(rs, torch.arange(2 * world, dtype=torch.float32) + r)
    out["reduce_scatter_tensor"] = rs
    a2a_in = torch.arange(world * 2, dtype=torch.float32) + 100 * r
    a2a_out = torch.zeros(world * 2)
    dist.all_to_all_single(a2a_out, a2a_in)
    out["all_to_all_single"] = a2a_out
    # uneven splits: rank r sends (i + 1) elements to rank i
    in_splits = [i + 1 for i in range(world)]
    out_splits = [rank + 1] * world
    a2a_in = torch.cat([torch.full((i + 1,), float(100 * rank + i)) for i in range(world)])
    a2a_out = torch.zeros(sum(out_splits))
    dist.all_to_all_single(a2a_out, a2a_in, out_splits, in_splits)
    out["all_to_all_uneven"] = a2a_out
    outs = [torch.zeros(1) for _ in range(world)]
    dist.all_to_all(outs, [torch.full((1,), float(10 * rank + i)) for i in range(world)])
    out["all_to_all"] = torch.cat(outs)
    dist.barrier()
    # point to point, blocking and async
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    buf = torch.zeros(3)
    if world > 1:
        sw = dist.isend(torch.full((3,), r), dst=nxt)
        rw = dist.irecv(buf, src=prv)
        sw.wait()
        rw.wait()
    out["p2p"] = buf
    # async collective handles, futures
    t = torch.ones(1000) * (rank + 1)
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    work.wait()
    out["async"] = t
    out["future"] = fut.value()[0]
    # coalesced
    ts = [torch.ones(3) * r, torch.ones(2, 2) * (r + 1)]
    dist.all_reduce_coalesced(ts)
    out["coalesced"] = [x.clone() for x in ts]
    # sub-groups: every rank calls new_group; only members run on it
    sub = dist.new_group([0, world - 1])
    if rank in (0, world - 1):
        t = torch.ones(4) * (rank + 1)
        dist.all_reduce(t, group=sub)
        out["subgroup"] = t
    dtypes = {}
    for dt in [torch.bfloat16, torch.float16, torch.int64, torch.uint8]:
        t = torch.ones(7, dtype=dt) * (rank + 1)
        dist.all_reduce(t)
        dtypes[str(dt)] = t.to(torch.float64)
    out["dtypes"] = dtypes
    out["backend"] = dist.get_backend()
    dist.destroy_process_group()
    return out


class Net(nn.Module):
    def __init__(self, with_unused: bool) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        # A layer that never takes part: DDP needs find_unused_parameters for it.
        self.unused = nn.Linear(4, 4) if with_unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


_HOOK_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hook")


def strided_views(rank: int, world: int) -> dict[str, Any]:
    """Collectives on views that are not contiguous (a column, a transpose, every other
    element); returns each view's base, so the test also sees the elements around the view
    stay untouched."""
    _init()
    out: dict[str, Any] = {}
    m = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (rank + 1)
    dist.all_reduce(m[:, 1])
    out["all_reduce_column"] = m
    t = torch.arange(6, dtype=torch.float64).reshape(2, 3) + rank
    dist.all_reduce(t.t(), op=dist.ReduceOp.MAX)
    out["all_reduce_transpose"] = t
    b = torch.full((2, 6), float(rank + 7))
    dist.broadcast(b[:, ::2], src=world - 1)
    out["broadcast_every_other"] = b
    base = torch.zeros(world, 4)
    dist.all_gather([base[i, ::2] for i in range(world)], torch.full((2,), float(rank)))
    out["all_gather_into_views"] = base
    rs = torch.zeros(2, 2)
    dist.reduce_scatter(rs[:, 0], [torch.full((2,), float(rank + i)) for i in range(world)])
    out["reduce_scatter_into_column"] = rs
    dist.destroy_process_group()
    return out


def _hook_from_thread(state, bucket):  # type: ignore[no-untyped-def]
    """A comm hook whose future is completed from another thread (one thread, so that the
    buckets' all-reduces are issued in the same order on every rank). No annotations: DDP
    checks them against dist.GradBucket, which postponed annotations would hide."""
    t = bucket.buffer()
    fut: torch.futures.Future = torch.futures.Future()

    def run() -> None:
        try:
            dist.all_reduce(t, group=state)
            fut.set_result(t / dist.get_world_size(state))
        except Exception as e:
            fut.set_exception(e)

    _HOOK_THREAD.submit(run)
    return fut


def ddp_train(rank: int, world: int, backend: str, mode: str, steps: int = 5) -> list[torch.Tensor]:
    """Trains Net for a few steps with DDP in `mode`; returns the final parameters."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.distributed.algorithms.join import Join

    _init(backend)
    torch.manual_seed(0)
    model = Net(with_unused=mode == "find_unused")
    kwargs: dict[str, Any] = {}
    if mode == "find_unused":
        kwargs["find_unused_parameters"] = True
    if mode == "bucket_view":
        kwargs["gradient_as_bucket_view"] = True
    if mode == "static_graph":
        kwargs["static_graph"] = True
    # Small buckets (several all-reduces per step), except for PowerSGD, whose per-bucket
    # callback chains issue collectives from completion threads: with several buckets their
    # order across ranks would depend on thread timing, for any backend; and compiled DDP,
    # whose graph splitter wants the first bucket no larger than the others.
    bucket_mb = 25.0 if mode in ("hook_powersgd", "compiled") else 0.0001
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb, **kwargs)
    if mode == "hook_allreduce":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    if mode == "hook_fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    if mode == "hook_powersgd":
        state = psgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=1,
            start_powerSGD_iter=2,
            min_compression_rate=0.0,
        )
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
    if mode == "hook_thread":
        ddp.register_comm_hook(dist.group.WORLD, _hook_from_thread)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    if mode == "compiled" and backend == "mcp":
        # Dynamo splits the graph at the buckets (DDPOptimizer) and runs DDP's own Python
        # (bucket rebuilding) eagerly, calling the group from there. aot_eager: the same
        # Dynamo path as inductor without needing a C++ compiler. Gloo, the reference, runs
        # eagerly: once Dynamo is imported, its group's teardown can deadlock in torch
        # (the destructor joins a thread that waits for the GIL it holds).
        ddp = torch.compile(ddp, backend="aot_eager")
    gen = torch.Generator().manual_seed(100 + rank)
    n_steps = steps + (rank if mode == "join" else 0)  # uneven inputs for Join
    data = [
        (torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen))
        for _ in range(n_steps)
    ]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        loss = ((ddp(x) - y) ** 2).mean()
        loss.backward()
        opt.step()

    if mode == "join":
        with Join([ddp]):
            for x, y in data:
                step(x, y)
    elif mode == "no_sync":
        for i, (x, y) in enumerate(data):
            if i % 2 == 0:
                with ddp.no_sync():
                    opt.zero_grad()
                    ((ddp(x) - y) ** 2).mean().backward()
            else:
                loss = ((ddp(x) - y) ** 2).mean()
                loss.backward()  # accumulates the no_sync step's gradients, then syncs
                opt.step()
    else:
        for x, y in data:
            step(x, y)
    if mode == "compiled" and backend == "mcp":
        from torch._dynamo.utils import counters

        # A torch.compile that fell back to eager would train the same parameters.
        if counters["stats"]["unique_graphs"] < 1:
            raise RuntimeError(f"torch.compile captured no graph: {dict(counters['stats'])}")
    params = [p.detach().clone() for p in model.parameters()]
    dist.destroy_process_group()
    return params


def fsdp2_train(
    rank: int,
    world: int,
    backend: str,
    steps: int = 4,
    replicas: int = 1,
    divide_factor: float | None = None,
    force_sum: bool = False,
) -> dict[str, Any]:
    """Trains Net sharded with FSDP2 (``fully_shard`` per layer and at the root: all-gathers
    before forward and backward, reduce-scatters after), accumulating gradients over two
    micro-batches per step with gradient sync off for the first; returns this rank's full
    parameters and the initial ones (all-gathered from the shards). ``replicas`` > 1 is HSDP:
    a 2-D mesh of that many replicas of a shard group each, whose gradients are all-reduced
    across the replicas (the mesh's subgroups are groups of the backend too).
    ``divide_factor`` divides the summed gradients by it instead of the world size: FSDP2
    reduce-scatters with PREMUL_SUM for that, or with SUM and divides after when
    ``force_sum``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _init(backend)
    mesh = None
    if replicas > 1:
        shape = (replicas, world // replicas)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = Net(with_unused=False)
    initial = [p.detach().clone() for p in model.parameters()]
    for module in (model.a, model.b, model):
        fully_shard(module, mesh=mesh)
        if divide_factor is not None:
            module.set_gradient_divide_factor(divide_factor)
            module.set_force_sum_reduction_for_comms(force_sum)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        opt.zero_grad()
        for micro in range(2):
            model.set_requires_gradient_sync(micro == 1)
            x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)
            ((model(x) - y) ** 2).mean().backward()
        opt.step()
    full = [p.full_tensor().detach().clone() for p in model.parameters()]
    dist.destroy_process_group()
    return {"full": full, "initial": initial}


def shape_mismatch(rank: int, world: int) -> None:
    _init(timeout=20)
    dist.all_reduce(torch.zeros(10 + rank))


def _outcome(call: Callable[[], object], result: Any) -> Any:
    """What a collective that may be refused gave: ``result`` once ``call`` returned, or its
    error as "Type: message"."""
    try:
        call()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return result


def _and_next_all_reduce(rank: int, out: dict[str, Any]) -> dict[str, Any]:
    """Adds one all-reduce after the collective (whether the group goes on) and leaves."""
    t = torch.full((2,), rank + 1.0)
    dist.all_reduce(t)
    out["next"] = t
    dist.destroy_process_group()
    return out


def all_to_all_misfit_for_itself(rank: int, world: int) -> dict[str, Any]:
    """Rank 1's split sizes disagree at its own index (it sends itself 2 elements and
    expects 1); what it exchanges with rank 0 agrees. Returns each rank's output (or its
    error), what it received, and the next all-reduce."""
    _init(timeout=20)
    inp = torch.arange(4, dtype=torch.float32) + 10 * rank
    res = torch.full((4 if rank == 0 else 3,), -1.0)
    splits_out = [2, 2] if rank == 0 else [2, 1]
    a2a = _outcome(lambda: dist.all_to_all_single(res, inp, splits_out, [2, 2]), res)
    return _and_next_all_reduce(rank, {"a2a": a2a, "received": res})


def all_to_all_splits_disagree(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 expects 3 elements from rank 0, which sends it 2; every other part agrees.
    Returns each rank's outcome (its output, or its error's type and message) and the next
    all-reduce."""
    _init(timeout=20)
    inp = torch.arange(4, dtype=torch.float32) + 10 * rank
    res = torch.full((4 if rank == 0 else 5,), -1.0)
    splits_out = [2, 2] if rank == 0 else [3, 2]
    a2a = _outcome(lambda: dist.all_to_all_single(res, inp, splits_out, [2, 2]), res)
    return _and_next_all_reduce(rank, {"a2a": a2a})


def scatter_sizes_disagree(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 scatters 2 elements to each rank; rank 1 expects 3. Returns each rank's
    outcome (its output, or its error's type and message) and the next all-reduce."""
    _init(timeout=20)
    res = torch.full((2 if rank == 0 else 3,), -1.0)
    parts = [torch.full((2,), 10.0 + r) for r in range(world)] if rank == 0 else None
    got = _outcome(lambda: dist.scatter(res, parts, src=0), res)
    return _and_next_all_reduce(rank, {"scatter": got})


def all_to_all_list_misshaped_for_itself(rank: int, world: int) -> dict[str, Any]:
    """The list form: each rank's output tensor for itself is 2 x 3, its input for itself
    3 x 2 (the same count); the parts between the ranks agree. Returns the error, the part
    received from the other rank and the next all-reduce."""
    _init(timeout=20)
    ins = [torch.arange(6.0).reshape(3, 2) + 10 * rank + 100 * i for i in range(world)]
    outs = [torch.full((3, 2), -1.0) for _ in range(world)]
    outs[rank] = torch.full((2, 3), -1.0)
    a2a = _outcome(lambda: dist.all_to_all(outs, ins), outs)
    return _and_next_all_reduce(rank, {"a2a": a2a, "from_peer": outs[1 - rank]})


def wrong_secret(rank: int, world: int) -> None:
    """Rank 1 holds another job secret than rank 0: it must be refused at the handshake."""
    os.environ["MCP_SECRET"] = "the job's secret" if rank == 0 else "a guess"
    _init(timeout=5)
    dist.all_reduce(torch.ones(4))


def wrong_collective(rank: int, world: int) -> None:
    _init(timeout=20)
    t = torch.zeros(4)
    if rank == 0:
        dist.broadcast(t, src=0)  # the root only sends: it cannot object right away
        time.sleep(0.5)
        dist.barrier()  # ... so it hears of the mismatch at its next operation
    else:
        dist.all_reduce(t)


def digits_loss(rank: int, world: int, codec: str | None, epochs: int = 6) -> float:
    """Trains the digits MLP with DDP over "mcp", optionally through the compression hook;
    returns the final training loss averaged over ranks."""
    from sklearn.datasets import load_digits

    from mcp_fast.torch import CompressionState, compression_hook

    _init()
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)[rank::world]
    y = torch.tensor(y, dtype=torch.long)[rank::world]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    if codec is not None:
        ddp.register_comm_hook(CompressionState(codec=codec, block=64), compression_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    last = 0.0
    for _ in range(epochs):
        total = 0.0
        steps = len(x) // 32
        for i in range(steps):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(
                ddp(x[i * 32 : (i + 1) * 32]), y[i * 32 : (i + 1) * 32]
            )
            loss.backward()
            opt.step()
            total += loss.item()
        last = total / steps
    t = torch.tensor([last])
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    dist.destroy_process_group()
    return float(t.item())


def torch_any_source(rank: int, world: int) -> list[int]:
    _init()
    got = []
    if rank == 0:
        for _ in range(world - 1):
            t = torch.zeros(4)
            src = dist.recv(t)
            assert float(t[0]) == float(src)
            got.append(src)
    else:
        time.sleep(0.3 * (world - 1 - rank))
        dist.send(torch.full((4,), float(rank)), dst=0)
    dist.barrier()
    dist.destroy_process_group()
    return got


def device_backends(rank: int, world: int) -> dict[str, Any]:
    """What torch's own code reads of ``group._get_backend(device)``, for the default group
    and a subgroup; then a batched exchange and an all-reduce on each, which take that path."""
    _init()
    sub = dist.new_group(list(range(world)))
    out: dict[str, Any] = {}
    for name, g in (("world", dist.group.WORLD), ("sub", sub)):
        for d in ("cpu", "cuda"):
            dev = torch.device(d)
            b = g._get_backend(dev)  # type: ignore[union-attr]
            out[f"{name}/{d}"] = [
                b.name(),
                b.supports_splitting,
                b.supports_coalescing,
                b.supports_tensor_alloc(dev),
            ]
        try:
            g._get_backend(torch.device("meta"))  # type: ignore[union-attr]
            out[f"{name}/meta"] = "accepted"
        except RuntimeError as e:
            out[f"{name}/meta"] = str(e)
        peer = (rank + 1) % world
        got = torch.zeros(3)
        ops = [
            dist.P2POp(dist.isend, torch.full((3,), float(rank)), peer, group=g),
            dist.P2POp(dist.irecv, got, (rank - 1) % world, group=g),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        t = torch.ones(4)
        dist.all_reduce(t, group=g)
        out[f"{name}/exchanged"] = got
        out[f"{name}/all_reduce"] = t
    dist.destroy_process_group()
    return out


def zero_and_post_local_sgd(rank: int, world: int, backend: str) -> dict[str, Any]:
    """torch.distributed.optim on top of DDP: ``ZeroRedundancyOptimizer`` (Adam's state
    sharded, parameters broadcast from their owners, the state consolidated on rank 0), and
    ``PostLocalSGDOptimizer`` with the post-local-SGD comm hook (all-reduced gradients for two
    steps, then local steps averaged every second one). Returns both models' parameters."""
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as pls
    from torch.distributed.algorithms.model_averaging import averagers
    from torch.distributed.optim import PostLocalSGDOptimizer, ZeroRedundancyOptimizer

    _init(backend)
    gen = torch.Generator().manual_seed(300 + rank)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ddp = nn.parallel.DistributedDataParallel(model)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    for _ in range(3):
        zero.zero_grad()
        ((ddp(torch.randn(4, 8, generator=gen)) - 1) ** 2).mean().backward()
        zero.step()
    zero.consolidate_state_dict(to=0)
    torch.manual_seed(0)
    local = nn.Linear(8, 4)
    ddp_local = nn.parallel.DistributedDataParallel(local)
    sub, _ = dist.new_subgroups(group_size=world)
    state = pls.PostLocalSGDState(process_group=None, subgroup=sub, start_localSGD_iter=2)
    ddp_local.register_comm_hook(state, pls.post_localSGD_hook)
    averager = averagers.PeriodicModelAverager(period=2, warmup_steps=2)
    opt = PostLocalSGDOptimizer(
        optim=torch.optim.SGD(local.parameters(), lr=0.1), averager=averager
    )
    for _ in range(6):
        opt.zero_grad()
        ((ddp_local(torch.randn(4, 8, generator=gen)) - 1) ** 2).mean().backward()
        opt.step()
    out = {
        "zero": [p.detach().clone() for p in model.parameters()],
        "local_sgd": [p.detach().clone() for p in local.parameters()],
    }
    dist.destroy_process_group()
    return out


def checkpoint_round_trip(rank: int, world: int, path: str) -> dict[str, Any]:
    """torch.distributed.checkpoint on an "mcp" group: ``async_save`` of each rank's model,
    ``load`` into a fresh one; then ``set_model_state_dict`` with ``broadcast_from_rank0``
    (rank 0's full state dict sent to every rank). Returns what each step produced."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
    )

    _init()
    torch.manual_seed(0)  # the same model on every rank, as DCP expects of unsharded ones
    saved = nn.Linear(6, 3)
    dcp.async_save({"model": saved.state_dict()}, checkpoint_id=path).result()
    loaded = nn.Linear(6, 3)
    state = {"model": loaded.state_dict()}
    dcp.load(state, checkpoint_id=path)
    loaded.load_state_dict(state["model"])
    torch.manual_seed(100 + rank)  # each rank starts from its own weights
    received = nn.Linear(6, 3)
    full = received.state_dict() if rank == 0 else {}
    set_model_state_dict(
        received,
        full,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    out = {
        "device_types": [str(d) for d in dist.group.WORLD._device_types],  # type: ignore[union-attr]
        "saved": [p.detach().clone() for p in saved.parameters()],
        "loaded": [p.detach().clone() for p in loaded.parameters()],
        "received": [p.detach().clone() for p in received.parameters()],
    }
    dist.destroy_process_group()
    return out


def cuda_collectives(rank: int, world: int, bind_device: bool = False) -> dict[str, Any]:
    """CUDA tensors through the backend (staged via pinned host buffers); ``bind_device``:
    ``init_process_group(device_id=...)`` as NCCL scripts call it."""
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    if bind_device:
        dist.init_process_group("mcp", timeout=timedelta(seconds=60), device_id=dev)
    else:
        _init()
    torch.cuda.set_device(dev)
    t = torch.full((1 << 20,), float(rank + 1), device=dev)
    dist.all_reduce(t)
    b = (
        torch.arange(1000, dtype=torch.float32, device=dev)
        if rank == 0
        else torch.zeros(1000, device=dev)
    )
    dist.broadcast(b, src=0)
    out = torch.empty(world * 4, device=dev)
    dist.all_gather_into_tensor(out, torch.full((4,), float(rank), device=dev))
    res = {"all_reduce": t.cpu(), "broadcast": b.cpu(), "all_gather": out.cpu()}
    dist.destroy_process_group()
    return res


def through_env_chaos(rank: int, world: int, rounds: int) -> dict[str, Any]:
    """All-reduces through ``init_process_group("mcp")`` with the faults and lane that the
    environment (``MCP_CHAOS``, ``MCP_LANE``) names; every result checked exactly."""
    _init()
    for i in range(rounds):
        t = torch.arange(50_000, dtype=torch.float32) % 7 + rank + i
        dist.all_reduce(t)
        want = sum(torch.arange(50_000, dtype=torch.float32) % 7 + r + i for r in range(world))
        torch.testing.assert_close(t, want, rtol=0, atol=0)
    g = dist.group.WORLD.mcp_group  # type: ignore[union-attr]
    out = {"lane": g.lane, "stats": g.stats()}
    dist.destroy_process_group()
    return out


TORCH_DTYPES = [
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
]


def _values(dtype: torch.dtype, rank: int, n: int = 12) -> torch.Tensor:
    base = torch.arange(n, dtype=torch.int64) % 5 + rank
    if dtype == torch.bool:
        return base % 2 == 1
    if dtype.is_complex:
        return torch.complex(base.double(), -base.double()).to(dtype)
    return base.to(dtype)


# Gloo moves none of these (its "Invalid scalar type"): the test computes what to expect.
NOT_IN_GLOO = {"int16", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2"}


def every_dtype(rank: int, world: int, backend: str) -> dict[str, Any]:
    """Every data-moving collective on every dtype torch has (those Gloo knows on Gloo), and
    all_reduce except on 8-bit floats; returns the results as bytes for an exact comparison."""
    _init(backend)
    out: dict[str, Any] = {}
    for name in TORCH_DTYPES:
        if backend == "gloo" and name in NOT_IN_GLOO:
            continue
        dt = getattr(torch, name)
        mine = _values(dt, rank)
        b = _values(dt, 0) if rank == 0 else torch.zeros_like(mine)
        dist.broadcast(b, src=0)
        g = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(g, mine)
        a2a = torch.zeros(world * 3, dtype=dt)
        dist.all_to_all_single(a2a, torch.cat([_values(dt, rank, 3)] * world))
        if rank == 0:
            dist.send(mine, dst=1)
            p2p = mine
        else:
            p2p = torch.zeros_like(mine)
            dist.recv(p2p, src=0)
        res = {"broadcast": b, "all_gather": torch.stack(g), "all_to_all": a2a, "p2p": p2p}
        if not name.startswith("float8"):
            r = mine.clone()
            dist.all_reduce(r)
            res["all_reduce"] = r
        out[name] = {k: v.contiguous().view(torch.uint8).numpy().tobytes() for k, v in res.items()}
    dist.destroy_process_group()
    return out


BITWISE_DTYPES = ["bool", "uint8", "int8", "int32", "int64"]


def bitwise_ops(rank: int, world: int, backend: str) -> dict[str, Any]:
    """all_reduce and reduce with BAND, BOR and BXOR on the integer dtypes Gloo reduces, as
    bytes; on mcp also what a floating tensor and an integer PREMUL_SUM raise."""
    _init(backend)
    out: dict[str, Any] = {}
    for name in BITWISE_DTYPES:
        dt = getattr(torch, name)
        # Bits that differ by rank and position, negative values among the signed ones.
        base = (torch.arange(40, dtype=torch.int64) * (2 * rank + 3) + 5 * rank) % 251 - 60
        mine = base % 2 == 1 if dt == torch.bool else base.to(dt)
        for op in ("BAND", "BOR", "BXOR"):
            r = mine.clone()
            dist.all_reduce(r, op=getattr(dist.ReduceOp, op))
            out[f"{name} all_reduce {op}"] = r.view(torch.uint8).numpy().tobytes()
            r = mine.clone()
            dist.reduce(r, dst=world - 1, op=getattr(dist.ReduceOp, op))
            if rank == world - 1:
                out[f"{name} reduce {op}"] = r.view(torch.uint8).numpy().tobytes()
    if backend == "mcp":
        for what, call in [
            ("float BXOR", lambda: dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BXOR)),
            (
                "int PREMUL_SUM",
                lambda: dist.all_reduce(
                    torch.ones(3, dtype=torch.int32), op=dist._make_nccl_premul_sum(2.0)
                ),
            ),
        ]:
            try:
                call()
                out[what] = "no error"
            except Exception as e:  # the type is what the test checks
                out[what] = f"{type(e).__name__}: {e}"
    dist.destroy_process_group()
    return out


def premul_sum(rank: int, world: int) -> dict[str, Any]:
    """NCCL's PREMUL_SUM (each rank's tensor times a factor, then summed) through every
    reducing call, with a float factor and a one-element tensor factor; returns the results,
    the inputs afterwards (where the call must leave them as they were) and the error of an
    integer tensor, which every rank raises before anything is sent."""
    _init()
    out: dict[str, Any] = {}
    x = torch.linspace(-3.0, 5.0, 12) * (rank + 1) + 0.1 * rank
    for fname, factor in [("float", 0.37), ("tensor", torch.tensor([1.0 / 3.0]))]:
        op = dist._make_nccl_premul_sum(factor)
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            key = f"{fname} {dtype}"
            t = x.to(dtype)
            r = t.clone()
            dist.all_reduce(r, op=op)
            out[f"{key} all_reduce"] = r
            r = t.clone()
            dist.reduce(r, dst=0, op=op)
            out[f"{key} reduce"] = r if rank == 0 else None
            inp, o = t.clone(), torch.empty(12 // world, dtype=dtype)
            dist.reduce_scatter_tensor(o, inp, op=op)
            out[f"{key} reduce_scatter_tensor"], out[f"{key} its input"] = o, inp
            o = torch.empty(12 // world, dtype=dtype)
            dist.reduce_scatter(o, list(t.clone().chunk(world)), op=op)
            out[f"{key} reduce_scatter"] = o
            pair = [t[:5].clone(), t[5:].clone()]
            dist.all_reduce_coalesced(pair, op=op)
            out[f"{key} all_reduce_coalesced"] = torch.cat(pair)
    try:
        dist.all_reduce(torch.ones(3, dtype=torch.int64), op=dist._make_nccl_premul_sum(2.0))
        out["int"] = "no error"
    except Exception as e:  # the type is what the test checks
        out["int"] = f"{type(e).__name__}: {e}"
    after = torch.full((2,), float(rank))
    dist.all_reduce(after)  # the group still works after the refused call
    out["after"] = after
    dist.destroy_process_group()
    return out


def hier_model() -> nn.Module:
    """Larger than the hierarchical all-reduce's 64 KiB threshold (16,897 float32)."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 1))


def hier_data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * rank + step)
    x = torch.randn(8, 64, generator=g)
    return x, x[:, :1] * 2 - x[:, 1:2]


def diloco_over_hosts(
    rank: int, world: int, hosts: list[str], steps: int, h: int
) -> dict[str, Any]:
    """DDP inside each host (``host_group``), DiLoCo between hosts over the whole job."""
    from torch.nn.parallel import DistributedDataParallel

    from mcp_fast.torch import DiLoCo, host_group

    os.environ["MCP_HOST_ID"] = hosts[rank]
    _init()
    host = host_group()
    model = hier_model()
    ddp = DistributedDataParallel(model, process_group=host)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = dist.group.WORLD.mcp_group  # type: ignore[union-attr]
    dl = DiLoCo(model, opt, g, sync_every=h)
    quic0, shm0 = g.stats()["bytes_sent"], g.shm_stats()["bytes_sent"]
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        x, y = hier_data(rank, step)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        dl.step()
    dl.finish()
    out = {
        "host_ranks": dist.get_process_group_ranks(host),
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
        "quic_bytes": g.stats()["bytes_sent"] - quic0,
        "shm_bytes": g.shm_stats()["bytes_sent"] - shm0,
    }
    dist.destroy_process_group()
    return out


def host_group_needs_mcp(rank: int, world: int) -> str:
    """``host_group`` on a Gloo group: a TypeError that says what to do."""
    from mcp_fast.torch import host_group

    _init("gloo")
    try:
        host_group()
    except TypeError as e:
        return str(e)
    finally:
        dist.destroy_process_group()
    return "no error"


def _coo(indices: torch.Tensor, values: torch.Tensor, size: tuple[int, ...]) -> torch.Tensor:
    return torch.sparse_coo_tensor(indices, values, size, check_invariants=True)


def _sparse_cases(rank: int) -> dict[str, torch.Tensor]:
    """Sparse tensors per rank: overlapping entries, a dense dimension, an uncoalesced input
    (a repeated index), a rank with no entries, every rank without entries."""
    gen = torch.Generator().manual_seed(7 + rank)
    idx = torch.tensor([[rank, 3, 5 + rank, 9]])
    return {
        "vector": _coo(idx, torch.randn(4, generator=gen), (12,)),
        "rows": _coo(torch.tensor([[0, 2 + rank]]), torch.randn(2, 3, generator=gen), (6, 3)),
        "float64_2d": _coo(
            torch.tensor([[1, rank], [0, 2]]),
            torch.randn(2, dtype=torch.float64, generator=gen),
            (3, 3),
        ),
        "uncoalesced": _coo(torch.tensor([[4, 4, rank]]), torch.tensor([1.5, 2.25, 0.5]), (8,)),
        "one_empty": _coo(
            torch.tensor([[1, 2]]) if rank == 0 else torch.zeros((1, 0), dtype=torch.int64),
            torch.tensor([1.0, 2.0]) if rank == 0 else torch.zeros(0),
            (4,),
        ),
        "all_empty": _coo(torch.zeros((1, 0), dtype=torch.int64), torch.zeros(0), (4,)),
    }


def sparse_all_reduce(rank: int, world: int, backend: str) -> dict[str, Any]:
    """Sums each sparse case across ranks in place; returns each result as (coalesced,
    indices, values, dense)."""
    _init(backend)
    out: dict[str, Any] = {}
    for name, t in _sparse_cases(rank).items():
        dist.all_reduce(t)
        out[name] = {
            "coalesced": torch.tensor(t.is_coalesced()),
            "indices": t._indices().clone(),
            "values": t._values().clone(),
            "dense": t.to_dense(),
        }
    t = _coo(torch.tensor([[0]]), torch.ones(1), (4,))
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    out["async"] = t.to_dense()
    dist.destroy_process_group()
    return out


def sparse_refused(rank: int, world: int, case: str) -> None:
    """A sparse all-reduce every rank must refuse: MAX on every rank or on rank 0 alone, or
    shapes that differ across ranks."""
    _init(timeout=20)
    if case in ("max", "max_on_one"):
        t = _coo(torch.tensor([[0]]), torch.ones(1), (4,))
        op = dist.ReduceOp.MAX if case == "max" or rank == 0 else dist.ReduceOp.SUM
        dist.all_reduce(t, op=op)
    else:
        t = _coo(torch.tensor([[0]]), torch.ones(1), (4 + rank,))
        dist.all_reduce(t)


def ddp_sparse_embedding(rank: int, world: int, backend: str, steps: int = 4) -> list[torch.Tensor]:
    """DDP over a model with a sparse embedding (its gradients are sparse all-reduces) and a
    dense layer; returns the final parameters."""
    _init(backend)
    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(50, 8, mode="sum", sparse=True), nn.Linear(8, 2))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(200 + rank)
    for _ in range(steps):
        x = torch.randint(0, 50, (16, 5), generator=gen)
        y = torch.randn(16, 2, generator=gen)
        opt.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()
        opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    dist.destroy_process_group()
    return params


def _mlp(width: int, depth: int) -> nn.Sequential:
    """A ``depth``-layer MLP of ``width`` features, the same weights on every rank."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def tensor_parallel_train(rank: int, world: int, backend: str, steps: int = 3) -> dict[str, Any]:
    """Megatron-style tensor parallelism with DTensor on a 1-D mesh of every rank: the first
    layer split by columns, the second by rows (an all-reduce in forward, one in backward),
    SGD on the same batches on every rank. Returns the losses and the full parameters, and
    those of the same model trained in this process alone."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    _init(backend)
    mesh = init_device_mesh("cpu", (world,))
    model, alone = _mlp(12, 2), _mlp(12, 2)
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, alone)]
    gen = torch.Generator().manual_seed(7)  # the same batches on every rank
    losses: dict[str, list[float]] = {"tp": [], "alone": []}
    for _ in range(steps):
        x, y = torch.randn(6, 12, generator=gen), torch.randn(6, 12, generator=gen)
        for key, m, opt in zip(("tp", "alone"), (model, alone), opts, strict=True):
            opt.zero_grad()
            loss = ((m(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            losses[key].append(float(loss))
    full = [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for p in model.parameters()
    ]
    dist.destroy_process_group()
    return {
        "losses": losses,
        "full": full,
        "alone": [p.detach().clone() for p in alone.parameters()],
    }


def pipeline_train(rank: int, world: int, backend: str, schedule: str) -> dict[str, Any]:
    """One pipeline-parallel training step with ``torch.distributed.pipelining``: each rank
    holds one stage (two layers) of a ``2 x world``-layer MLP, four micro-batches pass
    through the schedule (activations forward, gradients back, point to point). Returns this
    stage's parameters after the step, the last stage's output and losses, and the same
    from the whole model trained in this process alone."""
    import inspect

    from torch.distributed import pipelining

    _init(backend)
    width, n_micro = 10, 4
    full, alone = _mlp(width, 2 * world), _mlp(width, 2 * world)
    stage_mod = full[4 * rank : 4 * rank + 4]  # (Linear, Tanh) x 2
    stage = pipelining.PipelineStage(stage_mod, rank, world, torch.device("cpu"))
    sched_cls = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}[schedule]
    kwargs: dict[str, Any] = {}
    if "scale_grads" in inspect.signature(sched_cls.__init__).parameters:
        kwargs["scale_grads"] = False  # gradients summed over micro-batches, as below
    sched = sched_cls(stage, n_micro, loss_fn=lambda o, t: ((o - t) ** 2).mean(), **kwargs)
    gen = torch.Generator().manual_seed(11)
    x, y = torch.randn(8, width, generator=gen), torch.randn(8, width, generator=gen)
    opt = torch.optim.SGD(stage_mod.parameters(), lr=0.1)
    opt.zero_grad()
    out: dict[str, Any] = {}
    if rank == 0:
        sched.step(x)
    elif rank == world - 1:
        losses: list[torch.Tensor] = []
        out["output"] = sched.step(target=y, losses=losses).detach().clone()
        out["losses"] = [float(v) for v in losses]
    else:
        sched.step()
    opt.step()
    dist.destroy_process_group()
    with torch.no_grad():
        out["ref_output"] = alone(x)
    ref_opt = torch.optim.SGD(alone.parameters(), lr=0.1)
    ref_opt.zero_grad()
    pairs = zip(x.chunk(n_micro), y.chunk(n_micro), strict=True)
    ref_losses = [((alone(xc) - yc) ** 2).mean() for xc, yc in pairs]
    torch.stack(ref_losses).sum().backward()
    ref_opt.step()
    out["stage"] = [p.detach().clone() for p in stage_mod.parameters()]
    out["ref_stage"] = [p.detach().clone() for p in alone[4 * rank : 4 * rank + 4].parameters()]
    out["ref_losses"] = [float(v) for v in ref_losses]
    return out


def interrupted(rank: int, world: int, flag: str) -> dict[str, Any]:
    """``workers.interrupted`` through ``dist.all_reduce`` and ``dist.recv`` on "mcp"."""
    from workers import refusal, seconds_to_interrupt, wait_for_file

    _init(timeout=120)
    if rank == 1:
        try:
            dist.recv(torch.zeros(4), src=0)
        except mcp_fast.PeerLostError as e:
            open(flag, "w").close()
            return {"error": "PeerLostError", "rank": e.rank}
        raise AssertionError("rank 0 sent nothing, yet the receive finished")
    late = seconds_to_interrupt(
        lambda: dist.all_reduce(torch.ones(1 << 18)), "the all-reduce without rank 1"
    )
    then = refusal(dist.barrier, mcp_fast.GroupClosedError)
    return {"late": late, **then, "told": wait_for_file(flag, 60)}


def interrupted_init(rank: int, world: int) -> float:
    """Rank 1 waits in ``init_process_group("mcp")`` for a rank 0 that holds torch's store
    but never starts the backend, and gets Ctrl-C: how late the KeyboardInterrupt came."""
    from workers import seconds_to_interrupt

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank == 0:
        store = dist.TCPStore(host, port, world, is_master=True, wait_for_workers=False)
        store.wait(["done"], timedelta(seconds=60))
        return 0.0
    late = seconds_to_interrupt(
        lambda: _init(timeout=120), "the init without rank 0's backend", after=2.0
    )
    dist.TCPStore(host, port, world, is_master=False).set("done", "1")
    return late
