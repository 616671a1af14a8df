"""Workload generators: causal agentic episodes as trajectory records.

    from libra.sim import workloads
    batch = workloads.sample("search-r1", n_prompts=32, group=16, step=0, seed=0)

`sample` returns one training step's batch: `n_prompts` dataset prompts (walked epoch by
epoch in a seeded order), `group` episodes each, as `libra.record.Trajectory` records
(DESIGN.md schema; token-id lists empty, buckets and endpoints blank, `timings.tool_s`
filled). Per turn the records carry what a simulator needs to replay an episode
causally: `model_tokens`, `tool_tokens`, and each tool return's status, payload and
latency. Same arguments, same records.

Names: `search-r1`, `r2e-gym`, `dapo-math`, `search-r1-causal` (docs/workloads.md).
`params` overrides fields of the workload's
`WorkloadSpec` (e.g. `{"dataset_size": 512}` for a multi-epoch run on a subset).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from libra.errors import ConfigError
from libra.record import Trajectory
from libra.sim.workloads.dapo_math import DAPO_MATH
from libra.sim.workloads.generator import episode_data, make_task, step_tasks
from libra.sim.workloads.r2e_gym import R2E_GYM
from libra.sim.workloads.search_r1 import SEARCH_R1
from libra.sim.workloads.search_r1_causal import SEARCH_R1_CAUSAL
from libra.sim.workloads.spec import TaskClass, ToolSpec, WorkloadSpec

WORKLOADS: dict[str, WorkloadSpec] = {
    s.name: s for s in (SEARCH_R1, R2E_GYM, DAPO_MATH, SEARCH_R1_CAUSAL)
}


def spec(name: str, params: Mapping[str, Any] | None = None) -> WorkloadSpec:
    """The named workload's spec, with `params` overriding its fields."""
    try:
        base = WORKLOADS[name]
    except KeyError:
        known = ", ".join(WORKLOADS)
        raise ConfigError(f"unknown workload {name!r}; known: {known}") from None
    if not params:
        return base
    for key, value in params.items():
        if not hasattr(base, key):
            fields = ", ".join(f.name for f in dataclasses.fields(base))
            raise ConfigError(f"workload {name!r} has no field {key!r}; fields: {fields}")
        old = getattr(base, key)
        # an int field takes an int; a float field any number
        numeric = isinstance(old, float) and isinstance(value, int | float)
        if not numeric and not isinstance(value, type(old)):
            raise ConfigError(
                f"workload {name!r}: {key} must be of type {type(old).__name__} (got {value!r})"
            )
    out = base.replace(**dict(params))
    for key, value in params.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if key in ("dataset_size", "max_context", "max_turns") and value < 1:
            raise ConfigError(f"workload {name!r}: {key} must be at least 1 (got {value!r})")
        if key.startswith("p_") and not 0 <= value <= 1:
            raise ConfigError(f"workload {name!r}: {key} is a probability, in [0, 1] "
                              f"(got {value!r})")  # fmt: skip
        if (value < 0 and not key.startswith("drift")) or value != value:  # noqa: PLR0124 - NaN
            raise ConfigError(f"workload {name!r}: {key} must be a number >= 0 (got {value!r})")
        if abs(value) == math.inf:  # an OverflowError traceback from the generator
            raise ConfigError(f"workload {name!r}: {key} must be finite (got {value!r})")
    return out


def sample(
    name: str,
    n_prompts: int,
    group: int,
    *,
    step: int = 0,
    seed: int = 0,
    params: Mapping[str, Any] | None = None,
) -> list[Trajectory]:
    """One step's batch of `n_prompts` x `group` episodes of workload `name`.

    Records come grouped by prompt (`group_id`), `seq` numbering them in order.
    """
    return [
        Trajectory.model_validate(d)
        for d in sample_data(name, n_prompts, group, step=step, seed=seed, params=params)
    ]


def sample_data(
    name: str,
    n_prompts: int,
    group: int,
    *,
    step: int = 0,
    seed: int = 0,
    params: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """`sample` as plain record data, not validated (the simulator's fast path)."""
    if n_prompts < 1 or group < 1:
        raise ConfigError(f"n_prompts and group must be >= 1 (got {n_prompts}, {group})")
    if step < 0:
        raise ConfigError(f"step must be >= 0 (got {step})")
    s = spec(name, params)
    out: list[dict[str, Any]] = []
    try:
        for index in step_tasks(s, n_prompts, step, seed):
            task = make_task(s, seed, index)
            group_id = f"{s.name}/step-{step}/{index}"
            for k in range(group):
                rec = episode_data(s, task, step=step, seed=seed, sample=k, group_id=group_id)
                rec["seq"] = len(out)
                out.append(rec)
    except OverflowError:  # a finite parameter past what its distribution can draw
        given = dict(params or {})
        raise ConfigError(f"workload {name!r}: a parameter is too large to draw lengths "
                          f"from ({given}); use values near the defaults") from None  # fmt: skip
    return out


__all__ = ["WORKLOADS", "TaskClass", "ToolSpec", "WorkloadSpec", "sample", "sample_data", "spec"]
