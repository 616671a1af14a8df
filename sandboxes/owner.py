"""Who owns a sandbox, and whether that owner is gone (the reaping rule).

Every sandbox carries its owner (host, pid, the process's start time) and an expiry time.
A reaper removes a sandbox when it has expired, or when it was made on this host by a
process that no longer exists (pid reuse is ruled out by the start time). It never touches
live sandboxes of another running Libra process, so two runs can share one engine.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from functools import cache


def _start_ticks(pid: int) -> str:
    """Field 22 of /proc/PID/stat: start time in clock ticks since boot ("" if gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return ""
    # The command name (field 2) may contain spaces and parentheses: split after it.
    return stat.rpartition(")")[2].split()[19]


@dataclass(frozen=True, slots=True)
class Owner:
    host: str
    pid: int
    start: str

    def labels(self) -> dict[str, str]:
        return {"libra.host": self.host, "libra.pid": str(self.pid), "libra.start": self.start}

    @classmethod
    def from_labels(cls, labels: dict[str, str]) -> Owner | None:
        try:
            return cls(labels["libra.host"], int(labels["libra.pid"]), labels["libra.start"])
        except (KeyError, ValueError):
            return None

    def alive(self) -> bool:
        """False only when this host can tell the process is gone."""
        if self.host != socket.gethostname():
            return True
        return _start_ticks(self.pid) == self.start


@cache
def current() -> Owner:
    return Owner(socket.gethostname(), os.getpid(), _start_ticks(os.getpid()))


def should_reap(labels: dict[str, str], now: float | None = None) -> bool:
    """The reaping rule over a sandbox's labels (see the module docstring)."""
    now = time.time() if now is None else now
    try:
        if float(labels.get("libra.expires", "inf")) < now:
            return True
    except ValueError:
        return True
    owner = Owner.from_labels(labels)
    return owner is not None and not owner.alive()


__all__ = ["Owner", "current", "should_reap"]
