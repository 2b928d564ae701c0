"""Every ```python block of README.md runs as it is, so that no example can rot.

Each block is written to a file of its own and run in a fresh interpreter (so that blocks that
start processes with 'spawn' work), with ``MASTER_PORT`` set to a free port and a timeout. The
blocks start the ranks, coordinators and servers they need themselves, on 127.0.0.1 only.
```bash blocks (torchrun, shell commands) are not run. Links to files of the repository must
point at files that exist.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _launch import free_port

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TIMEOUT = 240  # seconds per block: 0.2-6 s idle; the torch block took 68 s at load 13 on 2 vCPUs


def python_blocks() -> list[tuple[int, str]]:
    """(line number, source) of every ```python block."""
    text = README.read_text()
    blocks = []
    for m in re.finditer(r"^```python\n(.*?)^```$", text, flags=re.S | re.M):
        blocks.append((text.count("\n", 0, m.start()) + 1, m.group(1)))
    return blocks


BLOCKS = python_blocks()


def test_readme_has_examples_and_starts_with_the_two_commands() -> None:
    text = README.read_text()
    assert len(BLOCKS) >= 7
    assert text.split("\n")[2:6] == ["```", "make demo", "make test", "```"]
    assert len(text.split("\n")) <= 300, "the README is meant to be read in five minutes"


def test_readme_links_point_at_files() -> None:
    text = README.read_text()
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert targets and not missing, f"README links to missing files: {missing}"


@pytest.mark.parametrize(("line", "source"), BLOCKS, ids=[f"line{n}" for n, _ in BLOCKS])
def test_readme_block_runs(tmp_path: Path, line: int, source: str) -> None:
    script = tmp_path / f"readme_line{line}.py"
    script.write_text(source)
    env = dict(os.environ)
    env["MASTER_ADDR"] = "127.0.0.1"
    env["MASTER_PORT"] = str(free_port())
    env.setdefault("OMP_NUM_THREADS", "1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MCP_CHAOS", "MCP_SECRET"):
        env.pop(k, None)
    try:
        r = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"README block at line {line} ran past {TIMEOUT} s:\n{e.stdout}\n{e.stderr}")
    assert r.returncode == 0, (
        f"README block at line {line} failed (exit {r.returncode}):\n"
        f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    )


def test_docs_links_point_at_files() -> None:
    missing = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                missing.append(f"{page.name}: {target}")
    assert not missing, f"docs link to missing files: {missing}"
