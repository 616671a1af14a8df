"""One row of `metrics.jsonl` per training step (pure: the loop hands in what it
measured). The fields are listed in docs/train.md, "What a run leaves behind"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from libra.record import Trajectory
from libra.train.groups import Group, Tally


@dataclass(frozen=True, slots=True)
class StepTimes:
    """Seconds of one step, as the loop measured them."""

    step_s: float
    """From the end of the previous step to the end of this one."""
    wait_s: float
    """Waiting for the batch's groups to finish."""
    train_s: float
    """The trainer's step."""
    publish_s: float
    """The weight sync: new weights written and loaded into every engine."""
    elapsed_s: float
    """Since training began."""


def step_row(
    rep: Any,
    batch: list[Group],
    records: list[Trajectory],
    version: int,
    times: StepTimes,
    *,
    tally: Tally,
    busy_s: float,
    reward: float,
    roles: dict[str, list[str]],
    val: tuple[int | None, float | None],
    switches: int,
) -> dict[str, Any]:
    """The row of the step that trained `version` into `rep.version`. `tally` and
    `busy_s` cover the episodes finished since the previous row; `reward` is the mean
    over every episode drawn for the step (dropped groups included)."""
    stale = [version - min((x.policy_version for x in r.turns), default=r.step) for r in records]
    per_batch = len(records) / max(tally.episodes, 1)
    step_s = times.step_s
    return {
        "step": rep.version,
        "time_s": round(times.elapsed_s, 2),
        "reward": reward,
        "reward_batch": rep.reward_mean,
        "reward_finished": tally.reward,
        "val_reward": val[1],
        "val_version": val[0],
        "tokens_per_s": sum(r.total_tokens for r in records) / step_s,
        "gen_tokens_per_s": tally.model_tokens / step_s,
        "train_tokens_per_s": rep.tokens_per_s,
        "roles": {r: len(ids) for r, ids in roles.items()},
        "workers": roles,
        "step_s": step_s,
        "wait_s": times.wait_s,
        "train_s": times.train_s,
        "publish_s": times.publish_s,
        "rollout_busy_s": busy_s,
        "rollout_s": busy_s * per_batch,
        "episodes": tally.episodes,
        "not_ok": tally.not_ok,
        "errors": sum(tally.errors.values()),
        "error_reasons": dict(tally.errors.most_common(3)),
        "groups": len(batch),
        "groups_dropped": tally.dropped,
        "groups_kept_equal": tally.kept_equal,
        "staleness_mean": sum(stale) / max(len(stale), 1),
        "staleness_max": max(stale, default=0),
        "stale_dropped": rep.dropped_records.get("stale", 0),
        "loss": rep.loss,
        "kl": rep.kl,
        "clip_frac": rep.clip_frac,
        "mismatch_kl": rep.mismatch_kl,
        "grad_norm": rep.grad_norm,
        "lr": rep.lr,
        "samples": rep.samples,
        "train_tokens": rep.tokens,
        "migrations": tally.migrations,
        "switches": switches,
        "replicas": {r.id: r.state for r in rep.replicas},
    }


__all__ = ["StepTimes", "step_row"]
