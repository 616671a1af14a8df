"""Agents written against the real `openai` SDK run as Libra episodes through the proxy,
against the fake vLLM server on loopback (real HTTP both ways, real tokenizer and chat
template; only the model is scripted, see tests/fakes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from libra.chat import ChatTokenizer
from libra.endpoints.config import BucketConfig
from libra.record import Trajectory, read_jsonl
from libra.rollout import rollout
from tests.integration.test_rollout import USER_ENV, cfg

AGENT = '''
import json, re
import openai

TOOLS = [{"type": "function", "function": {"name": "calculator",
          "description": "Evaluate an integer expression.",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                         "required": ["expression"]}}}]
MORE_TOOLS = TOOLS + [{"type": "function", "function": {"name": "noop", "description": "No-op.",
                       "parameters": {"type": "object", "properties": {}}}}]


async def ask(client, messages, tools, stream, **kw):
    """One chat completion; with stream=True the agent assembles the chunks itself."""
    if not stream:
        r = await client.chat.completions.create(model="policy", messages=messages, tools=tools,
                                                 **kw)
        c = r.choices[0]
        return c.message.model_dump(exclude_none=True), c.finish_reason
    content, calls, finish = "", {}, None
    async for chunk in await client.chat.completions.create(
            model="policy", messages=messages, tools=tools, stream=True, **kw):
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": tc.id, "type": "function",
                                               "function": {"name": "", "arguments": ""}})
            slot["function"]["name"] += tc.function.name or ""
            slot["function"]["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    msg = {"role": "assistant", "content": content or None}
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg, finish


def edit(messages, mode):
    if mode == "rewrite-user":
        messages[0]["content"] += " Be brief."
    elif mode == "drop-assistant":
        del messages[1]
    elif mode == "strip-content":
        messages[1]["content"] = None
    elif mode == "reserialize":  # same rendered content: not an edit
        m = messages[1]
        messages[1] = {"role": "assistant", "content": m.get("content") or "", "refusal": None,
                       "tool_calls": [{"id": c["id"], "type": "function", "function": {
                           "name": c["function"]["name"],
                           "arguments": json.dumps(json.loads(c["function"]["arguments"]), indent=2)}}
                           for c in m["tool_calls"]]}


async def run(task, client: openai.AsyncOpenAI, log=None, stream=False, tools=None, stop=None,
              own_client=False):
    if own_client:  # a client of its own on the base URL: real HTTP to the proxy server
        client = openai.AsyncOpenAI(base_url=str(client.base_url), api_key=client.api_key,
                                    max_retries=0)
    mode = task.get("mode", "normal")
    if mode == "no-call":
        return 1.0
    messages = [{"role": "user", "content": task["question"]}]
    tools, sent, seen = tools or TOOLS, [], []
    kw = {"stop": stop} if stop else {}
    for turn in range(4):
        sent.append(json.loads(json.dumps(messages)))
        if mode == "parallel" and turn == 0:  # two samples of the first turn at once
            import asyncio
            (msg, finish), _ = await asyncio.gather(ask(client, messages, tools, stream, **kw),
                                                    ask(client, messages, tools, stream, **kw))
        else:
            msg, finish = await ask(client, messages, tools, stream, **kw)
        seen.append({"content": msg.get("content"), "finish": finish,
                     "calls": [[c["function"]["name"], json.loads(c["function"]["arguments"])]
                               for c in msg.get("tool_calls", [])]})
        messages.append(msg)
        if not msg.get("tool_calls"):
            break
        for c in msg["tool_calls"]:
            expr = json.loads(c["function"]["arguments"])["expression"]
            extra = {}
            try:
                out = str(eval(expr, {"__builtins__": {}}))
            except Exception as e:
                out, extra = f"Error: {e}", {"info": {"exception": type(e).__name__}}
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": out, **extra})
        if mode == "raise":
            raise ValueError("boom")
        if mode == "hang":
            import asyncio
            await asyncio.sleep(3600)
        if turn == 0:
            edit(messages, mode)
            tools = MORE_TOOLS if mode == "tools-changed" else tools
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"task": task["id"], "sent": sent, "seen": seen, "tools": tools}) + "\\n")
    if mode == "bad-return":
        return "great"
    found = re.findall(r"<answer>(.*?)(?:</answer>|$)", seen[-1]["content"] or "")
    return {"reward": float(bool(found) and found[-1] == task["answer"]), "turns": len(seen)}
'''


def write_tasks(path: Path, tasks: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(t) + b"\n" for t in tasks))
    return path


def arith_tasks(n: int, **extra: Any) -> list[dict[str, Any]]:
    return [{"id": f"q{i}", "question": f"What is {i} * 3 + 1?", "answer": str(i * 3 + 1),
             **extra} for i in range(n)]  # fmt: skip


def fake_lp(ids: list[int]) -> list[float]:
    return [-((t * 7919) % 997) / 1000.0 for t in ids]


def parts(rec: Trajectory) -> list[tuple[list[int], list[int], list[int], list[float], int]]:
    """(prompt, response, mask, logprobs, first turn) of every segment, in order."""
    out = [(rec.prompt_token_ids, rec.response_token_ids, rec.loss_mask, rec.logprobs, 0)]
    out += [(s.prompt_token_ids, s.response_token_ids, s.loss_mask, s.logprobs, s.turn)
            for s in rec.segments]  # fmt: skip
    return out


def check_tokens(rec: Trajectory, served: list[dict[str, Any]]) -> None:
    """Each segment is aligned like a native record: every model turn is exactly what the
    endpoint generated for exactly that context (mask 1, its logprobs); everything else
    is mask 0, logprob 0."""
    by_prompt = {tuple(r["prompt"]): r["token_ids"] for r in served}
    segs = parts(rec)
    bounds = [s[4] for s in segs] + [len(rec.turns)]
    for k, (prompt, resp, mask, lps, first) in enumerate(segs):
        assert len(resp) == len(mask) == len(lps)
        assert (k == 0) or rec.segments[k - 1].prompt_tokens == len(prompt)
        covered = 0
        for turn in rec.turns[first : bounds[k + 1]]:
            assert turn.start == covered
            model = slice(turn.start, turn.start + turn.model_tokens)
            assert resp[model] == by_prompt[tuple(prompt + resp[: turn.start])]
            assert mask[model] == [1] * turn.model_tokens and lps[model] == fake_lp(resp[model])
            tool = slice(model.stop, model.stop + turn.tool_tokens)
            assert mask[tool] == [0] * turn.tool_tokens and lps[tool] == [0.0] * turn.tool_tokens
            covered = tool.stop
        assert covered == len(resp)
    last_prompt, last_resp = segs[-1][0], segs[-1][1]
    assert rec.total_tokens == len(last_prompt) + len(last_resp)


def model_text(tok: ChatTokenizer, rec: Trajectory, turn_index: int) -> str:
    seg = max((s for s in parts(rec) if s[4] <= turn_index), key=lambda s: s[4])
    turn = rec.turns[turn_index]
    text = tok.decode(seg[1][turn.start : turn.start + turn.model_tokens])
    return text.removesuffix(tok.eos_token or "")


def seen_text(seen: dict[str, Any]) -> str:
    """What the agent saw, written back the Hermes way."""
    calls = "".join(
        "<tool_call>" + json.dumps({"name": n, "arguments": a}) + "</tool_call>"
        for n, a in seen["calls"]
    )
    return (seen["content"] or "") + calls


def as_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as a chat template gets them from an OpenAI server (vLLM parses tool-call
    arguments into objects first, since HF templates write them with `tojson`)."""
    out = json.loads(json.dumps(messages))
    for msg in out:
        for call in msg.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


