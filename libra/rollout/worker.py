"""One rollout worker: a process with its own event loop that runs the episodes its front
hands it and sends each finished record back (`libra.rollout.workers` is the front's
side; `libra.rollout.wire` the messages).

    python -m libra.rollout.worker --connect SOCKET [--id K]

It connects to the front's socket, says `hello`, reads its `WorkerInit` (model, buckets
with every endpoint URL, endpoint limits, hosted envs, routing policy, weight versions),
opens its own endpoint pool and answers `ready`, or `error` with one line. Then, until
the front says `stop` or goes away (and with its parent: it gets SIGKILL if the front
dies):

| front -> worker | |
|---|---|
| `batch` b, env, sampling | a batch's runner opens (on first use of it here) |
| `run` e, spec, waited | run one episode: one `done`, `none` or `fail` with `e` comes back |
| `cancel` e | end that episode: its `aborted` record (`done`) or `none` if it had not started |
| `end` b | the batch completed: close its runner |
| `version` v, urls | weights `v` are loaded on `urls` (null: all): stamp later turns |
| `learn` env, l | finished episodes of other workers, for this env's routing policy |
| `step` env, s | step `s` ended: this env's routing policy applies what it held back |
| `pool` c | the front's endpoint pool changed (`EndpointPool.apply`): applied in order |
| `drain` k, url, t | stop calls to `url`, wait ≤ t s for ours: `drained` k, left |
| `monitor` | loop lag, GC passes and CPU since the last `monitor` (benchmarks) |
| `ping` | `pong` at once (the front kills a worker quiet for `HANG_S`) |

A worker holds nothing that must survive it: finished records are the front's once
sent, and the front runs a lost worker's episodes again elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from libra import usercode
from libra.config import Config
from libra.endpoints.config import BucketConfig, EndpointConfig, SamplingConfig
from libra.endpoints.pool import EndpointPool
from libra.env import Env
from libra.record import Trajectory
from libra.rollout.batch import ADMIT_SLICE, Runner
from libra.rollout.config import LimitsConfig
from libra.rollout.episode import EpisodeSpec
from libra.rollout.serving import Serving, open_pool, resolve_serving
from libra.rollout.wire import Lesson, frame, lesson_of, pack_record, read_frame
from libra.routing.base import RoutingPolicy

log = logging.getLogger("libra.worker")


class HostedEnv(Config):
    """An env a worker may run: `name` as batches call it, `spec` as `load_env` takes it."""

    name: str
    spec: str
    options: dict[str, Any] = Field(default_factory=dict)


class WorkerInit(Config):
    """Everything a worker needs, sent by the front once it connects."""

    model: str
    """Model folder (tokenizer, chat template)."""
    max_context: int
    buckets: list[BucketConfig]
    """Buckets with their bounds and every endpoint URL (engines the front launched
    included); a worker launches nothing."""
    endpoint: EndpointConfig
    """This worker's share of the endpoint limits (the front divides them)."""
    limits: LimitsConfig
    envs: list[HostedEnv]
    policy: str
    routing: dict[str, Any] = Field(default_factory=dict)
    versions: dict[str, int] = Field(default_factory=dict)
    """Weight version loaded on each endpoint URL now."""
    paused: list[str] = Field(default_factory=list)
    """Endpoint URLs that admit no new calls now (a weight update, a drain)."""
    joined_later: bool = False
    """Buckets may be empty now: their endpoints join later (`pool` changes)."""
    monitor: bool = False
    """Sample event-loop lag and GC passes for `monitor` (benchmarks)."""


@dataclass(eq=False)
class _Batch:
    env: str
    opening: asyncio.Task[None] | None = None
    runner: Runner | None = None
    failed: str | None = None
    """Why its runner could not open (its episodes fail with this)."""
    waiting: dict[int, tuple[EpisodeSpec, float]] = field(default_factory=dict)
    """Episodes that arrived while the runner opened, started in slices once it is."""
    stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)


