"""Inference engines started and stopped one at a time (hybrid role switches).

`libra.endpoints.launch.Launched` starts a fixed set for one job; a training run needs
to start an engine on the newest weights when a hybrid worker leaves training, and to
free one when it joins. Each engine is a `libra serve-engine` process on a free loopback
port, in its own session (a Ctrl-C at the terminal reaches `libra train`, which stops
engines in order), and on Linux it is killed by the kernel if `libra train` itself dies
(PR_SET_PDEATHSIG), so no engine outlives its run.

A `Launcher` says how a worker's engine starts: `EmbeddedLauncher` (this module) or
`libra.train.vllm_fleet.VllmLauncher` (a vLLM server at the bucket's TP size). Both
return an `Engine`; `stop_engine` stops either (its whole process group).
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
from typing import Protocol

from libra.endpoints.launch import die_with_parent, free_port, wait_healthy
from libra.engine.weights import EndpointKind


@dataclass(slots=True)
class Engine:
    name: str
    url: str
    proc: asyncio.subprocess.Process
    log_path: Path
    start_s: float = 0.0
    """Seconds from spawn to healthy."""
    kind: EndpointKind = "embedded"
    """How weights are loaded into it (`libra.engine.weights.load_weights`)."""


class Launcher(Protocol):
    """Starts the engine of worker `name` for a bucket of TP size `tp`."""

    @property
    def kind(self) -> EndpointKind: ...
    @property
    def stop_grace_s(self) -> float: ...

    async def start(self, name: str, tp: int, model_dir: str, log_dir: Path) -> Engine: ...

    def release(self, name: str) -> None:
        """Worker `name` is gone for good (a layout change): its devices are free."""
        ...


@dataclass(slots=True)
class EmbeddedLauncher:
    """`libra serve-engine` processes (TP 1)."""

    threads: int = 1
    max_num_seqs: int = 64
    kind: EndpointKind = "embedded"
    stop_grace_s: float = 10.0

    async def start(self, name: str, tp: int, model_dir: str, log_dir: Path) -> Engine:
        return await start_engine(
            model_dir, name, log_dir, threads=self.threads, max_num_seqs=self.max_num_seqs
        )

    def release(self, name: str) -> None:
        """Embedded engines hold no placement."""


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
    """SIGTERM its process group, SIGKILL after `grace_s`; always reaps it. What is left
    of the group after its leader exited (vLLM's engine core and TP workers) is killed."""
    if engine.proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(engine.proc.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(asyncio.shield(engine.proc.wait()), grace_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(engine.proc.pid, signal.SIGKILL)
        await engine.proc.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(engine.proc.pid, signal.SIGKILL)


__all__ = ["EmbeddedLauncher", "Engine", "Launcher", "start_engine", "stop_engine"]
