"""Training cost of one RL iteration's update: TP x PP x DP (x EP for MoE), bf16 with Adam.

Time = compute (FLOPs / achieved FLOP/s) + 1F1B pipeline bubble + exposed communication
(tensor-parallel all-reduces, pipeline sends, data-parallel gradient sync or ZeRO-3
gathers, MoE all-to-alls) + the optimizer step. Memory = weights, gradients and Adam
state (16 bytes per parameter, sharded over data parallelism by the ZeRO stage) +
activations of the micro-batches in flight (1F1B keeps up to `pp` of them on the first
stage; full recomputation keeps only each layer's input) + the loss's fp32 logits.
Placement: TP innermost (inside a node), then PP, then DP.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from libra.planner.comm import allgather_time, allreduce_time, alltoall_time, p2p_time, spans_nodes
from libra.planner.profiles import HardwareProfile, ModelProfile
from libra.planner.settings import TrainSettings
from libra.planner.workload import WorkloadStats

_DEFAULT = TrainSettings()


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainConfig:
    """One training parallelism configuration."""

    tp: int
    pp: int
    dp: int
    ep: int = 1
    micro_batch_tokens: int
    zero: int = 0
    """ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 (FSDP) also weights."""
    shard: int = 0
    """Data-parallel ranks one ZeRO shard group spans; 0: all `dp` of them. Below `dp`
    it is hybrid sharding (HSDP): state sharded inside groups of `shard` ranks and
    replicated across the `dp / shard` groups, as Libra's elastic trainer runs it
    (FSDP2 inside a replica of `shard` ranks, gradients all-reduced across replicas)."""
    recompute: bool = False
    """Full activation recomputation."""

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def shard_group(self) -> int:
        """Ranks the ZeRO-sharded state is divided over."""
        return self.shard or self.dp

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"gpus": self.gpus}


@dataclass(frozen=True, slots=True)
class TrainWorkload:
    """What an update trains on: every episode's full sequence once."""

    tokens: float
    pairs: float
    """Causal attention (query, key) pairs."""
    max_seq: int
    sequences: int

    @classmethod
    def from_stats(cls, stats: WorkloadStats) -> TrainWorkload:
        return cls(stats.train_tokens, stats.train_pairs, stats.max_total, stats.n)

    @classmethod
    def from_lengths(cls, lengths: Sequence[int]) -> TrainWorkload:
        """From the sequence lengths (prompt + response tokens) of one update's batch."""
        return cls(
            float(sum(lengths)),
            float(sum(n * n / 2.0 for n in lengths)),
            int(max(lengths)),
            len(lengths),
        )


@dataclass(frozen=True, slots=True)
class TrainCost:
    config: TrainConfig
    fits: bool
    memory_bytes: float
    memory_limit: float
    micro_batches: int
    compute_s: float = math.inf
    bubble_s: float = 0.0
    tp_comm_s: float = 0.0
    pp_comm_s: float = 0.0
    dp_comm_s: float = 0.0
    ep_comm_s: float = 0.0
    optimizer_s: float = 0.0

    @property
    def total_s(self) -> float:
        if not self.fits:
            return math.inf
        return (
            self.compute_s
            + self.bubble_s
            + self.tp_comm_s
            + self.pp_comm_s
            + self.dp_comm_s
            + self.ep_comm_s
            + self.optimizer_s
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.config.as_dict(),
            "t_train_s": self.total_s,
            "micro_batches": self.micro_batches,
            "memory_gib": round(self.memory_bytes / 2**30, 2),
            "breakdown_s": {
                "compute": self.compute_s,
                "bubble": self.bubble_s,
                "tp_comm": self.tp_comm_s,
                "pp_comm": self.pp_comm_s,
                "dp_comm": self.dp_comm_s,
                "ep_comm": self.ep_comm_s,
                "optimizer": self.optimizer_s,
            },
        }


