"""`SimConfig`: one simulated run (what `libra simulate` flags set)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from libra.config import Config
from libra.planner import ReplanConfig
from libra.routing.config import RoutingConfig

DEFAULT_PROMPTS = {"search-r1": 32, "r2e-gym": 16, "dapo-math": 16}
"""Prompts per step when a run does not say: the shapes of the frozen traces in
`tests/data` (docs/workloads.md); the paper does not give its batch sizes."""


class SimConfig(Config):
    workload: str = "r2e-gym"
    """A generator (`search-r1`, `r2e-gym`, `dapo-math`) or a trace file of trajectory
    records (grouped into training steps by their `step` field)."""
    gpus: int = Field(48, ge=2)
    """GPUs in the cluster."""
    hardware: str = "a800-80g"
    """Hardware profile id or a profile .toml (`libra plan --hardware`)."""
    model: str = "qwen3-14b"
    """Model profile id or a folder with config.json."""
    steps: int = Field(100, ge=1)
    """Training steps to simulate."""
    prompts: int | None = Field(None, ge=1)
    """Prompts per step (default: 32 for search-r1, 16 otherwise)."""
    group: int = Field(16, ge=1)
    """Samples per prompt (GRPO group; the paper uses 16)."""
    seed: int = 0
    """Seed of the generated workload (the simulation itself has no randomness)."""
    staleness: int = Field(1, ge=1)
    """Asynchronous systems: an episode of step s starts only once the weights of version
    s - staleness reached the rollout side (AReaL's `max_head_offpolicyness`; 1 = one
    step off-policy, as verl's one-step-off-policy recipe and the planner assume)."""
    pipeline: Literal["stream", "batch"] = "batch"
    """`stream`: the next batch's episodes start as soon as staleness allows (AReaL-style);
    `batch`: a batch also waits until the previous batch has finished rolling out."""
    dispatch: Literal["spill", "exact"] = "spill"
    """Where a placed episode runs among the buckets that can serve it. `spill`: the
    least-loaded live instance (sequences per GPU) of the routing policy's bucket or a
    larger one (a larger bound also fits it), so work waiting on a crowded small bucket
    goes to idle larger instances; `exact`: the least-loaded instance of the policy's
    bucket only (the policy's choice taken literally)."""
    engine_start_s: float = Field(60.0, ge=0.0)
    """Seconds to start a rollout engine on GPUs it did not run on (process, CUDA graphs,
    warm-up), plus its weight shard over the network (`reconfig_cost`'s default)."""
    train_restart_s: float = Field(60.0, ge=0.0)
    """Seconds to restart a trainer whose topology changes (`reconfig_cost`'s default)."""
    hybrid_wake_s: float = Field(5.0, ge=0.0)
    """Seconds for a hybrid worker to switch back from training to rollout (vLLM sleep
    mode: weights back from host memory, KV cache re-allocated); an assumption."""
    greedy_band: float = Field(0.1, ge=0.0)
    """verl-Greedy-Heuristic moves GPUs only when the slower side was slower by more than
    this fraction."""
    colocated_memory: float = Field(0.5, gt=0.0, le=1.0)
    """verl-Colocated: the share of device memory the rollout engine gets next to the
    resident training state (verl's `rollout.gpu_memory_utilization` default)."""
    pilot_steps: int = Field(3, ge=1)
    """Steps of the pilot runs that choose the simulated-best static layouts
    (areal-static-optimal, best-static-colocated, ceiling; `libra.sim.search`): every
    candidate runs the first `pilot_steps` batches and the one whose pilot predicts the
    shortest run is kept."""
    replan: ReplanConfig = Field(default_factory=ReplanConfig)
    """When the planner-driven systems replan (`libra.planner.ReplanPolicy`)."""
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    """Options of the systems' routing policies (C-MLFQ's `objective`, ...), as in a
    rollout config's `routing` table."""

    def prompts_for(self, workload: str) -> int:
        return self.prompts or DEFAULT_PROMPTS.get(workload, 16)


__all__ = ["DEFAULT_PROMPTS", "SimConfig"]
