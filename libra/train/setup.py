"""The phases before the loop (model, hardware profile, warm start, planner, trainer
config) and the summary after it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from libra.chat import ChatTokenizer
from libra.env import Env
from libra.errors import ConfigError
from libra.planner import (
    HardwareProfile,
    PlannerSettings,
    ReplanPolicy,
    RolloutSettings,
    calibrate_local,
    hardware_from_dict,
    hardware_to_dict,
    load_hardware,
    load_model,
)
from libra.train.config import TrainConfig
from libra.train.display import Display, View
from libra.train.planning import Assignment, FleetShape, Replanner, layouts
from libra.train.report import Report, read_rows
from libra.train.state import write_json


async def prepare_model(cfg: TrainConfig, out: Path) -> Path:
    """The starting model folder: `model.path`, or a tiny Qwen2 made in `out/base`."""
    if cfg.model.path is not None:
        path = Path(cfg.model.path)
        if not (path / "config.json").is_file():
            from libra.errors import ConfigError

            raise ConfigError(
                f"model.path {cfg.model.path!r} is not a model folder (no config.json)"
            )
        return path
    from libra.engine.model_maker import TinyQwen2, make_model

    m = cfg.model
    sizes = TinyQwen2(
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads,
        max_position_embeddings=m.max_position_embeddings,
    )
    return await asyncio.to_thread(
        make_model, out / "base", seed=cfg.model.seed, sizes=sizes, exist_ok=True
    )


async def calibrate(cfg: TrainConfig, out: Path, model_dir: Path, view: View) -> HardwareProfile:
    """The planner's hardware profile; `local` is measured once per run (kept for resumes)."""
    if cfg.planner.hardware != "local":
        return load_hardware(cfg.planner.hardware)
    saved = out / "hardware.json"
    if saved.is_file():
        return hardware_from_dict(json.loads(saved.read_text()), str(saved))
    view.phase, view.note = "calibrating the planner's `local` profile", ""
    m = load_model(str(model_dir))
    hw = await asyncio.to_thread(
        calibrate_local,
        devices=cfg.fleet.total,
        hidden=m.hidden,
        intermediate=m.intermediate or None,
        budget_s=0.2,
    )
    write_json(saved, hardware_to_dict(hw))
    return hw


async def warm_start_demos(
    cfg: TrainConfig, env: Env, tok: ChatTokenizer, tasks: Sequence[dict[str, Any]]
) -> list[Any]:
    """The warm start's demonstrations: `sft.demos` training tasks drawn with
    replacement, seeded by `model.seed`, played by the expert (those it is rewarded for)."""
    import random

    from libra.train.demos import demonstrations, load_expert

    rng = random.Random(cfg.model.seed)
    picked = [rng.choice(tasks) for _ in range(cfg.sft.demos)]
    expert = load_expert(cfg.sft.expert, cfg.data.env)
    return await demonstrations(env, cfg.data.env, tok, picked, expert)


