"""The CI vLLM stage's check of the OpenAI proxy: the example `openai`-SDK agent through
`libra rollout` on real vLLM servers (a TP=1 and a TP=2 bucket), against the native
`search-qa` env on the same tasks and seeds (collected only with LIBRA_TEST_VLLM=1)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from libra.envs.search_qa import SYSTEM
from libra.tools.search import search

from libra.chat import ChatTokenizer
from libra.record import read_jsonl
from tests.conftest import ROOT

pytestmark = pytest.mark.vllm


def test_openai_agent_on_vllm_buckets_matches_native(vllm_engines, tiny_model, tmp_path: Path):
    lines = (ROOT / "envs" / "data" / "search_qa.jsonl").read_text().splitlines()[:4]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(lines) + "\n")
    questions = {json.loads(line)["id"]: json.loads(line)["question"] for line in lines}
    tp1, tp2 = vllm_engines["vllm-tp1"], vllm_engines["vllm-tp2"]
    runs = {}
    for name, env in [("agent", f"{ROOT}/examples/openai_agent.py:run"), ("native", "search-qa")]:
        out = tmp_path / f"{name}.jsonl"
        cmd = [
            sys.executable, "-m", "libra", "rollout", "--env", env, "--tasks", str(tasks),
            "--model", str(tiny_model), "--group-size", "2", "--max-tokens", "24",
            "--seed", "3", "--concurrency", "1", "--out", str(out), "--json", "--quiet",
            "--endpoint", f"tp1={tp1.url}", "--endpoint", f"tp2={tp2.url}",
            "--bucket", "tp1=1:700", "--bucket", "tp2=2:4096",
        ]  # fmt: skip
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        runs[name] = {r.id.split("/", 1)[1]: r for r in read_jsonl(out)}
    tok = ChatTokenizer(tiny_model)
    assert len(runs["agent"]) == 8 and runs["agent"].keys() == runs["native"].keys()
    for key, r in runs["agent"].items():
        assert r.status in ("ok", "truncated"), r.error
        assert {t.endpoint.rstrip("/") for t in r.turns} <= {tp1.url, tp2.url}
        resp = r.response_token_ids
        assert len(resp) == len(r.loss_mask) == len(r.logprobs)
        assert sum(r.loss_mask) == sum(t.model_tokens for t in r.turns) > 0
        assert all(lp <= 0.0 for lp, m in zip(r.logprobs, r.loss_mask, strict=True) if m)
        msgs = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Question: {questions[r.task_id]}"}]  # fmt: skip
        assert r.prompt_token_ids == tok.prompt_ids(msgs, [search.schema])
        # Same prompt, seed and bucket as the native env: vLLM sampled the same first turn.
        n, first = runs["native"][key], r.turns[0].model_tokens
        assert r.prompt_token_ids == n.prompt_token_ids and r.turns[0].bucket == n.turns[0].bucket
        assert resp[:first] == n.response_token_ids[:first]