def by_task(log: Path) -> dict[str, dict[str, Any]]:
    return {d["task"]: d for d in map(json.loads, log.read_text().splitlines())}


def native_tools(tmp_path: Path) -> list[dict[str, Any]]:
    """The tool schema of the native `Adder` env (USER_ENV), for an agent to send."""
    from libra.registry import load_object

    (tmp_path / "my_envs.py").write_text(USER_ENV)
    return [load_object(f"{tmp_path}/my_envs.py:calculator").schema]


@pytest.mark.parametrize(
    ("stream", "own_client"), [(False, False), (True, False), (True, True)],
    ids=["given-client", "given-client-streaming", "own-http-client-streaming"],
)  # fmt: skip
async def test_openai_agent_records_like_a_native_env(
    tmp_path: Path, tiny_model: Path, fake_vllm, stream: bool, own_client: bool
) -> None:
    (tmp_path / "agent.py").write_text(AGENT)
    tools = native_tools(tmp_path)
    log = tmp_path / "seen.jsonl"
    tasks = write_tasks(tmp_path / "t.jsonl", arith_tasks(6))
    bucket = [BucketConfig(name="tp1", endpoints=[fake_vllm.url])]
    c = cfg(tmp_path, tiny_model, bucket, env=f"{tmp_path}/agent.py:run", tasks=str(tasks),
            group_size=3, concurrency=8,
            env_options={"log": str(log), "stream": stream, "tools": tools,
                         "stop": ["</answer>"], "own_client": own_client})  # fmt: skip
    summary = await rollout(c, progress=False)
    recs = read_jsonl(c.out)
    assert summary["episodes"] == len(recs) == 18 and summary["status"] == {"ok": 18}
    served = list(fake_vllm.fake.requests)
    native_cfg = cfg(tmp_path, tiny_model, bucket, env=f"{tmp_path}/my_envs.py:Adder",
                     tasks=str(tasks), out=str(tmp_path / "native.jsonl"))  # fmt: skip
    await rollout(native_cfg, progress=False)
    native = {r.task_id: r for r in read_jsonl(native_cfg.out)}
    tok = ChatTokenizer(tiny_model)
    seen = by_task(log)
    for r in recs:
        assert r.status == "ok" and r.segments == []
        assert r.reward == 1.0 and r.reward_info == {"turns": 2}
        check_tokens(r, served)
        # Same prompt, tools, stop and model as the native env: the very same record.
        n = native[r.task_id]
        assert r.model_dump().keys() == n.model_dump().keys()
        for key in ("prompt_token_ids", "response_token_ids", "loss_mask", "logprobs",
                    "total_tokens", "answer", "reward"):  # fmt: skip
            assert getattr(r, key) == getattr(n, key), key
        volatile = {"endpoint", "tool_returns"}
        assert [t.model_dump(exclude=volatile) for t in r.turns] == [
            t.model_dump(exclude=volatile) for t in n.turns
        ]
        (ret,), (nret,) = r.turns[0].tool_returns, n.turns[0].tool_returns
        assert ret.model_dump(exclude={"latency_s"}) == nret.model_dump(exclude={"latency_s"})
        # The prompt is the chat template's render of the agent's first request...
        saw = seen[r.task_id]
        assert tok.decode(r.prompt_token_ids) == tok.render(saw["sent"][0], saw["tools"])
        # ...each model turn decodes to exactly what the agent was shown (the stop
        # string, a single token here, is in the tokens but not the content)...
        first, last = saw["seen"]
        assert model_text(tok, r, 0) == seen_text(first)
        assert model_text(tok, r, 1) == seen_text(last) + "</answer>"
        assert (first["finish"], last["finish"]) == ("tool_calls", "stop")
        # ...and the appended delta carries the tool result the agent sent back.
        t0 = r.turns[0]
        delta = r.response_token_ids[t0.start + t0.model_tokens :][: t0.tool_tokens]
        assert f"<tool_response>\n{r.answer}\n</tool_response>" in tok.decode(delta)


