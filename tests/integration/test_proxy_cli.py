"""`libra rollout --env agent.py:run` end to end (CLI subprocess, fake vLLM process), the
shipped example agent, and what the proxy answers to requests it cannot serve."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from libra.chat import ChatTokenizer
from libra.endpoints.config import EndpointConfig, SamplingConfig
from libra.endpoints.pool import EndpointPool
from libra.proxy.agent import AgentEnv
from libra.proxy.runner import AgentRunner
from libra.record import Trajectory, read_jsonl
from libra.rollout.batch import run_episodes
from libra.rollout.config import LimitsConfig
from libra.rollout.episode import EpisodeSpec
from libra.routing.base import Bucket, StaticPolicy
from tests.conftest import ROOT
from tests.integration.test_proxy import check_tokens
from tests.integration.test_rollout import run_cli

EXAMPLE = ROOT / "examples" / "openai_agent.py"
SEARCH_QA_TASKS = ROOT / "envs" / "data" / "search_qa.jsonl"


def search_tasks(path: Path, n: int) -> Path:
    """search-qa's first tasks, with the fake model told to search (see tests/fakes)."""
    tasks = [json.loads(line) for line in SEARCH_QA_TASKS.read_text().splitlines()[:n]]
    for t in tasks:
        t["question"] += " DIRECTIVE:search"
    path.write_bytes(b"".join(orjson.dumps(t) + b"\n" for t in tasks))
    return path


def test_example_agent_records_equal_the_native_search_env(
    tmp_path: Path, tiny_model: Path, spawn_fake
) -> None:
    """examples/openai_agent.py through `libra rollout` against `--env search-qa`: same
    prompt, tool, corpus and stop string, so the very same tokens and rewards."""
    url, _ = spawn_fake()
    tasks = search_tasks(tmp_path / "t.jsonl", 6)
    runs = {}
    for name, env in [("agent", f"{EXAMPLE}:run"), ("native", "search-qa")]:
        out = tmp_path / f"{name}.jsonl"
        res = run_cli(
            "rollout", "--env", env, "--tasks", str(tasks), "--group-size", "2",
            "--model", str(tiny_model), "--endpoint", f"tp1={url}", "--out", str(out),
            "--quiet", "--json",
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["status"] == {"ok": 12}
        runs[name] = {r.id.split("/", 1)[1]: r for r in read_jsonl(out)}
    assert runs["agent"].keys() == runs["native"].keys()
    tok = ChatTokenizer(tiny_model)
    for key, r in runs["agent"].items():
        n = runs["native"][key]
        for field in ("prompt_token_ids", "response_token_ids", "loss_mask", "logprobs",
                      "total_tokens", "answer", "reward"):  # fmt: skip
            assert getattr(r, field) == getattr(n, field), field
        # The native tool also reports `info` (the agent runs its own tool: none).
        volatile = {"endpoint": True, "tool_returns": {"__all__": {"latency_s", "info"}}}
        assert [t.model_dump(exclude=volatile) for t in r.turns] == [
            t.model_dump(exclude=volatile) for t in n.turns
        ]
        (call,) = r.turns[0].tool_calls
        assert call.name == "search" and "DIRECTIVE" not in call.arguments["query"]
        assert r.reward_info is not None and r.reward_info["searches"] == 1
        text = tok.decode(r.prompt_token_ids + r.response_token_ids)
        assert f"<answer>{r.answer}</answer>" in text and "<tool_response>\nDoc 1(Title:" in text


def test_example_tasks_ship_with_the_agent(tmp_path: Path, tiny_model: Path, spawn_fake) -> None:
    """Without --tasks the agent's `tasks_file` is used. Unprompted, the fake model calls
    `calculator`, which the agent does not have: its "Error: ..." reply is a tool error."""
    url, _ = spawn_fake()
    out = tmp_path / "o.jsonl"
    res = run_cli(
        "rollout", "--env", f"{EXAMPLE}:run", "--model", str(tiny_model), "--num-tasks", "3",
        "--endpoint", f"tp1={url}", "--out", str(out), "--quiet", "--json",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    first = [json.loads(line)["id"] for line in SEARCH_QA_TASKS.read_text().splitlines()[:3]]
    recs = read_jsonl(out)
    assert sorted(r.task_id for r in recs) == sorted(first)
    for r in recs:
        assert r.status == "ok" and r.reward == 0.0
        (ret,) = r.turns[0].tool_returns
        assert (ret.tool, ret.status) == ("calculator", "error")


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("sync_fn", "is not a libra.Env subclass nor an async agent function"),
        ("run --env-option", "must accept (task, client"),
    ],
)
def test_bad_agent_is_one_clear_line(
    tmp_path: Path, tiny_model: Path, target: str, message: str
) -> None:
    agent = tmp_path / "a.py"
    agent.write_text("def sync_fn(task, client):\n    return 1.0\n\n"
                     "async def run(task, client):\n    return 1.0\n")  # fmt: skip
    cfg = tmp_path / "c.toml"
    cfg.write_text("[env_options]\nwhatever = 1\n" if "option" in target else "")
    res = run_cli(
        "rollout", str(cfg), "--env", f"{agent}:{target.split(maxsplit=1)[0]}", "--model", str(tiny_model),
        "--endpoint", "tp1=http://127.0.0.1:9", "--out", str(tmp_path / "o.jsonl"), "--quiet",
    )  # fmt: skip
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and message in lines[0], res.stderr


# --- the proxy's answers, with the SDK as the client -----------------------------------
def _nested(levels: int) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for _ in range(levels - 1):
        doc = {"type": "object", "properties": {"x": doc}}
    return doc


