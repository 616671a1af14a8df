"""The durable spool: one folder per batch, every finished record appended before it is
streamed.

    <spool dir>/<batch_id>/batch.json      the submit request (written before the reply)
    <spool dir>/<batch_id>/records.jsonl   one trajectory record per line, line k = seq k
    <spool dir>/<batch_id>/state.json      {"state": "done" | "cancelled"} once terminal

`append` writes and flushes a line (the record then survives a crash of the service);
the record becomes *visible* to streams as the fsync policy allows (`Syncer`). Streams
read visible lines back from the file (`os.pread`), so a slow reader holds a file
offset, not memory, and never delays an episode. A restarted service re-opens the file:
a torn last line (a crash mid-write) is cut off; any other bad line is corruption and
stops the service with the file and line named.

A write that fails (no space left on the device, an I/O error) leaves the file as it
was (a partly written tail is cut off again) and the records *pending*, in memory, in
order; `retry` writes them, and nothing later is written before them. The manager
stops admitting episodes meanwhile and retries (`BatchManager`): the episodes finished
while the disk was full are not lost, and the service keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

from libra.errors import LibraError
from libra.record import Trajectory
from libra.rollout.wire import RawRecord, serialized

log = logging.getLogger(__name__)

RETRY_S = 2.0
"""How long a failed spool write or fsync waits before it is tried again."""


class SpoolCorrupt(LibraError):
    """A spool file holds a line that is not a record of its batch."""


def write_json_atomic(path: Path, doc: Any) -> None:
    """Write, fsync, rename into place, fsync the folder: all or nothing after a crash."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(orjson.dumps(doc))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk left half a file behind
        raise
    fsync_dir(path.parent)


def store_batch(folder: Path, doc: dict[str, Any], opened: Callable[[], Spool]) -> Spool:
    """A new batch's folder, its stored request (`batch.json`) and its spool
    (`opened()`), all or nothing: on a failed write (a full disk: the client gets a 507
    and may submit again; the folder's fsync too, when batch.json was in place and ran
    at restart) or a spool that cannot open (no descriptor left) no folder is left that
    this call made, so nothing of a refused submit runs at a restart."""
    made = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        write_json_atomic(folder / "batch.json", doc)
        return opened()
    except OSError:
        if made:
            _forget(folder)
        raise


def _forget(folder: Path) -> None:
    """Remove a refused batch's folder, by name (listing a folder takes a descriptor,
    and a submit refused for want of them has none)."""
    for name in ("records.jsonl", "batch.json", "batch.json.tmp"):
        with contextlib.suppress(OSError):
            (folder / name).unlink()
    with contextlib.suppress(OSError):
        folder.rmdir()


