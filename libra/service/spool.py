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
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from libra.errors import LibraError
from libra.record import Trajectory
from libra.rollout.wire import RawRecord, serialized


class SpoolCorrupt(LibraError):
    """A spool file holds a line that is not a record of its batch."""


def write_json_atomic(path: Path, doc: Any) -> None:
    """Write, fsync, rename into place, fsync the folder: all or nothing after a crash."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(orjson.dumps(doc))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


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
        self._changed = asyncio.Event()
        self._recover()
        self._w = open(self.path, "ab")  # noqa: SIM115 - closed in close()
        self._r = os.open(self.path, os.O_RDONLY)
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
        that cannot be written (lists and objects nested deeper than pydantic and orjson
        write, about 254 levels) is replaced by an `error` record of the same
        episode saying why, so the episode is accounted for and the service goes on.
        Returns the records written (`libra.rollout.wire.serialized`)."""
        written: list[Trajectory | RawRecord] = []
        lines = []
        for k, given in enumerate(records):
            if given.id in self.ids:
                raise ValueError(f"episode {given.id} already has a record in {self.path}")
            given.seq = len(self.ends) + k
            record, line = serialized(given)
            written.append(record)
            lines.append(line + b"\n")
        if not written:
            return written
        self._w.write(b"".join(lines))
        self._w.flush()
        for record, line in zip(written, lines, strict=True):
            self._index(record.seq, record.id, record.group_id, record.status, len(line))
        if not self.durable_publish:
            self.publish(len(self.ends))
        return written

    def sync(self) -> int:
        """fsync the file (blocking: call it in a thread); returns the records covered."""
        n = self.written
        os.fsync(self._w.fileno())
        return n

    def publish(self, n: int) -> None:
        """Make the first `n` records visible to streams."""
        if n > self.visible:
            self.visible = n
            self._wake()

    def close(self) -> None:
        """No more records: streams end once they have sent everything visible."""
        if not self._w.closed:
            self._w.close()
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
        start = self.ends[first - 1] if first else 0
        return os.pread(self._r, self.ends[last] - start, start)

    def read_line(self, seq: int) -> bytes:
        return self.read_lines(seq, seq)

    def release(self) -> None:
        """Close the read side too (the batch is forgotten)."""
        self.close()
        try:
            os.close(self._r)
        except OSError:
            pass

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
        """fsync every dirty spool now and publish what the fsyncs covered."""
        async with self._lock:
            self._wake.clear()
            dirty, self._dirty = self._dirty, set()
            for spool in dirty:
                await self._sync(spool)

    async def settle(self, spool: Spool) -> None:
        """Before closing a spool: everything written is synced (unless `never`) and
        visible."""
        async with self._lock:
            self._dirty.discard(spool)
            if self.policy != "never":
                await self._sync(spool)
            spool.publish(spool.written)

    @staticmethod
    async def _sync(spool: Spool) -> None:
        if spool.closed or spool.synced == spool.written:
            return
        n = await asyncio.to_thread(spool.sync)
        spool.synced = n
        spool.publish(n)


__all__ = ["Spool", "SpoolCorrupt", "Syncer", "fsync_dir", "write_json_atomic"]
