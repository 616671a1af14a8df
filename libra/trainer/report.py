"""What the trainer reports: per rank and update (`StepResult`, sent to the driver), and
from `ElasticTrainer` per step, per replica, per membership change."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(slots=True)
class StepResult:
    """One optimizer update as one rank saw it. Sums are global (all replicas)."""

    update: int
    applied: bool
    """This rank's state now includes `update` (false while catching up)."""
    contributed: bool
    """This rank trained on its samples (its gradient was real)."""
    tokens: int = 0
    samples: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    grad_norm: float = 0.0
    lr: float = 0.0
    epoch: str = ""
    members: list[str] = field(default_factory=list)
    joining: list[str] = field(default_factory=list)
    """Members admitted by this update (they are in the next epoch)."""
    leaving: list[str] = field(default_factory=list)
    """Members that left after this update."""
    dropped: list[str] = field(default_factory=list)
    """Members a failure recovery dropped during this call."""
    became_ready: bool = False
    """This rank finished catching up with this update (its first real gradient is next)."""
    join_latency_s: float | None = None
    """With `became_ready`: seconds from registration to now."""
    left: bool = False
    """This rank left training after this update."""
    reason: str | None = None
    """With `left`: why, when the replica gave up by itself (its snapshot was too slow)
    rather than being asked to leave."""
    timings: dict[str, float] = field(default_factory=dict)


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
    """The last update's pre-clip gradient norm; NaN or infinity when an update of the
    step was skipped for a gradient that was not finite (`Replica.apply`)."""
    lr: float
    step_s: float
    tokens_per_s: float
    core_stall_s: float
    """Seconds of this step the core spent on membership changes (see MembershipEvent)."""
    replicas: list[ReplicaStatus] = field(default_factory=list)
    events: list[MembershipEvent] = field(default_factory=list)


__all__ = ["MembershipEvent", "ReplicaState", "ReplicaStatus", "StepReport", "StepResult"]