def config_valid(model: ModelProfile, hw: HardwareProfile, cfg: TrainConfig) -> bool:
    """Divisibility rules (Megatron's): TP splits query and KV heads evenly inside a node;
    PP splits the layers evenly; EP splits the experts and the data-parallel group."""
    if min(cfg.tp, cfg.pp, cfg.dp, cfg.ep) < 1 or cfg.tp > hw.devices_per_node:
        return False
    if model.heads % cfg.tp or model.kv_heads % cfg.tp or model.layers % cfg.pp:
        return False
    if cfg.ep > 1 and (not model.is_moe or model.experts % cfg.ep or cfg.dp % cfg.ep):
        return False
    if cfg.shard < 0 or (cfg.shard and (cfg.dp % cfg.shard or cfg.shard % cfg.ep)):
        return False
    return cfg.zero in (0, 1, 2, 3)


def passes(settings: TrainSettings, recompute: bool) -> tuple[int, int]:
    """(forward-only passes over the batch, extra forward of recomputation)."""
    return int(settings.ref_model) + int(settings.recompute_old_logprobs), int(recompute)


def micro_batches(
    cfg: TrainConfig, wl: TrainWorkload, settings: TrainSettings
) -> tuple[int, float]:
    """Micro-batches per data-parallel rank per mini-batch, and tokens in each."""
    per_rank = wl.tokens / cfg.dp / settings.mini_batches
    n = max(1, math.ceil(per_rank / cfg.micro_batch_tokens))
    return n, per_rank / n


def activation_bytes_per_token_layer(model: ModelProfile) -> float:
    """Activations one token keeps per layer for the backward pass (bf16, flash
    attention, no TP): norms' inputs, Q/K/V and the attention output, the MLP's inputs
    and gate/up/act outputs (Korthikanti et al. 2022 style, for GQA and SwiGLU)."""
    attn = 8 * model.hidden + 2 * (2 * model.q_dim + 2 * model.kv_dim)
    if model.is_moe:
        mlp = model.experts_active * 6 * model.moe_intermediate + 4 * model.experts
    else:
        mlp = 6 * model.intermediate
    return float(attn + mlp)


