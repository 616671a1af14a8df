"""Docker backend: one container per sandbox on a real dockerd.

The blocking Docker SDK runs on a thread pool of the backend's own (never the event
loop, never asyncio's small default pool); creates and execs have separate concurrency
limits. Nothing is ever pulled: a recipe image is built with `docker import`
(`libra.sandboxes.images`), any other image must already be in the engine.

Every container carries the label `libra.sandbox` plus its owner, its backend and
expiry (`libra.sandboxes.owner`); the backend reaps by label on start and on a timer,
and a watchdog process removes a backend's containers as soon as its owner exits,
SIGKILL included (`libra.sandboxes.watchdog`). A container runs `docker-init` with a
`sleep` keeper as PID 1, no network (`network_mode=none`), memory = memory+swap limit,
a pids limit, a CPU quota, all capabilities dropped but a few file / process ones,
`no-new-privileges`, and a cap on what it can write (`disk_mb`, see
`libra.sandboxes.dockerdisk`: an engine quota, else a read-only root filesystem with
one size-capped tmpfs for its writable folders).

An exec that times out or floods its output kills the whole container and starts it
again: the kernel then kills every process inside (a fork bomb, a `setsid` daemon),
and the files stay. So a timeout also ends other commands running in that sandbox at
the time. Optionally a warm pool keeps started containers of one spec ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from libra.sandboxes import dockerdisk, images, owner, watchdog
from libra.sandboxes.base import LABEL, Backend, RawExec, SandboxSpec
from libra.sandboxes.dockerexec import OOM_PROBE, exec_stream
from libra.sandboxes.fileops import ExecFileOps

from libra.errors import SandboxError

T = TypeVar("T")
KEEPER = ["sleep", "999999999"]
CAPS = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID"]


def docker_host() -> str | None:
    """The engine address: `$DOCKER_HOST`, else the default socket when it exists."""
    if env := os.environ.get("DOCKER_HOST"):
        return env
    return "unix:///var/run/docker.sock" if Path("/var/run/docker.sock").exists() else None


def engine_answers(timeout: float = 2.0) -> str | None:
    """None when a Docker engine answers a ping, else why not (blocking)."""
    host = docker_host()
    if host is None:
        return "no DOCKER_HOST and no /var/run/docker.sock"
    try:
        import docker

        client = docker.DockerClient(base_url=host, timeout=timeout)
        try:
            client.ping()
        finally:
            client.close()
    except Exception as e:
        return f"engine at {host} does not answer ({type(e).__name__})"
    return None


def _oom_counter_file(api: Any, cid: str) -> Path | None:
    """memory.oom_control (cgroup v1) or memory.events (v2) of a local container."""
    try:
        pid = api.inspect_container(cid)["State"]["Pid"]
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except Exception:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            f = Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.oom_control"
            return f if f.exists() else None
        if controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            f = Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.events"
            return f if f.exists() else None
    return None


class DockerSandbox(ExecFileOps):
    backend = "docker"

    def __init__(self, id: str, spec: SandboxSpec, backend: DockerBackend):
        super().__init__(id, spec)
        self._b = backend
        self._oom_seen = 0
        self._oom_file: Path | bool | None = False  # False: not looked up yet
        self._restart = asyncio.Lock()

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
        ooms = await self._host_ooms()
        async with self._b.exec_slots:
            raw = await self._b.call(
                exec_stream,
                self._b.api,
                self.id,
                argv,
                cwd=cwd,
                env=env,
                stdin=stdin,
                timeout=timeout,
                max_output=max_output,
                flood_limit=flood_limit,
            )
            if raw.timed_out or raw.flooded:
                await self._kill_everything()
            if ooms is not None:
                raw.oom_killed = (await self._host_ooms() or 0) > ooms
            elif raw.exit_code == 137 and not (raw.timed_out or raw.flooded):
                raw.oom_killed = await self._oom_happened()
        if self.closed:
            raise SandboxError(f"sandbox {self.id} was closed while a command ran")
        return raw

    async def _kill_everything(self) -> None:
        """Kill PID 1 (the kernel then kills the whole PID namespace) and start again."""
        async with self._restart:

            def restart() -> None:
                with contextlib.suppress(Exception):
                    self._b.api.kill(self.id)
                self._b.api.wait(self.id, timeout=30)
                self._b.api.start(self.id)

            try:
                await self._b.call(restart)
            except Exception as e:
                raise SandboxError(f"sandbox {self.id}: restart after kill failed: {e}") from e

    async def _host_ooms(self) -> int | None:
        """The container cgroup's OOM-kill counter, read on the host when the engine runs
        here (None for a remote engine: then `_oom_happened` asks inside)."""
        if self._oom_file is False:
            self._oom_file = await self._b.call(_oom_counter_file, self._b.api, self.id)
        if not isinstance(self._oom_file, Path):
            return None
        try:
            for line in self._oom_file.read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return None

    async def _oom_happened(self) -> bool:
        raw = await self._b.call(
            exec_stream,
            self._b.api,
            self.id,
            ["/bin/sh", "-c", OOM_PROBE],
            cwd="/",
            env={},
            stdin=None,
            timeout=10,
            max_output=4096,
            flood_limit=4096,
        )
        try:
            count = int(raw.out.text().split()[-1])
        except (ValueError, IndexError):
            return False
        seen, self._oom_seen = self._oom_seen, count
        return count > seen

    async def _close(self) -> None:
        self._b._live.pop(self.id, None)
        await self._b.call(self._b.remove, self.id)


class DockerBackend(Backend):
    """Sandboxes as Docker containers. `pool_size` > 0 keeps that many started
    containers of `pool_spec` ready, so `create(pool_spec)` skips create+start."""

    name = "docker"

    def __init__(
        self,
        *,
        base_url: str | None = None,
        max_concurrent_creates: int = 4,
        max_concurrent_execs: int = 32,
        pool_size: int = 0,
        pool_spec: SandboxSpec | None = None,
        reap_interval_s: float = 30.0,
        disk: str = "auto",
    ):
        if disk not in dockerdisk.MODES:
            raise SandboxError(f"docker backend: disk={disk!r}; use {', '.join(dockerdisk.MODES)}")
        self.disk = disk
        """What caps the sandboxes' writes: `auto`, `quota`, `tmpfs` or `none`
        (`libra.sandboxes.dockerdisk`); `disk_mode` is what `start` chose."""
        self.disk_mode = "none"
        self.id = f"lb-{secrets.token_hex(6)}"
        """Carried by this backend's containers (label `libra.backend`)."""
        self.state_dir = dockerdisk.state_root() / self.id
        self._watchdog: Any = None
        self._closed = False
        self.base_url = base_url or docker_host()
        self.create_slots = asyncio.Semaphore(max_concurrent_creates)
        self.exec_slots = asyncio.Semaphore(max_concurrent_execs)
        self.pool_size = pool_size
        self.pool_spec = pool_spec or SandboxSpec()
        self.reap_interval_s = reap_interval_s
        self._threads = ThreadPoolExecutor(
            max_concurrent_creates + max_concurrent_execs + 2, thread_name_prefix="libra-docker"
        )
        self._live: dict[str, DockerSandbox] = {}
        # (container id, created at): bounded, so the refill blocks while the pool is full.
        self._pool: asyncio.Queue[tuple[str, float]] = asyncio.Queue(max(1, pool_size))
        self._runner: asyncio.Task[None] | None = None
        self._client: Any = None

    @property
    def api(self) -> Any:
        if self._client is None:
            raise SandboxError("DockerBackend used before start()")
        return self._client.api

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a blocking SDK call on the backend's own threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, functools.partial(fn, *args, **kwargs))

    def info(self) -> dict[str, object]:
        return {"backend": self.name, "engine": self.base_url, "pool_size": self.pool_size,
                "disk": self.disk_mode}  # fmt: skip

    async def start(self) -> None:
        if self._client is not None:
            return
        if self.base_url is None:
            raise SandboxError("docker backend: no engine (set DOCKER_HOST or start dockerd)")
        import docker

        try:
            self._client = await self.call(docker.DockerClient, base_url=self.base_url)
            await self.call(self._client.ping)
        except Exception as e:
            self._client = None
            raise SandboxError(
                f"docker backend: engine at {self.base_url} does not answer: {e}"
            ) from e
        try:
            info = await self.call(self._client.info)
            self.disk_mode = dockerdisk.choose(self.disk, info, self.base_url)
        except ValueError as e:
            await self.call(self._client.close)
            self._client = None
            raise SandboxError(f"docker backend: {e}") from None
        await self.call(dockerdisk.claim, self.state_dir)
        self._watchdog = watchdog.spawn(self.base_url, self.id, self.state_dir)
        await self.call(self.reap)
        await self.call(dockerdisk.reap_stale, dockerdisk.state_root())
        self._runner = asyncio.create_task(self._background(), name="libra-docker-backend")

    async def _background(self) -> None:
        """Owned by the backend: the reaper timer and the warm-pool refill."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._reap_loop())
            if self.pool_size > 0:
                tg.create_task(self._fill_pool())

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self.reap_interval_s)
            with contextlib.suppress(Exception):  # an engine hiccup must not stop reaping
                await self.call(self.reap)

    async def _fill_pool(self) -> None:
        while True:
            try:
                cid = await self._new_container(self.pool_spec)
            except SandboxError:
                await asyncio.sleep(5)  # engine trouble: retry later
                continue
            try:
                await self._pool.put((cid, time.time()))
            except asyncio.CancelledError:
                await asyncio.shield(self.call(self.remove, cid))
                raise

    def reap(self) -> list[str]:
        """Remove labelled containers whose owner died or whose time to live passed."""
        reaped = []
        for c in self.api.containers(all=True, filters={"label": LABEL}):
            if owner.should_reap(c.get("Labels") or {}):
                self.remove(c["Id"])
                live = self._live.pop(c["Id"], None)
                if live is not None:
                    live.closed = True
                reaped.append(c["Id"])
        return reaped

    def remove(self, cid: str) -> None:
        """Remove a container and release its writable storage (blocking)."""
        import docker.errors

        folder = None
        with contextlib.suppress(docker.errors.NotFound):
            labels = self.api.inspect_container(cid)["Config"]["Labels"] or {}
            folder = labels.get(dockerdisk.STATE_LABEL)
        with contextlib.suppress(docker.errors.NotFound):
            self.api.remove_container(cid, force=True)
        if folder:
            dockerdisk.release(Path(folder))

    def _image(self, spec: SandboxSpec) -> str:
        import docker.errors

        if spec.image in images.RECIPES:
            return images.docker_import(self._client, spec.image)
        try:
            self.api.inspect_image(spec.image)
        except docker.errors.ImageNotFound:
            raise SandboxError(
                f"image {spec.image!r} is not in the engine and Libra never pulls: build it "
                f"(`docker import`) or use a recipe ({', '.join(images.RECIPES)})"
            ) from None
        return spec.image

    def _create(
        self, image: str, name: str, spec: SandboxSpec, labels: dict[str, str], folder: Any
    ) -> str:
        """Create and start one container (blocking)."""
        host = self.api.create_host_config(
            network_mode="bridge" if spec.network else "none",
            mem_limit=f"{spec.memory_mb}m",
            memswap_limit=f"{spec.memory_mb}m",
            pids_limit=spec.pids,
            nano_cpus=int(spec.cpus * 1e9),
            init=True,
            cap_drop=["ALL"],
            cap_add=CAPS,
            security_opt=["no-new-privileges"],
            **dockerdisk.host_config(self.disk_mode, spec, folder),
        )
        c = self.api.create_container(
            image,
            command=KEEPER,
            labels=labels,
            working_dir=spec.workdir,
            environment=dict(spec.env),
            host_config=host,
            name=name,
        )
        try:
            self.api.start(c["Id"])
        except Exception:
            self.remove(c["Id"])
            raise
        return str(c["Id"])

    async def _new_container(self, spec: SandboxSpec) -> str:
        def make() -> str:
            image = self._image(spec)
            name = f"libra-{secrets.token_hex(6)}"
            labels = {
                LABEL: "1",
                "libra.expires": f"{time.time() + spec.ttl_s:.0f}",
                "libra.image": spec.image,
                watchdog.BACKEND_LABEL: self.id,
                **owner.current().labels(),
            }
            folder = None
            if self.disk_mode == "tmpfs":
                folder = self.state_dir / name
                labels[dockerdisk.STATE_LABEL] = str(folder)
                dockerdisk.prepare(folder, spec)
            try:
                return self._create(image, name, spec, labels, folder)
            except Exception as e:
                if folder is not None:
                    dockerdisk.release(folder)
                if self.disk_mode == "quota" and "storage-opt" in str(e) and self.disk == "auto":
                    # xfs without project quotas: the engine refuses the size option.
                    self.disk_mode = dockerdisk.choose("auto", {}, self.base_url)
                    return make()
                raise

        async with self.create_slots:
            made = asyncio.get_running_loop().run_in_executor(self._threads, make)
            try:
                return await asyncio.shield(made)
            except asyncio.CancelledError:
                # The thread finishes the create regardless: remove what it made.
                with contextlib.suppress(Exception):
                    await self.call(self.remove, await made)
                raise
            except SandboxError:
                raise
            except Exception as e:
                raise SandboxError(f"docker: cannot create sandbox: {e}") from e

    async def create(self, spec: SandboxSpec | None = None) -> DockerSandbox:
        if self._client is None:
            raise SandboxError("DockerBackend.create before start()")
        spec = spec or SandboxSpec()
        cid = None
        while self.pool_size and spec == self.pool_spec and not self._pool.empty():
            pooled, born = self._pool.get_nowait()
            if time.time() - born < spec.ttl_s / 2:  # else the reaper would take it soon
                cid = pooled
                break
            await self.call(self.remove, pooled)
        if cid is None:
            cid = await self._new_container(spec)
        sb = DockerSandbox(cid, spec, self)
        self._live[cid] = sb
        return sb

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._runner is not None:
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner
            self._runner = None
        for sb in list(self._live.values()):
            await sb.close()
        while not self._pool.empty():
            await self.call(self.remove, self._pool.get_nowait()[0])
        if self._client is not None:
            await self.call(self._client.close)
            self._client = None
        await self.call(watchdog.stop, self._watchdog)  # it sweeps what is left, then exits
        self._watchdog = None
        await self.call(dockerdisk.release_all, self.state_dir)
        self._threads.shutdown(wait=False, cancel_futures=True)


__all__ = ["DockerBackend", "DockerSandbox", "docker_host", "engine_answers"]
