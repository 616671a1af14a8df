"""Rollout cost: one inference instance (vLLM-like, continuous batching) of TP size t.

Decode is memory-bound: a step reads, on *each* GPU of the instance, that GPU's shard of
the weights plus the KV cache of every sequence in the batch, at that GPU's own HBM
bandwidth. (The reference code divided the per-GPU bytes by the bandwidth of the whole TP
group, so its decode time fell with t squared.) TP also adds two all-reduces per layer
per step (after attention and after the MLP), which is why large TP pays off for latency
but not for throughput. KV heads shard over TP only up to their count: beyond it each GPU
keeps a replica of one head, so KV bytes per GPU stop shrinking. Prefill is
compute-bound and chunked (`max_num_batched_tokens`).

Every function takes plain numbers (and numpy arrays where noted) and is pure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from libra.planner.comm import allreduce_time
from libra.planner.profiles import GIB, HardwareProfile, ModelProfile
from libra.planner.settings import RolloutSettings

_DEFAULT = RolloutSettings()


def tp_supported(model: ModelProfile, hw: HardwareProfile, tp: int) -> bool:
    """Whether an instance of TP `tp` can shard this model (vLLM's rules: query heads
    divide evenly; KV heads divide evenly or are replicated) within one node."""
    if tp < 1 or tp > hw.devices_per_node or model.heads % tp:
        return False
    return model.kv_heads % tp == 0 or tp % model.kv_heads == 0


def kv_heads_per_gpu(model: ModelProfile, tp: int) -> int:
    """KV heads each GPU stores: kv_heads / tp, but at least one (replicated beyond)."""
    return max(1, model.kv_heads // tp)


def kv_bytes_per_token_per_gpu(model: ModelProfile, tp: int) -> int:
    return 2 * model.layers * kv_heads_per_gpu(model, tp) * model.head_dim * model.dtype_bytes


def activation_reserve_bytes(model: ModelProfile, tp: int, settings: RolloutSettings) -> float:
    """Peak activation memory vLLM profiles for a full prefill chunk, per GPU: the MLP
    intermediate (gate+up), a few hidden-state buffers, and the sampler's fp32 logits."""
    chunk = settings.max_num_batched_tokens
    if model.is_moe:
        mlp = chunk * model.experts_active * 2 * model.moe_intermediate / tp
    else:
        mlp = chunk * 2 * model.intermediate / tp
    hidden = chunk * 8 * model.hidden
    logits = settings.max_num_seqs * model.vocab * 4 / tp
    return mlp * model.dtype_bytes + hidden * model.dtype_bytes + logits


