"""Where and how an agent episode's model turns are generated.

`Placement` holds the episode's bucket and its moves, and generates a turn on the bucket's
endpoints with the native engine's rules (`libra/rollout/episode.py`): when the context
outgrows the bucket's bound the episode moves to a bucket with room (`overflow`); when
the bucket's bound — not the turn's budget or the context — cuts a turn, generation
continues there; when a bucket stays down the turn falls back to a healthy bucket that
fits (`endpoint-down`); routing decisions are applied with the policy's explanation.
Seeds, stop handling and sampling are the native engine's too.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from libra.chat import ChatTokenizer
from libra.endpoints.config import SamplingConfig
from libra.endpoints.pool import BucketDown, EndpointPool, Served
from libra.record import Migration
from libra.rollout.config import LimitsConfig
from libra.rollout.offload import Offload
from libra.routing.base import Bucket, RoutingPolicy
from libra.toolcalls import ToolCallParser


@dataclass(frozen=True, slots=True)
class Shared:
    """What every session of one runner shares."""

    tok: ChatTokenizer
    pool: EndpointPool
    policy: RoutingPolicy
    sampling: SamplingConfig
    limits: LimitsConfig
    max_context: int
    parser: ToolCallParser
    cpu: asyncio.Semaphore
    """Gate on synchronous work (render, tokenize, parse), as in the native engine."""
    clock: Callable[[], float]
    offload: Offload
    """Tokenizing big texts off the event loop."""
    tool_lists: dict[bytes, list[dict[str, Any]]] = field(default_factory=dict)
    """One object per distinct `tools` list: the tokenizer caches its delta plans per
    object, and every request brings a freshly parsed copy."""

    @property
    def max_body(self) -> int | None:
        """Bytes of request body beyond which the conversation cannot fit the context:
        every character is at most 6 bytes of JSON (`\\uXXXX`), one token stands for at
        most `chars_per_token` of them; 1 MiB more for tool schemas and fields. None
        when the tokenizer gives no bound."""
        per_token = self.tok.chars_per_token
        return None if per_token is None else self.max_context * per_token * 6 + (1 << 20)

    @property
    def buckets(self) -> dict[str, Bucket]:
        return {b.name: b for b in self.pool.buckets}

    def intern_tools(self, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if tools is None:
            return None
        key = orjson.dumps(tools, option=orjson.OPT_SORT_KEYS)
        if key not in self.tool_lists and len(self.tool_lists) >= 64:
            self.tool_lists.clear()
        return self.tool_lists.setdefault(key, tools)


@dataclass(slots=True)
class Seg:
    """One segment's tokens: a prompt, then model turns (mask 1) and appended messages
    (mask 0), aligned like a record's."""

    turn: int
    reason: str
    prompt_ids: list[int]
    context: list[int]
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def append(self, ids: Sequence[int], lps: Sequence[float] | None, model: bool) -> None:
        self.context.extend(ids)
        self.response.extend(ids)
        self.mask.extend([1 if model else 0] * len(ids))
        self.logprobs.extend(lps if lps is not None else [0.0] * len(ids))

    def cut(self, n: int) -> None:
        """Drop response tokens from offset `n` on (a turn that never reached the agent)."""
        extra = len(self.response) - n
        if extra > 0:
            del self.context[-extra:], self.response[n:], self.mask[n:], self.logprobs[n:]


class ContextFull(Exception):
    """The context has no room for another token."""


@dataclass(slots=True)
class Placement:
    """The episode's bucket, its moves, and the time its turns queued and generated."""

    sh: Shared
    index: int
    """The episode's index (per-episode seeds: seed + index * 1009 + turn)."""
    bucket: str = ""
    migrations: list[Migration] = field(default_factory=list)
    queued_s: float = 0.0
    generate_s: float = 0.0

    def known(self, bucket: str) -> str:
        if bucket not in self.sh.buckets:
            raise ValueError(f"routing policy answered unknown bucket {bucket!r}")
        return bucket

    def move(self, turn_idx: int, to: str, reason: str, context_len: int) -> None:
        if to == self.bucket:
            return
        self.migrations.append(Migration(turn=turn_idx, from_bucket=self.bucket, to_bucket=to,
                                         reprefill_tokens=context_len, reason=reason))  # fmt: skip
        self.bucket = to

    def fit(self, turn_idx: int, context_len: int) -> None:
        """Force a move when the context no longer fits the current bucket's bound."""
        if context_len < self.sh.buckets[self.bucket].bound:
            return
        bigger = [b for b in self.sh.pool.buckets if b.bound > context_len]
        if bigger:
            self.move(turn_idx, bigger[0].name, "overflow", context_len)

    async def generate(
        self, seg: Seg, turn_idx: int, max_tokens: int | None, stop: Sequence[str]
    ) -> tuple[Served, str | None]:
        """Generate one turn onto `seg` under the turn timeout; raises ContextFull."""
        sh = self.sh
        budget = min(sh.sampling.max_tokens, max_tokens or math.inf)
        stop_ids, stop_strs = self._stops(stop)
        buckets = sh.buckets
        async with asyncio.timeout(sh.limits.turn_timeout_s):
            while True:
                self.fit(turn_idx, len(seg.context))
                room_ctx = sh.max_context - len(seg.context)
                if room_ctx <= 0:
                    raise ContextFull(f"context reached max_context={sh.max_context}")
                room_bucket = buckets[self.bucket].bound - len(seg.context)
                n = int(min(budget, room_ctx, room_bucket))
                bucket_binds = room_bucket < min(budget, room_ctx)
                served = await self._call(turn_idx, seg.context, n, stop_ids, stop_strs)
                comp = served.completion
                seg.append(comp.token_ids, comp.logprobs, model=True)
                budget -= len(comp.token_ids)
                if comp.finish_reason == "length" and bucket_binds and budget > 0:
                    continue  # `fit` moves it to a bucket with room
                return served, comp.finish_reason

    def _stops(self, stops: Sequence[str]) -> tuple[list[int], list[str]]:
        """End-of-turn ids + single-token stops as `stop_token_ids` (vLLM matches stop
        strings on decoded text only, which misses special tokens); the rest as strings."""
        ids, strs = list(self.sh.tok.eos_token_ids), []
        for s in stops:
            tid = self.sh.tok.token_id(s)
            if tid is not None:
                ids.append(tid)
            else:
                strs.append(s)
        return ids, strs

    async def _call(
        self, turn_idx: int, context: list[int], max_tokens: int, ids: list[int], strs: list[str]
    ) -> Served:
        sp, pool = self.sh.sampling, self.sh.pool
        seed = None if sp.seed is None else sp.seed + self.index * 1009 + turn_idx
        while True:
            try:
                served = await pool.generate(
                    self.bucket, context, max_tokens=max_tokens, temperature=sp.temperature,
                    top_p=sp.top_p, logprobs=sp.logprobs, seed=seed, stop=strs,
                    stop_token_ids=ids,
                )  # fmt: skip
            except BucketDown as e:
                up = [b for b in pool.buckets if b.name != e.bucket
                      and pool.has_healthy(b.name) and b.bound > len(context)]  # fmt: skip
                if not up:
                    raise
                self.move(turn_idx, up[0].name, "endpoint-down", len(context))
                continue
            self.queued_s += served.queued_s
            self.generate_s += served.generate_s
            return served


__all__ = ["ContextFull", "Placement", "Seg", "Shared"]
