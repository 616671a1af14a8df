"""`libra train`: planner-controlled agentic RL end to end.

    from libra.train import load_config, train
    from libra.rollout.run import run_sync

    summary = run_sync(train(load_config("examples/cpu-train.toml", {"seed": 1})))

Modules, in the order a run uses them: `config` (the TOML schema), `state` (run folder,
resume, `LoopState`), `run` (parse, build, train, close) and `build` (`build_run -> Run`),
`setup` (model, hardware profile, warm start, trainer config), `demos` (expert
demonstrations), `placement` (workers, their devices, the engine launcher), `workers`
(the `Fleet`: engines on workers), `handle` (async calls into the trainer), `rollouts`
(admission, episodes, groups) + `admission` (bounded staleness) + `groups`, `loop` (the
asynchronous GRPO loop) + `metrics` (its rows) + `validation`, `reconfig` (the planner's
decisions applied) with `planning` (pure), `roles` (hybrid switches) and `relayout`
(core instances restarted at other TP sizes), `display`, `report`, `dryrun`. Weights
move through `libra.weights`, processes start through `libra.cluster`. Design:
docs/train.md; the layering: docs/architecture.md.
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
