"""Trainer memory: the peak above the model's state for one micro-batch, and its time.

One GRPO forward + backward (`libra.trainer.grpo.backward`, the trainer's own) over one
micro-batch of `--tokens` tokens (`--rows` samples of equal length) of a model built
from a config with random weights (Qwen2 architecture; default: Qwen2-0.5B's shape with
a 32k vocabulary), float32 on CPU, in a fresh process per variant. `--mix rl` replaces
the equal rows by samples of log-uniform lengths (`--min-len` to `--max-len`, a long
tail of a few long trajectories among many short ones) adding up to about `--tokens`,
split into micro-batches of `--budget` tokens: the whole step's passes.

- `whole-logits`: the model's own forward, a micro-batch's float32 logits at once
  (`grpo.logprob_chunk_tokens = 0`; what the trainer did before);
- `chunked`: the output head `--chunk` positions at a time, each recomputed in the
  backward (the default);
- `whole-logits+ckpt` / `chunked+ckpt`: each with every decoder layer recomputed in
  the backward (`trainer.activation_checkpointing = true`);
- `chunked+packed` / `chunked+ckpt+packed`: the samples of a micro-batch concatenated
  in one row (`grpo.packing = true`) instead of padded rows; compare with `--mix rl`.

Without checkpointing a 24-layer model's activations at 8,192 tokens need ~20 GiB:
pick the variants (`--variants`) and `--layers` the machine can hold.

Memory is the process's resident set: `state_mib` once the weights, their gradients and
both Adam moments exist (what the trainer allocates up front), `peak_mib` the high-water
mark during the pass (reset just before it: `/proc/self/clear_refs`), and
`above_state_mib` the difference (activations, logits,
log-prob buffers). The ratio row divides the first variant's `above_state_mib` by each one's, in the
same invocation. `--repeats N` runs every variant N times, round robin (on a shared
machine a busy spell then slows each variant alike), and reports the fastest pass and
the highest peak.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from typing import Any

VARIANTS: dict[str, tuple[bool, bool, bool]] = {
    "whole-logits": (False, False, False),
    "chunked": (True, False, False),
    "whole-logits+ckpt": (False, True, False),
    "chunked+ckpt": (True, True, False),
    "chunked+packed": (True, False, True),
    "chunked+ckpt+packed": (True, True, True),
}
"""name -> (chunked log-probs, activation checkpointing, packing)."""
DEFAULT = ("whole-logits", "chunked", "whole-logits+ckpt", "chunked+ckpt")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=8192, help="tokens in the micro-batch")
    p.add_argument("--rows", type=int, default=8, help="samples in it (equal lengths)")
    p.add_argument("--mix", choices=("equal", "rl"), default="equal",
                   help="equal: --rows samples in one micro-batch; rl: log-uniform lengths "
                   "in micro-batches of --budget tokens")  # fmt: skip
    p.add_argument("--budget", type=int, default=4096, help="grpo.micro_batch_tokens (rl)")
    p.add_argument("--min-len", type=int, default=128, help="shortest sample (rl)")
    p.add_argument("--max-len", type=int, default=4096, help="longest sample (rl)")
    add_model_arguments(p)
    p.add_argument("--chunk", type=int, default=1024, help="grpo.logprob_chunk_tokens")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each variant, round robin; the fastest is reported")  # fmt: skip
    p.add_argument("--variants", default=",".join(DEFAULT),
                   help=f"comma-separated, of {', '.join(VARIANTS)}")  # fmt: skip


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The shape of the model built from a config (default: Qwen2-0.5B's widths with a
    32k vocabulary); `libra bench gpu-check` takes the same flags."""
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--intermediate", type=int, default=4864)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    shape = {k: getattr(args, k) for k in ("tokens", "rows", "vocab", "hidden",
                                           "intermediate", "layers", "heads", "kv_heads",
                                           "threads", "mix", "budget", "min_len",
                                           "max_len")}  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    ctx = multiprocessing.get_context("spawn")
    for _ in range(args.repeats):  # round robin: a busy spell slows every variant alike
        for name in names:
            chunked, ckpt, packing = VARIANTS[name]
            chunk = args.chunk if chunked else 0
            with ctx.Pool(1) as pool:  # a fresh process: its high-water mark is this pass's
                runs[name].append(pool.apply(_measure, (shape, chunk, ckpt, packing)))
    results = {n: _fastest(r) for n, r in runs.items()}
    base = results[names[0]]["above_state_mib"]
    return {
        "shape": shape,
        "chunk": args.chunk,
        "variants": results,
        f"{names[0]}_above_state_over": {
            n: round(base / max(r["above_state_mib"], 1), 2) for n, r in results.items()
        },
    }


