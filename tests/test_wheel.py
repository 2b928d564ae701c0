"""The wheel builds with maturin and works when pip-installed into a clean virtual env."""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

import mcp_fast as mcp

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_builds_and_installs_into_a_clean_venv(tmp_path: Path) -> None:
    maturin = shutil.which("maturin") or str(Path(sys.executable).parent / "maturin")
    dist = tmp_path / "dist"
    subprocess.run(
        [maturin, "build", "--release", "--quiet", "-o", str(dist)],
        cwd=ROOT,
        check=True,
        timeout=900,
    )
    (wheel,) = dist.glob("mcp_fast-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    subprocess.run([py, "-m", "pip", "install", "-q", str(wheel)], check=True, timeout=600)
    code = (
        "import numpy as np, mcp_fast as mcp, socket\n"
        "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(('127.0.0.1', 0))\n"
        "port = s.getsockname()[1]; s.close()\n"
        "with mcp.init(rank=0, world_size=1, master_port=port, secret='w') as g:\n"
        "    a = np.arange(5, dtype=np.float32); g.all_reduce(a)\n"
        "    assert a.tolist() == [0, 1, 2, 3, 4]\n"
        "print(mcp.__version__, mcp.PROTOCOL_VERSION)\n"
    )
    out = subprocess.run(
        [py, "-c", code], cwd=tmp_path, check=True, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.split() == ["0.1.0", mcp.PROTOCOL_VERSION]
    assert (env_dir / "bin" / "mcp-ckpt").exists()
