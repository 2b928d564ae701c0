"""DeltaCheckpointer: exact round trips, delta chains, crash safety, corruption, prune/verify,
and the mcp-ckpt CLI."""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mcp_fast.checkpoint import CheckpointError, DeltaCheckpointer
from mcp_fast.errors import MCPError


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Same types, dtypes, shapes and bits, recursively."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        raw_a = a.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        raw_b = b.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert raw_a == raw_b, where
        if isinstance(a, torch.nn.Parameter):
            assert a.requires_grad == b.requires_grad, where
    elif isinstance(a, np.ndarray | np.generic):
        assert a.dtype == b.dtype and np.shape(a) == np.shape(b), where
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), where
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), where
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}/{i}")
    elif isinstance(a, float):
        assert np.float64(a).tobytes() == np.float64(b).tobytes(), where
    else:
        assert a == b, where


def training_state(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model[2].to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 16, generator=g)
    out = model[2](model[1](model[0](x)).to(torch.bfloat16))
    opt.zero_grad()
    out.float().pow(2).mean().backward()
    opt.step()


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "step": step,
        "loss": float("nan") if step % 7 == 0 else 1.0 / (step + 1),
        "name": "run-α",
        "history": [1, 2.5, None, True, b"\x00\xff", 3 + 4j],
        "ids": (np.int64(step), np.float32(0.5)),
        "mask": np.arange(10) % 3 == 0,
        "ints": {1: torch.arange(5, dtype=torch.int16) * step, (2, "x"): np.zeros((2, 0))},
        "scalar": torch.tensor(float(step), dtype=torch.float64),
        "param": torch.nn.Parameter(torch.ones(3) * step),
    }


def snapshot(state: Any) -> Any:
    """A deep copy (tensors cloned) of a state, to compare with later loads."""
    if isinstance(state, torch.nn.Parameter):
        return torch.nn.Parameter(state.detach().clone(), requires_grad=state.requires_grad)
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, np.ndarray):
        return state.copy()
    if isinstance(state, dict):
        d = type(state)((k, snapshot(v)) for k, v in state.items())
        if hasattr(state, "_metadata"):
            d._metadata = state._metadata  # type: ignore[attr-defined]
        return d
    if isinstance(state, list | tuple):
        return type(state)(snapshot(v) for v in state)
    return state


def test_round_trip_of_every_supported_type(tmp_path: Path) -> None:
    model, opt = training_state()
    train_step(model, opt, 0)
    state = full_state(model, opt, 3)
    ckpt = DeltaCheckpointer(tmp_path)
    ckpt.save(state, 3)
    loaded = ckpt.load()
    assert_same(state, loaded)
    assert isinstance(loaded["model"], collections.OrderedDict)
    model2, opt2 = training_state(seed=1)
    model2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["optim"])
    assert_same(model2.state_dict(), model.state_dict())


def test_chain_of_50_deltas_with_periodic_full_snapshots(tmp_path: Path) -> None:
    model, opt = training_state()
    ckpt = DeltaCheckpointer(tmp_path, full_every=10)
    saved = {}
    for step in range(50):
        train_step(model, opt, step)
        state = full_state(model, opt, step)
        ckpt.save(state, step)
        saved[step] = snapshot(state)
    info = ckpt.info()
    assert [s.kind for s in info] == (["full"] + ["delta"] * 9) * 5
    assert all(s.base == s.step - 1 for s in info if s.kind == "delta")
    for step in (0, 1, 9, 10, 27, 49):
        assert_same(saved[step], ckpt.load(step), f"step {step}")
    assert_same(saved[49], DeltaCheckpointer(tmp_path).load())
    assert all(r.ok for r in ckpt.verify())
    deltas = [s.stored_bytes for s in info if s.kind == "delta"]
    fulls = [s.stored_bytes for s in info if s.kind == "full"]
    assert max(deltas) < min(fulls)


def test_unchanged_tensors_are_skipped_and_structure_may_change(tmp_path: Path) -> None:
    ckpt = DeltaCheckpointer(tmp_path, full_every=100)
    big = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
    ckpt.save({"w": big, "b": np.ones(3)}, 0)
    ckpt.save({"w": big, "b": np.ones(3) * 2, "new": torch.zeros(2, 2)}, 1)
    ckpt.save({"w": big.reshape(1000, 100), "new": torch.zeros(2, 2, dtype=torch.int8)}, 2)
    modes = {r.path: r.mode for r in ckpt.records(1)}
    assert modes == {"/w": "unchanged", "/b": "delta", "/new": "full"}
    assert {r.path: r.mode for r in ckpt.records(2)} == {"/w": "full", "/new": "full"}
    assert ckpt.info()[1].stored_bytes < 2000
    assert_same(
        ckpt.load(2), {"w": big.reshape(1000, 100), "new": torch.zeros(2, 2).to(torch.int8)}
    )
    assert_same(ckpt.load(1)["b"], np.ones(3) * 2)


