"""`simulate(config, systems)`: build the shared workload once, run every system on it.

Systems are independent given the workload, so with `jobs > 1` they run in forked worker
processes (the workload is generated before the fork and shared copy-on-write); results
do not depend on `jobs`.
"""

from __future__ import annotations

import ctypes
import gc
import os
import platform
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from libra.errors import ConfigError
from libra.planner import load_hardware, load_model
from libra.sim import search
from libra.sim.config import SimConfig
from libra.sim.episodes import Workload
from libra.sim.layout import Env, Layout
from libra.sim.systems import BASELINES, SystemSpec

_SHARED: dict[str, Env] = {}
"""The environment forked workers share (set while a pool runs)."""


def build_env(cfg: SimConfig) -> Env:
    """Profiles and the workload of a run (the expensive part shared by all systems)."""
    if cfg.hardware == "local":
        raise ConfigError(
            "--hardware local describes this machine; the simulator models clusters: "
            "pass a profile id (a800-80g, h100-80g, h200-141g, ascend-910b3) or a .toml"
        )
    model, hw = load_model(cfg.model), load_hardware(cfg.hardware)
    path = Path(cfg.workload)
    if cfg.workload.endswith((".jsonl", ".jsonl.gz")) or path.is_file():
        wl = Workload.from_trace(path, cfg.steps)
    else:
        from libra.sim import workloads

        if cfg.workload not in workloads.WORKLOADS:
            known = ", ".join(workloads.WORKLOADS)
            raise ConfigError(
                f"unknown workload {cfg.workload!r}; known: {known} (or a TRACE.jsonl file)"
            )
        wl = Workload.generate(
            cfg.workload, cfg.steps, cfg.prompts_for(cfg.workload), cfg.group, cfg.seed
        )
    return Env(cfg, model, hw, wl)


def run_system(spec: SystemSpec, env: Env) -> dict[str, Any]:
    """Simulate one system; its result with the CPU and wall time the simulation took.
    A system that cannot run on this cluster (its layout cannot train the model, or a
    batch outgrows every training configuration it may use) gives `{"system", "summary",
    "error"}`: the others still run, and one that cannot is no bar to compare with."""
    from libra.sim.cluster import Simulation
    from libra.sim.metrics import summarize

    c0, w0 = time.process_time(), time.perf_counter()
    try:
        sim = Simulation(spec, env)
        sim.run()
    except ConfigError as e:
        return {"system": spec.name, "summary": spec.summary, "error": str(e)}
    return summarize(sim, time.process_time() - c0, time.perf_counter() - w0)


