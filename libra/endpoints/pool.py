"""Buckets of OpenAI-compatible endpoints: least-loaded choice, health, failover.

One aiohttp session per process (keep-alive). Each endpoint has an in-flight limit;
calls beyond it wait in Libra (backpressure instead of a flooded server). A call that
fails with a connection error marks its endpoint down and is retried at once on a
sibling in the same bucket; 429 / 5xx / timeouts are retried with capped, fully jittered
exponential backoff. A background probe (`GET /health`) brings endpoints back.
The pool owns that probe task: `async with EndpointPool(...)` starts and stops it.

Membership (which endpoints, which are admitting, their weight versions) may be
followed by other processes' pools (`PoolFollower`: rollout workers, whose calls this
pool never sees): every change is told to them in order, and `drain` waits for their
calls to the endpoint as well as this pool's.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import orjson

from libra.endpoints.client import Completion, RetriableError, completion_body, post_completion
from libra.endpoints.config import EndpointConfig
from libra.endpoints.governor import LagGovernor, Limiter
from libra.errors import EndpointDown, EndpointError
from libra.routing.base import Bucket

log = logging.getLogger("libra.endpoints")


class BucketDown(EndpointDown):
    """No endpoint of the bucket came back within `down_wait_s`."""

    def __init__(self, bucket: str, message: str):
        super().__init__(message)
        self.bucket = bucket


class PoolFollower(Protocol):
    """Another pool that mirrors this one's membership (`EndpointPool.followers`)."""

    def follow(self, change: dict[str, Any]) -> None:
        """Apply `change` (`{"do": "add" | "admit" | "remove" | "version", ...}`, as
        `EndpointPool.apply` takes it) after every earlier one."""
        ...

    async def drain(self, url: str, timeout_s: float) -> int:
        """Stop new calls to `url`; wait at most `timeout_s` for those in flight; how
        many were still running."""
        ...


@dataclass(eq=False, slots=True)
class Endpoint:
    url: str
    bucket: str
    max_inflight: int
    inflight: int = 0
    healthy: bool = True
    version: int = 0
    """Weights version loaded on this endpoint (stamped on every turn it serves)."""
    model: str | None = None
    """Served model name from `/v1/models` (vLLM answers 404 to any other name)."""
    served: int = 0
    failures: int = 0
    admitting: bool = True
    """False while the endpoint is paused (a weight update) or being retired: no new
    calls go to it; calls already sent finish."""


@dataclass(eq=False, slots=True)
class _BucketState:
    spec: Bucket
    endpoints: list[Endpoint]
    cond: asyncio.Condition = field(default_factory=asyncio.Condition)


@dataclass(slots=True)
class Served:
    completion: Completion
    endpoint: Endpoint
    version: int
    queued_s: float
    generate_s: float
    attempts: int


