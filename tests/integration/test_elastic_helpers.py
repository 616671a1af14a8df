"""Helpers for the multi-process elastic tests (no tests here): a micro model folder and
a config; scenarios run through `libra.trainer.scenario.run_scenario`."""

from __future__ import annotations

from pathlib import Path

from libra.trainer.config import TrainerConfig
from libra.trainer.scenario import read_log, run_scenario


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


def config(model: Path, **elastic) -> str:
    cfg = TrainerConfig(model=str(model), elastic=elastic)
    return cfg.model_dump_json()


__all__ = ["config", "micro_model", "read_log", "run_scenario"]
