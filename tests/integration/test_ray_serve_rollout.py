"""`libra serve-rollout --ray ADDRESS --launch 2`: the service's engines are started and
placed by Ray, one on each CPU node of a local three-node Ray cluster (tests/conftest.py
`ray_cluster`), one service in front. Real engines, real HTTP, the real `arith` env:
a batch is served by both engines; one engine's node is then lost outright and the
engine restarted on a spare node, which serves the next batch; nothing of them is left
once the service stops."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from libra.client import Client
from tests.conftest import grow, shrink
from tests.integration.procs import engine_on, wait_gone
from tests.integration.service_util import Service


@pytest.mark.timeout(400)
def test_serve_rollout_places_its_engines_with_ray(
    tmp_path: Path, ray_cluster: Any, tiny_model: Path
) -> None:
    svc = Service(tmp_path, tiny_model, [], "--launch", "2", "--env", "arith",
                  "--ray", ray_cluster.address)  # fmt: skip
    svc.start(timeout=300)
    try:
        # each engine's node is named on stderr: one engine on each node with a CPU
        placed = re.findall(r"engine (\S+) on Ray node (\S+) at (\S+)", svc.log())
        assert sorted(name for name, _, _ in placed) == ["tp1-0", "tp1-1"], svc.log()
        assert {node for _, node, _ in placed} == {n.node_id for n in ray_cluster.worker_nodes}
        urls = {url for _, _, url in placed}
        pids = [engine_on(int(url.rsplit(":", 1)[1])) for url in urls]
        assert None not in pids, (urls, pids)

        tasks = [{"id": f"t{i}", "question": f"{i} + {i}", "answer": str(2 * i)}
                 for i in range(8)]  # fmt: skip
        with Client(svc.url, reconnect_s=5) as c:
            batch = c.submit("arith", tasks, group_size=2)
            records = list(c.trajectories(batch))
        assert sorted(r.id for r in records) == sorted(
            f"{batch}/{t['id']}/{k}" for t in tasks for k in range(2)
        )
        assert not [r.error for r in records if r.status == "error"]
        served = {t.endpoint for r in records for t in r.turns}
        assert served == urls, (served, urls)  # both engines, through the one service

        # tp1-0's node is lost (its raylet and everything Ray started there: SIGKILL);
        # the engine is restarted on the spare node, the only one with a free CPU.
        (spare,) = grow(ray_cluster, 1)
        _, node_id, lost_url = next(p for p in placed if p[0] == "tp1-0")
        node = next(n for n in ray_cluster.worker_nodes if n.node_id == node_id)
        lost_pid = engine_on(int(lost_url.rsplit(":", 1)[1]))
        ray_cluster.remove_node(node, allow_graceful=False)
        deadline = time.monotonic() + 180
        pattern = r"engine tp1-0 restarted on Ray node (\S+) at (\S+?), serving version 0"
        while not re.search(pattern, svc.log()) and time.monotonic() < deadline:
            time.sleep(0.5)
        m = re.search(pattern, svc.log())
        assert m, svc.log()[-3000:]
        assert m.group(1) == spare.node_id
        assert f"engine tp1-0 at {lost_url} (node {node_id}) lost:" in svc.log()
        assert lost_pid is not None and wait_gone(lost_pid), "the lost node's engine runs on"
        new_url = m.group(2)
        urls.add(new_url)
        with Client(svc.url, reconnect_s=5) as c:
            again = list(c.trajectories(c.submit("arith", tasks, group_size=2)))
        assert len(again) == 2 * len(tasks)
        assert not [r.error for r in again if r.status == "error"]
        served = {t.endpoint for r in again for t in r.turns}
        assert served == urls - {lost_url}, (served, urls)  # the replacement serves
    finally:
        code = svc.stop()
        shrink(ray_cluster)
    assert code == 0, svc.log()[-3000:]

    # the engines stop with the service (their actors and placement groups with them)
    deadline = time.monotonic() + 15
    while any(engine_on(int(u.rsplit(":", 1)[1])) for u in urls) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not [u for u in urls if engine_on(int(u.rsplit(":", 1)[1]))], "engines left running"
