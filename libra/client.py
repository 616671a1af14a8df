"""Python client of `libra serve-rollout`: submit batches, stream trajectories.

    async with AsyncClient("http://127.0.0.1:8700") as c:
        batch = await c.submit("arith", tasks, group_size=8)
        async for group in c.groups(batch):          # one completed GRPO group at a time
            train_on(group.records)

    with Client("http://127.0.0.1:8700") as c:       # blocking, for plain training loops
        for group in c.groups(c.submit("arith", tasks, group_size=8)):
            ...

Streams resume by cursor: when the connection drops or the service restarts, the
client reconnects with `after=<last seq received>` (backing off, for up to
`reconnect_s` without progress), so each record arrives exactly once. A submit carries
a client-made `batch_id`, so retrying it after a lost reply cannot create a second
batch. Errors the service answers with a reason (4xx) raise `ServiceError` at once.
"""

from __future__ import annotations

import asyncio
import os
import random
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aiohttp
import orjson

from libra.errors import LibraError
from libra.record import Trajectory

T = TypeVar("T")


class ServiceError(LibraError):
    """The service refused a request (`status` 4xx/5xx; the message is its reason, with
    each failing endpoint's own where the answer lists them), or could not be reached
    for `reconnect_s`. `detail` is the answer's JSON body, when it had one."""

    def __init__(
        self, message: str, status: int | None = None, detail: dict[str, Any] | None = None
    ):
        super().__init__(message)
        self.status = status
        self.detail = detail

    @property
    def retriable(self) -> bool:
        """Unreachable, or an answer that means "try again later" (507: the service's
        spool disk is full until someone frees space); any other status is the service's
        final word."""
        return self.status is None or self.status in (408, 429, 503, 504, 507)


@dataclass(slots=True)
class Group:
    """The G samples of one task, delivered once all of them finished."""

    group_id: str
    task_id: str
    seq: int
    """Seq of the record that completed the group (the stream's cursor)."""
    records: list[Trajectory]


