"""Task files in verl's and TRL's layouts through `libra rollout` into the built-in envs
(fake vLLM on loopback: the scripted model computes "What is X?" with the calculator)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from libra.endpoints.config import BucketConfig
from libra.errors import ConfigError
from libra.record import read_jsonl
from libra.rollout import rollout
from tests.integration.test_rollout import cfg


def verl_row(i: int, truth: str) -> dict:
    return {
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": f"What is {i} * 3 + 1? Let's think step by step."},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": "train", "index": i},
    }


async def test_verl_parquet_into_arith(tmp_path: Path, tiny_model: Path, fake_vllm) -> None:
    """A verl RL parquet: the question comes from the last user message, the answer from
    reward_model.ground_truth; ids from data_source + extra_info.index; the original row
    rides along under `row`. A wrong ground truth scores 0, as it should."""
    rows = [verl_row(i, str(i * 3 + 1)) for i in range(3)] + [verl_row(3, "999")]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    c = cfg(tmp_path, tiny_model, [BucketConfig(name="tp1", endpoints=[fake_vllm.url])],
            env="arith", tasks=str(path), group_size=2)  # fmt: skip
    summary = await rollout(c, progress=False)
    recs = sorted(read_jsonl(c.out), key=lambda r: r.seq)
    assert summary["episodes"] == len(recs) == 8
    by_task = {r.task_id: r for r in recs}
    assert sorted(by_task) == [f"openai/gsm8k-{i}" for i in range(4)]
    for i in range(4):
        r = by_task[f"openai/gsm8k-{i}"]
        assert r.status == "ok", r.error
        assert r.answer == str(i * 3 + 1)
        assert r.reward == (0.0 if i == 3 else 1.0)
        assert r.turns[0].tool_calls[0].name == "calculator"


async def test_trl_jsonl_into_arith_and_math(tmp_path: Path, tiny_model: Path, fake_vllm) -> None:
    """TRL prompts: a string with a `solution` column (arith), and conversational prompts
    with an `answer` column (math, verified by math-verify)."""
    bucket = [BucketConfig(name="tp1", endpoints=[fake_vllm.url])]
    arith = tmp_path / "trl.jsonl"
    arith.write_bytes(b"".join(
        orjson.dumps({"prompt": f"What is {i} + 10?", "solution": i + 10}) + b"\n"
        for i in range(3)))  # fmt: skip
    c = cfg(tmp_path, tiny_model, bucket, env="arith", tasks=str(arith))
    await rollout(c, progress=False)
    recs = read_jsonl(c.out)
    assert len(recs) == 3 and {r.reward for r in recs} == {1.0}
    assert sorted(r.answer for r in recs) == ["10", "11", "12"]

    math = tmp_path / "trl_conv.jsonl"
    msgs = [{"role": "user", "content": "Answer directly. DIRECTIVE:direct"}]
    math.write_bytes(orjson.dumps({"prompt": msgs, "answer": "42"}) + b"\n"
                     + orjson.dumps({"prompt": msgs, "answer": "41", "id": "w"}) + b"\n")  # fmt: skip
    c = cfg(tmp_path, tiny_model, bucket, env="math", tasks=str(math),
            out=str(tmp_path / "math.jsonl"))  # fmt: skip
    await rollout(c, progress=False)
    rewards = {r.task_id: r.reward for r in read_jsonl(c.out)}
    assert rewards.pop("w") == 0.0 and list(rewards.values()) == [1.0]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "What is 1 + 1?", "label": "2"}, "needs one of answer, solution, ground_truth"),
        (
            {
                "prompt": [{"role": "user", "content": "What is 1 + 1?"}],
                "reward_model": {"style": "rule"},
            },
            "needs 'reward_model.ground_truth'",
        ),
        ({"prompt": [{"role": "system", "content": "hi"}], "answer": "2"}, "no user message"),
    ],
)
async def test_an_unmappable_row_is_one_clear_error(
    tmp_path: Path, tiny_model: Path, fake_vllm, row: dict, message: str
) -> None:
    tasks = tmp_path / "bad.jsonl"
    tasks.write_bytes(orjson.dumps({"question": "What is 2 + 2?", "answer": "4"}) + b"\n"
                      + orjson.dumps(row) + b"\n")  # fmt: skip
    c = cfg(tmp_path, tiny_model, [BucketConfig(name="tp1", endpoints=[fake_vllm.url])],
            env="arith", tasks=str(tasks))  # fmt: skip
    with pytest.raises(ConfigError, match="task 2") as e:
        await rollout(c, progress=False)
    assert message in str(e.value)
    assert not fake_vllm.fake.requests  # nothing ran