async def warm_start(
    cfg: TrainConfig,
    out: Path,
    base: Path,
    env: Env,
    tok: ChatTokenizer,
    tasks: list[dict[str, Any]],
    view: View,
    display: Display,
    report: Report,
    should_stop: Callable[[], bool],
) -> tuple[Path, list[Any]]:
    """Demonstrations + SFT -> `out/sft` (or the base model when `sft.steps` is 0).
    Returns the folder GRPO starts from and the demonstrations (the first workload
    estimate of the planner)."""
    from libra.train.handle import no_sigint
    from libra.trainer.device import Device
    from libra.trainer.sft import SFTProgress
    from libra.trainer.sft import warm_start as warm_start_process

    s = cfg.sft
    if s.steps == 0:
        return base, []
    view.phase, view.note = "generating demonstrations", ""
    demos = await warm_start_demos(cfg, env, tok, tasks)
    report.event("demonstrations", count=len(demos), of=s.demos)
    view.phase = "warm start (supervised, on demonstrations)"
    display.line(
        "warm start: P(demo) is the chance the model generates a whole held-out "
        "demonstration at temperature 1, the product of every token's probability: it "
        "stays near 0.00 while the loss falls and rises only once most tokens are near-certain"
    )
    loop = asyncio.get_running_loop()

    def progress(p: SFTProgress) -> None:
        prob = "-" if p.seq_prob is None else f"{p.seq_prob:.2f}"
        stop = f" (stops at {s.target})" if s.target is not None else ""
        view.note = f"step {p.step}/{p.steps}  loss {p.loss:.3f}  P(demo) {prob}{stop}"
        loop.call_soon_threadsafe(display.draw, view)
        if display.mode == "lines" and p.step % 100 == 0:
            loop.call_soon_threadsafe(display.line, f"warm start: {view.note}")

    def fit() -> Any:  # in a trainer process (one torch thread); this thread relays progress
        return warm_start_process(
            base,
            demos,
            out / "sft",
            steps=s.steps,
            batch=s.batch,
            lr=s.lr,
            target=s.target,
            seed=cfg.model.seed,
            on_progress=progress,
            should_stop=should_stop,
            device=device,
        )

    # where the trainer trains; on CUDA its first GPU (the fleet has not started yet)
    tc = trainer_config(cfg, base)
    device = Device.resolve(tc, tc.gpus[0] if tc.gpus else None)

    # SIGINT blocked: a Ctrl-C reaches `libra train`, which stops the process itself
    res = await asyncio.to_thread(no_sigint(fit))
    report.event("warm-start", **dataclasses.asdict(res))
    display.line(
        f"warm start: {res.steps} steps, loss {res.loss:.3f}, P(demo) {res.seq_prob:.2f} "
        f"({res.stopped}), {res.wall_s:.0f} s"
    )
    if s.target is not None and res.stopped != "target":
        display.line(
            f"warm start: P(demo) {res.seq_prob:.2f} is short of sft.target {s.target} "
            f"after all {res.steps} steps: GRPO starts from a policy that is rarely right "
            "and may learn little (more sft.steps, or another model.seed, may get there)"
        )
    return Path(res.path), demos


def planner_settings(cfg: TrainConfig) -> PlannerSettings:
    s = cfg.planner.settings
    # the fleet's instances: embedded engines are TP 1, vLLM ones at their buckets' TP;
    # whole replicas per device (the trainer has no pipeline stages)
    tps = [1] if cfg.fleet.kind == "embedded" else sorted({b.tp for b in cfg.fleet.buckets})
    chunk = cfg.trainer.grpo.logprob_chunk_tokens or None
    return s.model_copy(
        update={
            "rollout": RolloutSettings(
                **{
                    **s.rollout.model_dump(),
                    "tp_sizes": tps,
                    "max_num_seqs": cfg.fleet.engine_max_num_seqs,
                }
            ),
            # what the trainer runs: log-probs in chunks (or whole, at 0); a reference
            # model only with a KL term; the old log-probs' pass only with several updates
            "train": s.train.model_copy(
                update={
                    "max_pp": 1,
                    "logprob_chunk_tokens": chunk,
                    "ref_model": cfg.trainer.grpo.kl_coef > 0,
                    "recompute_old_logprobs": cfg.trainer.grpo.minibatches > 1,
                    "mini_batches": cfg.trainer.grpo.minibatches,
                }
            ),
        }
    )


def fleet_shape(cfg: TrainConfig) -> FleetShape:
    """The fleet as the run's replanner sees it."""
    f = cfg.fleet
    # vLLM fleets whose buckets differ in TP size may also change the core layout
    # (instances per bucket, at least one each); embedded engines are TP 1 whatever the
    # bucket says
    names = [b.name for b in f.buckets]
    start = [sum(names[i % len(names)] == b for i in range(f.core_rollout)) for b in names]
    relayout = f.kind == "vllm" and len({b.tp for b in f.buckets}) > 1 and all(start)
    return FleetShape(
        f.core_rollout,
        f.core_train,
        f.hybrids,
        tp=f.buckets[0].tp if f.kind == "vllm" else 1,
        micro_batch_tokens=cfg.trainer.grpo.micro_batch_tokens,
        recompute=cfg.trainer.activation_checkpointing,
        buckets=tuple((b.name, b.tp) for b in f.buckets) if relayout else (),
        layout=tuple(start) if relayout else (),
        replica_ranks=cfg.trainer.elastic.replica_ranks,
    )


