"""`libra serve-rollout` as a subprocess for tests: start, kill, restart on one port."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from tests.conftest import ROOT, free_port

FAST_ENDPOINTS = """
[endpoint]
backoff_s = 0.01
backoff_max_s = 0.2
health_interval_s = 0.2
down_wait_s = 5
"""


class Service:
    """One service configuration; `start()` can be called again after `kill()`."""

    def __init__(self, tmp: Path, model: Path, urls: list[str], *extra: str, config: str = ""):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.spool = tmp / "spool"
        self.config = tmp / "service.toml"
        self.config.write_text(config + FAST_ENDPOINTS)  # top-level keys of `config` first
        self.args = [
            "serve-rollout", str(self.config), "--model", str(model), "--port", str(self.port),
            "--spool", str(self.spool), *(a for u in urls for a in ("--endpoint", f"tp1={u}")),
            *extra,
        ]  # fmt: skip
        self.logs: list[Path] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self.tmp = tmp

    def start(self, timeout: float = 60.0) -> str:
        log = self.tmp / f"service-{len(self.logs)}.log"
        self.logs.append(log)
        env = {k: v for k, v in os.environ.items() if k != "LIBRA_TOKEN"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "libra", *self.args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=open(log, "wb"), env=env,  # noqa: SIM115
        )  # fmt: skip
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready:
                line = self.proc.stdout.readline().decode().strip()
                if line:
                    if line.endswith(f":{self.port}"):  # the host part may differ (--host)
                        return self.url
                    self.kill()
                    raise AssertionError(f"service announced {line!r}, not port {self.port}")
            if self.proc.poll() is not None:
                break
        self.kill()
        raise AssertionError(f"service did not start: {log.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs (a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()

    def stop(self) -> int:
        """SIGTERM: the graceful stop."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)

    def close(self) -> None:
        """End of a test: a graceful stop (engines the service launched stop with it),
        SIGKILL if that hangs."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()

    def log(self, i: int = -1) -> str:
        return self.logs[i].read_text()


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[int]:
    """`app` served on a free loopback port (yielded) until the block ends."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()