class EndpointPool:
    def __init__(
        self,
        buckets: Sequence[tuple[Bucket, Sequence[str]]],
        config: EndpointConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        joined_later: bool = False,
    ):
        """`joined_later`: the buckets start empty and their servers join through
        `add_endpoint` (`libra train` registers the engines it starts); otherwise every
        bucket must have an endpoint that answers when the pool opens."""
        self.config = config or EndpointConfig()
        self.joined_later = joined_later
        self.clock = clock
        self.rng = rng or random.Random()
        self._buckets: dict[str, _BucketState] = {}
        for spec, urls in buckets:
            eps = [Endpoint(u.rstrip("/"), spec.name, self.config.max_inflight) for u in urls]
            self._buckets[spec.name] = _BucketState(spec, eps)
        self._session: aiohttp.ClientSession | None = None
        self._probe: asyncio.Task[None] | None = None
        self._lag_task: asyncio.Task[None] | None = None
        self.governor = LagGovernor(
            target_s=self.config.loop_lag_target_s,
            max_cap=self.config.max_inflight_total,
            cap=min(64, self.config.max_inflight_total),
        )
        self.limiter = Limiter(self.governor.cap)
        self.followers: list[PoolFollower] = []
        """Pools in other processes that mirror this one's membership (module doc)."""
        cfg = self.config
        self._headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}

    # --- lifecycle ------------------------------------------------------------------
    async def __aenter__(self) -> EndpointPool:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, ttl_dns_cache=None)
        self._session = aiohttp.ClientSession(
            connector=connector,
            json_serialize=_dumps,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s),
        )
        try:
            await self._check_all()
        except BaseException:
            await self._session.close()
            raise
        self._probe = asyncio.create_task(self._probe_loop(), name="libra-endpoint-probe")
        self._lag_task = asyncio.create_task(self._lag_loop(), name="libra-loop-lag")
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in (self._probe, self._lag_task):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("EndpointPool used outside `async with`")
        return self._session

    @property
    def buckets(self) -> list[Bucket]:
        return sorted((b.spec for b in self._buckets.values()), key=lambda b: b.bound)

    def endpoints(self, bucket: str | None = None) -> list[Endpoint]:
        states = [self._buckets[bucket]] if bucket else list(self._buckets.values())
        return [e for s in states for e in s.endpoints]

    def has_healthy(self, bucket: str) -> bool:
        return any(e.healthy for e in self._buckets[bucket].endpoints)

    def set_version(self, version: int, urls: Sequence[str] | None = None) -> None:
        """Record that `version` weights are loaded on `urls` (default: all endpoints)."""
        wanted = {u.rstrip("/") for u in urls} if urls is not None else None
        for e in self.endpoints():
            if wanted is None or e.url in wanted:
                e.version = version
        told = None if wanted is None else sorted(wanted)
        self._tell({"do": "version", "version": version, "urls": told})

    def _tell(self, change: dict[str, Any]) -> None:
        for f in self.followers:
            f.follow(change)

    async def apply(self, change: dict[str, Any]) -> None:
        """A change another pool told its followers (`PoolFollower.follow`). The leader
        checked the endpoint before it joined; one this pool lacks is skipped."""
        do = change["do"]
        if do == "add":
            if not any(e.url == change["url"] for e in self.endpoints()):
                await self.add_endpoint(change["bucket"], change["url"], change["version"],
                                        checked=change["model"],
                                        admitting=change.get("admitting", True))  # fmt: skip
        elif do == "version":
            self.set_version(change["version"], change["urls"])
        elif any(e.url == change["url"] for e in self.endpoints()):
            if do == "admit":
                await self.set_admitting(change["url"], change["admitting"])
            elif do == "remove":
                await self.remove_endpoint(change["url"])

    # --- membership (libra train: engines come and go, weights change) ---------------
    async def add_endpoint(
        self,
        bucket: str,
        url: str,
        version: int = 0,
        *,
        checked: str | None = None,
        admitting: bool = True,
    ) -> Endpoint:
        """Register a running server in `bucket` (serving weights `version`); calls may
        go to it at once (`admitting=False`: once `set_admitting` lets them). Raises
        EndpointDown when it does not answer. (`checked`: the model name it serves, as
        another pool's probe found it: not probed again.)"""
        state = self._buckets[bucket]
        ep = Endpoint(url.rstrip("/"), bucket, self.config.max_inflight, version=version)
        ep.model, ep.admitting = checked, admitting
        why = await self._probe_one(ep) if checked is None else None
        if why is not None:
            raise EndpointDown(f"{ep.url} cannot join bucket {bucket!r}: {why}", url=ep.url)
        async with state.cond:
            state.endpoints.append(ep)
            state.cond.notify_all()
        self._tell({"do": "add", "bucket": bucket, "url": ep.url, "version": version,
                    "model": ep.model, "admitting": admitting})  # fmt: skip
        return ep

    def find(self, url: str) -> Endpoint:
        url = url.rstrip("/")
        for e in self.endpoints():
            if e.url == url:
                return e
        raise KeyError(url)

    async def set_admitting(self, url: str, admitting: bool) -> Endpoint:
        """Pause (False) or resume (True) new calls to `url`; waiters wake on resume."""
        ep = self.find(url)
        state = self._buckets[ep.bucket]
        async with state.cond:
            ep.admitting = admitting
            state.cond.notify_all()
        self._tell({"do": "admit", "url": ep.url, "admitting": admitting})
        return ep

    async def drain(self, url: str, timeout_s: float, poll_s: float = 0.05) -> int:
        """Stop new calls to `url` and wait (at most `timeout_s`) for its calls in flight
        to finish (this pool's and its followers'); returns how many were still running."""
        ep = await self.set_admitting(url, False)
        deadline = self.clock() + timeout_s

        async def here() -> int:
            # polled: a release wakes one caller waiting for a slot (`notify`), not us
            while ep.inflight and self.clock() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(poll_s)
            return ep.inflight

        left = await asyncio.gather(here(), *(f.drain(ep.url, timeout_s) for f in self.followers))
        return sum(left)

    async def remove_endpoint(self, url: str) -> None:
        """Forget `url` (drain it first). A call still running on it that then fails is
        retried on a sibling like any failover."""
        ep = self.find(url)
        state = self._buckets[ep.bucket]
        async with state.cond:
            ep.admitting = False
            state.endpoints.remove(ep)
            state.cond.notify_all()
        self._tell({"do": "remove", "url": ep.url})

    # --- health ---------------------------------------------------------------------
    async def _probe_one(self, ep: Endpoint) -> str | None:
        """None when healthy, else the reason."""
        timeout = aiohttp.ClientTimeout(total=max(2.0, self.config.connect_timeout_s))
        try:
            async with self.session.get(
                f"{ep.url}/v1/models", headers=self._headers, timeout=timeout
            ) as resp:
                if resp.status != 200:
                    return f"GET /v1/models answered HTTP {resp.status}"
                doc = orjson.loads(await resp.read())
            models = doc.get("data") or []
            if models and ep.model is None:
                ep.model = models[0].get("id")
        except aiohttp.ClientConnectorError as e:
            return f"cannot connect: {e.os_error.strerror or e.os_error}"
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        except (orjson.JSONDecodeError, AttributeError):
            return "GET /v1/models did not return an OpenAI model list"
        return None

    async def _check_all(self) -> None:
        eps = self.endpoints()
        reasons = await asyncio.gather(*(self._probe_one(e) for e in eps))
        for ep, why in zip(eps, reasons, strict=True):
            ep.healthy = why is None
        for name, state in self._buckets.items():
            if self.joined_later and not state.endpoints:
                continue
            if not state.endpoints:
                raise EndpointError(f"bucket {name!r} has no endpoints; add --endpoint {name}=URL")
            if not any(e.healthy for e in state.endpoints):
                detail = "; ".join(
                    f"{e.url} ({why})"
                    for e, why in zip(eps, reasons, strict=True)
                    if e.bucket == name
                )
                raise EndpointDown(
                    f"no endpoint of bucket {name!r} answers: {detail}; start a server "
                    "(e.g. `libra serve-engine`) or fix --endpoint"
                )
        for ep, why in zip(eps, reasons, strict=True):
            if why is not None:
                log.warning("endpoint %s is down at start: %s", ep.url, why)

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            down = [e for e in self.endpoints() if not e.healthy]
            if not down:
                continue
            reasons = await asyncio.gather(*(self._probe_one(e) for e in down))
            for ep, why in zip(down, reasons, strict=True):
                if why is None:
                    log.warning("endpoint %s is back", ep.url)
                    await self._set_health(ep, True)

    async def _lag_loop(self) -> None:
        """Measure event-loop lag every 10 ms; feed the worst of each 50 ms window to the
        governor, which sets the cap on requests in flight."""
        loop = asyncio.get_running_loop()
        worst = 0.0
        n = 0
        while True:
            t = loop.time()
            await asyncio.sleep(0.01)
            worst = max(worst, loop.time() - t - 0.01)
            n += 1
            if n == 5:
                self.limiter.set_limit(self.governor.observe(worst, self.limiter.inflight))
                worst, n = 0.0, 0

    async def _set_health(self, ep: Endpoint, healthy: bool) -> None:
        state = self._buckets[ep.bucket]
        async with state.cond:
            ep.healthy = healthy
            state.cond.notify_all()

    async def mark_down(self, ep: Endpoint, why: str) -> None:
        if ep.healthy:
            log.warning("endpoint %s marked down: %s", ep.url, why)
        ep.failures += 1
        await self._set_health(ep, False)

    # --- calls ----------------------------------------------------------------------
    async def _acquire(self, bucket: str) -> Endpoint:
        state = self._buckets[bucket]
        deadline: float | None = None
        async with state.cond:
            while True:
                best: Endpoint | None = None
                for e in state.endpoints:
                    if (
                        e.healthy
                        and e.admitting
                        and e.inflight < e.max_inflight
                        and (best is None or e.inflight < best.inflight)
                    ):
                        best = e
                if best is not None:
                    best.inflight += 1
                    return best
                if any(e.healthy for e in state.endpoints):
                    await state.cond.wait()
                    continue
                now = self.clock()
                deadline = now + self.config.down_wait_s if deadline is None else deadline
                if now >= deadline:
                    raise BucketDown(
                        bucket,
                        f"no healthy endpoint in bucket {bucket!r} "
                        f"for {self.config.down_wait_s:g} s",
                    )
                try:
                    async with asyncio.timeout(deadline - now):
                        await state.cond.wait()
                except TimeoutError:
                    pass

    async def _release(self, ep: Endpoint) -> None:
        state = self._buckets[ep.bucket]
        async with state.cond:
            ep.inflight -= 1
            state.cond.notify()

    def _backoff(self, attempt: int) -> float:
        cap = min(self.config.backoff_max_s, self.config.backoff_s * 2 ** (attempt - 1))
        return self.rng.uniform(0, cap)

    async def generate(
        self,
        bucket: str,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        logprobs: int = 1,
        seed: int | None = None,
        stop: list[str] | None = None,
        stop_token_ids: list[int] | None = None,
    ) -> Served:
        """One completion on the least-loaded healthy endpoint of `bucket`, with retries
        and failover inside the bucket. Raises BucketDown when the bucket has no healthy
        endpoint for `down_wait_s`, EndpointError when retries are exhausted or the
        endpoint rejects the request."""
        queued = generating = 0.0
        attempts = 0
        while True:
            t0 = self.clock()
            ep = await self._acquire(bucket)
            try:
                await self.limiter.acquire()
            except BaseException:
                await self._release(ep)
                raise
            t1 = self.clock()
            queued += t1 - t0
            version = ep.version
            body = completion_body(
                ep.model,
                prompt_ids,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                logprobs=logprobs,
                seed=seed,
                stop=stop or [],
                stop_token_ids=stop_token_ids or [],
            )
            failure: EndpointError | None = None
            try:
                async with asyncio.timeout(self.config.request_timeout_s):
                    completion = await post_completion(
                        self.session, ep.url, body, headers=self._headers
                    )
            except TimeoutError:
                failure = RetriableError(
                    f"{ep.url}: no answer within {self.config.request_timeout_s:g} s", url=ep.url
                )
            except EndpointDown as e:
                failure = e
                await self.mark_down(ep, str(e))
            except RetriableError as e:
                failure = e
            else:
                ep.served += 1
                generating += self.clock() - t1
                return Served(completion, ep, version, queued, generating, attempts + 1)
            finally:
                self.limiter.release()
                await self._release(ep)
            generating += self.clock() - t1
            attempts += 1
            if attempts > self.config.retries:
                raise EndpointError(
                    f"bucket {bucket!r}: giving up after {attempts} attempts: {failure}"
                )
            sibling_up = isinstance(failure, EndpointDown) and self.has_healthy(bucket)
            if not sibling_up:
                await asyncio.sleep(self._backoff(attempts))


def _dumps(obj: object) -> str:
    return orjson.dumps(obj).decode()


__all__ = ["BucketDown", "Endpoint", "EndpointPool", "PoolFollower", "Served"]