def kv_capacity_tokens(
    model: ModelProfile, hw: HardwareProfile, tp: int, settings: RolloutSettings | None = None
) -> int:
    """Tokens of KV cache one instance holds (0 when the weights do not fit): memory left
    on each GPU after weights, activations and runtime, over the per-GPU KV bytes."""
    s = settings or _DEFAULT
    free = (
        hw.memory_bytes * s.gpu_memory_utilization
        - model.weight_bytes / tp
        - activation_reserve_bytes(model, tp, s)
        - s.runtime_reserve_gib * GIB
    )
    return max(0, int(free // kv_bytes_per_token_per_gpu(model, tp)))


@dataclass(frozen=True, slots=True)
class InstanceCost:
    """Per-step constants of one instance type; its methods accept numpy arrays."""

    tp: int
    kv_capacity: int
    """KV-cache tokens of one instance."""
    kv_time_per_token: float
    """Seconds to read one context token's KV on each GPU."""
    dense_read_s: float
    """Seconds to read the always-used weights (all of a dense model) on each GPU."""
    expert_read_s: float
    """Seconds to read one expert's shard on each GPU, per layer summed (MoE only)."""
    experts: int
    experts_active: int
    cmp_per_token_s: float
    """Compute seconds of one token's matmuls (per GPU)."""
    cmp_per_pair_s: float
    """Compute seconds of one (query, context token) attention pair (per GPU)."""
    comm_step_s: float
    """Fixed all-reduce latency of one step (2 per layer), plus the engine overhead."""
    comm_per_token_s: float
    """Seconds per sequence of a decode step outside the max(memory, compute): its
    all-reduce transfer (2 per layer) plus the engine's per-sequence overhead."""
    link_per_token_s: float
    """All-reduce transfer seconds of one prefilled token (no per-sequence overhead)."""

    @property
    def fits(self) -> bool:
        return self.kv_capacity > 0

    def weight_read_s(self, batch: np.ndarray | float) -> np.ndarray | float:
        """Seconds to read the weights a step of `batch` sequences touches (per GPU)."""
        if not self.experts:
            return self.dense_read_s + 0.0 * batch
        miss = (1.0 - self.experts_active / self.experts) ** np.maximum(batch, 1.0)
        return self.dense_read_s + self.expert_read_s * self.experts * (1.0 - miss)

    def step_s(
        self, batch: np.ndarray | float, kv_tokens: np.ndarray | float
    ) -> np.ndarray | float:
        """One decode step of `batch` sequences holding `kv_tokens` context in total."""
        mem = self.weight_read_s(batch) + kv_tokens * self.kv_time_per_token
        cmp = batch * self.cmp_per_token_s + kv_tokens * self.cmp_per_pair_s
        return np.maximum(mem, cmp) + self.comm_step_s + batch * self.comm_per_token_s

    def step_time(self, batch: float, kv_tokens: float) -> float:
        """`step_s` for one batch state, in plain floats (no numpy dispatch: the
        discrete-event simulator calls it several times per event)."""
        read = self.dense_read_s
        if self.experts:
            miss = (1.0 - self.experts_active / self.experts) ** max(batch, 1.0)
            read += self.expert_read_s * self.experts * (1.0 - miss)
        mem = read + kv_tokens * self.kv_time_per_token
        cmp = batch * self.cmp_per_token_s + kv_tokens * self.cmp_per_pair_s
        return max(mem, cmp) + self.comm_step_s + batch * self.comm_per_token_s

    def prefill_time(self, tokens: float, context: float = 0.0, chunk: int = 8192) -> float:
        """`prefill_time` on this instance type (`chunk`: `max_num_batched_tokens`)."""
        if tokens <= 0:
            return 0.0
        chunks = math.ceil(tokens / chunk)
        pairs = tokens * context + tokens * tokens / 2.0
        compute = float(self.prefill_s(float(tokens), pairs))
        weights = chunks * float(self.weight_read_s(float(chunk)))
        return max(compute, weights) + chunks * self.comm_step_s

    def prefill_s(
        self, tokens: np.ndarray | float, pairs: np.ndarray | float
    ) -> np.ndarray | float:
        """Compute time of prefilling `tokens` new tokens that attend over `pairs`
        (query, key) pairs, plus their all-reduce transfer (weights are read anyway by
        the decode steps the chunks ride along with)."""
        return tokens * (self.cmp_per_token_s + self.link_per_token_s) + pairs * self.cmp_per_pair_s


def instance_cost(
    model: ModelProfile, hw: HardwareProfile, tp: int, settings: RolloutSettings | None = None
) -> InstanceCost:
    """The constants of an instance of TP `tp` (check `.fits` before using it)."""
    s = settings or _DEFAULT
    bw = hw.hbm_bandwidth * hw.eff.hbm
    fl = hw.flops * hw.eff.prefill_mfu
    expert_bytes = (
        model.expert_params * model.dtype_bytes * model.layers / tp if model.is_moe else 0
    )
    dense_bytes = model.weight_bytes / tp - expert_bytes * (model.experts if model.is_moe else 0)
    link = allreduce_time(hw, 1.0, tp) - hw.eff.allreduce_latency_s if tp > 1 else 0.0
    link_per_token = 2 * model.layers * link * model.hidden * model.dtype_bytes
    return InstanceCost(
        tp=tp,
        kv_capacity=kv_capacity_tokens(model, hw, tp, s) if tp_supported(model, hw, tp) else 0,
        kv_time_per_token=kv_bytes_per_token_per_gpu(model, tp) / bw,
        dense_read_s=dense_bytes / bw,
        expert_read_s=expert_bytes / bw,
        experts=model.experts,
        experts_active=model.experts_active,
        cmp_per_token_s=model.flops_per_token / tp / fl,
        cmp_per_pair_s=model.attn_flops_per_pair / tp / fl,
        comm_step_s=(2 * model.layers * hw.eff.allreduce_latency_s if tp > 1 else 0.0)
        + hw.eff.step_overhead_s,
        comm_per_token_s=link_per_token + hw.eff.seq_overhead_s,
        link_per_token_s=link_per_token,
    )


# --- scalar conveniences (the API the simulator and the routing code call) ------------------
def decode_step_time(
    model: ModelProfile,
    hw: HardwareProfile,
    tp: int,
    batch: int,
    context: float | Sequence[int],
    settings: RolloutSettings | None = None,
) -> float:
    """Seconds of one decode step of `batch` sequences on a TP-`tp` instance. `context` is
    the total context tokens of the batch, or the list of each sequence's length."""
    total = float(context if isinstance(context, int | float) else sum(context))
    return float(instance_cost(model, hw, tp, settings).step_s(float(batch), total))


def prefill_time(
    model: ModelProfile,
    hw: HardwareProfile,
    tp: int,
    tokens: int,
    context: int = 0,
    settings: RolloutSettings | None = None,
) -> float:
    """Seconds to prefill `tokens` new tokens after `context` cached ones, alone on the
    instance: chunked into `max_num_batched_tokens`, each chunk bound by compute or by
    reading the weights, whichever is slower."""
    if tokens <= 0:
        return 0.0
    s = settings or _DEFAULT
    return instance_cost(model, hw, tp, s).prefill_time(tokens, context, s.max_num_batched_tokens)


__all__ = [
    "InstanceCost",
    "activation_reserve_bytes",
    "decode_step_time",
    "instance_cost",
    "kv_bytes_per_token_per_gpu",
    "kv_capacity_tokens",
    "kv_heads_per_gpu",
    "prefill_time",
    "tp_supported",
]
