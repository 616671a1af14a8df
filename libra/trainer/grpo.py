"""The GRPO loss in torch: token log-probs at the sampling temperature, clipped ratio,
truncated importance correction with the rollout log-probs, optional k3 KL.

Every function returns *sums over loss tokens*, never means: the elastic all-reduce
sums gradients and token counts across replicas and divides once, so the loss is the
global token mean no matter how tokens are spread over replicas (DAPO's token-level
aggregation).

Per loss token t of a sample with advantage A (see docs/grpo.md):

    r_t   = exp(logp_t - old_t)                      old: trainer log-prob before this update
    pg_t  = -min(r_t * A, clip(r_t, 1 - eps_lo, 1 + eps_hi) * A)
    w_t   = min(exp(old_t - rollout_t), tis_cap)     (rollout_correction = "tis"; else 1)
    kl_t  = exp(ref_t - logp_t) - (ref_t - logp_t) - 1
    loss  = sum_t (w_t * pg_t + kl_coef * kl_t) / N_tokens (N over all replicas)
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from libra.trainer.config import GRPOConfig
from libra.trainer.device import CPU, Device, autocast
from libra.trainer.microbatch import MicroBatch, collate, micro_batches, pack, plan_micro_batches
from libra.trainer.samples import Sample

# The chunked path's forward returns the final hidden states, a view of the decoder's
# output; FSDP2 warns (once per pass) that an in-place op on a root's view output would
# skip its backward hook. Nothing writes to it in place: reshape copies it.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")

METRICS = ("loss", "pg", "kl", "clipped", "tis_capped", "mismatch_kl", "rollout_tokens")
"""Summed per-token statistics every replica contributes (see `LocalStats`)."""


@dataclass(slots=True)
class LocalStats:
    """What one rank's backward produced: loss-token count and metric sums."""

    tokens: int = 0
    samples: int = 0
    metrics: dict[str, float] = field(default_factory=lambda: dict.fromkeys(METRICS, 0.0))

    def add(self, other: LocalStats) -> None:
        self.tokens += other.tokens
        self.samples += other.samples
        for k, v in other.metrics.items():
            self.metrics[k] += v


def token_logprobs(
    model: torch.nn.Module, mb: MicroBatch, temperature: float, dtype: str = "float32",
    *, device: Device = CPU, chunk_tokens: int = 0,
) -> torch.Tensor:  # fmt: skip
    """log softmax(logits / temperature) of each next token: [B, T-1] (float32).

    `chunk_tokens` > 0: the output head runs on that many positions at a time, each
    chunk recomputed in the backward (`torch.utils.checkpoint`), so a micro-batch's
    float32 logits over the vocabulary ([B, T, V]: 1 GiB at 8,192 tokens x 32k) never
    exist at once; the result is the same. 0: the model's own forward, whole logits."""
    head = _head(model) if chunk_tokens > 0 else None
    if head is None or not isinstance(head, torch.nn.Linear) or _scales_logits(model):
        with autocast(device, dtype):
            logits = _forward(model, mb)
        logits = logits[:, :-1].float() / temperature
        targets = mb.input_ids[:, 1:].unsqueeze(-1)
        return (logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, -1)).float()
    b, t = mb.input_ids.shape
    with autocast(device, dtype):
        with _head_skipped(head):  # the forward returns the final hidden states
            hidden = _forward(model, mb)
        h = hidden[:, :-1].reshape(b * (t - 1), -1)
        targets = mb.input_ids[:, 1:].reshape(-1)
        parts = []
        for lo in range(0, h.shape[0], chunk_tokens):
            args = (h[lo : lo + chunk_tokens], head.weight, head.bias,
                    targets[lo : lo + chunk_tokens], temperature)  # fmt: skip
            if torch.is_grad_enabled():
                parts.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
            else:
                parts.append(_chunk_logprobs(*args))
    return torch.cat(parts).view(b, t - 1).float()


def _forward(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """The model's `logits` output. A packed row passes its restarting position ids and
    no attention mask: transformers masks attention block-diagonally from them."""
    out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                position_ids=mb.position_ids)  # fmt: skip
    return out.logits


def _chunk_logprobs(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
    temperature: float,
) -> torch.Tensor:  # fmt: skip
    logits = F.linear(h, weight, bias).float() / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)


def _head(model: torch.nn.Module) -> torch.nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def _scales_logits(model: torch.nn.Module) -> bool:
    """Does the model change its head's output before returning it (Gemma's soft cap,
    Cohere's scale)? Then only its own forward gives its logits."""
    c = getattr(model, "config", None)
    return bool(getattr(c, "final_logit_softcapping", None) or getattr(c, "logit_scale", None))


