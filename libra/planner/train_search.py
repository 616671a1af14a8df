"""Best training configuration for a given number of GPUs, with exact pruning.

Pruning never drops a configuration that could be strictly faster:

- divisibility: (tp, pp) pairs that do not divide the GPU count, TP sizes that split no
  head evenly or leave the node, PP sizes that split no layer evenly, micro-batch
  budgets shorter than the longest sequence;
- memory: a configuration that does not fit is not timed;
- dominance: in this cost model ZeRO-2 is never slower than ZeRO-0/1 and needs less
  memory, ZeRO-3 is never faster than ZeRO-2, and recomputation is never faster than
  keeping activations. So ZeRO-3 is timed only where ZeRO-2 does not fit, and
  recomputation only where the no-recompute variant needs ZeRO-3 or does not fit;
- bound: no configuration beats its compute time, so a GPU count whose compute lower
  bound already exceeds the target is skipped whole (`TrainSearch.best(g, bound)`).

`exhaustive=True` times every configuration that exists (all ZeRO stages, both recompute
settings, every micro-batch budget) and takes the minimum.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator

from libra.planner.profiles import HardwareProfile, ModelProfile
from libra.planner.settings import TrainSettings
from libra.planner.train_cost import (
    TrainConfig,
    TrainCost,
    TrainWorkload,
    compute_lower_bound,
    train_memory,
    train_step_time,
)


class TrainSearch:
    """Memoised best training cost per GPU count."""

    def __init__(
        self,
        model: ModelProfile,
        hw: HardwareProfile,
        wl: TrainWorkload,
        settings: TrainSettings,
        *,
        tp_sizes: tuple[int, ...] = (1, 2, 4, 8),
        exhaustive: bool = False,
    ):
        self.model, self.hw, self.wl, self.settings = model, hw, wl, settings
        self.exhaustive = exhaustive
        self.counts: Counter[str] = Counter()
        self._best: dict[int, TrainCost | None] = {}
        self.tp_sizes = tuple(t for t in tp_sizes if t <= hw.devices_per_node)
        self.pp_sizes = tuple(
            p for p in range(1, min(settings.max_pp, model.layers) + 1) if model.layers % p == 0
        )
        # A sequence is never split, so a budget is at least the longest sequence; that
        # length itself (one long sequence per micro-batch) is always a candidate.
        budgets = {b for b in settings.micro_batch_tokens if b >= wl.max_seq} | {wl.max_seq}
        self.budgets = tuple(sorted(budgets))

    def lower_bound(self, gpus: int) -> float:
        return compute_lower_bound(self.model, self.hw, self.wl, gpus, self.settings)

    def best(self, gpus: int, bound: float = math.inf) -> TrainCost | None:
        """The fastest fitting configuration on exactly `gpus` GPUs (None if none fits).
        With a finite `bound`, a GPU count that cannot beat it returns None unmemoised."""
        if gpus in self._best:
            return self._best[gpus]
        if not self.exhaustive and self.lower_bound(gpus) >= bound:
            self.counts["train_gpu_counts_bounded"] += 1
            return None
        best: TrainCost | None = None
        for cost in self._candidates(gpus):
            if cost.fits and (best is None or cost.total_s < best.total_s):
                best = cost
        self._best[gpus] = best
        return best

    def time(self, gpus: int, bound: float = math.inf) -> float:
        b = self.best(gpus, bound)
        return b.total_s if b is not None else math.inf

    def _shapes(self, gpus: int) -> Iterator[tuple[int, int, int, int]]:
        m = self.model
        for tp in self.tp_sizes:
            for pp in self.pp_sizes:
                if gpus % (tp * pp):
                    self.counts["train_pruned_divisibility"] += 1
                    continue
                if m.heads % tp or m.kv_heads % tp:
                    self.counts["train_pruned_divisibility"] += 1
                    continue
                dp = gpus // (tp * pp)
                eps = [1]
                if m.is_moe:
                    eps = [e for e in range(1, dp + 1) if dp % e == 0 and m.experts % e == 0]
                for ep in eps:
                    yield tp, pp, dp, ep

    def _candidates(self, gpus: int) -> Iterator[TrainCost]:
        for tp, pp, dp, ep in self._shapes(gpus):
            for mb in self.budgets:
                if self.exhaustive:
                    zeros = (0, 1, 2, 3) if dp > 1 else (0,)
                    for zero in zeros:
                        for rc in (False, True):
                            self.counts["train_evaluated"] += 1
                            yield self._cost(tp, pp, dp, ep, mb, zero, rc)
                else:
                    yield from self._dominant(tp, pp, dp, ep, mb)

    def _dominant(self, tp: int, pp: int, dp: int, ep: int, mb: int) -> Iterator[TrainCost]:
        """The configurations no other one (same shape and budget) dominates."""
        z_low = 2 if dp > 1 else 0
        skipped = 4 if dp > 1 else 0  # ZeRO 0/1 (with or without recompute) never beat ZeRO-2
        self.counts["train_pruned_dominated"] += skipped
        options = (
            [(z_low, False), (3, False), (z_low, True), (3, True)]
            if dp > 1
            else [
                (0, False),
                (0, True),
            ]
        )
        fitted: list[tuple[int, bool]] = []
        for zero, rc in options:
            if any(_dominates(f, (zero, rc)) for f in fitted):
                self.counts["train_pruned_dominated"] += 1
                continue
            cfg = TrainConfig(
                tp=tp, pp=pp, dp=dp, ep=ep, micro_batch_tokens=mb, zero=zero, recompute=rc
            )
            if train_memory(self.model, self.hw, cfg, self.wl, self.settings) > (
                self.hw.memory_bytes * self.settings.memory_fraction
            ):
                self.counts["train_pruned_memory"] += 1
                continue
            fitted.append((zero, rc))
            self.counts["train_evaluated"] += 1
            yield train_step_time(self.model, self.hw, cfg, self.wl, self.settings)

    def _cost(self, tp: int, pp: int, dp: int, ep: int, mb: int, zero: int, rc: bool) -> TrainCost:
        cfg = TrainConfig(
            tp=tp, pp=pp, dp=dp, ep=ep, micro_batch_tokens=mb, zero=zero, recompute=rc
        )
        return train_step_time(self.model, self.hw, cfg, self.wl, self.settings)


def _dominates(a: tuple[int, bool], b: tuple[int, bool]) -> bool:
    """Fitting option a is never slower than b: a lower-or-equal ZeRO stage with b's
    ZeRO-3 gathers absent in a, and no recomputation where b has it."""
    (za, ra), (zb, rb) = a, b
    return (za <= zb) and (ra <= rb)


__all__ = ["TrainSearch"]
