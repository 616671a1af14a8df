"""The rendezvous store and the per-epoch cross-replica process groups.

One TCPStore serves the whole run (hosted by the driver, or by a test). Groups of an
epoch are constructed directly over `PrefixStore("{epoch}/s{shard}", store)`
(`libra.trainer.device.cross_replica_group`): `new_group` cannot include a process that
was not in the original world, and a replica's own internal group (the process's
default group) must never be rebuilt. Construction runs in a thread (it releases the
GIL while it waits for peers), so the next epoch's group is built while the current
step computes.

Each thread that may block on the store gets its own client: a TCPStore client
serialises its operations, and a blocking `wait` would stall every other caller.

Threads that call into torch's C++ code (building or retiring a group) are not daemons,
and their owner joins them before it returns from `close`. Python 3.11 ends a daemon
thread that retakes the GIL while the interpreter shuts down with `pthread_exit`; the
forced unwind reaches pybind11's GIL guard, a noexcept destructor, and the C++ runtime
calls `std::terminate`: the process dies of SIGABRT ("terminate called without an
active exception") after it has finished its work. A thread that is only in Python or
socket code may stay a daemon.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable
from typing import Any

from torch.distributed import PrefixStore, Store, TCPStore

log = logging.getLogger("libra.trainer")

STORE_TIMEOUT = datetime.timedelta(seconds=300)
PREFIX = "libra"
"""The keys of the elastic protocol (tickets, epochs) live under this prefix."""


def host_store(host: str = "127.0.0.1", port: int = 0) -> TCPStore:
    """Start the run's store server in this process."""
    return TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)


def connect(host: str, port: int, prefix: str = "") -> Store:
    """A new client connection (one per thread that may block on it)."""
    store: Store = TCPStore(host, port, is_master=False, timeout=STORE_TIMEOUT)
    return PrefixStore(prefix, store) if prefix else store


def get_str(store: Store, key: str) -> str:
    return bytes(store.get(key)).decode()


def wait_key(store: Store, key: str, timeout_s: float) -> str:
    """Block until `key` exists (TimeoutError after `timeout_s`), return its value."""
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:  # c10d reports a store timeout as DistStoreError
        raise TimeoutError(f"store key {key!r} not set within {timeout_s:.0f}s") from e
    return get_str(store, key)


class Background:
    """Run `fn` in a thread; `result()` waits for it. Used to build the next epoch's
    group off the critical path. An abandoned build (after a failure) is left to time
    out on its own: gloo cannot be interrupted. Not a daemon (see the module doc): at
    exit Python waits for it, which the group's timeout bounds."""

    def __init__(self, fn: Callable[[], Any], name: str):
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as e:
            self._error = e
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def settle(self, timeout_s: float) -> Any:
        """Wait (at most `timeout_s`) for a build nobody will use; its value, or None
        if it failed or is still running."""
        self._thread.join(timeout_s)
        return self._value if self._done.is_set() and self._error is None else None

    def result(self, timeout_s: float | None = None) -> Any:
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"{self._thread.name} did not finish within {timeout_s}s")
        if self._error is not None:
            raise self._error
        return self._value


def retire(pg: Any) -> threading.Thread | None:
    """Shut a group down and drop it without blocking the caller (a shutdown can wait
    on a dead peer). Returns the thread doing it, for the owner to join before exit
    (not a daemon: see the module doc)."""
    if pg is None:
        return None

    def _shutdown() -> None:
        try:
            pg.shutdown()
        except RuntimeError as e:  # c10d's errors: a peer already gone, a group broken
            log.debug("retiring a group: %s", e)  # it is being dropped either way

    t = threading.Thread(target=_shutdown, name="retire-group")
    t.start()
    return t


class GroupReaper:
    """The groups a rank no longer uses: shutdowns in flight, and builds of epochs that a
    recovery replaced. Gloo can interrupt neither, so both are left to finish in their
    threads, and the rank's `close` waits for them (not daemons: see the module doc)."""

    def __init__(self) -> None:
        self._abandoned: list[Background] = []
        """Group builds of epochs that a recovery replaced: `close` waits for them."""
        self._retiring: list[threading.Thread] = []

    def retire(self, pg: Any) -> None:
        """Shut `pg` down in the background (None: nothing to do)."""
        self._retiring = [t for t in self._retiring if t.is_alive()]
        t = retire(pg)
        if t is not None:
            self._retiring.append(t)

    def abandon(self, job: Background) -> None:
        """A build (returning `(epoch, group)`) whose group nobody will use; `reap`
        retires it once it is done."""
        self._abandoned.append(job)

    def reap(self, wait_s: float) -> None:
        """Retire the groups of abandoned builds that finished (waiting up to `wait_s`
        for each); keep waiting on the others."""
        running = []
        for job in self._abandoned:
            built = job.settle(wait_s)
            if job.done():
                self.retire(built[1] if built else None)
            else:
                running.append(job)
        self._abandoned = running

    def join(self, timeout_s: float) -> None:
        """Wait for the shutdowns started so far (each up to `timeout_s`)."""
        for t in self._retiring:
            t.join(timeout_s)
        self._retiring = []


__all__ = [
    "PREFIX",
    "Background",
    "GroupReaper",
    "connect",
    "get_str",
    "host_store",
    "retire",
    "wait_key",
]
