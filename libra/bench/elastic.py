"""Elastic: how much the core's step stalls when a hybrid replica joins and leaves live.

Spawns `--core` core replicas and one hybrid replica (one process each, gloo on loopback,
one torch thread per process) training GRPO on synthetic records with a fixed Qwen2
model whose parameters + Adam moments make a ~256 MB snapshot. Each update trains one
global batch split over the replicas that are current, so the work per update does not
depend on membership. The hybrid runs `--cycles` times: register, get admitted, receive
the snapshot in the background while contributing zeros, replay, train, leave, idle.

Per cycle, from the coordinator's (core replica 0's) own step times:
- join window: from the update that admits the hybrid through its first real gradient;
  leave window: the update carrying its leave flag and the next (the epoch switch);
- `join_stall_ratio` / `leave_stall_ratio`: the window's slowest core step divided by the
  median core step outside all windows (the worst cycle is reported, and the median
  cycle as `*_median`; goal <= 1.3);
  `*_same_members`: each window step against the median steady step with the same
  number of members (separates the join's own cost from the cost of one more replica
  in the all-reduce, and from a third process sharing this machine's cores);
- `steady_window_ratio`: the same statistic for windows without any membership change
  (the median, over every run of consecutive steady updates as long as the median join
  window, of its slowest step / the median step): what the stall ratios would read if
  joining cost nothing, i.e. this machine's step-time noise;
- `join_latency_s`: registration to the update after which it contributes real gradients
  (median over cycles);
- `hash_mismatches`: updates at which replicas' parameter + optimizer hashes differ
  (every `--hash-every` updates, so at least once per cycle while the hybrid trains;
  `hash_checks` counts the updates compared; mismatches must be 0).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from libra.cli.common import count


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--core", type=count, default=2, help="core replicas (default 2)")
    p.add_argument("--cycles", type=count, default=3, help="join/leave cycles (default 3)")
    p.add_argument("--global-samples", type=count, default=6, help="samples per update (6)")
    p.add_argument("--prompt-len", type=count, default=4, help="prompt tokens (4)")
    p.add_argument("--response-len", type=count, default=12, help="response tokens (12)")
    p.add_argument("--hidden", type=count, default=512, help="model width (512)")
    p.add_argument("--layers", type=count, default=7, help="decoder layers (7)")
    p.add_argument("--intermediate", type=count, default=1458, help="MLP width (1458)")
    p.add_argument("--baseline", type=int, default=12, help="core updates before the first join")
    p.add_argument("--ready-updates", type=int, default=12, help="hybrid trains this many")
    p.add_argument("--idle-updates", type=int, default=8, help="core updates between cycles")
    p.add_argument("--hash-every", type=int, default=10, help="hash state every N updates")
    p.add_argument("--snapshot-rate", type=float, help="cap the snapshot stream (MB/s)")
    p.add_argument("--timeout", type=float, default=120.0, help="gloo timeout (s)")
    p.add_argument("--keep", metavar="DIR", help="write the model and logs here and keep them")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="trainer.device of every member (cuda: all on GPU 0; the elastic "
                   "domain is gloo over host memory either way)")  # fmt: skip


def _model(folder: Path, args: argparse.Namespace) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=4096, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(folder)
    return folder


def run(args: argparse.Namespace) -> dict[str, Any]:
    from libra.errors import ConfigError

    if args.global_samples < args.core + 1:
        raise ConfigError(
            f"--global-samples {args.global_samples} cannot give each of {args.core + 1} "
            "replicas a sample; raise it"
        )
    if args.keep:
        root = Path(args.keep)
        root.mkdir(parents=True, exist_ok=True)
        return _run_in(args, root)
    with tempfile.TemporaryDirectory(prefix="libra-bench-elastic-") as tmp:
        return _run_in(args, Path(tmp))


def _run_in(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """The scenario with its model and member logs under `root`."""
    from libra.cli.common import progress
    from libra.trainer.config import TrainerConfig
    from libra.trainer.rendezvous import host_store
    from libra.trainer.scenario import MemberPlan, run_scenario

    progress("writing the model ...")
    model = _model(root / "model", args)
    cfg = TrainerConfig(
        model=str(model),
        device=args.device,
        elastic={"timeout_s": args.timeout, "snapshot_rate_mb_s": args.snapshot_rate},
        grpo={"micro_batch_tokens": 1 << 20},
    ).model_dump_json()
    store = host_store()
    core = [f"core{i}" for i in range(args.core)]
    common: dict[str, Any] = {
        "core_ids": core, "config": cfg, "port": store.port, "size": 1,
        "global_samples": args.global_samples, "prompt_len": args.prompt_len,
        "response_len": (args.response_len, args.response_len), "vocab": 4096,
        "hash_every": args.hash_every,
        # a bound if a cycle never completes (the analysis then says so)
        "max_updates": args.baseline + args.cycles * (args.ready_updates + args.idle_updates + 60),
    }  # fmt: skip
    plans = [MemberPlan(id=c, kind="core", rank=0, log=str(root / f"{c}.jsonl"), **common)
             for c in core]  # fmt: skip
    plans.append(MemberPlan(
        id="hybrid", kind="hybrid", rank=0, log=str(root / "hybrid.jsonl"), cycles=args.cycles,
        ready_updates=args.ready_updates, idle_updates=args.idle_updates,
        start_after=args.baseline, stop_margin=args.idle_updates, scramble=True, **common,
    ))  # fmt: skip
    progress(f"running {args.core} core replicas + 1 hybrid ({args.cycles} cycles) ...")
    t0 = time.perf_counter()
    previous = signal.signal(signal.SIGTERM, _exit)  # so the member processes get reaped
    try:
        logs = run_scenario(plans, timeout=3600)
    finally:
        signal.signal(signal.SIGTERM, previous)
    out = analyse(logs, core[0], args)
    snap = _snapshot_bytes(model)
    out = {"snapshot_mb": round(snap / 1e6, 1), "snapshot_mib": round(snap / 2**20, 1), **out}
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    out["config"] = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "json"}
    return out


def _exit(*_: Any) -> None:
    raise SystemExit(143)


def _snapshot_bytes(model: Path) -> int:
    """Parameters + both Adam moments, float32: 3 x 4 bytes per parameter."""
    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), "pt") as f:
        params = sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118
    return 12 * params


def _prod(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def analyse(logs: dict[str, list[dict]], coordinator: str, args: argparse.Namespace) -> dict:
    from libra.errors import LibraError

    core = {r["update"]: r for r in logs[f"{coordinator}-0"]}
    hybrid = logs["hybrid-0"]
    step_ms = {u: r["timings"]["total_s"] * 1e3 for u, r in core.items()}
    windows: list[dict] = []
    excluded: set[int] = set(range(1, 4))  # warm-up
    for c in range(args.cycles):
        rows = [r for r in hybrid if r.get("cycle") == c]
        gone = next((r for r in rows if r["left"]), None)
        if gone is None:
            raise LibraError(f"join/leave cycle {c} did not complete within the update budget")
        ready = next((r for r in rows if r["became_ready"]), None)
        if ready is None:
            raise LibraError(f"join/leave cycle {c}: the hybrid left before catching up: "
                             f"{gone.get('reason')}")  # fmt: skip
        first = rows[0]["update"]
        real = next((r["update"] for r in rows if r["contributed"]), ready["update"] + 1)
        left = next(r["update"] for r in rows if r["left"])
        join = list(range(first - 1, real + 1))
        leave = [left, left + 1]
        excluded |= set(join) | set(leave)
        windows.append({
            "join": join, "leave": leave, "join_latency_s": ready["since_register_s"],
            "join_updates": real - first, "snapshot_received_updates": ready["update"] - first,
        })  # fmt: skip
    hashed: dict[int, set[str]] = {}
    for rows in logs.values():
        for r in rows:
            if "hash" in r:
                hashed.setdefault(r["update"], set()).add(r["hash"])
                excluded.add(r["update"] + 1)  # hashing 256 MB delays the next update
    steady = [ms for u, ms in step_ms.items() if u not in excluded]
    median = statistics.median(steady)
    by_members: dict[int, list[float]] = {}
    for u, ms in step_ms.items():
        if u not in excluded:
            by_members.setdefault(len(core[u]["members"]), []).append(ms)
    same = {k: statistics.median(v) for k, v in by_members.items()}
    span = round(statistics.median(len(w["join"]) for w in windows))
    runs = [
        max(step_ms[v] for v in range(u, u + span)) / median
        for u in step_ms
        if all(v in step_ms and v not in excluded for v in range(u, u + span))
    ]

    def vs_same(us: list[int]) -> float:
        """Worst step of the window against steady steps of the same membership size."""
        return max(step_ms[u] / same.get(len(core[u]["members"]), median) for u in us)

    cycles = []
    for w in windows:
        w["join"] = [u for u in w["join"] if u in step_ms]
        w["leave"] = [u for u in w["leave"] if u in step_ms]
        js = [step_ms[u] for u in w["join"]]
        ls = [step_ms[u] for u in w["leave"]]
        stall = {k: sum(core[u]["timings"].get(k, 0.0) for u in w["join"] + w["leave"])
                 for k in ("wait_group_s", "wait_copy_s")}  # fmt: skip
        cycles.append({
            "join_stall_ratio": round(max(js) / median, 3),
            "leave_stall_ratio": round(max(ls) / median, 3),
            "join_stall_ratio_same_members": round(vs_same(w["join"]), 3),
            "leave_stall_ratio_same_members": round(vs_same(w["leave"]), 3),
            "join_window_ms": [round(x, 1) for x in js],
            "leave_window_ms": [round(x, 1) for x in ls],
            "join_latency_s": round(w["join_latency_s"], 3),
            "join_updates": w["join_updates"],
            "core_wait_group_ms": round(stall["wait_group_s"] * 1e3, 1),
            "core_wait_copy_ms": round(stall["wait_copy_s"] * 1e3, 1),
        })  # fmt: skip
    counts: dict[int, int] = {}
    for rows in logs.values():
        for r in rows:
            if "hash" in r:
                counts[r["update"]] = counts.get(r["update"], 0) + 1
    return {
        "median_step_ms": round(median, 1),
        "median_step_ms_by_members": {
            str(k): round(statistics.median(v), 1) for k, v in sorted(by_members.items())
        },
        "join_stall_ratio": max(c["join_stall_ratio"] for c in cycles),
        "leave_stall_ratio": max(c["leave_stall_ratio"] for c in cycles),
        "join_stall_ratio_median": round(
            statistics.median(c["join_stall_ratio"] for c in cycles), 3
        ),
        "leave_stall_ratio_median": round(
            statistics.median(c["leave_stall_ratio"] for c in cycles), 3
        ),
        "join_stall_ratio_same_members": max(c["join_stall_ratio_same_members"] for c in cycles),
        "leave_stall_ratio_same_members": max(c["leave_stall_ratio_same_members"] for c in cycles),
        "steady_window_ratio": round(statistics.median(runs), 3) if runs else None,
        "join_latency_s": round(statistics.median(c["join_latency_s"] for c in cycles), 3),
        "hash_mismatches": sum(len(h) > 1 for h in hashed.values()),
        "hash_checks": sum(n > 1 for n in counts.values()),
        "cycles": cycles,
        "updates": len(core),
    }