class Worker:
    """Serves one front connection (see the module docstring)."""

    def __init__(
        self,
        init: WorkerInit,
        serving: Serving,
        pool: EndpointPool,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ):
        self.init = init
        self.serving = serving
        self.pool = pool
        self.reader = reader
        self.writer = writer
        self.entries = {e.name: e for e in init.envs}
        self.envs: dict[str, Env] = {}
        self.policies: dict[str, RoutingPolicy] = {}
        self.batches: dict[str, _Batch] = {}
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.learns = init.policy != "static"
        self.changes: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        """The front pool's changes, applied one after another (`_follow`)."""
        self._out: list[bytes] = []
        self._flushing = False
        self.monitor: Any = None

    # --- sending: frames of one loop iteration go out in one write ---------------------
    def send(self, header: dict[str, Any], blob: bytes = b"") -> None:
        self._out.append(frame(header, blob))
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flushing = False
        data, self._out = b"".join(self._out), []
        if not self.writer.is_closing():
            self.writer.write(data)

    # --- serving -----------------------------------------------------------------------
    async def serve(self) -> None:
        async with asyncio.TaskGroup() as tg:
            watch = None
            if self.init.monitor:
                from libra.bench.lag import LagMonitor  # benchmarks only

                self.monitor = LagMonitor()
                gc.callbacks.append(self.monitor.on_gc)
                watch = tg.create_task(self.monitor.run(), name="libra-worker-monitor")
            follow = tg.create_task(self._follow(), name="libra-worker-pool")
            try:
                runs = 0
                while (got := await read_frame(self.reader)) is not None:
                    if not self._handle(got[0], tg):
                        break
                    if got[0]["op"] == "run":
                        runs += 1
                        if runs % ADMIT_SLICE == 0:
                            # Buffered frames are read without yielding: admit in slices,
                            # as run_episodes does (an episode's first steps are ~1 ms).
                            await asyncio.sleep(0)
            finally:
                for task in list(self.tasks.values()):
                    task.cancel()
                for b in list(self.batches.values()):
                    tg.create_task(self._close(b))
                follow.cancel()
                if watch is not None:
                    watch.cancel()
        self._flush()

    def _handle(self, h: dict[str, Any], tg: asyncio.TaskGroup) -> bool:
        op = h["op"]
        if op == "run":
            spec = EpisodeSpec(h["id"], h.get("bid", h["b"]), h["task_id"], h["group_id"],
                               h["task"], h["index"], h["step"])  # fmt: skip
            b = self.batches[h["b"]]
            if b.runner is not None:
                self._start(tg, h["e"], b, spec, h["waited"])
            elif b.failed is not None:
                self.send({"op": "fail", "e": h["e"], "error": b.failed})
            else:
                b.waiting[h["e"]] = (spec, h["waited"])
        elif op == "cancel":
            running = self.tasks.get(h["e"])
            if running is not None:
                running.cancel()
            for b in self.batches.values():
                if b.waiting.pop(h["e"], None) is not None:
                    self.send({"op": "none", "e": h["e"]})
        elif op == "learn":
            policy = self._policy(h["env"])
            for v in h["l"]:
                policy.on_finish(Lesson.of(v))
        elif op == "batch":
            b = self.batches[h["b"]] = _Batch(h["env"])
            b.opening = tg.create_task(self._open(tg, h["b"], h["env"], h["sampling"]))
        elif op == "end":
            ended = self.batches.pop(h["b"], None)
            if ended is not None:
                tg.create_task(self._close(ended))
        elif op == "version":
            self.pool.set_version(h["v"], h["urls"])
        elif op == "step":
            end_step = getattr(self._policy(h["env"]), "end_step", None)
            if end_step is not None:
                end_step(h["s"])
        elif op == "pool":
            self.changes.put_nowait(h["c"])
        elif op == "drain":
            tg.create_task(self._drain(h["k"], h["url"], h["t"]))
        elif op == "monitor":
            self.send({"op": "monitor", **self._figures()})
        elif op == "ping":
            self.send({"op": "pong"})
        elif op == "stop":
            return False
        return True

    async def _follow(self) -> None:
        while True:
            change = await self.changes.get()
            try:
                await self.pool.apply(change)
            except Exception:  # a change this pool cannot take must not stop the worker
                log.exception("cannot apply the front's pool change %s", change)
            finally:
                self.changes.task_done()

    async def _drain(self, key: int, url: str, timeout_s: float) -> None:
        await self.changes.join()  # the endpoint's `add` may still be queued
        left = 0
        if any(e.url == url for e in self.pool.endpoints()):
            left = await self.pool.drain(url, timeout_s)
        self.send({"op": "drained", "k": key, "left": left})

    def _figures(self) -> dict[str, Any]:
        out: dict[str, Any] = {"cpu_s": time.process_time(), "pid": os.getpid()}
        if self.monitor is not None:
            out.update(self.monitor.figures())
            self.monitor.reset()
        return out

    def _policy(self, env: str) -> RoutingPolicy:
        policy = self.policies.get(env)
        if policy is None:
            from libra.rollout.run import make_policy

            policy = make_policy(self.init.policy, self.serving.buckets, self.init.routing)
            self.policies[env] = policy
        return policy

    def _start(
        self, tg: asyncio.TaskGroup, key: int, b: _Batch, spec: EpisodeSpec, waited: float
    ) -> None:
        task = tg.create_task(self._episode(key, b, spec, waited), name=f"episode:{spec.id}")
        self.tasks[key] = task
        task.add_done_callback(lambda _t: self.tasks.pop(key, None))

    async def _open(
        self, tg: asyncio.TaskGroup, batch_id: str, env_name: str, sampling: dict[str, Any]
    ) -> None:
        """Open the batch's runner, then start the episodes that waited for it, a slice
        per loop iteration (all at once, their first steps would stop the loop for ~1 ms
        each)."""
        from libra.rollout.run import episode_runner, load_env

        b = self.batches[batch_id]
        try:
            env = self.envs.get(env_name)
            if env is None:
                entry = self.entries[env_name]
                env = await asyncio.to_thread(load_env, entry.spec, entry.options)
                self.envs[env_name] = env
            b.runner = await b.stack.enter_async_context(
                episode_runner(
                    env,
                    env_name=env_name,
                    tokenizer=self.serving.tokenizer,
                    pool=self.pool,
                    policy=self._policy(env_name),
                    sampling=SamplingConfig.model_validate(sampling),
                    limits=self.init.limits,
                    max_context=self.serving.max_context,
                )
            )
        except Exception as e:
            log.exception("cannot open a runner for batch %s", batch_id)
            b.failed = f"cannot start the env: {usercode.describe(e)}"
            for key in b.waiting:
                self.send({"op": "fail", "e": key, "error": b.failed})
            b.waiting.clear()
            return
        n = 0
        while b.waiting:
            key = next(iter(b.waiting))
            spec, waited = b.waiting.pop(key)
            self._start(tg, key, b, spec, waited)
            n += 1
            if n % ADMIT_SLICE == 0:
                await asyncio.sleep(0)

    async def _close(self, b: _Batch) -> None:
        if b.opening is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await b.opening
        try:
            await b.stack.aclose()
        except Exception:
            log.exception("closing a batch's runner failed")

    async def _episode(self, key: int, b: _Batch, spec: EpisodeSpec, waited: float) -> None:
        aborted: Trajectory | None = None

        def on_abort(record: Trajectory) -> None:
            nonlocal aborted
            aborted = record

        try:
            assert b.runner is not None
            record = await b.runner.run(spec, admitted_after_s=waited, on_abort=on_abort)
        except asyncio.CancelledError:
            self._reply(key, b.env, aborted)
            raise
        except Exception as e:  # a bug must not take the worker down with it
            log.exception("episode %s raised", spec.id)
            self.send({"op": "fail", "e": key, "error": usercode.describe(e)})
            return
        self._reply(key, b.env, record)

    def _reply(self, key: int, env: str, record: Trajectory | None) -> None:
        if record is None:
            self.send({"op": "none", "e": key})
            return
        head, blob = pack_record(record)
        head.update(op="done", e=key)
        if self.learns:
            head["lesson"] = lesson_of(record)
            try:
                self._policy(env).on_finish(record)
            except Exception:
                log.exception("routing policy failed to learn from %s", record.id)
        self.send(head, blob)


