"""Who owns a sandbox, and whether that owner is gone (the reaping rule).

Every sandbox carries its owner (host, pid, the process's start time) and an expiry time.
A reaper removes a sandbox when it has expired, or when it was made on this host by a
process that no longer exists (pid reuse is ruled out by the start time). It never touches
live sandboxes of another running Libra process, so two runs can share one engine.
"""

from __future__ import annotations

import os
import socket
import stat
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from libra.errors import SandboxError


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


def private_folder(path: Path) -> Path:
    """`path` as a folder only this user can enter (made 0700 if missing): the state
    root of a backend is a fixed name in a shared place (/dev/shm), and a folder another
    user made there first let them swap a sandbox's folder for a link, which the
    reaper then emptied or a mount went over. A link, or a folder of another user, is
    refused; one of ours with wider permissions (an older Libra's) is narrowed."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        raise SandboxError(f"sandbox state folder {path}: {e}") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        what = ("a link" if stat.S_ISLNK(st.st_mode)
                else "not a folder" if not stat.S_ISDIR(st.st_mode)
                else f"owned by uid {st.st_uid}")  # fmt: skip
        raise SandboxError(
            f"sandbox state folder {path} is {what}, not a folder of this user (uid "
            f"{os.geteuid()}): another user may have made it to take over the sandboxes' "
            "state; remove it, or set LIBRA_DOCKER_STATE / LIBRA_BWRAP_STATE to a folder of yours"
        )
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def own_entry(path: Path) -> bool:
    """Whether `path`, an entry of a private state folder, is a real folder of this user
    (never follow a link out of the state folder)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


__all__ = ["Owner", "current", "own_entry", "private_folder", "should_reap"]
