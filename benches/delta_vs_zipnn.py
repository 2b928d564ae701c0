"""Checkpoint delta coding vs zstd-3 and ZipNN on consecutive checkpoints of a real run.

Trains an MLP (64-1024-1024-1024-10) on scikit-learn's digits with AdamW (synthetic data if
scikit-learn is missing), in float32 and in bfloat16, and takes the model + optimizer state at
steps t, t+1, t+10 and t+100. For each pair it reports, over all tensors:

* zstd-3   python ``zstandard`` level 3 on the raw bytes of the newer checkpoint;
* ZipNN    ``zipnn`` (PyPI) on the XOR delta of the two checkpoints (if installed);
* mcp      ``mcp_fast.delta.encode(prev, cur)`` (ulp distance to ``α · prev``, one rANS symbol
           per element for its magnitude class and sign, the low bits raw).

Ratios are raw bytes / stored bytes; throughputs are raw tensor bytes per second, single
thread unless marked 2T. Run:  python benches/delta_vs_zipnn.py [--quick]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from mcp_fast import delta

try:
    import zstandard
except ImportError:  # pragma: no cover
    zstandard = None  # type: ignore[assignment]
try:
    import zipnn
except ImportError:  # pragma: no cover
    zipnn = None  # type: ignore[assignment]


def load_data() -> tuple[torch.Tensor, torch.Tensor, str]:
    try:
        from sklearn.datasets import load_digits

        d = load_digits()
        x = torch.tensor(d.data / 16.0, dtype=torch.float32)
        return x, torch.tensor(d.target), "sklearn digits"
    except ImportError:
        g = torch.Generator().manual_seed(0)
        x = torch.rand(1797, 64, generator=g)
        return x, (x.sum(1) * 10).long() % 10, "synthetic"


def train_snapshots(dtype: torch.dtype, t0: int, gaps: list[int]) -> list[dict[str, np.ndarray]]:
    """Model + AdamW state (as uint8 views per tensor) at steps t0 and t0 + gap."""
    torch.manual_seed(0)
    x, y, _ = load_data()
    h = 1024
    model = torch.nn.Sequential(
        torch.nn.Linear(64, h),
        torch.nn.ReLU(),
        torch.nn.Linear(h, h),
        torch.nn.ReLU(),
        torch.nn.Linear(h, h),
        torch.nn.ReLU(),
        torch.nn.Linear(h, 10),
    ).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    wanted = {t0} | {t0 + g for g in gaps}
    snaps: dict[int, dict[str, np.ndarray]] = {}
    for step in range(max(wanted) + 1):
        idx = torch.randint(0, len(x), (64,))
        loss = torch.nn.functional.cross_entropy(model(x[idx].to(dtype)).float(), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step in wanted:
            state: dict[str, np.ndarray] = {}
            for k, v in model.state_dict().items():
                state[f"model.{k}"] = v.detach().clone()
            for pid, st in opt.state_dict()["state"].items():
                for k, v in st.items():
                    if v.numel() > 1:
                        state[f"opt.{pid}.{k}"] = v.detach().clone()
            snaps[step] = state
    return [snaps[t0]] + [snaps[t0 + g] for g in gaps]


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def timed(f: Callable[[], Any], repeat: int) -> tuple[Any, float]:
    best = float("inf")
    out = None
    for _ in range(repeat):
        t = time.perf_counter()
        out = f()
        best = min(best, time.perf_counter() - t)
    return out, best


def compare(prev: dict[str, Any], cur: dict[str, Any], dtype: str, repeat: int) -> dict[str, float]:
    total = sum(v.numel() * v.element_size() for v in cur.values())
    res: dict[str, float] = {"raw_mib": total / 2**20}
    if zstandard is not None:
        c = zstandard.ZstdCompressor(level=3)
        blobs, t = timed(lambda: [c.compress(raw(v)) for v in cur.values()], repeat)
        res["zstd3_ratio"] = total / sum(map(len, blobs))
    if zipnn is not None:
        xors = {
            k: (np.frombuffer(raw(prev[k]), np.uint8) ^ np.frombuffer(raw(v), np.uint8)).tobytes()
            for k, v in cur.items()
        }
        for threads in (1, 2):
            z = zipnn.ZipNN(input_format="byte", bytearray_dtype=dtype, threads=threads)
            blobs, t = timed(lambda z=z: [z.compress(b) for b in xors.values()], repeat)
            if threads == 1:
                res["zipnn_ratio"] = total / sum(map(len, blobs))
            sfx = "" if threads == 1 else "_2t"
            res["zipnn_enc_mbs" + sfx] = total / t / 1e6
            _, t = timed(lambda z=z, bl=blobs: [z.decompress(b) for b in bl], repeat)
            res["zipnn_dec_mbs" + sfx] = total / t / 1e6
    for threads in (1, 2):
        blobs, t = timed(
            lambda th=threads: {k: delta.encode(prev[k], v, threads=th) for k, v in cur.items()},
            repeat,
        )
        res[f"mcp_enc_mbs_{threads}t"] = total / t / 1e6
        outs, t = timed(
            lambda th=threads, bl=blobs: {
                k: delta.decode(prev[k], b, threads=th) for k, b in bl.items()
            },
            repeat,
        )
        res[f"mcp_dec_mbs_{threads}t"] = total / t / 1e6
        res["mcp_ratio"] = total / sum(map(len, blobs.values()))
        for k, v in cur.items():
            assert raw(outs[k]) == raw(v), k  # bit-exact
    return res


PEAK_CHILD = """
import sys, numpy as np
from mcp_fast import delta

