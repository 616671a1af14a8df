"""Typed settings of the planner (embeddable in `libra train` configs and TOML files)."""

from __future__ import annotations

from pydantic import Field, field_validator

from libra.config import Config


class RolloutSettings(Config):
    """How rollout instances are run (vLLM engine arguments the cost model needs)."""

    tp_sizes: list[int] = Field(default_factory=lambda: [1, 2, 4, 8])
    """Tensor-parallel sizes an instance may have; sizes the model does not fit in, or
    that exceed a node, are dropped per plan."""
    max_num_seqs: int = Field(256, ge=1)
    """vLLM `--max-num-seqs` (default 256): most sequences decoded in one step."""
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    """vLLM `--gpu-memory-utilization` (default 0.9): share of device memory vLLM takes."""
    max_num_batched_tokens: int = Field(8192, ge=256)
    """vLLM `--max-num-batched-tokens`: the prefill chunk, and the activation peak vLLM
    reserves memory for."""
    runtime_reserve_gib: float = Field(1.5, ge=0.0)
    """Memory outside weights, activations and KV (CUDA context, NCCL buffers, CUDA
    graphs); an assumption, see docs/cost-model.md."""

    @field_validator("tp_sizes")
    @classmethod
    def _powers_of_two(cls, v: list[int]) -> list[int]:
        if not v or any(t < 1 or t & (t - 1) for t in v):
            raise ValueError("tp_sizes must be non-empty powers of two, e.g. [1, 2, 4, 8]")
        return sorted(set(v))


class TrainSettings(Config):
    """What one RL iteration trains (verl/Megatron-style GRPO step)."""

    ref_model: bool = True
    """A frozen reference model's forward pass for the KL term (GRPO with KL loss; DAPO
    drops it)."""
    recompute_old_logprobs: bool = True
    """A forward pass of the actor before the update to get the old-policy log-probs."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per iteration (PPO mini-batches); gradients sync once per step."""
    micro_batch_tokens: list[int] = Field(default_factory=lambda: [4096, 8192, 16384, 32768, 65536])
    """Token budgets per micro-batch the search tries (dynamic batching packs sequences;
    a sequence is never split, so budgets below the longest one are skipped)."""
    max_pp: int = Field(16, ge=1)
    """Largest pipeline-parallel size the search tries."""
    memory_fraction: float = Field(0.9, gt=0.0, le=1.0)
    """Share of device memory a training config may plan for (allocator fragmentation,
    NCCL buffers)."""
    overlap_grad_reduce: bool = False
    """Whether the data-parallel gradient reduction hides behind the backward pass."""
    logprob_chunk_tokens: int | None = Field(None, ge=1)
    """Positions whose float32 logits over the vocabulary exist at once in a pass (Libra's
    trainer computes log-probs in chunks: `grpo.logprob_chunk_tokens`). None: the whole
    micro-batch's logits, as a trainer without a chunked or fused loss holds them."""


class PlannerSettings(Config):
    """The search itself."""

    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    train: TrainSettings = Field(default_factory=TrainSettings)
    sync: bool = False
    """Synchronous RL: an iteration costs T_rollout + T_train + weight sync instead of
    max(T_rollout, T_train)."""
    bins: int = Field(32, ge=1, le=256)
    """Length bins the sorted requests are grouped into before the dynamic program (equal
    generated tokens per bin, so the tail is finely resolved)."""
    min_train_gpus: int = Field(1, ge=1)
    """Fewest GPUs training may get."""
    min_rollout_gpus: int = Field(1, ge=1)
    """Fewest GPUs rollout may get."""
    colocated_memory: float = Field(0.5, gt=0.0, le=1.0)
    """A colocated (time-shared) plan's rollout engines get this share of each device's
    memory beside the resident training state (verl's `rollout.gpu_memory_utilization`
    default); only `plan_colocated` and the colocated candidate of `plan(...,
    colocated=True)` use it."""


__all__ = ["PlannerSettings", "RolloutSettings", "TrainSettings"]