async def test_stop_strings_are_cut_from_content_but_kept_in_tokens(
    tmp_path: Path, tiny_model: Path, fake_vllm
) -> None:
    fake_vllm.fake.honor_stop = True
    (tmp_path / "agent.py").write_text(AGENT)
    log = tmp_path / "seen.jsonl"
    tasks = write_tasks(tmp_path / "t.jsonl", arith_tasks(1))
    c = cfg(tmp_path, tiny_model, [BucketConfig(name="tp1", endpoints=[fake_vllm.url])],
            env=f"{tmp_path}/agent.py:run", tasks=str(tasks),
            env_options={"log": str(log), "stop": [" <answer>", "never"]})  # fmt: skip
    await rollout(c, progress=False)
    (r,) = read_jsonl(c.out)
    last = by_task(log)["q0"]["seen"][-1]
    assert last == {"content": "The tool says 1.", "finish": "stop", "calls": []}
    tok = ChatTokenizer(tiny_model)
    assert model_text(tok, r, 1) == "The tool says 1. <answer>"  # no EOS: the stop ended it
    assert r.answer is None and r.status == "ok" and r.reward == 0.0
    check_tokens(r, fake_vllm.fake.requests)


EDITS = [
    ("rewrite-user", "message 0 (user) rewritten"),
    ("drop-assistant", "message 1 (assistant) dropped"),
    ("strip-content", "message 1 (assistant) rewritten"),
    ("tools-changed", "tools changed"),
]


