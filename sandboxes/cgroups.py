"""Per-sandbox cgroups for the bubblewrap backend (root only), v1 or v2.

One cgroup per sandbox (under `libra/` in each hierarchy) holds memory, pids and CPU
limits for all the sandbox's processes together. A process joins by writing its pid to
`cgroup.procs` before it execs bwrap, so everything it starts is accounted there. The
kernel's own counters tell what acted: `oom_kill` (memory) and `max` (pids, refused
forks).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


def version() -> int | None:
    """2 for a unified hierarchy, 1 when the v1 memory and pids controllers are mounted,
    None when cgroups cannot be used (not root, or neither layout)."""
    if os.geteuid() != 0:
        return None
    if (ROOT / "cgroup.controllers").exists():
        return 2
    if (ROOT / "memory" / "cgroup.procs").exists() and (ROOT / "pids" / "cgroup.procs").exists():
        return 1
    return None


def _read_counter(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


class Cgroup:
    """The cgroup(s) of one sandbox."""

    def __init__(self, name: str, *, memory_mb: int, pids: int, cpus: float):
        self.version = version()
        if self.version is None:
            raise RuntimeError("cgroups need root and a v1 (memory, pids) or v2 hierarchy")
        period = 100_000
        quota = max(1000, int(cpus * period))
        mem = str(memory_mb * 1024 * 1024)
        if self.version == 2:
            parent = ROOT / "libra"
            parent.mkdir(exist_ok=True)
            for level in (ROOT, parent):
                try:
                    (level / "cgroup.subtree_control").write_text("+memory +pids +cpu")
                except OSError:
                    (level / "cgroup.subtree_control").write_text("+memory +pids")
            self.dirs = [parent / name]
            self.dirs[0].mkdir(exist_ok=True)
            (self.dirs[0] / "memory.max").write_text(mem)
            swap = self.dirs[0] / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")
            (self.dirs[0] / "pids.max").write_text(str(pids))
            if (self.dirs[0] / "cpu.max").exists():
                (self.dirs[0] / "cpu.max").write_text(f"{quota} {period}")
            self._oom = (self.dirs[0] / "memory.events", "oom_kill")
            self._pids_events = self.dirs[0] / "pids.events"
        else:
            controllers = ["memory", "pids"] + (["cpu"] if (ROOT / "cpu").is_dir() else [])
            self.dirs = [ROOT / c / "libra" / name for c in controllers]
            for d in self.dirs:
                d.mkdir(parents=True, exist_ok=True)
            memdir = self.dirs[0]
            (memdir / "memory.limit_in_bytes").write_text(mem)
            if (memdir / "memory.memsw.limit_in_bytes").exists():
                (memdir / "memory.memsw.limit_in_bytes").write_text(mem)
            (self.dirs[1] / "pids.max").write_text(str(pids))
            if len(self.dirs) > 2:
                (self.dirs[2] / "cpu.cfs_period_us").write_text(str(period))
                (self.dirs[2] / "cpu.cfs_quota_us").write_text(str(quota))
            self._oom = (memdir / "memory.oom_control", "oom_kill")
            self._pids_events = self.dirs[1] / "pids.events"

    @property
    def procs_files(self) -> list[str]:
        """`cgroup.procs` files a process writes its pid to, to join."""
        return [str(d / "cgroup.procs") for d in self.dirs]

    def oom_kills(self) -> int:
        return _read_counter(*self._oom)

    def refused_forks(self) -> int:
        return _read_counter(self._pids_events, "max")

    def pids(self) -> list[int]:
        found: set[int] = set()
        for d in self.dirs:
            try:
                found.update(int(p) for p in (d / "cgroup.procs").read_text().split())
            except OSError:
                pass
        return sorted(found)

    def kill_all(self, rounds: int = 50) -> None:
        """SIGKILL every process in the cgroup until none is left (forks race kills)."""
        for _ in range(rounds):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)

    def remove(self) -> None:
        self.kill_all()
        for d in self.dirs:
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # busy until the killed processes are reaped
                    time.sleep(0.02)


def remove_stale(name: str) -> None:
    """Kill and remove a sandbox's cgroups by name (the reaper's path)."""
    v = version()
    if v is None:
        return
    dirs = (
        [ROOT / "libra" / name]
        if v == 2
        else [ROOT / c / "libra" / name for c in ("memory", "pids", "cpu")]
    )
    for d in dirs:
        if d.is_dir():
            cg = Cgroup.__new__(Cgroup)
            cg.dirs = [d]
            cg.remove()


__all__ = ["Cgroup", "remove_stale", "version"]
