"""`POST /v1/weights` against the embedded engine the service launches itself: the
checkpoint is loaded, later turns and batches carry the new version, generations change;
a failed load leaves versions alone and says why (502)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

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


async def test_weight_update_reaches_the_engine_and_stamps_later_turns(
    tmp_path: Path, tiny_model: Path, services: list[Service]
) -> None:
    from libra.engine.model_maker import make_model

    other = make_model(tmp_path / "ckpt-s1", seed=1)
    svc = Service(tmp_path, tiny_model, [], "--launch", "1", "--env", "arith",
                  config='[sampling]\ntemperature = 0.0\nmax_tokens = 24\n')  # fmt: skip
    services.append(svc)
    svc.start(timeout=240)
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

        with pytest.raises(ServiceError, match="HTTP 502") as err:
            await c.update_weights(4, str(tmp_path / "no-such-checkpoint"))
        assert "did not load it" in str(err.value)
        again = [r async for r in c.trajectories(await c.submit("arith", tasks[:1]))]
        assert {t.policy_version for r in again for t in r.turns} == {3}
