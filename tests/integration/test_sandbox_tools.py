"""`view`, `edit`, `bash`, `python` against a real sandbox."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from libra.sandboxes.base import SandboxSpec
from libra.tools.files import edit, view
from libra.tools.shell import bash, python

import libra
from tests.contracts.sandbox_fixtures import start_backend


@pytest.fixture
async def ctx(tmp_path: Path) -> AsyncIterator[libra.Context]:
    backend = await start_backend("bwrap", tmp_path)
    sb = await backend.create(SandboxSpec(image="host"))  # host python, read-only host fs
    try:
        yield libra.Context("tools", {}, sandbox=sb)
    finally:
        await backend.aclose()


async def test_edit_replaces_exactly_one_occurrence(ctx: libra.Context) -> None:
    made = await edit.invoke({"path": "f.py", "old": "", "new": "a = 1\nb = 1\n"}, ctx)
    assert made.status == "ok"
    again = await edit.invoke({"path": "f.py", "old": "", "new": "x"}, ctx)
    assert again.status == "error" and "exists" in again.content
    twice = await edit.invoke({"path": "f.py", "old": " = 1", "new": " = 2"}, ctx)
    assert twice.status == "error" and "occurs 2 times" in twice.content
    none = await edit.invoke({"path": "f.py", "old": "zzz", "new": "y"}, ctx)
    assert none.status == "error" and "occurs 0 times" in none.content
    ok = await edit.invoke({"path": "f.py", "old": "b = 1", "new": "b = 2"}, ctx)
    assert ok.status == "ok"
    assert (await ctx.sandbox.read_file("f.py")) == b"a = 1\nb = 2\n"
    missing = await edit.invoke({"path": "nope.py", "old": "a", "new": "b"}, ctx)
    assert missing.status == "error" and "no such file" in missing.content


async def test_view_numbers_lines_and_lists_directories(ctx: libra.Context) -> None:
    await ctx.sandbox.write_file("src/m.py", "".join(f"line {i}\n" for i in range(1, 501)))
    shown = await view.invoke({"path": "src/m.py", "start_line": 10, "end_line": 12}, ctx)
    assert shown.content.splitlines() == [f"{i:6}\tline {i}" for i in (10, 11, 12)] + [
        "[488 more lines]"
    ]
    full = await view.invoke({"path": "src/m.py"}, ctx)
    assert "[100 more lines]" in full.content  # capped at 400 lines per call
    listing = await view.invoke({"path": "src"}, ctx)
    assert "m.py" in listing.content
    bad = await view.invoke({"path": "src/m.py", "start_line": 5, "end_line": 2}, ctx)
    assert bad.status == "error"
    # a file past MAX_FILE_BYTES is not read into the host's memory: the model is told
    # how to see part of it
    await ctx.sandbox.exec("head -c 9000000 /dev/zero | tr '\\0' 'a' > big.txt", timeout=30)
    for tool, args in ((view, {"path": "big.txt"}), (edit, {"path": "big.txt", "old": "a",
                                                           "new": "b"})):  # fmt: skip
        big = await tool.invoke(args, ctx)
        assert big.status == "error" and "9,000,000 bytes" in big.content, big.content[:200]
        assert "sed -n" in big.content


async def test_bash_and_python_report_exit_codes_as_status(ctx: libra.Context) -> None:
    ok = await bash.invoke({"command": "echo hi"}, ctx)
    assert ok.status == "ok" and "hi" in ok.content and ok.info["exit_code"] == 0
    failed = await bash.invoke({"command": "echo oops >&2; exit 4"}, ctx)
    assert failed.status == "error" and "exit code 4" in failed.content
    assert "oops" in failed.content
    slow = await bash.invoke({"command": "sleep 10", "timeout": 1}, ctx)
    assert slow.status == "timeout" and "timed out" in slow.content
    py = await python.invoke({"code": "import sys\nprint(6*7)\nsys.exit(3)"}, ctx)
    assert py.status == "error" and "42" in py.content and py.info["exit_code"] == 3
    big = await bash.invoke({"command": "seq 1 100000"}, ctx)
    assert big.info["truncated"] and "[stdout truncated: 588895 bytes in all]" in big.content
    bad = await bash.invoke({"command": "true", "timeout": 100000}, ctx)
    assert bad.status == "error" and "between 1 and 300" in bad.content
    # a NUL cannot cross into an argv: the command ran cut at it, as `ok`
    nul = await bash.invoke({"command": "echo a\x00; rm -rf /work"}, ctx)
    assert nul.status == "error" and "NUL" in nul.content
