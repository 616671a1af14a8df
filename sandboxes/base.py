"""The sandbox interface every backend implements, and the pieces they share.

A sandbox is an isolated Linux filesystem plus process limits in which an episode's
commands run: `exec` a command, read / write files, copy trees in and out, `close`.
Backends: `docker` (a real dockerd), `bwrap` (bubblewrap, no daemon) and `auto` (Docker
when its socket answers, else bubblewrap); see `docs/sandboxes.md` for what each one does
and does not protect against.

Expected failures are values, not exceptions (nanochat): a command that exits non-zero,
runs out of time, floods its output or is OOM-killed returns an `ExecResult` that says
so. `SandboxError` is for the backend itself failing (no engine, image missing, the
sandbox was closed).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any, Self

from libra.errors import SandboxError

DEFAULT_MAX_OUTPUT = 64 * 1024
"""Bytes of stdout and of stderr kept per exec; the rest is counted and discarded."""
DEFAULT_FLOOD_LIMIT = 32 * 1024 * 1024
"""A command that writes more than this in all is killed: draining a runaway writer costs
the host CPU (Docker's stream path moves ~130 MB/s here, docs/sandboxes.md)."""
LABEL = "libra.sandbox"
"""Docker label (and bwrap state marker) carried by everything a backend creates."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxSpec:
    """What to create. Limits apply to the sandbox as a whole, not per command."""

    image: str = "busybox"
    """A recipe name from `libra.sandboxes.images` (`busybox`, `python`, `host` for
    bubblewrap), or a backend-specific reference: a local Docker image tag, or a rootfs
    directory for bubblewrap. Nothing is ever pulled."""
    workdir: str = "/work"
    """Absolute path inside the sandbox where commands start; created if missing."""
    memory_mb: int = 512
    """Memory limit; going over it gets the biggest process OOM-killed."""
    cpus: float = 1.0
    """CPU share (Docker: `--cpus`; bubblewrap as root: cgroup CPU quota)."""
    pids: int = 256
    """Most processes and threads alive at once; a fork past it fails with EAGAIN."""
    network: bool = False
    """Off by default: the sandbox sees only its own loopback interface."""
    ttl_s: float = 3600.0
    """Time to live: a sandbox older than this is removed by the reaper even if its
    owner died without closing it."""
    disk_mb: int = 1024
    """Most the sandbox can write, all its files together: Docker caps its layer with an
    engine quota where the storage supports it, else mounts its writable folders
    (workdir, /tmp, /var/tmp, /root) from one tmpfs of this size over a read-only root
    (`libra.sandboxes.dockerdisk`); bubblewrap as root: the size of the tmpfs holding
    its writable layer. A tmpfs is memory: what is kept written counts against
    `memory_mb` too."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Environment variables of every command (on top of a minimal PATH/HOME/LANG)."""

    def __post_init__(self) -> None:
        if not PurePosixPath(self.workdir).is_absolute():
            raise ValueError(f"SandboxSpec.workdir must be absolute, got {self.workdir!r}")
        for name in ("memory_mb", "pids", "disk_mb"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxSpec.{name} must be > 0, got {getattr(self, name)}")
        if self.cpus <= 0 or self.ttl_s <= 0:
            raise ValueError("SandboxSpec.cpus and SandboxSpec.ttl_s must be > 0")


@dataclass(frozen=True, slots=True)
class ExecResult:
    """The outcome of one command. Output is decoded as UTF-8 (invalid bytes replaced)."""

    exit_code: int
    """The command's exit status; 128 + N when killed by signal N (137: SIGKILL)."""
    stdout: str
    stderr: str
    truncated: bool = False
    """Some output was dropped: more than `max_output` bytes on a stream."""
    timed_out: bool = False
    """The command ran past its timeout and everything it started was killed."""
    duration_s: float = 0.0
    stdout_bytes: int = 0
    """Bytes the command wrote to stdout in all (kept or not); for a flooded command,
    up to the kill (what it writes while the kill lands is drained, not counted)."""
    stderr_bytes: int = 0
    oom_killed: bool = False
    """The kernel's OOM killer acted in the sandbox during this command."""
    flooded: bool = False
    """Killed for writing more than the flood limit of output."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def describe(self) -> str:
        """One line on how the command ended, for tool messages and logs."""
        if self.timed_out:
            return f"timed out after {self.duration_s:.1f} s (killed)"
        if self.flooded:
            return "killed: wrote more output than the flood limit"
        if self.oom_killed:
            return f"killed by the OOM killer (exit code {self.exit_code})"
        return f"exit code {self.exit_code}"


class OutputCapture:
    """Keeps the first `cap` bytes of a stream, counts the rest."""

    __slots__ = ("cap", "chunks", "kept", "total")

    def __init__(self, cap: int):
        self.cap = cap
        self.chunks: list[bytes] = []
        self.kept = 0
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.cap - self.kept
        if room > 0:
            piece = data[:room]
            self.chunks.append(piece)
            self.kept += len(piece)

    @property
    def truncated(self) -> bool:
        return self.total > self.kept

    def bytes(self) -> bytes:
        return b"".join(self.chunks)

    def text(self) -> str:
        return self.bytes().decode("utf-8", errors="replace")


def shell_argv(cmd: str | Sequence[str]) -> list[str]:
    """A string runs through `/bin/sh -c`; a sequence is an argv run as is."""
    if isinstance(cmd, str):
        return ["/bin/sh", "-c", cmd]
    argv = list(cmd)
    if not argv:
        raise ValueError("exec: empty command")
    return argv


DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(slots=True)
class RawExec:
    """What a backend's `_exec` returns: the captures keep raw bytes (file reads need
    them); `Sandbox.exec` turns it into an `ExecResult`."""

    exit_code: int
    out: OutputCapture
    err: OutputCapture
    duration_s: float
    timed_out: bool = False
    flooded: bool = False
    oom_killed: bool = False

    def result(self) -> ExecResult:
        return ExecResult(
            exit_code=self.exit_code,
            stdout=self.out.text(),
            stderr=self.err.text(),
            truncated=self.out.truncated or self.err.truncated,
            timed_out=self.timed_out,
            duration_s=self.duration_s,
            stdout_bytes=self.out.total,
            stderr_bytes=self.err.total,
            oom_killed=self.oom_killed,
            flooded=self.flooded,
        )


class Sandbox(ABC):
    """One isolated environment. Use as `async with await backend.create(spec) as sb:`."""

    backend: str = "?"

    def __init__(self, id: str, spec: SandboxSpec):
        self.id = id
        self.spec = spec
        self.closed = False
        self.created_at = time.time()

    def resolve(self, path: str) -> str:
        """A path inside the sandbox; relative paths are relative to the workdir."""
        p = PurePosixPath(path)
        return str(p if p.is_absolute() else PurePosixPath(self.spec.workdir) / p)

    def _check_open(self) -> None:
        if self.closed:
            raise SandboxError(f"sandbox {self.id} is closed")

    async def exec(
        self,
        cmd: str | Sequence[str],
        *,
        timeout: float = 60.0,  # noqa: ASYNC109  (the interface: a per-command limit)
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
        flood_limit: int = DEFAULT_FLOOD_LIMIT,
    ) -> ExecResult:
        """Run a command (string: through `sh -c`) and wait for it, at most `timeout` s.

        On timeout (or flood) every process the command started is killed; the sandbox
        and its files stay usable. Never raises for the command's own failures."""
        raw = await self.exec_raw(
            shell_argv(cmd),
            timeout=timeout,
            cwd=cwd,
            env=env,
            stdin=stdin,
            max_output=max_output,
            flood_limit=flood_limit,
        )
        return raw.result()

    async def exec_raw(
        self,
        argv: list[str],
        *,
        timeout: float = 60.0,  # noqa: ASYNC109  (the interface: a per-command limit)
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
        flood_limit: int = DEFAULT_FLOOD_LIMIT,
    ) -> RawExec:
        """`exec` with an argv and the raw byte captures."""
        self._check_open()
        if timeout <= 0:
            raise ValueError(f"exec timeout must be > 0 s, got {timeout}")
        full_env = {"PATH": DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8"}
        full_env.update(self.spec.env)
        full_env.update(env or {})
        return await self._exec(
            argv,
            timeout=timeout,
            cwd=self.resolve(cwd or self.spec.workdir),
            env=full_env,
            stdin=stdin,
            max_output=max_output,
            flood_limit=max(flood_limit, max_output),
        )

    @abstractmethod
    async def _exec(
        self,
        argv: list[str],
        *,
        timeout: float,  # noqa: ASYNC109
        cwd: str,
        env: dict[str, str],
        stdin: bytes | None,
        max_output: int,
        flood_limit: int,
    ) -> RawExec: ...

    @abstractmethod
    async def read_file(self, path: str) -> bytes:
        """Contents of a file; `FileNotFoundError` when it does not exist."""

    @abstractmethod
    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        """Create or replace a file, creating missing parent directories."""

    @abstractmethod
    async def copy_in(self, src: str | Path, dest: str) -> None:
        """Copy a host file or directory tree to `dest` inside (`dest` becomes its name)."""

    @abstractmethod
    async def copy_out(self, src: str, dest: str | Path) -> None:
        """Copy a file or directory tree from inside to host path `dest`."""

    @abstractmethod
    async def _close(self) -> None: ...

    async def close(self) -> None:
        """Kill everything inside and remove the sandbox. Idempotent."""
        if self.closed:
            return
        self.closed = True
        await self._close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} image={self.spec.image!r}>"


class Backend(ABC):
    """Creates sandboxes. Use as `async with backend:` (or `start()` / `aclose()`): the
    backend reaps what dead owners left behind on start and on a timer, and closes
    every sandbox it created on `aclose`."""

    name: str = "?"

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def create(self, spec: SandboxSpec | None = None) -> Sandbox: ...

    @abstractmethod
    async def aclose(self) -> None: ...

    def info(self) -> dict[str, Any]:
        """What this backend is and how it is configured (for `libra bench`, logs)."""
        return {"backend": self.name}

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


__all__ = [
    "DEFAULT_FLOOD_LIMIT",
    "DEFAULT_MAX_OUTPUT",
    "LABEL",
    "Backend",
    "ExecResult",
    "OutputCapture",
    "RawExec",
    "Sandbox",
    "SandboxSpec",
    "shell_argv",
]
