"""`view` and `edit`: read and change files in the episode's sandbox (SWE-agent style).

`view` shows a file with line numbers (or a directory listing); `edit` replaces one
exact, unique occurrence of a string, or creates a file when `old` is empty. Both act
through the sandbox, so paths resolve inside it (relative to its working directory).
"""

from __future__ import annotations

import shlex

from libra.tools.shell import sandbox_of

import libra
from libra.errors import ToolError

MAX_VIEW_LINES = 400
"""Lines shown per `view`; ask for a range to see more."""


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
        data = await sb.read_file(path)
    except IsADirectoryError:
        r = await sb.exec(["ls", "-la", "--", sb.resolve(path)], timeout=30)
        if not r.ok:
            raise ToolError(r.stderr.strip() or f"cannot list {path}") from None
        return r.stdout
    except FileNotFoundError:
        raise ToolError(f"{path}: no such file or directory") from None
    lines = data.decode("utf-8", errors="replace").splitlines()
    if start_line < 1 or (end_line is not None and end_line < start_line):
        raise ToolError(f"bad line range {start_line}..{end_line} (1-based, inclusive)")
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
        text = (await sb.read_file(path)).decode("utf-8")
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