@pytest.mark.parametrize(("mode", "reason"), EDITS)
async def test_history_edit_starts_a_segment(
    tmp_path: Path, tiny_model: Path, fake_vllm, mode: str, reason: str
) -> None:
    (tmp_path / "agent.py").write_text(AGENT)
    log = tmp_path / "seen.jsonl"
    tasks = write_tasks(tmp_path / "t.jsonl", arith_tasks(2, mode=mode))
    c = cfg(tmp_path, tiny_model, [BucketConfig(name="tp1", endpoints=[fake_vllm.url])],
            env=f"{tmp_path}/agent.py:run", tasks=str(tasks), env_options={"log": str(log)})  # fmt: skip
    await rollout(c, progress=False)
    tok = ChatTokenizer(tiny_model)
    seen = by_task(log)
    for r in read_jsonl(c.out):
        assert r.status == "ok" and r.reward == 1.0, r.error
        (seg,) = r.segments
        assert (seg.turn, seg.reason) == (1, reason)
        assert len(r.turns) == 2 and r.turns[1].start == 0
        check_tokens(r, fake_vllm.fake.requests)
        # The first segment holds turn 0 only, as generated: nothing after it was appended.
        t0 = r.turns[0]
        assert len(r.response_token_ids) == t0.model_tokens and t0.tool_tokens == 0
        # The new segment is the agent's edited conversation, rendered whole.
        saw = seen[r.task_id]
        assert tok.decode(seg.prompt_token_ids) == tok.render(
            as_template(saw["sent"][1]), saw["tools"]
        )
        # C-MLFQ still sees the tool return that came with the edited request.
        (ret,) = t0.tool_returns
        assert (ret.tool, ret.status) == ("calculator", "ok")
        assert r.total_tokens == seg.prompt_tokens + len(seg.response_token_ids)
        assert model_text(tok, r, 1) == seen_text(saw["seen"][1])


async def test_concurrent_requests_of_one_episode_are_serialised_into_segments(
    tmp_path: Path, tiny_model: Path, fake_vllm
) -> None:
    """Two requests at once with the same messages: the second does not extend the
    first's reply, so it opens a segment on the same prompt; the agent then goes on from
    the first reply, which renders the same as the second's (call ids are not rendered),
    so the episode continues in that segment."""
    (tmp_path / "agent.py").write_text(AGENT)
    tasks = write_tasks(tmp_path / "t.jsonl", arith_tasks(1, mode="parallel"))
    c = cfg(tmp_path, tiny_model, [BucketConfig(name="tp1", endpoints=[fake_vllm.url])],
            env=f"{tmp_path}/agent.py:run", tasks=str(tasks))  # fmt: skip
    await rollout(c, progress=False)
    (r,) = read_jsonl(c.out)
    assert r.status == "ok" and r.reward == 1.0 and len(r.turns) == 3
    (seg,) = r.segments
    assert (seg.turn, seg.reason) == (1, "message 1 (assistant) dropped")
    assert seg.prompt_token_ids == r.prompt_token_ids
    assert r.turns[1].tool_calls == r.turns[0].tool_calls and r.turns[1].tool_returns
    check_tokens(r, fake_vllm.fake.requests)