class AsyncClient:
    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout_s: float = 60.0,
        reconnect_s: float = 300.0,
        backoff_s: float = 0.2,
        backoff_max_s: float = 5.0,
    ):
        self.url = url.rstrip("/")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            # a URL without its scheme was retried until `reconnect_s` (5 minutes)
            raise ValueError(f"service URL {url!r}: expected http://HOST:PORT "
                             "(e.g. http://127.0.0.1:8000)")  # fmt: skip
        token = token or os.environ.get("LIBRA_TOKEN")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout_s = timeout_s
        """Limit for one request (not for a stream, which waits as long as episodes run)."""
        self.reconnect_s = reconnect_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    # --- calls ---------------------------------------------------------------------
    async def submit(
        self,
        env: str,
        tasks: list[dict[str, Any]],
        *,
        group_size: int = 1,
        sampling: dict[str, Any] | None = None,
        batch_id: str | None = None,
        step: int | None = None,
        weight: float | None = None,
    ) -> str:
        """Submit a batch; returns its id. Safe to call again with the same id. `weight`:
        its share of the service's episode slots against other busy batches (default 1;
        an evaluation batch at 0.25 takes a fifth of them beside a training batch)."""
        body: dict[str, Any] = {
            "env": env,
            "tasks": tasks,
            "group_size": group_size,
            "batch_id": batch_id or uuid.uuid4().hex[:16],
        }
        if sampling:
            body["sampling"] = sampling
        if step is not None:
            body["step"] = step
        if weight is not None:
            body["weight"] = weight
        doc = await self._call("POST", "/v1/rollouts", body)
        return str(doc["batch_id"])

    async def status(self, batch_id: str) -> dict[str, Any]:
        return await self._call("GET", f"/v1/rollouts/{batch_id}")

    async def cancel(self, batch_id: str) -> dict[str, Any]:
        return await self._call("DELETE", f"/v1/rollouts/{batch_id}")

    async def update_weights(
        self, version: int, path: str | None = None, *, sender: str | None = None
    ) -> dict[str, Any]:
        """Load checkpoint folder `path` into every endpoint, or have them receive the
        tensors of the broadcast `sender` (a `libra.weights.remote.serve_sender` URL in
        this process: `broadcast_weights` does both); later turns carry `version`."""
        body: dict[str, Any] = {"version": version}
        body |= {"path": path} if sender is None else {"sender": sender}
        return await self._call("POST", "/v1/weights", body)

    async def broadcast_weights(
        self, version: int, tensors: Callable[[], dict[str, Any]], *, host: str = "127.0.0.1"
    ) -> dict[str, Any]:
        """Send `tensors()` (name -> torch tensor, HF names, as a checkpoint holds them)
        straight from this process's memory into every endpoint: no file. The engines
        connect to `host` (an address of this machine they can reach). Needs torch."""
        from libra.transfer.local import LocalSender
        from libra.weights.remote import serve_sender

        async with serve_sender(LocalSender(tensors, version=lambda: version), host) as url:
            return await self.update_weights(version, sender=url)

    async def healthy(self) -> bool:
        """Whether the service answers `/healthz` now (one try; no service is False)."""
        try:
            await self._call("GET", "/healthz", retry=False)
        except (ServiceError, aiohttp.ClientError, OSError, TimeoutError):
            return False
        return True

    async def trajectories(self, batch_id: str, *, after: int = -1) -> AsyncIterator[Trajectory]:
        """Every record of the batch with `seq > after`, in seq order, as each finishes."""
        async for doc in self._stream(batch_id, "episode", after):
            yield Trajectory.model_validate(doc)

    async def groups(self, batch_id: str, *, after: int = -1) -> AsyncIterator[Group]:
        """Completed groups (all G samples finished), in the order they completed."""
        async for doc in self._stream(batch_id, "group", after):
            recs = [Trajectory.model_validate(r) for r in doc["records"]]
            yield Group(doc["group_id"], doc["task_id"], doc["seq"], recs)

    # --- plumbing ------------------------------------------------------------------
    async def _call(self, method: str, path: str, body: Any = None, retry: bool = True) -> Any:
        async def once() -> Any:
            timeout = aiohttp.ClientTimeout(total=self.timeout_s)
            data = orjson.dumps(body) if body is not None else None
            headers = {**self._headers, "Content-Type": "application/json"}
            async with self.session.request(
                method, self.url + path, data=data, headers=headers, timeout=timeout
            ) as r:
                raw = await r.read()
                if r.status >= 400:
                    raise _service_error(r.status, raw, method, path)
                return orjson.loads(raw) if raw else None

        return await self._retrying(once, f"{method} {path}") if retry else await once()

    async def _retrying(self, fn: Any, what: str) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.reconnect_s
        attempt = 0
        while True:
            try:
                return await fn()
            except ServiceError as e:
                if not e.retriable or loop.time() > deadline:
                    raise
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                if loop.time() > deadline:
                    raise ServiceError(f"{what}: cannot reach {self.url}: {_why(e)}") from None
            attempt += 1
            await asyncio.sleep(self._backoff(attempt))

    def _backoff(self, attempt: int) -> float:
        return random.uniform(0, min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1)))

    async def _stream(self, batch_id: str, unit: str, after: int) -> AsyncIterator[dict[str, Any]]:
        """Parsed lines of the stream; reconnects from the last seq after a cut."""
        loop = asyncio.get_running_loop()
        cursor = after
        attempt = 0
        deadline = loop.time() + self.reconnect_s
        path = f"/v1/rollouts/{batch_id}/trajectories"
        while True:
            try:
                params = {"after": str(cursor), "unit": unit}
                async with self.session.get(self.url + path, params=params,
                                            headers=self._headers) as r:  # fmt: skip
                    if r.status >= 400:
                        raise _service_error(r.status, await r.read(), "GET", path)
                    # a bytearray: a record of many MB arrives in many chunks, and
                    # `bytes +=` copied the whole line at each (50 MB: 7.8 s, now 0.1 s)
                    buf = bytearray()
                    async for chunk in r.content.iter_any():
                        buf += chunk
                        if b"\n" not in chunk:
                            continue
                        *lines, rest = buf.split(b"\n")
                        buf = bytearray(rest)
                        for line in lines:
                            if not line.strip():
                                continue
                            doc = orjson.loads(line)
                            if doc["seq"] <= cursor:
                                continue
                            cursor = doc["seq"]
                            attempt = 0
                            deadline = loop.time() + self.reconnect_s
                            yield doc
                    if buf.strip():
                        raise aiohttp.ClientPayloadError("stream ended inside a line")
                return  # the service ended the stream: the batch is complete
            except ServiceError as e:
                if not e.retriable or loop.time() > deadline:
                    raise
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                if loop.time() > deadline:
                    raise ServiceError(
                        f"lost the stream of batch {batch_id} after seq {cursor} and could not "
                        f"resume within {self.reconnect_s:g} s: {_why(e)}"
                    ) from None
            attempt += 1
            await asyncio.sleep(self._backoff(attempt))


