"""Engines a job launched, kept serving: one that exits or is lost with its node is
replaced, and its replacement serves the weights the others serve.

`libra rollout` and `libra serve-rollout` launch engines (`launch = N` in a bucket,
`--launch N`: embedded ones, or vLLM servers with `[launch] kind = "vllm"`), locally or
on a Ray cluster's nodes. `EngineWatch` polls them
(`libra.cluster.engines.engine_down`: an exit code, or a Ray node silent for
`SILENT_S` whose engine does not answer either). A lost engine leaves the pool at once
(its turns fail over to the bucket's other endpoints, as on any endpoint failure), is
stopped (reaped, or its Ray actor and placement group freed) and started again, with
Ray wherever a node has room. Then it joins its bucket with the latest weight update
(`loaded`):

- none yet: the model the engines started with, at version 0; it joins at once;
- a checkpoint folder (`POST /v1/weights` with a path): loaded into it first, and it
  joins at that version;
- tensors broadcast from a trainer, which only the trainer holds: it joins *paused* (no
  turn goes to it) and is admitted once the next weight update has reached it.

An engine a broadcast update failed halfway (its weights may be half new: the update
took it out of the pool) is `condemn`-ed and replaced the same way, though it runs.

A start that fails is retried with a doubling backoff (`backoff_s` .. `max_backoff_s`)
for as long as the job runs. Each loss, restart and failure is one line on stderr
(`say`) and counted (`restarts`, `failures`). Weight updates and joins hold one lock
(`lock`), so a replacement never joins between an update's loads and misses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import aiohttp

from libra.cluster.engines import Engine, Launched, engine_down, stop_engine
from libra.endpoints.pool import EndpointPool
from libra.errors import LibraError

BASE = ""
"""The folder of `EngineWatch.latest` before any update: the model engines start with."""


def _stderr(line: str) -> None:
    print(f"libra: {line}", file=sys.stderr, flush=True)


@dataclass(slots=True)
class EngineWatch:
    """Keeps a job's launched engines serving (module doc)."""

    interval_s: float = 1.0
    backoff_s: float = 2.0
    max_backoff_s: float = 60.0
    check_local: bool = True
    """Check that a folder exists here before loading it (`check_weights_locally`)."""
    say: Callable[[str], None] = _stderr
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held by weight updates (around `loaded` too) and by a replacement while it
    catches up and joins."""
    latest: tuple[int, str | None] = (0, BASE)
    """(version, folder) of the latest weight update: `BASE` before any, None for one
    that came by broadcast."""
    held: set[str] = field(default_factory=set)
    """Replacements that joined paused, waiting for a weight update."""
    condemned: dict[str, str] = field(default_factory=dict)
    """url -> why: running engines no longer trusted (a broadcast into them failed
    halfway and took them out of the pool), replaced at the next poll."""
    restarts: int = 0
    failures: int = 0

    async def loaded(
        self, pool: EndpointPool, urls: list[str], version: int, folder: str | None
    ) -> None:
        """A weight update put `version` (from `folder`; None: by broadcast) on `urls`.
        Call it holding `lock`. Paused replacements it reached are admitted."""
        self.latest = (version, folder)
        for url in sorted(self.held & {u.rstrip("/") for u in urls}):
            self.held.discard(url)
            with contextlib.suppress(KeyError):  # lost again meanwhile
                await pool.set_admitting(url, True)
                self.say(f"engine at {url} admitted: it serves version {version} now")

    def condemn(self, url: str, why: str) -> None:
        """Have the launched engine at `url` replaced though it runs (`condemned`); a
        URL that is no launched engine's is ignored."""
        self.condemned[url.rstrip("/")] = why

    @contextlib.asynccontextmanager
    async def running(self, launched: Launched, pool: EndpointPool) -> AsyncIterator[None]:
        """Watch `launched`'s engines for the block's duration."""
        task = asyncio.create_task(self._watch(launched, pool), name="libra-engine-watch")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _watch(self, launched: Launched, pool: EndpointPool) -> None:
        replacing: set[asyncio.Task[None]] = set()
        try:
            while True:
                for engine in [e for es in launched.engines.values() for e in es]:
                    try:
                        why = self.condemned.pop(engine.url, None) or await engine_down(engine)
                    except Exception as e:  # a poll that fails says nothing: next round
                        self.say(f"engine {engine.worker}: its check failed ({e!r})")
                        continue
                    if why is None:
                        continue
                    bucket = launched.forget(engine)  # not watched from here on
                    task = asyncio.create_task(self._replace(launched, pool, bucket, engine, why))
                    replacing.add(task)
                    task.add_done_callback(replacing.discard)
                await asyncio.sleep(self.interval_s)
        finally:
            for task in replacing:
                task.cancel()
            await asyncio.gather(*replacing, return_exceptions=True)

    async def _replace(
        self, launched: Launched, pool: EndpointPool, bucket: str, old: Engine, why: str
    ) -> None:
        self.say(f"engine {old.worker} at {old.url} (node {old.slot.node}) {why}; "
                 "restarting it")  # fmt: skip
        with contextlib.suppress(KeyError):  # its turns fail over to the bucket's others
            await pool.remove_endpoint(old.url)
        self.held.discard(old.url)
        grace = launched.launcher.stop_grace_s
        await stop_engine(old, grace)  # reaped, or its Ray actor and placement group freed
        wait = self.backoff_s
        while True:
            try:
                new = await launched.start_one(bucket, old.worker)
                try:
                    version, paused = await self._join(pool, bucket, new)
                except BaseException:
                    launched.forget(new)
                    await stop_engine(new, grace)
                    raise
                break
            except (LibraError, aiohttp.ClientError, OSError) as e:
                self.failures += 1
                self.say(f"engine {old.worker}: its restart failed ({e}); trying again "
                         f"in {wait:g} s")  # fmt: skip
                await asyncio.sleep(wait)
                wait = min(2 * wait, self.max_backoff_s)
        self.restarts += 1
        where = f" on Ray node {new.slot.node}" if new.slot.node != "local" else ""
        state = (f"paused until the next weight update reaches it (version {version} came "
                 "by broadcast or no longer loads)") if paused else (
                 f"serving version {version}")  # fmt: skip
        self.say(f"engine {new.worker} restarted{where} at {new.url}, {state}")

    async def _join(self, pool: EndpointPool, bucket: str, new: Engine) -> tuple[int, bool]:
        """Catch `new` up with the latest update and add it to `bucket`, paused when that
        cannot be done here; (the update's version, paused)."""
        async with self.lock:
            version, folder = self.latest
            paused = not await self._catch_up(pool, new, version, folder)
            await pool.add_endpoint(bucket, new.url, 0 if paused else version,
                                    admitting=not paused)  # fmt: skip
            if paused:
                self.held.add(new.url)
        return version, paused

    async def _catch_up(
        self, pool: EndpointPool, new: Engine, version: int, folder: str | None
    ) -> bool:
        """Load the latest update into `new`; False when that cannot be done here."""
        if folder == BASE:
            return True
        if folder is None:  # broadcast: only the trainer holds those tensors
            return False
        from libra.engine.weights import load_weights

        try:
            await load_weights(pool.session, new.url, new.kind, folder,
                               check_local=self.check_local)  # fmt: skip
        except (LibraError, aiohttp.ClientError, OSError) as e:
            self.say(f"engine {new.worker}: version {version} from {folder} did not load "
                     f"into it ({e})")  # fmt: skip
            return False
        return True


__all__ = ["BASE", "EngineWatch"]