async def test_reserialized_reply_is_not_an_edit(
    tmp_path: Path, tiny_model: Path, fake_vllm
) -> None:
    (tmp_path / "agent.py").write_text(AGENT)
    tasks = write_tasks(tmp_path / "t.jsonl", arith_tasks(2, mode="reserialize"))
    c = cfg(tmp_path, tiny_model, [BucketConfig(name="tp1", endpoints=[fake_vllm.url])],
            env=f"{tmp_path}/agent.py:run", tasks=str(tasks))  # fmt: skip
    await rollout(c, progress=False)
    for r in read_jsonl(c.out):
        assert r.status == "ok" and r.segments == [] and r.turns[0].tool_tokens > 0
        check_tokens(r, fake_vllm.fake.requests)


async def test_agent_failures_become_status_and_the_batch_goes_on(
    tmp_path: Path, tiny_model: Path, fake_vllm
) -> None:
    (tmp_path / "agent.py").write_text(AGENT)
    modes = ["normal", "raise", "no-call", "bad-return", "normal"]
    tasks = write_tasks(
        tmp_path / "t.jsonl",
        [{**t, "mode": m} for t, m in zip(arith_tasks(5), modes, strict=True)]
        + [{"id": "z", "question": "What is 1 // 0?", "answer": "x"}],
    )
    c = cfg(tmp_path, tiny_model, [BucketConfig(name="tp1", endpoints=[fake_vllm.url])],
            env=f"{tmp_path}/agent.py:run", tasks=str(tasks), group_size=2)  # fmt: skip
    summary = await rollout(c, progress=False)
    recs = {r.id.split("/", 1)[1]: r for r in read_jsonl(c.out)}
    assert summary["episodes"] == 12
    for k in (0, 1):
        assert recs[f"q0/{k}"].status == recs[f"q4/{k}"].status == "ok"
        raised = recs[f"q1/{k}"]
        assert (raised.status, raised.error) == ("error", "agent raised ValueError: boom")
        assert len(raised.turns) == 1 and raised.reward == 0.0  # the turn it made is kept
        check_tokens(raised, fake_vllm.fake.requests)
        assert recs[f"q2/{k}"].status == "error"
        assert "without calling the model" in (recs[f"q2/{k}"].error or "")
        assert recs[f"q3/{k}"].status == "error"
        assert "agent returned 'great'" in (recs[f"q3/{k}"].error or "")
        (ret,) = recs[f"z/{k}"].turns[0].tool_returns  # "Error: ..." from the agent's tool
        assert ret.status == "error" and ret.info == {"exception": "ZeroDivisionError"}


async def test_limits_end_the_episode_and_the_agent_is_told(
    tmp_path: Path, tiny_model: Path, fake_vllm
) -> None:
    (tmp_path / "agent.py").write_text(AGENT)
    tasks = write_tasks(tmp_path / "t.jsonl", arith_tasks(1))
    bucket = [BucketConfig(name="tp1", endpoints=[fake_vllm.url])]
    c = cfg(tmp_path, tiny_model, bucket, env=f"{tmp_path}/agent.py:run", tasks=str(tasks),
            limits={"max_turns": 1})  # fmt: skip
    await rollout(c, progress=False)
    (r,) = read_jsonl(c.out)
    assert r.status == "truncated" and r.error == "reached max_turns=1"
    assert len(r.turns) == 1
    check_tokens(r, fake_vllm.fake.requests)
    # A context too small for the tool result: truncated, the overflowing delta not kept.
    first_turn = r.prompt_tokens + r.turns[0].model_tokens
    c2 = cfg(tmp_path, tiny_model, bucket, env=f"{tmp_path}/agent.py:run", tasks=str(tasks),
             out=str(tmp_path / "o2.jsonl"), limits={"max_context": first_turn + 3})  # fmt: skip
    await rollout(c2, progress=False)
    (r2,) = read_jsonl(c2.out)
    assert r2.status == "truncated" and "does not fit the context" in (r2.error or "")
    assert r2.total_tokens == first_turn and r2.turns[0].tool_tokens == 0


