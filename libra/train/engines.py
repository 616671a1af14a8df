"""Embedded inference engines started and stopped one at a time (hybrid role switches).

`libra.endpoints.launch.Launched` starts a fixed set for one job; a training run needs
to start an engine on the newest weights when a hybrid worker leaves training, and to
free one when it joins. Each engine is a `libra serve-engine` process on a free loopback
port, in its own session (a Ctrl-C at the terminal reaches `libra train`, which stops
engines in order), and on Linux it is killed by the kernel if `libra train` itself dies
(PR_SET_PDEATHSIG), so no engine outlives its run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from libra.endpoints.launch import die_with_parent, free_port, wait_healthy


@dataclass(slots=True)
class Engine:
    name: str
    url: str
    proc: asyncio.subprocess.Process
    log_path: Path
    start_s: float = 0.0
    """Seconds from spawn to healthy."""


async def start_engine(
    model_dir: str | Path,
    name: str,
    log_dir: Path,
    *,
    threads: int = 1,
    max_num_seqs: int = 64,
    timeout_s: float = 180.0,
) -> Engine:
    """Spawn an engine serving `model_dir` and wait until it answers `/health`."""
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once per engine
    log_path = log_dir / f"engine-{name}.log"
    cmd = [
        sys.executable,
        "-m",
        "libra",
        "serve-engine",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--max-num-seqs",
        str(max_num_seqs),
    ]
    t0 = time.monotonic()
    with open(log_path, "ab") as log:  # noqa: ASYNC230 - a local file, once per engine
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent(signal.SIGTERM),
        )
    engine = Engine(name, f"http://127.0.0.1:{port}", proc, log_path)
    try:
        await wait_healthy(engine.url, engine.proc, engine.log_path, timeout_s,
                           name=f"engine {engine.name}")  # fmt: skip
    except BaseException:
        await stop_engine(engine)
        raise
    engine.start_s = time.monotonic() - t0
    return engine


async def stop_engine(engine: Engine, grace_s: float = 10.0) -> None:
    """SIGTERM its process group, SIGKILL after `grace_s`; always reaps it."""
    if engine.proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(engine.proc.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(asyncio.shield(engine.proc.wait()), grace_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(engine.proc.pid, signal.SIGKILL)
        await engine.proc.wait()


__all__ = ["Engine", "start_engine", "stop_engine"]
