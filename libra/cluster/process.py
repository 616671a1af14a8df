"""Child processes of a job: spawned in their own session, healthy when `/health` says so,
stopped with their whole process group. The one copy of spawn / health / stop that the
embedded engines, vLLM servers and `libra train`'s workers all use.

- Own session (`start_new_session`): a Ctrl-C at the terminal reaches Libra, which stops
  its children in order, not the children themselves; and `stop` can signal the whole
  group (vLLM's engine core and TP workers die with their API server).
- Death with the parent (Linux, `PR_SET_PDEATHSIG`): a Libra process that is killed
  (SIGKILL, OOM) leaves no child behind.
- Output goes to a log file; a child that fails to start is reported with the log's tail.

Plain `subprocess.Popen` (asyncio's subprocess transport spawns through it too), so the
same `Child` serves asyncio code (`wait_healthy`, `stop`) and blocking code
(`wait_healthy_blocking`, `stop_blocking`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from libra.errors import EndpointError

POLL_S = 0.05
"""How often a stop checks whether the child has exited."""


@dataclass(eq=False, slots=True)
class Child:
    """A running child process (and its process group)."""

    name: str
    """What it is, for messages (`engine rollout0`, `vLLM hybrid0 (tp=2, GPUs [4, 5])`)."""
    proc: subprocess.Popen[bytes]
    log_path: Path
    url: str = ""
    """Base URL of its HTTP API (empty: it serves none)."""
    start_s: float = 0.0
    """Seconds from spawn to healthy (set by `wait_healthy`)."""
    log_from: int = 0
    """Where this run's output starts in the log (a restarted engine appends to its
    predecessor's)."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """None while it runs (and reaps it once it has exited)."""
        return self.proc.poll()

    def log_tail(self, lines: int = 4, chars: int = 400, sep: str = " | ") -> str:
        """The log's last lines (of its last `chars` characters), joined with `sep`
        (one-line errors by default)."""
        text = self._log()
        if text is None:
            return "(no log)"
        return sep.join(text[-chars:].splitlines()[-lines:]) or "(empty log)"

    def last_error(self) -> str:
        """The log's last line that names an error (vLLM ends with shutdown messages)."""
        text = self._log()
        if text is None:
            return "(no log)"
        lines = text.splitlines()
        found = [x for x in lines if "Error" in x or "error" in x]
        return ((found or lines or ["(empty log)"])[-1]).strip()[-300:]

    def _log(self) -> str | None:
        try:
            with self.log_path.open("rb") as f:
                f.seek(self.log_from)
                return f.read().decode(errors="replace").strip()
        except OSError:
            return None


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """Linux: a `preexec_fn` that makes the child get `sig` when its parent dies. libc
    is loaded here, in the parent: the hook only calls prctl."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, sig)  # 1 = PR_SET_PDEATHSIG


BIND_TRIES = 3
"""Starts of a server child on a fresh port before a bind failure is final."""


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; other systems: a guess below theirs


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (for a child's HTTP API). Picked at random below the
    kernel's ephemeral range when there is room (ports 20000..): a port the kernel hands
    to an outgoing connection cannot take it between this check and the child's bind.
    Another listener still can; `spawn_listening` starts the child again if so."""
    low = _ephemeral_low()
    candidates = [random.randrange(20000, low) for _ in range(32)] if low > 21000 else []
    for port in [*candidates, 0]:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise OSError(f"no free TCP port on {host}")


class PortTaken(EndpointError):
    """What answered a child's URL is another process's listener, not the child's."""


def _listeners(port: int) -> set[int] | None:
    """Socket inodes listening on TCP `port` in this network namespace (None: Linux's
    tables cannot be read here, so nobody can tell)."""
    out: set[int] | None = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        out = out or set()
        for line in lines:
            f = line.split()  # local address "HEXIP:HEXPORT", state 0A = LISTEN, inode
            if len(f) > 9 and f[3] == "0A" and int(f[1].rpartition(":")[2], 16) == port:
                out.add(int(f[9]))
    return out


def _session_holds(session: int, inodes: set[int]) -> bool | None:
    """Whether a process of `session` holds one of the sockets `inodes` (None: none of
    its processes' descriptors could be read, so nobody can tell)."""
    seen = False
    for proc in Path("/proc").iterdir():
        if not (proc.name.isascii() and proc.name.isdigit()):
            continue
        try:
            if int((proc / "stat").read_text().rpartition(")")[2].split()[3]) != session:
                continue
            fds = list((proc / "fd").iterdir())
            seen = True
            for fd in fds:
                link = os.readlink(fd)
                if link.startswith("socket:[") and int(link[8:-1]) in inodes:
                    return True
        except (OSError, ValueError, IndexError):  # gone, or not ours to read
            continue
    return False if seen else None


