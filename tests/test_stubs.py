"""The type stubs of the extension module match it: mypy's stubtest on ``mcp_fast._core``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy")

ALLOWLIST = Path(__file__).with_name("stubtest_allowlist.txt")


def test_core_stubs_match_the_extension_module() -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy.stubtest",
            "mcp_fast._core",
            "--allowlist",
            str(ALLOWLIST),
            "--concise",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stdout + r.stderr
