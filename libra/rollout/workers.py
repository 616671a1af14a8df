"""The front's side of rollout workers: N processes (`libra.rollout.worker`), each with
its own event loop, that run the episodes this process admits.

The front keeps everything a user sees: admission and its concurrency bound, the HTTP
API, the spool, seqs and cursors, idempotency, cancellation. It hands each admitted
episode to the worker with the fewest in flight (`WorkerPool.run`, awaited by the
episode's task in the front, exactly where an in-process runner's `run` is) and gets
back the record as its worker serialised it (`RawRecord`: spooled and streamed without
being parsed here). So one process's semantics hold unchanged:

- exactly once: an episode's task resolves once, from the one reply of the worker that
  ran it; the spool drops a second record of an id anyway;
- cancelling the episode's task cancels it in its worker, whose `aborted` record comes
  back as from an in-process runner (`on_abort`, then CancelledError);
- a worker that dies (its socket ends) loses nothing finished (records it sent are the
  front's); the episodes it was running are run again on the other workers, or on its
  replacement, which is started at once (as a restarted service runs them again); an
  episode whose worker died `MAX_LOST` times under it is recorded as an error instead.
  Episodes that died together are placed on different workers where they can be, and
  never share one while either is on its last try (`_Call.apart`): an episode that kills
  its worker takes it alone to its error record, not the innocent ones that shared its
  workers (with few workers that costs time: those run one per worker at their last try);
- routing state is merged: each finished record's lesson (`libra.rollout.wire`) goes
  to every other worker's policy for that env, so each learns from all episodes;
- endpoint pools are split: every worker talks to every endpoint, with `max_inflight`
  and `max_inflight_total` divided by N, so the endpoints see the caps of one process;
- the front's pool stays the one that changes (`libra train`: engines join and leave,
  weights are published): the pool follows it (`EndpointPool.followers`), so every
  change reaches each worker in order and a drain waits for the workers' calls too.

The workers connect to a Unix socket this process listens on, so a worker is a small
unit that something else (a placement layer) could start as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from libra.cluster.process import die_with_parent
from libra.endpoints.config import BucketConfig, EndpointConfig
from libra.endpoints.pool import EndpointPool
from libra.errors import ConfigError
from libra.record import Trajectory
from libra.rollout.episode import EpisodeSpec
from libra.rollout.wire import (
    Lesson,
    RawRecord,
    WireError,
    frame,
    pack_record,
    read_frame,
    unpack_record,
)
from libra.rollout.worker import WorkerInit
from libra.rollout.worker_runners import WorkerRunner
from libra.routing.base import RoutingPolicy

log = logging.getLogger("libra.workers")

START_TIMEOUT_S = 120.0
"""A worker that has not answered `ready` by then failed to start."""
ABORT_WAIT_S = 10.0
"""How long a cancelled episode waits for its worker's `aborted` record."""
MAX_LOST = 3
"""Workers that may die under one episode before it is recorded as an error (an episode
that kills its worker must not kill them all in turn, forever). Which of a dead worker's
episodes killed it cannot be told, so the ones that died together are kept apart at
their last try (`_Call.apart`): an innocent one then does not die a third time with it."""
HANG_S = 60.0
"""A worker that has sent nothing for this long, pings included, is hung (its event loop
blocked: a sync call that never returns, a C extension holding the GIL): it is killed,
and its episodes run again as after a crash."""
RESPAWN_BACKOFF_S = (0.5, 30.0)
REPLY_SLICE = 64
"""Replies handled per event-loop iteration: each wakes its episode's task in the front
(spool or sink write, stream wake-up), so a burst of buffered replies is taken in slices."""


class WorkerLost(Exception):
    """The worker running an episode died before it answered."""


@dataclass(eq=False, slots=True)
class _Call:
    future: asyncio.Future[RawRecord | None]
    env: str
    died: frozenset[int] = frozenset()
    """The workers (`_Worker.serial`) that died under this episode before."""

    @property
    def last_try(self) -> bool:
        return len(self.died) >= MAX_LOST - 1

    def apart(self, other: _Call) -> bool:
        """Whether the two must not share a worker: they died together before and one
        of them is at its last try (the other may be what killed them)."""
        return bool(self.died & other.died) and (self.last_try or other.last_try)


_serials = itertools.count()


