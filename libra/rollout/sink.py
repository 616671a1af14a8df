"""Where finished records go: a JSONL file (flushed per record) and a progress line."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import IO, Any

from libra.errors import ConfigError
from libra.record import Trajectory
from libra.rollout.wire import RawRecord, facts_of, serialized

log = logging.getLogger(__name__)


TAIL_BLOCK = 1 << 16


def whole_lines(path: Path) -> int:
    """Cut a torn last line off the JSON-lines file `path` (a write the disk refused
    partway, a crash in mid-write): the bytes after its last newline, which no reader
    can parse and which the next appended line would be glued to. Returns the bytes
    cut (0: the file ends with a whole line, is empty or absent). Reads the file from
    its end, a block at a time."""
    try:
        f = open(path, "r+b")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return 0
    with f:
        size = f.seek(0, os.SEEK_END)
        end = size
        while end > 0:
            start = max(0, end - TAIL_BLOCK)
            f.seek(start)
            block = f.read(end - start)
            if end == size and block.endswith(b"\n"):
                return 0
            nl = block.rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            end = start
        else:
            keep = 0
        f.truncate(keep)
    return size - keep


class JsonlSink:
    """Appends one record per line and flushes it, so a crash loses nothing finished.
    `fsync=True` also forces each line to disk (survives a machine crash; slower). A
    torn last line already in the file is cut off first (`whole_lines`)."""

    def __init__(self, path: str | Path, fsync: bool = False):
        self.path = Path(path)
        if self.path.exists() and not self.path.is_file():
            raise ConfigError(f"out {str(self.path)!r} is not a regular file (a folder, a "
                              "device or a pipe); records go to a .jsonl file")  # fmt: skip
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if cut := whole_lines(self.path):
                log.warning("%s: cut off a torn last line (%d bytes, a write that did not "
                            "finish)", self.path, cut)  # fmt: skip
            self._f: IO[bytes] = open(self.path, "ab")  # noqa: SIM115 - closed in close()
        except OSError as e:
            raise ConfigError(f"out {str(self.path)!r} cannot be written: "
                              f"{e.strerror or e}") from None  # fmt: skip
        self.fsync = fsync

    def __call__(self, record: Trajectory | RawRecord) -> Trajectory | RawRecord:
        """Write `record`; returns what was written (its error stand-in when the record
        cannot be written: `libra.rollout.wire.serialized`)."""
        record, line = serialized(record)
        self._f.write(line + b"\n")
        self._f.flush()
        if self.fsync:
            os.fsync(self._f.fileno())
        return record

    def close(self) -> None:
        self._f.close()


class Stats:
    """Running totals over finished records (the summary and the progress line)."""

    def __init__(self, total: int, clock: Any = time.monotonic):
        self.total = total
        self.clock = clock
        self.t0 = clock()
        self.done = 0
        self.status: Counter[str] = Counter()
        self.model_tokens = 0
        self.total_tokens = 0
        self.reward_sum = 0.0
        self.migrations = 0
        self.tool_calls = 0
        self.tool_errors = 0

    def add(self, r: Trajectory | RawRecord) -> None:
        status, model_tokens, total_tokens, reward, reasons, calls, errors = (
            r.facts if isinstance(r, RawRecord) else facts_of(r)
        )
        self.done += 1
        self.status[status] += 1
        self.model_tokens += model_tokens
        self.total_tokens += total_tokens
        self.reward_sum += reward
        self.migrations += len(reasons)
        self.tool_calls += calls
        self.tool_errors += sum(errors.values())

    def summary(self) -> dict[str, Any]:
        wall = max(self.clock() - self.t0, 1e-9)
        return {
            "episodes": self.done,
            "status": dict(sorted(self.status.items())),
            "mean_reward": self.reward_sum / self.done if self.done else 0.0,
            "model_tokens": self.model_tokens,
            "total_tokens": self.total_tokens,
            "tokens_per_s": self.model_tokens / wall,
            "migrations": self.migrations,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "wall_s": wall,
        }


class Progress:
    """One status line on stderr: redrawn in place on a terminal, else every 10 s."""

    def __init__(self, stats: Stats, stream: IO[str] | None = None):
        self.stats = stats
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._last = 0.0

    def __call__(self, record: Trajectory | RawRecord) -> None:
        now = self.stats.clock()
        if now - self._last >= (0.25 if self.tty else 10.0) or self.stats.done == self.stats.total:
            self._last = now
            self.draw()

    def draw(self) -> None:
        s = self.stats
        wall = max(s.clock() - s.t0, 1e-9)
        bad = s.done - s.status.get("ok", 0)
        line = (
            f"episodes {s.done}/{s.total}  {s.model_tokens / wall:,.0f} tok/s  "
            f"not-ok {bad}  tool errors {s.tool_errors}  migrations {s.migrations}  "
            f"{wall:,.0f}s"
        )
        if self.tty:
            self.stream.write("\r\x1b[K" + line)
            if s.done == s.total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


__all__ = ["JsonlSink", "Progress", "Stats", "whole_lines"]
