"""`bash` and `python`: run code in the episode's sandbox.

The env creates the sandbox in `setup` (`ctx.sandbox`); these tools never run anything
on the host. A non-zero exit code is a tool `error`, a command killed at its time limit
a tool `timeout` (both are what C-MLFQ keys on). The model sees at most
`SHOWN_BYTES` of stdout and of stderr; `info` carries exit code, byte counts and which
limit acted (OOM kill, output flood), for the env and the trajectory's tool returns.
"""

from __future__ import annotations

from typing import Any, Literal

from libra.sandboxes.base import ExecResult, Sandbox

import libra
from libra.errors import ToolError

SHOWN_BYTES = 8 * 1024
"""Bytes of stdout and of stderr shown to the model per call."""
MAX_TIMEOUT_S = 300
"""Longest a single command may run; the tool's own timeout is this plus a margin, so a
command always ends through the sandbox (which kills what it started)."""


def sandbox_of(ctx: libra.Context | None) -> Sandbox:
    sb = getattr(ctx, "sandbox", None)
    if sb is None:
        raise ToolError("this tool needs a sandbox: the env must create one in setup()")
    return sb


def exec_result(r: ExecResult) -> libra.ToolResult:
    """The model-facing text and the tool status of a finished command."""
    parts = [r.describe()]
    for name, text, total in (
        ("stdout", r.stdout, r.stdout_bytes),
        ("stderr", r.stderr, r.stderr_bytes),
    ):
        if total:
            parts.append(f"--- {name} ---\n{text.rstrip()}")
            if total > len(text.encode()):
                parts.append(f"[{name} truncated: {total} bytes in all]")
    status: Literal["ok", "error", "timeout"] = (
        "timeout" if r.timed_out else ("ok" if r.exit_code == 0 else "error")
    )
    info: dict[str, Any] = {
        "exit_code": r.exit_code,
        "timed_out": r.timed_out,
        "truncated": r.truncated,
        "oom_killed": r.oom_killed,
        "flooded": r.flooded,
        "stdout_bytes": r.stdout_bytes,
        "stderr_bytes": r.stderr_bytes,
        "duration_s": round(r.duration_s, 4),
    }
    content = "\n".join(parts)
    info["payload_chars"] = len(content)
    return libra.ToolResult(content, status, info)


def _limit(timeout: int) -> int:
    if not 1 <= timeout <= MAX_TIMEOUT_S:
        raise ToolError(f"timeout must be between 1 and {MAX_TIMEOUT_S} seconds, got {timeout}")
    return timeout


@libra.tool(timeout=MAX_TIMEOUT_S + 30)
async def bash(command: str, ctx: libra.Context, timeout: int = 30) -> libra.ToolResult:  # noqa: ASYNC109
    """Run a shell command in the sandbox and return its exit code and output.

    Args:
        command: the command line, run with /bin/sh -c in the working directory.
        timeout: seconds before the command and everything it started are killed.
    """
    if "\x00" in command:  # an argv cannot hold it: the command ran cut at the NUL
        return libra.ToolResult("Error: the command contains a NUL character; remove it", "error")
    r = await sandbox_of(ctx).exec(command, timeout=_limit(timeout), max_output=SHOWN_BYTES)
    return exec_result(r)


@libra.tool(timeout=MAX_TIMEOUT_S + 30)
async def python(code: str, ctx: libra.Context, timeout: int = 30) -> libra.ToolResult:  # noqa: ASYNC109
    """Run a Python 3 program in the sandbox and return its exit code and output.

    Args:
        code: the program's source; print what you want to see.
        timeout: seconds before the program is killed.
    """
    r = await sandbox_of(ctx).exec(
        ["python3", "-"], stdin=code.encode(), timeout=_limit(timeout), max_output=SHOWN_BYTES
    )
    return exec_result(r)


__all__ = ["MAX_TIMEOUT_S", "SHOWN_BYTES", "bash", "exec_result", "python", "sandbox_of"]