async def probe(task: dict[str, Any], client: openai.AsyncOpenAI) -> dict[str, Any]:
    """An agent that tries what the proxy refuses, then makes one good call."""
    seen: dict[str, Any] = {}
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    for name, kw in [
        ("n", {"n": 2}),
        ("tool_choice", {"tool_choice": "required", "tools": [{"type": "function",
                         "function": {"name": "f", "parameters": {}}}]}),
        ("image", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]}),
        ("deep", {"tools": [{"type": "function", "function": {"name": "f",
                  "parameters": _nested(300)}}]}),
    ]:  # fmt: skip
        try:
            await client.chat.completions.create(**{"model": "m", "messages": msgs, **kw})
        except openai.BadRequestError as e:
            seen[name] = (e.status_code, str(e))
    seen["models"] = [m.id for m in (await client.models.list()).data]
    # The same answers over real HTTP, from a client of the agent's own.
    over_http = openai.AsyncOpenAI(base_url=str(client.base_url), api_key=client.api_key)
    seen["http_models"] = [m.id for m in (await over_http.models.list()).data]
    try:
        await over_http.chat.completions.create(model="m", messages=msgs, n=2)
    except openai.BadRequestError as e:
        seen["http_n"] = (e.status_code, str(e))
    try:
        await over_http.with_options(api_key="wrong").models.list()
    except openai.AuthenticationError as e:
        seen["http_key"] = e.status_code
    await over_http.close()
    bad_key = client.with_options(api_key="wrong")
    try:
        await bad_key.chat.completions.create(model="m", messages=msgs)
    except openai.AuthenticationError as e:
        seen["key"] = e.status_code
    elsewhere = client.with_options(base_url=str(client.base_url).replace("/episodes/", "/x/"))
    try:
        await elsewhere.chat.completions.create(model="m", messages=msgs)
    except openai.NotFoundError as e:
        seen["path"] = e.status_code
    reply = await client.chat.completions.create(model="m", messages=msgs, logprobs=True)
    seen["logprobs"] = [(t.token, t.logprob) for t in reply.choices[0].logprobs.content]
    seen["usage"] = reply.usage.model_dump()
    return {"reward": 0.5, **{k: json.dumps(v) for k, v in seen.items()}}


REPLIED: list[str] = []


async def hang(task: dict[str, Any], client: openai.AsyncOpenAI) -> float:
    await client.chat.completions.create(model="m", messages=[
        {"role": "user", "content": "What is 3 + 4?"}])  # fmt: skip
    REPLIED.append(str(client.base_url))
    await asyncio.Event().wait()
    return 1.0


def make_runner(model: Path, url: str, fn: Any, pool: EndpointPool) -> AgentRunner:
    return AgentRunner(agent=AgentEnv(fn), env_name="probe", tokenizer=ChatTokenizer(model),
                       pool=pool, policy=StaticPolicy(pool.buckets), sampling=SamplingConfig(),
                       limits=LimitsConfig(), max_context=4096)  # fmt: skip


def spec(i: int = 0) -> EpisodeSpec:
    return EpisodeSpec(id=f"b/t{i}/0", batch_id="b", task_id=f"t{i}", group_id=f"b/t{i}",
                       task={})  # fmt: skip


async def test_the_proxy_refuses_clearly_and_serves_the_rest(tiny_model: Path, fake_vllm) -> None:
    bucket = Bucket("tp1", 1, 4096)
    pool = EndpointPool([(bucket, [fake_vllm.url])], EndpointConfig())
    async with pool, make_runner(tiny_model, fake_vllm.url, probe, pool) as runner:
        rec = await runner.run(spec())
    assert rec.status == "ok" and rec.reward == 0.5, rec.error
    info = {k: json.loads(v) for k, v in (rec.reward_info or {}).items()}
    assert info["n"][0] == 400 and "`n` must be 1" in info["n"][1]
    assert info["tool_choice"][0] == 400 and "tool_choice 'required'" in info["tool_choice"][1]
    assert "'image_url' is not supported" in info["image"][1]
    assert info["deep"][0] == 400 and "`tools` nests lists and objects more" in info["deep"][1]
    assert info["models"] == ["libra-policy"] and info["key"] == 401 and info["path"] == 404
    assert info["http_models"] == ["libra-policy"] and info["http_key"] == 401
    assert info["http_n"][0] == 400 and "`n` must be 1" in info["http_n"][1]
    (turn,) = rec.turns  # refused requests leave no trace on the record
    assert [lp for _, lp in info["logprobs"]] == rec.logprobs[: turn.model_tokens]
    assert info["usage"]["prompt_tokens"] == rec.prompt_tokens
    assert info["usage"]["completion_tokens"] == turn.model_tokens
    check_tokens(rec, fake_vllm.fake.requests)


async def test_cancelled_batch_records_aborted_agent_episodes(tiny_model: Path, fake_vllm) -> None:
    bucket = Bucket("tp1", 1, 4096)
    got: list[Trajectory] = []
    pool = EndpointPool([(bucket, [fake_vllm.url])], EndpointConfig())
    async with pool, make_runner(tiny_model, fake_vllm.url, hang, pool) as runner:
        batch = asyncio.create_task(
            run_episodes(runner, [spec(i) for i in range(3)], concurrency=3, emit=got.append)
        )
        REPLIED.clear()
        while len(REPLIED) < 3:  # every agent has its first reply
            await asyncio.sleep(0.01)
        batch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await batch
        assert runner.server.sessions == {}  # nothing left open
    assert sorted(r.id for r in got) == [f"b/t{i}/0" for i in range(3)]
    for r in got:
        assert (r.status, r.error, len(r.turns)) == ("aborted", "cancelled", 1)
        check_tokens(r, fake_vllm.fake.requests)
