"""Trainer memory: the peak above the model's state for one micro-batch, and its time.

One GRPO forward + backward (`libra.trainer.grpo.backward`, the trainer's own) over one
micro-batch of `--tokens` tokens (`--rows` samples of equal length) of a model built
from a config with random weights (Qwen2 architecture; default: Qwen2-0.5B's shape with
a 32k vocabulary), float32 on CPU, in a fresh process per variant:

- `whole-logits`: the model's own forward, a micro-batch's float32 logits at once
  (`grpo.logprob_chunk_tokens = 0`; what the trainer did before);
- `chunked`: the output head `--chunk` positions at a time, each recomputed in the
  backward (the default);
- `whole-logits+ckpt` / `chunked+ckpt`: each with every decoder layer recomputed in
  the backward (`trainer.activation_checkpointing = true`).

Without checkpointing a 24-layer model's activations at 8,192 tokens need ~20 GiB:
pick the variants (`--variants`) and `--layers` the machine can hold.

Memory is the process's resident set: `state_mib` once the weights, their gradients and
both Adam moments exist (what the trainer allocates up front), `peak_mib` the high-water
mark during the pass (reset just before it: `/proc/self/clear_refs`), and
`above_state_mib` the difference (activations, logits,
log-prob buffers). The ratio row divides the first variant's `above_state_mib` by each one's, in the
same invocation.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from typing import Any

VARIANTS: dict[str, tuple[bool, bool]] = {
    "whole-logits": (False, False),
    "chunked": (True, False),
    "whole-logits+ckpt": (False, True),
    "chunked+ckpt": (True, True),
}
"""name -> (chunked log-probs, activation checkpointing)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=8192, help="tokens in the micro-batch")
    p.add_argument("--rows", type=int, default=8, help="samples in it (equal lengths)")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--intermediate", type=int, default=4864)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--chunk", type=int, default=1024, help="grpo.logprob_chunk_tokens")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS)}")  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    shape = {k: getattr(args, k) for k in ("tokens", "rows", "vocab", "hidden",
                                           "intermediate", "layers", "heads", "kv_heads",
                                           "threads")}  # fmt: skip
    results: dict[str, dict[str, Any]] = {}
    ctx = multiprocessing.get_context("spawn")
    for name in names:
        chunked, ckpt = VARIANTS[name]
        chunk = args.chunk if chunked else 0
        with ctx.Pool(1) as pool:  # a fresh process: its high-water mark is this pass's
            results[name] = pool.apply(_measure, (shape, chunk, ckpt))
    base = results[names[0]]["above_state_mib"]
    return {
        "shape": shape,
        "chunk": args.chunk,
        "variants": results,
        f"{names[0]}_above_state_over": {
            n: round(base / max(r["above_state_mib"], 1), 2) for n, r in results.items()
        },
    }


def _measure(shape: dict[str, int], chunk: int, ckpt: bool) -> dict[str, Any]:
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
        max_position_embeddings=max(4096, shape["tokens"]), tie_word_embeddings=True,
        use_cache=False,
    )  # fmt: skip
    model = Qwen2ForCausalLM(cfg).float().train()
    if ckpt:
        checkpoint_layers(model)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:  # what a Replica allocates up front: gradients and both Adam moments
        p.grad = torch.zeros_like(p)
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    n = shape["tokens"] // shape["rows"]
    prompt = n // 8
    gen = torch.Generator().manual_seed(1)
    samples = [
        Sample(torch.randint(shape["vocab"], (n,), generator=gen).tolist(), prompt,
               [1] * (n - prompt), [-1.0] * (n - prompt), 1.0 if i % 2 else -1.0, 0)
        for i in range(shape["rows"])
    ]  # fmt: skip
    gcfg = GRPOConfig(micro_batch_tokens=n * shape["rows"], logprob_chunk_tokens=chunk)
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
        "tokens_per_s": round(shape["tokens"] / took),
        "loss_tokens": stats.tokens,
    }


def _rss_mib(field: str) -> float:
    """This process's resident set (`VmRSS`) or its high-water mark (`VmHWM`), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


__all__ = ["add_arguments", "run"]
