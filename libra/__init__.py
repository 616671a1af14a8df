"""Libra: an adaptive runtime for agentic RL post-training.

The public Python API (checked by `tests/unit/test_public_api.py`):

    libra.Env, libra.tool, libra.Tool, libra.ToolResult, libra.Context, libra.Trajectory

Importing `libra` is cheap: nothing here imports torch, aiohttp or transformers.
"""

from libra.env import Env
from libra.errors import LibraError
from libra.record import Trajectory
from libra.tooling import Context, Tool, ToolResult, tool

__version__ = "0.1.0"

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
