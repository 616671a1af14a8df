"""The trainer on one device, end to end: what `scripts/gpu-check.sh` runs on a GPU.

One rank of the elastic trainer's own code (`Replica`, `grpo.backward`,
`Replica.apply`, `checkpoint.save` / `load`) on `--device` (`cuda`: one GPU, NCCL
backend; `cpu`: what CI runs, at a tiny shape):

1. a Qwen3-architecture model built from a config with random weights (nothing is
   downloaded; default: about 0.5B parameters, Qwen2-0.5B's widths, a 32k vocabulary);
2. `--steps` GRPO steps in bfloat16 (float32 master weights and Adam state) over a
   batch of log-uniform lengths, packed (`grpo.packing`), log-probs in chunks; per step
   tokens/s, model FLOP utilisation (6 x parameters x tokens plus causal attention over
   the device's peak `--peak-tflops`), and peak device memory;
3. a DCP checkpoint saved and loaded into a fresh replica: the state hash must match;
4. one step's loss on a tiny float32 model, on the CPU and on `--device`, from the same
   weights and batch: the relative difference of the summed loss and of the gradient;
5. the elastic domain with its replicas on `--device` (`libra bench elastic --device`,
   a small model, `--elastic-cycles` join/leave cycles): a core replica and a hybrid in
   their own processes, both on GPU 0 (two ranks of one replica cannot share a GPU under
   NCCL; two replicas can, their domain being gloo over host memory): the hybrid's
   snapshot lands in device memory, buffered updates replay from host buffers, and the
   replicas' state hashes must agree (`hash_mismatches` 0).

Prints one JSON document; every figure is measured in this run.
"""

from __future__ import annotations

import argparse
import math
import random
import tempfile
import time
from pathlib import Path
from typing import Any

PARTS = ("cpu_vs_device", "train", "elastic")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from libra.bench.trainer import add_model_arguments

    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tokens", type=int, default=65536, help="tokens per step (about)")
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--budget", type=int, default=16384, help="grpo.micro_batch_tokens")
    p.add_argument("--chunk", type=int, default=1024, help="grpo.logprob_chunk_tokens")
    add_model_arguments(p)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--no-packing", action="store_true", help="padded micro-batches instead")
    p.add_argument("--checkpointing", action="store_true",
                   help="trainer.activation_checkpointing")  # fmt: skip
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="the device's dense bf16 peak (H100/H200 SXM: 989)")  # fmt: skip
    p.add_argument("--profile", action="store_true",
                   help="instead of the parts: --steps timed steps packed and padded on one "
                        "batch, then torch.profiler over one more packed step (its tables on "
                        "stderr)")  # fmt: skip
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"which parts run, comma-separated (of {','.join(PARTS)})")  # fmt: skip
    p.add_argument("--elastic-cycles", type=int, default=1,
                   help="hybrid join/leave cycles on the device (0: skip)")  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from libra.trainer.device import CPU, cuda

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here (--device cpu runs on CPU)")
    device = cuda(0) if args.device == "cuda" else CPU
    parts = set(args.parts.split(","))
    if not parts <= set(PARTS):
        raise SystemExit(f"--parts: {sorted(parts - set(PARTS))} unknown (of {', '.join(PARTS)})")
    if args.profile:
        return _profile(args, device)
    with tempfile.TemporaryDirectory(prefix="libra-gpu-check-") as tmp:
        root = Path(tmp)
        shape = _shape(args)
        out: dict[str, Any] = {
            "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "shape": shape,
        }
        tiny = {**shape, "hidden": 64, "intermediate": 128, "layers": 2, "heads": 4,
                "kv_heads": 2, "head_dim": 16, "vocab": 512}  # fmt: skip
        # each part runs even when one before it failed: one device session answers all
        if "cpu_vs_device" in parts:
            out["cpu_vs_device"] = _part(
                "cpu_vs_device", lambda: _compare(device, _model(root / "tiny", tiny))
            )
        if "train" in parts:
            model = root / "model"
            out["train"] = _part("train", lambda: _train(args, device, _model(model, shape)))
    if "elastic" in parts and args.elastic_cycles:
        out["elastic"] = _part("elastic", lambda: _elastic(args))
    out["failed"] = [k for k, v in out.items() if isinstance(v, dict) and "error" in v]
    return out


def _part(name: str, fn: Any) -> dict[str, Any]:
    """`fn()`, or its failure as `{"error": the traceback's last lines}`; its progress on
    stderr (a run cut off by its time limit still says where it was)."""
    import sys
    import traceback

    t0 = time.perf_counter()
    print(f"gpu-check: {name} ...", file=sys.stderr, flush=True)
    try:
        got: dict[str, Any] = fn()
    except Exception:  # reported in the JSON, and the command exits 1
        traceback.print_exc()
        got = {"error": traceback.format_exc().strip().splitlines()[-12:]}
    print(f"gpu-check: {name} done in {time.perf_counter() - t0:.1f} s", file=sys.stderr,
          flush=True)  # fmt: skip
    return got


