"""What `ElasticTrainer` reports: per step, per replica, per membership change."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

ReplicaState = Literal["starting", "waiting", "joining", "ready", "leaving", "left", "dropped"]


@dataclass(slots=True)
class ReplicaStatus:
    id: str
    kind: Literal["core", "hybrid"]
    state: ReplicaState
    """starting (process coming up) -> waiting (registered, not admitted yet) -> joining
    (a member contributing zeros while its snapshot arrives) -> ready -> leaving -> left;
    or dropped (crashed / hung, removed by recovery)."""
    ranks: int
    start_s: float | None = None
    """Process start to registration (model load, groups)."""
    join_latency_s: float | None = None
    """Registration to the update after which it contributes real gradients."""


@dataclass(slots=True)
class MembershipEvent:
    kind: Literal["joined", "left", "dropped"]
    replica: str
    update: int
    """`joined`: the update it caught up with (real gradients from the next one);
    `left`: its last update; `dropped`: the update recovery restarted from."""
    join_latency_s: float | None = None
    stall_s: float = 0.0
    """Seconds the core spent on this change: waiting for new groups, for the snapshot
    staging copy, and in failure recovery (measured on the coordinator)."""
    reason: str | None = None
    """`left` without being asked: why the replica gave up (its snapshot did not arrive
    within `elastic.max_catchup_mb`, or failed)."""


@dataclass(slots=True)
class StepReport:
    """One `ElasticTrainer.step`: one policy version, `minibatches` optimizer updates."""

    version: int
    """Policy version after this step (= steps done)."""
    updates: int
    """Optimizer updates done so far."""
    samples: int
    tokens: int
    """Loss tokens trained on (all replicas)."""
    groups: int
    reward_mean: float
    dropped_records: dict[str, int]
    loss: float
    """Token-mean loss (the quantity whose gradient was applied)."""
    kl: float
    clip_frac: float
    """Share of loss tokens where the clipped ratio was active."""
    mismatch_kl: float
    """k3 estimate of KL(rollout policy || trainer) per token: engine mismatch + staleness."""
    tis_capped_frac: float
    grad_norm: float
    lr: float
    step_s: float
    tokens_per_s: float
    core_stall_s: float
    """Seconds of this step the core spent on membership changes (see MembershipEvent)."""
    replicas: list[ReplicaStatus] = field(default_factory=list)
    events: list[MembershipEvent] = field(default_factory=list)


__all__ = ["MembershipEvent", "ReplicaState", "ReplicaStatus", "StepReport"]
