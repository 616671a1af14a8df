"""`POST /v1/weights` against the embedded engine the service launches itself: the
checkpoint is loaded, later turns and batches carry the new version, generations change;
a folder that is not a checkpoint is refused before any endpoint is touched (400)
and leaves versions alone."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from libra.envs.arith import make_tasks

from libra.client import AsyncClient, ServiceError
from tests.integration.service_util import Service


@pytest.fixture
def services() -> Iterator[list[Service]]:
    made: list[Service] = []
    yield made
    for s in made:
        s.close()


def greedy_service(
    tmp_path: Path, tiny_model: Path, services: list[Service]
) -> tuple[Service, Path]:
    """A started service with one launched engine, greedy sampling, and another
    checkpoint (`ckpt-s1`, other weights) to load into it."""
    from libra.engine.model_maker import make_model

    other = make_model(tmp_path / "ckpt-s1", seed=1)
    svc = Service(tmp_path, tiny_model, [], "--launch", "1", "--env", "arith",
                  config='[sampling]\ntemperature = 0.0\nmax_tokens = 24\n')  # fmt: skip
    services.append(svc)
    svc.start(timeout=240)
    return svc, other


async def test_weight_update_reaches_the_engine_and_stamps_later_turns(
    tmp_path: Path, tiny_model: Path, services: list[Service]
) -> None:
    svc, other = greedy_service(tmp_path, tiny_model, services)
    tasks = make_tasks(4, seed=5)
    async with AsyncClient(svc.url) as c:
        before = [r async for r in c.trajectories(await c.submit("arith", tasks))]
        assert {t.policy_version for r in before for t in r.turns} == {0}
        assert {r.step for r in before} == {0}

        doc = await c.update_weights(3, str(other))
        (ep,) = doc["endpoints"].values()
        assert ep["status"] == "ok" and ep["kind"] == "embedded", doc

        after = [r async for r in c.trajectories(await c.submit("arith", tasks))]
        assert {t.policy_version for r in after for t in r.turns} == {3}
        assert {r.step for r in after} == {3}  # a batch's default step: the loaded version
        # Greedy generations now come from the other checkpoint.
        first = {r.task_id: r.response_token_ids for r in before}
        assert any(first[r.task_id] != r.response_token_ids for r in after)

        with pytest.raises(ServiceError, match="HTTP 400") as err:  # before any endpoint
            await c.update_weights(4, str(tmp_path / "no-such-checkpoint"))
        assert "is not a checkpoint (no such folder)" in str(err.value)
        (tmp_path / "empty").mkdir()
        with pytest.raises(ServiceError, match="HTTP 400") as err:
            await c.update_weights(4, str(tmp_path / "empty"))
        assert "is not a checkpoint (no config.json)" in str(err.value)
        again = [r async for r in c.trajectories(await c.submit("arith", tasks[:1]))]
        assert {t.policy_version for r in again for t in r.turns} == {3}


async def test_weights_broadcast_from_the_clients_memory(
    tmp_path: Path, tiny_model: Path, services: list[Service]
) -> None:
    """`broadcast_weights`: the trainer's tensors go from its process straight into the
    service's engine (no folder): later turns carry the version and generate as the
    folder of the same weights does; a sender on another host is refused (403)."""
    from safetensors.torch import load_file

    svc, other = greedy_service(tmp_path, tiny_model, services)
    tasks = make_tasks(4, seed=5)
    tensors = load_file(str(other / "model.safetensors"))
    async with AsyncClient(svc.url) as c:
        before = [r async for r in c.trajectories(await c.submit("arith", tasks))]
        doc = await c.broadcast_weights(2, lambda: tensors)
        (ep,) = doc["endpoints"].values()
        assert ep["status"] == "ok" and ep["kind"] == "embedded", doc
        by_cast = [r async for r in c.trajectories(await c.submit("arith", tasks))]
        assert {t.policy_version for r in by_cast for t in r.turns} == {2}

        await c.update_weights(3, str(other))  # the same weights from their folder
        by_disk = [r async for r in c.trajectories(await c.submit("arith", tasks))]
        cast = {r.task_id: r.response_token_ids for r in by_cast}
        assert all(cast[r.task_id] == r.response_token_ids for r in by_disk)
        first = {r.task_id: r.response_token_ids for r in before}
        assert any(first[r.task_id] != r.response_token_ids for r in by_disk)

        with pytest.raises(ServiceError, match="HTTP 403") as err:
            await c.update_weights(4, sender="http://10.1.2.3:9000")
        assert "requesting host" in str(err.value)
        with pytest.raises(ServiceError, match="HTTP 502") as err:  # nobody listens there
            await c.update_weights(4, sender="http://127.0.0.1:9")
        assert "start the sender" in str(err.value)
    async with aiohttp.ClientSession() as s:  # both sources at once: one clear 400
        body = {"version": 4, "path": str(other), "sender": "http://127.0.0.1:9"}
        async with s.post(f"{svc.url}/v1/weights", json=body) as r:
            assert r.status == 400 and "exactly one of path" in await r.text()


async def test_a_restarted_service_loads_the_last_folder_into_its_launched_engines(
    tmp_path: Path, tiny_model: Path, services: list[Service]
) -> None:
    """After a crash (SIGKILL) and a restart on the same spool, the engine the service
    launches again is given the last update's folder before it serves: later turns are
    stamped with that version and generate as they did before the crash. A folder the
    config no longer allows is refused then, as a request for it would be."""
    svc, other = greedy_service(tmp_path, tiny_model, services)
    tasks = make_tasks(4, seed=5)
    async with AsyncClient(svc.url) as c:
        base = [r async for r in c.trajectories(await c.submit("arith", tasks))]
        await c.update_weights(3, str(other))
        loaded = [r async for r in c.trajectories(await c.submit("arith", tasks))]
    svc.kill()
    svc.start(timeout=240)
    assert re.search(r"version 3 from \S+ckpt-s1 loaded into 1 of 1 launched engines", svc.log())
    async with AsyncClient(svc.url) as c:
        again = [r async for r in c.trajectories(await c.submit("arith", tasks))]
    assert {t.policy_version for r in again for t in r.turns} == {3}
    assert {r.step for r in again} == {3}
    answers = {r.task_id: r.response_token_ids for r in loaded}
    assert all(answers[r.task_id] == r.response_token_ids for r in again)
    first = {r.task_id: r.response_token_ids for r in base}
    assert any(first[r.task_id] != r.response_token_ids for r in again)

    # Restarted with weights_dirs that no longer hold that folder: the stored path is
    # checked again, refused, and the engine serves the base model at version 0.
    svc.kill()
    svc.args += ["--weights-dir", str(tmp_path / "elsewhere")]
    svc.start(timeout=240)
    assert "the last update's folder is refused now" in svc.log()
    async with AsyncClient(svc.url) as c:
        refused = [r async for r in c.trajectories(await c.submit("arith", tasks))]
    assert {t.policy_version for r in refused for t in r.turns} == {0}
    assert all(first[r.task_id] == r.response_token_ids for r in refused)
