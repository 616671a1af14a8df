"""bubblewrap backend: sandboxes without a daemon, for machines without Docker.

Each sandbox is a state directory: an overlay upper + work dir on a tmpfs (as root: its
own tmpfs mount of `disk_mb`; otherwise under /dev/shm), an owner record, and (as root)
a cgroup. Each exec is one launcher process:

    [prlimit ...]  unshare -m[r]  sh -c 'join cgroup; mount overlay; exec bwrap ...'  CMD

The overlay (read-only rootfs below, the sandbox's upper dir above) is mounted in a
private mount namespace of that exec only, so nothing is mounted on the host and nothing
leaks when Libra dies. bwrap then enters new user, PID, network, IPC, UTS and cgroup
namespaces, drops every capability, and dies with its parent: killing the launcher kills
the PID namespace and everything the command started (`timeout`, `close`).

Limits: as root, one cgroup per sandbox (memory incl. tmpfs pages, pids, CPU quota);
otherwise rlimits per process (address space, process count), weaker: see
docs/sandboxes.md. Not protected against: kernel exploits (it is the host kernel),
and with image `host` the host's files are readable.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shlex
import shutil
import subprocess
import time
from pathlib import Path

from libra.sandboxes import cgroups, images, owner
from libra.sandboxes.base import LABEL, Backend, RawExec, SandboxSpec
from libra.sandboxes.fileops import ExecFileOps
from libra.sandboxes.process import run_process

from libra.errors import SandboxError


def state_root() -> Path:
    if env := os.environ.get("LIBRA_BWRAP_STATE"):
        return Path(env)
    return Path("/dev/shm") / f"libra-bwrap-{os.geteuid()}"


class BwrapSandbox(ExecFileOps):
    backend = "bwrap"

    def __init__(
        self,
        id: str,
        spec: SandboxSpec,
        backend: BwrapBackend,
        rootfs: Path,
        state: Path,
        cgroup: cgroups.Cgroup | None,
    ):
        super().__init__(id, spec)
        self._backend = backend
        self.rootfs = rootfs
        self.state = state
        self.cgroup = cgroup
        self._procs: set[asyncio.Task[RawExec]] = set()

    def _launcher(self, argv: list[str], args_fd: int) -> list[str]:
        """The command that runs `argv` in the sandbox; bwrap reads its options (`options`)
        from `args_fd`. No host path is left where the sandbox can read it: the overlay
        is mounted from inside the sandbox's folder with relative paths (its options show
        in /proc/self/mountinfo) and bwrap, the sandbox's PID 1, has its options from a
        pipe (they show in /proc/1/cmdline), which is empty once read, and an empty
        environment."""
        procs = self.cgroup.procs_files if self.cgroup else []
        joins = "".join(f"echo $$ > {shlex.quote(f)} && " for f in procs)
        mount = (
            f"cd {shlex.quote(str(self.state))} && "
            f"mount --bind {shlex.quote(str(self.rootfs))} lower && "
            "mount -t overlay overlay -o lowerdir=lower,upperdir=fs/upper,workdir=fs/work merged"
        )
        # bwrap's own environment, which the sandbox reads as /proc/1/environ, is empty:
        # it was this process's (API keys and all), while `--clearenv` cleared only the
        # command's.
        bwrap = shlex.quote(shutil.which("bwrap") or "/usr/bin/bwrap")
        script = f'{joins}{mount} && exec env -i {bwrap} --args {args_fd} -- "$@"'
        root = os.geteuid() == 0
        launcher = ["unshare", "-m" if root else "-rm", "--", "/bin/sh", "-c", script, "sh", *argv]
        if self.cgroup is None:
            mem = self.spec.memory_mb * 1024 * 1024
            launcher = ["prlimit", f"--as={mem}", f"--nproc={self.spec.pids}", "--", *launcher]
        return launcher

    def options(self, cwd: str, env: dict[str, str]) -> list[str]:
        """bwrap's options: the overlay as the root, fresh /proc and /dev, every namespace
        unshared, the environment and the working folder."""
        bw = ["--bind", str(self.state / "merged"), "/", "--proc", "/proc", "--dev", "/dev"]
        bw += ["--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
        bw += ["--hostname", "sandbox", "--clearenv"]
        if self.spec.network:
            bw.append("--share-net")
        for k, v in env.items():
            bw += ["--setenv", k, v]
        return [*bw, "--chdir", cwd]

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
    ) -> RawExec:
        ooms = self.cgroup.oom_kills() if self.cgroup else 0
        options = b"".join(o.encode() + b"\0" for o in self.options(cwd, env))
        r, w = os.pipe()
        # written beside the start (a pipe holds 64 KiB; a large environment is more)
        writing = asyncio.ensure_future(asyncio.to_thread(_write_all, w, options))
        try:
            async with self._backend.exec_slots:
                raw = await run_process(
                    self._launcher(argv, r),
                    stdin=stdin,
                    timeout=timeout,
                    max_output=max_output,
                    flood_limit=flood_limit,
                    pass_fds=(r,),
                )
        finally:
            os.close(r)  # a launcher that died unread: the writer gets EPIPE and ends
            await asyncio.wait([writing])
        if self.cgroup is not None:
            raw.oom_killed = self.cgroup.oom_kills() > ooms
        if self.closed:
            raise SandboxError(f"sandbox {self.id} was closed while a command ran")
        return raw

    async def _close(self) -> None:
        self._backend._live.pop(self.id, None)
        await asyncio.to_thread(destroy, self.state, self.cgroup)


def _write_all(fd: int, data: bytes) -> None:
    """Write `data` to the pipe `fd` and close it (a reader that left ends it)."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        pass  # the launcher died before it read them: its result says why
    finally:
        os.close(fd)


