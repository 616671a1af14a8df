"""Huge payloads through the agent proxy (issue 14, item 2): a 6 MB request cannot fit
the context and is refused from its size alone, unparsed; a big one that might fit is
tokenized off the event loop; either way the episode ends `truncated` with the reason, the agent
is told (HTTP 400, context_length_exceeded), and the other episodes go on."""

from __future__ import annotations

import time
from pathlib import Path

from libra.endpoints.config import BucketConfig
from libra.record import read_jsonl
from libra.rollout import rollout
from tests.integration.test_proxy import AGENT, arith_tasks, write_tasks
from tests.integration.test_rollout import cfg

HUGE_AGENT = '''
import openai

async def run(task, client, size=0, where="prompt"):
    """Sends `size` characters in its first request (`prompt`) or in a tool message."""
    blob = "lorem ipsum dolor sit amet " * (size // 27)
    messages = [{"role": "user", "content": task["question"] + (blob if where == "prompt" else "")}]
    try:
        r = await client.chat.completions.create(model="policy", messages=messages)
        if where == "tool":
            messages.append(r.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "tool", "tool_call_id": "x", "content": blob})
            await client.chat.completions.create(model="policy", messages=messages)
    except openai.BadRequestError as e:
        return {"reward": 0.0, "code": e.code}
    return 1.0
'''


async def test_huge_messages_end_truncated_and_do_not_stall_others(
    tmp_path: Path, tiny_model: Path, fake_vllm
) -> None:
    (tmp_path / "huge.py").write_text(HUGE_AGENT)
    (tmp_path / "agent.py").write_text(AGENT)
    bucket = [BucketConfig(name="tp1", endpoints=[fake_vllm.url])]
    cases = {"prompt-6mb": (6_000_000, "prompt"), "tool-6mb": (6_000_000, "tool"),
             "prompt-500kb": (500_000, "prompt"), "tool-500kb": (500_000, "tool"),
             "prompt-100kb": (100_000, "prompt"), "tool-100kb": (100_000, "tool")}  # fmt: skip
    cpu = time.thread_time()  # CPU of the event loop's thread (not wall time)
    recs = {}
    for name, (size, where) in cases.items():
        c = cfg(tmp_path, tiny_model, bucket, env=f"{tmp_path}/huge.py:run",
                env_options={"size": size, "where": where}, out=str(tmp_path / f"{name}.jsonl"),
                tasks=str(write_tasks(tmp_path / "t.jsonl", arith_tasks(1))))  # fmt: skip
        await rollout(c, progress=False)
        (recs[name],) = read_jsonl(c.out)
    loop_cpu = time.thread_time() - cpu
    for name, rec in recs.items():
        assert rec.status == "truncated", (name, rec.error)
        assert "fit the context of 4096" in (rec.error or ""), rec.error
        assert (rec.reward_info or {})["code"] == "context_length_exceeded"  # the agent knew
    # The 6 MB ones were refused from their size alone, unparsed and untokenized.
    assert "bytes) cannot fit" in (recs["prompt-6mb"].error or "")
    assert "bytes) cannot fit" in (recs["tool-6mb"].error or "")
    # 500 KB: parsed, then refused from its length ("at least"), not tokenized.
    assert "(at least" in (recs["prompt-500kb"].error or "")
    assert "(at least" in (recs["tool-500kb"].error or "")
    assert recs["tool-6mb"].turns and recs["tool-6mb"].turns[0].tool_tokens == 0
    # Tokenizing 12 MB on the loop would cost it ~18 s of CPU; refused by length and
    # tokenized elsewhere, the loop spent a small part of that.
    assert loop_cpu < 3.0, loop_cpu

    # Meanwhile an ordinary agent batch runs to the end next to a huge one.
    c = cfg(tmp_path, tiny_model, bucket, env=f"{tmp_path}/agent.py:run",
            tasks=str(write_tasks(tmp_path / "n.jsonl", arith_tasks(4))),
            out=str(tmp_path / "normal.jsonl"))  # fmt: skip
    await rollout(c, progress=False)
    assert all(r.status == "ok" for r in read_jsonl(c.out))
