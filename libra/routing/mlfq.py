"""Classic MLFQ: start in the smallest bucket, demote when the context outgrows it.

The baseline C-MLFQ improves on: it knows nothing ahead of time and moves an episode one
bucket up each time its running length crosses the current bucket's bound. Every move it
makes is an overflow demotion, so it never routes an episode right in one shot unless
the episode stays in its first bucket.
"""

from __future__ import annotations

from collections.abc import Sequence

from libra.routing.base import Bucket, Decision, EpisodeState, smallest_fitting
from libra.routing.records import FinishedEpisode


class MLFQPolicy:
    name = "mlfq"

    def __init__(self, buckets: Sequence[Bucket]):
        if not buckets:
            raise ValueError("a routing policy needs at least one bucket")
        self.buckets = tuple(sorted(buckets, key=lambda b: b.bound))
        self._index = {b.name: i for i, b in enumerate(self.buckets)}

    def on_start(self, state: EpisodeState) -> str:
        return smallest_fitting(self.buckets, state.prompt_tokens)

    def on_tool_return(self, state: EpisodeState) -> str | Decision:
        i = self._index.get(state.bucket)
        if i is None or i + 1 == len(self.buckets):
            return state.bucket
        bound = self.buckets[i].bound
        if state.tokens_so_far < bound:
            return state.bucket
        return Decision(
            self.buckets[i + 1].name, f"overflow (mlfq): {state.tokens_so_far} >= bound {bound}"
        )

    def on_finish(self, record: FinishedEpisode) -> None:
        return None

    def end_step(self, step: int | None = None) -> None:
        return None


__all__ = ["MLFQPolicy"]
