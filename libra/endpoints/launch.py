"""Start embedded inference engines (`libra serve-engine`) as child processes.

Used when a bucket asks for `launch = N`: each engine gets a free loopback port, its
output goes to a log file, and `Launched` stops them all (SIGTERM, then SIGKILL after a
grace period) when its `async with` block ends, also on errors and Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from libra.errors import EndpointError


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """Linux: the child gets `sig` when its launcher dies, so a launcher that is killed
    (SIGKILL, OOM) leaves no engine behind. libc is loaded here, in the parent."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, sig)  # 1 = PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class EngineProcess:
    url: str
    proc: asyncio.subprocess.Process
    log_path: Path


class Launched:
    """`async with Launched(model_dir, counts) as urls:` -> {bucket: [url, ...]}."""

    def __init__(
        self,
        model_dir: str | Path,
        counts: dict[str, int],
        *,
        startup_timeout_s: float = 120.0,
        extra_args: list[str] | None = None,
        log_dir: str | Path | None = None,
    ):
        self.model_dir = str(model_dir)
        self.counts = {k: v for k, v in counts.items() if v > 0}
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = extra_args or []
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="libra-engines-"))
        self.procs: dict[str, list[EngineProcess]] = {}

    async def __aenter__(self) -> dict[str, list[str]]:
        try:
            for bucket, n in self.counts.items():
                for i in range(n):
                    ep = await self._spawn(f"{bucket}-{i}")
                    self.procs.setdefault(bucket, []).append(ep)
            await asyncio.gather(*(self._wait_ready(p) for ps in self.procs.values() for p in ps))
        except BaseException:
            await self.stop()
            raise
        return {b: [p.url for p in ps] for b, ps in self.procs.items()}

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _spawn(self, name: str) -> EngineProcess:
        port = free_port()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"engine-{name}.log"
        cmd = [sys.executable, "-m", "libra", "serve-engine", "--model", self.model_dir,
               "--host", "127.0.0.1", "--port", str(port), *self.extra_args]  # fmt: skip
        with open(log_path, "wb") as log:  # noqa: ASYNC230 - a local file, once per engine
            proc = await asyncio.create_subprocess_exec(
                *cmd,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )
        return EngineProcess(f"http://127.0.0.1:{port}", proc, log_path)

    async def _wait_ready(self, ep: EngineProcess) -> None:
        await wait_healthy(
            ep.url,
            ep.proc,
            ep.log_path,
            self.startup_timeout_s,
            name=f"embedded engine at {ep.url}",
        )

    async def stop(self) -> None:
        procs = [p for ps in self.procs.values() for p in ps]
        for p in procs:
            if p.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.proc.pid, signal.SIGTERM)
        for p in procs:
            try:
                await asyncio.wait_for(p.proc.wait(), 10)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.proc.pid, signal.SIGKILL)
                await p.proc.wait()
        self.procs.clear()


async def wait_healthy(
    url: str, proc: asyncio.subprocess.Process, log_path: Path, timeout_s: float, *, name: str
) -> None:
    """Poll `url`/health until it answers 200; `EndpointError` (with the log's tail) when
    the process exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                raise EndpointError(
                    f"{name} exited with {proc.returncode} at start; "
                    f"log {log_path}: {_tail(log_path)}"
                )
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with session.get(
                    f"{url}/health", timeout=aiohttp.ClientTimeout(total=2)
                ) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise EndpointError(
        f"{name} not healthy after {timeout_s:g} s; log {log_path}: {_tail(log_path)}"
    )


def _tail(path: Path, n: int = 400) -> str:
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return "(no log)"
    return " | ".join(text[-n:].splitlines()[-4:]) or "(empty log)"


__all__ = ["Launched", "free_port"]