def destroy(state: Path, cgroup: cgroups.Cgroup | None) -> None:
    """Kill what runs in a sandbox and remove every trace of it (blocking)."""
    if cgroup is not None:
        cgroup.remove()
    else:
        cgroups.remove_stale(state.name)
    fs = state / "fs"
    if os.path.ismount(fs):
        subprocess.run(["umount", "-l", str(fs)], check=False, capture_output=True)
    shutil.rmtree(state, ignore_errors=True)


class BwrapBackend(Backend):
    """Sandboxes with bubblewrap. `use_cgroups=None`: when running as root."""

    name = "bwrap"

    def __init__(
        self,
        *,
        state_dir: str | Path | None = None,
        use_cgroups: bool | None = None,
        max_concurrent_execs: int = 64,
        reap_interval_s: float = 30.0,
    ):
        self.state_dir = Path(state_dir) if state_dir else state_root()
        self.use_cgroups = cgroups.version() is not None if use_cgroups is None else use_cgroups
        if self.use_cgroups and cgroups.version() is None:
            raise SandboxError("use_cgroups=True needs root and a cgroup v1 or v2 hierarchy")
        self.exec_slots = asyncio.Semaphore(max_concurrent_execs)
        self.reap_interval_s = reap_interval_s
        self._live: dict[str, BwrapSandbox] = {}
        self._reaper: asyncio.Task[None] | None = None

    @staticmethod
    def available() -> str | None:
        """None when usable, else why not."""
        for tool in ("bwrap", "unshare"):
            if shutil.which(tool) is None:
                return f"{tool} not found (apt-get install bubblewrap util-linux)"
        if os.geteuid() != 0 and shutil.which("prlimit") is None:
            return "prlimit not found (apt-get install util-linux)"
        return None

    def info(self) -> dict[str, object]:
        return {
            "backend": self.name,
            "cgroups": cgroups.version() if self.use_cgroups else None,
            "state_dir": str(self.state_dir),
        }

    async def start(self) -> None:
        if why := self.available():
            raise SandboxError(f"bubblewrap backend unavailable: {why}")
        await asyncio.to_thread(owner.private_folder, self.state_dir)
        await asyncio.to_thread(self.reap)
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap_loop(), name="libra-bwrap-reaper")

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self.reap_interval_s)
            await asyncio.to_thread(self.reap)

    def reap(self) -> list[str]:
        """Remove sandboxes whose owner died or whose time to live passed."""
        reaped = []
        for state in self.state_dir.glob("lb-*"):
            if not owner.own_entry(state):
                continue  # never follow a link out of the state folder
            try:
                labels = json.loads((state / "owner.json").read_text())
            except (OSError, ValueError):
                labels = {}
            if not labels and time.time() - state.stat().st_mtime < 60:
                continue  # being created right now
            if not labels or owner.should_reap(labels):
                live = self._live.pop(state.name, None)
                if live is not None:
                    live.closed = True
                destroy(state, live.cgroup if live else None)
                reaped.append(state.name)
        return reaped

    async def create(self, spec: SandboxSpec | None = None) -> BwrapSandbox:
        spec = spec or SandboxSpec()
        rootfs = await asyncio.to_thread(images.rootfs, spec.image)
        sid = f"lb-{secrets.token_hex(6)}"
        state = self.state_dir / sid
        try:
            cgroup = await asyncio.to_thread(self._prepare, sid, spec, state)
        except (OSError, subprocess.CalledProcessError) as e:
            await asyncio.to_thread(destroy, state, None)
            raise SandboxError(f"bubblewrap: cannot create sandbox: {e}") from e
        sb = BwrapSandbox(sid, spec, self, rootfs, state, cgroup)
        self._live[sid] = sb
        return sb

    def _prepare(self, sid: str, spec: SandboxSpec, state: Path) -> cgroups.Cgroup | None:
        fs = state / "fs"
        state.mkdir(mode=0o700)
        fs.mkdir()
        (state / "merged").mkdir()
        (state / "lower").mkdir()  # the rootfs, bound there at each exec
        if os.geteuid() == 0:
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={spec.disk_mb}m,mode=0700", "tmpfs", str(fs)],
                check=True,
                capture_output=True,
            )
        (fs / "work").mkdir()
        # Created in the upper layer so that it is writable even for a non-root user.
        (fs / "upper" / spec.workdir.lstrip("/")).mkdir(parents=True)
        cgroup = None
        if self.use_cgroups:
            cgroup = cgroups.Cgroup(sid, memory_mb=spec.memory_mb, pids=spec.pids, cpus=spec.cpus)
        labels = {
            LABEL: sid,
            "libra.expires": f"{time.time() + spec.ttl_s:.0f}",
            "libra.image": spec.image,
            **owner.current().labels(),
        }
        (state / "owner.json").write_text(json.dumps(labels))
        return cgroup

    async def aclose(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        for sb in list(self._live.values()):
            await sb.close()


__all__ = ["BwrapBackend", "BwrapSandbox", "state_root"]
