"""What a simulated run reports: throughput, time, GPU use by role, routing, decisions."""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from libra.sim.cluster import Simulation


def forward_model(sim: Simulation) -> dict[str, Any] | None:
    """How the replanner's predictions did (None for a system that does not replan):
    every layout it chose, scored on its first step run wholly in it against the
    prediction made before it ran (`Replanner.scores`); the median relative error."""
    scores = getattr(sim.controller, "scores", None)
    if scores is None:
        return None
    errors = [s["rel_error"] for s in scores]
    return {
        "scored": len(scores),
        "median_rel_error": round(statistics.median(errors), 4) if errors else None,
        "scores": scores,
    }


def summarize(sim: Simulation, cpu_s: float, wall_s: float) -> dict[str, Any]:
    """The result of one system's run, as plain data (the `--json` document's entry)."""
    env, steps = sim.env, sim.steps
    gpus = env.cfg.gpus
    time_s = sim.t_end[steps - 1]
    tokens = [sum(e.generated for e in env.workload.batch(s)) for s in range(steps)]
    total_tokens = sum(tokens)
    per_step = []
    prev = 0.0
    for s in range(steps):
        per_step.append(
            {
                "step": s,
                "released_s": _r(sim.released[s]),
                "rollout_done_s": _r(sim.done[s]),
                "train_start_s": _r(sim.t_start[s]),
                "train_end_s": _r(sim.t_end[s]),
                "rollout_s": _r(sim.done[s] - sim.released[s]),
                "train_s": _r(sim.t_end[s] - sim.t_start[s]),
                "train_gpus": sim.train_gpus[s],
                "tokens": tokens[s],
                "throughput": round(tokens[s] / max(sim.t_end[s] - prev, 1e-9), 1),
            }
        )
        prev = sim.t_end[s]
    gpu_s = gpus * time_s
    rollout = sim.fleet.busy_gpu_s()
    train = sim.trainer.busy_gpu_s
    reconfig = sim.reconfig_gpu_s + sim.trainer.stall_gpu_s
    fleet = sim.fleet
    episodes = sum(len(env.workload.batch(s)) for s in range(steps))
    all_tokens = sum(e.total for s in range(steps) for e in env.workload.batch(s))
    applied = [d for d in sim.decisions if d.get("apply")]
    return {
        "system": sim.spec.name,
        "summary": sim.spec.summary,
        "steps": steps,
        "time_s": round(time_s, 1),
        "tokens": total_tokens,
        "throughput": round(total_tokens / time_s, 1),
        "utilization": {
            "rollout": round(rollout / gpu_s, 4),
            "training": round(train / gpu_s, 4),
            "reconfiguration": round(reconfig / gpu_s, 4),
            "idle": round(max(0.0, 1.0 - (rollout + train + reconfig) / gpu_s), 4),
        },
        "routing": {
            "policy": sim.spec.routing
            + (f" from tool return {sim.spec.oracle_from}" if sim.spec.oracle_from else ""),
            "moves_per_episode": {k: round(v / episodes, 4) for k, v in fleet.moves.items()},
            "migrated_token_ratio": round(fleet.reprefill_tokens / max(all_tokens, 1), 4),
        },
        "layout": {"initial": sim.initial_layout.describe(), "final": sim.layout.describe()},
        "replans": {"decisions": len(sim.decisions), "applied": len(applied)},
        "forward_model": forward_model(sim),
        "trainer_restarts": sim.trainer.restarts,
        "hybrid": {
            "loans": sim.pool.lent if sim.pool is not None else 0,
            "replica_steps": sim.pool.trained_with if sim.pool is not None else 0,
        },
        "per_step": per_step,
        "decisions": sim.decisions,
        "timeline": [[round(t, 2), a, b, c] for t, a, b, c in sim.timeline],
        "sim": {"events": sim.loop.events, "cpu_s": round(cpu_s, 3), "wall_s": round(wall_s, 3)},
    }


def _r(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 2)


__all__ = ["summarize"]
