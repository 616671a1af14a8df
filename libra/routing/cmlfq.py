"""C-MLFQ: route on causal signals, the tool returns, with a prefix tree of history.

Every episode starts in the smallest bucket that fits its prompt. After each turn's tool
returns the policy finds the deepest node of the tree (`libra.routing.tree`) that matches
the episode's prompt and its tool-return states and has enough samples, and predicts the
total length twice: current length + the node's mean remaining length, and current
length + its P90. It moves only when both predictions fall in the same bucket and that
bucket differs from the current one, and (`kv_aware`) only when the move pays for the
re-prefill of the context (`libra.routing.cost.judge_move`). Finished episodes update
the tree between steps (or online). No model inference, nothing to retrain.

With `objective` set (or `rule = "distribution"`) the node speaks through its whole
length distribution instead: the target is the bucket most likely to be the episode's
final one given the node and its current length. `accuracy`: one move per episode,
made when it beats waiting for the next tool return (a one-step lookahead through the
node's children); `cost`: every such move the KV-aware judge finds paying.

When the deepest usable node is an ancestor of the episode's position (its own path is
too rare), the node's remaining lengths were measured at an earlier point; the policy
then uses the node's total-length distribution conditioned on exceeding the current
length instead. docs/cmlfq.md has the details and the numbers.

Engine protocol: `on_start`, `on_tool_return` (once per turn, after all of the turn's
tool results are appended), `on_finish(record)` for every finished episode, and
`end_step(step)` when a training step's episodes are done (between-steps updates).
`save()` writes the tree to `tree_path` (call it off the event loop).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from libra.errors import ConfigError
from libra.routing import store
from libra.routing.base import Bucket, Decision, EpisodeState, smallest_fitting
from libra.routing.config import RoutingConfig
from libra.routing.cost import MoveCost, TPScaledCost, judge_move
from libra.routing.records import FinishedEpisode, ToolReturnLike, learnable, total_of
from libra.routing.tree import Match, PrefixTree, StateKey

_Pending = tuple[int, str, list[tuple[StateKey, int]], int, int]
MOVED_KEPT = 1 << 16
"""Moved episodes remembered (objective = accuracy); the oldest go first."""


class CMLFQPolicy:
    name = "cmlfq"

    def __init__(
        self,
        buckets: Sequence[Bucket],
        config: RoutingConfig | None = None,
        *,
        cost: MoveCost | None = None,
    ):
        if not buckets:
            raise ValueError("a routing policy needs at least one bucket")
        self.config = cfg = config or RoutingConfig()
        self.buckets = tuple(sorted(buckets, key=lambda b: b.bound))
        self._by_name = {b.name: b for b in self.buckets}
        self._bounds = [b.bound for b in self.buckets]
        self.cost: MoveCost = cost or TPScaledCost(batch=cfg.decode_batch)
        self.tree = self._new_tree()
        if cfg.tree_path is not None:
            self.load(cfg.tree_path, missing_ok=True)
        self._pending: list[_Pending] = []
        self._moved: OrderedDict[str, None] = OrderedDict()
        """Episodes this policy moved (objective = accuracy: one move per episode)."""

    # --- routing -----------------------------------------------------------------
    def on_start(self, state: EpisodeState) -> str:
        base = smallest_fitting(self.buckets, state.prompt_tokens)
        if self.config.start != "tree":
            return base
        match = self.tree.lookup(state.task_id, (), self.config.min_samples)
        if match is None:
            return base
        pred = _Prediction(match, state.prompt_tokens, exact=True)
        mean = self._bucket_for(pred.mean)
        agree: Bucket | None = mean if mean is self._bucket_for(pred.p90) else None
        if self.config.decision_rule == "distribution":
            target, _ = self._most_likely(self._probs(pred, state.prompt_tokens), base)
            if self.config.gate and target is not agree:
                return base
        elif agree is None:
            return base
        else:
            target = agree
        return target.name if target.bound >= state.prompt_tokens else base

    def on_tool_return(self, state: EpisodeState) -> str | Decision:
        cfg = self.config
        if cfg.objective == "accuracy" and state.episode_id in self._moved:
            # Single-shot accuracy counts an episode moved at most once: a second move
            # can only lose it, so the first is final.
            return state.bucket
        keys = [self.key(t) for t in state.tool_returns]
        match = self.tree.lookup(state.task_id, keys, cfg.min_samples)
        if match is None:
            return state.bucket
        ctx = state.tokens_so_far
        pred = _Prediction(match, ctx, exact=match.depth == len(keys))
        if pred.mean <= 0.0:  # an ancestor that never saw an episode run this long
            return state.bucket
        target: Bucket | None = self._bucket_for(pred.mean)
        rule = "agree"
        agree = target is self._bucket_for(pred.p90)
        if cfg.decision_rule == "distribution":
            blend = self._blend(state, keys, ctx) if cfg.backoff == "blend" else None
            probs = blend or self._probs(pred, ctx)
            target, p = self._most_likely(probs, state.bucket)
            rule = f"distribution, P={p:.2f}"
            if (
                cfg.objective == "accuracy"
                and target.name != state.bucket
                and pred.exact
                and not self._now_or_never(match, state, p, probs)
            ):
                return state.bucket
            if cfg.gate and not (agree and target is self._bucket_for(pred.mean)):
                return state.bucket
        elif not agree:
            target = self._deadline(state, pred) if cfg.deadline else None
            rule = "deadline"
        if target is None or target.name == state.bucket or target.bound <= ctx:
            return state.bucket
        why = (
            f"cmlfq ({rule}): {match.tree} node at depth {match.depth} "
            f"(n={match.node.rem.count}) predicts {pred.mean:.0f} mean / "
            f"{pred.p90:.0f} p90 tokens"
        )
        current = self._by_name.get(state.bucket)
        if cfg.judges_cost and current is not None:
            pays, figures = judge_move(self.cost, current, target, ctx, pred.mean - ctx)
            if not pays:
                return state.bucket
            why = f"{why}; {figures}"
        if cfg.objective == "accuracy":
            self._moved[state.episode_id] = None
            if len(self._moved) > MOVED_KEPT:  # episodes never reported finished
                self._moved.popitem(last=False)
        return Decision(target.name, why)

    def _probs(self, pred: _Prediction, ctx: int) -> list[float]:
        """P(final bucket = b) for each bucket under a node's distribution given the
        current length: P(total in (previous bound, bound]), the last bucket taking
        everything above its predecessor; buckets the context outgrew get 0."""
        out, below = [], 0.0
        last = self.buckets[-1]
        for b in self.buckets:
            if b.bound < ctx and b is not last:
                out.append(0.0)
                continue
            upto = 1.0 if b is last else pred.cdf(b.bound)
            out.append(max(0.0, upto - below))
            below = max(below, upto)
        return out

    def _now_or_never(
        self, match: Match, state: EpisodeState, p_move: float, here: list[float]
    ) -> bool:
        """Whether moving now (right with probability `p_move`, and final: one move per
        episode) beats waiting one more tool return (objective = accuracy). Waiting wins
        what the episode's next return teaches: at each child of the node, the best
        bucket's probability then, weighted by how often episodes go there; plus the
        episodes that end in the current bucket without another return. It loses
        everything if the next turn, at the episode's own pace so far, outgrows the
        current bucket (an overflow demotion is never single-shot): then it is now.
        `here`: the bucket probabilities the decision used (the node's, or blended)."""
        current = self._by_name.get(state.bucket)
        ctx = state.tokens_so_far
        nxt = ctx + (ctx - state.prompt_tokens) / max(1, state.turn)
        if current is None or nxt >= current.bound:
            return True
        node = match.node
        kids = [c for c in node.children.values() if c.rem.count]
        reach = sum(c.rem.count for c in kids)
        n = max(node.rem.count, reach)
        i = self.buckets.index(current)
        wait = min(1.0 - reach / n, here[i])
        edges = [b.bound - nxt for b in self.buckets[:-1]]
        thin, floor = 0, self.config.min_samples
        for child in kids:
            if child.rem.count < floor:  # too few episodes there to learn anything new
                thin += child.rem.count
                continue
            cdf = child.rem.summary().cdf  # P(final in bucket i) = cdf(edge i) - cdf(edge i-1)
            best = below = 0.0
            for edge in edges:
                upto = cdf(edge) if edge > 0 else 0.0
                best = max(best, upto - below)
                below = max(below, upto)
            wait += child.rem.count / n * max(best, 1.0 - below)
        return p_move > wait + thin / n * max(here)

    def _blend(self, state: EpisodeState, keys: list[StateKey], ctx: int) -> list[float] | None:
        """Bucket probabilities of the prompt's node and the pooled one, the prompt's
        weighted by its episodes n against `min_samples` for the pooled (n / (n + m)):
        a prompt's own history counts as it accumulates. None without either node."""
        parts: list[tuple[float, list[float]]] = []
        mine, pooled = self.tree.lookup_each(state.task_id, keys, self.config.min_samples)
        for match, weight in ((mine, None), (pooled, float(self.config.min_samples))):
            if match is None:
                continue
            pred = _Prediction(match, ctx, exact=match.depth == len(keys))
            if pred.mean > 0.0:
                w = float(match.node.rem.count) if weight is None else weight
                parts.append((w, self._probs(pred, ctx)))
        if not parts:
            return None
        total = sum(w for w, _ in parts)
        return [sum(w * v[i] for w, v in parts) / total for i in range(len(self.buckets))]

    def _most_likely(self, probs: list[float], current: str) -> tuple[Bucket, float]:
        """The bucket most likely to be the episode's final one under `probs` (one per
        bucket), and that probability; a tie keeps `current`."""
        best, best_p = self.buckets[-1], -1.0
        for b, p in zip(self.buckets, probs, strict=True):
            if p > best_p + 1e-12 or (abs(p - best_p) <= 1e-12 and b.name == current):
                best, best_p = b, p
        return best, best_p

    def _deadline(self, state: EpisodeState, pred: _Prediction) -> Bucket | None:
        """The most probable larger bucket, if the episode most likely outgrows its
        bucket and its next turn (at its own average pace) would already do so."""
        current = self._by_name.get(state.bucket)
        if current is None or current is self.buckets[-1]:
            return None
        ctx = state.tokens_so_far
        pace = (ctx - state.prompt_tokens) / max(1, state.turn)
        if ctx + pace < current.bound or pred.cdf(current.bound) >= 0.5:
            return None
        best, best_p, below = None, -1.0, pred.cdf(current.bound)
        for b in self.buckets:
            if b.bound <= current.bound:
                continue
            upto = 1.0 if b is self.buckets[-1] else pred.cdf(b.bound)
            if upto - below > best_p:
                best, best_p = b, upto - below
            below = upto
        return best

    def forget_moves(self) -> None:
        """Forget which episodes were moved (a benchmark replaying the same episodes)."""
        self._moved.clear()

    def key(self, ret: ToolReturnLike) -> StateKey:
        """A tool return as the tree sees it: (tool, size class, status)."""
        n = ret.payload_tokens
        size = (
            "small"
            if n <= self.config.small_payload
            else "medium"
            if n <= self.config.large_payload
            else "large"
        )
        return (ret.tool, size, ret.status)

    def _bucket_for(self, total: float) -> Bucket:
        i = bisect.bisect_left(self._bounds, total)
        return self.buckets[min(i, len(self.buckets) - 1)]

    # --- learning ----------------------------------------------------------------
    def on_finish(self, record: FinishedEpisode) -> None:
        self._moved.pop(getattr(record, "id", ""), None)
        if not learnable(record):
            return
        total = total_of(record)
        ctx = record.prompt_tokens
        path: list[tuple[StateKey, int]] = []
        for turn in record.turns:
            ctx += turn.model_tokens + turn.tool_tokens
            for ret in turn.tool_returns:
                path.append((self.key(ret), max(0, total - ctx)))
        item = (record.step, record.task_id, path, max(0, total - record.prompt_tokens), total)
        if self.config.update == "online":
            self._insert(item)
            self.tree.refresh(self.config.min_samples)
            return
        # A record of a later step closes the earlier steps still pending, so the
        # tree keeps learning even if the engine never calls `end_step`.
        if self._pending and record.step > self._pending[-1][0]:
            self._flush(before=record.step)
        self._pending.append(item)

    def end_step(self, step: int | None = None) -> None:
        """Apply the finished episodes held back for between-steps updates (all of
        them, or those of steps <= `step`)."""
        self._flush(before=None if step is None else step + 1)

    def _flush(self, before: int | None) -> None:
        keep = []
        for item in self._pending:
            if before is None or item[0] < before:
                self._insert(item)
            else:
                keep.append(item)
        self._pending = keep
        self.tree.refresh(self.config.min_samples)

    def _insert(self, item: _Pending) -> None:
        _, task_id, path, start_remaining, total = item
        self.tree.insert(task_id, path, start_remaining, total)

    # --- persistence -------------------------------------------------------------
    def _new_tree(self) -> PrefixTree:
        cfg = self.config
        tree = PrefixTree(window=cfg.window, max_nodes=cfg.max_nodes, max_depth=cfg.max_depth)
        tree.meta = self._meta()
        return tree

    def _meta(self) -> dict[str, Any]:
        return {
            "small_payload": self.config.small_payload,
            "large_payload": self.config.large_payload,
        }

    def save(self, path: str | Path | None = None) -> None:
        """Write the tree to `path` (default: `tree_path`) atomically."""
        target = path or self.config.tree_path
        if target is None:
            raise ConfigError("no tree path: set routing.tree_path or pass a path")
        store.write_atomic(target, self.tree.to_bytes())

    def load(self, path: str | Path, *, missing_ok: bool = False) -> None:
        """Replace the tree with the one saved at `path`."""
        data = store.read(path)
        if data is None:
            if missing_ok:
                return
            raise ConfigError(f"C-MLFQ tree file {str(path)!r} not found")
        cfg = self.config
        try:
            tree = PrefixTree.from_bytes(
                data, window=cfg.window, max_nodes=cfg.max_nodes, max_depth=cfg.max_depth
            )
        except ValueError as e:
            raise ConfigError(f"{path}: {e}; delete it or point tree_path elsewhere") from None
        if tree.meta and tree.meta != self._meta():
            raise ConfigError(
                f"{path}: tree was built with payload thresholds {tree.meta}, this policy "
                f"uses {self._meta()}; use the same thresholds or a new tree_path"
            )
        tree.meta = self._meta()
        self.tree = tree


class _Prediction:
    """The total-length distribution a node implies for an episode at `ctx` tokens: at
    the episode's own position, ctx + the node's remaining lengths; at an ancestor, the
    node's total lengths conditioned on exceeding ctx."""

    __slots__ = ("ctx", "exact", "mean", "node", "p90")

    def __init__(self, match: Match, ctx: int, *, exact: bool):
        self.node, self.ctx, self.exact = match.node, ctx, exact
        if exact:
            mean, p90 = match.node.rem.mean_p90()
            self.mean, self.p90 = ctx + mean, ctx + p90
        else:
            total = match.node.total
            self.mean = total.conditional_mean(ctx)
            self.p90 = total.quantile(0.9, above=ctx)

    def cdf(self, length: float) -> float:
        """P(total <= length)."""
        if self.exact:
            return self.node.rem.cdf(length - self.ctx)
        total = self.node.total
        below = total.cdf(self.ctx)
        if below >= 1.0:
            return 1.0
        return max(0.0, (total.cdf(length) - below) / (1.0 - below))


__all__ = ["CMLFQPolicy"]
