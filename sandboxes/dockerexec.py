"""One `docker exec` on the raw hijacked socket (blocking; run it on a worker thread).

The SDK's own demultiplexer reads frame by frame and moves about 90 MB/s here; reading
the socket in 1 MiB slices and parsing the 8-byte frame headers ourselves is bounded by
the daemon instead (~130 MB/s, docs/sandboxes.md). stdin is written as the socket
becomes writable, so a command that talks before it reads cannot deadlock us. The
deadline is enforced with `select`: the thread always returns by then.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import time
from typing import Any

from libra.sandboxes.base import OutputCapture, RawExec

from libra.errors import SandboxError

OOM_PROBE = (
    "grep -h '^oom_kill ' /sys/fs/cgroup/memory/memory.oom_control "
    "/sys/fs/cgroup/memory.events 2>/dev/null | tail -n 1"
)
"""Prints `oom_kill N`: the sandbox cgroup's OOM-kill counter (cgroup v1 or v2)."""
_HEADER = struct.Struct(">BxxxI")


def exec_stream(
    api: Any,
    cid: str,
    argv: list[str],
    *,
    cwd: str,
    env: dict[str, str],
    stdin: bytes | None,
    timeout: float,
    max_output: int,
    flood_limit: int,
) -> RawExec:
    import docker.errors

    start = time.monotonic()
    deadline = start + timeout
    try:
        eid = api.exec_create(cid, argv, workdir=cwd, environment=env, stdin=stdin is not None)[
            "Id"
        ]
        sock = api.exec_start(eid, socket=True)
    except docker.errors.NotFound:
        raise SandboxError(f"sandbox {cid[:12]} no longer exists (reaped or removed)") from None
    except docker.errors.APIError as e:
        raise SandboxError(f"docker exec in {cid[:12]} failed: {e.explanation or e}") from None
    raw: socket.socket = getattr(sock, "_sock", sock)
    caps = {1: OutputCapture(max_output), 2: OutputCapture(max_output)}
    timed_out = flooded = False
    pending = memoryview(stdin) if stdin else None
    try:
        raw.setblocking(False)
        sel = selectors.DefaultSelector()
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if stdin is not None else 0)
        sel.register(raw, events)
        buf = bytearray()
        want: tuple[int, int] | None = None  # (stream, bytes left in the current frame)
        eof = False
        while not eof:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for _, events in sel.select(min(left, 1.0)):
                if events & selectors.EVENT_WRITE:
                    try:
                        if pending:
                            pending = pending[raw.send(pending[: 1 << 16]) :]
                    except BlockingIOError:
                        pass
                    except (BrokenPipeError, ConnectionResetError):
                        pending = None  # the command closed its stdin
                    if not pending:
                        with contextlib.suppress(OSError):
                            raw.shutdown(socket.SHUT_WR)
                        sel.modify(raw, selectors.EVENT_READ)
                if events & selectors.EVENT_READ:
                    try:
                        chunk = raw.recv(1 << 20)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        eof = True
                        break
                    buf += chunk
                    while True:
                        if want is None:
                            if len(buf) < _HEADER.size:
                                break
                            kind, size = _HEADER.unpack_from(buf)
                            del buf[: _HEADER.size]
                            want = (kind, size)
                        kind, size = want
                        piece = bytes(buf[:size])
                        del buf[: len(piece)]
                        if piece and kind in caps:
                            caps[kind].feed(piece)
                        want = (kind, size - len(piece)) if size > len(piece) else None
                        if want is not None:
                            break
                    if caps[1].total + caps[2].total > flood_limit:
                        flooded = True
                        eof = True
                        break
        sel.close()
    finally:
        # shutdown, not only close: the SDK's response object holds the socket too, and
        # a connection left open with unread output stalls dockerd (and a later kill).
        with contextlib.suppress(OSError):
            raw.shutdown(socket.SHUT_RDWR)
        raw.close()
        sock.close()
    code = 137
    if not (timed_out or flooded):
        for _ in range(50):  # the exit code lands a moment after the stream closes
            info = api.exec_inspect(eid)
            if info.get("ExitCode") is not None and not info.get("Running"):
                code = int(info["ExitCode"])
                break
            time.sleep(0.02)
    return RawExec(
        exit_code=code,
        out=caps[1],
        err=caps[2],
        duration_s=time.monotonic() - start,
        timed_out=timed_out,
        flooded=flooded,
    )


__all__ = ["OOM_PROBE", "exec_stream"]
