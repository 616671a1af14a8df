"""`view` and `edit`: read and change files in the episode's sandbox (SWE-agent style).

`view` shows a file with line numbers (or a directory listing); `edit` replaces one
exact, unique occurrence of a string, or creates a file when `old` is empty. Both act
through the sandbox, so paths resolve inside it (relative to its working directory).
"""

from __future__ import annotations

import asyncio
import shlex
from typing import Any

from libra.tools.shell import sandbox_of

import libra
from libra.errors import ToolError

MAX_VIEW_LINES = 400
"""Lines shown per `view`; ask for a range to see more."""
MAX_FILE_BYTES = 8 * 1024 * 1024
"""Largest file `view` and `edit` read whole (a 250 MB file in the sandbox's limits made
the host read it all into memory, 6.4 GB at once, and split it on the event loop)."""


async def _read(sb: Any, path: str) -> bytes:
    """The file's bytes, when it is at most `MAX_FILE_BYTES` (asked in the sandbox first:
    the file is not read to find out)."""
    size = await sb.exec(["stat", "-L", "-c", "%s", "--", sb.resolve(path)], timeout=30)
    if size.ok and size.stdout.strip().isdigit() and int(size.stdout) > MAX_FILE_BYTES:
        raise ToolError(
            f"{path} is {int(size.stdout):,} bytes; view and edit take files of at most "
            f"{MAX_FILE_BYTES:,}: use bash for part of it (e.g. sed -n '100,200p' {path})"
        )
    return await sb.read_file(path)


@libra.tool(timeout=60)
async def view(
    path: str, ctx: libra.Context, start_line: int = 1, end_line: int | None = None
) -> str:
    """Show a file with line numbers, or list a directory.

    Args:
        path: file or directory, relative to the working directory or absolute.
        start_line: first line to show (1-based).
        end_line: last line to show (default: up to 400 lines from start_line).
    """
    sb = sandbox_of(ctx)
    try:
        data = await _read(sb, path)
    except IsADirectoryError:
        r = await sb.exec(["ls", "-la", "--", sb.resolve(path)], timeout=30)
        if not r.ok:
            raise ToolError(r.stderr.strip() or f"cannot list {path}") from None
        return r.stdout
    except FileNotFoundError:
        raise ToolError(f"{path}: no such file or directory") from None
    if start_line < 1 or (end_line is not None and end_line < start_line):
        raise ToolError(f"bad line range {start_line}..{end_line} (1-based, inclusive)")
    lines = await asyncio.to_thread(lambda: data.decode("utf-8", errors="replace").splitlines())
    last = min(
        len(lines), end_line or start_line + MAX_VIEW_LINES - 1, start_line + MAX_VIEW_LINES - 1
    )
    shown = [f"{i:6}\t{lines[i - 1]}" for i in range(start_line, last + 1)]
    more = f"\n[{len(lines) - last} more lines]" if last < len(lines) else ""
    return ("\n".join(shown) or f"[{path} has {len(lines)} lines]") + more


@libra.tool(timeout=60)
async def edit(path: str, old: str, new: str, ctx: libra.Context) -> str:
    """Replace the one occurrence of `old` with `new` in a file; with `old` empty, create
    the file with content `new` (it must not exist yet).

    Args:
        path: file to change, relative to the working directory or absolute.
        old: exact text to replace, including whitespace; must occur exactly once.
        new: replacement text.
    """
    sb = sandbox_of(ctx)
    if old == "":
        exists = await sb.exec(f"test -e {shlex.quote(sb.resolve(path))}", timeout=30)
        if exists.ok:
            raise ToolError(f"{path} exists; give `old` to change part of it")
        await sb.write_file(path, new)
        return f"created {path} ({len(new.splitlines())} lines)"
    try:
        text = (await _read(sb, path)).decode("utf-8")
    except FileNotFoundError:
        raise ToolError(f"{path}: no such file") from None
    except UnicodeDecodeError:
        raise ToolError(f"{path} is not UTF-8 text") from None
    count = text.count(old)
    if count != 1:
        raise ToolError(
            f"`old` occurs {count} times in {path}; it must occur exactly once "
            "(include more surrounding lines)"
        )
    before = text[: text.index(old)]
    await sb.write_file(path, before + new + text[len(before) + len(old) :])
    first = before.count("\n") + 1
    snippet = (before + new).splitlines()[max(0, first - 3) : first + len(new.splitlines()) + 2]
    return f"edited {path}; lines {max(1, first - 2)}.. now read:\n" + "\n".join(snippet)


__all__ = ["MAX_VIEW_LINES", "edit", "view"]
