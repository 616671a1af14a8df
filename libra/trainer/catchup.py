"""A catching-up rank: receive a donor's snapshot, then replay the buffered averaged
gradients in a background thread until the rank is current (see `snapshot`)."""

from __future__ import annotations

import collections
import json
import logging
import socket
import threading
import time

import torch

from libra.trainer.replica import Replica
from libra.trainer.snapshot import _view, layout_signature

log = logging.getLogger("libra.trainer")


class CatchUp:
    """Owns the listener socket and the replay queue of one joining rank."""

    def __init__(
        self, replica: Replica, listener: socket.socket, *, timeout_s: float, max_mb: float
    ):
        self.replica = replica
        self.listener = listener
        self.timeout_s = timeout_s
        self.max_mb = max_mb
        # Each queued update holds one float32 gradient of this rank's shard; at least
        # one fits whatever the limit (the error then names the limit to raise).
        self.update_mb = replica.grad_numel * 4 / 1e6
        self.max_queue = max(1, int(max_mb / self.update_mb))
        self._cv = threading.Condition()
        self._queue: collections.deque[tuple[int, torch.Tensor, float, float]] = collections.deque()
        self._token: str | None = None
        self._since = 0.0
        self._loaded = False
        self._busy = False
        self._conn: socket.socket | None = None
        self._stop = False
        self.error: str | None = None
        self.received_s = 0.0
        """Seconds the last snapshot took from `expect` to fully received."""
        self.replayed = 0
        self._thread = threading.Thread(target=self._loop, name="catch-up", daemon=True)
        self._thread.start()

    # -- main thread ------------------------------------------------------------------

    def expect(self, token: str) -> None:
        """Start (or restart) catching up from the snapshot named `token`."""
        with self._cv:
            self._token, self._since = token, time.perf_counter()
            self._loaded, self.error = False, None
            self._queue.clear()
            self._cut()
            self._cv.notify_all()

    def push(self, update: int, flat: torch.Tensor, tokens: float, sumsq: float) -> None:
        """Queue one update's summed gradient (a private copy) for replay."""
        with self._cv:
            if len(self._queue) >= self.max_queue:
                self.error = (
                    f"the snapshot did not arrive within {self.max_queue} updates (buffering "
                    f"them takes {self.max_queue * self.update_mb:.0f} MB, the "
                    f"elastic.max_catchup_mb limit of {self.max_mb:g}): raise "
                    "elastic.max_catchup_mb, or elastic.snapshot_rate_mb_s if it is set"
                )
            else:
                self._queue.append((update, flat, tokens, sumsq))
            self._cv.notify_all()

    def drained(self) -> bool:
        """Snapshot loaded and every queued update replayed: the rank is current."""
        with self._cv:
            return (
                self._token is not None
                and self._loaded
                and not self._queue
                and not self._busy
                and self.error is None
            )

    def finish(self) -> None:
        """The rank is current; stop expecting snapshots."""
        with self._cv:
            self._token = None

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._token = None
            self._cut()
            self._cv.notify_all()
        # A replay in flight runs torch code: let it finish (a thread inside torch at
        # interpreter shutdown aborts the process; see libra.trainer.rendezvous).
        self._thread.join(self.timeout_s)

    def _cut(self) -> None:
        if self._conn is not None:
            try:
                self._conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # the donor closed it already: nothing left to cut

    # -- background thread ------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not (
                    self._token is not None
                    and self.error is None
                    and (not self._loaded or self._queue)
                ):
                    self._cv.wait()
                if self._stop:
                    return
                token, loaded = self._token, self._loaded
                item = self._queue.popleft() if loaded else None
                self._busy = item is not None
            if item is None:
                self._receive(token)
            else:
                self._replay(token, item)

    def _receive(self, token: str | None) -> None:
        log.info("waiting for snapshot %s", token)
        try:
            conn, _ = self.listener.accept()
        except TimeoutError:
            with self._cv:
                if self._token == token and time.perf_counter() - self._since > self.timeout_s:
                    self.error = f"no snapshot arrived within {self.timeout_s:.0f}s"
            return
        with self._cv:
            if self._token != token:
                conn.close()
                return
            self._conn = conn
        try:
            with conn:
                conn.settimeout(self.timeout_s)
                header = json.loads(_read_line(conn))
                if header.get("token") != token:
                    return  # a stale donation (an abandoned epoch): wait for ours
                if header.get("layout") != layout_signature(self.replica):
                    raise ConnectionError(
                        f"snapshot layout {header.get('layout')!r} does not match this "
                        "replica: replicas must share model and ranks per replica"
                    )
                for t in self.replica.state_tensors():
                    _recv_tensor(conn, t)
                self.replica.set_counts(int(header["updates"]), float(header["adam_step"]))
                log.info("snapshot %s received (state at update %s)", token, header["updates"])
            with self._cv:
                if self._token == token:
                    self._loaded = True
                    self.received_s = time.perf_counter() - self._since
                    self._cv.notify_all()
        except (OSError, ValueError) as e:
            with self._cv:
                if self._token == token:
                    self.error = f"snapshot receive failed: {e}"
        finally:
            with self._cv:
                self._conn = None

    def _replay(self, token: str | None, item: tuple[int, torch.Tensor, float, float]) -> None:
        update, flat, tokens, sumsq = item
        try:
            if update > self.replica.updates:
                if update != self.replica.updates + 1:
                    have = self.replica.updates
                    raise RuntimeError(f"replay gap: state at update {have}, next {update}")
                self.replica.apply(flat, tokens, sumsq)
                self.replayed += 1
        except Exception as e:
            with self._cv:
                self.error = f"replay failed: {e}"
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()


def _recv_tensor(sock: socket.socket, t: torch.Tensor, via_host: bool | None = None) -> None:
    """`t`'s bytes from `sock`, written into `t`: straight into a host tensor's memory; a
    GPU shard (`via_host`, default: `t` is not on the CPU) through host memory, one tensor
    at a time. The copy runs without autograd: this is the catch-up thread, where grad
    mode is on (it is per thread) and the parameters are leaves that require grad."""
    if via_host is None:
        via_host = t.device.type != "cpu"
    if not via_host:
        _recv_exact(sock, _view(t))
        return
    host = torch.empty(t.shape, dtype=t.dtype)
    _recv_exact(sock, _view(host))
    with torch.no_grad():
        t.copy_(host)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("donor closed the connection mid-snapshot")
        got += n


def _read_line(sock: socket.socket, limit: int = 1 << 16) -> bytes:
    buf = bytearray()
    while not buf.endswith(b"\n"):
        b = sock.recv(1)
        if not b or len(buf) > limit:
            raise ConnectionError("bad snapshot header")
        buf += b
    return bytes(buf)


__all__ = ["CatchUp"]
