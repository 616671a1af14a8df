"""Docker-only behaviour: reaping by label, the warm pool, never pulling; and `auto`."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from libra.sandboxes import auto
from libra.sandboxes.base import LABEL, SandboxSpec
from libra.sandboxes.bwrap import BwrapBackend
from libra.sandboxes.docker import DockerBackend, engine_answers

from tests.conftest import need

pytestmark = pytest.mark.docker
SPEC = SandboxSpec(image="busybox", memory_mb=64)


@pytest.fixture
async def docker() -> DockerBackend:
    why = engine_answers()
    need(why is None, f"no Docker engine: {why}")
    backend = DockerBackend()
    await backend.start()
    yield backend
    await backend.aclose()


def labelled(backend: DockerBackend) -> list[str]:
    return [c["Id"] for c in backend.api.containers(all=True, filters={"label": LABEL})]


async def test_start_reaps_containers_of_dead_owners_only(docker: DockerBackend) -> None:
    live = await docker.create(SPEC)
    image = await asyncio.to_thread(docker._image, SPEC)
    orphan = await asyncio.to_thread(
        docker.api.create_container,
        image,
        command=["sleep", "1000"],
        labels={
            LABEL: "1",
            "libra.host": __import__("socket").gethostname(),
            "libra.pid": "999999999",
            "libra.start": "1",
            "libra.expires": "9999999999",
        },
    )
    assert orphan["Id"] in labelled(docker)
    other = DockerBackend()  # a second run starting up: reaps the orphan, not our sandbox
    await other.start()
    try:
        ids = labelled(docker)
        assert orphan["Id"] not in ids and live.id in ids
    finally:
        await other.aclose()
    assert (await live.exec("echo ok")).stdout == "ok\n"


async def test_warm_pool_hands_out_started_containers() -> None:
    need(engine_answers() is None, "no Docker engine")
    async with DockerBackend(pool_size=2, pool_spec=SPEC) as backend:
        for _ in range(200):
            if backend._pool.qsize() == 2:
                break
            await asyncio.sleep(0.05)
        pooled = {cid for cid, _ in list(backend._pool._queue)}  # type: ignore[attr-defined]
        assert len(pooled) == 2
        sb = await backend.create(SPEC)
        assert sb.id in pooled and (await sb.exec("echo warm")).stdout == "warm\n"
        other = await backend.create(SandboxSpec(image="busybox", memory_mb=96))
        assert other.id not in pooled  # another spec: a fresh container
        ids = set(labelled(backend))
    assert not (ids & set(labelled_after())), "pool or sandboxes survived aclose"


def labelled_after() -> list[str]:
    import docker as sdk

    client = sdk.from_env()
    try:
        return [c.id for c in client.containers.list(all=True, filters={"label": LABEL})]
    finally:
        client.close()


async def test_an_unknown_image_is_never_pulled(docker: DockerBackend) -> None:
    from libra.errors import SandboxError

    with pytest.raises(SandboxError, match="never pulls"):
        await docker.create(SandboxSpec(image="alpine:3.19"))
    assert not docker.api.images(name="alpine")


def test_auto_picks_docker_when_it_answers_else_bubblewrap(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    need(engine_answers() is None, "no Docker engine")
    assert isinstance(auto(), DockerBackend)
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    if BwrapBackend.available() is None:
        assert isinstance(auto(), BwrapBackend)


async def test_writes_are_capped_and_the_root_is_read_only(docker: DockerBackend) -> None:
    """`disk_mb` caps everything a sandbox writes, together; nothing lands on the host's
    disk; the files survive the restart after a timeout (issue 14, item 4)."""
    spec = SandboxSpec(image="busybox", memory_mb=256, disk_mb=32)
    assert docker.info().get("disk") in ("tmpfs", "quota")  # what this machine (CI) has
    async with await docker.create(spec) as sb:
        r = await sb.exec("head -c 64000000 /dev/zero > big; echo rc=$?; du -m big")
        assert "rc=1" in r.stdout and int(r.stdout.split()[-2]) <= 32, r.stdout
        await sb.exec("rm big && head -c 20000000 /dev/zero > /work/a")
        r = await sb.exec("head -c 20000000 /dev/zero > /tmp/b; echo rc=$?")
        assert "rc=1" in r.stdout  # /tmp shares the cap with the workdir
        if docker.info().get("disk") == "tmpfs":
            r = await sb.exec("echo x > /etc/x; echo rc=$?")
            assert "rc=1" in r.stdout and "Read-only file system" in r.stderr
        (found,) = docker.api.containers(all=True, size=True, filters={"id": sb.id})
        size = found.get("SizeRw") or 0
        assert size < 1_000_000  # the container's layer on the host's disk stayed empty
        assert (await sb.exec("sleep 60", timeout=1)).timed_out  # kill + restart
        assert (await sb.exec("ls -s /work/a")).stdout.split()[0] == "19532"


OWNER = """
import asyncio, sys
from libra.sandboxes.base import SandboxSpec
from libra.sandboxes.docker import DockerBackend

async def main():
    backend = DockerBackend()
    await backend.start()
    sb = await backend.create(SandboxSpec(image="busybox", memory_mb=64))
    await sb.exec("setsid sh -c 'while :; do :; done' >/dev/null 2>&1 &")  # a CPU spinner
    print(sb.id, getattr(backend, "state_dir", "-"), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_containers_die_with_a_killed_owner(tmp_path: Path) -> None:
    """SIGKILL the process that made a sandbox: its container (a CPU spinner inside) is
    removed and its storage released, with no other backend around to reap it (issue 14,
    item 4)."""
    need(engine_answers() is None, "no Docker engine")
    import docker as sdk

    client = sdk.from_env()  # a plain client: no backend, so no reaper, runs here
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    try:
        cid, state = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode().split()
        assert client.api.inspect_container(cid)["State"]["Running"]
        proc.kill()
        await proc.wait()

        def there() -> bool:
            return bool(client.api.containers(all=True, filters={"id": cid}))

        for _ in range(600):  # it goes within a second or two; 60 s before calling it a leak
            if not there():
                break
            await asyncio.sleep(0.1)
        else:
            client.api.remove_container(cid, force=True)
            pytest.fail("the container of a killed owner was still there after 60 s")
        for _ in range(100):
            if state not in Path("/proc/mounts").read_text() and not Path(state).exists():
                break
            await asyncio.sleep(0.1)
        assert state not in Path("/proc/mounts").read_text() and not Path(state).exists()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        client.close()