def ran(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The results of the systems that ran (not those that could not: `run_system`)."""
    return [r for r in results if "error" not in r]


def keep_freed_memory() -> None:
    """Have glibc keep freed memory for reuse instead of handing it back to the kernel
    at once. The planner's numpy temporaries are large enough to be mmap-ed and unmapped
    on every call, so a replanning system faulted in ~150,000-300,000 fresh pages (10-20%
    of its CPU time). For a process that only simulates (`libra simulate` calls it): it
    changes how the whole process allocates, for good; results are the same either way."""
    if platform.libc_ver()[0] != "glibc":
        return
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    mallopt(m_mmap_threshold, 64 << 20)
    mallopt(m_trim_threshold, 256 << 20)
    mallopt(m_top_pad, 64 << 20)


def _worker(spec: SystemSpec) -> dict[str, Any]:
    return run_system(spec, _SHARED["env"])


def _shared_plans(cfg: SimConfig, systems: Sequence[SystemSpec], jobs: int) -> list[list[int]]:
    """Steps whose heterogeneous plan to compute before the systems fork, split into
    `jobs` interleaved shares; none unless several replanning systems need them.

    Plans depend only on the step's batch, so `Env.planned` memoises them, but a forked
    worker's memo stays in that worker: Libra's ladder rungs would each plan every step
    again. Replanning asks for step s after step s (s < steps - 1), and the first layout
    for step 0."""
    users = sum(1 for s in systems if s.replan and s.hetero)
    if jobs < 2 or users < 2:
        return []
    steps = list(range(max(1, cfg.steps - 1)))
    return [steps[i::jobs] for i in range(jobs)]


def _plan_worker(steps: list[int]) -> list[tuple[int, Layout]]:
    env, out = _SHARED["env"], []
    for s in steps:
        try:
            out.append((s, env.planned(env.stats(s), hetero=True, step=s)))
        except ConfigError:  # the system that needs it reports it
            continue
    return out


def simulate(
    cfg: SimConfig,
    systems: Sequence[SystemSpec],
    *,
    jobs: int = 1,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every system of `systems` on the workload of `cfg`."""
    say = progress or (lambda msg: None)
    c0, w0 = time.process_time(), time.perf_counter()
    results: list[dict[str, Any]] = []
    jobs = max(1, min(jobs, len(systems)))
    # The workload's records are long-lived and neither they nor the simulation make
    # reference cycles worth collecting: keep the collector from scanning them as they
    # are made (a third of the setup's time) and from rescanning them (full
    # collections over ~10^6 objects otherwise cost more than the simulation).
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        env = build_env(cfg)
        for step in range(cfg.steps):  # once here, not once per system (workers fork after)
            env.stats(step)
        setup = {"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - w0}
        say(f"workload {env.workload.name}: {cfg.steps} steps ready ({setup['wall_s']:.1f} s)")
        searches = _search(env, systems)  # before the fork: the systems share them
        if searches:
            pilots = sum(s["pilots"] for s in searches.values())
            took = time.perf_counter() - w0 - setup["wall_s"]
            say(
                f"static layouts: {pilots} pilots of {search.pilot_steps(env)} steps ({took:.1f} s)"
            )
        gc.freeze()
        if jobs == 1:
            for spec in systems:
                results.append(run_system(spec, env))
                say(_line(results[-1]))
        else:
            _SHARED["env"] = env
            shares = _shared_plans(cfg, systems, jobs)
            if shares:
                with ProcessPoolExecutor(jobs, mp_context=get_context("fork")) as pool:
                    for got in pool.map(_plan_worker, shares):
                        for s, layout in got:
                            env.remember(s, True, layout)
            # Longest first (C-MLFQ's learning dominates; then replanning), so the
            # workers finish together.
            order = sorted(systems, key=lambda s: (s.routing != "cmlfq", not s.replan))
            with ProcessPoolExecutor(jobs, mp_context=get_context("fork")) as pool:
                futures = {s.name: pool.submit(_worker, s) for s in order}
                for fut in as_completed(futures.values()):
                    say(_line(fut.result()))
                results = [futures[s.name].result() for s in systems]
    finally:
        _SHARED.clear()
        if was_enabled:
            gc.enable()
        gc.unfreeze()
    child = os.times()
    return {
        "config": cfg.model_dump(mode="json"),
        "workload": {
            "name": env.workload.name,
            "episodes_per_step": len(env.workload.batch(0)),
            **env.initial.summary(),
        },
        "systems": results,
        "static_search": searches,
        "headroom": headroom(results),
        "timing": {
            "setup_cpu_s": round(setup["cpu_s"], 3),
            "cpu_s": round(
                time.process_time() - c0 + child.children_user + child.children_system, 3
            ),
            "wall_s": round(time.perf_counter() - w0, 3),
            "jobs": jobs,
        },
    }


def _search(env: Env, systems: Sequence[SystemSpec]) -> dict[str, Any]:
    """The static layouts the systems of `systems` take from pilot runs, found once."""
    for s in systems:  # the `@tpN` variants search among their TP size only
        try:
            if s.split in ("searched", "colocated-searched"):
                search.best_static(env, colocated=s.split != "searched", tp=s.rollout_tp)
            if s.split == "ceiling":
                search.best_static(env, colocated=False)
                search.best_static(env, colocated=True)
                search.ceiling(env)
        except ConfigError:
            continue  # no such layout serves this cluster: the system reports it
    return {kind: found.describe() for kind, found in env.searched.items()}


def headroom(results: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Libra against the best baseline and the ceiling (when the run has all three):
    `captured` = (libra - best baseline) / (ceiling - best baseline) in throughput, None
    when the ceiling is not above the best baseline (no headroom to capture)."""
    by = {r["system"]: r["throughput"] for r in ran(results)}
    bases = {n: by[n] for n in BASELINES if n in by}
    if "libra" not in by or "ceiling" not in by or not bases:
        return None
    best = max(bases, key=lambda n: (bases[n], n))
    lib, top, bar = by["libra"], by["ceiling"], bases[best]
    return {
        "best_baseline": best,
        "libra_over_best_baseline": round(lib / bar, 4),
        "ceiling_over_best_baseline": round(top / bar, 4),
        "captured": round((lib - bar) / (top - bar), 4) if top > bar else None,
    }


def _line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"  {r['system']}: cannot run: {r['error']}"
    return (
        f"  {r['system']}: {r['throughput']:,.0f} token/s, {r['time_s']:,.0f} s "
        f"(simulated in {r['sim']['cpu_s']:.1f} s CPU)"
    )


__all__ = ["build_env", "headroom", "keep_freed_memory", "ran", "run_system", "simulate"]
