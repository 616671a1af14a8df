"""Libra: an adaptive runtime for agentic RL post-training.

The public Python API (checked by `tests/unit/test_public_api.py`):

    libra.Env, libra.tool, libra.Tool, libra.ToolResult, libra.Context, libra.Trajectory

Importing `libra` is cheap: nothing here imports torch, aiohttp or transformers, and
the names above load on first use, so a subpackage with few dependencies
(`libra.transfer`, which vLLM's workers import) needs nothing else of Libra's.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from libra.env import Env
    from libra.errors import LibraError
    from libra.record import Trajectory
    from libra.tooling import Context, Tool, ToolResult, tool

__version__ = "0.1.0"

_HOME = {
    "Context": "libra.tooling",
    "Env": "libra.env",
    "LibraError": "libra.errors",
    "Tool": "libra.tooling",
    "ToolResult": "libra.tooling",
    "Trajectory": "libra.record",
    "tool": "libra.tooling",
}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(import_module(_HOME[name]), name)
    raise AttributeError(f"module 'libra' has no attribute {name!r}")


__all__ = [
    "Context",
    "Env",
    "LibraError",
    "Tool",
    "ToolResult",
    "Trajectory",
    "__version__",
    "tool",
]
