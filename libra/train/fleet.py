"""Workers and their roles: core engines, core training replicas, hybrids that switch.

Role switches (docs/train.md, "Hybrid workers"):

rollout -> training
    1. stop admitting turns to its engine (`EndpointPool.drain`): turns already running
       finish there; each episode's *next* turn goes to a sibling engine, which
       re-prefills its context (the episode migrates at a turn boundary, nothing is lost);
    2. remove the endpoint and stop the engine (frees its core and memory);
    3. `ElasticTrainer.add_hybrid`: at the next step boundary the replica registers,
       is admitted, fetches a snapshot from a live peer in the background and trains
       from the step after it caught up.
training -> rollout
    1. `ElasticTrainer.remove_hybrid`: it leaves after its next update;
    2. start an engine on the newest published weights;
    3. register it in its bucket at that weights version (under the publishing lock, so
       a version published meanwhile is loaded before any turn is sent to it).

Every trainer call goes through `TrainerHandle` (one at a time, in a worker thread), so
membership changes happen between steps, never inside one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import aiohttp

from libra.endpoints.pool import EndpointPool
from libra.engine.weights import load_weights
from libra.errors import EndpointDown
from libra.train.engines import EmbeddedLauncher, Engine, Launcher, stop_engine

log = logging.getLogger("libra.train")

Role = Literal["rollout", "train", "switching"]
T = TypeVar("T")


def no_sigint(fn: Callable[..., T]) -> Callable[..., T]:
    """Run `fn` with SIGINT blocked in the calling thread, so processes it spawns start
    with SIGINT blocked (the mask survives fork and exec): a Ctrl-C at the terminal goes
    to the whole foreground process group, and the trainer's processes must keep
    running until `libra train` has saved its checkpoint and stops them itself."""

    def wrapped(*args: Any) -> T:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            return fn(*args)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    return wrapped


class TrainerHandle:
    """Serialises calls into the (blocking) `ElasticTrainer` from asyncio: one at a
    time, in a worker thread, with SIGINT blocked (`no_sigint`). A cancelled caller
    still waits for its call to end before the next one may start."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self._lock = asyncio.Lock()

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        async with self._lock:
            fut = asyncio.ensure_future(asyncio.to_thread(no_sigint(fn), *args))
            try:
                return await asyncio.shield(fut)
            except asyncio.CancelledError:
                with contextlib.suppress(BaseException):
                    await fut
                raise


@dataclass(slots=True)
class Worker:
    id: str
    kind: Literal["core-rollout", "core-train", "hybrid"]
    role: Role
    bucket: str | None = None
    engine: Engine | None = None


