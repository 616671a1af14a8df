"""The run folder and what a resume needs.

    out/
      config.json        the resolved config of the run (a resume must match it)
      state.json         loop state at the last checkpoint (below)
      checkpoint/        trainer checkpoint: weights + optimizer, sharded as the trainer's
                         ranks hold them, + version (`libra.trainer.checkpoint`)
      model/             the weights at the end of the run as an HF folder
                         (`libra serve-engine --model out/model` serves it)
      base/ sft/         the made model and the warm-started one
      weights/v{N}/      published versions (the newest few)
      hardware.json      the calibrated `local` profile
      routing-tree.json  what C-MLFQ learned
      metrics.jsonl decisions.jsonl events.jsonl trajectories.jsonl plots/ logs/

`state.json` and `checkpoint/` are written together at a step boundary (checkpoint
first, then the state file atomically), so the state always names a checkpoint that
exists. A resume restarts the trainer from `checkpoint/` (at any `replica_ranks`), the
engines on its weights (exported to `weights/v{N}/` when weights travel by disk),
the task stream at its position and the hybrids in their roles; episodes that were in
flight are started again (their groups' tasks are drawn afresh).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libra.config import without_secrets
from libra.errors import ConfigError
from libra.paths import holds_working_folder
from libra.train.config import TrainConfig
from libra.train.planning import SwitchCosts

RESUME_FREE = ("steps", "report", "out", "weights", "rollout.workers",
               "rollout.max_failed_steps", "trainer.max_skipped_updates")  # fmt: skip
"""Config keys a resumed run may change (`weights`: how versions travel;
`rollout.workers`: how many processes run the episodes; the two limits that stop a run
that cannot learn, `libra.train.guards`, which a stopped run's message names)."""


@dataclass(slots=True)
class LoopState:
    """What the loop keeps across a resume besides the trainer checkpoint (`state.json`
    holds it as `loop`)."""

    switches: int = 0
    costs: SwitchCosts = field(default_factory=lambda: SwitchCosts(10.0, 10.0))
    """Measured reconfiguration costs (the planner's), estimates until measured."""
    val_version: int | None = None
    val_reward: float | None = None
    first_reward: float | None = None

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> LoopState:
        state = cls(**doc)
        if isinstance(state.costs, dict):
            state.costs = SwitchCosts(**state.costs)
        return state


def write_json(path: Path, doc: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_state(out: Path) -> dict[str, Any] | None:
    """The run's `state.json` (None: there is none); `ConfigError` when it is damaged."""
    p = out / "state.json"
    if not p.is_file():
        return None
    try:
        doc = json.loads(p.read_text())
    except (ValueError, OSError) as e:  # UnicodeDecodeError is a ValueError
        raise ConfigError(f"{p} cannot be read ({e}); the run's state is damaged: "
                          "pass --fresh to start over, or set another out") from None  # fmt: skip
    if not isinstance(doc, dict):
        raise ConfigError(f"{p} is not a run's state (a JSON object); pass --fresh to "
                          "start the run over, or set another out")  # fmt: skip
    return doc


def _comparable(cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` less the keys a resume may change (dotted: a key inside a section) and its
    secrets (not saved: `Config.public`)."""
    out = {k: v for k, v in without_secrets(cfg).items() if k not in RESUME_FREE}
    for key in RESUME_FREE:
        section, _, name = key.partition(".")
        if name and isinstance(out.get(section), dict):
            out[section] = {k: v for k, v in out[section].items() if k != name}
    return out


def _as_now(cls: type[TrainConfig], saved: dict[str, Any]) -> dict[str, Any]:
    """A saved config as this version of Libra reads it: keys added since then take
    their defaults (a run started before a new option resumes)."""
    try:
        return cls.model_validate(saved).model_dump(mode="json")
    except ValueError:  # a key since removed or renamed: compared as it is, and differs
        return saved


RUN_KEYS = frozenset({"out", "seed", "steps", "model", "data", "rollout", "trainer"})
"""Keys the `config.json` of every `libra train` run has (a model folder's has none)."""


def is_run(out: Path) -> bool:
    """Whether `out` holds a `libra train` run: a `config.json` that is a run's config
    (a model folder has a `config.json` too)."""
    try:
        doc = json.loads((out / "config.json").read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and doc.keys() >= RUN_KEYS


def _check_replaceable(out: Path, why: str) -> None:
    """A `ConfigError` unless `out` is a run's folder that may be deleted: never a folder
    that is not a run (a model, a home), nor the working folder or one above it."""
    if holds_working_folder(out):
        raise ConfigError(f"out {str(out)!r} is the working folder or holds it; set another out")
    if not is_run(out):
        names = ", ".join(sorted(p.name for p in out.iterdir())[:4])
        raise ConfigError(
            f"{out} is not empty ({names}) and is not a libra train run, so it is left as "
            f"it is ({why}); set another out"
        )


def prepare_out(cfg: TrainConfig, *, fresh: bool) -> tuple[Path, dict[str, Any] | None]:
    """The run folder, and the state to resume from (None: a new run).

    An existing run in `out` is resumed when its config matches (only the keys of
    `RESUME_FREE` may differ); `fresh` deletes it first. Only a run's folder is ever
    deleted (`is_run`): `--fresh` deleted whatever `out` named, and a model folder (it
    has a `config.json`) was taken for a run that never reached a checkpoint."""
    out = Path(cfg.out)
    if not cfg.out.strip():
        raise ConfigError('out is empty; name the run\'s folder (e.g. out = "runs/train")')
    if out.is_symlink():
        raise ConfigError(f"out {str(out)!r} is a symbolic link (to {os.readlink(out)!r}); "
                          "name the folder itself")  # fmt: skip
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out {str(out)!r} is a file; name a folder for the run")
    if fresh and out.exists() and any(out.iterdir()):
        _check_replaceable(out, "--fresh replaces only a run's folder")
        shutil.rmtree(out)
    state = read_state(out) if out.is_dir() else None
    if state is None:
        if out.exists() and any(out.iterdir()):
            _check_replaceable(out, "pass --fresh only to replace a run")
            shutil.rmtree(out)  # a run of ours that never reached a checkpoint: redo it
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"out {str(out)!r} cannot be made ({e.strerror or e}); "
                              "name a folder this user can write") from None  # fmt: skip
        write_json(out / "config.json", cfg.public())
        return out, None
    try:
        saved_doc = json.loads((out / "config.json").read_text())
    except (ValueError, OSError) as e:
        raise ConfigError(f"{out} holds a state.json but its config.json cannot be "
                          f"read ({e}); set another out") from None  # fmt: skip
    saved = _comparable(_as_now(type(cfg), saved_doc))
    mine = cfg.public()
    if saved != _comparable(mine):
        now = _comparable(mine)
        diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        raise ConfigError(
            f"{out} holds a run started with a different config ({', '.join(diff)} differ); "
            "pass --fresh to start over, or set another out"
        )
    write_json(out / "config.json", mine)
    return out, state


__all__ = ["RESUME_FREE", "LoopState", "prepare_out", "read_state", "write_json"]