def test_steps_prune_and_new_instance(tmp_path: Path) -> None:
    ckpt = DeltaCheckpointer(tmp_path, full_every=3)
    for step in range(0, 80, 10):
        ckpt.save({"x": np.full(4, step)}, step)
    assert ckpt.steps() == [0, 10, 20, 30, 40, 50, 60, 70]
    (tmp_path / ".tmp-step-stray").write_bytes(b"junk")
    # keep the last 2 (60 delta of 60? kinds: F D D F D D F D) -> 70 needs 60
    assert ckpt.prune(keep=2) == [0, 10, 20, 30, 40, 50]
    assert ckpt.steps() == [60, 70]
    assert not (tmp_path / ".tmp-step-stray").exists()
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [
        "step-000000000060.mcdc",
        "step-000000000070.mcdc",
    ]
    assert ckpt.prune(keep=1) == []  # 70 is a delta on 60: both stay
    again = DeltaCheckpointer(tmp_path)
    assert again.save({"x": np.full(4, 80)}, 80).kind == "full"  # no reference in memory
    assert again.save({"x": np.full(4, 90)}, 90).kind == "delta"
    with pytest.raises(ValueError, match="not after"):
        again.save({"x": 1}, 90)
    with pytest.raises(CheckpointError, match="no such step"):
        again.load(5)
    with pytest.raises(TypeError, match="/bad"):
        again.save({"bad": object()}, 100)
    # a save refused before anything was written keeps the chain going
    assert again.save({"x": np.full(4, 100)}, 100).kind == "delta"
    with pytest.raises(ValueError):
        DeltaCheckpointer(tmp_path, full_every=0)


def _steps_files(tmp_path: Path) -> dict[int, Path]:
    return {int(p.stem.split("-")[1]): p for p in tmp_path.glob("step-*.mcdc")}


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_file_names_file_and_step_and_earlier_steps_load(
    tmp_path: Path, damage: str
) -> None:
    ckpt = DeltaCheckpointer(tmp_path, full_every=3)
    rng = np.random.default_rng(1)
    w = rng.standard_normal(20_000).astype(np.float32)
    saved = {}
    for step in range(6):
        w = w + rng.standard_normal(w.size).astype(np.float32) * 1e-3
        ckpt.save({"w": w, "i": step}, step)
        saved[step] = w.copy()
    path = _steps_files(tmp_path)[4]
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 3] ^= 0x01
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[: len(data) - 100]))
    else:
        path.unlink()
    for step in (4, 5):  # 5 is a delta on 4
        with pytest.raises(CheckpointError) as ex:
            ckpt.load(step)
        assert isinstance(ex.value, MCPError)
        assert ex.value.step == 4 and ex.value.path == path
        assert "step 4" in str(ex.value) and str(path) in str(ex.value)
    for step in (0, 1, 2, 3):
        assert ckpt.load(step)["w"].tobytes() == saved[step].tobytes()
    results = {r.step: r for r in ckpt.verify()}
    assert [s for s, r in results.items() if not r.ok] == [4, 5]
    assert str(path) in (results[4].error or "")


def test_corrupt_manifest_is_reported(tmp_path: Path) -> None:
    ckpt = DeltaCheckpointer(tmp_path)
    ckpt.save({"a": np.zeros(3)}, 1)
    manifest = tmp_path / "MANIFEST.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'"step": 1', b'"step": 2'))
    with pytest.raises(CheckpointError, match=r"MANIFEST\.json"):
        ckpt.load()


def test_lossy_errors_do_not_accumulate_along_a_chain(tmp_path: Path) -> None:
    ckpt = DeltaCheckpointer(tmp_path, full_every=20, max_abs_error=1e-4)
    rng = np.random.default_rng(2)
    w = rng.standard_normal(10_000).astype(np.float32)
    ints = np.arange(100)
    for step in range(15):
        w = w + rng.standard_normal(w.size).astype(np.float32) * 1e-3
        ckpt.save({"w": w, "ints": ints + step}, step)
        back = ckpt.load(step)
        assert np.abs(back["w"].astype(np.float64) - w).max() <= 1e-4
        assert back["ints"].tobytes() == (ints + step).tobytes()
    assert {r.mode for r in ckpt.records(14)} == {"lossy", "delta"}


CHILD = textwrap.dedent(
    """
    import sys, numpy as np
    from mcp_fast import checkpoint
    from mcp_fast.checkpoint import DeltaCheckpointer
    directory, die_at = sys.argv[1], int(sys.argv[2])
    if die_at >= 0:  # die at the die_at-th directory fsync (inside a save)
        calls = [0]
        real = checkpoint._fsync_dir
        def fsync_then_maybe_die(d):
            real(d)
            calls[0] += 1
            if calls[0] == die_at:
                import os; os._exit(9)
        checkpoint._fsync_dir = fsync_then_maybe_die
    base = np.random.default_rng(0).standard_normal(1_000_000).astype(np.float32)
    ckpt = DeltaCheckpointer(directory, full_every=4)
    start = ckpt.steps()[-1] + 1 if ckpt.steps() else 0
    for step in range(start, start + 200):
        ckpt.save({"w": base + np.float32(step * 1e-3), "step": step}, step)
        print(step, flush=True)
    """
)