async def test_turn_timeout(tmp_path: Path, tiny_model: Path, spawn_fake) -> None:
    url, _ = spawn_fake(delay=1.0)
    (tmp_path / "agent.py").write_text(AGENT)
    tasks = write_tasks(tmp_path / "t.jsonl", arith_tasks(2))
    bucket = [BucketConfig(name="tp1", endpoints=[url])]
    c = cfg(tmp_path, tiny_model, bucket, env=f"{tmp_path}/agent.py:run", tasks=str(tasks),
            limits={"turn_timeout_s": 0.2})  # fmt: skip
    await rollout(c, progress=False)
    for r in read_jsonl(c.out):
        assert (r.status, r.error) == ("timeout", "model turn exceeded 0.2 s")
        assert r.turns == [] and r.response_token_ids == []


async def test_episode_timeout_cancels_the_agent(
    tmp_path: Path, tiny_model: Path, fake_vllm
) -> None:
    (tmp_path / "agent.py").write_text(AGENT)
    tasks = write_tasks(tmp_path / "t.jsonl", arith_tasks(2, mode="hang"))
    c = cfg(tmp_path, tiny_model, [BucketConfig(name="tp1", endpoints=[fake_vllm.url])],
            env=f"{tmp_path}/agent.py:run", tasks=str(tasks),
            limits={"episode_timeout_s": 3.0})  # fmt: skip
    await rollout(c, progress=False)
    for r in read_jsonl(c.out):
        assert (r.status, r.error) == ("timeout", "episode exceeded 3 s")
        assert len(r.turns) == 1 and r.reward == 0.0  # its one turn is kept
        check_tokens(r, fake_vllm.fake.requests)


class Recorder:
    """Test policy: remembers what routing saw; moves to tp2 at the first tool return."""

    def __init__(self) -> None:
        self.returns: list[Any] = []
        self.finished: list[Trajectory] = []

    def on_start(self, state: Any) -> str:
        return "tp1"

    def on_tool_return(self, state: Any) -> str:
        self.returns.append(state)
        return "tp2"

    def on_finish(self, record: Trajectory) -> None:
        self.finished.append(record)


async def test_routing_sees_the_tool_returns_the_agent_sends(
    tmp_path: Path, tiny_model: Path, fake_vllm, monkeypatch
) -> None:
    policy = Recorder()
    monkeypatch.setattr("libra.rollout.run.make_policy", lambda *a: policy)
    (tmp_path / "agent.py").write_text(AGENT)
    tasks = write_tasks(tmp_path / "t.jsonl",
                        [{"id": "e", "question": "What is 7 // 0?", "answer": "x"}])  # fmt: skip
    c = cfg(tmp_path, tiny_model,
            [BucketConfig(name="tp1", bound=2048, endpoints=[fake_vllm.url]),
             BucketConfig(name="tp2", tp=2, bound=4096, endpoints=[fake_vllm.url])],
            env=f"{tmp_path}/agent.py:run", tasks=str(tasks))  # fmt: skip
    await rollout(c, progress=False)
    (r,) = read_jsonl(c.out)
    (state,) = policy.returns
    (ret,) = r.turns[0].tool_returns
    assert state.tool_returns[0].tool == "calculator" and state.tool_returns[0].status == "error"
    assert state.tool_returns[0].payload_tokens == ret.payload_tokens > 0
    assert state.tokens_so_far == r.prompt_tokens + r.turns[0].model_tokens + r.turns[0].tool_tokens
    assert (state.task_id, state.bucket, state.turn) == ("e", "tp1", 1)
    assert [t.bucket for t in r.turns] == ["tp1", "tp2"]
    (m,) = r.migrations
    assert (m.turn, m.from_bucket, m.to_bucket, m.reprefill_tokens) == (
        1, "tp1", "tp2", state.tokens_so_far
    )  # fmt: skip
    assert [f.id for f in policy.finished] == [r.id]


