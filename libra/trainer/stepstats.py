"""Fold the coordinator's per-update results of one step into a `StepReport`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from libra.trainer.report import StepReport, StepResult
from libra.trainer.samples import Prepared

if TYPE_CHECKING:
    from libra.trainer.trainer import ElasticTrainer

STALL_KEYS = ("wait_group_s", "wait_copy_s", "recover_s")


def aggregate(
    trainer: ElasticTrainer, prep: Prepared, results: list[StepResult], elapsed: float
) -> StepReport:
    tokens = sum(r.tokens for r in results)
    m: dict[str, float] = {}
    for r in results:
        for k, v in r.metrics.items():
            m[k] = m.get(k, 0.0) + v
    per_tok = max(tokens, 1)
    rollout = max(m.get("rollout_tokens", 0.0), 1.0)
    return StepReport(
        version=trainer.version,
        updates=trainer.updates,
        samples=sum(r.samples for r in results),
        tokens=tokens,
        groups=prep.groups,
        reward_mean=prep.reward_mean,
        dropped_records=dict(prep.dropped),
        loss=m.get("loss", 0.0) / per_tok,
        kl=m.get("kl", 0.0) / per_tok,
        clip_frac=m.get("clipped", 0.0) / per_tok,
        mismatch_kl=m.get("mismatch_kl", 0.0) / rollout,
        tis_capped_frac=m.get("tis_capped", 0.0) / rollout,
        grad_norm=step_grad_norm(results),
        lr=results[-1].lr if results else 0.0,
        step_s=elapsed,
        tokens_per_s=tokens / elapsed if elapsed > 0 else 0.0,
        core_stall_s=sum(r.timings.get(k, 0.0) for r in results for k in STALL_KEYS),
        replicas=trainer.replicas(),
        events=trainer.take_events(),
    )


def step_grad_norm(results: list[StepResult]) -> float:
    """The last update's gradient norm, or the first that was not finite (its update was
    skipped: the step reports it even when a later minibatch's update went through)."""
    for r in results:
        if not math.isfinite(r.grad_norm):
            return r.grad_norm
    return results[-1].grad_norm if results else 0.0


__all__ = ["aggregate", "step_grad_norm"]
