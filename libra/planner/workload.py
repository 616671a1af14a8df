"""What the planner knows about a workload: per-episode token and tool figures.

`WorkloadStats.from_records` reads any list of trajectory records (a `TRACE.jsonl`
through `libra.record.read_jsonl`, the simulator's generators, or the live service's
finished episodes). Token-id lists are not needed: the per-turn counts are.

For each episode it derives what the cost model consumes:

- `generated`: decode steps (model tokens);
- `kv_reads`: context tokens read over those steps, sum over turns of
  g*c + g*(g-1)/2 for g tokens decoded after a context of c;
- `prefill_tokens` and `prefill_pairs`: tokens prefilled (the prompt and every appended
  tool response; prefix caching keeps the rest) and the attention (query, key) pairs
  they cost, u*c + u*u/2 for u tokens appended after c;
- `total`: the final context, which is also the sequence the trainer trains on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from libra.errors import ConfigError


@dataclass(frozen=True, slots=True, eq=False)
class WorkloadStats:
    """Per-episode arrays (all the same length, one entry per episode)."""

    prompt: np.ndarray
    generated: np.ndarray
    tool_tokens: np.ndarray
    turns: np.ndarray
    tool_s: np.ndarray
    """Summed tool latency of the episode, seconds (the GPU is free meanwhile)."""
    total: np.ndarray
    kv_reads: np.ndarray
    prefill_tokens: np.ndarray
    prefill_pairs: np.ndarray

    @classmethod
    def from_records(cls, records: Iterable[Any]) -> WorkloadStats:
        """From trajectory records (`libra.record.Trajectory` or anything shaped like one)."""
        rows = [_episode(r) for r in records]
        if not rows:
            raise ConfigError("the workload has no episodes; pass a non-empty trace")
        if not any(row[5] > 0 for row in rows):  # a ZeroDivisionError in the training model
            raise ConfigError("the workload's episodes hold no tokens; pass a trace of them")
        cols = list(zip(*rows, strict=True))
        return cls(*(np.asarray(c, dtype=np.float64) for c in cols))

    # --- figures -----------------------------------------------------------------------
    @property
    def n(self) -> int:
        return int(self.total.shape[0])

    @property
    def train_tokens(self) -> float:
        return float(self.total.sum())

    @property
    def train_pairs(self) -> float:
        """Causal attention (query, key) pairs of training on every episode once."""
        return float((self.total * self.total / 2.0).sum())

    @property
    def max_total(self) -> int:
        return int(self.total.max())

    def summary(self) -> dict[str, Any]:
        tot = np.sort(self.total)
        gen = self.generated
        top = np.argsort(self.total)[-max(1, self.n // 10) :]
        return {
            "episodes": self.n,
            "total_tokens_p50": int(np.percentile(tot, 50)),
            "total_tokens_p90": int(np.percentile(tot, 90)),
            "total_tokens_max": int(tot[-1]),
            "generated_mean": round(float(gen.mean()), 1),
            "turns_mean": round(float(self.turns.mean()), 2),
            "tool_s_mean": round(float(self.tool_s.mean()), 3),
            "top10pct_share_of_kv_reads": round(
                float(self.kv_reads[top].sum() / max(self.kv_reads.sum(), 1.0)), 3
            ),
        }

    def resample(self, n: int) -> WorkloadStats:
        """`n` episodes at evenly spaced quantiles of the final context length
        (deterministic; keeps the distribution's shape, tail included)."""
        if n < 1:
            raise ConfigError("a batch needs at least one episode")
        order = np.argsort(self.total, kind="stable")
        pick = order[np.minimum(((np.arange(n) + 0.5) * self.n / n).astype(int), self.n - 1)]
        return self.take(pick)

    def take(self, idx: np.ndarray) -> WorkloadStats:
        return WorkloadStats(*(getattr(self, f)[idx] for f in _FIELDS))

    def sorted_by_length(self) -> WorkloadStats:
        return self.take(np.argsort(self.total, kind="stable"))


_FIELDS = (
    "prompt",
    "generated",
    "tool_tokens",
    "turns",
    "tool_s",
    "total",
    "kv_reads",
    "prefill_tokens",
    "prefill_pairs",
)


def _episode(r: Any) -> tuple[float, ...]:
    prompt = float(getattr(r, "prompt_tokens", 0) or 0)
    turns = list(getattr(r, "turns", []) or [])
    ctx = prompt
    gen = tool = kv = tool_s = 0.0
    pre_tok, pre_pairs = prompt, prompt * prompt / 2.0
    if not turns:
        g = max(0.0, float(getattr(r, "total_tokens", 0) or 0) - prompt)
        turns_n, gen, kv, ctx = 1, g, g * ctx + g * (g - 1) / 2.0, ctx + g
    else:
        turns_n = len(turns)
        for t in turns:
            g, u = float(t.model_tokens), float(t.tool_tokens)
            kv += g * ctx + g * (g - 1) / 2.0
            ctx += g
            pre_tok += u
            pre_pairs += u * ctx + u * u / 2.0
            ctx += u
            gen += g
            tool += u
            tool_s += sum(float(x.latency_s) for x in (t.tool_returns or []))
    if not all(0 <= x < math.inf for x in (prompt, gen, tool, tool_s)) or any(
        float(t.model_tokens) < 0 or float(t.tool_tokens) < 0 for t in turns
    ):  # they printed a throughput of -54 token/s and a context range from -89,229
        raise ConfigError(f"record {getattr(r, 'id', '')!r}: token counts and tool "
                          "latencies must be finite and >= 0")  # fmt: skip
    return (prompt, gen, tool, float(turns_n), tool_s, ctx, kv, pre_tok, pre_pairs)


@dataclass(frozen=True, slots=True, eq=False)
class Bins:
    """Episodes sorted by final context, cut into contiguous bins of about equal
    generated tokens (so the tail, which holds most of the tokens, gets most bins)."""

    stats: WorkloadStats
    """The episodes, sorted by final context."""
    edges: np.ndarray
    """Bin b holds sorted episodes edges[b] .. edges[b+1]-1."""

    @property
    def nbins(self) -> int:
        return len(self.edges) - 1

    def sums(self, values: np.ndarray) -> np.ndarray:
        """Per-bin sums of a per-episode array."""
        return np.add.reduceat(values, self.edges[:-1])

    def maxes(self, values: np.ndarray) -> np.ndarray:
        return np.maximum.reduceat(values, self.edges[:-1])

    def ranges(self) -> list[tuple[int, int]]:
        """(shortest, longest) final context of each bin."""
        tot = self.stats.total
        return [
            (int(tot[a]), int(tot[b - 1]))
            for a, b in zip(self.edges[:-1], self.edges[1:], strict=True)
        ]


def length_bins(stats: WorkloadStats, nbins: int) -> Bins:
    s = stats.sorted_by_length()
    cum = np.cumsum(s.generated + 1.0)  # +1: episodes with no output still count a little
    targets = cum[-1] * np.arange(1, nbins) / nbins
    cuts = np.searchsorted(cum, targets, side="left") + 1
    edges = np.unique(np.concatenate([[0], np.clip(cuts, 1, s.n), [s.n]])).astype(np.int64)
    return Bins(stats=s, edges=edges)


__all__ = ["Bins", "WorkloadStats", "length_bins"]
