"""`libra train`: planner-controlled agentic RL end to end.

    from libra.train import load_config, train
    from libra.rollout.run import run_sync

    summary = run_sync(train(load_config("examples/cpu-train.toml", {"seed": 1})))

Modules, in the order a run uses them: `config` (the TOML schema), `state` (run folder,
resume), `setup` (model, hardware profile, warm start), `demos` + `sft` (expert
demonstrations and the supervised warm start), `fleet` + `engines` (workers, engines, role
switches) + `vllm_fleet` (`fleet.kind = "vllm"`: vLLM servers), `admission` (bounded
staleness), `groups`, `loop` (the asynchronous GRPO loop), `planning` (the planner in
the loop) + `relayout` (core instances restarted at other TP sizes), `display`,
`report`, `dryrun`. Design: docs/train.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from libra.train.config import TrainConfig


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """A `TrainConfig` from TOML plus dotted-key overrides; a bad value is a
    `ConfigError` naming the file and the field's path."""
    from libra import config

    return config.load(TrainConfig, path, overrides)


def train(cfg: TrainConfig, *, fresh: bool = False) -> Any:
    """The run as a coroutine (see `libra.train.run.train`)."""
    from libra.train.run import train as _train

    return _train(cfg, fresh=fresh)


__all__ = ["TrainConfig", "load_config", "train"]
