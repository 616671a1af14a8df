"""The cost model against published measurements (docs/cost-model.md#validation).

`decode_checks()` times the seven published vLLM decode measurements the efficiencies
were fitted to; `kv_log_check()` a vLLM KV-cache log line; `sequence_length_table()` the
paper's 1K -> 32K asymmetry; `sensitivity()` how a plan moves when one efficiency does.
`libra bench planner --validate` prints them; the unit tests assert them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from libra.planner.evaluate import best_train, solve_rollout
from libra.planner.profiles import GIB, HardwareProfile, ModelProfile, load_hardware, load_model
from libra.planner.rollout_cost import decode_step_time, kv_bytes_per_token_per_gpu, prefill_time
from libra.planner.search import plan
from libra.planner.workload import WorkloadStats

LLAMA_31_8B = ModelProfile(
    id="llama-3.1-8b", name="Llama-3.1-8B", layers=32, hidden=4096, heads=32, kv_heads=8,
    head_dim=128, intermediate=14336, vocab=128256,
)  # fmt: skip
LLAMA_3_70B = ModelProfile(
    id="llama-3-70b", name="Llama-3-70B", layers=80, hidden=8192, heads=64, kv_heads=8,
    head_dim=128, intermediate=28672, vocab=128256,
)  # fmt: skip
MIXTRAL_8X7B = ModelProfile(
    id="mixtral-8x7b", name="Mixtral-8x7B", layers=32, hidden=4096, heads=32, kv_heads=8,
    head_dim=128, intermediate=14336, vocab=32000, experts=8, experts_active=2,
    moe_intermediate=14336,
)  # fmt: skip
QWEN3_235B = ModelProfile(
    id="qwen3-235b-a22b", name="Qwen3-235B-A22B", layers=94, hidden=4096, heads=64,
    kv_heads=4, head_dim=128, intermediate=12288, vocab=151936, experts=128,
    experts_active=8, moe_intermediate=1536,
)  # fmt: skip


def _a100_40g() -> HardwareProfile:
    a800 = load_hardware("a800-80g")
    return dataclasses.replace(
        a800, id="a100-40g", memory_bytes=40 * GIB, hbm_bandwidth=1.555e12,
        intra_node_bandwidth=300e9,
    )  # fmt: skip


def latency_test(
    m: ModelProfile, hw: HardwareProfile, tp: int, batch: int, inp: int, out: int
) -> float:
    """vLLM's latency benchmark: prefill batch x inp tokens, then out - 1 decode steps."""
    t = prefill_time(m, hw, tp, batch * inp)
    return t + sum(decode_step_time(m, hw, tp, batch, batch * (inp + k)) for k in range(out - 1))


def decode_checks() -> list[tuple[str, Callable[[], float], float, str]]:
    """(what, model prediction, measured seconds, source) for each published measurement."""
    h200, h100, a100 = load_hardware("h200-141g"), load_hardware("h100-80g"), _a100_40g()
    dash = "buildkite.com/vllm/performance-benchmark/builds/9515"
    sweep_a100 = "johnmusgrave.com/p/vllm-throughput-latency-sweep-on"
    sweep_h100 = "yobitelcomm.github.io/bench/recipes/concurrency-sweep"
    return [
        ("H200 Llama-3.1-8B TP1, batch 8, 32 in / 128 out",
         lambda: latency_test(LLAMA_31_8B, h200, 1, 8, 32, 128), 0.8334, dash),
        ("H200 Llama-3-70B TP4, same test",
         lambda: latency_test(LLAMA_3_70B, h200, 4, 8, 32, 128), 2.0775, dash),
        ("H200 Mixtral-8x7B TP2, same test",
         lambda: latency_test(MIXTRAL_8X7B, h200, 2, 8, 32, 128), 1.9174, dash),
        ("A100-40GB Llama-3.1-8B, 1 request, 1024 in, TPOT",
         lambda: decode_step_time(LLAMA_31_8B, a100, 1, 1, 1088), 1 / 75, sweep_a100),
        ("A100-40GB Llama-3.1-8B, 8 requests (6.6x the throughput of 1), TPOT",
         lambda: decode_step_time(LLAMA_31_8B, a100, 1, 8, 8 * 1088), 8 / (75 * 6.6), sweep_a100),
        ("H100 Llama-3.1-8B, 1 request, TPOT",
         lambda: decode_step_time(LLAMA_31_8B, h100, 1, 1, 512), 6.48e-3, sweep_h100),
        ("H100 Llama-3.1-8B, 4 requests, TPOT",
         lambda: decode_step_time(LLAMA_31_8B, h100, 1, 4, 4 * 512), 6.59e-3, sweep_h100),
    ]  # fmt: skip


