"""The global resource planner and its cost model: pure code shared by `libra plan`,
`libra train` and the simulator (no I/O beyond reading profile data files; no asyncio).

    from libra.planner import load_model, load_hardware, WorkloadStats, plan
    p = plan(load_model("qwen3-14b"), load_hardware("a800-80g"),
             WorkloadStats.from_records(records), gpus=48)
    p.t_iter, p.train.config, p.rollout.groups

Cost model (docs/cost-model.md): `decode_step_time`, `prefill_time`,
`kv_capacity_tokens`, `instance_cost` (vectorised per-step constants),
`train_step_time`, `train_memory`. Search (docs/planner.md): `plan`, `plan_colocated`,
`solve_rollout`, `evaluate_rollout`, `best_train`, `evaluate_plan`. Replanning: `ReplanPolicy`,
`reconfig_cost`. The `local` profile: `calibrate_local` (the one function that measures).
"""

from libra.planner.calibrate import calibrate_local
from libra.planner.evaluate import (
    best_train,
    evaluate_plan,
    evaluate_rollout,
    evaluate_train,
    solve_rollout,
    time_config,
)
from libra.planner.profiles import (
    Efficiency,
    HardwareProfile,
    ModelProfile,
    hardware_from_dict,
    hardware_to_dict,
    known_hardware,
    known_models,
    load_hardware,
    load_model,
)
from libra.planner.replan import (
    Decision,
    ReconfigCost,
    ReplanConfig,
    ReplanPolicy,
    Signals,
    reconfig_cost,
)
from libra.planner.rollout_cost import (
    InstanceCost,
    decode_step_time,
    instance_cost,
    kv_bytes_per_token_per_gpu,
    kv_capacity_tokens,
    kv_heads_per_gpu,
    prefill_time,
    tp_supported,
)
from libra.planner.rollout_search import RolloutGroup, RolloutPlan
from libra.planner.search import (
    Plan,
    PlanInfeasible,
    iteration_time,
    plan,
    plan_colocated,
    weight_sync_time,
)
from libra.planner.settings import PlannerSettings, RolloutSettings, TrainSettings
from libra.planner.train_cost import (
    TrainConfig,
    TrainCost,
    TrainWorkload,
    train_memory,
    train_step_time,
)
from libra.planner.workload import WorkloadStats

__all__ = [
    "Decision",
    "Efficiency",
    "HardwareProfile",
    "InstanceCost",
    "ModelProfile",
    "Plan",
    "PlanInfeasible",
    "PlannerSettings",
    "ReconfigCost",
    "ReplanConfig",
    "ReplanPolicy",
    "RolloutGroup",
    "RolloutPlan",
    "RolloutSettings",
    "Signals",
    "TrainConfig",
    "TrainCost",
    "TrainSettings",
    "TrainWorkload",
    "WorkloadStats",
    "best_train",
    "calibrate_local",
    "decode_step_time",
    "evaluate_plan",
    "evaluate_rollout",
    "evaluate_train",
    "hardware_from_dict",
    "hardware_to_dict",
    "instance_cost",
    "iteration_time",
    "known_hardware",
    "known_models",
    "kv_bytes_per_token_per_gpu",
    "kv_capacity_tokens",
    "kv_heads_per_gpu",
    "load_hardware",
    "load_model",
    "plan",
    "plan_colocated",
    "prefill_time",
    "reconfig_cost",
    "solve_rollout",
    "time_config",
    "tp_supported",
    "train_memory",
    "train_step_time",
    "weight_sync_time",
]
