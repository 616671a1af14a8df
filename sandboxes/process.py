"""Run one local process with capped output, a flood limit and a timeout.

The bubblewrap backend's exec: the process is the bwrap launcher, so killing it takes
down the sandbox's PID namespace and with it everything the command started.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Sequence

from libra.sandboxes.base import OutputCapture, RawExec

_CHUNK = 1 << 16


def exit_status(returncode: int) -> int:
    """asyncio's `-N` for death by signal N becomes the shell's `128 + N`."""
    return 128 - returncode if returncode < 0 else returncode


async def run_process(
    argv: Sequence[str],
    *,
    stdin: bytes | None,
    timeout: float,  # noqa: ASYNC109  (enforced with asyncio.timeout inside)
    max_output: int,
    flood_limit: int,
    env: dict[str, str] | None = None,
    clock: Callable[[], float] = time.monotonic,
    pass_fds: Sequence[int] = (),
) -> RawExec:
    start = clock()
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        start_new_session=True,
        pass_fds=pass_fds,
    )
    out, err = OutputCapture(max_output), OutputCapture(max_output)
    flooded = False

    async def pump(stream: asyncio.StreamReader, cap: OutputCapture) -> None:
        nonlocal flooded
        while chunk := await stream.read(_CHUNK):
            cap.feed(chunk)
            if out.total + err.total > flood_limit:
                if not flooded:
                    flooded = True
                    proc.kill()
                # Until the kill has taken the command's processes down (a PID
                # namespace's teardown, under load, takes a while) they keep writing:
                # drain to EOF (so the pipes close) without counting what comes after.
                while await stream.read(_CHUNK):
                    pass
                return

    async def feed(data: bytes) -> None:
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            proc.stdin.write(data)
            await proc.stdin.drain()
            proc.stdin.close()
            await proc.stdin.wait_closed()

    timed_out = False
    try:
        async with asyncio.timeout(timeout):
            async with asyncio.TaskGroup() as tg:
                assert proc.stdout is not None and proc.stderr is not None
                tg.create_task(pump(proc.stdout, out))
                tg.create_task(pump(proc.stderr, err))
                if stdin is not None:
                    tg.create_task(feed(stdin))
            await proc.wait()
    except TimeoutError:
        timed_out = True
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    code = exit_status(proc.returncode) if proc.returncode is not None else 128 + signal.SIGKILL
    return RawExec(
        exit_code=code,
        out=out,
        err=err,
        duration_s=clock() - start,
        timed_out=timed_out,
        flooded=flooded,
    )


__all__ = ["exit_status", "run_process"]
