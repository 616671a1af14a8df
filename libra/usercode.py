"""Running user code (tools, env hooks, agent functions) so that its limits hold whatever
it does.

- A plain function runs in a thread of the user-code pool, never on the event loop: a
  synchronous reward that sleeps 3 s costs the service nothing but that thread. The pool
  is its own (not asyncio's default one, which the spool's fsyncs use), so code stuck
  past its limit cannot starve the service's own file I/O.
- A coroutine function runs in a task of its own. The caller waits for that task under
  the limit and, at the limit (or when the caller itself is cancelled), cancels it and
  waits `GRACE_S` more for it to unwind. Code that swallows `CancelledError` is then left
  behind (kept referenced, logged when it ends): the episode goes on with a `timeout`.

Whatever user code raises reaches the caller as an `Exception`: a `BaseException` that
is not one (`SystemExit`, `KeyboardInterrupt`, a subclass of its own) would end the
process or the event loop, a `StopIteration` cannot cross into an asyncio future (the
call hung until its limit), a `CancelledError` from a plain function would read as the
caller's cancellation, and an exception whose `str()` raises would break every handler
that writes it into a record. Each becomes a `UserCodeError` naming what was raised.

What this cannot do: a thread cannot be killed. A plain function that blocks past its
limit keeps its thread until it returns (the episode has moved on); `overruns()` counts
such calls still running. Code that may block for good belongs in a process the env
can kill (a sandbox exec, `libra.envs.verifier`'s worker processes).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger("libra.usercode")

THREADS = 32
"""Threads for synchronous user code; calls beyond that wait for a free one (their
limit runs meanwhile)."""
GRACE_S = 1.0
"""How long cancelled async user code may take to unwind before it is left behind."""

_left_behind: set[asyncio.Future[Any] | concurrent.futures.Future[Any]] = set()


class LimitExceeded(TimeoutError):
    """User code ran past the limit `call` gave it (not a TimeoutError it raised)."""


class UserCodeError(RuntimeError):
    """User code raised something an `except Exception` cannot handle as it was (see
    the module docstring); the message names it."""


def text(e: BaseException) -> str:
    """`str(e)`, or a note when it raises (an exception's own `__str__` is user code)."""
    try:
        return str(e)
    except Exception as err:
        return f"<its str() raised {type(err).__name__}>"


def describe(e: BaseException) -> str:
    """`Type: message` for a record or a log, safe for any exception (a `UserCodeError`
    is its message alone: it names what was raised)."""
    if isinstance(e, UserCodeError):
        return text(e)
    detail = text(e)
    return f"{type(e).__name__}: {detail}" if detail else type(e).__name__


def _tamed(e: BaseException, what: str) -> BaseException:
    """`e` as the caller gets it: itself when an `except Exception` can handle it."""
    if isinstance(e, (StopIteration, asyncio.CancelledError)) or not isinstance(e, Exception):
        detail = text(e)
        detail = f": {detail}" if detail else ""
        return UserCodeError(f"{what} raised {type(e).__name__}{detail}")
    try:
        str(e)
    except Exception:
        return UserCodeError(f"{what} raised {type(e).__name__} {text(e)}")
    return e


def _in_thread(fn: Callable[..., Any], *args: Any, what: str) -> Any:
    """`fn(*args)` in a pool thread, anything it raises tamed (`_tamed`)."""
    try:
        return fn(*args)
    except BaseException as e:  # user code: see the module docstring
        raise _tamed(e, what) from None


async def _in_task(coro: Any, what: str) -> Any:
    """`await coro` in its task. A `CancelledError` passes (cancelling the task, ours or
    its own: `call` tells them apart); anything else raised is tamed (`_tamed`): a
    `SystemExit` or `KeyboardInterrupt` escaping a task would stop the event loop."""
    try:
        return await coro
    except asyncio.CancelledError:
        raise
    except BaseException as e:  # user code: see the module docstring
        raise _tamed(e, what) from None


_pools: list[ThreadPoolExecutor] = []
_pools_lock = threading.Lock()
_stuck_in: dict[concurrent.futures.Future[Any], ThreadPoolExecutor] = {}
"""Calls left behind in a thread (past their limit), by the pool whose thread they hold."""
MAX_POOLS = 8
"""Pools made in all (`pool`): past that, stuck calls are not given new threads."""


def pool() -> ThreadPoolExecutor:
    """The user-code thread pool (made on first use, shared by every event loop). Calls
    stuck past their limits keep their threads: once half of a pool's are held so, new
    calls go to a fresh pool (a service whose env hung 32 calls over its life ran no
    plain-function hook of any env again: every call waited for a thread that never
    came), up to `MAX_POOLS` in all."""
    with _pools_lock:
        current = _pools[-1] if _pools else None
        stuck = sum(1 for p in _stuck_in.values() if p is current)
        if current is None or (stuck >= THREADS // 2 and len(_pools) < MAX_POOLS):
            if current is not None:
                log.warning("%d calls of user code hold threads of the user-code pool past "
                            "their limits; new calls go to a fresh pool (%d of at most %d)",
                            stuck, len(_pools) + 1, MAX_POOLS)  # fmt: skip
            current = ThreadPoolExecutor(THREADS, thread_name_prefix="libra-user")
            _pools.append(current)
        return current


_prestart_lock = threading.Lock()
_prestarted = threading.Event()


def prestart() -> None:
    """Start all `THREADS` threads of the pool now, once per process (blocking: call it
    off the loop when a runner starts, `libra.rollout.run.episode_runner`). Runners that
    open at once (a worker's first two batches) wait for the first start: two starts
    side by side would each hold part of the pool at its barrier until both time out."""
    with _prestart_lock:
        if not _prestarted.is_set():
            start_threads(pool(), THREADS)
            _prestarted.set()


def start_threads(
    executor: ThreadPoolExecutor,
    n: int,
    timeout_s: float = 30.0,
    then: Callable[[], Any] | None = None,
) -> None:
    """Make `executor` start `n` worker threads now (blocking). A ThreadPoolExecutor starts
    a thread inside `submit`, and `Thread.start` waits until the new thread has run: with
    busy threads holding the GIL (a tokenizer rendering a 10 MB tool return) one start
    held the event loop for up to 100 ms, the user-code pool's first 32 calls 0.7 s in
    all. `n` jobs that wait for each other need `n` threads at once. Gives up quietly
    after `timeout_s` (threads busy with other work). `then`, if given, runs once in
    each of the `n` threads after they met (per-thread set-up)."""
    barrier = threading.Barrier(n)

    def meet() -> None:
        try:
            barrier.wait(timeout_s)
        except threading.BrokenBarrierError:
            pass
        if then is not None:
            then()

    for job in [executor.submit(meet) for _ in range(n)]:
        job.result()


def is_async(fn: Any) -> bool:
    """A coroutine function, or an object whose `__call__` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - an async callable object
    )


def overruns() -> int:
    """User-code calls still running after their caller gave up on them."""
    return len(_left_behind)


def stuck_tasks(loop: asyncio.AbstractEventLoop) -> set[asyncio.Future[Any]]:
    """`loop`'s tasks of async user code left behind (they ignored cancellation): a loop
    that waited for them at its close would never close."""
    return {f for f in _left_behind if isinstance(f, asyncio.Future) and f.get_loop() is loop}


async def call(fn: Callable[..., Any], *args: Any, limit_s: float | None, what: str) -> Any:
    """`fn(*args)` run as the module docstring says (keyword arguments: pass a
    `functools.partial`); its result, or its exception. `LimitExceeded` (a
    `TimeoutError`) when it ran past `limit_s` seconds (None: no limit of its own; the
    caller's scope still cancels it). `what` names it in logs."""
    thread: concurrent.futures.Future[Any] | None = None
    fut: asyncio.Future[Any]
    if is_async(fn):
        try:
            coro = fn(*args)
        except BaseException as e:  # a callable object's own __call__
            raise _tamed(e, what) from None
        fut = asyncio.get_running_loop().create_task(_in_task(coro, what), name=f"user:{what}")
    else:
        ctx = contextvars.copy_context()
        executor = pool()
        thread = executor.submit(ctx.run, functools.partial(_in_thread, what=what), fn, *args)
        thread.pool = executor  # type: ignore[attr-defined]  # `_leave` counts it there
        fut = asyncio.wrap_future(thread)
    started = time.monotonic()
    try:
        done, _ = await asyncio.wait({fut}, timeout=limit_s)
    except asyncio.CancelledError:
        await _abandon(fut, thread, what, "its caller was cancelled")
        raise
    if not done:
        await _abandon(fut, thread, what, f"it ran past its limit of {limit_s:g} s")
        raise LimitExceeded(f"{what} exceeded {limit_s:g} s")
    if thread is None and limit_s is not None and time.monotonic() - started > limit_s:
        _held_the_loop(what, time.monotonic() - started, limit_s)
    if fut.cancelled():  # it cancelled itself: its failure, not a cancel of our caller
        raise RuntimeError(f"{what} was cancelled from inside (it raised CancelledError)")
    out = fut.result()
    if inspect.isawaitable(out):  # a plain function that returned a coroutine
        return await call(_awaited, out, limit_s=limit_s, what=what)
    return out


_warned: set[str] = set()


def _held_the_loop(what: str, took: float, limit_s: float) -> None:
    """Async user code finished past its limit: the timer could not fire, so it most
    likely blocked the event loop (a `time.sleep` in an `async def`), and every episode
    waited. Said once per name (its result stands: the limit could not act)."""
    if what not in _warned:
        _warned.add(what)
        log.warning("async user code %s took %.1f s, past its limit of %g s, and most likely "
                    "held the event loop all that time (every episode waited): make it a "
                    "plain function, or await its blocking work", what, took, limit_s)  # fmt: skip


async def _awaited(aw: Any) -> Any:
    return await aw


async def _abandon(
    fut: asyncio.Future[Any], thread: concurrent.futures.Future[Any] | None, what: str, why: str
) -> None:
    """Cancel the call and give a task `GRACE_S` to end; else leave it behind, counted
    in `overruns()` until it ends."""
    fut.cancel()  # a call still queued for a thread never starts; a running one runs on
    interrupted = False
    if thread is None:
        try:  # shielded: our caller being cancelled again does not cut the grace short
            await asyncio.shield(asyncio.wait({fut}, timeout=GRACE_S))
        except asyncio.CancelledError:
            interrupted = True
    left: asyncio.Future[Any] | concurrent.futures.Future[Any] = thread or fut
    if left.done():
        _consume(left)
    else:
        _leave(left, what, why)
    if interrupted:
        raise asyncio.CancelledError


def _leave(left: Any, what: str, why: str) -> None:
    _left_behind.add(left)
    if isinstance(left, concurrent.futures.Future) and hasattr(left, "pool"):
        with _pools_lock:
            _stuck_in[left] = left.pool
    started = time.monotonic()
    log.warning("user code %s left running: %s", what, why)

    def ended(f: Any) -> None:  # in the loop for a task, in the worker for a thread
        _left_behind.discard(f)
        with _pools_lock:
            _stuck_in.pop(f, None)
        if not f.cancelled():
            f.exception()  # retrieved: no "exception was never retrieved" noise
        log.warning("user code %s ended %.1f s after it was left", what, time.monotonic() - started)

    left.add_done_callback(ended)


def _consume(fut: asyncio.Future[Any] | concurrent.futures.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


__all__ = [
    "GRACE_S",
    "THREADS",
    "LimitExceeded",
    "UserCodeError",
    "call",
    "describe",
    "is_async",
    "overruns",
    "pool",
    "prestart",
    "start_threads",
    "stuck_tasks",
    "text",
]
