"""The ``torch.backends`` entry point: torch calls :func:`autoload` at the end of its own import,
so that ``init_process_group("mcp")`` works without importing mcp_fast first.

It lives outside ``mcp_fast.torch`` because importing that package imports torch: when a
program's first import is ``mcp_fast.torch``, torch's import runs this entry point while
``mcp_fast.torch`` is still half-loaded, and the package registers the backend itself once it
is loaded.
"""

from __future__ import annotations

import sys


def autoload() -> None:
    """Registers the backend ``"mcp"`` with torch.distributed (idempotent)."""
    loading = sys.modules.get("mcp_fast.torch.backend")
    if loading is not None and not hasattr(loading, "register"):
        return  # torch is being imported by mcp_fast.torch, which registers "mcp" when done
    from mcp_fast.torch.backend import register

    register()