def _elastic(args: argparse.Namespace) -> dict[str, Any]:
    """`libra bench elastic` on `--device`, small: one core replica, one hybrid."""
    from libra.bench import elastic

    p = argparse.ArgumentParser()
    elastic.add_arguments(p)
    ns = p.parse_args([
        "--device", args.device, "--core", "1", "--cycles", str(args.elastic_cycles),
        "--global-samples", "4", "--hidden", "128", "--layers", "2", "--intermediate", "256",
        "--baseline", "6", "--ready-updates", "6", "--idle-updates", "4", "--hash-every", "3",
        "--timeout", "60",
    ])  # fmt: skip
    got = elastic.run(ns)
    keys = ("hash_checks", "hash_mismatches", "join_latency_s", "join_stall_ratio", "wall_s")
    return {k: got.get(k) for k in keys}


def _shape(args: argparse.Namespace) -> dict[str, int]:
    keys = ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim")
    return {k: getattr(args, k) for k in keys}


def _model(folder: Path, shape: dict[str, int]) -> Path:
    """A Qwen3 model folder with random weights (float32 on disk, as `load_model` reads)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"], max_position_embeddings=32768, tie_word_embeddings=True,
        use_cache=False,
    )  # fmt: skip
    Qwen3ForCausalLM(cfg).float().save_pretrained(folder)
    return folder


def _samples(total: int, lo: int, hi: int, vocab: int, seed: int) -> list[Any]:
    """Log-uniform lengths adding up to about `total`; an eighth of each is prompt."""
    from libra.trainer.samples import Sample

    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
    out = []
    for i, n in enumerate(lengths):
        p = max(1, n // 8)
        ids = [rng.randrange(vocab) for _ in range(n)]
        logps = [-rng.uniform(0.1, 3.0) for _ in range(n - p)]
        out.append(Sample(ids, p, [1] * (n - p), logps, 1.0 if i % 2 else -1.0, 0))
    return out


def _trainer_cfg(folder: Path, args: argparse.Namespace | None, dtype: str) -> Any:
    from libra.trainer.config import TrainerConfig

    grpo: dict[str, Any] = {}
    if args is not None:
        grpo = {"micro_batch_tokens": args.budget, "logprob_chunk_tokens": args.chunk,
                "packing": not args.no_packing}  # fmt: skip
    ckpt = bool(args and args.checkpointing)
    return TrainerConfig(model=str(folder), dtype=dtype, grpo=grpo,
                         activation_checkpointing=ckpt)  # fmt: skip


def _step(replica: Any, samples: list[Any], flat: Any) -> dict[str, float]:
    """One GRPO update on `samples` as a rank of the elastic trainer makes it: the
    backward on the device, the gradient packed into `flat` (the elastic domain's host
    buffer, pinned on CUDA) and its sum of squares taken there, the update applied from
    it. Returns the summed loss, the loss tokens and each phase's seconds."""
    import torch

    from libra.trainer import grpo
    from libra.trainer.replica import sumsq

    def clock() -> float:
        if replica.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    cfg = replica.cfg
    t0 = clock()
    stats = grpo.backward(replica.model, samples, cfg.grpo, dtype=cfg.dtype, device=replica.device)
    t1 = clock()
    replica.pack_grads(flat)
    gsq = sumsq(flat)
    t2 = clock()
    replica.apply(flat, stats.tokens, gsq)
    t3 = clock()
    return {"loss": stats.metrics["loss"], "tokens": stats.tokens, "compute_s": t1 - t0,
            "exchange_s": t2 - t1, "apply_s": t3 - t2}  # fmt: skip


def _train(args: argparse.Namespace, device: Any, folder: Path) -> dict[str, Any]:
    import torch

    from libra.trainer import checkpoint
    from libra.trainer.replica import Replica

    cuda = device.type == "cuda"
    replica = Replica(_trainer_cfg(folder, args, "bfloat16"), device=device)
    params = sum(p.numel() for p in replica.params)
    layers, width = args.layers, args.heads * args.head_dim
    flat = torch.zeros(replica.grad_numel, pin_memory=cuda)
    steps = []
    for k in range(args.steps):
        samples = _samples(args.tokens, args.min_len, args.max_len, args.vocab, seed=k)
        tokens = sum(s.length for s in samples)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        got = _step(replica, samples, flat)
        if cuda:
            torch.cuda.synchronize()
        took = time.perf_counter() - t0
        # forward + backward: 6 flops per parameter and token, plus causal attention
        # (QK^T and AV, 4 x width per query-key pair, x3 for the backward)
        pairs = sum(s.length * (s.length + 1) / 2 for s in samples)
        flops = 6 * params * tokens + 12 * layers * width * pairs
        steps.append({
            "step": k,
            "tokens": tokens,
            "samples": len(samples),
            "seconds": round(took, 3),
            "tokens_per_s": round(tokens / took),
            "mfu": round(flops / took / (args.peak_tflops * 1e12), 4) if cuda else None,
            "peak_memory_gib": (
                round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None
            ),
            "loss_per_token": round(got["loss"] / max(got["tokens"], 1), 6),
            "phases_s": {k: round(got[k], 3) for k in ("compute_s", "exchange_s", "apply_s")},
        })  # fmt: skip
    ckpt = folder.parent / "ckpt"
    t0 = time.perf_counter()
    checkpoint.save(replica, ckpt, {"version": args.steps})
    saved_s = time.perf_counter() - t0
    again = Replica(_trainer_cfg(folder, args, "bfloat16"), device=device)
    t0 = time.perf_counter()
    checkpoint.load(again, ckpt)
    loaded_s = time.perf_counter() - t0
    return {
        "params_m": round(params / 1e6, 1),
        "packing": not args.no_packing,
        "activation_checkpointing": args.checkpointing,
        "steps": steps,
        "dcp": {
            "save_s": round(saved_s, 2),
            "load_s": round(loaded_s, 2),
            "state_hash_equal": again.state_hash() == replica.state_hash(),
            "bytes": sum(f.stat().st_size for f in ckpt.iterdir()),
        },
    }


