"""Docker-only behaviour: reaping by label, the warm pool, never pulling; and `auto`."""

from __future__ import annotations

import asyncio
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
