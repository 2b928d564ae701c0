"""Draw the figures of docs/benchmarks.md (and the README's headline) from docs/data/*.json.

    python benches/plots.py [--data docs/data] [--out docs/img]

Each JSON file is written by a benchmark's ``--json`` option (the command that made it is in
its ``meta``); a figure whose file is missing is skipped with a note. ``make plots`` runs this.

- ``loss.json``    (benches/bench_loss.py):    all-reduce time against packet loss, Gloo vs mcp
- ``codecs.json``  (benches/compare_codecs.py): codec speed-ups over Gloo on a capped link
- ``ddp.json``     (benches/bench_ddp.py):     DDP step times, loopback and lossy link
- ``elastic.json`` (benches/bench_elastic.py): steps committed over time, with the kills
- ``diloco.json``  (benches/bench_diloco.py):  training loss curves, DDP vs DiLoCo vs streaming
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

GLOO, MCP = "#d62728", "#1f77b4"


def _load(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        print(f"skip {path.stem}: {path} is missing (run the benchmark with --json {path})")
        return None
    return json.loads(path.read_text())


def _caption(ax: Any, meta: dict[str, Any]) -> None:
    ax.text(
        0.0,
        -0.2,
        textwrap.fill(meta.get("command", ""), 120)
        + f"\n{meta.get('date', '')}, {meta.get('cpus', '?')} CPUs",
        transform=ax.transAxes,
        fontsize=7,
        color="0.35",
        va="top",
    )


def _save(fig: Any, out: Path) -> None:
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    print(f"wrote {out} ({out.stat().st_size // 1024} KiB)")


def plot_loss(data: dict[str, Any], out: Path) -> None:
    rows = [r for r in data["rows"] if not r.get("rate")]
    lanes = data["meta"].get("lanes", ["auto"])
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for world, style in zip(sorted({r["world"] for r in rows}), ["-", "--", ":"], strict=False):
        for mib in sorted({r["mib"] for r in rows}):
            sel = sorted(
                (r for r in rows if r["world"] == world and r["mib"] == mib),
                key=lambda r: r["loss"],
            )
            xs = [100 * r["loss"] for r in sel]
            tag = f"{world} ranks, {mib} MiB"
            ax.plot(
                xs,
                [1e3 * r["gloo"] for r in sel],
                style,
                marker="o",
                color=GLOO,
                label=f"Gloo, {tag}",
            )
            for lane in lanes:
                ax.plot(
                    xs,
                    [1e3 * r[lane] for r in sel],
                    style,
                    marker="s",
                    color=MCP,
                    label=f"mcp_fast ({lane}), {tag}",
                )
    ax.set_yscale("log")
    ax.set_xlabel("packets dropped at random (%)")
    ax.set_ylabel("all-reduce time (ms, log scale)")
    ax.set_title(
        textwrap.fill("All-reduce over a lossy link: Gloo (TCP) vs mcp_fast (QUIC), same run", 70),
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    _caption(ax, data["meta"])
    _save(fig, out)


def plot_codecs(data: dict[str, Any], out: Path) -> None:
    times = data["times"]
    names = list(times)
    speed = [times["gloo"] / times[n] for n in names]
    fig, ax = plt.subplots(figsize=(7, 4))
    colors = [GLOO if n == "gloo" else MCP for n in names]
    bars = ax.bar([data["labels"].get(n, n) for n in names], speed, color=colors)
    for b, t in zip(bars, [times[n] for n in names], strict=True):
        ax.text(
            b.get_x() + b.get_width() / 2,
            b.get_height(),
            f"{t * 1e3:.0f} ms",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.axhline(1.0, color="0.5", lw=0.8)
    ax.set_ylabel("speed-up over Gloo (x)")
    ax.set_title(
        textwrap.fill(data["meta"].get("title", "all-reduce with codecs"), 70), fontsize=10
    )
    ax.tick_params(axis="x", labelsize=8)
    _caption(ax, data["meta"])
    _save(fig, out)


def plot_ddp(data: dict[str, Any], out: Path) -> None:
    links = list(data["links"])
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    for i, (backend, color) in enumerate([("gloo", GLOO), ("mcp", MCP)]):
        xs = [j + (i - 0.5) * width for j in range(len(links))]
        ys = [data["links"][lk][backend]["median_ms"] for lk in links]
        bars = ax.bar(xs, ys, width, color=color, label="Gloo" if backend == "gloo" else "mcp_fast")
        for b, y in zip(bars, ys, strict=True):
            ax.text(
                b.get_x() + b.get_width() / 2, y, f"{y:.0f}", ha="center", va="bottom", fontsize=8
            )
    ax.set_xticks(range(len(links)), [data["labels"].get(lk, lk) for lk in links])
    ax.set_ylabel("median DDP step (ms)")
    ax.set_title(textwrap.fill(data["meta"].get("title", "DDP step time"), 70), fontsize=10)
    ax.legend()
    _caption(ax, data["meta"])
    _save(fig, out)


def plot_elastic(data: dict[str, Any], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, color, label in [
        ("elastic", MCP, "mcp_fast elastic"),
        ("torchrun", GLOO, "torchrun restart-everything (Gloo)"),
    ]:
        run = data.get(key) or {}
        commits = run.get("commits") or []
        if commits:
            ax.plot(
                [c[0] for c in commits],
                [c[1] for c in commits],
                color=color,
                label=label,
                drawstyle="steps-post",  # nothing committed until the next point
            )
        for k in run.get("kills") or []:
            ax.axvline(k, color=color, alpha=0.3, lw=0.8)
    ax.set_xlabel("seconds since the job started (vertical lines: kill -9)")
    ax.set_ylabel("steps committed")
    ax.set_title(textwrap.fill(data["meta"].get("title", "recovery after kills"), 70), fontsize=10)
    ax.legend()
    _caption(ax, data["meta"])
    _save(fig, out)


def plot_diloco(data: dict[str, Any], out: Path) -> None:
    """Rank 0's training loss (its own batch, every 10 steps, averaged over 100 steps) of
    the loopback runs, with each run's held-out loss at the end in the legend."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = iter(["#2ca02c", MCP, "#9467bd", "#ff7f0e"])
    for r in data["runs"]:
        if r.get("link") != "loopback" or "failed" in r or r.get("stopped_early"):
            continue
        steps = [s for s, _ in r["train_losses"]]
        losses = [v for _, v in r["train_losses"]]
        smooth = [
            sum(losses[max(0, i - 9) : i + 1]) / len(losses[max(0, i - 9) : i + 1])
            for i in range(len(losses))
        ]
        label = f"{r['name']}: held-out {r['eval_loss']:.3f}, {r['bytes_sent'] / 1e6:,.0f} MB"
        ax.plot(steps, smooth, color=next(colors), label=label, lw=1.2)
    ax.set_ylim(top=3.0)  # the first hundred steps fall from 5; the gap is lower down
    ax.set_xlabel("inner step (4 members; DDP: step)")
    ax.set_ylabel("training loss (mean of the last 100 steps)")
    ax.set_title(
        textwrap.fill("DiLoCo H=50 and streaming F=4 against DDP every step, same tokens", 70),
        fontsize=10,
    )
    ax.legend(fontsize=8)
    _caption(ax, data["meta"])
    _save(fig, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="docs/data")
    p.add_argument("--out", default="docs/img")
    a = p.parse_args()
    data, out = Path(a.data), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, fn in [
        ("loss", plot_loss),
        ("codecs", plot_codecs),
        ("ddp", plot_ddp),
        ("elastic", plot_elastic),
        ("diloco", plot_diloco),
    ]:
        d = _load(data / f"{name}.json")
        if d is not None:
            fn(d, out / f"{name}.png")


if __name__ == "__main__":
    main()
