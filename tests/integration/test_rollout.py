"""`libra rollout` end to end against fake vLLM servers on loopback (real HTTP, real
tokenizer, real envs and tools; only the model is scripted, see tests/fakes)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from libra.chat import ChatTokenizer
from libra.endpoints.config import BucketConfig, EndpointConfig
from libra.record import Trajectory, read_jsonl
from libra.rollout import RolloutConfig, rollout
from libra.routing.base import Decision
from tests.conftest import ROOT

USER_ENV = '''
import libra

@libra.tool
async def calculator(expression: str) -> str:
    """Evaluate an expression."""
    if "DIRECTIVE" in expression:
        raise ValueError("no directives")
    return str(eval(expression, {"__builtins__": {}}))

class Adder(libra.Env):
    tools = [calculator]
    max_turns = 3

    def prompt(self, task):
        return [{"role": "user", "content": task["question"]}]

    async def reward(self, task, trajectory):
        return float(trajectory.answer == task["answer"])
'''


def cfg(tmp_path: Path, model: Path, buckets: list[BucketConfig], **kw: Any) -> RolloutConfig:
    base: dict[str, Any] = {
        "model": str(model),
        "out": str(tmp_path / "out.jsonl"),
        "buckets": buckets,
        "endpoint": EndpointConfig(backoff_s=0.01, health_interval_s=0.1, down_wait_s=2),
    }
    base.update(kw)
    return RolloutConfig(**base)


def check_alignment(rec: Trajectory, served: list[dict[str, Any]], tok: ChatTokenizer) -> None:
    """response ids = what the endpoint generated (mask 1, its logprobs) + appended
    tool/template tokens (mask 0, logprob 0), turn offsets included."""
    n = len(rec.response_token_ids)
    assert len(rec.loss_mask) == n == len(rec.logprobs)
    assert rec.total_tokens == rec.prompt_tokens + n == len(rec.prompt_token_ids) + n
    by_prompt = {tuple(r["prompt"]): r["token_ids"] for r in served}
    context = list(rec.prompt_token_ids)
    for turn in rec.turns:
        assert context == rec.prompt_token_ids + rec.response_token_ids[: turn.start]
        generated = by_prompt[tuple(context)]
        seg = slice(turn.start, turn.start + turn.model_tokens)
        assert rec.response_token_ids[seg] == generated
        assert rec.loss_mask[seg] == [1] * turn.model_tokens
        assert rec.logprobs[seg] == [-((t * 7919) % 997) / 1000.0 for t in generated]
        tool = slice(seg.stop, seg.stop + turn.tool_tokens)
        assert rec.loss_mask[tool] == [0] * turn.tool_tokens
        assert rec.logprobs[tool] == [0.0] * turn.tool_tokens
        context = rec.prompt_token_ids + rec.response_token_ids[: tool.stop]
    assert context == rec.prompt_token_ids + rec.response_token_ids
    # The whole context decodes to the chat template's render of the conversation.
    text = tok.decode(rec.prompt_token_ids + rec.response_token_ids)
    assert text.startswith(tok.decode(rec.prompt_token_ids))


async def test_user_env_by_path_produces_valid_records(
    tmp_path: Path, tiny_model: Path, fake_vllm
) -> None:
    env_file = tmp_path / "my_envs.py"
    env_file.write_text(USER_ENV)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_bytes(
        b"".join(
            orjson.dumps(
                {"id": f"q{i}", "question": f"What is {i} * 3 + 1?", "answer": str(i * 3 + 1)}
            )
            + b"\n"
            for i in range(6)
        )
    )
    c = cfg(tmp_path, tiny_model, [BucketConfig(name="tp1", endpoints=[fake_vllm.url])],
            env=f"{env_file}:Adder", tasks=str(tasks), group_size=3, concurrency=4)  # fmt: skip
    summary = await rollout(c, progress=False)
    recs = read_jsonl(c.out)
    assert summary["episodes"] == len(recs) == 18
    assert sorted(r.seq for r in recs) == list(range(18))
    tok = ChatTokenizer(tiny_model)
    for r in recs:
        assert r.status == "ok", r.error
        assert r.reward == 1.0 and r.answer == str(int(r.task_id[1:]) * 3 + 1)
        assert len(r.turns) == 2
        call = r.turns[0]
        assert call.tool_calls[0].name == "calculator"
        (ret,) = call.tool_returns
        assert ret.status == "ok" and ret.tool == "calculator"
        assert ret.payload_tokens == len(tok.encode(str(int(r.answer))))
        assert call.tool_tokens > ret.payload_tokens  # template tokens around the payload
        assert r.turns[1].tool_calls == [] and r.turns[1].finish_reason == "stop"
        assert call.bucket == "tp1" and call.endpoint == fake_vllm.url and call.policy_version == 0
        check_alignment(r, fake_vllm.fake.requests, tok)
    groups: dict[str, list[Trajectory]] = {}
    for r in recs:
        groups.setdefault(r.group_id, []).append(r)
    assert len(groups) == 6 and all(
        len(g) == 3 and len({x.task_id for x in g}) == 1 for g in groups.values()
    )
    assert {r.reward for r in recs} == {1.0}


@pytest.mark.parametrize(
    ("directive", "status", "tool_status"),
    [
        ("bad-json", "ok", "error"),
        ("unterminated", "ok", "error"),
        ("unknown-tool", "ok", "error"),
        ("bad-args", "ok", "error"),
        ("ramble", "truncated", None),
        ("loop", "truncated", "ok"),
        ("direct", "ok", None),
    ],
)
async def test_misbehaving_model_becomes_data(
    tmp_path: Path,
    tiny_model: Path,
    fake_vllm,
    directive: str,
    status: str,
    tool_status: str | None,
) -> None:
    tasks = tmp_path / "t.jsonl"
    tasks.write_bytes(
        orjson.dumps(
            {"id": "x", "question": f"What is 2 + 3? DIRECTIVE:{directive}", "answer": "5"}
        )
        + b"\n"
    )
    c = cfg(tmp_path, tiny_model, [BucketConfig(name="tp1", endpoints=[fake_vllm.url])],
            env="arith", tasks=str(tasks), sampling={"max_tokens": 64})  # fmt: skip
    await rollout(c, progress=False)
    (rec,) = read_jsonl(c.out)
    assert rec.status == status, rec.error
    returns = [tr for t in rec.turns for tr in t.tool_returns]
    if tool_status is None:
        assert returns == []
    else:
        assert returns and returns[0].status == tool_status
    if directive == "ramble":
        assert rec.turns[0].finish_reason == "length" and rec.turns[0].model_tokens == 64
    if directive == "loop":
        assert len(rec.turns) == 4 and "max_turns" in (rec.error or "")
    check_alignment(rec, fake_vllm.fake.requests, ChatTokenizer(tiny_model))


@pytest.mark.parametrize(("parser", "calls"), [("qwen3_coder", 1), ("auto", 0)])
async def test_an_env_names_its_models_tool_call_format(
    tmp_path: Path, tiny_model: Path, fake_vllm, parser: str, calls: int
) -> None:
    """A model that writes Qwen3-Coder XML calls: with `tool_parser = "qwen3_coder"` the
    env's tool runs and the episode is solved; with `auto` (the tiny model's template
    is Hermes) the same text is a malformed Hermes call: the tool never runs."""
    env = tmp_path / "env.py"
    env.write_text(USER_ENV + f"\n\nclass XmlAdder(Adder):\n    tool_parser = {parser!r}\n")
    tasks = tmp_path / "t.jsonl"
    task = {"id": "x", "question": "What is 2 + 3? DIRECTIVE:qwen-xml", "answer": "5"}
    tasks.write_bytes(orjson.dumps(task) + b"\n")
    c = cfg(tmp_path, tiny_model, [BucketConfig(name="tp1", endpoints=[fake_vllm.url])],
            env=f"{env}:XmlAdder", tasks=str(tasks), sampling={"max_tokens": 64})  # fmt: skip
    await rollout(c, progress=False)
    (rec,) = read_jsonl(c.out)
    returns = [tr for t in rec.turns for tr in t.tool_returns]
    assert sum(r.status == "ok" for r in returns) == calls
    assert (rec.answer == "5" and rec.reward == 1.0) == bool(calls)


class MoveAfterFirstTool:
    """Test policy: start in tp1, move to tp2 at the first tool return."""

    def on_start(self, state):
        return "tp1"

    def on_tool_return(self, state):
        return Decision("tp2", "test: move after the first tool")

    def on_finish(self, record):
        self.finished = getattr(self, "finished", 0) + 1


async def test_policy_move_is_recorded(
    tmp_path: Path, tiny_model: Path, spawn_fake, monkeypatch
) -> None:
    url1, _ = spawn_fake()
    url2, _ = spawn_fake()
    policy = MoveAfterFirstTool()
    monkeypatch.setattr("libra.rollout.run.make_policy", lambda *a: policy)
    c = cfg(tmp_path, tiny_model,
            [BucketConfig(name="tp1", bound=2048, endpoints=[url1]),
             BucketConfig(name="tp2", tp=2, bound=4096, endpoints=[url2])],
            env="arith", num_tasks=4, group_size=2)  # fmt: skip
    await rollout(c, progress=False)
    recs = read_jsonl(c.out)
    assert len(recs) == 8 and policy.finished == 8
    for r in recs:
        assert r.status == "ok"
        assert [t.bucket for t in r.turns] == ["tp1", "tp2"]
        assert [t.endpoint for t in r.turns] == [url1, url2]
        (m,) = r.migrations
        assert (m.turn, m.from_bucket, m.to_bucket) == (1, "tp1", "tp2")
        assert (
            m.reprefill_tokens == r.prompt_tokens + r.turns[0].model_tokens + r.turns[0].tool_tokens
        )
        assert m.reason == "test: move after the first tool"


async def test_killing_one_of_two_endpoints_loses_nothing(
    tmp_path: Path, tiny_model: Path, spawn_fake
) -> None:
    url1, p1 = spawn_fake(delay=0.05)
    url2, _ = spawn_fake(delay=0.05)
    c = cfg(tmp_path, tiny_model, [BucketConfig(name="tp1", endpoints=[url1, url2])],
            env="arith", group_size=4, concurrency=16)  # fmt: skip

    async def kill_soon() -> None:
        out = Path(c.out)
        while not out.exists() or out.read_bytes().count(b"\n") < 20:
            await asyncio.sleep(0.02)
        p1.kill()

    killer = asyncio.create_task(kill_soon())
    summary = await rollout(c, progress=False)
    await killer
    recs = read_jsonl(c.out)
    assert summary["episodes"] == len(recs) == 64 * 4
    assert len({r.id for r in recs}) == 256
    assert all(r.status == "ok" and r.reward == 1.0 for r in recs), {r.status for r in recs}
    served_by = {t.endpoint for r in recs for t in r.turns}
    assert served_by == {url1, url2}
    late = [t.endpoint for r in recs[-40:] for t in r.turns]
    assert set(late) == {url2}  # after the kill only the survivor serves


def run_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "libra", *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--env", "nope"], "unknown env 'nope'; known:"),
        (["--tasks", "{bad}"], ":1: not valid JSON"),
        (["--endpoint", "tp1=http://127.0.0.1:9"], "no endpoint of bucket 'tp1' answers"),
        (["--model", "{empty}"], "has no tokenizer.json"),
        (["--endpoint", "tp1"], "expected BUCKET=URL"),
        (["--group-size", "0"], "group_size: Input should be greater than or equal to 1"),
    ],
)
def test_bad_input_is_one_clear_line(
    tmp_path: Path, tiny_model: Path, extra: list[str], message: str
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    empty = tmp_path / "empty-model"
    empty.mkdir()
    args = [a.replace("{bad}", str(bad)).replace("{empty}", str(empty)) for a in extra]
    base = ["rollout", "--model", str(tiny_model), "--out", str(tmp_path / "o.jsonl"), "--quiet"]
    if not any(a.startswith("--endpoint") for a in args):
        base += ["--endpoint", "tp1=http://127.0.0.1:9"]
    t = time.monotonic()
    res = run_cli(*base, *args)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("libra: error:"), res.stderr
    assert message in lines[0]
    assert time.monotonic() - t < 60
