"""A length predictor that routes once, at the start (the paper's embedding-predictor
baseline, with what Libra can know up front instead of an embedding model).

It fits a ridge regression of log(total length) on what is known when an episode
starts: log prompt length; the prompt's own history (mean log length of its earlier
episodes, shrunk towards the global mean by how few there are); and, when the engine
passes prompt token ids, a hashed bag of those ids. It refits between steps on the most
recent `history` finished episodes, sends each new episode to the bucket of its
predicted total, and never moves it afterwards (an overflow still forces a move).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import numpy as np

from libra.routing.base import Bucket, Decision, EpisodeState, smallest_fitting
from libra.routing.config import RoutingConfig
from libra.routing.records import FinishedEpisode, learnable, total_of

HASH_DIMS = 32
SHRINK = 2.0
"""Pseudo-episodes of the global mean mixed into a prompt's own mean."""
RIDGE = 1.0


class LengthPredictorPolicy:
    name = "predictor"

    def __init__(self, buckets: Sequence[Bucket], config: RoutingConfig | None = None):
        if not buckets:
            raise ValueError("a routing policy needs at least one bucket")
        self.config = config or RoutingConfig()
        self.buckets = tuple(sorted(buckets, key=lambda b: b.bound))
        self._prompt_sum: dict[str, float] = {}
        self._prompt_n: dict[str, int] = {}
        self._global = (0.0, 0)  # (sum of log totals, count)
        self._rows: deque[tuple[np.ndarray, float]] = deque(maxlen=self.config.history)
        self._pending: list[FinishedEpisode] = []
        self._coef: np.ndarray | None = None

    def features(
        self, task_id: str, prompt_tokens: int, token_ids: Sequence[int] = ()
    ) -> np.ndarray:
        g_sum, g_n = self._global
        g_mean = g_sum / g_n if g_n else 0.0
        n = self._prompt_n.get(task_id, 0)
        own = (self._prompt_sum.get(task_id, 0.0) + SHRINK * g_mean) / (n + SHRINK)
        x = np.zeros(4 + HASH_DIMS)
        x[0] = 1.0
        x[1] = math.log(max(1, prompt_tokens))
        x[2] = own - g_mean
        x[3] = math.log1p(n)
        if token_ids:
            counts = np.bincount(np.asarray(token_ids) % HASH_DIMS, minlength=HASH_DIMS)
            x[4:] = counts / len(token_ids)
        return x

    # --- routing -----------------------------------------------------------------
    def on_start(self, state: EpisodeState) -> str:
        if self._coef is None:
            return smallest_fitting(self.buckets, state.prompt_tokens)
        x = self.features(state.task_id, state.prompt_tokens, state.prompt_token_ids)
        predicted = math.exp(float(x @ self._coef))
        return smallest_fitting(self.buckets, max(state.prompt_tokens, round(predicted)))

    def on_tool_return(self, state: EpisodeState) -> str | Decision:
        return state.bucket

    # --- learning ----------------------------------------------------------------
    def on_finish(self, record: FinishedEpisode) -> None:
        if not learnable(record):
            return
        if self._pending and record.step > self._pending[-1].step:
            self.end_step()
        self._pending.append(record)

    def end_step(self, step: int | None = None) -> None:
        """Add the held-back episodes to the history (features as they were known when
        those episodes started), then refit."""
        if not self._pending:
            return
        for rec in self._pending:
            ids = getattr(rec, "prompt_token_ids", None) or ()
            x = self.features(rec.task_id, rec.prompt_tokens, ids)
            self._rows.append((x, math.log(max(1, total_of(rec)))))
        for rec in self._pending:
            y = math.log(max(1, total_of(rec)))
            self._prompt_sum[rec.task_id] = self._prompt_sum.get(rec.task_id, 0.0) + y
            self._prompt_n[rec.task_id] = self._prompt_n.get(rec.task_id, 0) + 1
            self._global = (self._global[0] + y, self._global[1] + 1)
        self._pending = []
        xs = np.stack([x for x, _ in self._rows])
        ys = np.array([y for _, y in self._rows])
        # Standardise the features (the intercept stays), so that the ridge penalty
        # weighs them alike; constant columns drop out.
        mu, sd = xs.mean(0), xs.std(0)
        mu[0], sd[0] = 0.0, 1.0
        sd[sd == 0] = np.inf
        z = (xs - mu) / sd
        penalty = RIDGE * np.eye(z.shape[1])
        penalty[0, 0] = 0.0
        coef = np.linalg.solve(z.T @ z + penalty, z.T @ ys)
        self._coef = coef / sd
        self._coef[0] -= float(mu @ self._coef)

    def _global_mean(self) -> float:
        s, n = self._global
        return s / n if n else 0.0


__all__ = ["LengthPredictorPolicy"]