async def test_a_context_that_outgrows_its_bucket_moves_as_in_native(
    tmp_path: Path, tiny_model: Path, fake_vllm
) -> None:
    (tmp_path / "agent.py").write_text(AGENT)
    tasks = write_tasks(tmp_path / "t.jsonl", arith_tasks(1))
    one = [BucketConfig(name="tp1", endpoints=[fake_vllm.url])]
    c = cfg(tmp_path, tiny_model, one, env=f"{tmp_path}/agent.py:run", tasks=str(tasks))
    await rollout(c, progress=False)
    (first,) = read_jsonl(c.out)
    after_turn0 = first.prompt_tokens + first.turns[0].model_tokens
    two = [BucketConfig(name="tp1", bound=after_turn0 + 2, endpoints=[fake_vllm.url]),
           BucketConfig(name="tp2", tp=2, bound=4096, endpoints=[fake_vllm.url])]  # fmt: skip
    c2 = cfg(tmp_path, tiny_model, two, env=f"{tmp_path}/agent.py:run", tasks=str(tasks),
             out=str(tmp_path / "o2.jsonl"))  # fmt: skip
    await rollout(c2, progress=False)
    (r,) = read_jsonl(c2.out)
    assert r.status == "ok" and [t.bucket for t in r.turns] == ["tp1", "tp2"]
    (m,) = r.migrations
    assert (m.turn, m.from_bucket, m.to_bucket, m.reason) == (1, "tp1", "tp2", "overflow")
    assert m.reprefill_tokens == after_turn0 + r.turns[0].tool_tokens
    assert r.response_token_ids == first.response_token_ids  # same tokens, other bucket


OWN_PARSER = """
import time

from libra.proxy import AgentEnv
from agent import run


class Parsed(AgentEnv):
    def parse_answer(self, text):
        return "parsed:" + str(len(text))


class Blocking(AgentEnv):
    def parse_answer(self, text):  # blocks its thread (a sync call the loop must not run)
        time.sleep(3)
        return "late"


parsed = Parsed(run, "parsed")
blocking = Blocking(run, "blocking")
"""


async def test_an_agent_env_s_own_answer_parser_runs_off_the_loop_under_the_turn_limit(
    tmp_path: Path, tiny_model: Path, fake_vllm, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "own.py").write_text(OWN_PARSER)
    monkeypatch.syspath_prepend(str(tmp_path))
    tasks = write_tasks(tmp_path / "t.jsonl", arith_tasks(2))
    bucket = [BucketConfig(name="tp1", endpoints=[fake_vllm.url])]
    c = cfg(tmp_path, tiny_model, bucket, env=f"{tmp_path}/own.py:parsed", tasks=str(tasks),
            group_size=2)  # fmt: skip
    await rollout(c, progress=False)
    recs = read_jsonl(c.out)
    assert len(recs) == 4 and all(r.status == "ok" for r in recs)
    assert all((r.answer or "").startswith("parsed:") for r in recs)
    # A parser that blocks its thread: the episode ends at the turn's limit, as an error,
    # (on the loop it could not be cut: it would hold every episode for its 3 s).
    c2 = cfg(tmp_path, tiny_model, bucket, env=f"{tmp_path}/own.py:blocking", tasks=str(tasks),
             out=str(tmp_path / "o2.jsonl"), group_size=2,
             limits={"turn_timeout_s": 0.5})  # fmt: skip
    summary = await rollout(c2, progress=False)
    recs = read_jsonl(c2.out)
    assert summary["episodes"] == 4 and summary["status"] == {"error": 4}
    for r in recs:
        assert r.answer is None and len(r.turns) == 2
        assert (r.error or "").endswith("own.py:blocking.parse_answer exceeded 0.5 s"), r.error