def read_state(folder: Path) -> dict[str, Any]:
    """A batch folder's `state.json` ({} when it has none yet)."""
    path = folder / "state.json"
    return dict(orjson.loads(path.read_bytes())) if path.is_file() else {}


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Spool:
    """Append-only record log of one batch, indexed by seq, id and group."""

    def __init__(self, folder: Path, group_size: int, *, durable_publish: bool):
        self.folder = folder
        self.path = folder / "records.jsonl"
        self.group_size = group_size
        self.durable_publish = durable_publish
        """True: `visible` advances only after an fsync (`Syncer`); else at each write."""
        self.ends: list[int] = []
        """End offset of line `seq` in the file."""
        self.ids: dict[str, int] = {}
        self.group_seqs: dict[str, list[int]] = {}
        self.group_done: list[tuple[int, str]] = []
        """(seq of the record that completed the group, group id), in seq order."""
        self.status: Counter[str] = Counter()
        self.visible = 0
        self.synced = 0
        self.closed = False
        self.pending: list[tuple[Trajectory | RawRecord, bytes]] = []
        """Records (and their lines) given to `extend` that could not be written yet."""
        self.write_error: str | None = None
        """Why the last write failed, while records are pending (naming the file)."""
        self.write_reason: str | None = None
        """The same without the path (the OS's words: `No space left on device`)."""
        self._torn = False
        """A failed write may have left part of a line that could not be cut off yet."""
        self._changed = asyncio.Event()
        self._recover()
        self._w: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            self._r: int | None = os.open(self.path, os.O_RDONLY)
        except OSError:
            os.close(self._w)  # out of file descriptors: this one is not kept either
            raise
        self.visible = self.synced = len(self.ends)

    # --- writing -----------------------------------------------------------------------
    @property
    def written(self) -> int:
        return len(self.ends)

    def append(self, record: Trajectory | RawRecord) -> int:
        """Append `record` with the next seq (set on the record); returns the seq."""
        self.extend([record])
        return record.seq

    def extend(self, records: Sequence[Trajectory | RawRecord]) -> list[Trajectory | RawRecord]:
        """Append `records` in order with the next seqs, in one write (a `RawRecord`,
        from a rollout worker, is written as it came with its seq spliced in). A record
        that cannot be serialized (lists and objects nested deeper than pydantic and
        orjson write, about 254 levels) is replaced by an `error` record of the same
        episode saying why, so the episode is accounted for and the service goes on.
        Returns the records taken (`libra.rollout.wire.serialized`): written, or pending
        when the write failed (`write_error` says why; `retry` writes them)."""
        taken: list[Trajectory | RawRecord] = []
        first = len(self.ends) + len(self.pending)
        for k, given in enumerate(records):
            if given.id in self.ids:
                raise ValueError(f"episode {given.id} already has a record in {self.path}")
            given.seq = first + k
            record, line = serialized(given)
            taken.append(record)
            self.pending.append((record, line + b"\n"))
        for record in taken:
            self.ids[record.id] = record.seq
        if taken:
            self.retry()
        return taken

    def retry(self) -> bool:
        """Write the pending records in one write; True when none is left pending. On a
        failure the file is cut back to its last whole record (at the next try if the
        cut failed too) and `write_error` says why."""
        if not self.pending:
            return True
        assert self._w is not None, "a closed spool takes no records"
        good = self.ends[-1] if self.ends else 0
        try:
            if self._torn:
                os.ftruncate(self._w, good)
                self._torn = False
            _write_all(self._w, b"".join(line for _, line in self.pending))
        except OSError as e:
            self._torn = True
            with contextlib.suppress(OSError):
                os.ftruncate(self._w, good)
                self._torn = False
            self.write_reason = e.strerror or type(e).__name__
            self.write_error = f"cannot write {self.path}: {self.write_reason}"
            return False
        for record, line in self.pending:
            self._index(record.seq, record.id, record.group_id, record.status, len(line))
        self.pending.clear()
        self.write_error = self.write_reason = None
        if not self.durable_publish:
            self.publish(len(self.ends))
        return True

    def sync(self) -> int:
        """fsync the file (blocking: call it in a thread); returns the records covered."""
        n = self.written
        if self._w is not None:
            os.fsync(self._w)
        return n

    def publish(self, n: int) -> None:
        """Make the first `n` records visible to streams."""
        if n > self.visible:
            self.visible = n
            self._wake()

    def close(self) -> None:
        """No more records: streams end once they have sent everything visible."""
        if self._w is not None:
            os.close(self._w)
            self._w = None
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        old, self._changed = self._changed, asyncio.Event()
        old.set()

    # --- reading -----------------------------------------------------------------------
    async def wait_beyond(self, n: int) -> None:
        """Return once more than `n` records are visible."""
        while self.visible <= n:
            await self._changed.wait()

    def read_lines(self, first: int, last: int) -> bytes:
        """Raw lines of records `first..last` (inclusive), newline-terminated."""
        if self._r is None:  # its number may be another batch's file by now
            raise RuntimeError(f"{self.folder.name}: read after the spool was released")
        start = self.ends[first - 1] if first else 0
        return os.pread(self._r, self.ends[last] - start, start)

    def read_line(self, seq: int) -> bytes:
        return self.read_lines(seq, seq)

    def release(self) -> None:
        """Close the read side too (the batch is forgotten)."""
        self.close()
        r, self._r = self._r, None
        if r is not None:
            with contextlib.suppress(OSError):
                os.close(r)

    # --- recovery ----------------------------------------------------------------------
    def _index(self, seq: int, rid: str, group: str, status: str, size: int) -> None:
        self.ends.append((self.ends[-1] if self.ends else 0) + size)
        self.ids[rid] = seq
        self.status[status] += 1
        members = self.group_seqs.setdefault(group, [])
        members.append(seq)
        if len(members) == self.group_size:
            self.group_done.append((seq, group))

    def _recover(self) -> None:
        """Index an existing file line by line (memory: the index, not the file)."""
        if not self.path.exists():
            self.path.touch()
            fsync_dir(self.folder)
            return
        good = 0  # end of the last good line
        bad: int | None = None  # line number of a bad complete line, if any
        with open(self.path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.endswith(b"\n"):
                    break  # torn tail: a crash mid-write
                if bad is not None:  # a bad line with good ones after it: not a crash
                    raise SpoolCorrupt(
                        f"{self.path}:{bad}: not the record with seq {bad - 1}; "
                        "move the batch folder away or repair the file"
                    )
                try:
                    doc = orjson.loads(line)
                    ok = doc["seq"] == len(self.ends) and doc["id"] not in self.ids
                except (orjson.JSONDecodeError, KeyError, TypeError):
                    ok = False
                if not ok:
                    bad = lineno  # the last complete line may be garbage after a crash
                    continue
                self._index(len(self.ends), doc["id"], doc["group_id"], doc["status"], len(line))
                good += len(line)
        if good < self.path.stat().st_size:
            with open(self.path, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class Syncer:
    """Makes appended records visible under the fsync policy; one task for all spools.

    `always`: group commit: fsync (in a thread) whatever was written since the last one,
    then publish it; records written meanwhile wait for the next round. `interval`:
    records are visible at once; dirty spools are fsynced every `interval_s`. `never`:
    nothing to do."""

    def __init__(self, policy: str, interval_s: float):
        self.policy = policy
        self.interval_s = interval_s
        self._dirty: set[Spool] = set()
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()

    def touched(self, spool: Spool) -> None:
        if self.policy != "never":
            self._dirty.add(spool)
            self._wake.set()

    async def run(self) -> None:
        while True:
            if self.policy == "interval":
                await asyncio.sleep(self.interval_s)
            await self._wake.wait()
            await self.flush()

    async def flush(self) -> None:
        """fsync every dirty spool now and publish what the fsyncs covered. A spool
        whose fsync failed stays dirty and is tried again `RETRY_S` later."""
        async with self._lock:
            self._wake.clear()
            dirty, self._dirty = self._dirty, set()
            for spool in dirty:
                if not await self._sync(spool):
                    self._dirty.add(spool)
            if self._dirty:
                asyncio.get_running_loop().call_later(RETRY_S, self._wake.set)

    async def settle(self, spool: Spool) -> None:
        """Before closing a spool: everything written is synced (unless `never`, and
        tried again until an fsync succeeds) and visible."""
        async with self._lock:
            self._dirty.discard(spool)
            # a disk to recover, with no event to wait on: poll it
            while self.policy != "never" and not await self._sync(spool):  # noqa: ASYNC110
                await asyncio.sleep(RETRY_S)
            spool.publish(spool.written)

    @staticmethod
    async def _sync(spool: Spool) -> bool:
        """fsync `spool` and publish what it covered; False when the fsync failed."""
        if spool.closed or spool.synced == spool.written:
            return True
        try:
            n = await asyncio.to_thread(spool.sync)
        except OSError as e:
            log.warning("fsync of %s failed: %s; tried again in %g s", spool.path, e, RETRY_S)
            return False
        spool.synced = n
        spool.publish(n)
        return True


__all__ = ["RETRY_S", "Spool", "SpoolCorrupt", "Syncer", "fsync_dir", "read_state",
           "store_batch", "write_json_atomic"]  # fmt: skip
