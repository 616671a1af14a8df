"""State snapshots for joining replicas: a donor streams, a joiner catches up.

Donor side. At the first update of the epoch that names it, a donor copies its state
(parameters + Adam moments of its shard: the state after the previous update) into a
staging buffer allocated when the worker started, in a thread, while the main thread
runs forward/backward; the main thread only waits for the copy to finish before it
applies the next update (parameters must not change under the copy). The copy is a
deep one: `optimizer.state_dict()` would share tensors with the live optimizer. The
same thread then streams the staging bytes to each recipient over a plain TCP socket,
optionally rate-limited, while training goes on.

Joiner side. A listener opened at registration accepts the donor's connection and
receives straight into the live parameter / moment tensors (the joiner's main thread
is not touching them: until it is caught up it contributes zeros). Meanwhile the main
thread keeps taking part in every all-reduce and queues each averaged gradient; once
the snapshot is in, this thread replays them through the same `Replica.apply` the
live replicas ran, and the joiner is current.

Wire format: one JSON header line (`token`, `updates`, `adam_step`, `numel`, `layout`), then
`numel` float32 values in the `Replica.state_tensors` order.
"""

from __future__ import annotations

import collections
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from libra.trainer.replica import Replica

log = logging.getLogger("libra.trainer")
CHUNK = 4 << 20


def layout_signature(replica: Replica) -> str:
    return f"{replica.rank}/{replica.size}:" + ",".join(map(str, replica.numels))


def _view(t: torch.Tensor) -> memoryview:
    arr: Any = t.detach().contiguous().view(torch.uint8).numpy()
    return memoryview(arr).cast("B")


@dataclass(slots=True)
class Job:
    token: str
    """Names the epoch and recipient; the joiner rejects any other."""
    addr: str


class Donor:
    """Streams this rank's state to joiners, one copy for all jobs queued together."""

    def __init__(self, replica: Replica, *, rate_mb_s: float | None, timeout_s: float):
        self.replica = replica
        self.rate = rate_mb_s * 1e6 if rate_mb_s else None
        self.timeout_s = timeout_s
        # Pre-allocated and touched now, so a join does not pay for page faults.
        self.staging = torch.zeros(replica.state_numel, dtype=torch.float32)
        self.pending: collections.deque[Job] = collections.deque()
        self.copied = threading.Event()
        self.copied.set()
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self.sent: list[tuple[str, bool, float]] = []
        """(token, ok, seconds) per finished job."""

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def add(self, jobs: list[Job]) -> None:
        self.pending.extend(jobs)

    def tick(self) -> None:
        """At the start of an update, before the forward pass: if jobs wait and the
        staging buffer is free, snapshot the current state and start streaming."""
        if not self.pending or self.busy:
            return
        jobs = list(self.pending)
        self.pending.clear()
        log.info("snapshot of update %d for %s", self.replica.updates, [j.token for j in jobs])
        self.copied.clear()
        counts = (self.replica.updates, self.replica.adam_step)
        self._thread = threading.Thread(
            target=self._run, args=(jobs, *counts), name="snapshot-send", daemon=True
        )
        self._thread.start()

    def wait_copied(self) -> float:
        """Block until the staging copy is done; returns the seconds waited."""
        if self.copied.is_set():
            return 0.0
        t = time.perf_counter()
        self.copied.wait()
        return time.perf_counter() - t

    def cancel(self) -> None:
        """Drop queued jobs and cut the one in flight (after a failure)."""
        self.pending.clear()
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # the joiner closed it already: nothing left to cut

    def close(self) -> None:
        """Finish streaming what was started (a leaving donor completes its jobs)."""
        if self._thread is not None:
            self._thread.join(self.timeout_s)

    def _run(self, jobs: list[Job], updates: int, adam_step: float) -> None:
        try:
            off = 0
            with torch.no_grad():  # this thread's grad mode is on; the staging is plain bytes
                for t in self.replica.state_tensors():
                    n = t.numel()
                    self.staging[off : off + n].copy_(t.reshape(-1))
                    off += n
        finally:
            self.copied.set()
        for job in jobs:
            t0 = time.perf_counter()
            ok = self._send(job, updates, adam_step)
            self.sent.append((job.token, ok, time.perf_counter() - t0))

    def _send(self, job: Job, updates: int, adam_step: float) -> bool:
        host, port = job.addr.rsplit(":", 1)
        header = {
            "token": job.token,
            "updates": updates,
            "adam_step": adam_step,
            "numel": self.staging.numel(),
            "layout": layout_signature(self.replica),
        }
        try:
            with socket.create_connection((host, int(port)), timeout=self.timeout_s) as sock:
                self._sock = sock
                sock.sendall(json.dumps(header).encode() + b"\n")
                data = _view(self.staging)
                # Rate-limited: small chunks, each sent no earlier than its share of time.
                step = CHUNK if not self.rate else max(1 << 12, min(CHUNK, int(self.rate / 20)))
                t0 = time.perf_counter()
                for i in range(0, len(data), step):
                    if self.rate:
                        early = i / self.rate - (time.perf_counter() - t0)
                        if early > 0:
                            time.sleep(early)
                    sock.sendall(data[i : i + step])
                sock.shutdown(socket.SHUT_WR)
                sock.recv(1)  # the joiner closes once everything is in
            return True
        except OSError as e:
            log.warning("snapshot to %s (%s) failed: %s", job.addr, job.token, e)
            return False
        finally:
            self._sock = None


def listen(host: str) -> socket.socket:
    s = socket.create_server((host, 0))
    s.settimeout(0.5)
    return s


def addr_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"{host}:{port}"


__all__ = ["CHUNK", "Donor", "Job", "addr_of", "layout_signature", "listen"]