def train_memory(
    model: ModelProfile,
    hw: HardwareProfile,
    cfg: TrainConfig,
    wl: TrainWorkload,
    settings: TrainSettings | None = None,
) -> float:
    """Peak bytes per GPU."""
    s = settings or _DEFAULT
    expert = model.expert_params_total
    dense = model.params_total - expert
    shard_dense = cfg.shard_group
    shard_exp = max(1, cfg.shard_group // cfg.ep)
    p_dense = dense / (cfg.tp * cfg.pp)
    p_exp = expert / (cfg.tp * cfg.pp * cfg.ep)

    def sharded(bytes_per_param: float, stage: int) -> float:
        if cfg.zero >= stage:
            return bytes_per_param * (p_dense / shard_dense + p_exp / shard_exp)
        return bytes_per_param * (p_dense + p_exp)

    states = sharded(2, 3) + sharded(2, 2) + sharded(12, 1)
    if s.ref_model:
        states += sharded(2, 3)
    n_mb, mb_tok = micro_batches(cfg, wl, s)
    layers = model.layers / cfg.pp
    full = activation_bytes_per_token_layer(model) / cfg.tp
    if cfg.recompute:
        act = min(cfg.pp, n_mb) * mb_tok * layers * 2 * model.hidden / cfg.tp + mb_tok * full
    else:
        act = min(cfg.pp, n_mb) * mb_tok * layers * full
    chunk = s.logprob_chunk_tokens
    logits = (min(mb_tok, chunk) if chunk else mb_tok) * model.vocab * 4 / cfg.tp
    return states + act + logits


def train_step_time(
    model: ModelProfile,
    hw: HardwareProfile,
    cfg: TrainConfig,
    wl: TrainWorkload,
    settings: TrainSettings | None = None,
) -> TrainCost:
    """Seconds of one iteration's update under `cfg` (`.fits` False if it runs out of
    memory or breaks a divisibility rule; then `total_s` is inf)."""
    s = settings or _DEFAULT
    limit = hw.memory_bytes * s.memory_fraction
    n_mb, mb_tok = micro_batches(cfg, wl, s)
    if not config_valid(model, hw, cfg) or cfg.micro_batch_tokens < wl.max_seq:
        return TrainCost(cfg, False, math.inf, limit, n_mb)
    mem = train_memory(model, hw, cfg, wl, s)
    if mem > limit:
        return TrainCost(cfg, False, mem, limit, n_mb)
    fwd_only, recomp = passes(s, cfg.recompute)
    f1 = wl.tokens * model.flops_per_token + wl.pairs * model.attn_flops_per_pair
    compute = (3 + recomp + fwd_only) * f1 / (cfg.gpus * hw.flops * hw.eff.train_mfu)
    bubble = compute * (cfg.pp - 1) / n_mb
    n_mb_all = n_mb * s.mini_batches
    layers = model.layers / cfg.pp
    act = mb_tok * model.hidden * model.dtype_bytes
    # TP: two all-reduces per layer per forward (weights' outputs), two per backward.
    ar_passes = 2 + recomp + fwd_only
    tp_comm = n_mb_all * layers * 2 * ar_passes * allreduce_time(hw, act, cfg.tp)
    # PP: each micro-batch crosses pp-1 stage boundaries forward (and backward).
    pp_comm = 0.0
    if cfg.pp > 1:
        across = spans_nodes(hw, cfg.pp, cfg.tp)
        hops = (n_mb_all + (cfg.pp - 1) * s.mini_batches) * (2 + fwd_only)
        pp_comm = hops * p2p_time(hw, act / cfg.tp, across_nodes=across)
    # DP: gradient all-reduce per mini-batch (ZeRO 1/2: reduce-scatter + all-gather, the
    # same volume; HSDP: a reduce-scatter in the shard group and an all-reduce of the
    # shard across groups, no more than one all-reduce over dp); ZeRO-3 also all-gathers
    # the weights, inside the shard group, for every pass of every micro-batch.
    stride = cfg.tp * cfg.pp
    expert = model.expert_params_total
    dense_bytes = (model.params_total - expert) * model.dtype_bytes / (cfg.tp * cfg.pp)
    exp_bytes = expert * model.dtype_bytes / (cfg.tp * cfg.pp * cfg.ep)
    dp_exp = max(1, cfg.dp // cfg.ep)
    sh, sh_exp = cfg.shard_group, max(1, cfg.shard_group // cfg.ep)
    grads = allreduce_time(hw, dense_bytes, cfg.dp, stride=stride) + allreduce_time(
        hw, exp_bytes, dp_exp, stride=stride * cfg.ep
    )
    dp_comm = s.mini_batches * grads
    if cfg.zero >= 3:
        gathers = n_mb_all * (2 + recomp + fwd_only)
        dp_comm += gathers * (
            allgather_time(hw, dense_bytes, sh, stride=stride)
            + allgather_time(hw, exp_bytes, sh_exp, stride=stride * cfg.ep)
        )
    if s.overlap_grad_reduce:
        dp_comm = max(0.0, dp_comm - compute * 2 / (3 + recomp + fwd_only))
    ep_comm = 0.0
    if model.is_moe and cfg.ep > 1:
        a2a = mb_tok / cfg.tp * model.experts_active * model.hidden * model.dtype_bytes
        ep_comm = n_mb_all * layers * 2 * ar_passes * alltoall_time(hw, a2a, cfg.ep, stride=stride)
    opt_params = (model.params_total - expert) / (cfg.tp * cfg.pp) + expert / (
        cfg.tp * cfg.pp * cfg.ep
    )
    if cfg.zero >= 1:
        opt_params /= cfg.shard_group
    optimizer = s.mini_batches * 32 * opt_params / (hw.hbm_bandwidth * hw.eff.hbm)
    return TrainCost(
        cfg,
        True,
        mem,
        limit,
        n_mb,
        compute,
        bubble,
        tp_comm,
        pp_comm,
        dp_comm,
        ep_comm,
        optimizer,
    )


def compute_lower_bound(
    model: ModelProfile, hw: HardwareProfile, wl: TrainWorkload, gpus: int, settings: TrainSettings
) -> float:
    """No config on `gpus` GPUs trains faster than its compute alone."""
    fwd_only, _ = passes(settings, False)
    f1 = wl.tokens * model.flops_per_token + wl.pairs * model.attn_flops_per_pair
    return (3 + fwd_only) * f1 / (gpus * hw.flops * hw.eff.train_mfu)


__all__ = [
    "TrainConfig",
    "TrainCost",
    "TrainWorkload",
    "activation_bytes_per_token_layer",
    "compute_lower_bound",
    "config_valid",
    "micro_batches",
    "train_memory",
    "train_step_time",
]
