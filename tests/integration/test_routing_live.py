"""C-MLFQ in a live `libra rollout`: it learns from one batch which tool returns lead to
long episodes and, in the next batch, moves those episodes to the larger bucket at that
tool return, before they overflow (the tree persists across runs through `tree_path`)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from libra.endpoints.config import BucketConfig, EndpointConfig
from libra.record import read_jsonl
from libra.rollout import RolloutConfig, rollout

FETCH_ENV = '''
import libra

@libra.tool
async def fetch(kind: str) -> str:
    """Fetch a page."""
    return "short page" if kind == "short" else " ".join(f"word{i}" for i in range(150))

class Fetcher(libra.Env):
    tools = [fetch]
    max_turns = 6

    def prompt(self, task):
        return [{"role": "user", "content": task["question"]}]

    async def reward(self, task, trajectory):
        return float(trajectory.answer == "done")
'''


@pytest.mark.parametrize("workers", [1, 2])
async def test_cmlfq_moves_predicted_long_episodes_early(
    tmp_path: Path, tiny_model: Path, spawn_fake, workers: int
) -> None:
    """(With 2 rollout workers the front's copy of the policy learns every record's
    lesson and saves the tree; the workers of the next run load it.)"""
    env_file = tmp_path / "fetch_env.py"
    env_file.write_text(FETCH_ENV)
    tasks = tmp_path / "tasks.jsonl"
    kinds = ["fetch-short", "fetch-long"] * 8
    tasks.write_bytes(
        b"".join(
            orjson.dumps({"id": f"t{i}", "question": f"Go. DIRECTIVE:{k}"}) + b"\n"
            for i, k in enumerate(kinds)
        )
    )
    url1, _ = spawn_fake()
    url2, _ = spawn_fake()
    tree = tmp_path / "tree.bin"

    def cfg(step: int, tree: Path, **routing: object) -> RolloutConfig:
        return RolloutConfig(
            model=str(tiny_model), env=f"{env_file}:Fetcher", tasks=str(tasks), group_size=2,
            out=str(tmp_path / f"step{step}-{tree.stem}.jsonl"), step=step, policy="cmlfq",
            routing={"tree_path": str(tree), "small_payload": 50, "min_samples": 2, **routing},
            buckets=[BucketConfig(name="tp1", tp=1, bound=1024, endpoints=[url1]),
                     BucketConfig(name="tp2", tp=2, bound=4096, endpoints=[url2])],
            endpoint=EndpointConfig(backoff_s=0.01), workers=workers,
        )  # fmt: skip

    def is_long(task_id: str) -> bool:
        return kinds[int(task_id[1:])] == "fetch-long"

    tree = tmp_path / "tree.bin"
    await rollout(cfg(0, tree), progress=False)
    assert tree.exists()  # what step 0 taught is saved for the next run
    first = read_jsonl(tmp_path / "step0-tree.jsonl")
    long0 = [r for r in first if is_long(r.task_id)]
    assert len(long0) == 16 and all(r.status == "ok" and r.total_tokens > 1024 for r in long0)
    # Nothing learned yet: long episodes only move when they overflow tp1.
    assert all([m.reason for m in r.migrations] == ["overflow"] for r in long0)

    # Step 1, the paper's rule (start small, decide at tool returns): long episodes move
    # to tp2 at their first tool return, before they overflow; short ones never move.
    paper = tmp_path / "paper.bin"
    paper.write_bytes(tree.read_bytes())
    await rollout(cfg(1, paper, start="smallest"), progress=False)
    second = read_jsonl(tmp_path / "step1-paper.jsonl")
    assert len(second) == 32 and all(r.status == "ok" for r in second)
    for r in second:
        if is_long(r.task_id):
            (m,) = r.migrations
            assert (m.from_bucket, m.to_bucket, m.turn) == ("tp1", "tp2", 1)
            assert m.reason.startswith("cmlfq") and m.reprefill_tokens < 1024
            assert [t.bucket for t in r.turns] == ["tp1", "tp2", "tp2", "tp2"]
        else:
            assert r.migrations == [] and {t.bucket for t in r.turns} == {"tp1"}

    # Step 1, Libra's default start (the prompt's own root node): a prompt known to run
    # long starts in tp2 and never needs a move.
    await rollout(cfg(1, tree), progress=False)
    third = read_jsonl(tmp_path / "step1-tree.jsonl")
    for r in third:
        assert r.status == "ok" and r.migrations == []
        assert {t.bucket for t in r.turns} == ({"tp2"} if is_long(r.task_id) else {"tp1"})