async def planning_demos(
    cfg: TrainConfig, env: Any, tok: Any, tasks: Sequence[dict[str, Any]]
) -> list[Any]:
    """A step's worth of the expert's demonstrations, for `fleet.hybrid_start = "plan"`
    when no warm start made any (`sft.steps = 0`, a shared warm-started model): the
    planner places the hybrids at start on their workload, as it does on the warm
    start's. None (an empty list: the hybrids start in rollout) when the env has no
    expert or it earns nothing."""
    import random

    from libra.train.demos import demonstrations, load_expert

    try:
        expert = load_expert(cfg.sft.expert, cfg.data.env)
    except ConfigError:
        return []
    rng = random.Random(cfg.model.seed)
    n = min(len(tasks), cfg.rollout.batch_groups * cfg.rollout.group_size)
    try:
        return await demonstrations(env, cfg.data.env, tok, rng.sample(list(tasks), n), expert)
    except ConfigError:
        return []


def make_replanner(cfg: TrainConfig, model_dir: Path, hw: HardwareProfile) -> Replanner | None:
    shape = fleet_shape(cfg)
    if shape.hybrids == 0 and len(layouts(shape)) < 2:
        return None
    model = load_model(cfg.model.profile or str(model_dir))
    return Replanner(
        shape,
        model,
        hw,
        planner_settings(cfg),
        ReplanPolicy(cfg.planner.replan),
        Assignment(0, shape.hybrids, shape.layout),
    )


def trainer_config(
    cfg: TrainConfig, model_dir: Path, gpus: dict[str, list[int]] | None = None
) -> Any:
    """The trainer's config for this run; `gpus`: worker -> the fleet GPUs its training
    replica takes (`libra.train.placement.trainer_gpus`), else the trainer takes
    `trainer.gpus`."""
    from libra.train.placement import trainer_device
    from libra.trainer import TrainerConfig

    t = cfg.trainer
    grpo = t.grpo.model_copy(
        update={
            # the importance ratio compares the distribution that was sampled
            "temperature": cfg.rollout.sampling.temperature,
            "max_staleness": cfg.rollout.max_staleness,  # enforced at admission; a check here
        }
    )
    return TrainerConfig(
        model=str(model_dir),
        dtype=t.dtype,
        device=trainer_device(cfg),
        gpus=t.gpus if gpus is None else sorted(g for gs in gpus.values() for g in gs),
        seed=cfg.seed,
        activation_checkpointing=t.activation_checkpointing,
        grpo=grpo,
        optim=t.optim,
        elastic=t.elastic,
    )


def summarize(
    cfg: TrainConfig, out: Path, outcome: str, wall_s: float, cpu_s: float, plots: list[Path]
) -> dict[str, Any]:
    rows = read_rows(out / "metrics.jsonl")
    decisions = read_rows(out / "decisions.jsonl")
    events = read_rows(out / "events.jsonl")
    n = len(rows)
    k = max(1, n // 5)

    def mean(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    first, last = mean([r["reward"] for r in rows[:k]]), mean([r["reward"] for r in rows[-k:]])
    vals = [e for e in events if e.get("event") == "validation"]
    applied = [d for d in decisions if d.get("apply") and d.get("trigger") != "initial"]
    return {
        "outcome": outcome,
        "out": str(out),
        "steps": rows[-1]["step"] if rows else 0,
        "reward_first_20pct": first,
        "reward_last_20pct": last,
        "reward_gain": None if first is None or last is None else last - first,
        "val_first": vals[0]["reward"] if vals else None,
        "val_last": vals[-1]["reward"] if vals else None,
        "val_last_version": vals[-1]["version"] if vals else None,
        "switches": sum(e.get("event") == "switch-done" for e in events),
        "decisions": len(decisions),
        "applied_decisions": [
            {
                k: d.get(k)
                for k in ("step", "trigger", "predicted_gain_s", "reconfig_cost_s", "reason")
            }
            for d in applied
        ],
        "wall_s": wall_s,
        "cpu_s": cpu_s,
        "checkpoint": str(out / "checkpoint") if (out / "checkpoint").is_dir() else None,
        "model": str(out / "model") if (out / "model").is_dir() else None,
        "plots": [str(p) for p in plots],
    }


__all__ = [
    "calibrate",
    "make_replanner",
    "planner_settings",
    "prepare_model",
    "summarize",
    "trainer_config",
    "warm_start",
    "warm_start_demos",
]
