"""Answer checking with `math-verify` in killable worker processes.

math-verify parses LaTeX / plain answers into sympy and compares them; its own timeout
uses `signal.alarm`, which only works in a main thread, and sympy can hang on
adversarial input (`9^9^9^9`). So each check runs in a worker process
(`python -m libra.envs.verifier`, one JSON line in, one out) of a small pool: when a
check runs past `timeout_s`, the worker is killed and a fresh one started on the next
check. A killed or crashed check counts as not verified. Plain subprocesses rather
than `multiprocessing`, so no user script needs an `if __name__ == "__main__"` guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys


class _Worker:
    STARTUP_S = 15.0
    """Extra time for a fresh worker's first check (it imports sympy)."""

    def __init__(self) -> None:
        self.proc: asyncio.subprocess.Process | None = None
        self.warm = False

    async def check(self, gold: str, answer: str, timeout_s: float) -> bool | None:
        """True / False, or None when the check ran out of time or the worker died."""
        if self.proc is None or self.proc.returncode is not None:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "libra.envs.verifier",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
            )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps([gold, answer]).encode() + b"\n")
            await self.proc.stdin.drain()
            async with asyncio.timeout(timeout_s + (0 if self.warm else self.STARTUP_S)):
                line = await self.proc.stdout.readline()
            self.warm = True
            return bool(json.loads(line)) if line else None
        except (TimeoutError, ConnectionError, ValueError):
            return None

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()
        self.proc = None
        self.warm = False


class Verifier:
    """A pool of `size` worker processes; `await verify(gold, answer)`."""

    def __init__(self, size: int = 2, timeout_s: float = 5.0):
        self.timeout_s = timeout_s
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._all = [_Worker() for _ in range(size)]
        for w in self._all:
            self._idle.put_nowait(w)
        self.killed = 0
        """Checks that ran out of time (their worker was killed)."""

    async def verify(self, gold: str, answer: str) -> bool:
        """Whether `answer` is mathematically equal to `gold` (False on timeout)."""
        worker = await self._idle.get()
        result: bool | None = None
        try:
            result = await worker.check(gold, answer, self.timeout_s)
        finally:
            if result is None:  # timed out, died, or we were cancelled mid-check
                await asyncio.shield(worker.kill())
            self._idle.put_nowait(worker)
        if result is None:
            self.killed += 1
            return False
        return result

    async def aclose(self) -> None:
        for w in self._all:
            await w.kill()


def _serve() -> None:
    """Worker loop: `[gold, answer]` per line in, `true` / `false` per line out."""
    from math_verify import parse, verify

    for line in sys.stdin:
        try:
            gold, answer = json.loads(line)
            ok = bool(verify(parse(gold), parse(answer)))
        except Exception:
            ok = False
        sys.stdout.write("true\n" if ok else "false\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()


__all__ = ["Verifier"]
