"""What a move between buckets costs, for C-MLFQ's KV-aware decision.

A move re-prefills the whole context on the new bucket (its KV cache does not travel).
`MoveCost` is the small protocol the policy needs from an endpoint cost model:

    prefill_s(bucket, tokens)           seconds to prefill `tokens` on one instance
    decode_s_per_token(bucket, context) seconds per generated token (one decode step of
                                        a typical batch) at context length `context`

`TPScaledCost` is a self-contained default (a dense model on one accelerator type,
constants below); `PlannerCost` prices the same two quantities with the planner's
rollout cost model (`libra.planner.rollout_cost`) for a named model and hardware.

`judge_move` is the rule (docs/cmlfq.md): a move *up* (to a larger bound) pays when the
decode time it saves over the predicted remaining length, plus the forced re-prefill it
avoids if the episode would outgrow its bucket anyway, exceeds the re-prefill now; a move
*down* pays when it lowers the GPU time (seconds x TP) of the rest of the episode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from libra.routing.base import Bucket


class MoveCost(Protocol):
    def prefill_s(self, bucket: Bucket, tokens: int) -> float: ...

    def decode_s_per_token(self, bucket: Bucket, context: float) -> float: ...


@dataclass(frozen=True, slots=True)
class TPScaledCost:
    """Roofline costs of a dense model served at TP t: decode reads the weights and the
    batch's KV cache, split over t GPUs; prefill is compute-bound. Defaults: Qwen3-14B
    (14.8B parameters, 40 layers, 8 KV heads of 128, hidden 5120, bf16) on A800-80G
    (2.04 TB/s HBM, 312 bf16 TFLOP/s) — see docs/cmlfq.md for the sources."""

    params: float = 14.8e9
    kv_bytes_per_token: float = 2 * 40 * 8 * 128 * 2
    attn_flops_per_pair: float = 4 * 40 * 5120
    dtype_bytes: int = 2
    hbm_bytes_s: float = 2.039e12 * 0.8
    flops: float = 312e12 * 0.5
    allreduce_step_s: float = 2 * 40 * 10e-6
    """Two all-reduces per layer per step at ~10 us each when t > 1."""
    batch: int = 32

    def decode_s_per_token(self, bucket: Bucket, context: float) -> float:
        t = bucket.tp
        read = (self.params * self.dtype_bytes + self.batch * context * self.kv_bytes_per_token) / t
        return read / self.hbm_bytes_s + (self.allreduce_step_s if t > 1 else 0.0)

    def prefill_s(self, bucket: Bucket, tokens: int) -> float:
        flops = 2 * self.params * tokens + self.attn_flops_per_pair * tokens * tokens / 2
        return flops / (bucket.tp * self.flops)


class PlannerCost:
    """`MoveCost` from the planner's rollout cost model for a model and hardware profile
    (ids as `libra plan` knows them, e.g. `qwen3-14b`, `a800-80g`)."""

    def __init__(self, model: str, hardware: str, batch: int = 32):
        from libra.planner import profiles

        self._model = profiles.load_model(model)
        self._hw = profiles.load_hardware(hardware)
        self.batch = batch

    def decode_s_per_token(self, bucket: Bucket, context: float) -> float:
        from libra.planner.rollout_cost import decode_step_time

        return decode_step_time(
            self._model, self._hw, bucket.tp, self.batch, self.batch * float(context)
        )

    def prefill_s(self, bucket: Bucket, tokens: int) -> float:
        from libra.planner.rollout_cost import prefill_time

        return prefill_time(self._model, self._hw, bucket.tp, tokens)


def judge_move(
    cost: MoveCost,
    cur: Bucket,
    to: Bucket,
    context: int,
    remaining: float,
) -> tuple[bool, str]:
    """Whether moving an episode at `context` tokens with `remaining` predicted tokens
    from `cur` to `to` pays for its re-prefill, and the figures behind the answer."""
    prefill = cost.prefill_s(to, context)
    mid = context + remaining / 2
    if to.bound > cur.bound:
        saved = remaining * (cost.decode_s_per_token(cur, mid) - cost.decode_s_per_token(to, mid))
        if context + remaining > cur.bound:
            saved += cost.prefill_s(to, cur.bound)  # the overflow move it spares
        return saved > prefill, f"re-prefill {prefill:.3g}s vs decode saved {saved:.3g}s"
    stay = remaining * cost.decode_s_per_token(cur, mid) * cur.tp
    move = (prefill + remaining * cost.decode_s_per_token(to, mid)) * to.tp
    return move < stay, f"GPU-s {move:.3g} moved vs {stay:.3g} staying (re-prefill {prefill:.3g}s)"


__all__ = ["MoveCost", "PlannerCost", "TPScaledCost", "judge_move"]
