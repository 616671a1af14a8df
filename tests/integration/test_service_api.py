"""`libra serve-rollout` HTTP API against a real service process: auth, validation with
reasons, idempotent submit, group streams and cursors, cancel, slow readers, fairness,
metrics. Endpoints are fake vLLM servers (tests/fakes); everything of Libra's is real."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from libra.envs.arith import make_tasks

from libra.client import AsyncClient, ServiceError
from tests.conftest import ROOT
from tests.integration.service_util import Service

TOKEN = "api-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def services() -> Iterator[list[Service]]:
    made: list[Service] = []
    yield made
    for s in made:
        s.close()


async def call(method: str, url: str, body: Any = None, raw: bytes | None = None,
               headers: dict[str, str] | None = None) -> tuple[int, Any]:  # fmt: skip
    data = raw if raw is not None else (orjson.dumps(body) if body is not None else None)
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, url, data=data, headers=AUTH if headers is None else headers) as r,
    ):
        text = await r.read()
        try:
            return r.status, orjson.loads(text)
        except orjson.JSONDecodeError:
            return r.status, text.decode()


async def test_token_validation_and_idempotent_submit(
    tmp_path: Path, tiny_model: Path, spawn_fake, services: list[Service]
) -> None:
    url, _ = spawn_fake()
    svc = Service(tmp_path, tiny_model, [url], "--token", TOKEN, "--env", "arith")
    services.append(svc)
    base = svc.start()
    tasks = make_tasks(3)
    ok_body = {"env": "arith", "tasks": tasks, "group_size": 2, "batch_id": "b1"}

    # 401 without the token or with a wrong one, on every path but /healthz.
    for path in ("/v1/rollouts/b1", "/metrics", "/v1/rollouts/b1/trajectories"):
        status, doc = await call("GET", base + path, headers={})
        assert status == 401 and "missing bearer token" in doc["error"], (path, doc)
    status, doc = await call("POST", base + "/v1/rollouts", ok_body,
                             headers={"Authorization": "Bearer nope"})  # fmt: skip
    assert status == 401 and "wrong bearer token" in doc["error"]
    assert (await call("GET", base + "/healthz", headers={}))[0] == 200

    # 400 with a reason for malformed bodies; unknown envs name the hosted ones.
    bad: list[tuple[Any, str]] = [
        (b"{not json", "the body is not valid JSON"),
        ([1, 2], "the body must be a JSON object, got list"),
        ({"tasks": tasks}, "env: Field required"),
        ({"env": "arith", "tasks": []}, "tasks: List should have at least 1 item"),
        ({"env": "nope", "tasks": tasks}, "unknown env 'nope'; this service hosts: arith"),
        ({**ok_body, "group_size": 0}, "group_size: Input should be greater than or equal to 1"),
        ({**ok_body, "sampling": {"temprature": 1}}, "sampling.temprature: unknown key"),
        ({**ok_body, "sampling": {"top_p": 2}}, "sampling.top_p: Input should be less than"),
        ({**ok_body, "batch_id": "../etc"}, "batch_id: Value error, must be 1-128 characters"),
        ({**ok_body, "colour": "red"}, "colour: unknown key"),
        ({"env": "arith", "tasks": [{"q": 1}]}, "tasks[0]: the env cannot build a prompt"),
        ({"env": "arith", "tasks": [tasks[0], tasks[0]]}, "tasks[1] repeats the id"),
    ]
    for body, reason in bad:
        raw = body if isinstance(body, bytes) else None
        status, doc = await call("POST", base + "/v1/rollouts", None if raw else body, raw=raw)
        assert status == 400 and reason in doc["error"], (body, doc)
    status, doc = await call("GET", base + "/v1/rollouts/b1/trajectories")
    assert status == 404 and "no batch 'b1'" in doc["error"]

    # Submit is idempotent by batch_id; a different body under the same id is a conflict.
    status, doc = await call("POST", base + "/v1/rollouts", ok_body)
    assert status == 201 and doc == {"batch_id": "b1", "created": True, "episodes": 6}
    status, doc = await call("POST", base + "/v1/rollouts", ok_body)
    assert status == 200 and doc == {"batch_id": "b1", "created": False, "episodes": 6}
    status, doc = await call("POST", base + "/v1/rollouts", {**ok_body, "group_size": 3})
    assert status == 409 and "exists with a different request" in doc["error"]
    for query, reason in [("after=x", "after='x'"), ("after=-2", "after='-2'"),
                          ("unit=task", "unit='task'")]:  # fmt: skip
        status, doc = await call("GET", base + f"/v1/rollouts/b1/trajectories?{query}")
        assert status == 400 and reason in doc["error"], doc

    async with AsyncClient(base, token=TOKEN) as c:
        recs = [r async for r in c.trajectories("b1")]
        assert sorted(r.id for r in recs) == sorted(
            f"b1/{t['id']}/{k}" for t in tasks for k in range(2)
        )
        with pytest.raises(ServiceError, match="HTTP 400: unknown env 'math'"):
            await c.submit("math", tasks)
    assert (await call("GET", base + "/v1/rollouts/b1"))[1]["state"] == "done"

    # Metrics: Prometheus text with the batch's episodes and both endpoints' health.
    status, text = await call("GET", base + "/metrics")
    assert status == 200
    assert 'libra_episodes_finished_total{state="ok"} 6' in text
    assert f'libra_endpoint_up{{bucket="tp1",url="{url}"}} 1' in text
    assert "libra_model_tokens_total" in text and 'libra_episodes{state="queued"} 0' in text
    # ... that Prometheus' own parser reads: every family typed, the samples as above.
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["libra_episodes_finished"].type == "counter"
    assert {s.labels["state"]: s.value for s in families["libra_episodes_finished"].samples
            if s.name.endswith("_total")}["ok"] == 6  # fmt: skip
    up = families["libra_endpoint_up"].samples
    assert {(s.labels["bucket"], s.labels["url"], s.value) for s in up} >= {("tp1", url, 1.0)}
    # (a family may have no samples: libra_batch_queued while no batch is active)
    assert {f.type for f in families.values()} == {"counter", "gauge"}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--host", "0.0.0.0"], "refusing to listen on 0.0.0.0 without a token"),
        (["--port", "{busy}"], "cannot listen on 127.0.0.1:{busy}"),
        (["--env", "nope"], "unknown env 'nope'; known:"),
        (["{config}"], "spool.fsnyc: unknown key"),
        (["--fsync", "sometimes"], "argument --fsync: invalid choice"),
    ],
)
def test_bad_start_is_one_clear_line(
    tmp_path: Path, tiny_model: Path, extra: list[str], message: str
) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = str(busy.getsockname()[1])
    config = tmp_path / "bad.toml"
    config.write_text('[spool]\nfsnyc = "always"\n')
    args = [a.replace("{busy}", port).replace("{config}", str(config)) for a in extra]
    res = subprocess.run(
        [sys.executable, "-m", "libra", "serve-rollout", "--model", str(tiny_model),
         "--endpoint", "tp1=http://127.0.0.1:9", "--spool", str(tmp_path / "spool"), *args],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
    )  # fmt: skip
    busy.close()
    assert res.returncode == 2, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("libra: error:") and message.replace("{busy}", port) in line, line


@pytest.mark.parametrize("workers", [1, 2])
async def test_groups_cursor_cancel_slow_reader_and_fairness(
    tmp_path: Path, tiny_model: Path, spawn_fake, services: list[Service], workers: int
) -> None:
    """Also with `--workers 2` (#22): episodes run in two worker processes, and a client
    sees the same."""
    url, _ = spawn_fake(delay=0.05)
    svc = Service(tmp_path, tiny_model, [url], "--concurrency", "4", "--workers", str(workers))
    services.append(svc)
    base = svc.start()
    async with AsyncClient(base) as c:
        # A big batch, then a small one: the small one gets its fair share of the 4 slots
        # at once and finishes long before the big one.
        big = await c.submit("arith", make_tasks(40, seed=1), group_size=4, batch_id="big")
        # A reader that opens the big batch's stream and never reads: it must not stall.
        host, port = base.removeprefix("http://").split(":")
        stalled = socket.create_connection((host, int(port)))
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.sendall(f"GET /v1/rollouts/{big}/trajectories HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        small = await c.submit("arith", make_tasks(4, seed=2), group_size=2, batch_id="small")
        groups = [g async for g in c.groups(small)]
        big_status = await c.status(big)
        assert big_status["finished"] < 160 - 40, big_status  # the small one did not wait
        assert len(groups) == 4 and all(len(g.records) == 2 for g in groups)
        for g in groups:
            assert {r.group_id for r in g.records} == {g.group_id}
            assert g.group_id == f"small/{g.task_id}" and g.seq == max(r.seq for r in g.records)
        assert sorted(g.seq for g in groups) == [g.seq for g in groups]
        # Resume from a cursor: only groups completed after it.
        later = [g async for g in c.groups(small, after=groups[1].seq)]
        assert [g.group_id for g in later] == [g.group_id for g in groups[2:]]
        eps = [r async for r in c.trajectories(small, after=3)]
        assert [r.seq for r in eps] == [4, 5, 6, 7]

        # Cancel the big batch: queued episodes and running ones end `aborted`; the
        # stream still carries every episode exactly once and ends.
        doc = await c.cancel(big)
        assert doc["state"] == "cancelled"
        recs = [r async for r in c.trajectories(big)]
        assert Counter(r.id for r in recs).most_common(1)[0][1] == 1 and len(recs) == 160
        statuses = Counter(r.status for r in recs)
        assert statuses["aborted"] > 0 and statuses["ok"] + statuses["aborted"] == 160
        aborted = Counter(r.error for r in recs if r.status == "aborted")
        assert set(aborted) == {"cancelled", "cancelled before it started"}, aborted
        assert aborted["cancelled"] <= 4  # the running ones (concurrency 4), cut mid-episode
        for r in recs:
            if r.error == "cancelled":  # partial: what it had when it was cut
                assert r.prompt_tokens == len(r.prompt_token_ids)
                assert r.total_tokens == r.prompt_tokens + len(r.response_token_ids)
            if r.error == "cancelled before it started":
                assert not r.prompt_token_ids and not r.turns
        final = await c.status(big)
        assert final["counts"]["aborted"] == statuses["aborted"] and final["finished"] == 160
        assert (await c.cancel(big))["state"] == "cancelled"  # cancel is idempotent
        stalled.close()
        await asyncio.sleep(0)


async def test_batch_weights_split_the_slots_and_survive_a_restart(
    tmp_path: Path, tiny_model: Path, spawn_fake, services: list[Service]
) -> None:
    """A batch submitted with `weight` 3 beside a weight-1 one holds three of every four
    episode slots while both have episodes waiting (`libra.service.fair`); a weight above
    the service's `max_batch_weight` is refused naming it; the weight is stored with the
    batch and kept across a restart."""
    url, _ = spawn_fake(delay=0.05)
    svc = Service(tmp_path, tiny_model, [url], "--concurrency", "4",
                  config="max_batch_weight = 4\n")  # fmt: skip
    services.append(svc)
    base = svc.start()
    async with AsyncClient(base) as c:
        with pytest.raises(
            ServiceError, match=r"HTTP 400: weight 5 is above .*max_batch_weight \(4\)"
        ):
            await c.submit("arith", make_tasks(1, seed=0), weight=5)
        low = await c.submit("arith", make_tasks(40, seed=1), group_size=4, batch_id="low")
        high = await c.submit("arith", make_tasks(40, seed=2), group_size=4, batch_id="high",
                              weight=3)  # fmt: skip
        before = (await c.status(low))["finished"]  # what `low` did alone (a loaded machine)
        assert (await c.status(high))["weight"] == 3 and (await c.status(low))["weight"] == 1
        recs = [r async for r in c.trajectories(high)]
        assert len(recs) == 160
        # With equal weights `low` would have finished about as many as `high` (160)
        # meanwhile; at 3:1 it had one slot in four: about a third of `high`'s (54 here).
        done_low = (await c.status(low))["finished"] - before
        assert done_low < 100, (done_low, before)
        left = await c.submit("arith", make_tasks(40, seed=3), group_size=4, batch_id="left",
                              weight=2.5)  # fmt: skip
    svc.kill()
    svc.start()
    async with AsyncClient(base) as c:
        assert (await c.status(left))["weight"] == 2.5  # stored with the batch
        assert len([r async for r in c.trajectories(left)]) == 160
        assert len([r async for r in c.trajectories(low)]) == 160


async def test_a_full_queue_answers_429_and_the_client_submits_once_there_is_room(
    tmp_path: Path, tiny_model: Path, spawn_fake, services: list[Service]
) -> None:
    """With `max_queued_episodes` waiting, a submit that would queue more is a 429 naming
    the limit (the service's memory stays bounded whatever clients send); the client
    retries it and gets in once enough of the queue has started."""
    url, _ = spawn_fake(delay=0.05)
    svc = Service(tmp_path, tiny_model, [url], "--concurrency", "1",
                  config="max_queued_episodes = 6\n")  # fmt: skip
    services.append(svc)
    base = svc.start()
    async with AsyncClient(base, reconnect_s=0) as impatient, AsyncClient(base) as c:
        first = await c.submit("arith", make_tasks(5, seed=1), group_size=4)  # 20 > 6: alone
        with pytest.raises(ServiceError) as err:
            await impatient.submit("arith", make_tasks(1, seed=2), group_size=4)
        assert err.value.status == 429 and "above this service's max_queued_episodes (6)" in str(
            err.value
        )
        second = await c.submit("arith", make_tasks(1, seed=2), group_size=4)  # retried
        # let in once at most 2 of the first batch's 20 waited (and 1 ran): 17 had finished
        assert (await c.status(first))["finished"] >= 17
        assert len([r async for r in c.trajectories(second)]) == 4
        assert len([r async for r in c.trajectories(first)]) == 20


@pytest.mark.parametrize("workers", [1, 2])
async def test_an_openai_sdk_agent_is_served_like_a_native_env(
    tmp_path: Path, tiny_model: Path, spawn_fake, services: list[Service], workers: int
) -> None:
    """`--env NAME=agent.py:run` (an agent function behind the OpenAI-compatible proxy)
    next to a native env in the same service; with `--workers 2` each worker runs its
    own proxy (#22)."""
    from tests.integration.test_proxy import AGENT

    agent = tmp_path / "calc_agent.py"
    agent.write_text(AGENT)
    url, _ = spawn_fake()
    svc = Service(tmp_path, tiny_model, [url], "--env", f"calc={agent}:run", "--env", "arith",
                  "--workers", str(workers))  # fmt: skip
    services.append(svc)
    base = svc.start()
    tasks = [{"id": f"q{i}", "question": f"What is {i} * 3 + 1?", "answer": str(i * 3 + 1)}
             for i in range(4)]  # fmt: skip
    async with AsyncClient(base) as c:
        agent_batch = await c.submit("calc", tasks, group_size=2)
        native_batch = await c.submit("arith", tasks, group_size=2)
        agent_recs = [r async for r in c.trajectories(agent_batch)]
        native_recs = [r async for r in c.trajectories(native_batch)]
        assert (await c.status(agent_batch))["state"] == "done"
    assert len(agent_recs) == len(native_recs) == 8
    for r in agent_recs:
        assert r.status == "ok" and r.reward == 1.0 and r.env == "calc", r.error
        assert [len(t.tool_returns) for t in r.turns] == [1, 0]
        assert r.turns[0].tool_returns[0].tool == "calculator"
        assert sum(r.loss_mask) == r.model_tokens > 0
    assert {r.status for r in native_recs} == {"ok"}