@dataclass(slots=True)
class Fleet:
    """The run's workers. Engines serve `model_dir` at start, later the newest weights."""

    pool: EndpointPool | None
    trainer: TrainerHandle
    log_dir: Path
    launcher: Launcher = field(default_factory=EmbeddedLauncher)
    """How an engine starts (embedded, or vLLM at its bucket's TP size)."""
    bucket_tp: dict[str, int] = field(default_factory=dict)
    """TP size of each bucket's instances (default 1)."""
    drain_timeout_s: float = 30.0
    workers: list[Worker] = field(default_factory=list)
    weights_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    weights: tuple[int, str] = (0, "")
    """(version, folder) of the newest weights every engine serves."""
    start_weights: tuple[int, str] = (0, "")
    """(version, folder) the fleet started on: a folder that is never pruned, where a
    vLLM instance starts before it loads the newest weights (a start can outlast
    `trainer.keep_versions` publications)."""
    engine_start_s: list[float] = field(default_factory=list)
    """Measured engine start times (the planner's reconfiguration cost)."""
    used_ids: set[str] = field(default_factory=set)
    """Worker names given out so far (`new_id`)."""

    def by_role(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {"rollout": [], "train": []}
        for w in self.workers:
            out.setdefault(w.role, []).append(w.id)
        return out

    def counts(self) -> dict[str, int]:
        return {r: len(ids) for r, ids in self.by_role().items()}

    def new_id(self, prefix: str) -> str:
        """A worker name never used in this run (a layout change adds workers)."""
        self.used_ids.update(w.id for w in self.workers)
        n = 0
        while f"{prefix}{n}" in self.used_ids:
            n += 1
        self.used_ids.add(f"{prefix}{n}")
        return f"{prefix}{n}"

    def hybrids(self, role: Role) -> list[Worker]:
        return [w for w in self.workers if w.kind == "hybrid" and w.role == role]

    def urls(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for w in self.workers:
            if w.engine is not None and w.bucket is not None:
                out.setdefault(w.bucket, []).append(w.engine.url)
        return out

    async def start_engine(self, w: Worker, model_dir: str, bucket: str) -> Engine:
        tp = self.bucket_tp.get(bucket, 1)
        w.engine = await self.launcher.start(w.id, tp, model_dir, self.log_dir)
        self.engine_start_s.append(w.engine.start_s)
        return w.engine

    async def start(self, workers: list[Worker], model_dir: str, version: int) -> None:
        """Start the engines of every rollout worker (before the pool exists)."""
        self.workers = workers
        self.used_ids.update(w.id for w in workers)
        self.weights = self.start_weights = (version, model_dir)
        await asyncio.gather(
            *(
                self.start_engine(w, model_dir, w.bucket or "")
                for w in workers
                if w.role == "rollout"
            )
        )

    # -- weights ----------------------------------------------------------------------

    async def publish(self, version: int, folder: str) -> float:
        """Load `folder` into every engine, one at a time (the others keep serving).
        While an engine updates, no turn is sent to it; turns it is running finish on
        the old weights; from the update on its turns are stamped `version`. Returns
        the seconds it took.

        vLLM: the turns Libra sent are drained first (all of them, on the old weights),
        then the server pauses, reloads and resumes (`load_weights`), so no request can
        reach it between the pause and the reload and run on weights its stamp does not
        name."""
        assert self.pool is not None
        t0 = time.monotonic()
        kind = self.launcher.kind
        wait_s = self.pool.config.request_timeout_s
        async with self.weights_lock, aiohttp.ClientSession() as session:
            for ep in list(self.pool.endpoints()):
                await self.pool.set_admitting(ep.url, False)
                try:
                    if kind == "vllm":
                        await self.pool.drain(ep.url, wait_s)
                    await load_weights(session, ep.url, kind, folder)
                    ep.version = version
                finally:
                    await self.pool.set_admitting(ep.url, True)
            self.weights = (version, folder)
        return time.monotonic() - t0

    # -- role switches ----------------------------------------------------------------

    async def to_training(self, w: Worker) -> dict[str, float]:
        """rollout -> training (module doc). Returns measured durations."""
        t0 = time.monotonic()
        took = await self.retire(w)
        t2 = time.monotonic()
        await self.trainer.call(self.trainer.trainer.add_hybrid, w.id)
        w.role = "train"
        return took | {"register_s": time.monotonic() - t2, "total_s": time.monotonic() - t0}

    async def to_rollout(self, w: Worker, bucket: str) -> dict[str, float]:
        """training -> rollout (module doc). Returns measured durations."""
        assert self.pool is not None
        w.role = "switching"
        t0 = time.monotonic()
        await self.trainer.call(self.trainer.trainer.remove_hybrid, w.id)
        t1 = time.monotonic()
        start_s = await self.serve(w, bucket)
        return {"leave_s": t1 - t0, "engine_start_s": start_s, "total_s": time.monotonic() - t0}

    async def serve(self, w: Worker, bucket: str) -> float:
        """Start `w`'s engine at `bucket`'s TP size on the current weights and register
        it in `bucket` at their version; returns the engine's start time. A version
        published while it started is loaded before it is registered (under the
        publishing lock), so no turn reaches it on older weights than its stamp."""
        assert self.pool is not None
        # embedded: start on the newest weights; vLLM: on the fleet's first folder (never
        # pruned while the slow start runs), then load the newest below
        kind = self.launcher.kind
        version, folder = self.weights if kind == "embedded" else self.start_weights
        t0 = time.monotonic()
        engine = await self.start_engine(w, folder, bucket)
        start_s = time.monotonic() - t0
        async with self.weights_lock:
            if self.weights[0] != version:  # published while the engine started
                async with aiohttp.ClientSession() as session:
                    await load_weights(session, engine.url, kind, self.weights[1])
                version = self.weights[0]
            await self.pool.add_endpoint(bucket, engine.url, version)
        w.bucket, w.role = bucket, "rollout"
        return start_s

    async def retire(self, w: Worker) -> dict[str, float]:
        """Stop serving on `w`: no new turns go to its engine, the turns it runs finish
        there (up to `drain_timeout_s`; later ones are retried on a sibling), then the
        endpoint leaves the pool and the engine stops. Returns measured durations."""
        assert self.pool is not None and w.engine is not None
        w.role = "switching"
        t0 = time.monotonic()
        url = w.engine.url
        async with self.weights_lock:  # a weight update must not re-admit it meanwhile
            left = await self.pool.drain(url, self.drain_timeout_s)
            t1 = time.monotonic()
            await self.pool.remove_endpoint(url)
        engine, w.engine = w.engine, None  # detached first: `watch` sees no death
        await stop_engine(engine, self.launcher.stop_grace_s)
        return {"drain_s": t1 - t0, "turns_cut": float(left), "stop_s": time.monotonic() - t1}

    async def watch(self, interval_s: float = 1.0) -> None:
        """Runs until cancelled; raises `EndpointDown` (with the log's tail) when an engine
        that serves exits (a crashed vLLM engine core takes its API server down), so a
        run fails in one line instead of waiting on a bucket with no engine."""
        while True:
            for w in self.workers:
                e = w.engine
                if e is not None and e.proc.returncode is not None:
                    raise EndpointDown(
                        f"{e.kind} engine of {w.id} exited with code {e.proc.returncode} "
                        f"while serving; log {e.log_path}: {_last_error(e.log_path)}",
                        url=e.url,
                    )
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        """Stop every engine (also when cancelled: shielded)."""
        engines = [w.engine for w in self.workers if w.engine is not None]
        for w in self.workers:
            w.engine = None
        with contextlib.suppress(BaseException):
            grace = self.launcher.stop_grace_s
            await asyncio.shield(asyncio.gather(*(stop_engine(e, grace) for e in engines)))

    def kill_now(self) -> None:
        """Last resort (synchronous): SIGKILL every engine still running."""
        import os
        import signal

        for w in self.workers:
            if w.engine is not None and w.engine.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(w.engine.proc.pid, signal.SIGKILL)


def _last_error(log: Path) -> str:
    """The log's last line that names an error (vLLM ends with shutdown messages)."""
    try:
        lines = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    found = [x for x in lines if "Error" in x or "error" in x]
    return ((found or lines or ["(empty log)"])[-1]).strip()[-300:]


__all__ = ["Fleet", "Role", "TrainerHandle", "Worker", "no_sigint"]
