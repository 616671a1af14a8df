"""Replay recorded episodes through a routing policy and score it (`libra eval-routing`).

Records are replayed step by step in order: the episodes of step s are routed with what
the policy learned from steps < s (their `on_finish` calls and `end_step(s)` come after
the whole step), as the live system would. An episode is replayed turn by turn from its
token counts, faithful to what an endpoint can serve: when its context outgrows its
bucket's bound it is force-moved to the next bucket that fits (an *overflow demotion*),
re-prefilling its context there. Scores:

- single-shot accuracy: share of episodes that end in the bucket of their true total
  length having moved at most once and never by an overflow demotion;
- per-bucket recall: that share among the episodes whose true bucket is each bucket;
- migrated-token ratio: all re-prefilled context tokens (policy moves and overflow
  demotions) over all tokens;
- moves per episode (policy moves and overflow demotions);
- decision latency of `on_tool_return`, p50 / p99.

Only `task_id`, `step`, `prompt_tokens`, `total_tokens` and per turn `model_tokens`,
`tool_tokens`, `tool_returns` are needed; other fields are ignored.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from libra.routing.base import Bucket, Decision, EpisodeState, RoutingPolicy, ToolState


class _Rec(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ReplayReturn(_Rec):
    tool: str = ""
    status: Literal["ok", "error", "timeout"] = "ok"
    payload_tokens: int = Field(0, ge=0)


class ReplayTurn(_Rec):
    model_tokens: int = Field(ge=0)
    tool_tokens: int = Field(0, ge=0)
    tool_returns: list[ReplayReturn] = Field(default_factory=list)


class ReplayRecord(_Rec):
    """The fields of a trajectory record that routing needs."""

    id: str = ""
    task_id: str
    step: int = Field(0, ge=0)
    status: str = "ok"
    prompt_tokens: int = Field(ge=0)
    total_tokens: int = Field(0, ge=0)
    turns: list[ReplayTurn] = Field(default_factory=list)
    prompt_token_ids: list[int] = Field(default_factory=list)


def parse_lines(lines: Iterable[bytes]) -> tuple[list[ReplayRecord], list[tuple[int, str]]]:
    """Records, and `(line number, problem)` for every line that is not one."""
    records: list[ReplayRecord] = []
    bad: list[tuple[int, str]] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(ReplayRecord.model_validate(orjson.loads(line)))
        except orjson.JSONDecodeError as e:
            bad.append((lineno, f"not JSON: {e}"))
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "(record)"
            bad.append((lineno, f"{where}: {first['msg']}"))
    return records, bad


@dataclass(slots=True)
class _Outcome:
    true_bucket: int
    final_bucket: int
    policy_moves: int = 0
    overflow_moves: int = 0
    reprefill: int = 0

    @property
    def single_shot(self) -> bool:
        """Ended in its true bucket, moved at most once, never by overflow."""
        return (
            self.final_bucket == self.true_bucket
            and self.overflow_moves == 0
            and self.policy_moves <= 1
        )


@dataclass
class Scores:
    policy: str
    buckets: list[Bucket]
    outcomes: list[_Outcome] = field(default_factory=list)
    tokens: int = 0
    steps: int = 0
    latencies_ns: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        n = len(self.outcomes) or 1
        shot = [o.single_shot for o in self.outcomes]
        per_bucket = {}
        for i, b in enumerate(self.buckets):
            mine = [k for k, o in enumerate(self.outcomes) if o.true_bucket == i]
            per_bucket[b.name] = {
                "bound": b.bound,
                "episodes": len(mine),
                "recall": _share(sum(shot[k] for k in mine), len(mine)),
                "ended_in_bucket": _share(
                    sum(self.outcomes[k].final_bucket == i for k in mine), len(mine)
                ),
            }
        lat = np.array(self.latencies_ns, dtype=float) / 1e3
        policy_moves = sum(o.policy_moves for o in self.outcomes)
        overflow_moves = sum(o.overflow_moves for o in self.outcomes)
        return {
            "policy": self.policy,
            "episodes": len(self.outcomes),
            "steps": self.steps,
            "single_shot_accuracy": sum(shot) / n,
            "per_bucket": per_bucket,
            "migrated_token_ratio": sum(o.reprefill for o in self.outcomes) / max(1, self.tokens),
            "moves_per_episode": (policy_moves + overflow_moves) / n,
            "policy_moves_per_episode": policy_moves / n,
            "overflow_moves_per_episode": overflow_moves / n,
            "decision_latency_us": {
                "calls": len(lat),
                "p50": float(np.percentile(lat, 50)) if len(lat) else 0.0,
                "p99": float(np.percentile(lat, 99)) if len(lat) else 0.0,
            },
        }


def _share(k: int, n: int) -> float | None:
    return k / n if n else None


def replay(
    records: Sequence[ReplayRecord],
    policy: RoutingPolicy,
    buckets: Sequence[Bucket],
    *,
    name: str = "",
    clock: Callable[[], int] = time.perf_counter_ns,
) -> Scores:
    """Route every record through `policy` step by step, learning as the live system
    would, and score the routing."""
    ordered = sorted(buckets, key=lambda b: b.bound)
    scores = Scores(name or getattr(policy, "name", type(policy).__name__), list(ordered))
    by_step: dict[int, list[ReplayRecord]] = {}
    for rec in records:
        by_step.setdefault(rec.step, []).append(rec)
    end_step = getattr(policy, "end_step", None)
    for step in sorted(by_step):
        batch = by_step[step]
        for rec in batch:
            scores.outcomes.append(_episode(rec, policy, ordered, clock, scores.latencies_ns))
            scores.tokens += _total(rec)
        for rec in batch:
            policy.on_finish(rec)
        if end_step is not None:
            end_step(step)
        scores.steps += 1
    return scores


def _total(rec: ReplayRecord) -> int:
    return rec.total_tokens or rec.prompt_tokens + sum(
        t.model_tokens + t.tool_tokens for t in rec.turns
    )


def _episode(
    rec: ReplayRecord,
    policy: RoutingPolicy,
    buckets: list[Bucket],
    clock: Callable[[], int],
    latencies: list[int],
) -> _Outcome:
    bounds = [b.bound for b in buckets]
    index = {b.name: i for i, b in enumerate(buckets)}
    last = len(buckets) - 1

    def fits(n: int) -> int:
        """The smallest bucket whose bound is >= n (the largest if none is)."""
        return min(bisect.bisect_left(bounds, n), last)

    true = fits(_total(rec))
    ctx = rec.prompt_tokens
    ids = tuple(rec.prompt_token_ids)
    state = EpisodeState(rec.id, rec.task_id, ctx, ctx, (), "", 0, ids)
    start = policy.on_start(state)
    cur = index.get(start, 0)
    out = _Outcome(true, cur)
    if bounds[cur] < ctx:  # the prompt does not fit where the policy put it
        cur = fits(ctx)
        out.overflow_moves += 1
    states: list[ToolState] = []
    for t, turn in enumerate(rec.turns):
        left = turn.model_tokens
        while cur < last and ctx + left > bounds[cur]:  # the turn outgrows its bucket
            left -= bounds[cur] - ctx
            ctx = bounds[cur]
            cur += 1
            out.overflow_moves += 1
            out.reprefill += ctx
        ctx += left + turn.tool_tokens
        if not turn.tool_returns or t == len(rec.turns) - 1:
            continue
        states.extend(ToolState(r.tool, r.status, r.payload_tokens) for r in turn.tool_returns)
        state = EpisodeState(
            rec.id, rec.task_id, rec.prompt_tokens, ctx, tuple(states), buckets[cur].name, t + 1
        )
        t0 = clock()
        answer = policy.on_tool_return(state)
        latencies.append(clock() - t0)
        to = index.get(answer.bucket if isinstance(answer, Decision) else answer, cur)
        # The next turn needs room: a bucket whose bound the context has reached cannot
        # serve it (as the engine does). Staying there, or moving to one too small, is
        # an overflow demotion to the next bucket with room.
        forced = cur < last and ctx >= bounds[cur]
        if to < last and ctx >= bounds[to]:
            to = fits(ctx + 1)
            forced = True
        if to != cur:
            out.reprefill += ctx
            if forced:
                out.overflow_moves += 1
            else:
                out.policy_moves += 1
            cur = to
    out.final_bucket = cur
    return out


__all__ = ["ReplayRecord", "Scores", "parse_lines", "replay"]
