"""What /proc says of the processes a test started: their trees, whether they still run,
and which engine listens on a port. Shared by the tests that check nothing is left
running (a zombie counts as gone: it runs nothing)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first, then ppid)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def parent_of(pid: int) -> int:
    fields = _stat(pid)
    assert fields is not None, f"no process {pid}"
    return int(fields[1])


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (by walking /proc's parent links)."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (fields := _stat(int(d))) is not None:
            parent[int(d)] = int(fields[1])
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out.update(kids)
        todo += kids
    return out


def gone(pid: int) -> bool:
    fields = _stat(pid)
    return fields is None or fields[0] == "Z"


def alive(pids: set[int]) -> set[int]:
    return {p for p in pids if not gone(p)}


def wait_gone(pid: int, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return gone(pid)


def engine_on(port: int) -> int | None:
    """The live `libra serve-engine` process listening on `port`, if any."""
    for d in os.listdir("/proc"):
        if not d.isdigit() or gone(int(d)):
            continue
        try:
            args = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve-engine" not in args or b"--port" not in args:
            continue
        if args[args.index(b"--port") + 1] == str(port).encode():
            return int(d)
    return None
