"""The rollout side of a plan: how many instances of each TP size, and which lengths each
serves, for a GPU budget.

Requests are sorted by length and cut into bins; instance types, in increasing TP order,
take contiguous ranges of bins (short requests on small TP, the tail on large TP). For a
target time tau, `min_gpus` finds the fewest GPUs meeting it by an exact dynamic program
over (type, last bin covered):

    h_k[i] = min over j <= i of  h_{k-1}[j] + tp_k * m_k(j, i, tau)

where m_k(j, i, tau) is the fewest type-k instances serving bins j..i-1 within tau
(`SegmentModel.min_instances`). `solve(gpus)` then finds the smallest tau whose answer fits
the budget: bisection brackets it, and a final loop asks for a plan strictly faster than
the best one found until there is none, so the answer is the exact optimum of the binned
problem. `exhaustive(gpus)` enumerates every instance mix and every segmentation instead.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from libra.planner.profiles import HardwareProfile, ModelProfile
from libra.planner.rollout_cost import instance_cost, tp_supported
from libra.planner.segments import SegmentModel
from libra.planner.settings import RolloutSettings
from libra.planner.workload import Bins, WorkloadStats, length_bins


@dataclass(frozen=True, slots=True)
class RolloutGroup:
    """Instances of one TP size and the request lengths they serve."""

    tp: int
    instances: int
    first_bin: int
    end_bin: int
    episodes: int
    min_tokens: int
    """Shortest final context served."""
    max_tokens: int
    """Longest final context served."""
    time_s: float
    kv_capacity_tokens: int

    @property
    def gpus(self) -> int:
        return self.tp * self.instances

    def as_dict(self) -> dict[str, Any]:
        return {
            "tp": self.tp,
            "instances": self.instances,
            "gpus": self.gpus,
            "episodes": self.episodes,
            "min_tokens": self.min_tokens,
            "max_tokens": self.max_tokens,
            "t_s": self.time_s,
            "kv_capacity_tokens": self.kv_capacity_tokens,
        }


@dataclass(frozen=True, slots=True)
class RolloutPlan:
    groups: tuple[RolloutGroup, ...]
    time_s: float

    @property
    def gpus(self) -> int:
        return sum(g.gpus for g in self.groups)

    def mix(self) -> dict[int, int]:
        return {g.tp: g.instances for g in self.groups}

    def as_dict(self) -> dict[str, Any]:
        return {
            "t_rollout_s": self.time_s,
            "gpus": self.gpus,
            "instances": [g.as_dict() for g in self.groups],
        }


INFEASIBLE = RolloutPlan((), math.inf)


class RolloutProblem:
    """One workload, model, hardware and instance settings; many budgets and targets."""

    def __init__(
        self,
        model: ModelProfile,
        hw: HardwareProfile,
        stats: WorkloadStats,
        settings: RolloutSettings,
        nbins: int,
    ):
        self.model, self.hw, self.settings = model, hw, settings
        self.bins: Bins = length_bins(stats, nbins)
        types = [instance_cost(model, hw, t, settings) for t in settings.tp_sizes]
        self.types = [ic for ic in types if ic.fits and tp_supported(model, hw, ic.tp)]
        self.seg = SegmentModel(self.bins, self.types, settings.max_num_seqs)
        self.tps = [ic.tp for ic in self.types]
        self.counts: Counter[str] = Counter()
        self._cache: dict[int, RolloutPlan] = {}
        self._bounds: tuple[float, float] | None = None

    @property
    def nbins(self) -> int:
        return self.bins.nbins

    @property
    def min_instance_gpus(self) -> int:
        """GPUs of the smallest instance that can serve every request (inf if none)."""
        full = [ic.tp for t, ic in enumerate(self.types) if self.seg.bcap[t][0, self.nbins] > 0]
        return min(full) if full else 0

    # --- the dynamic program --------------------------------------------------------------
    def min_gpus(
        self, tau: float, *, strict: bool = False
    ) -> tuple[float, list[tuple[int, int, int, int]]]:
        """Fewest GPUs serving all requests within tau (< tau when strict), and the
        segments (type, j, i, instances) achieving it."""
        nb = self.nbins
        h = np.full(nb + 1, math.inf)
        h[0] = 0.0
        choice = []
        for t, tp in enumerate(self.tps):
            m = self.seg.min_instances(t, tau, strict=strict)
            cost = h[:, None] + tp * m
            arg = np.argmin(cost, axis=0)
            h = cost[arg, np.arange(nb + 1)]
            choice.append((arg, m))
        self.counts["rollout_dp_solves"] += 1
        self.counts["rollout_segments_evaluated"] += len(self.tps) * nb * (nb + 1) // 2
        if not math.isfinite(h[nb]):
            return math.inf, []
        segs, i = [], nb
        for t in range(len(self.tps) - 1, -1, -1):
            arg, m = choice[t]
            j = int(arg[i])
            if j < i:
                segs.append((t, j, i, int(m[j, i])))
            i = j
        return float(h[nb]), segs[::-1]

    def plan_of(self, segs: list[tuple[int, int, int, int]]) -> RolloutPlan:
        """A plan from DP segments, timed by the forward model."""
        groups = []
        tot = self.bins.stats.total
        for t, j, i, m in segs:
            a, b = int(self.bins.edges[j]), int(self.bins.edges[i])
            groups.append(
                RolloutGroup(
                    tp=self.tps[t],
                    instances=m,
                    first_bin=j,
                    end_bin=i,
                    episodes=b - a,
                    min_tokens=int(tot[a]),
                    max_tokens=int(tot[b - 1]),
                    time_s=self.seg.time(t, j, i, m),
                    kv_capacity_tokens=self.types[t].kv_capacity,
                )
            )
        return RolloutPlan(tuple(groups), max((g.time_s for g in groups), default=math.inf))

    def lower_bound(self, gpus: int) -> float:
        """No plan on `gpus` GPUs is faster than this: the larger of (a) the slowest bin's
        critical path on its fastest type at batch 1 with no KV to read, and (b) the GPU
        time every plan spends reading KV, weights (at most max_num_seqs sequences share a
        read), transferring all-reduces and prefilling, spread over all `gpus`."""
        if self._bounds is None:
            seg, s = self.seg, self.bins.stats
            floor, work = np.full(self.nbins, np.inf), np.full(self.nbins, np.inf)
            seqs = float(self.settings.max_num_seqs)
            gen, kv = self.bins.sums(s.generated), self.bins.sums(s.kv_reads)
            for t, ic in enumerate(self.types):
                step1 = float(ic.step_s(1.0, 0.0))
                floor = np.minimum(floor, seg.gen_max * step1 + seg.other_max[t])
                pf = self.bins.sums(np.asarray(ic.prefill_s(s.prefill_tokens, s.prefill_pairs)))
                per = gen * float(ic.weight_read_s(seqs)) / seqs + kv * ic.kv_time_per_token
                work = np.minimum(work, ic.tp * (per + gen * ic.comm_per_token_s + pf))
            self._bounds = (float(floor.max()), float(work.sum()))
        floor_s, gpu_s = self._bounds
        return max(floor_s, gpu_s / max(gpus, 1))

    def fits(self, tau: float, gpus: int, *, strict: bool = False) -> bool:
        return self.min_gpus(tau, strict=strict)[0] <= gpus

    def solve(self, gpus: int, hint: float = math.inf) -> RolloutPlan:
        """The fastest rollout plan on at most `gpus` GPUs (INFEASIBLE if none). `hint`
        is the time of any plan known to fit the budget (it narrows the search)."""
        if gpus in self._cache:
            return self._cache[gpus]
        hi = self._upper(gpus)
        if hint < hi and self.fits(hint, gpus):
            # A hint is a plan's forward time; the inversion (`min_gpus`) can need one
            # more instance at exactly that time (r2e-gym, Qwen3-30B-A3B, 40 A800s:
            # 31 GPUs for a 30-GPU plan's 815.08 s), and a bisection started there ends
            # on a plan over the budget. It narrows the search only when it fits.
            hi = hint
        if not math.isfinite(hi):
            self._cache[gpus] = INFEASIBLE
            return INFEASIBLE
        lo = hi / 2.0
        while self.fits(lo, gpus) and lo > 1e-9:
            hi, lo = lo, lo / 2.0
        hi = bisect_time(lambda tau: self.fits(tau, gpus), lo, hi)
        plan = self._tighten(hi, gpus)
        self._cache[gpus] = plan
        return plan

    def _upper(self, gpus: int) -> float:
        """Time of some feasible plan: all GPUs as instances of one type."""
        best = math.inf
        for t, tp in enumerate(self.tps):
            if tp <= gpus:
                best = min(best, self.seg.time(t, 0, self.nbins, gpus // tp))
        return best

    def _tighten(self, tau: float, gpus: int) -> RolloutPlan:
        """From a feasible target, ask for strictly faster plans until none exists."""
        _, segs = self.min_gpus(tau)
        plan = self.plan_of(segs)
        while True:
            g, segs = self.min_gpus(plan.time_s, strict=True)
            if g > gpus:
                return plan
            better = self.plan_of(segs)
            if not better.time_s < plan.time_s:  # cannot happen if inversion and forward agree
                return plan
            plan = better

    # --- verification ------------------------------------------------------------------------
    def exhaustive(self, gpus: int) -> list[RolloutPlan]:
        """Every instance mix within `gpus` and every contiguous segmentation, timed by the
        forward model: entry R of the result is the fastest plan using at most R GPUs."""
        k, nb = len(self.tps), self.nbins
        tables = [self.seg.time_table(t, gpus // tp) for t, tp in enumerate(self.tps)]
        best = [math.inf] * (gpus + 1)
        keys: list[Any] = [None] * (gpus + 1)
        for mix in itertools.product(*(range(gpus // tp + 1) for tp in self.tps)):
            used = sum(m * tp for m, tp in zip(mix, self.tps, strict=True))
            if used > gpus or used == 0:
                continue
            self.counts["rollout_mixes_evaluated"] += 1
            # cost over the boundaries 0 = b_0 <= b_1 <= ... <= b_k = nb (k-1 free ones).
            cost: Any = np.zeros((nb + 1,) * (k - 1))
            for t in range(k):
                tab = tables[t][:, :, mix[t]]
                if k == 1:
                    part = tab[0, nb]
                elif t == 0:
                    part = _axis(tab[0, :], 0, k - 1)
                elif t == k - 1:
                    part = _axis(tab[:, nb], k - 2, k - 1)
                else:
                    part = _pair(tab, t - 1, k - 1)
                cost = np.maximum(cost, part)
            self.counts["rollout_segmentations_evaluated"] += int(np.size(cost))
            flat = int(np.argmin(cost))
            val = float(np.ravel(cost)[flat])
            if val < best[used]:
                cuts = np.unravel_index(flat, np.shape(cost)) if k > 1 else ()
                best[used], keys[used] = val, (mix, tuple(int(x) for x in cuts))
        out, run, run_key = [], math.inf, None
        for r in range(gpus + 1):
            if best[r] < run:
                run, run_key = best[r], keys[r]
            if run_key is None:
                out.append(INFEASIBLE)
                continue
            mix, cuts = run_key
            bounds = [0, *cuts, nb]
            segs = [
                (t, bounds[t], bounds[t + 1], mix[t]) for t in range(k) if bounds[t] < bounds[t + 1]
            ]
            out.append(self.plan_of(segs))
        return out


def _axis(v: np.ndarray, axis: int, ndim: int) -> np.ndarray:
    shape = [1] * ndim
    shape[axis] = v.shape[0]
    return v.reshape(shape)


def _pair(tab: np.ndarray, axis: int, ndim: int) -> np.ndarray:
    shape = [1] * ndim
    shape[axis], shape[axis + 1] = tab.shape[0], tab.shape[1]
    return tab.reshape(shape)


def bisect_time(
    feasible: Callable[[float], bool], lo: float, hi: float, rel: float = 1e-4
) -> float:
    """Smallest time (to `rel`) between an infeasible `lo` and a feasible `hi`."""
    while hi - lo > rel * hi:
        mid = math.sqrt(lo * hi) if lo > 0 else hi / 2.0
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return hi


__all__ = ["INFEASIBLE", "RolloutGroup", "RolloutPlan", "RolloutProblem", "bisect_time"]