def _profile(args: argparse.Namespace, device: Any) -> dict[str, Any]:
    """Where a step's time goes: `--steps` timed steps on one batch, packed then padded
    (a fresh replica each), then `torch.profiler` over one more packed step; its tables
    (by device time, by host time) go to stderr."""
    import sys

    import torch
    from torch.profiler import ProfilerActivity, profile

    from libra.trainer.replica import Replica

    cuda = device.type == "cuda"
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if cuda else "cpu"}
    with tempfile.TemporaryDirectory(prefix="libra-gpu-check-") as tmp:
        folder = _model(Path(tmp) / "model", _shape(args))
        samples = _samples(args.tokens, args.min_len, args.max_len, args.vocab, seed=1)
        out["tokens"] = sum(s.length for s in samples)
        for packing in (True, False):
            layout = argparse.Namespace(**{**vars(args), "no_packing": not packing})
            replica = Replica(_trainer_cfg(folder, layout, "bfloat16"), device=device)
            flat = torch.zeros(replica.grad_numel, pin_memory=cuda)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            steps = [_step(replica, samples, flat) for _ in range(args.steps)]
            out["packed" if packing else "padded"] = {
                "step_s": [round(x["compute_s"] + x["exchange_s"] + x["apply_s"], 3)
                           for x in steps],
                "peak_memory_gib": (
                    round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None
                ),
            }  # fmt: skip
            if packing:
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                with profile(activities=acts) as prof:
                    _step(replica, samples, flat)
                table = prof.key_averages()
                key = "cuda_time_total" if cuda else "cpu_time_total"
                print(table.table(sort_by=key, row_limit=20, max_name_column_width=60),
                      file=sys.stderr)  # fmt: skip
                print(table.table(sort_by="self_cpu_time_total", row_limit=12,
                                  max_name_column_width=60), file=sys.stderr)  # fmt: skip
            del replica
            if cuda:
                torch.cuda.empty_cache()
    return out


def _compare(device: Any, folder: Path) -> dict[str, Any]:
    """One float32 step's loss and gradient from the same weights and batch: padded on
    the CPU against padded on `device` (the device's arithmetic), and packed against
    padded on `device` (the installed transformers' packed-sequence masking there)."""
    import torch

    from libra.trainer import grpo
    from libra.trainer.config import TrainerConfig
    from libra.trainer.device import CPU
    from libra.trainer.replica import Replica

    samples = _samples(2048, 16, 512, vocab=512, seed=7)
    out = {}
    for name, dev, packing in (("cpu", CPU, False), ("device", device, False),
                               ("packed", device, True)):  # fmt: skip
        cfg = TrainerConfig(model=str(folder), dtype="float32", grpo={"packing": packing})
        replica = Replica(cfg, device=dev)
        stats = grpo.backward(replica.model, samples, replica.cfg.grpo, device=dev)
        flat = torch.zeros(replica.grad_numel)
        replica.pack_grads(flat)
        out[name] = (stats.metrics["loss"], flat)

    def rel(a: str, b: str) -> tuple[float, float]:
        (la, ga), (lb, gb) = out[a], out[b]
        loss = abs(la - lb) / max(abs(lb), 1e-12)
        return loss, float((ga - gb).norm() / gb.norm().clamp_min(1e-12))

    loss_rel, grad_rel = rel("device", "cpu")
    packed_loss_rel, packed_grad_rel = rel("packed", "device")
    return {
        "loss_cpu": out["cpu"][0],
        "loss_device": out["device"][0],
        "loss_rel_diff": loss_rel,
        "grad_rel_diff": grad_rel,
        "packed_vs_padded_loss_rel_diff": packed_loss_rel,
        "packed_vs_padded_grad_rel_diff": packed_grad_rel,
    }


__all__ = ["add_arguments", "run"]