async def main_async(path: str, wid: int) -> int:
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(frame({"op": "hello", "id": wid, "pid": os.getpid()}))
    got = await read_frame(reader)
    if got is None:
        return 0
    try:
        init = WorkerInit.model_validate(got[0]["init"])
        serving = await asyncio.to_thread(
            resolve_serving, init.model, init.max_context, init.buckets
        )
        async with contextlib.AsyncExitStack() as stack:
            pool = await stack.enter_async_context(
                open_pool(serving, init.endpoint, joined_later=init.joined_later)
            )
            for url, version in init.versions.items():
                pool.set_version(version, [url])
            for url in init.paused:
                await pool.set_admitting(url, False)
            gc.collect()
            gc.freeze()  # what start-up made stays out of full collections (run_sync)
            writer.write(frame({"op": "ready"}))
            await Worker(init, serving, pool, reader, writer).serve()
    except Exception as e:
        log.exception("rollout worker %d failed", wid)
        writer.write(frame({"op": "error", "message": f"{type(e).__name__}: {e}"}))
        await writer.drain()
        return 1
    finally:
        writer.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m libra.rollout.worker", description=__doc__)
    ap.add_argument("--connect", required=True, help="the front's Unix socket")
    ap.add_argument("--id", type=int, default=0, help="worker number (for messages)")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, format=f"libra worker {args.id}: %(message)s", stream=sys.stderr
    )
    from libra.rollout.run import run_sync

    code = int(run_sync(main_async(args.connect, args.id)))
    if usercode.overruns():  # threads stuck in user code: exit without joining them
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["HostedEnv", "Worker", "WorkerInit", "main"]