def _expected(step: int) -> bytes:
    base = np.random.default_rng(0).standard_normal(1_000_000).astype(np.float32)
    return (base + np.float32(step * 1e-3)).tobytes()


def _check_all_steps_load(directory: Path) -> None:
    ckpt = DeltaCheckpointer(directory)
    steps = ckpt.steps()
    assert steps == list(range(len(steps)))
    for step in steps:
        state = ckpt.load(step)
        assert state["step"] == step
        assert state["w"].tobytes() == _expected(step)


def test_killed_at_every_point_of_save_never_loads_wrong(tmp_path: Path) -> None:
    # deterministic: die right after the step file's rename (1st fsync of a save: the step
    # file exists but is not in the manifest) and right after the manifest (2nd fsync)
    for die_at in (1, 4, 5):
        subprocess.run(
            [sys.executable, "-c", CHILD, str(tmp_path), str(die_at)], check=False, timeout=60
        )
        _check_all_steps_load(tmp_path)
    assert DeltaCheckpointer(tmp_path).steps() == [0, 1, 2, 3]


def test_kill_9_at_random_moments_during_save(tmp_path: Path) -> None:
    rnd = random.Random(3)
    for _ in range(4):
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(tmp_path), "-1"], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None
        proc.stdout.readline()  # at least one save done in this run
        time.sleep(rnd.uniform(0.0, 0.15))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        _check_all_steps_load(tmp_path)
    assert len(DeltaCheckpointer(tmp_path).steps()) >= 4


def test_cli_info_verify_stats_restore(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mcp_fast import ckpt_cli

    model, opt = training_state()
    ckpt = DeltaCheckpointer(tmp_path / "ck", full_every=3)
    for step in range(3):
        train_step(model, opt, step)
        ckpt.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, step)
    expected = snapshot({"model": model.state_dict(), "optim": opt.state_dict(), "step": 2})

    assert ckpt_cli.main(["info", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "3 steps" in out and " full " in out and " delta " in out

    assert ckpt_cli.main(["stats", str(tmp_path / "ck"), "--step", "1"]) == 0
    out = capsys.readouterr().out
    assert "/model/0.weight" in out and "bfloat16" in out and "total" in out

    assert ckpt_cli.main(["restore", str(tmp_path / "ck"), "2", str(tmp_path / "s.pt")]) == 0
    assert_same(torch.load(tmp_path / "s.pt", weights_only=True), expected)
    assert ckpt_cli.main(["restore", str(tmp_path / "ck"), "2", str(tmp_path / "s.npz")]) == 0
    with np.load(tmp_path / "s.npz") as z:
        w = z["model/0.weight"]
        assert w.tobytes() == expected["model"]["0.weight"].numpy().tobytes()
        assert z["model/2.weight"].dtype == np.float32  # bfloat16 widened exactly
        assert int(z["step"]) == 2
    capsys.readouterr()

    assert ckpt_cli.main(["verify", str(tmp_path / "ck")]) == 0
    assert "3 of 3 steps OK" in capsys.readouterr().out
    f = tmp_path / "ck" / "step-000000000001.mcdc"
    f.write_bytes(f.read_bytes()[:-1])
    assert ckpt_cli.main(["verify", str(tmp_path / "ck")]) == 1
    out = capsys.readouterr().out
    assert "step 1: FAILED" in out and str(f) in out and "step 2: FAILED" in out
    assert ckpt_cli.main(["restore", str(tmp_path / "ck"), "1", str(tmp_path / "x.pt")]) == 2
    err = capsys.readouterr().err
    assert "step 1" in err and str(f) in err

    for cmd in ("info", "verify", "restore", "stats"):
        with pytest.raises(SystemExit) as ex:
            ckpt_cli.main([cmd, "--help"])
        assert ex.value.code == 0
        assert "usage: mcp-ckpt" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        ckpt_cli.main([])
    proc = subprocess.run(
        [sys.executable, "-m", "mcp_fast.ckpt_cli", "info", str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0 and "3 steps" in proc.stdout


def test_verify_reports_progress_per_step(tmp_path: Path) -> None:
    model, opt = training_state()
    ckpt = DeltaCheckpointer(tmp_path, full_every=2)
    for step in range(3):
        train_step(model, opt, step)
        ckpt.save({"model": model.state_dict(), "step": step}, step)
    seen: list[int] = []
    results = ckpt.verify(progress=lambda r: seen.append(r.step))
    assert seen == [r.step for r in results] == [0, 1, 2]
    assert all(r.ok for r in results)
