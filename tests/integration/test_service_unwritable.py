"""An env's reward info nested 253 levels deep passed the check that makes reward info
JSON-safe (orjson writes 254 levels) and, one level deeper inside the record, left a
record the spool could not write: the exception left the spool's write, and the
service's episode task group does not survive one: every batch stopped (with rollout
workers, the worker died packing it, three in a row). Now the too-deep value is a note
on the record, which keeps its tokens; a record that still cannot be written is
replaced by an `error` record of its episode (`tests/unit/test_spool.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from libra.envs.arith import make_tasks

from libra.client import AsyncClient
from tests.integration.service_util import Service

ENV = '''
from libra.envs.arith import Arith


class DeepInfo(Arith):
    """Arith whose reward info is nested 253 levels deep for tasks marked `deep`."""

    async def reward(self, task, trajectory):
        info = 1
        for _ in range(253 if task.get("deep") else 3):
            info = [info]
        return 0.5, {"trace": info}
'''


@pytest.mark.parametrize("workers", [1, 2])
async def test_reward_info_too_deep_to_write_is_noted_and_the_service_goes_on(
    tmp_path: Path, tiny_model: Path, spawn_fake, workers: int
) -> None:
    (tmp_path / "deep_env.py").write_text(ENV)
    url, _ = spawn_fake()
    svc = Service(tmp_path, tiny_model, [url], "--env", f"deep={tmp_path}/deep_env.py:DeepInfo",
                  "--workers", str(workers))  # fmt: skip
    base = svc.start()
    try:
        async with AsyncClient(base) as c:
            tasks = [{**t, "deep": i % 2 == 1} for i, t in enumerate(make_tasks(4, seed=0))]
            recs = {r.task_id: r async for r in c.trajectories(await c.submit("deep", tasks))}
            assert len(recs) == 4
            for i, t in enumerate(tasks):
                r = recs[t["id"]]
                assert r.status != "error" and r.reward == 0.5 and r.response_token_ids, r.error
                assert r.reward_info == {
                    "trace": "<a list nested more than 64 levels deep, not kept>" if i % 2
                    else [[[1]]]
                }  # fmt: skip
            again = [r async for r in c.trajectories(await c.submit("deep", make_tasks(2, seed=1)))]
            assert len(again) == 2 and all(r.status != "error" for r in again)
    finally:
        svc.close()
