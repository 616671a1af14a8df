"""The batch manager: submits, fair admission under one concurrency bound, the spool,
cancel, and recovery after a restart.

One admission task hands free slots to episodes (`FairQueue`: the batch with the fewest
episodes running goes first). Every episode task belongs to the manager's TaskGroup.
A finished record goes to its batch's spool first; streams read it from there, so
they never hold an episode up. Cancelling a batch records its queued episodes and its
running ones (cancelled mid-turn, or before they took their first step) as `aborted`;
stopping the service records nothing for running episodes: a restarted service runs
them again under the same ids.

Nothing proportional to a batch runs on the event loop in one go: a submit is parsed,
validated and expanded into episodes in a worker thread (`libra.service.intake`), and
the `aborted` records of a cancelled batch are written `ABORT_SLICE` at a time, the loop
serving other work in between.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import resource
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from libra import usercode
from libra.chat import ChatTokenizer
from libra.endpoints.config import SamplingConfig
from libra.endpoints.pool import EndpointPool
from libra.errors import ConfigError
from libra.proxy.agent import AgentEnv
from libra.record import Trajectory
from libra.rollout.episode import EpisodeSpec
from libra.rollout.layouts import adapt_tasks
from libra.rollout.run import episode_runner
from libra.rollout.wire import RawRecord
from libra.rollout.workers import BatchInfo, WorkerPool
from libra.routing.base import StaticPolicy
from libra.service.batch import Batch, check_tasks, specs_for, submit_digest
from libra.service.config import ServiceConfig, SubmitRequest
from libra.service.envs import EnvHost
from libra.service.errors import RequestError
from libra.service.fair import FairQueue
from libra.service.metrics import Metrics
from libra.service.spool import (
    RETRY_S,
    Spool,
    Syncer,
    read_state,
    store_batch,
    write_json_atomic,
)

log = logging.getLogger("libra.service")

WEIGHTS = ".weights.json"
"""In the spool dir: the last weight version (a dot name: no batch id can take it)."""
ABORT_SLICE = 64
"""Aborted records written per event-loop turn when a batch is cancelled."""
KEEP_LOADED = 16
"""Finished batches kept in memory (index, open file); older ones without readers are
dropped and re-read from the spool when asked for again (a trainer submitting a batch
per step must not run the process out of memory or file descriptors)."""


class BatchManager:
    def __init__(
        self,
        *,
        config: ServiceConfig,
        pool: EndpointPool,
        tokenizer: ChatTokenizer,
        max_context: int,
        envs: EnvHost,
        workers: WorkerPool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.pool = pool
        self.tok = tokenizer
        self.max_context = max_context
        self.envs = envs
        self.workers = workers
        """Rollout worker processes that run the episodes (`--workers N`), or None: they
        run on this event loop."""
        self.clock = clock
        self.root = Path(config.spool.dir)
        self.fair: FairQueue[EpisodeSpec] = FairQueue()
        self.batches: dict[str, Batch] = {}
        self.metrics = Metrics()
        self.syncer = Syncer(config.spool.fsync, config.spool.fsync_interval_s)
        self.version = 0
        """Policy version of the last weight update (default `step` of new batches)."""
        self.folder: str | None = None
        """The folder the last weight update loaded (None: none, or a broadcast)."""
        self.readers = 0
        self._terminal: set[str] = set()
        """Finished batches on disk, loaded when first asked for."""
        self._slots = asyncio.Semaphore(config.concurrency)
        self._reloading: dict[str, asyncio.Future[Batch]] = {}
        """Finished batches being read back from the spool, one load each."""
        self._wanted: Counter[str] = Counter()
        """Batches a `hold` waits for (loaded back, or not yet resumed): kept loaded."""
        self.write_error: str | None = None
        """Why finished records cannot be written to the spool (the disk is full), while
        some wait in memory; None when every record is written."""
        self.write_reason: str | None = None
        """`write_error` without the path, for `/healthz` (which needs no token)."""
        self._unwritten: set[Batch] = set()
        self._writable = asyncio.Event()
        """Set while the spool takes records: admission waits on it."""
        self._writable.set()
        self._work = asyncio.Event()
        self._submit_lock = asyncio.Lock()
        self._tg: asyncio.TaskGroup | None = None

    # --- lifecycle ---------------------------------------------------------------------
    async def run(self) -> None:
        """Admit and run episodes until cancelled (the service stops)."""
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                tg.create_task(self.syncer.run(), name="libra-spool-syncer")
                tg.create_task(self._admit(tg), name="libra-admission")
                for b in list(self.batches.values()):
                    self._check_complete(b)
        finally:
            self._tg = None
            if lost := sum(len(b.spool.pending) for b in self._unwritten):
                log.error("stopping with %d finished records not written (%s); their "
                          "episodes run again after a restart", lost, self.write_error)  # fmt: skip
            for b in list(self.batches.values()):
                await self._stop_runner(b)
            for b in self.batches.values():
                spool = b.spool
                if self.config.spool.fsync != "never" and not spool.closed:
                    spool.sync()
                spool.release()

    def active(self) -> list[Batch]:
        return [b for b in self.batches.values() if not b.complete]

    def recover(self, kept_urls: list[str] | None = None) -> None:
        """Pick up the spool: resume unfinished batches, list finished ones.

        The last weight version is restored for `kept_urls` (default: every endpoint):
        endpoints that outlived the service still hold those weights; engines the
        service launched itself start from the base model (version 0; the server
        loads the last update's `folder` into them, when it came from one)."""
        self.root.mkdir(parents=True, exist_ok=True)
        weights = self.root / WEIGHTS
        if weights.is_file():
            doc = orjson.loads(weights.read_bytes())
            self.version, self.folder = int(doc["version"]), doc.get("path")
            self.pool.set_version(self.version, kept_urls)
        for folder in sorted(p for p in self.root.iterdir() if (p / "batch.json").is_file()):
            state = read_state(folder)
            if state.get("complete"):
                self._terminal.add(folder.name)
                continue
            doc = orjson.loads((folder / "batch.json").read_bytes())
            batch = self._open(doc, state.get("state", "running"))
            missing = batch.missing()
            why = None
            if batch.state == "cancelled":
                why = "cancelled"
            elif not batch.runnable:
                why = f"env {doc['env']!r} is not hosted by the restarted service"
            elif self.config.spool.on_restart == "abort":
                why = "the service restarted before the episode finished"
            if why is not None:
                self._finish_many(batch, [batch.aborted(spec, why) for spec in missing])
            else:
                self.fair.push(batch.id, missing, doc.get("weight", 1.0))
                self._work.set()
            log.warning(
                "resumed batch %s: %d of %d episodes to %s",
                batch.id, len(missing), batch.total, "record aborted" if why else "run again",
            )  # fmt: skip

    def _open(
        self,
        doc: dict[str, Any],
        state: Any,
        made: tuple[list[EpisodeSpec], Spool] | None = None,
    ) -> Batch:
        """A batch from its stored request; `made`: its specs and spool, when a worker
        thread made them already (a submit)."""
        specs, spool = made or (specs_for(doc), self._spool(doc))
        runnable = state == "running" and doc["env"] in self.envs.names()
        batch = Batch(doc["batch_id"], doc, specs, spool, runnable, state=state)
        self.batches[batch.id] = batch
        return batch

    def _spool(self, doc: dict[str, Any]) -> Spool:
        durable = self.config.spool.fsync == "always"
        return Spool(self.root / doc["batch_id"], doc["group_size"], durable_publish=durable)

    async def _start_runner(self, batch: Batch) -> None:
        """The batch's runner (`episode_runner`: an EpisodeRunner for a libra.Env, an
        AgentRunner with its proxy for an agent function), kept open until it completes."""
        doc = batch.doc
        if self.workers is not None:  # the workers open theirs (libra.rollout.worker)
            info = BatchInfo(batch.id, doc["env"], doc["sampling"])
            batch.runner = self.workers.runner(info, StaticPolicy(self.pool.buckets))
            return
        stack = contextlib.AsyncExitStack()
        batch.runner = await stack.enter_async_context(
            episode_runner(
                self.envs.get(doc["env"]),
                env_name=doc["env"],
                tokenizer=self.tok,
                pool=self.pool,
                policy=self.envs.policy(doc["env"]),
                sampling=SamplingConfig.model_validate(doc["sampling"]),
                limits=self.config.limits,
                max_context=self.max_context,
            )
        )
        batch.stack = stack

    async def _stop_runner(self, batch: Batch) -> None:
        if self.workers is not None and batch.runner is not None:
            self.workers.end_batch(batch.id)
        stack, batch.stack, batch.runner = batch.stack, None, None
        if stack is not None:
            try:
                await stack.aclose()
            except Exception:
                log.exception("closing the runner of batch %s failed", batch.id)

    # --- the API -----------------------------------------------------------------------
    async def get(self, batch_id: str) -> Batch:
        """A batch by id; a finished one that was unloaded is read back from the spool
        in a worker thread (its records file is indexed line by line)."""
        batch = self.batches.get(batch_id)
        if batch is None and batch_id in self._terminal:
            # One reload per batch, however many requests ask at once (each read the whole
            # spool again: 40 readers of a 30,000-episode batch took 95 s, and 100 streams
            # grew the process by 2 GB).
            loading = self._reloading.get(batch_id)
            if loading is None:
                loading = self._reloading[batch_id] = asyncio.ensure_future(
                    self._load_back(batch_id)
                )
                loading.add_done_callback(lambda _: self._reloading.pop(batch_id, None))
            batch = await asyncio.shield(loading)
        if batch is None:
            raise RequestError(404, f"no batch {batch_id!r} here; submit it with POST /v1/rollouts")
        return batch

    async def hold(self, batch_id: str) -> Batch:
        """`get`, counted as a reader until `let_go`: `evict` leaves it loaded. Wanted
        from before the first await (`evict` skips a batch someone waits for) and a
        reader from the step `get` returns in: a stream counted itself only after its
        first await, and another request's `evict` released the spool under it (reads
        from a closed file, or from another batch's file that took its number)."""
        self._wanted[batch_id] += 1
        try:
            batch = await self.get(batch_id)
        finally:
            self._wanted[batch_id] -= 1
            if not self._wanted[batch_id]:
                del self._wanted[batch_id]
        batch.readers += 1
        self.readers += 1
        return batch

    def let_go(self, batch: Batch) -> None:
        """The end of a `hold`."""
        batch.readers -= 1
        self.readers -= 1
        self.evict()

    async def _load_back(self, batch_id: str) -> Batch:
        doc, state, made = await asyncio.to_thread(self._reload, batch_id)
        batch = self.batches.get(batch_id)  # a submit may have opened it meanwhile
        if batch is not None:
            made[1].release()
            return batch
        batch = self._open(doc, state, made)
        batch.spool.close()
        batch.completing = True
        self._terminal.discard(batch_id)
        return batch

    def _reload(self, batch_id: str) -> tuple[dict[str, Any], Any, tuple[list[EpisodeSpec], Spool]]:
        folder = self.root / batch_id
        doc = orjson.loads((folder / "batch.json").read_bytes())
        return doc, read_state(folder).get("state", "done"), (specs_for(doc), self._spool(doc))

    def max_open_batches(self) -> int:
        """`max_open_batches`, or a quarter of the open-file limit (at least 16)."""
        if self.config.max_open_batches is not None:
            return self.config.max_open_batches
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return max(16, soft // 4)

    def known(self, batch_id: str) -> bool:
        return batch_id in self.batches or batch_id in self._terminal

    async def submit(self, req: SubmitRequest) -> tuple[Batch, bool]:
        """Create the batch (stored before this returns), or return the one with this
        id when the request is the same (idempotent); 409 when it differs."""
        async with self._submit_lock:
            if self.write_error is not None:
                raise RequestError(507, self._full_message())
            digest = await asyncio.to_thread(submit_digest, req, self.config.sampling)
            batch_id = req.batch_id or uuid.uuid4().hex[:16]
            if self.known(batch_id):
                batch = await self.get(batch_id)
                if batch.doc["digest"] != digest:
                    raise RequestError(
                        409, f"batch {batch_id!r} exists with a different request; "
                        "use a new batch_id (or resubmit the same body to get this one)",
                    )  # fmt: skip
                return batch, False
            env = self.envs.get(req.env)
            n = len(req.tasks) * req.group_size
            if n > self.config.max_episodes_per_batch:
                raise RequestError(
                    400, f"{len(req.tasks)} tasks x group_size {req.group_size} = {n} episodes; "
                    f"this service takes at most {self.config.max_episodes_per_batch} per batch",
                )  # fmt: skip
            open_now = sum(not b.spool.closed for b in self.batches.values())
            if open_now >= (most := self.max_open_batches()):
                raise RequestError(
                    429, f"{open_now} batches are unfinished, this service's "
                    f"max_open_batches ({most}); submit it again once one has finished "
                    "(libra.client retries a 429 itself) or cancel a batch",
                )  # fmt: skip
            waiting, cap = self.fair.pending(), self.config.max_queued_episodes
            if waiting and waiting + n > cap:
                raise RequestError(
                    429, f"{waiting} episodes are waiting for a slot and this batch adds {n}, "
                    f"above this service's max_queued_episodes ({cap}); submit it again once "
                    "some have started (libra.client retries a 429 itself) or cancel a batch",
                )  # fmt: skip
            if req.weight > self.config.max_batch_weight:
                raise RequestError(
                    400, f"weight {req.weight:g} is above this service's max_batch_weight "
                    f"({self.config.max_batch_weight:g}); give a weight in (0, "
                    f"{self.config.max_batch_weight:g}]",
                )  # fmt: skip
            doc = {
                "batch_id": batch_id,
                "env": req.env,
                "tasks": req.tasks,
                "group_size": req.group_size,
                "sampling": req.sampling_over(self.config.sampling).model_dump(mode="json"),
                "step": self.version if req.step is None else req.step,
                "weight": req.weight,
                "digest": digest,
                "created": time.time(),
            }
            prompt = None if isinstance(env, AgentEnv) else env.prompt
            try:
                made = await asyncio.to_thread(self._make, doc, prompt, env.task_fields)
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE):  # not the disk's fault
                    raise RequestError(503, f"no file descriptor is left for another batch "
                                            f"({len(self.batches)} are open, each holds "
                                            "two); submit it again once some have "
                                            "finished") from None  # fmt: skip
                raise RequestError(507, f"the batch cannot be stored under {self.root}: "
                                        f"{e.strerror or e}; free space there and submit "
                                        "it again") from None  # fmt: skip
            batch = self._open(doc, "running", made)
            batch.queued_since = self.clock()
            self.fair.push(batch.id, batch.specs, req.weight)
            self._work.set()
            return batch, True

    def _make(
        self, doc: dict[str, Any], prompt: Any, fields: tuple[str, str] | None
    ) -> tuple[list[EpisodeSpec], Spool]:
        """A submitted batch's checks, episodes, stored request and spool (blocking: a
        worker thread runs it, as `prompt` is the env's code and all of it is
        proportional to the batch). Rows in verl's or TRL's layout are mapped to the
        env's `fields` first, and stored mapped."""
        try:
            doc["tasks"] = adapt_tasks(doc["tasks"], fields, env=doc["env"], source="submit")
        except ConfigError as e:
            raise RequestError(400, str(e)) from None
        check_tasks(doc["tasks"], prompt)
        specs = specs_for(doc)
        return specs, store_batch(self.root / doc["batch_id"], doc, lambda: self._spool(doc))

    async def cancel(self, batch_id: str) -> Batch:
        """Queued episodes are recorded `aborted` at once, running ones as they stop."""
        batch = await self.get(batch_id)
        if batch.state != "running" or batch.complete:
            return batch
        batch.state = "cancelled"
        state = {"state": "cancelled", "complete": False}
        await asyncio.to_thread(write_json_atomic, batch.spool.folder / "state.json", state)
        for task in batch.tasks.values():
            task.cancel()
        await self._abort(batch, self.fair.drop(batch.id), "cancelled before it started")
        self._check_complete(batch)
        return batch

    async def _abort(self, batch: Batch, specs: list[EpisodeSpec], why: str) -> None:
        """Record `specs` as `aborted`, a slice per event-loop turn."""
        for i in range(0, len(specs), ABORT_SLICE):
            if i:
                await asyncio.sleep(0)
            self._finish_many(batch, [batch.aborted(s, why) for s in specs[i : i + ABORT_SLICE]])

    def set_version(self, version: int, folder: str | None = None) -> None:
        """The last weight update: `version`, loaded from `folder` (None: by broadcast)."""
        self.version, self.folder = version, folder
        write_json_atomic(self.root / WEIGHTS, {"version": version, "path": folder})

    def status(self, batch: Batch) -> dict[str, Any]:
        counts = {"queued": self.fair.pending(batch.id) if batch.state == "running" else 0}
        counts["running"] = len(batch.tasks)
        for s in ("ok", "error", "timeout", "truncated", "aborted"):
            counts[s] = batch.spool.status.get(s, 0)
        return {
            "batch_id": batch.id,
            "env": batch.doc["env"],
            "state": batch.state if batch.state != "running" or not batch.complete else "done",
            "episodes": batch.total,
            "groups": len(batch.doc["tasks"]),
            "group_size": batch.doc["group_size"],
            "step": batch.doc["step"],
            "weight": batch.doc.get("weight", 1.0),
            "finished": batch.spool.written,
            "streamable": batch.spool.visible,
            "counts": counts,
        }

    # --- episodes ----------------------------------------------------------------------
    async def _admit(self, tg: asyncio.TaskGroup) -> None:
        while True:
            if not self._writable.is_set():  # finished records wait in memory: no more
                await self._writable.wait()
            await self._slots.acquire()
            while (item := self.fair.pop()) is None:
                self._work.clear()
                await self._work.wait()
            batch = self.batches[item[0]]
            spec = item[1]
            waited = self.clock() - batch.queued_since
            if batch.runner is None:
                try:
                    await self._start_runner(batch)
                except Exception as e:
                    log.exception("cannot start a runner for batch %s", batch.id)
                    record = batch.aborted(spec, f"cannot start the env: {usercode.describe(e)}")
                    record.status = "error"
                    self.fair.release(batch.id)
                    self._slots.release()
                    self._finish(batch, record)
                    await asyncio.sleep(0)  # a free slot does not yield: never spin here
                    continue
            if batch.state != "running":  # cancelled meanwhile; `cancel` drops the rest
                self.fair.release(batch.id)
                self._slots.release()
                if spec.id not in batch.spool.ids:
                    self._finish(batch, batch.aborted(spec, "cancelled before it started"))
                await asyncio.sleep(0)
                continue
            task = tg.create_task(self._episode(batch, spec, waited), name=f"episode:{spec.id}")
            batch.tasks[spec.id] = task
            task.add_done_callback(functools.partial(self._episode_done, batch, spec))

    async def _episode(self, batch: Batch, spec: EpisodeSpec, waited: float) -> None:
        def on_abort(record: Trajectory | RawRecord) -> None:
            if batch.state == "cancelled":  # else the service is stopping: run it again later
                self._finish(batch, record)

        assert batch.runner is not None
        try:
            record = await batch.runner.run(spec, admitted_after_s=waited, on_abort=on_abort)
        except Exception as e:  # a bug must not take the service down with it
            log.exception("episode %s raised", spec.id)
            record = batch.aborted(spec, f"internal error: {usercode.describe(e)}")
            record.status = "error"
        self._finish(batch, record)

    def _episode_done(self, batch: Batch, spec: EpisodeSpec, task: asyncio.Task[None]) -> None:
        """Runs whether or not the episode's coroutine ever ran: a task cancelled before
        its first step runs no code of its own, so its slot and its record are seen to
        here."""
        batch.tasks.pop(spec.id, None)
        self.fair.release(batch.id)
        self._slots.release()
        if task.cancelled() and batch.state == "cancelled" and spec.id not in batch.spool.ids:
            self._finish(batch, batch.aborted(spec, "cancelled before it started"))

    def _finish(self, batch: Batch, record: Trajectory | RawRecord) -> None:
        self._finish_many(batch, [record])

    def _finish_many(self, batch: Batch, records: list[Trajectory | RawRecord]) -> None:
        fresh = []
        for record in records:
            if record.id in batch.spool.ids:
                log.error("episode %s finished twice; keeping the first record", record.id)
            else:
                fresh.append(record)
        fresh = batch.spool.extend(fresh)  # a record that cannot be written: an error one
        if batch.spool.pending:
            self._cannot_write(batch)
        self.syncer.touched(batch.spool)
        # With workers, theirs route and learn (each from every record: `WorkerPool`).
        learns = batch.runnable and self.workers is None
        policy = self.envs.policy(batch.doc["env"]) if learns else None
        for record in fresh:
            self.metrics.add(record)
            if policy is not None:
                try:
                    policy.on_finish(record)
                except Exception:
                    log.exception("routing policy failed to learn from %s", record.id)
        self._check_complete(batch)

    def _cannot_write(self, batch: Batch) -> None:
        """`batch`'s spool holds records it could not write: stop admitting, say why,
        and retry every `RETRY_S` until every spool takes its records."""
        self.write_error, self.write_reason = batch.spool.write_error, batch.spool.write_reason
        if not self._unwritten:
            log.error("%s; finished records wait in memory and no episode starts until "
                      "they are written (tried every %g s)", self.write_error, RETRY_S)  # fmt: skip
            self._writable.clear()
            if self._tg is not None:
                self._tg.create_task(self._retry_writes(), name="libra-spool-retry")
        self._unwritten.add(batch)

    async def _retry_writes(self) -> None:
        while self._unwritten:
            await asyncio.sleep(RETRY_S)
            for b in list(self._unwritten):
                if b.spool.retry():
                    self._unwritten.discard(b)
                    self.syncer.touched(b.spool)
                    self._check_complete(b)
                else:
                    self.write_error, self.write_reason = b.spool.write_error, b.spool.write_reason
        log.warning("the spool takes records again; admission resumes")
        self.write_error = self.write_reason = None
        self._writable.set()

    def _full_message(self) -> str:
        waiting = sum(len(b.spool.pending) for b in self._unwritten)
        return (
            f"the spool cannot be written ({self.write_error}): free space under "
            f"{self.root}. {waiting} finished records wait in memory and are written as "
            "soon as it can; until then no episode starts and no batch is taken"
        )

    def _check_complete(self, batch: Batch) -> None:
        if batch.complete and not batch.completing and self._tg is not None:
            batch.completing = True
            self._tg.create_task(self._complete(batch), name=f"complete:{batch.id}")

    async def _complete(self, batch: Batch) -> None:
        await self.syncer.settle(batch.spool)
        if batch.state == "running":
            batch.state = "done"
        state = {"state": batch.state, "complete": True}
        path = batch.spool.folder / "state.json"
        while True:  # a full disk: the batch completes once it can say so
            try:
                await asyncio.to_thread(write_json_atomic, path, state)
                break
            except OSError as e:
                log.warning("cannot write %s: %s; tried again in %g s", path, e, RETRY_S)
                await asyncio.sleep(RETRY_S)
        batch.spool.close()
        if batch.tasks:  # cancelled episodes recorded themselves and are still unwinding
            await asyncio.wait(list(batch.tasks.values()))
        await self._stop_runner(batch)
        self.evict()

    def evict(self) -> None:
        """Unload finished batches beyond the newest `KEEP_LOADED` that nobody streams."""
        done = [b for b in self.batches.values() if b.spool.closed]
        for b in done[: max(0, len(done) - KEEP_LOADED)]:
            if b.readers == 0 and b.id not in self._wanted:
                b.spool.release()
                del self.batches[b.id]
                self._terminal.add(b.id)


__all__ = ["BatchManager"]