def hwm():  # peak resident set (kB) since the last reset
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

def reset_hwm():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

n = int(sys.argv[1])
rng = np.random.default_rng(0)
prev = rng.standard_normal(n, dtype=np.float32)
cur = prev + (rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3)) * prev
reset_hwm()
base = hwm()
blob = delta.encode(prev, cur)
enc = hwm()
reset_hwm()
base2 = hwm()
back = delta.decode(prev, blob)
dec = hwm()
assert back.tobytes() == cur.tobytes()
print(base, enc, base2, dec, len(blob))
"""


def peak_memory(n: int) -> tuple[float, float]:
    """Peak extra RSS of encode and of encode+decode, in units of the tensor's size."""
    out = subprocess.run(
        [sys.executable, "-c", PEAK_CHILD, str(n)], capture_output=True, text=True, check=True
    ).stdout.split()
    base, enc, base2, dec = (int(v) * 1024 for v in out[:4])
    size = 4 * n
    return (enc - base) / size, (dec - base2) / size


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    ap.add_argument("--t0", type=int, default=200, help="training step of the first checkpoint")
    args = ap.parse_args(argv)
    gaps = [1, 10] if args.quick else [1, 10, 100]
    repeat = 1 if args.quick else 3
    _, _, source = load_data()
    print(f"data: {source}; zstandard: {zstandard is not None}; zipnn: {zipnn is not None}")
    hdr = (
        f"{'dtype':>8} {'gap':>4} {'MiB':>6} {'zstd3':>6} {'zipnn':>6} {'mcp':>6} "
        f"{'mcp/zipnn':>9} | enc 1T zipnn / mcp, 2T zipnn / mcp | dec 1T zipnn / mcp, "
        "2T zipnn / mcp   (MB/s)"
    )
    print(hdr)
    for tdtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        snaps = train_snapshots(tdtype, args.t0, gaps)
        for gap, cur in zip(gaps, snaps[1:], strict=True):
            r = compare(snaps[0], cur, name, repeat)
            zr = r.get("zipnn_ratio", float("nan"))
            print(
                f"{name:>8} {gap:>4} {r['raw_mib']:>6.1f} {r.get('zstd3_ratio', 0):>6.2f} "
                f"{zr:>6.2f} {r['mcp_ratio']:>6.2f} {r['mcp_ratio'] / zr:>9.2f} "
                f"| {r.get('zipnn_enc_mbs', 0):>6.0f} / {r['mcp_enc_mbs_1t']:>5.0f}, "
                f"{r.get('zipnn_enc_mbs_2t', 0):>5.0f} / {r['mcp_enc_mbs_2t']:>5.0f} "
                f"| {r.get('zipnn_dec_mbs', 0):>6.0f} / {r['mcp_dec_mbs_1t']:>5.0f}, "
                f"{r.get('zipnn_dec_mbs_2t', 0):>5.0f} / {r['mcp_dec_mbs_2t']:>5.0f}",
                flush=True,
            )
    enc, dec = peak_memory(16_000_000 if args.quick else 64_000_000)
    print(
        f"peak extra RSS, one float32 tensor with 1e-3 relative change: encode {enc:.2f}x the "
        f"tensor (blob included), decode {dec:.2f}x (output included)"
    )


if __name__ == "__main__":
    main()