@dataclass(eq=False)
class _Worker:
    slot: int
    proc: subprocess.Popen[bytes]
    serial: int = field(default_factory=lambda: next(_serials))
    """This process's identity among every worker the pool started."""
    writer: asyncio.StreamWriter | None = None
    pid: int = 0
    ready: bool = False
    lost: bool = False
    calls: dict[int, _Call] = field(default_factory=dict)
    batches: set[str] = field(default_factory=set)
    out: list[bytes] = field(default_factory=list)
    flushing: bool = False
    replies: dict[str, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    heard: float = 0.0
    """When its last frame came (monotonic)."""

    def send(self, header: dict[str, Any], blob: bytes = b"") -> None:
        if self.writer is None or self.lost:
            return
        self.out.append(frame(header, blob))
        if not self.flushing:
            self.flushing = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self.flushing = False
        data, self.out = b"".join(self.out), []
        if self.writer is not None and not self.writer.is_closing():
            self.writer.write(data)


@dataclass(frozen=True, slots=True)
class BatchInfo:
    """What a worker needs to open a batch's runner."""

    id: str
    env: str
    sampling: dict[str, Any]


def split_limits(endpoint: EndpointConfig, n: int) -> EndpointConfig:
    """Each of `n` workers' share of the endpoint limits."""
    return endpoint.model_copy(update={
        "max_inflight": math.ceil(endpoint.max_inflight / n),
        "max_inflight_total": math.ceil(endpoint.max_inflight_total / n),
    })  # fmt: skip


def worker_buckets(pool: EndpointPool) -> list[BucketConfig]:
    """The front pool's buckets with every endpoint URL (launched engines included)."""
    urls = {b.name: [e.url for e in pool.endpoints(b.name)] for b in pool.buckets}
    return [
        BucketConfig(name=b.name, tp=b.tp, bound=b.bound, endpoints=urls[b.name])
        for b in pool.buckets
    ]


class WorkerPool:
    """`async with WorkerPool(n, init_for) as workers`: n workers started and ready (a
    worker that cannot start raises ConfigError with its reason); stopped on exit.
    `init_for()` makes the `WorkerInit` of a worker being started (so a replacement gets
    the weight versions of that moment)."""

    def __init__(
        self,
        n: int,
        init_for: Callable[[], WorkerInit],
        on_lesson: Callable[[str, Lesson], None] | None = None,
        *,
        hang_s: float = HANG_S,
    ):
        self.n = n
        self.init_for = init_for
        self.hang_s = hang_s
        self.on_lesson = on_lesson
        """Also given every finished record's lesson (env, lesson): a policy in the front
        that learns as the workers' do (the one `libra rollout` saves to `tree_path`)."""
        self.workers: list[_Worker | None] = [None] * n
        self.closing = False
        self.lost_total = 0
        self._keys = itertools.count()
        self._batches: dict[str, BatchInfo] = {}
        self._freed = asyncio.Event()
        """Set when a call ends or a worker is ready: an episode waiting for a worker (none
        ready, or every one holding an episode it is kept apart from) may now have one."""
        self._dir = ""
        self._server: asyncio.AbstractServer | None = None
        self._conns: dict[int, asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]
        self._conns = {}
        self._tg: asyncio.TaskGroup | None = None
        self._started: list[asyncio.Future[str | None]] = []
        self._told: set[_Worker] = set()
        """Workers sent their init and not lost: they get every pool change."""

    @property
    def socket_path(self) -> str:
        return os.path.join(self._dir, "workers.sock")

    # --- lifecycle ---------------------------------------------------------------------
    async def __aenter__(self) -> WorkerPool:
        self._dir = tempfile.mkdtemp(prefix="libra-w-")
        self._server = await asyncio.start_unix_server(self._accept, self.socket_path)
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        loop = asyncio.get_running_loop()
        self._started = [loop.create_future() for _ in range(self.n)]
        for slot in range(self.n):
            self._tg.create_task(self._supervise(slot), name=f"libra-worker-{slot}")
        errors = [e for e in await asyncio.gather(*self._started) if e]
        if errors:
            await self.__aexit__(None, None, None)
            raise ConfigError(f"a rollout worker could not start: {errors[0]}")
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.closing = True
        for w in self.workers:
            if w is not None:
                w.send({"op": "stop"})
        tg, self._tg = self._tg, None
        if tg is not None:
            await tg.__aexit__(None, None, None)
        if self._server is not None:
            self._server.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def begin_close(self) -> None:
        """The front is stopping: cancelled episodes do not wait for their records."""
        self.closing = True

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            got = await asyncio.wait_for(read_frame(reader), 10)
        except (TimeoutError, WireError, OSError):
            writer.close()
            return
        fut = self._conns.get(got[0].get("id", -1)) if got else None
        if fut is None or fut.done():
            writer.close()  # not a worker this pool is waiting for
            return
        fut.set_result((reader, writer))

    async def _supervise(self, slot: int) -> None:
        """Start the worker of `slot`; when it dies, fail its calls and start another."""
        delay = RESPAWN_BACKOFF_S[0]
        first = True
        while not self.closing:
            try:
                w, reader = await self._start(slot)
            except Exception as e:
                if first:
                    self._started[slot].set_result(str(e))
                    return
                log.warning("rollout worker %d could not be restarted: %s (again in %.0f s)",
                            slot, e, delay)  # fmt: skip
                await asyncio.sleep(delay)
                delay = min(delay * 2, RESPAWN_BACKOFF_S[1])
                continue
            if first:
                self._started[slot].set_result(None)
                first = False
            print(f"libra: rollout worker {slot} started (pid {w.pid})", file=sys.stderr,
                  flush=True)  # fmt: skip
            if self.closing:  # a replacement that came up after the pool began to close
                w.send({"op": "stop"})
            delay = RESPAWN_BACKOFF_S[0]
            watch = asyncio.ensure_future(self._watch(w))
            try:
                await self._read(w, reader)
            finally:
                watch.cancel()
                running = self._lose(w)
                code = await self._reap(w)
            if not self.closing:
                print(f"libra: rollout worker {slot} (pid {w.pid}) exited with {code}; "
                      f"its {running} running episodes run again", file=sys.stderr,
                      flush=True)  # fmt: skip

    async def _watch(self, w: _Worker) -> None:
        """Ping `w` while it is quiet; kill it once it has said nothing for `hang_s`
        (`HANG_S`): its socket then ends, and `_supervise` replaces it."""
        loop = asyncio.get_running_loop()
        w.heard = loop.time()
        while True:
            await asyncio.sleep(self.hang_s / 4)
            quiet = loop.time() - w.heard
            if quiet >= self.hang_s:
                print(f"libra: rollout worker {w.slot} (pid {w.pid}) answered nothing for "
                      f"{quiet:.0f} s: killed as hung", file=sys.stderr, flush=True)  # fmt: skip
                with contextlib.suppress(ProcessLookupError):
                    w.proc.kill()
                return
            if quiet >= self.hang_s / 4:
                w.send({"op": "ping"})

    async def _start(self, slot: int) -> tuple[_Worker, asyncio.StreamReader]:
        cmd = [sys.executable, "-m", "libra.rollout.worker",
               "--connect", self.socket_path, "--id", str(slot)]  # fmt: skip
        conn = asyncio.get_running_loop().create_future()
        self._conns[slot] = conn
        proc = await asyncio.to_thread(
            subprocess.Popen, cmd, stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(),
            start_new_session=True, preexec_fn=die_with_parent(),
        )  # fmt: skip
        w = _Worker(slot, proc)
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                while not conn.done():
                    if proc.poll() is not None:
                        raise RuntimeError(f"worker exited with {proc.returncode} at start")
                    await asyncio.wait([conn], timeout=0.2)
                reader, writer = conn.result()
                w.writer = writer
                w.pid = proc.pid
                # no await between the init and joining `_told`: no pool change is missed
                w.send({"op": "init", "init": self.init_for().model_dump(mode="json")})
                self._told.add(w)
                got = await read_frame(reader)
            if got is None or got[0]["op"] != "ready":
                why = got[0].get("message") if got else f"it exited ({proc.wait()})"
                raise RuntimeError(why)
        except BaseException:
            self._told.discard(w)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await asyncio.to_thread(proc.wait)
            if w.writer is not None:
                w.writer.close()
            raise
        w.ready = True
        self.workers[slot] = w
        self._freed.set()
        return w, reader

    async def _read(self, w: _Worker, reader: asyncio.StreamReader) -> None:
        try:
            n = 0
            loop = asyncio.get_running_loop()
            while (got := await read_frame(reader)) is not None:
                w.heard = loop.time()
                self._on_frame(w, *got)
                n += 1
                if n % REPLY_SLICE == 0:
                    await asyncio.sleep(0)  # buffered frames are read without yielding
        except (WireError, OSError) as e:
            log.warning("rollout worker %d: %s", w.slot, e)
        except Exception:  # a bad message: drop this worker (a new one starts), not the front
            log.exception("rollout worker %d sent what the front cannot handle", w.slot)

    def _on_frame(self, w: _Worker, h: dict[str, Any], blob: bytes) -> None:
        op = h["op"]
        if op == "pong":
            return  # heard: that was all
        if op in ("monitor", "drained"):
            fut = w.replies.pop("monitor" if op == "monitor" else f"drain:{h['k']}", None)
            if fut is not None and not fut.done():
                fut.set_result(h)
            return
        call = w.calls.pop(h["e"], None)
        self._freed.set()
        if call is None or call.future.done():
            return  # an episode given up on (its cancel timed out)
        if op == "done":
            call.future.set_result(unpack_record(h, blob))
            lesson = h.get("lesson")
            if lesson is not None:
                for other in self.workers:
                    if other is not None and other is not w and other.ready:
                        other.send({"op": "learn", "env": call.env, "l": [lesson]})
                if self.on_lesson is not None:
                    self.on_lesson(call.env, Lesson.of(lesson))
        elif op == "none":
            call.future.set_result(None)
        else:
            call.future.set_exception(RuntimeError(f"in its worker: {h.get('error')}"))

    def _lose(self, w: _Worker) -> int:
        """`w` is gone: its calls fail with WorkerLost (their episodes run again)."""
        w.lost = True
        w.ready = False
        self._told.discard(w)
        if self.workers[w.slot] is w:
            self.workers[w.slot] = None
        calls, w.calls = w.calls, {}
        for call in calls.values():
            if not call.future.done():
                call.future.set_exception(WorkerLost())
        for fut in w.replies.values():
            if not fut.done():
                fut.cancel()
        self.lost_total += len(calls)
        if w.writer is not None:
            w.writer.close()
        return len(calls)

    async def _reap(self, w: _Worker) -> int | None:
        if self.closing:
            with contextlib.suppress(subprocess.TimeoutExpired):
                return await asyncio.to_thread(w.proc.wait, 10)
        with contextlib.suppress(ProcessLookupError):
            w.proc.send_signal(signal.SIGKILL)
        return await asyncio.to_thread(w.proc.wait)

    # --- episodes ----------------------------------------------------------------------
    def runner(self, info: BatchInfo, policy: RoutingPolicy) -> WorkerRunner:
        self._batches[info.id] = info
        return WorkerRunner(self, info, policy)

    async def _pick(self, call: _Call) -> _Worker:
        """The live worker with the fewest calls; for an episode whose workers died
        under it, the one with the fewest calls that died with it, none of them kept
        apart from it (waits until one is)."""
        while True:
            self._freed.clear()
            live = [w for w in self.workers if w is not None and w.ready]
            if live and not call.died:
                return min(live, key=lambda w: len(w.calls))
            fits = []
            for w in live:
                shared = [c for c in w.calls.values() if c.died & call.died]
                if not any(call.apart(c) for c in shared):
                    fits.append((len(shared), len(w.calls), w.slot, w))
            if fits:
                return min(fits)[-1]
            await self._freed.wait()

    async def run(
        self,
        info: BatchInfo,
        spec: EpisodeSpec,
        waited: float,
        on_abort: Callable[[RawRecord], None] | None,
    ) -> RawRecord:
        """Run `spec` in a worker; its record. Cancelled: the worker's `aborted` record
        goes to `on_abort` (if it comes within ABORT_WAIT_S), then CancelledError."""
        loop = asyncio.get_running_loop()
        died: frozenset[int] = frozenset()
        while True:
            fut: asyncio.Future[RawRecord | None] = loop.create_future()
            call = _Call(fut, info.env, died)
            w = await self._pick(call)
            if info.id not in w.batches:
                w.batches.add(info.id)
                w.send({"op": "batch", "b": info.id, "env": info.env, "sampling": info.sampling})
            key = next(self._keys)
            w.calls[key] = call
            w.send({"op": "run", "e": key, "b": info.id, "bid": spec.batch_id, "id": spec.id,
                    "task_id": spec.task_id, "group_id": spec.group_id, "task": spec.task,
                    "index": spec.index, "step": spec.step, "waited": waited})  # fmt: skip
            try:
                record = await asyncio.shield(fut)  # cancelled, it still takes the reply
            except WorkerLost:
                died |= {w.serial}
                if len(died) >= MAX_LOST:
                    # The episode's record, not the batch's end: it raised here, and the
                    # batch (`libra rollout`) stopped with every other episode aborted.
                    return _lost_record(info, spec, len(died))
                continue
            except asyncio.CancelledError:
                await self._cancel(w, key, fut, on_abort)
                raise
            if record is None:
                raise RuntimeError("its worker ended it without a record")
            return record

    async def _cancel(
        self,
        w: _Worker,
        key: int,
        fut: asyncio.Future[RawRecord | None],
        on_abort: Callable[[RawRecord], None] | None,
    ) -> None:
        if self.closing or w.lost:
            w.calls.pop(key, None)
            self._freed.set()
            return
        w.send({"op": "cancel", "e": key})
        await asyncio.wait([fut], timeout=ABORT_WAIT_S)
        w.calls.pop(key, None)
        self._freed.set()
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            record = fut.result()
            if record is not None and on_abort is not None:
                on_abort(record)

    def end_batch(self, batch_id: str) -> None:
        """The batch completed: workers close its runner."""
        self._batches.pop(batch_id, None)
        for w in self.workers:
            if w is not None and batch_id in w.batches:
                w.batches.discard(batch_id)
                w.send({"op": "end", "b": batch_id})

    def set_version(self, version: int, urls: Sequence[str] | None) -> None:
        for w in self.workers:
            if w is not None:
                w.send({"op": "version", "v": version, "urls": list(urls) if urls else None})

    # --- the front's pool, followed (`libra.endpoints.pool.PoolFollower`) --------------
    def follow(self, change: dict[str, Any]) -> None:
        for w in self._told:
            w.send({"op": "pool", "c": change})

    async def drain(self, url: str, timeout_s: float) -> int:
        """Each worker stops calling `url` and waits for its calls there; how many were
        still running when `timeout_s` ran out (a worker lost meanwhile has none)."""
        loop = asyncio.get_running_loop()
        asked: dict[asyncio.Future[dict[str, Any]], tuple[_Worker, str]] = {}
        for w in self._told:
            if not w.ready:  # still starting: it has no calls, and it got the pause
                continue
            n = next(self._keys)
            key = f"drain:{n}"
            fut: asyncio.Future[dict[str, Any]] = loop.create_future()
            w.replies[key] = fut
            w.send({"op": "drain", "k": n, "url": url, "t": timeout_s})
            asked[fut] = (w, key)
        if not asked:
            return 0
        done, late = await asyncio.wait(asked, timeout=timeout_s + 5)
        for fut in late:
            w, key = asked[fut]
            w.replies.pop(key, None)
            fut.cancel()
        return sum(f.result()["left"] for f in done if not f.cancelled())

    def end_step(self, env: str, step: int) -> None:
        """Step `step` ended: every worker's routing policy for `env` applies what it
        held back (`RoutingPolicy.end_step`, between-steps updates)."""
        for w in self._told:
            w.send({"op": "step", "env": env, "s": step})

    async def monitor(self) -> list[dict[str, Any]]:
        """Each live worker's figures since the last call (workers started with
        `monitor`: loop lag, GC passes; all: CPU seconds so far)."""
        futs = []
        loop = asyncio.get_running_loop()
        for w in self.workers:
            if w is not None and w.ready:
                fut: asyncio.Future[dict[str, Any]] = loop.create_future()
                w.replies["monitor"] = fut
                w.send({"op": "monitor"})
                futs.append(fut)
        return list(await asyncio.gather(*futs))

    def pids(self) -> list[int]:
        return [w.pid for w in self.workers if w is not None]


def _lost_record(info: BatchInfo, spec: EpisodeSpec, lost: int) -> RawRecord:
    """The `error` record of an episode whose workers died under it `lost` times."""
    rec = Trajectory(id=spec.id, batch_id=spec.batch_id, task_id=spec.task_id,
                     group_id=spec.group_id, env=info.env, step=spec.step, status="error",
                     error=f"{lost} rollout workers died while running it (a process exit or "
                     "crash in the env's code?); it is not run again")  # fmt: skip
    return unpack_record(*pack_record(rec))


__all__ = ["BatchInfo", "WorkerLost", "WorkerPool", "split_limits", "worker_buckets"]