@contextlib.contextmanager
def _head_skipped(head: torch.nn.Module) -> Iterator[None]:
    """The output head passes its input through for the duration (its instance's
    `forward` shadows the class's): the model returns hidden states as its `logits`."""
    head.forward = _identity
    try:
        yield
    finally:
        del head.forward


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def token_loss(
    logp: torch.Tensor,
    old: torch.Tensor,
    rollout: torch.Tensor,
    advantage: torch.Tensor,
    mask: torch.Tensor,
    cfg: GRPOConfig,
    ref: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Summed GRPO loss over masked tokens and the metric sums (see module doc).

    `rollout` holds nan where the endpoint's log-prob is unknown (weight 1 there).
    """
    old = old.detach()
    ratio = torch.exp(logp - old)
    unclipped = ratio * advantage
    clipped = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high) * advantage
    pg = -torch.minimum(unclipped, clipped)
    known = ~torch.isnan(rollout)
    diff = torch.where(known, old - rollout, torch.zeros_like(old))  # log(pi_old / pi_rollout)
    if cfg.rollout_correction == "tis":
        weight = torch.exp(diff).clamp(max=cfg.tis_cap)
        pg = pg * weight
    else:
        weight = torch.ones_like(pg)
    loss = pg
    kl = torch.zeros_like(pg)
    if ref is not None and cfg.kl_coef > 0:
        d = ref.detach() - logp
        kl = torch.exp(d) - d - 1
        loss = pg + cfg.kl_coef * kl
    m = mask
    total = (loss * m).sum()
    with torch.no_grad():
        km = m * known
        stats = {
            "loss": float(total),
            "pg": float((pg * m).sum()),
            "kl": float((kl * m).sum()),
            "clipped": float(((clipped < unclipped) * m).sum()),
            "tis_capped": float(((weight >= cfg.tis_cap) * km).sum())
            if cfg.rollout_correction == "tis"
            else 0.0,
            # k3 estimate of KL(rollout || trainer) from tokens the rollout sampled
            "mismatch_kl": float(((torch.exp(diff) - diff - 1) * km).sum()),
            "rollout_tokens": float(km.sum()),
        }
    return total, stats


def passes(samples: Sequence[Sample], cfg: GRPOConfig) -> int:
    """Forward passes `backward` and `old_logprobs` make over `samples` (before the
    dummy ones of `count`): what the FSDP ranks of a replica agree on."""
    return len(plan_micro_batches(samples, cfg.micro_batch_tokens, packing=cfg.packing))


def dummy_pass(model: torch.nn.Module, device: Device = CPU) -> None:
    """A forward/backward that adds zero to every gradient: keeps an FSDP rank with no
    data in step with its replica's collectives."""
    ids = torch.zeros(1, 2, dtype=torch.long, device=device.torch)
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    (out.sum() * 0.0).backward()


def backward(
    model: torch.nn.Module,
    samples: Sequence[Sample],
    cfg: GRPOConfig,
    *,
    dtype: str = "float32",
    device: Device = CPU,
    old: Sequence[torch.Tensor] | None = None,
    ref_model: torch.nn.Module | None = None,
    count: int | None = None,
) -> LocalStats:
    """Accumulate d(summed loss)/d(params) into `.grad` over `samples`.

    `old[i]` is sample i's per-position trainer log-prob before this version's first
    update ([length - 1]); None uses the current log-probs (ratio 1: one update per
    batch). `count` forces that many passes (dummy ones when data runs out). `device`
    is the replica's (`Replica.device`): each micro-batch moves there, and it sets the
    autocast of `dtype`.
    """
    stats = LocalStats()
    for idx, planned in micro_batches(samples, cfg.micro_batch_tokens, packing=cfg.packing,
                                      count=count):  # fmt: skip
        if planned is None:
            dummy_pass(model, device)
            continue
        mb = planned.to(device.torch)
        logp = token_logprobs(model, mb, cfg.temperature, dtype, device=device,
                              chunk_tokens=cfg.logprob_chunk_tokens)  # fmt: skip
        prev = logp.detach() if old is None else mb.place([old[i] for i in idx])
        ref = None
        if ref_model is not None and cfg.kl_coef > 0:
            with torch.no_grad():
                ref = token_logprobs(ref_model, mb, cfg.temperature, dtype, device=device,
                                    chunk_tokens=cfg.logprob_chunk_tokens)  # fmt: skip
        total, m = token_loss(logp, prev, mb.rollout, mb.advantage, mb.mask, cfg, ref)
        total.backward()
        part = LocalStats(tokens=int(mb.mask.sum()), samples=len(idx), metrics=m)
        stats.add(part)
    return stats


@torch.no_grad()
def old_logprobs(
    model: torch.nn.Module,
    samples: Sequence[Sample],
    cfg: GRPOConfig,
    *,
    dtype: str = "float32",
    device: Device = CPU,
    count: int | None = None,
) -> list[torch.Tensor]:
    """Per-sample trainer log-probs under the current weights (before any update of
    this version): the `old` of the clipped ratio when a step has several updates."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(samples)
    for idx, planned in micro_batches(samples, cfg.micro_batch_tokens, packing=cfg.packing,
                                      count=count):  # fmt: skip
        if planned is None:
            ids = torch.zeros(1, 2, dtype=torch.long, device=device.torch)
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
            continue
        mb = planned.to(device.torch)
        logp = token_logprobs(model, mb, cfg.temperature, dtype, device=device,
                              chunk_tokens=cfg.logprob_chunk_tokens)  # fmt: skip
        for i, lp in zip(idx, mb.per_sample(logp), strict=True):
            out[i] = lp.clone()
    return out


__all__ = [
    "METRICS",
    "LocalStats",
    "MicroBatch",
    "backward",
    "collate",
    "dummy_pass",
    "old_logprobs",
    "pack",
    "passes",
    "plan_micro_batches",
    "token_logprobs",
    "token_loss",
]