def _service_error(status: int, raw: bytes, method: str, path: str) -> ServiceError:
    try:
        doc = orjson.loads(raw)
        reason = str(doc["error"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        doc, reason = None, raw[:300].decode(errors="replace") or "no reason given"
    detail = doc if isinstance(doc, dict) else None
    return ServiceError(f"{method} {path}: HTTP {status}: {reason}{_per_endpoint(detail)}",
                        status, detail)  # fmt: skip


def _per_endpoint(doc: dict[str, Any] | None) -> str:
    """`POST /v1/weights` answers a summary ("1 of 2 endpoints did not load it") and each
    endpoint's result: the reasons are what the caller needs to act (a missing
    config.json, an endpoint that is down), one per distinct reason with its endpoints."""
    results = (doc or {}).get("endpoints")
    if not isinstance(results, dict):
        return ""
    urls_by_reason: dict[str, list[str]] = {}
    for url, r in results.items():
        if isinstance(r, dict) and r.get("status") != "ok" and r.get("error"):
            urls_by_reason.setdefault(str(r["error"]), []).append(str(url))
    return "".join(f"; {', '.join(urls)}: {why}" for why, urls in urls_by_reason.items())


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class Client:
    """Blocking client (its own event loop), for scripts and plain training loops.
    Same methods as `AsyncClient`; the streams are ordinary iterators."""

    def __init__(self, url: str, **kwargs: Any):
        self._c = AsyncClient(url, **kwargs)  # a bad URL raises before a loop is made
        self._runner = asyncio.Runner()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._runner.run(self._c.close())
        self._runner.close()

    def submit(self, env: str, tasks: list[dict[str, Any]], **kwargs: Any) -> str:
        return str(self._runner.run(self._c.submit(env, tasks, **kwargs)))

    def status(self, batch_id: str) -> dict[str, Any]:
        return dict(self._runner.run(self._c.status(batch_id)))

    def cancel(self, batch_id: str) -> dict[str, Any]:
        return dict(self._runner.run(self._c.cancel(batch_id)))

    def update_weights(self, version: int, path: str) -> dict[str, Any]:
        return dict(self._runner.run(self._c.update_weights(version, path)))

    def broadcast_weights(
        self, version: int, tensors: Callable[[], dict[str, Any]], *, host: str = "127.0.0.1"
    ) -> dict[str, Any]:
        return dict(self._runner.run(self._c.broadcast_weights(version, tensors, host=host)))

    def healthy(self) -> bool:
        return bool(self._runner.run(self._c.healthy()))

    def trajectories(self, batch_id: str, *, after: int = -1) -> Iterator[Trajectory]:
        return self._iterate(self._c.trajectories(batch_id, after=after))

    def groups(self, batch_id: str, *, after: int = -1) -> Iterator[Group]:
        return self._iterate(self._c.groups(batch_id, after=after))

    def _iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        try:
            while True:
                try:
                    yield self._runner.run(agen.__anext__())  # type: ignore[arg-type]
                except StopAsyncIteration:
                    return
        finally:
            self._runner.run(agen.aclose())  # type: ignore[attr-defined]


__all__ = ["AsyncClient", "Client", "Group", "ServiceError"]
