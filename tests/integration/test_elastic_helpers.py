"""Helpers for the multi-process elastic tests (no tests here): a micro model folder and a
scenario runner that spawns self-driven members."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

from libra.trainer.config import TrainerConfig
from libra.trainer.scenario import MemberPlan, main


def micro_model(folder: Path, *, hidden: int = 32, layers: int = 2, vocab: int = 256) -> Path:
    """A tiny random Qwen2 folder (config + safetensors) written with transformers."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=256, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(folder)
    return folder


def run_scenario(
    plans: list[MemberPlan], *, timeout: float = 240, kill: tuple | None = None
) -> dict[str, list[dict]]:
    """Spawn one process per plan, wait for all; returns each log's rows by `id-rank`.

    `kill=(key, predicate, signal)`: once `predicate(rows)` holds for the log `key`,
    send `signal` to that process (the test's crash / hang of a hybrid).
    """
    ctx = mp.get_context("spawn")
    procs = {f"{p.id}-{p.rank}": ctx.Process(target=main, args=(p,)) for p in plans}
    for p in procs.values():
        p.start()
    logs = {f"{p.id}-{p.rank}": p.log for p in plans}
    deadline = time.monotonic() + timeout
    killed = None
    try:
        while any(p.is_alive() for k, p in procs.items() if k != killed):
            if time.monotonic() > deadline:
                raise TimeoutError("scenario did not finish")
            if kill and killed is None:
                key, pred, sig = kill
                if pred(read_log(logs[key])):
                    os.kill(procs[key].pid, sig)
                    killed = key
            time.sleep(0.05)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join()
    for k, p in procs.items():
        if k != killed and p.exitcode != 0:
            raise RuntimeError(f"member {k} exited with {p.exitcode}")
    return {k: read_log(v) for k, v in logs.items()}


def read_log(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def config(model: Path, **elastic) -> str:
    cfg = TrainerConfig(model=str(model), elastic=elastic)
    return cfg.model_dump_json()