def decode_table() -> dict[str, Any]:
    rows, errs = [], []
    for what, predict, measured, source in decode_checks():
        p = predict()
        errs.append(math.log(p / measured))
        rows.append(
            {
                "measurement": what,
                "measured_ms": round(measured * 1e3, 2),
                "model_ms": round(p * 1e3, 2),
                "error": f"{100 * (p / measured - 1):+.0f}%",
                "source": source,
            }
        )
    return {
        "rows": rows,
        "rms_log_error": round(math.sqrt(sum(e * e for e in errs) / len(errs)), 4),
    }


def kv_log_check() -> dict[str, Any]:
    """vllm-project/vllm#21348: 4x H100, Qwen3-235B-A22B TP4, 'Available KV cache memory:
    8.11 GiB, GPU KV cache size: 178,880 tokens' (bf16 KV cache)."""
    tokens = 8.11 * GIB / kv_bytes_per_token_per_gpu(QWEN3_235B, 4)
    return {
        "measured_tokens": 178_880,
        "model_tokens": round(tokens),
        "error": tokens / 178_880 - 1,
    }


def uniform_batch(episodes: int, prompt: int, generated: int) -> WorkloadStats:
    """A batch of identical single-turn episodes."""
    from libra.record import Trajectory

    recs = [
        Trajectory(
            id=str(i), batch_id="b", task_id=str(i // 16), group_id=str(i // 16), env="x",
            prompt_tokens=prompt, total_tokens=prompt + generated,
        )
        for i in range(episodes)
    ]  # fmt: skip
    return WorkloadStats.from_records(recs)


def sequence_length_table(gpus: int = 8, hardware: str = "a800-80g") -> list[dict[str, Any]]:
    """Rollout and training time of one batch whose sequences are all 1K, then all 32K
    tokens (256 prompt + response), each on the best plan for `gpus` GPUs."""
    hw, rows = load_hardware(hardware), []
    for name in ("qwen3-14b", "qwen3-4b"):
        m = load_model(name)
        for episodes in (64, 512):
            t: dict[int, tuple[float, float]] = {}
            for length in (1024, 32768):
                stats = uniform_batch(episodes, 256, length - 256)
                train = best_train(m, hw, stats, gpus)
                t[length] = (
                    solve_rollout(m, hw, stats, gpus).time_s,
                    train.total_s if train else math.inf,
                )
            (r1, t1), (r32, t32) = t[1024], t[32768]
            rows.append(
                {
                    "model": name,
                    "episodes": episodes,
                    "rollout_s": [round(r1, 1), round(r32, 1)],
                    "rollout_x": round(r32 / r1, 1),
                    "train_s": [round(t1, 1), round(t32, 1)],
                    "train_x": round(t32 / t1, 1),
                    "train_per_token_x": round(t32 / t1 / 32, 2),
                }
            )
    return rows


SENSITIVITY = (
    ("hbm", 0.8), ("hbm", 1.1), ("train_mfu", 0.8), ("train_mfu", 1.2), ("prefill_mfu", 0.5),
    ("allreduce_latency_s", 2.0), ("allreduce_latency_s", 0.25), ("step_overhead_s", 2.0),
    ("step_overhead_s", 0.25),
)  # fmt: skip


def sensitivity(
    model: ModelProfile, hw: HardwareProfile, stats: WorkloadStats, gpus: int
) -> dict[str, Any]:
    """The plan re-searched with one efficiency scaled at a time."""
    base = plan(model, hw, stats, gpus)
    rows = []
    for field, factor in SENSITIVITY:
        value = getattr(hw.eff, field) * factor
        if field == "hbm":
            value = min(value, 1.0)
        changed = dataclasses.replace(hw, eff=dataclasses.replace(hw.eff, **{field: value}))
        p = plan(model, changed, stats, gpus)
        rows.append(
            {
                "change": f"{field} x{factor:g}",
                "t_iter_s": round(p.t_iter, 1),
                "vs_base": f"{100 * (p.t_iter / base.t_iter - 1):+.0f}%",
                "train_gpus": p.train_gpus,
                "rollout_gpus": p.rollout_gpus,
            }
        )
    return {
        "base": {"t_iter_s": round(base.t_iter, 1), "train_gpus": base.train_gpus,
                 "rollout_gpus": base.rollout_gpus},
        "rows": rows,
    }  # fmt: skip


__all__ = [
    "decode_checks",
    "decode_table",
    "kv_log_check",
    "latency_test",
    "sensitivity",
    "sequence_length_table",
    "uniform_batch",
]
