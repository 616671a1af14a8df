"""`ElasticTrainer`, the API `libra train` drives, end to end with real processes: GRPO
steps on trajectory records, a hybrid replica added and removed live, saved weights
loaded into a real `libra serve-engine` process, checkpoint and bit-exact resume."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from libra.record import Trajectory
from libra.trainer import ElasticTrainer, TrainerConfig
from tests.conftest import ROOT, free_port, wait_http


def records(step: int, *, groups: int = 3, g: int = 4, vocab: int = 4096) -> list[Trajectory]:
    rng = random.Random(step)
    out = []
    for gi in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(8)]
        for j in range(g):
            n = rng.randint(4, 24)
            mask = [1] * n
            mask[n // 2] = 0  # a tool token in the middle
            out.append(
                Trajectory(
                    id=f"{step}-{gi}-{j}",
                    batch_id="b",
                    task_id=f"t{gi}",
                    group_id=f"{step}-{gi}",
                    env="test",
                    step=step,
                    prompt_token_ids=prompt,
                    loss_mask=mask,
                    response_token_ids=[rng.randrange(vocab) for _ in range(n)],
                    logprobs=[-rng.uniform(0.5, 3) if m else 0.0 for m in mask],
                    reward=float(rng.random() < 0.5),
                    status="truncated" if j == 3 else "ok",
                )
            )
    out.append(out[0].model_copy(update={"id": "x", "status": "aborted"}))
    return out


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def served_logprob(base: str, prompt: list[int]) -> tuple[int, float]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "logprobs": 1, "return_token_ids": True}  # fmt: skip
    c = post(f"{base}/v1/completions", body)["choices"][0]
    return c["token_ids"][0], c["logprobs"]["token_logprobs"][0]


async def load_into(base: str, folder: str) -> None:
    import aiohttp

    from libra.engine.weights import load_weights

    async with aiohttp.ClientSession() as session:
        await load_weights(session, base, "embedded", folder)


def folder_logprob(folder: str, prompt: list[int], tok: int) -> float:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = m(input_ids=torch.tensor([prompt])).logits[0, -1].double()
    return float(torch.log_softmax(logits, -1)[tok])


@pytest.fixture
def engine(tiny_model: Path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "libra", "serve-engine", "--model", str(tiny_model),
         "--port", str(port), "--served-model-name", "tiny", "--kv-cache-gib", "0.05"],
        cwd=ROOT,
    )  # fmt: skip
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=300)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def test_trainer_steps_joins_leaves_saves_weights_and_resumes(tiny_model, engine, tmp_path):
    cfg = TrainerConfig(
        model=str(tiny_model),
        grpo={"minibatches": 2, "micro_batch_tokens": 256},
        optim={"lr": 1e-2},
        elastic={"core_replicas": 1, "timeout_s": 60},
    )
    prompt = [5, 17, 300, 42]
    tok, before = served_logprob(engine, prompt)
    trainer = ElasticTrainer(cfg)
    try:
        trainer.start()
        r = trainer.step(records(0))
        assert (r.version, r.updates) == (1, 2)
        assert r.dropped_records == {"aborted": 1}
        want = sum(sum(t.loss_mask) for t in records(0) if t.status != "aborted")
        assert r.tokens == want and r.samples == 12 and r.groups == 3
        folder = trainer.save_weights(str(tmp_path / "weights" / "v1"))
        assert folder == str(tmp_path / "weights" / "v1")
        asyncio.run(load_into(engine, folder))
        # the engine now serves exactly the saved weights
        tok2, after = served_logprob(engine, prompt)
        expected = folder_logprob(folder, prompt, tok2)
        assert after == pytest.approx(expected, abs=1e-3)
        assert abs(after - before) > 1e-3 or tok2 != tok

        trainer.add_hybrid("h0")
        joined = None
        for s in range(1, 400):
            r = trainer.step(records(s))
            joined = next((e for e in r.events if e.kind == "joined"), None)
            if joined:
                break
        assert joined is not None and joined.replica == "h0" and joined.join_latency_s > 0
        r = trainer.step(records(500))
        states = {x.id: x.state for x in r.replicas}
        assert states == {"core0": "ready", "h0": "ready"}
        hashes = trainer.state_hashes()
        assert hashes["core0"] == hashes["h0"]
        trainer.remove_hybrid("h0")
        r = trainer.step(records(501))
        assert [e.kind for e in r.events] == ["left"]
        assert {x.id: x.state for x in r.replicas}["h0"] == "left"

        ckpt = trainer.save_checkpoint(str(tmp_path / "ckpt"))
        version = trainer.version
        trainer.step(records(777))
        expected_hash = trainer.state_hashes()["core0"]
    finally:
        trainer.close()
    # sharded trainer state, not a model folder (save_weights writes those)
    assert (Path(ckpt) / ".metadata").is_file() and not list(Path(ckpt).glob("*.safetensors"))
    resumed = ElasticTrainer(cfg, resume=ckpt)
    try:
        resumed.start()
        assert resumed.version == version
        resumed.step(records(777))
        assert resumed.state_hashes()["core0"] == expected_hash  # bit-exact resume
    finally:
        resumed.close()