def _fastest(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest run's figures, every run's time and the highest peak."""
    best = dict(min(runs, key=lambda r: r["pass_s"]))
    best["pass_s_runs"] = [r["pass_s"] for r in runs]
    best["peak_mib"] = max(r["peak_mib"] for r in runs)
    best["above_state_mib"] = max(r["above_state_mib"] for r in runs)
    return best


def _measure(shape: dict[str, Any], chunk: int, ckpt: bool, packing: bool) -> dict[str, Any]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from libra.trainer import grpo
    from libra.trainer.config import GRPOConfig
    from libra.trainer.model import checkpoint_layers
    from libra.trainer.samples import Sample

    if shape["threads"]:
        torch.set_num_threads(shape["threads"])
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=max(4096, shape["tokens"], shape["max_len"]),
        tie_word_embeddings=True,
        use_cache=False,
    )  # fmt: skip
    model = Qwen2ForCausalLM(cfg).float().train()
    if ckpt:
        checkpoint_layers(model)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:  # what a Replica allocates up front: gradients and both Adam moments
        p.grad = torch.zeros_like(p)
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    gen = torch.Generator().manual_seed(1)
    lengths = _lengths(shape)
    samples = [
        Sample(torch.randint(shape["vocab"], (n,), generator=gen).tolist(), n // 8,
               [1] * (n - n // 8), [-1.0] * (n - n // 8), 1.0 if i % 2 else -1.0, 0)
        for i, n in enumerate(lengths)
    ]  # fmt: skip
    budget = shape["budget"] if shape["mix"] == "rl" else sum(lengths)
    gcfg = GRPOConfig(micro_batch_tokens=budget, logprob_chunk_tokens=chunk, packing=packing)
    plans = grpo.plan_micro_batches(samples, budget, packing=packing)
    width = [sum(lengths[i] for i in p) if packing else len(p) * max(lengths[i] for i in p)
             for p in plans]  # fmt: skip
    with open("/proc/self/clear_refs", "w") as f:  # the high-water mark restarts here
        f.write("5")
    state = _rss_mib("VmRSS")
    t0 = time.perf_counter()
    stats = grpo.backward(model, samples, gcfg)
    took = time.perf_counter() - t0
    peak = _rss_mib("VmHWM")
    del moments
    return {
        "params_m": round(sum(p.numel() for p in params) / 1e6, 1),
        "state_mib": round(state),
        "peak_mib": round(peak),
        "above_state_mib": round(peak - state),
        "pass_s": round(took, 2),
        "tokens_per_s": round(sum(lengths) / took),
        "loss_tokens": stats.tokens,
        "samples": len(lengths),
        "tokens": sum(lengths),
        "micro_batches": len(plans),
        "padded_tokens": sum(width),
    }


def _lengths(shape: dict[str, Any]) -> list[int]:
    """Sample lengths: `--rows` equal ones, or log-uniform ones adding up to about
    `--tokens` (`--mix rl`; seeded, so every variant gets the same)."""
    import math
    import random

    if shape["mix"] == "equal":
        return [shape["tokens"] // shape["rows"]] * shape["rows"]
    rng = random.Random(0)
    lo, hi = math.log(shape["min_len"]), math.log(shape["max_len"])
    out: list[int] = []
    while sum(out) < shape["tokens"]:
        out.append(round(math.exp(rng.uniform(lo, hi))))
    return out


def _rss_mib(field: str) -> float:
    """This process's resident set (`VmRSS`) or its high-water mark (`VmHWM`), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


__all__ = ["add_arguments", "run"]
