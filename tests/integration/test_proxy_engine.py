"""The example agent against a real inference server: `libra serve-engine` (the tiny
model, seeded sampling) as a subprocess on loopback, through the proxy, compared with the
native `search-qa` env on the same tasks and seeds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from libra.envs.search_qa import SYSTEM
from libra.tools.search import search

from libra.chat import ChatTokenizer
from libra.endpoints.config import BucketConfig
from libra.record import read_jsonl
from libra.rollout import rollout
from tests.conftest import ROOT, serve_engine
from tests.integration.test_rollout import cfg

EXAMPLE = ROOT / "examples" / "openai_agent.py"


@pytest.fixture
def engine(tiny_model: Path) -> Iterator[str]:
    with serve_engine(tiny_model, timeout=120) as url:
        yield url


async def test_example_agent_on_the_embedded_engine_matches_native(
    tmp_path: Path, tiny_model: Path, engine: str
) -> None:
    lines = (ROOT / "envs" / "data" / "search_qa.jsonl").read_text().splitlines()[:3]
    tasks = tmp_path / "t.jsonl"
    tasks.write_text("\n".join(lines) + "\n")
    runs = {}
    for name, env in [("agent", f"{EXAMPLE}:run"), ("native", "search-qa")]:
        c = cfg(tmp_path, tiny_model, [BucketConfig(name="tp1", endpoints=[engine])],
                env=env, tasks=str(tasks), group_size=2, concurrency=1,
                out=str(tmp_path / f"{name}.jsonl"),
                sampling={"max_tokens": 24, "seed": 3})  # fmt: skip
        await rollout(c, progress=False)
        runs[name] = {r.id.split("/", 1)[1]: r for r in read_jsonl(c.out)}
    tok = ChatTokenizer(tiny_model)
    assert len(runs["agent"]) == 6 and runs["agent"].keys() == runs["native"].keys()
    for key, r in runs["agent"].items():
        n = runs["native"][key]
        assert r.status in ("ok", "truncated"), r.error
        assert r.turns and all(t.endpoint == engine for t in r.turns)
        resp = r.response_token_ids
        assert len(resp) == len(r.loss_mask) == len(r.logprobs) and r.total_tokens > len(resp)
        first = r.turns[0]
        model = slice(0, first.model_tokens)
        assert r.loss_mask[model] == [1] * first.model_tokens
        assert all(lp <= 0.0 for lp in r.logprobs[model])
        # The prompt is the template's render of what the agent sent...
        msgs = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Question: {_question(lines, r.task_id)}"}]  # fmt: skip
        assert r.prompt_token_ids == tok.prompt_ids(msgs, [search.schema])
        # ...and with the same prompt and seed the engine sampled the native env's first
        # turn: the proxy changes nothing on the way.
        assert r.prompt_token_ids == n.prompt_token_ids
        assert resp[model] == n.response_token_ids[model] and r.logprobs[model] == n.logprobs[model]


def _question(lines: list[str], task_id: str) -> str:
    for line in lines:
        task = orjson.loads(line)
        if task["id"] == task_id:
            return str(task["question"])
    raise KeyError(task_id)