def check_listener(child: Child) -> None:
    """Raise `PortTaken` unless the socket listening on the child's port is the child's
    (a process of its session). A port is free only when it is checked: another local
    user who binds it first, having read the port from the child's command line, answers
    `/health` and then receives every prompt (and could send any completion back)."""
    from urllib.parse import urlsplit

    port = urlsplit(child.url).port
    inodes = _listeners(port) if port else None
    held = _session_holds(child.pid, inodes) if inodes else None  # None: nobody can tell
    if held is False or child.returncode is not None:  # (an exited child answers nothing)
        raise PortTaken(
            f"{child.name}: port {port} is answered by another process than the one "
            "started (something else bound it first)"
        )


async def spawn_listening(
    start: Callable[[int], Child], timeout_s: float, host: str = "127.0.0.1"
) -> Child:
    """`start(port)` on a free port, then `wait_healthy`. A port is only free when it is
    checked: a child that exits saying its address is in use, or whose port another
    process answers (`check_listener`), is started again on another, `BIND_TRIES` times
    in all."""
    for attempt in range(1, BIND_TRIES + 1):
        child = start(free_port(host))
        try:
            await wait_healthy(child, timeout_s)
        except PortTaken:
            if attempt == BIND_TRIES:
                raise
            continue
        except EndpointError:
            in_use = "address already in use" in child.log_tail(lines=20, chars=4000).lower()
            if child.returncode is None or not in_use or attempt == BIND_TRIES:
                raise
            continue
        return child
    raise AssertionError("unreachable")


def spawn(
    name: str,
    cmd: Sequence[str],
    *,
    log_path: Path,
    env: dict[str, str] | None = None,
    url: str = "",
    death_signal: int = signal.SIGKILL,
) -> Child:
    """Start `cmd` in its own session, output appended to `log_path`, stdin closed; it
    gets `death_signal` if this process dies (SIGKILL for servers that ignore SIGTERM
    while they start, as vLLM does)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log_from = log.tell()
        proc = subprocess.Popen(
            list(cmd),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent(death_signal),  # noqa: PLW1509 - only a prctl call
        )
    return Child(name, proc, log_path, url, log_from=log_from)


async def wait_healthy(child: Child, timeout_s: float) -> None:
    """Poll `{url}/health` until it answers 200 and set `child.start_s`. Raises
    `EndpointError` (with the log's tail) when the child exits first or `timeout_s`
    passes; the child is then stopped."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    try:
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if child.returncode is not None:
                    raise EndpointError(
                        f"{child.name} exited with {child.returncode} at start; "
                        f"log {child.log_path}: {child.log_tail()}"
                    )
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    timeout = aiohttp.ClientTimeout(total=2)
                    async with session.get(f"{child.url}/health", timeout=timeout) as r:
                        if r.status == 200:
                            check_listener(child)
                            child.start_s = time.monotonic() - t0
                            return
                await asyncio.sleep(0.2)
        raise EndpointError(
            f"{child.name} not healthy after {timeout_s:g} s; "
            f"log {child.log_path}: {child.log_tail()}"
        )
    except BaseException:
        await stop(child)
        raise


def healthy(url: str, timeout: float = 2.0) -> bool:
    """Does `{url}/health` answer 200 now? (blocking)"""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy_blocking(child: Child, timeout_s: float) -> bool:
    """Blocking `wait_healthy`: True once healthy, False if it exited or timed out."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if child.returncode is not None:
            return False
        if healthy(child.url):
            try:
                check_listener(child)
            except PortTaken:
                return False
            child.start_s = time.monotonic() - t0
            return True
        time.sleep(1.0)
    return False


def _signal_group(child: Child, sig: int) -> None:
    # the group outlives its leader when workers linger: signal it even after the
    # leader exited (ESRCH once all are gone; EPERM if the id was reused elsewhere)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, sig)


async def stop(child: Child, grace_s: float = 10.0) -> None:
    """SIGTERM the child's process group, SIGKILL it after `grace_s`, reap the child. A
    stop that is cancelled still kills and reaps it before the cancellation goes on."""
    try:
        if child.returncode is None:
            _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while child.returncode is None and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(POLL_S)
    finally:
        kill(child)


def kill(child: Child) -> None:
    """SIGKILL the child's process group now and reap the child (last resort, and the
    end of every stop: what is left of the group after its leader went is killed)."""
    _signal_group(child, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.proc.wait(timeout=5)  # a killed process is reaped at once


def stop_blocking(children: Sequence[Child], grace_s: float = 30.0) -> None:
    """Blocking `stop` of several children: SIGTERM all, SIGKILL what is left after
    `grace_s`."""
    for c in children:
        if c.returncode is None:
            _signal_group(c, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for c in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        kill(c)


__all__ = [
    "Child",
    "PortTaken",
    "check_listener",
    "die_with_parent",
    "free_port",
    "healthy",
    "kill",
    "spawn",
    "spawn_listening",
    "stop",
    "stop_blocking",
    "wait_healthy",
    "wait_healthy_blocking",
]
