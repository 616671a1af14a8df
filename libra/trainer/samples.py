"""Trajectory records -> training samples: filtering, group advantages, partitioning.

Pure Python (no torch): the driver runs it before handing each replica its share, so
advantages are computed over whole groups even when a group's samples end up on
different replicas.

What happens to a record (documented in docs/grpo.md):

- `aborted`: dropped (the episode was cancelled; its reward means nothing) and left
  out of its group's statistics.
- `ok`, `truncated`, `error`, `timeout`: kept with the reward the environment gave it
  (usually 0 or a penalty for the last three): a failed episode is data, and a policy
  that times out should learn from it.
- stale (`GRPOConfig.max_staleness`): counted in its group's mean and std, but its
  tokens are left out of the loss.
- malformed (no prompt tokens, or mask / logprob lengths that disagree with the
  response): dropped and counted.
- a reward that is not finite or beyond `REWARD_LIMIT` (a record that did not come from
  Libra's own scoring, which refuses those): dropped as `bad_reward` and left out of its
  group's statistics, so the rest of its group still trains.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from libra.record import REWARD_LIMIT, Trajectory
from libra.trainer.config import GRPOConfig


@dataclass(frozen=True, slots=True)
class Sample:
    """One trajectory as the loss sees it."""

    input_ids: list[int]
    """Prompt followed by the response (model and tool tokens)."""
    prompt_len: int
    """Tokens of the prompt; the response starts here."""
    loss_mask: list[int]
    """Per response token: 1 for model tokens (trained), 0 for tool/template tokens."""
    rollout_logprobs: list[float]
    """Per response token: log-prob the endpoint reported (empty: unknown)."""
    advantage: float
    """Group-normalised advantage, the same for every token of the sample."""
    version: int
    """Oldest policy version that generated a turn of this sample."""

    @property
    def tokens(self) -> int:
        """Tokens that carry loss."""
        return sum(self.loss_mask)

    @property
    def length(self) -> int:
        return len(self.input_ids)


@dataclass(slots=True)
class Prepared:
    """What `prepare` made of a batch of records."""

    samples: list[Sample]
    groups: int
    """Groups that contributed at least one sample."""
    reward_mean: float
    """Mean reward over the records kept for advantages (not aborted or malformed)."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Records left out of the loss, by reason: aborted, stale, malformed, no_tokens."""


def policy_version(record: Trajectory) -> int:
    """The oldest policy that produced any of the record's turns (`step` without turns)."""
    versions = [t.policy_version for t in record.turns]
    return min(versions) if versions else record.step


def group_advantages(rewards: Sequence[float], cfg: GRPOConfig) -> list[float]:
    """(r - mean) / (std + eps) with the unbiased std (`scale_rewards="none"`: r - mean).

    A group of one has no baseline: its advantage is 0.
    """
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    mean = math.fsum(rewards) / n
    centred = [r - mean for r in rewards]
    if cfg.scale_rewards == "none":
        return centred
    std = math.sqrt(math.fsum(c * c for c in centred) / (n - 1))
    return [c / (std + cfg.adv_eps) for c in centred]


def _malformed(r: Trajectory) -> bool:
    n = len(r.response_token_ids)
    return (
        not r.prompt_token_ids
        or len(r.loss_mask) != n
        or (bool(r.logprobs) and len(r.logprobs) != n)
    )


def prepare(records: Iterable[Trajectory], *, version: int, cfg: GRPOConfig) -> Prepared:
    """Turn records into samples for training policy `version` (the trainer's current one)."""
    dropped: dict[str, int] = defaultdict(int)
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for r in records:
        if r.status == "aborted":
            dropped["aborted"] += 1
        elif _malformed(r):
            dropped["malformed"] += 1
        elif not abs(r.reward) <= REWARD_LIMIT:  # also NaN
            dropped["bad_reward"] += 1
        else:
            groups[r.group_id].append(r)
    samples: list[Sample] = []
    rewards_all: list[float] = []
    used_groups = 0
    for members in groups.values():
        rewards = [m.reward for m in members]
        rewards_all.extend(rewards)
        before = len(samples)
        for r, adv in zip(members, group_advantages(rewards, cfg), strict=True):
            v = policy_version(r)
            if cfg.max_staleness is not None and version - v > cfg.max_staleness:
                dropped["stale"] += 1
                continue
            if not any(r.loss_mask):
                dropped["no_tokens"] += 1
                continue
            samples.append(
                Sample(
                    input_ids=[*r.prompt_token_ids, *r.response_token_ids],
                    prompt_len=len(r.prompt_token_ids),
                    loss_mask=list(r.loss_mask),
                    rollout_logprobs=list(r.logprobs),
                    advantage=adv,
                    version=v,
                )
            )
        used_groups += len(samples) > before
    mean = math.fsum(rewards_all) / len(rewards_all) if rewards_all else 0.0
    return Prepared(samples=samples, groups=used_groups, reward_mean=mean, dropped=dict(dropped))


def split_minibatches(samples: Sequence[Sample], n: int) -> list[list[Sample]]:
    """Deal samples round-robin into `n` mini-batches (each sees every kind of group)."""
    return [list(samples[i::n]) for i in range(n)]


def partition(samples: Sequence[Sample], n: int) -> list[list[Sample]]:
    """Split samples over `n` ranks balancing sequence length (the compute), greedily
    longest first; deterministic. Shares may have unequal loss-token counts: the
    all-reduce sums tokens, so the loss stays the global token mean."""
    if n < 1:
        raise ValueError("partition needs at least one rank")
    shares: list[list[Sample]] = [[] for _ in range(n)]
    load = [0] * n
    for s in sorted(samples, key=lambda s: -s.length):
        i = min(range(n), key=lambda k: (load[k], k))
        shares[i].append(s)
        load[i] += s.length
    return shares


__all__ = [
    "Prepared",
    "Sample",
    "group_advantages",
    "partition",
    "policy_version",
    "prepare",
    "split_minibatches",
]
